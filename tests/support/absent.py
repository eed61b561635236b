"""Code run as if some packages were not installed (a subprocess's prelude).

:func:`blocker` returns Python source that installs a ``sys.meta_path`` finder refusing
the named packages and their submodules with the ``ModuleNotFoundError`` an absent
package gives.  The tests of optional extras (OpenTelemetry, prometheus_client) run
their child's code after it; ``tests/support/notorch.py`` does the same for torch
through a ``sitecustomize`` (so that spawned grandchildren inherit it)."""

from __future__ import annotations

import textwrap


def blocker(*packages: str) -> str:
    """Source refusing ``packages`` (top-level names) from the next import on."""
    return textwrap.dedent(
        f"""
        import importlib.abc, sys

        class _Absent(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in {tuple(packages)!r}:
                    raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
                return None

        sys.meta_path.insert(0, _Absent())
        """
    )
