"""The doctor's probes (:mod:`ringwire._probes`) for real: the torch and NIXL scripts
in child processes, a probe that hangs killed at its timeout, one that prints nothing,
and the memory-file check in this process."""

from __future__ import annotations

import importlib.util
import sys
import time

import pytest

from ringwire import _probes as probes

pytestmark = pytest.mark.multiprocess  # every test here starts a process


def test_memfd_support_on_linux() -> None:
    if not sys.platform.startswith("linux"):
        assert probes.memfd_support() is not None
        return
    assert probes.memfd_support() is None  # Linux >= 3.17 with sealing


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
def test_the_torch_probe_answers_what_torch_says() -> None:
    import torch

    answer = probes.collect(probes.start(probes.TORCH_PROBE), 120)
    assert answer["version"] == str(torch.__version__)
    assert answer["cuda_build"] == torch.version.cuda
    assert isinstance(answer["available"], bool)
    assert isinstance(answer["devices"], list)
    if not torch.version.cuda:
        assert answer["available"] is False and answer["devices"] == []


@pytest.mark.skipif(importlib.util.find_spec("nixl_cu12") is None, reason="needs nixl-cu12")
def test_the_nixl_probe_makes_an_agent_and_lists_ucx_transports() -> None:
    answer = probes.collect(probes.start(probes.NIXL_PROBE), 120)
    assert answer.get("ucx_backend") is True, answer
    assert "ucx_error" not in answer, answer
    assert answer["ucx_version"].count(".") == 2
    assert any(t.startswith("tcp/") for t in answer["transports"]), answer  # always built in
    assert all("/" in t for t in answer["transports"])


def test_a_probe_that_hangs_is_killed_at_its_timeout() -> None:
    proc = probes.start("import time; time.sleep(60)")
    t0 = time.monotonic()
    assert probes.collect(proc, 0.5) == {"timeout": 0.5}
    assert time.monotonic() - t0 < 10
    assert proc.returncode is not None  # killed and reaped


def test_a_probe_without_an_answer_is_an_error() -> None:
    assert probes.collect(probes.start("print('not json')"), 60) == {
        "error": "the probe exited with status 0 and no answer"
    }
    answer = probes.collect(probes.start("import sys; sys.exit(3)"), 60)
    assert answer == {"error": "the probe exited with status 3 and no answer"}
