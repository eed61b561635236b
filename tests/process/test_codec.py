"""ringwire._wire.codec in a fresh interpreter: a numpy-only user never imports torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.multiprocess  # every test here starts a process


def test_numpy_only_user_never_imports_torch() -> None:
    code = (
        "import sys, numpy as np, ringwire\n"
        "e, d = ringwire.Encoder(), ringwire.Decoder()\n"
        "v = {'a': np.arange(4), 't': (1, 2), 's': np.int8(1), 'dt': np.dtype('f4')}\n"
        "assert d.decode(e.encode(v))['t'] == (1, 2)\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
