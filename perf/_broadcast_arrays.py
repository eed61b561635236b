"""Broadcast of a 2.4 MB array per step to N reader processes, lockstep
(``python -m perf.broadcast --arrays``).

The question: how long from "the writer starts producing step k's array" to "the
slowest reader holds it as an array", when the writer waits for every reader to be
done with step k before step k+1 (lockstep, what a scheduler and its model ranks do)?
The writer *produces* each step's array (``np.add(BASE, k, out=dst)``: one pass
writing 2.4 MB) into ``dst``: a private array that the transport then copies, or, for
a ringwire loan, the loaned slot itself -- the step's one write lands in shared memory
and nothing is copied after it.  The clock (``time.perf_counter_ns``, one clock for
every process of the host) is read by the writer before producing and by each reader
once its receive returned the array; the reader then checks the array (its first
element is k; a strided sample every step and the whole array every 8th step equal
``BASE + k``), drops it and acknowledges on its control pipe.  A wrong array fails
the run (exit 1).  The whole-array steps are left out of the figures: a reader that
checks 2.4 MB takes a core from the readers still on their way.  The writer sleeps 1-1.5 ms (jittered) after the acknowledgements,
so parked readers park.

Peers, each with its own N ``spawn`` readers alive for the whole run, in interleaved
rounds (the order rotates every round):

* **ringwire broadcast, loan** -- ``loan`` a slot, produce into it, ``send`` it (no
  copy; every reader gets a read-only view of the slot);
* **ringwire broadcast, loan, parked readers** -- the same, readers ``spin_us=0``;
* **ringwire broadcast, send** -- produce into a private array and ``send`` it (one
  copy into a slot, views for the readers);
* **vLLM MessageQueue (real)** -- vLLM's own ``shm_broadcast.py``
  (:mod:`perf.peers.vllm_shm`), measured as it is: ``enqueue`` pickles (protocol 5,
  the array out of band, copied into the ring chunk), every reader copies it out into
  a ``bytearray``, and its readers spin (``sched_yield``) for 1 s after each read;
* **vLLM MessageQueue scheme (re-implemented)** -- :mod:`perf._vllm_mq` (continuity
  with earlier tables): the array's bytes copied into a chunk, copied out by readers.

After a vLLM round the run pauses past its readers' 1 s busy loop.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from perf._common import (
    await_ready,
    format_table,
    format_targets,
    machine_info,
    spawn_readers,
    started_peers,
)

clock = time.perf_counter_ns
ELEMS = 600_000  # float32: 2.4 MB
BASE = (np.arange(ELEMS, dtype=np.int64) % 1000).astype(np.float32)
SAMPLE = slice(0, None, 997)
T_VS_VLLM = 0.7  # issue 27's target: loaned broadcast p50 <= 0.7x vLLM's


# ======================================================================================
# readers (children)
# ======================================================================================


def _check(arr: Any, k: int) -> bool:
    a = np.asarray(arr)
    if a.shape != (ELEMS,) or a.dtype != np.float32 or a[0] != k:
        return False
    if not np.array_equal(a[SAMPLE], BASE[SAMPLE] + k):
        return False
    return k % 8 != 0 or bool(np.array_equal(a, BASE + k))


def _serve(ctrl: Any, recv: Callable[[], Any]) -> None:
    """``("round", n)``: n steps, each acknowledged with ``("ack", t, ok)``."""
    ctrl.send(("ready", os.getpid()))
    while True:
        cmd = ctrl.recv()
        if cmd[0] == "stop":
            return
        for k in range(cmd[1]):
            arr = recv()
            t = clock()
            ok = _check(arr, k)
            del arr
            ctrl.send(("ack", t, ok))


def reader_ringwire(ctrl: Any, path: str, spin_us: float | None) -> None:
    import ringwire

    kw: dict[str, Any] = {} if spin_us is None else {"spin_us": spin_us}
    with ringwire.subscribe_sync(path, handshake_timeout=60, **kw) as sub:
        _serve(ctrl, lambda: sub.receive(timeout=120))


def reader_vllm_real(ctrl: Any, fields: dict[str, Any], rank: int, rpc_dir: str) -> None:
    from perf.peers.vllm_shm import load_message_queue, reader_from_fields

    load_message_queue(rpc_dir)
    mq = reader_from_fields(fields, rank)
    mq.wait_until_ready()
    _serve(ctrl, lambda: mq.dequeue(timeout=120))


def reader_vllm_scheme(ctrl: Any, handle: Any, rank: int) -> None:
    from perf._vllm_mq import MQReader

    mq = MQReader(handle, rank)
    try:
        _serve(ctrl, lambda: np.frombuffer(mq.dequeue(), np.float32))
    finally:
        mq.close()


# ======================================================================================
# peers (the writer's side): ``step(k)`` produces step k's array and sends it
# ======================================================================================


@dataclass
class Peer:
    name: str
    step: Callable[[int], None]
    ctrls: list[Any]
    procs: list[Any]
    close: Callable[[], None]
    settle_s: float = 0.0
    lat: list[int] = field(default_factory=list)  # per step, slowest reader, ns
    first: list[int] = field(default_factory=list)  # per step, fastest reader, ns


def peer_ringwire(tmp: str, n: int, loan: bool, spin_us: float | None, label: str) -> Peer:
    import ringwire

    path = os.path.join(tmp, f"b{len(os.listdir(tmp))}.sock")
    bc = ringwire.broadcast_sync(path, readers=n)
    ctrls, procs = spawn_readers(reader_ringwire, [(path, spin_us)] * n)
    await_ready(ctrls, 120)
    bc.wait_ready(n, timeout=60)
    private = np.empty(ELEMS, np.float32)

    def step(k: int) -> None:
        dst = bc.loan((ELEMS,), np.float32, timeout=60) if loan else private
        np.add(BASE, k, out=dst)
        bc.send(dst, timeout=60)

    return Peer(label, step, ctrls, procs, bc.close)


def peer_vllm_real(tmp: str, n: int) -> Peer:
    from perf.peers.vllm_shm import handle_fields, load_message_queue

    mq_cls = load_message_queue(tmp)
    mq = mq_cls(n, n)
    ctrls, procs = spawn_readers(reader_vllm_real, [(handle_fields(mq), r, tmp) for r in range(n)])
    mq.wait_until_ready()
    await_ready(ctrls, 120)
    private = np.empty(ELEMS, np.float32)

    def step(k: int) -> None:
        np.add(BASE, k, out=private)
        mq.enqueue(private, timeout=60)

    def close() -> None:
        nonlocal mq
        del mq  # its ShmRingBuffer unlinks the segment when collected (vLLM's way)
        import gc

        gc.collect()

    return Peer("vLLM MessageQueue (real)", step, ctrls, procs, close, settle_s=1.2)


def peer_vllm_scheme(tmp: str, n: int) -> Peer:
    from perf._vllm_mq import MQWriter

    mq = MQWriter(n, f"ipc://{tmp}/notify.ipc", max_chunk_bytes=4 << 20)
    ctrls, procs = spawn_readers(reader_vllm_scheme, [(mq.handle(), r) for r in range(n)])
    await_ready(ctrls, 120)
    time.sleep(0.5)  # PUB/SUB's slow joiner
    private = np.empty(ELEMS, np.float32)
    raw = private.view(np.uint8).data

    def step(k: int) -> None:
        np.add(BASE, k, out=private)
        mq.enqueue(raw, timeout=60)  # type: ignore[arg-type]  # (any buffer: one copy)

    return Peer(
        "vLLM MessageQueue scheme (re-implemented)", step, ctrls, procs, mq.close, settle_s=1.2
    )


@contextlib.contextmanager
def _peers(tmp: str, n: int, only: set[str] | None) -> Iterator[list[Peer]]:
    makers: list[tuple[str, Callable[[], Peer]]] = [
        ("loan", lambda: peer_ringwire(tmp, n, True, None, "ringwire broadcast, loan (no copy)")),
        (
            "loan-parked",
            lambda: peer_ringwire(tmp, n, True, 0.0, "ringwire broadcast, loan, parked readers"),
        ),
        ("send", lambda: peer_ringwire(tmp, n, False, None, "ringwire broadcast, send (1 copy)")),
        ("vllm", lambda: peer_vllm_real(tmp, n)),
        ("vllm-scheme", lambda: peer_vllm_scheme(tmp, n)),
    ]
    with started_peers(makers, only, close_first=False) as peers:
        yield peers


def run_round(peer: Peer, steps: int, warmup: int, rng: random.Random) -> int:
    """One round of ``warmup + steps`` lockstep steps; returns the readers' failed
    checks."""
    bad = 0
    for c in peer.ctrls:
        c.send(("round", warmup + steps))
    for k in range(warmup + steps):
        t0 = clock()
        peer.step(k)
        ts = []
        for c in peer.ctrls:
            if not c.poll(120):
                raise RuntimeError(f"{peer.name}: a reader did not acknowledge step {k}")
            _, t, ok = c.recv()
            ts.append(t)
            bad += not ok
        if k >= warmup and k % 8 != 0:  # not a whole-array check step (see the header)
            peer.lat.append(max(ts) - t0)
            peer.first.append(min(ts) - t0)
        time.sleep(0.001 * (1 + rng.random() / 2))
    if peer.settle_s:
        time.sleep(peer.settle_s)
    return bad


def _pct(samples: list[int], q: float) -> float:
    s = sorted(samples)
    return s[max(0, min(len(s) - 1, int(q * len(s)) - 1))] / 1000 if s else float("nan")


def _shm(pids: set[int]) -> set[str]:
    """This run's names in /dev/shm: ringwire's carry the creating pid (``rw.<pid>.``),
    vLLM's are ``psm_*`` (other engineers' runs on the machine are left out)."""
    try:
        names = os.listdir("/dev/shm")
    except OSError:
        return set()
    return {
        s
        for s in names
        if s.startswith("psm_") or any(f".{p}." in s or f"-{p}-" in s for p in pids)
    }


def main(n: int, quick: bool, only: list[str] | None) -> int:
    rounds, steps, warmup = (3, 60, 10) if quick else (6, 150, 15)
    rng = random.Random(1)
    tmp = tempfile.mkdtemp(prefix="rwbench-")
    pids = {os.getpid()}
    shm0 = _shm(pids)
    t_start = time.monotonic()
    bad = 0
    try:
        from perf.peers.vllm_shm import VllmUnavailable, describe

        try:
            vllm_desc = describe()
        except VllmUnavailable as exc:
            vllm_desc = f"vLLM's MessageQueue not measured: {exc}"
        print(f"# broadcast of a 2.4 MB array to {n} readers, lockstep", file=sys.stderr)
        with _peers(tmp, n, set(only) if only else None) as peers:
            for r in range(rounds):
                for j in range(len(peers)):
                    bad += run_round(peers[(r + j) % len(peers)], steps, warmup, rng)
                print(f"  round {r + 1}/{rounds}", file=sys.stderr)
            pids.update(proc.pid for p in peers for proc in p.procs)
            results = [
                (p.name, _pct(p.lat, 0.5), _pct(p.lat, 0.99), _pct(p.first, 0.5), len(p.lat))
                for p in peers
            ]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    leaked = sorted(_shm(pids) - shm0)
    by = {name: (p50, p99) for name, p50, p99, _, _ in results}
    ref = by.get("vLLM MessageQueue (real)")
    rows = [
        [
            name,
            f"{p50:.0f}",
            f"{p99:.0f}",
            f"{first:.0f}",
            f"{p50 / ref[0]:.2f} / {p99 / ref[1]:.2f}" if ref else "—",
            str(count),
        ]
        for name, p50, p99, first, count in results
    ]
    info = machine_info(["ringwire", "numpy", "zmq", "torch"])
    print()
    print(
        f"Broadcast of one 2.4 MB float32 array per step to {n} reader processes, "
        f"lockstep (the writer waits for every reader before the next step); step = "
        f"writer starts producing the array -> slowest reader holds it (µs). CPU: "
        f"{info['cpu']}, {info['cpus_usable']} usable cores, Python {info['python']}. "
        f"{vllm_desc}."
    )
    print()
    print(
        format_table(
            [
                "transport",
                "step p50 µs",
                "step p99 µs",
                "first reader p50 µs",
                "p50 / p99 ÷ vLLM (real)",
                "steps",
            ],
            rows,
            "lrrrrr",
        )
    )
    targets = []
    loan = next((r for r in results if r[0].startswith("ringwire broadcast, loan (")), None)
    if loan and ref:
        ratio = loan[1] / ref[0]
        targets.append(
            {
                "target": f"loaned broadcast p50 ≤ {T_VS_VLLM}× vLLM MessageQueue (real)",
                "shown": f"{ratio:.2f}× (p99 {loan[2] / ref[1]:.2f}×)",
                "status": "met" if ratio <= T_VS_VLLM else "missed",
            }
        )
    elif loan:
        targets.append(
            {
                "target": f"loaned broadcast p50 ≤ {T_VS_VLLM}× vLLM MessageQueue (real)",
                "shown": "—",
                "status": "not measured (no vLLM release: set RINGWIRE_VLLM)",
            }
        )
    print()
    if targets:
        print(format_targets(targets))
    print(
        f"\n({time.monotonic() - t_start:.0f} s; compare ratios: absolute µs move with the machine)"
    )
    if bad:
        print(f"FAILED: {bad} step(s) arrived wrong", file=sys.stderr)
    if leaked:
        print(f"FAILED: left in /dev/shm: {leaked}", file=sys.stderr)
    return 1 if bad or leaked else 0
