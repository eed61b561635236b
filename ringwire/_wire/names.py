"""Shared-memory segment names: ``/rw.<pid>.<12 hex digits>``.

At most 31 characters (the macOS limit), unguessable (48 random bits from
:mod:`secrets`), and carrying the creator's pid, so a sweep can remove the names of
creators that are gone and a listener can refuse segments a client did not make.
Pure string arithmetic: the segments themselves are in :mod:`ringwire._pool.segment`.
"""

from __future__ import annotations

import os
import re
import secrets

__all__ = ["is_memfd_label", "is_segment_name", "name_pid", "new_segment_name"]

_NAME_RE = re.compile(r"^/rw\.([1-9][0-9]{0,9})\.[0-9a-f]{12}$")


def new_segment_name() -> str:
    """A fresh ``/rw.<pid>.<12 hex>`` name."""
    return f"/rw.{os.getpid()}.{secrets.token_hex(6)}"


def is_segment_name(name: str) -> bool:
    """Is ``name`` a ringwire segment name (``/rw.<pid>.<12 hex>``)?"""
    return isinstance(name, str) and _NAME_RE.match(name) is not None


_LABEL_RE = re.compile(r"^memfd:rw\.([1-9][0-9]{0,9})\.[0-9a-f]{12}$")


def is_memfd_label(name: str) -> bool:
    """Is ``name`` a memory file's label (``memfd:rw.<pid>.<12 hex>``)?  It names
    nothing: a memory file travels as a descriptor, and the label only shows up in
    ``/proc/<pid>/maps`` (``/memfd:rw.… (deleted)``) for ``python -m ringwire inspect``."""
    return isinstance(name, str) and _LABEL_RE.match(name) is not None


def name_pid(name: str) -> int:
    """The creator pid embedded in a segment name or a memory file's label."""
    m = _NAME_RE.match(name) or _LABEL_RE.match(name)
    if m is None:
        raise ValueError(f"not a ringwire segment name: {name!r}")
    return int(m.group(1))
