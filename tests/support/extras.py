"""The optional extras, for tests that need one: the suite runs without any of them.

ringwire's own dependencies are msgspec, numpy, posix_ipc, anyio and rich; torch (the
``[torch]`` extra), pyzmq (``[net]``), nixl-cu12 (``[nixl]``) and the test tools of
``[test]`` that install only on some Pythons (atheris) may be absent.  A test that needs
one skips, with the reason, where it is absent, and runs where it is present: CI runs
the suite with torch and, on another venv, without it (``.ci/run``).

* A module whose every test needs the extra: ``pytest.importorskip("zmq")`` at its top.
* A module with a few such tests among many that need only numpy: import the extra from
  here (``torch`` is ``None`` where it is absent), mark those tests ``@needs_torch``, and
  build module-level parameters that need it with :func:`torch_params`.
* A test of an error that a process without torch reports differently (it cannot check
  a torch dtype name): ``pytest.raises(..., match=torch_error("..."))``, so that the
  message is asserted both ways.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

try:
    import torch
except ModuleNotFoundError:  # the [torch] extra is not installed: the torch tests skip
    torch = None  # type: ignore[assignment]

NO_TORCH = "torch is not installed (pip install 'ringwire[torch]')"

needs_torch = pytest.mark.skipif(torch is None, reason=NO_TORCH)

# What ringwire says where a message needs torch (a tensor, a torch leaf, a torch dtype
# name in a descriptor: checking one needs torch's table) and torch is absent: a
# DecodeError (ringwire/_wire/dtypes.py, torch_module).
TORCH_ABSENT_ERROR = r"torch is not installed \(pip install 'ringwire\[torch\]'\)"


def torch_error(match: str) -> str:
    """The ``pytest.raises(match=...)`` pattern for an error a process with torch reports
    as ``match``: that, or where torch is absent, :data:`TORCH_ABSENT_ERROR` (the
    message needs torch before it gets as far as the check ``match`` names)."""
    return match if torch is not None else TORCH_ABSENT_ERROR


def torch_params(make: Callable[[], list[Any]], *, width: int, id: str) -> list[Any]:
    """``make()``: a list of ``pytest.param``s (or tuples) built with torch; where torch is
    absent, ``make`` is not called and the list is one parameter named ``id``, of
    ``width`` values (the test's argument count), skipped with the reason."""
    if torch is None:
        return [pytest.param(*(None,) * width, id=id, marks=needs_torch)]
    return make()
