"""Helpers of both halves of the access tests (tests/unit/test_access.py and
tests/process/test_access.py): the uid of nobody, the root-only mark, a file's mode."""

from __future__ import annotations

import os
import stat

import pytest

NOBODY = 65534
root_only = pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root: it starts a process of another uid (nobody)"
)


def mode_of(path: str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)
