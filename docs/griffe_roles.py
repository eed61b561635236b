"""A griffe extension for the reference: ringwire's docstrings use reST roles.

The docstrings are prose written for ``help()`` and IDEs, with Sphinx roles
(``:class:`Channel```, ``:func:`~ringwire.subscribe```) and reST literal blocks (a
paragraph ending in ``::``).  Markdown has neither: each role becomes a code span of the
name as written (a ``~`` prefix shortened to the last component, as Sphinx shows it),
and ``::`` at the end of a paragraph becomes ``:``, so that the indented block under it
renders as code.  Docstrings are never changed in the source, only in what the site shows.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|mod|data|exc|obj|const):`(~?)([^`]+)`")


def _role(match: re.Match[str]) -> str:
    short, name = match.group(1), match.group(2)
    if short:
        name = name.rsplit(".", 1)[-1]
    return f"`{name}`"


def rewrite(text: str) -> str:
    """Return ``text`` with reST roles as code spans and ``::`` literal markers as ``:``."""
    text = _ROLE.sub(_role, text)
    return re.sub(r"::\n", ":\n", text)


class ReSTRolesToCode(griffe.Extension):
    """Rewrite every docstring of every object griffe loads (see the module header)."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = rewrite(obj.docstring.value)
