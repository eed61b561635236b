"""examples/pipeline: HTTP -> tokenizer -> scheduler -> N ranks (broadcast), end to end,
on a real uvicorn server driven by httpx; a rank killed mid-run; the script itself."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

pytestmark = pytest.mark.multiprocess


class _Server:
    def __init__(self, base: str, backend: Any) -> None:
        self.base = base
        self.backend = backend


@pytest.fixture
def pipeline_server(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[_Server]:
    """The example on a real uvicorn server (127.0.0.1, ephemeral port) in a thread of
    this process, so the suite's leak checks see every worker process."""
    pytest.importorskip("starlette")
    uvicorn = pytest.importorskip("uvicorn")
    pytest.importorskip("torch")
    monkeypatch.syspath_prepend(str(EXAMPLES))  # spawn passes sys.path to the workers
    from pipeline.app import RingwireBackend, make_app

    backend = RingwireBackend(getattr(request, "param", 2))
    app = make_app(backend)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(app, lifespan="on", log_level="warning", access_log=False)
    )
    errors: list[BaseException] = []

    def run() -> None:
        try:
            server.run(sockets=[sock])
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    thread = threading.Thread(target=run, name="uvicorn", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 90
        while not server.started:
            assert thread.is_alive() and not errors, f"uvicorn did not start: {errors}"
            assert time.monotonic() < deadline, "the pipeline did not start within 90 s"
            time.sleep(0.05)
        yield _Server(f"http://127.0.0.1:{port}", backend)
    finally:
        server.should_exit = True
        thread.join(60)
        sock.close()
    assert not thread.is_alive(), "uvicorn did not stop"
    assert not errors, errors


def _bodies(n: int) -> list[dict[str, Any]]:
    """Prompts with 0-4 images, both dtypes, two sizes."""
    return [
        {
            "prompt": f"describe picture {i} ✓",
            "images": i % 5,
            "seed": 1000 + i,
            "dtype": ("float32", "bfloat16")[i % 2],
            "size": (448, 224)[(i // 5) % 2],
            "max_new_tokens": 1 + i % 6,
        }
        for i in range(n)
    ]


async def _post_all(base: str, bodies: list[dict[str, Any]], concurrency: int) -> list[Any]:
    import httpx

    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:

        async def one(body: dict[str, Any]) -> Any:
            async with sem:
                return await client.post("/generate", json=body)

        return await asyncio.gather(*(one(b) for b in bodies))


@pytest.mark.parametrize("pipeline_server", [2, 4], indirect=True)
def test_answers_end_to_end(pipeline_server: _Server) -> None:
    """Every answer is exact (the feature sum the ranks computed from their shards, the
    tokens every rank agreed on), concurrent requests are batched into steps, bad
    bodies are refused, and no slot is left in use afterwards."""
    from pipeline import stages

    ranks = pipeline_server.backend.ranks
    bodies = _bodies(24)
    replies = asyncio.run(_post_all(pipeline_server.base, bodies, concurrency=8))
    batches = set()
    for body, r in zip(bodies, replies):
        assert r.status_code == 200, r.text
        got = r.json()
        want = stages.expected(stages.parse_request(body, "x"))
        assert got["feature_sum"] == want["feature_sum"], (body, got)
        assert got["output_ids"] == want["output_ids"], (body, got)
        assert got["image_tokens"] == want["image_tokens"]
        assert got["ranks"] == ranks
        batches.add(got["batch"])
    assert max(batches) > 1, f"8 concurrent requests were never batched: {batches}"

    import httpx

    with httpx.Client(base_url=pipeline_server.base, timeout=30) as c:
        for bad, why in [
            ({"prompt": "x", "images": 5}, "images"),
            ({"prompt": 3}, "prompt"),
            ({"prompt": "x", "dtype": "float64"}, "dtype"),
            ({"prompt": "x", "size": 100}, "size"),
            ({"prompt": "x", "extra": 1}, "unknown"),
        ]:
            r = c.post("/generate", json=bad)
            assert r.status_code == 400 and why in r.json()["error"], (bad, r.text)
        assert c.post("/generate", content=b"{not json").status_code == 400
        health = c.get("/health").json()
        assert health["state"] == "running" and health["pending"] == 0
        assert set(health["workers"]) == {
            "tokenizer",
            "scheduler",
            *(f"rank-{i}" for i in range(ranks)),
        }


def test_rank_killed(pipeline_server: _Server) -> None:
    """kill -9 of a rank: the broadcast fails, the step in flight and every queued
    request are answered at once (no hang), later ones get 503, and the topology
    stops with nothing left behind (the fixture's leak checks)."""
    import httpx

    topo = pipeline_server.backend.topology
    with httpx.Client(base_url=pipeline_server.base, timeout=60) as c:
        assert c.post("/generate", json={"prompt": "warm", "images": 1}).status_code == 200
        pid = topo.status()["rank-1"].pid
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        codes = [r.status_code for r in asyncio.run(_post_all(pipeline_server.base, _bodies(6), 6))]
        assert time.monotonic() - t0 < 20
        assert all(code in (502, 503) for code in codes), codes
        deadline = time.monotonic() + 30
        while c.get("/health").json()["state"] != "stopped":
            assert time.monotonic() < deadline, c.get("/health").json()
            time.sleep(0.1)
        r = c.post("/generate", json={"prompt": "after"})
        assert r.status_code == 503, r.text
        assert "rank-1" in (c.get("/health").json()["stop_reason"] or "")


def test_script(tmp_path: Path) -> None:
    """``python examples/pipeline --port 0 --ranks 1``: announces its port, answers,
    stops cleanly on SIGINT (exit status 0, workers gone)."""
    pytest.importorskip("uvicorn")
    pytest.importorskip("torch")
    import httpx

    proc = subprocess.Popen(
        [sys.executable, str(EXAMPLES / "pipeline"), "--port", "0", "--ranks", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=tmp_path,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("listening on http://"), line
        base = line.split()[-1]
        deadline = time.monotonic() + 30
        while True:
            try:
                r = httpx.post(
                    base + "/generate", json={"prompt": "hi", "images": 2, "seed": 9}, timeout=30
                )
                break
            except httpx.ConnectError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        assert r.status_code == 200 and r.json()["ranks"] == 1, r.text
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
