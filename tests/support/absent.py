"""Code run as if some packages were not installed (a subprocess's prelude).

:func:`blocker` returns Python source that installs a ``sys.meta_path`` finder refusing
the named packages and their submodules with the ``ModuleNotFoundError`` an absent
package gives.  The tests of optional extras (OpenTelemetry, prometheus_client) run
their child's code after it; ``tests/support/notorch.py`` does the same for torch
through a ``sitecustomize`` (so that spawned grandchildren inherit it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Any


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


def run_json(source: str, timeout: float = 60) -> Any:
    """Run ``source`` in a fresh interpreter (with this one's ``sys.path``) and return
    what the last line it printed holds, as JSON.  Fails the test (with the child's
    stderr) if it did not exit 0."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run(
        [sys.executable, "-c", source], capture_output=True, text=True, timeout=timeout, env=env
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])
