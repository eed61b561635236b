"""examples/pipeline: HTTP -> tokenizer -> scheduler -> N ranks (broadcast), end to end,
on a real uvicorn server driven by httpx; a rank killed mid-run; the script itself; its
metrics scraped and parsed, one trace per request across every process, and the
script without the optional packages."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
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
from support.absent import blocker

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

    param = getattr(request, "param", 2)  # the ranks, or {"ranks": N, "metrics": True}
    if isinstance(param, dict):
        metrics = {"host": "127.0.0.1", "port": 0} if param.get("metrics") else None
        backend = RingwireBackend(param["ranks"], metrics=metrics)
    else:
        backend = RingwireBackend(param)
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


# -- one rank on another host (tcp://127.0.0.1 here) -------------------------------------


class _Proc:
    """A subprocess whose output lines are collected by a thread (so waiting for one
    has a timeout), in a session of its own (so its workers can be killed with it)."""

    def __init__(self, args: list[str], cwd: Path) -> None:
        import queue

        self.proc = subprocess.Popen(
            [sys.executable, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=cwd,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._queue.put(line)
        self._queue.put(None)

    def expect(self, prefix: str, timeout: float = 90) -> str:
        """The first line (from now) starting with ``prefix``."""
        import queue

        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no {prefix!r} within {timeout:g} s: {self.lines}") from None
            if line is None:
                raise AssertionError(f"exited ({self.proc.wait()}) before {prefix!r}: {self.lines}")
            self.lines.append(line)
            if line.startswith(prefix):
                return line.strip()

    def finish(self, timeout: float = 60) -> int:
        """Its exit status, once its output is all read."""
        rc = self.proc.wait(timeout)
        self._thread.join(timeout)
        while (line := self._queue.get_nowait()) is not None:
            self.lines.append(line)
        return rc

    def kill(self) -> None:
        """Kill it and whatever it started (a failed test's cleanup)."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def _keygen(tmp_path: Path) -> dict[str, list[str]]:
    """The README's keys: the server's pair, rank 1's pair, rank 1's public key in the
    server's clients directory; the flags each side takes."""
    for name in ("server", "rank1"):
        subprocess.run(
            [sys.executable, "-m", "ringwire", "keygen", "keys", "--name", name],
            cwd=tmp_path, check=True, capture_output=True, timeout=60,
        )  # fmt: skip
    (tmp_path / "clients").mkdir()
    shutil.copy(tmp_path / "keys" / "rank1.key", tmp_path / "clients")
    return {
        "server": ["--key-secret", "keys/server.key_secret", "--clients", "clients"],
        "rank": ["--key-secret", "keys/rank1.key_secret", "--server-key", "keys/server.key"],
    }


def _remote_pipeline(tmp_path: Path, keys: bool) -> tuple[_Proc, _Proc, str]:
    """The server with rank 1 of 2 remote at tcp://127.0.0.1 (any free ports) and that
    rank started the documented way; (server, rank, the server's base URL)."""
    flags = _keygen(tmp_path) if keys else {"server": [], "rank": []}
    server = _Proc(
        [str(EXAMPLES / "pipeline"), "--port", "0", "--ranks", "2", "--remote-ranks", "1",
         "--tcp", "tcp://127.0.0.1:0", *flags["server"]],
        tmp_path,
    )  # fmt: skip
    procs = [server]
    try:
        line = server.expect("waiting for remote rank(s) 1 of 2: ")
        _, _, where = line.partition("steps at ")
        steps, _, results = where.partition(", results at ")
        assert steps.startswith("tcp://127.0.0.1:") and results.startswith("tcp://127.0.0.1:")
        rank = _Proc(
            [str(EXAMPLES / "pipeline"), "rank", steps, "--results", results, "--rank", "1",
             "--ranks", "2", *flags["rank"]],
            tmp_path,
        )  # fmt: skip
        procs.append(rank)
        base = server.expect("listening on http://").split()[-1]
        assert rank.expect("rank 1 of 2 joined ") == f"rank 1 of 2 joined {steps}"
    except BaseException:
        for p in procs:
            p.kill()
        raise
    return server, rank, base


@pytest.mark.parametrize("keys", [False, True], ids=["loopback", "curve"])
def test_remote_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, keys: bool) -> None:
    """``--remote-ranks 1 --tcp tcp://127.0.0.1:0`` and ``python examples/pipeline rank
    ...`` in another process (without keys, and with the README's CURVE keys): every
    answer is exact (rank 1's share of each feature came over TCP), then SIGINT stops
    the server and the remote rank exits 0 (the broadcast ended), nothing left."""
    pytest.importorskip("uvicorn")
    pytest.importorskip("torch")
    if keys:
        pytest.importorskip("zmq")
    import httpx

    monkeypatch.syspath_prepend(str(EXAMPLES))
    from pipeline import stages

    server, rank, base = _remote_pipeline(tmp_path, keys)
    try:
        bodies = _bodies(15)
        replies = asyncio.run(_post_all(base, bodies, concurrency=5))
        for body, r in zip(bodies, replies):
            assert r.status_code == 200, r.text
            got = r.json()
            want = stages.expected(stages.parse_request(body, "x"))
            assert got["feature_sum"] == want["feature_sum"], (body, got)
            assert got["output_ids"] == want["output_ids"], (body, got)
            assert got["image_tokens"] == want["image_tokens"]
            assert got["ranks"] == 2
        health = httpx.get(base + "/health", timeout=30).json()
        assert health["state"] == "running" and health["remote_ranks"] == 1, health
        assert set(health["workers"]) == {"tokenizer", "scheduler", "rank-0"}, health
        server.proc.send_signal(signal.SIGINT)
        assert server.finish() == 0, server.lines
        assert rank.finish() == 0, rank.lines
        assert "rank 1: the server closed the broadcast\n" in rank.lines, rank.lines
    finally:
        server.kill()
        rank.kill()


def test_remote_rank_killed(tmp_path: Path) -> None:
    """kill -9 of the remote rank: the broadcast fails naming rank 1, requests are
    answered 502/503 at once, and the server stops its topology (then exits on
    SIGINT), nothing left behind."""
    pytest.importorskip("uvicorn")
    pytest.importorskip("torch")
    import httpx

    server, rank, base = _remote_pipeline(tmp_path, keys=False)
    try:
        with httpx.Client(base_url=base, timeout=60) as c:
            assert c.post("/generate", json={"prompt": "warm", "images": 1}).status_code == 200
            rank.proc.kill()
            rank.finish()
            t0 = time.monotonic()
            codes = [r.status_code for r in asyncio.run(_post_all(base, _bodies(4), 4))]
            assert time.monotonic() - t0 < 20
            assert all(code in (502, 503) for code in codes), codes
            deadline = time.monotonic() + 30
            while c.get("/health").json()["state"] != "stopped":
                assert time.monotonic() < deadline, c.get("/health").json()
                time.sleep(0.1)
        server.proc.send_signal(signal.SIGINT)
        assert server.finish() == 0, server.lines
        assert any("rank 1" in line and "lost" in line for line in server.lines), server.lines
    finally:
        server.kill()
        rank.kill()


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--tcp", "tcp://0.0.0.0:0"], "refusing to listen at tcp://0.0.0.0:0"),
        (["--key-secret", "nope.key_secret", "--clients", "."], "nope.key_secret"),
        (["--key-secret", "nope.key_secret"], "--clients"),
        (["--tcp", "127.0.0.1:5600"], "tcp://"),
    ],
    ids=["non-loopback-without-keys", "missing-key-file", "half-keys", "bad-address"],
)
def test_remote_flags_refused(tmp_path: Path, flags: list[str], says: str) -> None:
    """A non-loopback ``--tcp`` without keys (ringwire refuses to listen there), a
    missing key file, half the keys, a bad address: exit status 2 with ringwire's
    reason (and, for the refusal, the flags that fix it), before any worker starts."""
    r = subprocess.run(
        [sys.executable, str(EXAMPLES / "pipeline"), "--port", "0", "--remote-ranks", "1",
         *flags],
        cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert says in r.stderr, r.stderr
    assert "listening" not in r.stdout and "waiting" not in r.stdout
    if "refusing" in says:
        assert "--key-secret" in r.stderr and "--insecure" in r.stderr, r.stderr


# -- observability: metrics, traces, and neither ----------------------------------------

# gauges that must read zero once every request is answered (depth, slots, loans, holds)
_DRAINED = (
    "ringwire_unread_bytes",
    "ringwire_unread_records",
    "ringwire_ring_fill_ratio",
    "ringwire_reader_unread_bytes",
    "ringwire_slots_in_use",
    "ringwire_slots_in_use_bytes",
    "ringwire_loans_out",
    "ringwire_reader_slots_held",
    "ringwire_received_arrays_held",
    "ringwire_releases_pending",
    "ringwire_large_arrays_in_use",
)

Samples = list[tuple[str, dict[str, str], float]]


def _scrape(url: str) -> Samples:
    """``url``'s Prometheus text, parsed by prometheus_client's own parser."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(url, timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain"), r.headers
    return [
        (s.name, s.labels, s.value)
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    ]


def _sum(samples: Samples, name: str, **labels: str) -> float:
    return sum(
        v for n, lab, v in samples if n == name and all(lab.get(k) == w for k, w in labels.items())
    )


@pytest.mark.parametrize("pipeline_server", [{"ranks": 2, "metrics": True}], indirect=True)
def test_metrics_scrape(pipeline_server: _Server) -> None:
    """The front's ``/metrics`` and every worker's (``--worker-metrics-port``, listed by
    ``/health``), fetched with httpx and parsed with prometheus_client's parser, also
    while requests are in flight: the counters move between two scrapes as requests are
    served (each rank received every step the broadcast sent), and once the requests
    are answered the unread depth, the slots in use, loans and holds are all back to
    zero and every slot is free again."""
    pytest.importorskip("prometheus_client")
    import httpx

    base = pipeline_server.base
    with httpx.Client(base_url=base, timeout=30) as c:
        urls = {"front": base + "/metrics", **c.get("/health").json()["metrics"]}
    assert set(urls) == {"front", "tokenizer", "scheduler", "rank-0", "rank-1"}, urls

    async def flow(n: int) -> tuple[list[Any], list[Samples]]:
        bodies = [{"prompt": f"p{i}", "images": 1 + i % 2, "seed": i} for i in range(n)]
        posting = asyncio.ensure_future(_post_all(base, bodies, concurrency=4))
        during = []
        while not posting.done():  # scraped while the requests flow
            during.append(await asyncio.to_thread(_scrape, urls["front"]))
            await asyncio.sleep(0.02)
        return await posting, during

    before = {w: _scrape(u) for w, u in urls.items()}
    replies, during = asyncio.run(flow(7))
    # and one alone: a step of its own, the last before the pipeline goes idle
    replies.append(httpx.post(base + "/generate", json={"prompt": "last", "images": 1}, timeout=30))
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
    assert during and all(_sum(s, "ringwire_open_endpoints") >= 1 for s in during)
    after = {w: _scrape(u) for w, u in urls.items()}

    def moved(worker: str, name: str, **labels: str) -> float:
        return _sum(after[worker], name, **labels) - _sum(before[worker], name, **labels)

    assert moved("front", "pipeline_http_requests_total", status="200") == 8
    assert moved("front", "ringwire_records_total", direction="send") >= 8  # the calls
    assert moved("front", "ringwire_records_total", direction="receive") >= 8  # the replies
    assert moved("front", "ringwire_payload_bytes_total", direction="send") > 0
    assert moved("tokenizer", "ringwire_records_total", direction="send") >= 16
    assert moved("tokenizer", "ringwire_slot_releases_total") >= 8  # one loaned slot each
    steps = moved("scheduler", "ringwire_records_total", direction="send", kind="broadcast")
    assert 1 <= steps <= 8, steps
    for r in ("rank-0", "rank-1"):
        got = moved(r, "ringwire_records_total", direction="receive", kind="subscriber")
        assert got == steps, (r, got, steps)
        assert moved(r, "ringwire_records_total", direction="send") == steps  # its outputs
        # the steps are stamped with their publish time: each rank timed every hop
        assert moved(r, "ringwire_hop_latency_seconds_count", kind="subscriber") == steps
    assert any(n == "ringwire_unread_records" for n, _, _ in after["rank-0"])

    # drained: a worker takes its peers' releases in when it next looks (the idle
    # scheduler looks every 0.25 s; without that, the broadcast's last slot showed as
    # held for ~7 s)
    deadline = time.monotonic() + 3
    while True:
        now = {w: _scrape(u) for w, u in urls.items()}
        busy = [
            (w, n, lab, v) for w, s in now.items() for n, lab, v in s if n in _DRAINED and v != 0
        ]
        if not busy:
            break
        assert time.monotonic() < deadline, busy
        time.sleep(0.1)
    for w in ("tokenizer", "scheduler"):  # the slot pools were there, and are all free
        assert any(n == "ringwire_slots_in_use" for n, _, _ in now[w]), w
    # (the tokenizer's pool is its call channel's: a Client's, kind "client")
    kinds = {"tokenizer": ("channel", "client"), "scheduler": ("broadcast",)}
    for w, ks in kinds.items():
        free = [(lab, v) for n, lab, v in now[w] if n == "ringwire_slots_free" and lab["kind"] in ks]
        assert sum(v for _, v in free) == 48, (w, free)  # FEATURE_SLOTS: 3 classes x 16


def _chain(by_id: dict[str, dict[str, Any]], span: dict[str, Any]) -> list[tuple[str, str]]:
    """``(service, name)`` of ``span`` and of each of its ancestors, up to the root."""
    out = []
    while True:
        out.append((span["service"], span["name"]))
        if span["parent_id"] is None or span["parent_id"] not in by_id:
            return out
        span = by_id[span["parent_id"]]


def test_one_trace_per_request(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The script with ``RINGWIRE_EXAMPLE_TRACE_FILE``: every process appends its spans
    there.  Each request is one trace (its id in the ``traceresponse`` header) whose
    spans chain parent -> child from the front's ``POST /generate`` through both calls
    into the scheduler's step and on into every rank, and hold nothing else; a
    ``traceparent`` sent by the HTTP client is continued; a bad body is a front-only
    trace."""
    pytest.importorskip("uvicorn")
    pytest.importorskip("torch")
    pytest.importorskip("opentelemetry.sdk")
    import httpx

    spans_file = tmp_path / "spans.jsonl"
    monkeypatch.setenv("RINGWIRE_EXAMPLE_TRACE_FILE", str(spans_file))
    server = _Proc([str(EXAMPLES / "pipeline"), "--port", "0", "--ranks", "2"], tmp_path)
    try:
        base = server.expect("listening on http://").split()[-1]
        assert server.expect("traces: ") == f"traces: JSON lines appended to {spans_file}"
        replies = asyncio.run(_post_all(base, _bodies(5), concurrency=5))
        upstream = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"
        continued = httpx.post(
            base + "/generate", json={"prompt": "from upstream", "images": 1},
            headers={"traceparent": upstream}, timeout=30,
        )  # fmt: skip
        bad = httpx.post(base + "/generate", json={"prompt": 3}, timeout=30)
        server.proc.send_signal(signal.SIGINT)
        assert server.finish() == 0, server.lines
    finally:
        server.kill()

    assert all(r.status_code == 200 for r in [*replies, continued]), replies
    assert bad.status_code == 400
    spans = [json.loads(line) for line in spans_file.read_text().splitlines()]
    by_id = {s["span_id"]: s for s in spans}
    by_trace: dict[str, list[dict[str, Any]]] = {}
    for s in spans:
        by_trace.setdefault(s["trace_id"], []).append(s)
    assert len(by_trace) == 7, sorted(by_trace)  # one per request, nothing else

    hops = [
        ("pipeline-scheduler", "pipeline.step"),
        ("pipeline-scheduler", "ringwire.serve TokenizedRequest"),
        ("pipeline-tokenizer", "ringwire.call"),
        ("pipeline-tokenizer", "ringwire.serve GenerateRequest"),
        ("pipeline-front", "ringwire.call"),
        ("pipeline-front", "POST /generate"),
    ]
    for r in [*replies, continued]:
        _, trace_id, root_id, _ = r.headers["traceresponse"].split("-")
        mine = by_trace[trace_id]
        assert len(mine) == len(hops) + 2, [(s["service"], s["name"]) for s in mine]
        assert by_id[root_id]["name"] == "POST /generate"
        ranks = [s for s in mine if s["name"] == "pipeline.rank"]
        assert sorted(s["service"] for s in ranks) == ["pipeline-rank-0", "pipeline-rank-1"]
        for s in ranks:
            assert _chain(by_id, s) == [(s["service"], "pipeline.rank"), *hops]
            assert all(by_id[a]["trace_id"] == trace_id for a in [s["parent_id"]])
        assert all(s["status"] != "ERROR" for s in mine), mine
        assert by_id[root_id]["attributes"]["http.response.status_code"] == 200
    _, trace_id, root_id, _ = continued.headers["traceresponse"].split("-")
    assert trace_id == "ab" * 16 and by_id[root_id]["parent_id"] == "cd" * 8
    _, trace_id, root_id, _ = bad.headers["traceresponse"].split("-")
    assert [s["name"] for s in by_trace[trace_id]] == ["POST /generate"]
    assert by_id[root_id]["attributes"]["http.response.status_code"] == 400


# what `pip uninstall prometheus_client opentelemetry-api opentelemetry-sdk` leaves: a
# sitecustomize (every process of the pipeline inherits PYTHONPATH) refusing them
_BLOCKER = blocker("prometheus_client", "opentelemetry")


def test_script_without_observe_packages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without prometheus_client and OpenTelemetry the pipeline answers as before, says
    tracing is off and why, adds no ``traceresponse``, and ``/metrics`` answers 501
    naming the extra to install."""
    pytest.importorskip("uvicorn")
    pytest.importorskip("torch")
    import httpx

    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(_BLOCKER)
    path = os.environ.get("PYTHONPATH")
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(tmp_path / "site"), *([path] if path else [])])
    )
    probe = subprocess.run([sys.executable, "-c", "import opentelemetry"], capture_output=True)
    assert probe.returncode != 0  # the blocker works
    monkeypatch.setenv("RINGWIRE_EXAMPLE_TRACE_FILE", str(tmp_path / "spans.jsonl"))
    server = _Proc([str(EXAMPLES / "pipeline"), "--port", "0", "--ranks", "1"], tmp_path)
    try:
        base = server.expect("listening on http://").split()[-1]
        assert server.expect("tracing off: ").endswith(
            "the OpenTelemetry SDK is not installed (pip install 'ringwire[observe]' "
            "opentelemetry-sdk)"
        )
        r = httpx.post(base + "/generate", json={"prompt": "hi", "images": 1}, timeout=30)
        assert r.status_code == 200 and "traceresponse" not in r.headers, r.text
        m = httpx.get(base + "/metrics", timeout=30)
        assert m.status_code == 501 and "ringwire[observe]" in m.text, m.text
        server.proc.send_signal(signal.SIGINT)
        assert server.finish() == 0, server.lines
    finally:
        server.kill()
    assert not (tmp_path / "spans.jsonl").exists()


def test_trace_choice(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """How the script picks its exporter from the standard variables: the file, OTLP
    (or the console, saying why, when the OTLP exporter is not installed), the console
    by default, off when asked."""
    pytest.importorskip("opentelemetry.sdk")
    monkeypatch.syspath_prepend(str(EXAMPLES))
    from pipeline import observe

    path = str(tmp_path / "s.jsonl")
    assert observe.trace_choice({observe.TRACE_FILE_ENV: path}) == (
        {"exporter": "file", "path": path},
        f"traces: JSON lines appended to {path}",
    )
    config, what = observe.trace_choice({})
    assert config == {"exporter": "console"} and what.startswith("traces: console")
    for off in ({"OTEL_TRACES_EXPORTER": "none"}, {"OTEL_SDK_DISABLED": "true"}):
        config, what = observe.trace_choice({**off, observe.TRACE_FILE_ENV: path})
        assert config is None and what.startswith("tracing off"), off
    env = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/v1/traces"}
    config, what = observe.trace_choice(env)
    if observe._otlp_exporter_module() is None:
        assert config == {"exporter": "console"}
        assert "opentelemetry-exporter-otlp is not installed" in what, what
    else:
        assert config is not None and config["exporter"] == "otlp"
        assert what == "traces: OTLP to http://127.0.0.1:4318/v1/traces"
