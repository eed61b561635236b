"""The measured side of :mod:`perf.compare`: one *driver* process per ringwire tree.

This file is self-contained on purpose: it imports only the standard library, numpy,
msgspec and ringwire's PUBLIC API (``ringwire.pair``, ``PairEnd.connect`` /
``connect_sync``, ``Channel`` / ``SyncChannel`` ``send``, ``receive``, ``send_many``,
``receive_many``, ``loan``, ``aclose`` / ``close``, ``ringwire.listen`` with
``Listener.accept`` / ``receive_many``, ``ringwire.connect_sync``).  Nothing of
``perf`` is imported, so the very same code measures the old and the new tree, and a
reorganisation of ringwire's private modules cannot break it; where the public API
was renamed (the handshake bound, ``timeout=`` -> ``handshake_timeout=``), the name
is read from the tree's own signature (:func:`_setup_kw`).

:mod:`perf.compare` copies this file into its run directory as ``rwcmp_child.py`` and
starts ``python -c "...; rwcmp_child.driver_main()"`` there with ``PYTHONPATH`` set to
one tree.  The driver speaks JSON lines: it reads commands on stdin and writes replies
and events on the stdout it was started with (file descriptor 1 is then pointed at
stderr, so nothing else -- a helper's print, a warning -- can corrupt the protocol)::

    driver -> parent  {"event": "hello", "ringwire_file": ..., ...}
    parent -> driver  {"m": "<measurement>", "args": {...}}
    driver -> parent  {"event": "pid", "pid": N}         every helper process it starts
    driver -> parent  {"ok": true, "result": {...}}  or  {"ok": false, "error": "..."}
    parent -> driver  {"m": "exit"}  (or stdin closes)

Each command starts fresh helper processes (``multiprocessing`` *spawn*, the other end
of the channel), measures, and stops them, so nothing of one measurement lives on into
the next.  Helpers report their own ``ringwire.__file__``; the driver refuses a helper
that imported ringwire from somewhere else.  Every process here sets
``PR_SET_PDEATHSIG``, and every blocking wait has a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import json
import multiprocessing as mp
import os
import signal
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import msgspec

clock = time.perf_counter_ns

BATCH = 256  # records per send_many / receive_many batch
WAIT_S = 60.0  # any single blocking wait
SETUP_S = 30.0  # connect / handshake
ARRAY_BYTES = 8 << 20  # the tensor handoffs: an 8 MiB uint8 array


class Req(msgspec.Struct, array_like=True):
    """The ~100-byte request record of ``perf.peers.Req`` (same fields, same values)."""

    rid: str
    seq: int
    tokens: list[int]
    temperature: float
    top_p: float
    max_new_tokens: int
    stream: bool
    model: str


def make_record(seq: int = 0) -> Req:
    return Req(
        rid="req-7f3a9c21-00000",
        seq=seq,
        tokens=[1000 + 7 * i for i in range(10)],
        temperature=0.7,
        top_p=0.95,
        max_new_tokens=256,
        stream=True,
        model="llama-3.1-8b-instruct",
    )


def marker(seq: int) -> int:
    """The byte the producer writes into element 0 of a handed-off array."""
    return seq % 128


# --------------------------------------------------------------------------- plumbing


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent dies."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # pragma: no cover - not Linux
        pass


def _ringwire_file() -> str:
    import ringwire

    return os.path.realpath(ringwire.__file__)


class HelperFailed(Exception):
    pass


def _helper_entry(fn: Callable[..., None], ctrl: Any, *args: Any) -> None:
    _die_with_parent()
    try:
        fn(ctrl, *args)
    except BaseException:
        with contextlib.suppress(Exception):
            ctrl.send(("error", traceback.format_exc()))
        raise SystemExit(1) from None
    finally:
        with contextlib.suppress(Exception):
            ctrl.close()


def _wait(ctrl: Any) -> Any:
    """A helper's blocking wait for the driver's next word."""
    if not ctrl.poll(WAIT_S):
        raise TimeoutError("no word from the driver")
    return ctrl.recv()


def _ready(ctrl: Any) -> None:
    ctrl.send(("ready", {"ringwire_file": _ringwire_file(), "pid": os.getpid()}))


def _finish(ctrl: Any, info: Any = None) -> None:
    """Report, then hold the channel open until the driver says bye."""
    ctrl.send(("done", info))
    _wait(ctrl)


_proto: Any = None  # the driver's protocol stream (set by driver_main)


def _emit(msg: dict[str, Any]) -> None:
    if _proto is not None:
        _proto.write(json.dumps(msg) + "\n")
        _proto.flush()


class Helpers:
    """The helper processes of one measurement (spawn children of the driver)."""

    def __init__(self) -> None:
        self.ctx = mp.get_context("spawn")
        self.procs: list[tuple[Any, Any]] = []

    def start(self, fn: Callable[..., None], *args: Any) -> Any:
        parent_end, child_end = self.ctx.Pipe()
        proc = self.ctx.Process(
            target=_helper_entry, args=(fn, child_end, *args), daemon=True, name="rwcmp-helper"
        )
        try:
            proc.start()
        finally:
            child_end.close()
        _emit({"event": "pid", "pid": proc.pid})
        self.procs.append((proc, parent_end))
        return parent_end

    def _check(self, ctrl: Any, tag: str) -> Any:
        try:
            msg = ctrl.recv()
        except (EOFError, OSError):
            raise HelperFailed("helper died") from None
        if msg[0] == "error":
            raise HelperFailed("helper raised:\n" + msg[1])
        if msg[0] != tag:
            raise HelperFailed(f"expected {tag!r} from the helper, got {msg!r}")
        if tag == "ready" and msg[1]["ringwire_file"] != _ringwire_file():
            raise HelperFailed(
                f"helper imported ringwire from {msg[1]['ringwire_file']}, not {_ringwire_file()}"
            )
        return msg[1]

    def expect(self, ctrl: Any, tag: str, timeout: float = WAIT_S) -> Any:
        if not ctrl.poll(timeout):
            raise HelperFailed(f"timed out waiting for {tag!r} from a helper")
        return self._check(ctrl, tag)

    async def aexpect(self, ctrl: Any, tag: str, timeout: float = WAIT_S) -> Any:
        """:meth:`expect` without blocking the event loop (a handshake may need it)."""
        deadline = time.monotonic() + timeout
        while not ctrl.poll(0):
            if time.monotonic() > deadline:
                raise HelperFailed(f"timed out waiting for {tag!r} from a helper")
            await asyncio.sleep(0.002)
        return self._check(ctrl, tag)

    def close(self) -> None:
        for _, ctrl in self.procs:
            with contextlib.suppress(Exception):
                ctrl.send("bye")
        for proc, ctrl in self.procs:
            proc.join(5.0)
            if proc.is_alive():
                proc.kill()
                proc.join(2.0)
            with contextlib.suppress(Exception):
                ctrl.close()
        self.procs.clear()


_SETUP_KW: dict[str, float] = {}


def _setup_kw() -> dict[str, float]:
    """The handshake bound as this tree's ``connect`` / ``PairEnd.connect`` name it:
    ``handshake_timeout=`` from issue 23 on, ``timeout=`` before (this file measures
    both trees; the signature is read once per process)."""
    if not _SETUP_KW:
        import inspect

        import ringwire

        params = inspect.signature(ringwire.connect_sync).parameters
        name = "handshake_timeout" if "handshake_timeout" in params else "timeout"
        _SETUP_KW[name] = SETUP_S
    return _SETUP_KW


def _pool_kw(pool: bool) -> dict[str, Any]:
    """``connect`` keywords: the default slot pool, or none (``slots=None``)."""
    return {} if pool else {"slots": None}


def _rt_result(samples: list[int]) -> dict[str, Any]:
    s = sorted(samples)
    return {
        "value": statistics.median(s) / 1e3,
        "p99": s[min(len(s) - 1, int(0.99 * len(s)))] / 1e3,
        "n": len(s),
    }


# --------------------------------------------------------------------------- helpers


def _h_echo_async(ctrl: Any, end: Any, spin_us: float, total: int) -> None:
    async def main() -> None:
        chan = await end.connect(type=Req, spin_us=spin_us, **_setup_kw())
        try:
            _ready(ctrl)
            recv, send = chan.receive, chan.send
            for _ in range(total):
                await send(await recv())
            _finish(ctrl)
        finally:
            await chan.aclose()

    asyncio.run(main())


def _spin_kw(spin_us: float | None) -> dict[str, Any]:
    """``connect`` keywords: the default spin budget (``None``) or ``spin_us``."""
    return {} if spin_us is None else {"spin_us": spin_us}


def _h_echo_sync(ctrl: Any, end: Any, total: int, spin_us: float | None) -> None:
    chan = end.connect_sync(type=Req, **_setup_kw(), **_spin_kw(spin_us))
    try:
        _ready(ctrl)
        recv, send = chan.receive, chan.send
        for _ in range(total):
            send(recv(WAIT_S), WAIT_S)
        _finish(ctrl)
    finally:
        chan.close()


def _h_sink(ctrl: Any, end: Any, batch: bool, pool: bool, phases: list[int]) -> None:
    """Receive each phase's records, then answer with one record (the "all there")."""
    chan = end.connect_sync(type=Req, **_setup_kw(), **_pool_kw(pool))
    try:
        _ready(ctrl)
        ack = make_record(-1)
        for k in phases:
            got = 0
            if batch:
                rm = chan.receive_many
                while got < k:
                    got += len(rm(BATCH, WAIT_S))
            else:
                recv = chan.receive
                while got < k:
                    recv(WAIT_S)
                    got += 1
            chan.send(ack, WAIT_S)
        _finish(ctrl)
    finally:
        chan.close()


def _h_producer(ctrl: Any, path: str, phases: list[int]) -> None:
    import ringwire

    chan = ringwire.connect_sync(path, type=Req, **_setup_kw(), slots=None)
    try:
        _ready(ctrl)
        recs = [make_record(i) for i in range(BATCH)]
        for k in phases:
            if _wait(ctrl) != "go":
                raise RuntimeError("expected 'go'")
            left = k
            while left > 0:
                n = min(BATCH, left)
                chan.send_many(recs[:n] if n < BATCH else recs, WAIT_S)
                left -= n
        _finish(ctrl)
    finally:
        chan.close()


def _h_array_sink(ctrl: Any, end: Any, total: int) -> None:
    """Receive ``{"seq", "x"}``, read element 0, drop the array, answer with ``seq``."""
    chan = end.connect_sync(slots=None, **_setup_kw())
    try:
        _ready(ctrl)
        bad = 0
        recv, send = chan.receive, chan.send
        for _ in range(total):
            msg = recv(WAIT_S)
            seq = msg["seq"]
            if int(msg["x"][0]) != marker(seq):
                bad += 1
            del msg  # drop the array: a slot goes back here
            send(seq, WAIT_S)
        _finish(ctrl, {"bad": bad})
    finally:
        chan.close()


# --------------------------------------------------------------------------- measurements


def m_async_rt(n: int, warm: int, spin_us: float = 0.0) -> dict[str, Any]:
    """(a) asyncio round trips of the 100-byte record; both ends ``spin_us`` (0: parked)."""
    import ringwire

    hs = Helpers()
    a, b = ringwire.pair()
    try:
        ctrl = hs.start(_h_echo_async, b, spin_us, warm + n)

        async def main() -> list[int]:
            chan = await a.connect(type=Req, spin_us=spin_us, **_setup_kw())
            try:
                await hs.aexpect(ctrl, "ready")
                send, recv = chan.send, chan.receive
                rec = make_record(0)
                for _ in range(warm):
                    await send(rec)
                    await recv()
                out = []
                gc.disable()
                try:
                    for i in range(n):
                        t0 = clock()
                        rec.seq = i
                        await send(rec)
                        await recv()
                        out.append(clock() - t0)
                finally:
                    gc.enable()
                await hs.aexpect(ctrl, "done")
                return out
            finally:
                await chan.aclose()

        return _rt_result(asyncio.run(main()))
    finally:
        a.close()
        b.close()
        hs.close()


def m_sync_rt(n: int, warm: int, spin_us: float | None = None) -> dict[str, Any]:
    """(b) blocking round trips of the 100-byte record, on both ends the default spin
    budget (``spin_us=None``) or ``spin_us``."""
    import ringwire

    hs = Helpers()
    a, b = ringwire.pair()
    try:
        ctrl = hs.start(_h_echo_sync, b, warm + n, spin_us)
        chan = a.connect_sync(type=Req, **_setup_kw(), **_spin_kw(spin_us))
        try:
            hs.expect(ctrl, "ready")
            send, recv = chan.send, chan.receive
            rec = make_record(0)
            for _ in range(warm):
                send(rec, WAIT_S)
                recv(WAIT_S)
            out = []
            gc.disable()
            try:
                for i in range(n):
                    t0 = clock()
                    rec.seq = i
                    send(rec, WAIT_S)
                    recv(WAIT_S)
                    out.append(clock() - t0)
            finally:
                gc.enable()
            hs.expect(ctrl, "done")
        finally:
            chan.close()
        return _rt_result(out)
    finally:
        a.close()
        b.close()
        hs.close()


def m_tp(n: int, warm: int, batch: bool, pool: bool) -> dict[str, Any]:
    """(c, d) one producer -> one consumer, blocking API on both ends: ``send`` per record
    or ``send_many`` in batches of BATCH; records/s from the first send until the
    consumer's answer that it has all ``n``."""
    import ringwire

    hs = Helpers()
    a, b = ringwire.pair()
    try:
        ctrl = hs.start(_h_sink, b, batch, pool, [warm, n])
        chan = a.connect_sync(type=Req, **_setup_kw(), **_pool_kw(pool))
        try:
            hs.expect(ctrl, "ready")
            recs = [make_record(i) for i in range(BATCH)]
            elapsed = 0
            for k in (warm, n):
                gc.disable()
                try:
                    t0 = clock()
                    if batch:
                        left = k
                        while left > 0:
                            m = min(BATCH, left)
                            chan.send_many(recs[:m] if m < BATCH else recs, WAIT_S)
                            left -= m
                    else:
                        send = chan.send
                        for i in range(k):
                            send(recs[i % BATCH], WAIT_S)
                    chan.receive(WAIT_S)
                    elapsed = clock() - t0
                finally:
                    gc.enable()
            hs.expect(ctrl, "done")
        finally:
            chan.close()
        return {"value": n / elapsed * 1e9, "n": n, "seconds": elapsed / 1e9}
    finally:
        a.close()
        b.close()
        hs.close()


_sock_ids = itertools.count(1)


def m_fanin(n: int, warm: int, workdir: str, producers: int = 2) -> dict[str, Any]:
    """(e) ``producers`` processes ``send_many`` ``n`` records each into one
    ``ringwire.listen`` listener (asyncio) that drains them with
    ``Listener.receive_many``; records/s from "go" until the listener has them all."""
    import ringwire

    path = os.path.join(workdir, f"fanin-{os.getpid()}-{next(_sock_ids)}.sock")
    hs = Helpers()

    async def main() -> int:
        async with ringwire.listen(path, type=Req, slots=None) as lst:
            ctrls = [hs.start(_h_producer, path, [warm, n]) for _ in range(producers)]
            for _ in ctrls:
                await asyncio.wait_for(lst.accept(), SETUP_S)
            for c in ctrls:
                await hs.aexpect(c, "ready")
            rm = lst.receive_many
            elapsed = 0
            for k in (warm, n):
                total, got = k * producers, 0
                gc.disable()
                try:
                    t0 = clock()
                    for c in ctrls:
                        c.send("go")
                    while got < total:
                        got += len(await rm(min(BATCH, total - got)))
                    elapsed = clock() - t0
                finally:
                    gc.enable()
            for c in ctrls:
                await hs.aexpect(c, "done")
            return elapsed

    try:
        elapsed = asyncio.run(main())
    finally:
        hs.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    return {"value": n * producers / elapsed * 1e9, "n": n * producers, "seconds": elapsed / 1e9}


def m_handoff(n: int, warm: int, loaned: bool) -> dict[str, Any]:
    """(f, g) an 8 MiB numpy array to a consumer that reads element 0, drops it and
    answers; the round trip per array.  ``loaned``: ``loan()`` the array from the send
    pool, write the marker byte, send it (loan + write + send + answer are timed).
    Otherwise: send an ordinary private array (copied into a slot by ``send``)."""
    import numpy as np

    import ringwire

    hs = Helpers()
    a, b = ringwire.pair()
    try:
        ctrl = hs.start(_h_array_sink, b, warm + n)
        chan = a.connect_sync(**_setup_kw())
        try:
            hs.expect(ctrl, "ready")
            send, recv = chan.send, chan.receive
            src = None if loaned else np.ones(ARRAY_BYTES, np.uint8)
            out = []
            for i in range(warm + n):
                gc.disable()
                try:
                    t0 = clock()
                    if loaned:
                        x = chan.loan((ARRAY_BYTES,), np.uint8, timeout=WAIT_S)
                    else:
                        x = src
                    x[0] = marker(i)
                    send({"seq": i, "x": x}, WAIT_S)
                    del x
                    if recv(WAIT_S) != i:
                        raise RuntimeError("answer out of order")
                    t1 = clock()
                finally:
                    gc.enable()
                if i >= warm:
                    out.append(t1 - t0)
            info = hs.expect(ctrl, "done")
            if info["bad"]:
                raise RuntimeError(f"{info['bad']} arrays arrived with the wrong marker byte")
        finally:
            chan.close()
        return _rt_result(out)
    finally:
        a.close()
        b.close()
        hs.close()


# --------------------------------------------------------------------------- broadcast, calls
#
# These two touch entry points whose keywords were renamed (issue 23: ``timeout=`` became
# ``handshake_timeout=`` on subscribe / connect): the same file runs against both trees, so
# the keyword is chosen once per call site from the signature.


def _handshake_kw(fn: Callable[..., Any], seconds: float = SETUP_S) -> dict[str, Any]:
    """``{"handshake_timeout": s}`` where ``fn`` takes it, else the older ``{"timeout": s}``."""
    import inspect

    names = inspect.signature(fn).parameters
    return {"handshake_timeout" if "handshake_timeout" in names else "timeout": seconds}


class Step(msgspec.Struct, array_like=True):
    """A ~100-byte broadcast step carrying the writer's clock at send (one host clock)."""

    seq: int
    t: int
    tokens: list[int]
    model: str


def _h_subscriber(ctrl: Any, path: str, rank: int, spin_us: float, total: int) -> None:
    """Receive ``total`` steps; report each step's latency (receive clock - ``t``) and
    the clock when the last one arrived."""
    import ringwire

    with ringwire.subscribe_sync(
        path, rank=rank, type=Step, spin_us=spin_us, **_handshake_kw(ringwire.subscribe_sync)
    ) as sub:
        _ready(ctrl)
        lat = []
        recv = sub.receive
        for _ in range(total):
            rec = recv(WAIT_S)
            lat.append(clock() - rec.t)
        _finish(ctrl, {"lat": lat, "end": clock()})


def _broadcast_run(n: int, warm: int, readers: int, spin_us: float, gap_s: float, workdir: str) -> tuple[list[dict[str, Any]], int]:
    import ringwire

    path = os.path.join(workdir, f"bcast-{os.getpid()}-{next(_sock_ids)}.sock")
    hs = Helpers()
    try:
        with ringwire.broadcast_sync(path, readers=readers, slots=None) as bc:
            ctrls = [hs.start(_h_subscriber, path, r, spin_us, warm + n) for r in range(readers)]
            for c in ctrls:
                hs.expect(c, "ready")
            bc.wait_ready(readers, timeout=SETUP_S)
            tokens = list(range(16))
            send = bc.send
            t_first = 0
            gc.disable()
            try:
                for i in range(warm + n):
                    if i == warm:
                        t_first = clock()
                    send(Step(i, clock(), tokens, "m"), timeout=WAIT_S)
                    if gap_s:
                        time.sleep(gap_s)
            finally:
                gc.enable()
            infos = [hs.expect(c, "done") for c in ctrls]
        return infos, t_first
    finally:
        hs.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def m_bcast_step(n: int, warm: int, workdir: str, readers: int = 2) -> dict[str, Any]:
    """(h) broadcast step latency: one ``broadcast_sync`` writer, ``readers`` parked
    ``subscribe_sync`` readers (``spin_us=0``), steps paced 1 ms apart; per step the
    slowest reader's "writer send -> decoded"."""
    infos, _ = _broadcast_run(n, warm, readers, 0.0, 0.001, workdir)
    steps = [max(info["lat"][i] for info in infos) for i in range(warm, warm + n)]
    return _rt_result(steps)


def m_bcast_tp(n: int, warm: int, workdir: str, readers: int = 2) -> dict[str, Any]:
    """(i) broadcast throughput: the same writer and readers (default spin), steps sent
    back to back; steps/s from the first measured send until the last reader has all."""
    infos, t_first = _broadcast_run(n, warm, readers, ringwire_default_spin(), 0.0, workdir)
    elapsed = max(info["end"] for info in infos) - t_first
    return {"value": n / elapsed * 1e9, "n": n, "seconds": elapsed / 1e9}


def ringwire_default_spin() -> float:
    import ringwire

    return float(getattr(ringwire, "DEFAULT_SPIN_US", 50.0))


def _h_call_server(ctrl: Any, end: Any) -> None:
    import ringwire

    async def main() -> None:
        chan = await end.connect(type=Req, **_handshake_kw(end.connect))
        try:
            _ready(ctrl)

            async def echo(req: Any) -> Any:
                return req

            await ringwire.serve(chan, echo)
        finally:
            await chan.aclose()

    asyncio.run(main())
    _finish(ctrl)


def m_call_rt(n: int, warm: int) -> dict[str, Any]:
    """(j) asyncio ``Client.call`` round trip of the 100-byte record to an ``async def``
    echo handler under ``ringwire.serve`` in another process (default spin)."""
    import ringwire

    hs = Helpers()
    a, b = ringwire.pair()
    try:
        ctrl = hs.start(_h_call_server, b)

        async def main() -> list[int]:
            chan = await a.connect(type=Req, **_handshake_kw(a.connect))
            try:
                await hs.aexpect(ctrl, "ready")
                out = []
                async with ringwire.Client(chan) as client:
                    call = client.call
                    rec = make_record(0)
                    for _ in range(warm):
                        await call(rec)
                    gc.disable()
                    try:
                        for i in range(n):
                            rec.seq = i
                            t0 = clock()
                            await call(rec)
                            out.append(clock() - t0)
                    finally:
                        gc.enable()
            finally:
                await chan.aclose()
            await hs.aexpect(ctrl, "done")
            return out

        return _rt_result(asyncio.run(main()))
    finally:
        a.close()
        b.close()
        hs.close()


MEASUREMENTS: dict[str, Callable[..., dict[str, Any]]] = {
    "async_rt": m_async_rt,
    "sync_rt": m_sync_rt,
    "tp": m_tp,
    "fanin": m_fanin,
    "handoff": m_handoff,
    "bcast_step": m_bcast_step,
    "bcast_tp": m_bcast_tp,
    "call_rt": m_call_rt,
}


# --------------------------------------------------------------------------- the driver


def _on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwind: every finally closes its channels and helpers


def driver_main() -> None:
    global _proto
    _die_with_parent()
    signal.signal(signal.SIGTERM, _on_sigterm)
    _proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray output of this process and its helpers goes to stderr
    sys.stdout = sys.stderr
    emit = _emit
    import numpy as np

    import ringwire

    emit(
        {
            "event": "hello",
            "pid": os.getpid(),
            "ringwire_file": _ringwire_file(),
            "ringwire_version": getattr(ringwire, "__version__", None),
            "native": getattr(ringwire, "native", False),  # the C ring (issue 15) is active
            "numpy": np.__version__,
            "msgspec": msgspec.__version__,
            "python": sys.version.split()[0],
        }
    )
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("m") == "exit":
            break
        try:
            result = MEASUREMENTS[cmd["m"]](**cmd.get("args", {}))
        except Exception:
            emit({"ok": False, "error": traceback.format_exc()})
        else:
            emit({"ok": True, "result": result})
