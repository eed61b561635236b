"""The fuzz targets of ``fuzz/targets.py``, loaded once by path, for both halves of the
fuzz tests: tests/unit/test_fuzz.py (hypothesis, regressions) and
tests/process/test_fuzz.py (atheris, in a subprocess)."""

from __future__ import annotations

import importlib.util
import pathlib
import sys
from typing import Any

import pytest

from support.extras import NO_TORCH

# The targets' typed record, seeds and Ext 2 checks hold torch tensors: where torch is
# absent, the fuzz tests (both halves) are skipped, with the reason.
pytest.importorskip("torch", reason=NO_TORCH + ": fuzz/targets.py is written with it")

ROOT = pathlib.Path(__file__).resolve().parents[2]  # the repository: two up from tests/<folder>/
FUZZ = ROOT / "fuzz"


def _load_targets() -> Any:
    spec = importlib.util.spec_from_file_location("ringwire_fuzz_targets", FUZZ / "targets.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


targets = _load_targets()
NAMES = [n for n in targets.TARGETS if n != "all"]
