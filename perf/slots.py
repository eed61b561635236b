"""Tensor handoff benchmark: ringwire's SHM slots (loans, copy-in) vs the usual IPC suspects.

Run from the repository root::

    python -m perf.slots                 # default run, ~1.5 minutes on a 2-core VM
    python -m perf.slots --quick         # fewer rounds, ~40 s
    python -m perf.slots --json out.json # also write every statistic as JSON

What is measured
----------------
*Handoff time* is the time from the producer starting the send (for copy-in: the copy
into the slot included; for a loan: the send of an already-filled loan) to the
consumer holding the array.  The consumer (a ``spawn`` child) receives the record,
reads one element of the array (checking it against a marker the producer wrote),
reads ``time.perf_counter_ns()``, replies with a tiny ack carrying that reading, and
only then drops the array (which, for a slot, releases it).  So every sample gives

* the **round trip** (producer's clock, send start -> ack received);
* the **one-way time**, measured directly: the consumer's clock reading minus the
  producer's send start (``perf_counter_ns`` is ``CLOCK_MONOTONIC`` on Linux, one
  clock for every process);
* a **one-way estimate** as the issue words it: the round trip minus half of a
  small-record round trip (a record with no array) on the same transport, measured
  in the same run, interleaved with the large ones.

Bandwidth = bytes / one-way time.  Targets are judged on the directly measured
one-way time; the estimate is printed next to it.

Cache state (copy-in tables): before every timed sample of every case -- peers and
memcpy floors alike -- the producer reads a buffer twice the size of the last-level
cache (one load per 64-byte line), so the array and its destination start cold;
then, for transports, one untimed small-record round trip warms both processes'
*code* again (a server's code paths are hot; the tensor bytes are what is cold).
Without this an 8 MiB copy whose source and destination are still cached runs 2-3x
faster than one after a multiprocessing.Queue round trip trashed the cache.  The
loaned-handoff table runs back to back, with no eviction.

Peers, for float32 numpy arrays of 8, 64 and 256 MiB (and a torch bfloat16 row at
64 MiB):

* **memcpy floor** -- ``np.copyto(dst, src)`` into a preallocated, already-touched
  private array, in this process (torch: ``dst.copy_(src)``): the copy-in target's
  yardstick.  A second floor copies into a slot of the same pool (a loan held for the
  whole table, never sent): the very memory a copy-in writes (tmpfs pages).
* **ringwire copy-in** -- ``SyncChannel.send({"seq": i, "x": array})``: copied once
  into a slot, sent as an Ext 4 reference; the consumer gets a read-only view.
* **ringwire loaned** -- ``x = chan.loan(shape, dtype)``, filled, then sent; only the
  send is timed and nothing is copied.  "Filled": every slot's pages are written once
  at setup, and per iteration the producer writes the marker into element 0.
* **ringwire inline** -- the same record on a channel with no slot pool and a 256 MiB
  ring (records up to 128 MiB fit): Ext 3 inline = encode, ring write, copying decode.
  256 MiB records do not fit that ring and are not run.
* **zmq PAIR ipc://** -- a small msgpack header frame plus ``send(array, copy=False)``;
  the consumer does ``recv_multipart(copy=False)`` and ``np.frombuffer`` on the frame.
* **multiprocessing.Queue** -- ``put((seq, array))`` (pickled); the ack on a second queue.
* **ringwire copy-in, spinning consumer** (information) -- a channel whose consumer
  spins up to 0.5 s instead of parking after 50 us, so it is awake when the copy lands.

All ringwire endpoints use the blocking API (``SyncChannel``) with the default spin
budget unless a row says otherwise; the consumer opens its end with ``slots=None``.

*Release-to-reuse*: a channel whose pool holds exactly ONE slot of the size.  The
producer loops "send an array (copy-in, or a loan filled and sent)"; the consumer
receives it, reads one element and drops it (no ack).  Every send after the first
waits until the consumer's release of the previous one reached the producer
(finalizer -> release lane -> doorbell if the producer is parked).  Reported: the
median time per iteration (between consecutive send completions, minus the memcpy of
that size for copy-in), against a plain small-record round trip on the same channel
and against a *doorbell round trip* (a channel whose ends both have ``spin_us=0``:
every record parks and rings).

Drift: the machine this runs on is noisy (2 shared cores; absolute times move 2-3x
between runs).  Every table's cases run *interleaved*: all children start, then each
round runs every case once (rotating who goes first), and statistics pool all
rounds.  Compare the ratios, not the absolute milliseconds.

Cleanup: the children are spawn processes with ``PR_SET_PDEATHSIG``; every blocking
wait on either side has a timeout, and a watchdog kills a child whose round overruns.
ringwire unlinks its ``/dev/shm`` names at handshake, the zmq socket file lives in a
temporary directory that is removed, and multiprocessing's semaphore names are
unlinked once the child has opened them.  The run ends by listing any ``/dev/shm``
name that appeared during it.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.metadata
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `perf` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import msgspec
import numpy as np

from perf import peers as P
from perf._common import fmt_ms, format_table, format_targets, machine_info, summarize

clock = time.perf_counter_ns
KiB, MiB = 1 << 10, 1 << 20

ACK, DROP = "ack", "drop"
CALL_TIMEOUT = 60.0  # seconds any single parent-side call (one case, one round) may take
OP_TIMEOUT = 30.0  # seconds any single blocking send / receive may take

# targets (from the issue)
T_LOAN_FLAT = 2.0  # loaned 256 MiB one-way <= 2 x loaned 4 KiB one-way
T_COPY_BW = 0.85  # ringwire copy-in bandwidth >= 0.85 x memcpy bandwidth (issue 27)
T_VS_MPQ = 100.0  # at 64 MiB: >= 100 x faster than multiprocessing.Queue
T_VS_ZMQ = 20.0  # at 64 MiB: >= 20 x faster than zmq copy=False
T_RR_EXTRA = 1.0  # release-to-reuse: <= ~1 round trip beyond the one round trip it needs

LOAN_SIZES = (4 * KiB, 1 * MiB, 64 * MiB, 256 * MiB)
COPY_SIZES = (8 * MiB, 64 * MiB, 256 * MiB)
INLINE_CAPACITY = 256 * MiB  # ring data bytes per lane: records up to 128 MiB go inline


def human(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", KiB)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} B"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def marker(seq: int) -> float:
    """The value the producer writes into element 0 (exact in bfloat16 too)."""
    return float(seq % 128)


# =========================================================================== children


def _first(x: Any) -> float:
    """Read element 0 of a numpy array or torch tensor (the consumer's "touch")."""
    if isinstance(x, np.ndarray):
        return float(x.flat[0])
    return float(x.reshape(-1)[0])


def _child_rw(
    ctrl: Any, ends: list[Any], names: list[str], spins: list[float | None], want_torch: bool
) -> None:
    """ringwire consumer: one blocking endpoint per channel (no send pool of its own)."""
    if want_torch:
        import torch  # noqa: F401  (import now, not inside the first timed receive)
    chans: dict[str, Any] = {}
    try:
        for name, end, spin in zip(names, ends, spins):
            kw = {} if spin is None else {"spin_us": spin}
            chans[name] = end.connect_sync(slots=None, handshake_timeout=P.SETUP_TIMEOUT_S, **kw)

        def serve(cmd: Any) -> dict[str, Any]:  # cmd: (channel, n, mode)
            name, n, mode = cmd
            ch = chans[name]
            recv, send = ch.receive, ch.send
            bad = 0
            for _ in range(n):
                msg = recv(P.CHILD_WAIT_S)
                x = msg.get("x")
                if x is not None:
                    if _first(x) != marker(msg["seq"]):
                        bad += 1
                    x = None
                t = clock()  # holding the array, one element read
                if mode == ACK:
                    send([msg["seq"], t], P.CHILD_WAIT_S)  # still holding the view
                del msg  # drop it: a slot is released here
            st = ch.statistics()
            return {
                "bad": bad,
                "slot_arrays_received": st.slot_arrays_received,
                "slot_arrays_held": st.slot_arrays_held,
                "receive_parks": st.receive_parks,
                "doorbells_sent": st.doorbells_sent,
            }

        P.serve_rounds(ctrl, serve, {"pid": os.getpid()})
    finally:
        for ch in chans.values():
            with contextlib.suppress(Exception):
                ch.close()


HDR_ENC = msgspec.msgpack.Encoder()
HDR_DEC = msgspec.msgpack.Decoder()


def _child_zmq(ctrl: Any, addr: str) -> None:
    import zmq

    zctx = zmq.Context()
    sock = zctx.socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, int(P.CHILD_WAIT_S * 1000))
    sock.setsockopt(zmq.SNDTIMEO, int(P.CHILD_WAIT_S * 1000))
    sock.connect(addr)
    try:

        def serve(cmd: Any) -> dict[str, Any]:  # cmd: (channel, n, mode)
            _, n, _mode = cmd
            bad = 0
            for _ in range(n):
                frames = sock.recv_multipart(copy=False)
                hdr = HDR_DEC.decode(frames[0].bytes)
                seq = hdr[0]
                if len(frames) > 1:
                    x = np.frombuffer(frames[1].buffer, dtype=hdr[2]).reshape(hdr[1])
                    if _first(x) != marker(seq):
                        bad += 1
                    del x
                sock.send(HDR_ENC.encode([seq, clock()]))
                del frames
            return {"bad": bad}

        P.serve_rounds(ctrl, serve, {"pid": os.getpid()})
    finally:
        sock.close(0)
        zctx.term()


def _child_mpq(ctrl: Any, q_in: Any, q_out: Any) -> None:
    def serve(cmd: Any) -> dict[str, Any]:  # cmd: (channel, n, mode)
        _, n, _mode = cmd
        bad = 0
        for _ in range(n):
            seq, x = q_in.get(timeout=P.CHILD_WAIT_S)
            if x is not None:
                if _first(x) != marker(seq):
                    bad += 1
            q_out.put((seq, clock()))
            del x
        return {"bad": bad}

    P.serve_rounds(ctrl, serve, {"pid": os.getpid()})


# =========================================================================== parent peers


class ChildFailed(Exception):
    pass


class _Peer(P.Peer):
    """A spawn child plus the bookkeeping every transport here shares."""

    last_child: dict[str, Any] | None = None  # the child's info of the last round

    def round(self, name: str, n: int, mode: str, body: Callable[[], list[Any]]) -> list[Any]:
        """Tell the child to serve ``n`` records on channel ``name`` (``mode``: ack each,
        or just drop it), run ``body`` (the parent's side), collect the child's report.
        If ``body`` fails the child may still be inside the round: the caller kills it."""
        self.ctrl.send(("round", (name, n, mode)))  # start_round() with a richer command
        out = body()
        info = self.finish_round(CALL_TIMEOUT)["info"]
        if info.get("bad"):
            raise ChildFailed(f"{info['bad']} of {n} arrays had the wrong marker value")
        self.last_child = info
        return out


def _fill_all_slots(ch: Any, classes: Any) -> None:
    """Write every page of every slot of ``ch``'s send pool once (loans of each class's
    full size, filled, then dropped): the copy-in destination is warm, like the memcpy
    floor's."""
    for c in classes:
        loans = []
        for _ in range(c.count):
            x = ch.loan((c.size,), np.uint8, timeout=OP_TIMEOUT, slot_policy="error")
            x.fill(1)
            loans.append(x)
        del loans, x


@dataclass(frozen=True)
class Spec:
    """One ringwire channel: the producer's slot pool, the ring capacity, and the
    consumer's spin budget (``None``: the default)."""

    name: str
    capacity: int
    slots: Any
    consumer_spin_us: float | None = None
    producer_spin_us: float | None = None


class RingwirePeer(_Peer):
    """The parent (producer) ends of every ringwire channel; one consumer child."""

    name = "ringwire"

    def __init__(self, specs: list[Spec], want_torch: bool) -> None:
        super().__init__()
        self.specs = specs
        self.want_torch = want_torch
        self.chans: dict[str, Any] = {}

    def setup(self) -> None:
        import ringwire

        ends = [ringwire.pair(capacity=sp.capacity) for sp in self.specs]
        try:
            self.spawn(
                _child_rw,
                [b for _, b in ends],
                [sp.name for sp in self.specs],
                [sp.consumer_spin_us for sp in self.specs],
                self.want_torch,
            )
            for sp, (a, _b) in zip(self.specs, ends):
                name, slots = sp.name, sp.slots
                kw = {} if sp.producer_spin_us is None else {"spin_us": sp.producer_spin_us}
                ch = a.connect_sync(slots=slots, handshake_timeout=P.SETUP_TIMEOUT_S, **kw)
                self.on_cleanup(ch.close)
                self.chans[name] = ch
        finally:
            for a, b in ends:  # whatever was not connected (an error): drop quietly
                for e in (a, b):
                    if e._sock is not None and not e._sent:
                        e.close()
        self.ready_info = self.expect("ready")
        for sp in self.specs:
            if sp.slots is not None:
                _fill_all_slots(self.chans[sp.name], sp.slots.classes)

    # one sample per record: send, wait for the ack
    def rt(
        self,
        chan: str,
        k: int,
        make: Callable[[int], dict[str, Any]],
        prep: Prep | None = None,
    ) -> list[tuple[int, int]]:
        """``k`` records: (round trip, one-way) nanoseconds of each."""
        ch = self.chans[chan]

        def body() -> list[tuple[int, int]]:
            send, recv = ch.send, ch.receive

            def warm() -> None:
                send(_small(0), OP_TIMEOUT)
                recv(OP_TIMEOUT)

            out = []
            for i in range(k):
                msg = make(i)  # a loan is taken and filled here, outside the clock
                if prep is not None:
                    prep.before(warm)
                t0 = clock()
                send(msg, OP_TIMEOUT)
                ack = recv(OP_TIMEOUT)
                t1 = clock()
                del msg
                out.append((t1 - t0, ack[1] - t0))
            return out

        return self.round(chan, k * Prep.msgs(prep), ACK, body)

    # release-to-reuse: no ack; the time between consecutive send completions
    def rr(self, chan: str, k: int, make: Callable[[int], dict[str, Any]]) -> list[int]:
        ch = self.chans[chan]

        def body() -> list[int]:
            send = ch.send
            stamps = []
            for i in range(k):
                msg = make(i)  # a loan waits here for the one slot to come back
                send(msg, OP_TIMEOUT)  # a copy-in waits here
                stamps.append(clock())
                del msg
            return [b - a for a, b in zip(stamps, stamps[1:])]

        return self.round(chan, k, DROP, body)

    def stats(self) -> dict[str, Any]:
        out = {}
        for name, ch in self.chans.items():
            with contextlib.suppress(Exception):
                st = ch.statistics()
                out[name] = {
                    "inline_fallbacks": st.inline_fallbacks,
                    "releases_received": st.releases_received,
                    "slots_in_use": st.slots_in_use,
                    "send_parks": st.send_parks,
                    "receive_parks": st.receive_parks,
                    "doorbells_received": st.doorbells_received,
                }
        return out


class ZmqPeer(_Peer):
    name = "zmq"

    def setup(self) -> None:
        try:
            import zmq
        except ImportError as e:
            raise P.PeerUnavailable("pyzmq not installed") from e
        d = P.tmpdir(self)
        addr = f"ipc://{d}/pair.sock"
        self.zctx = zmq.Context()
        self.sock = self.zctx.socket(zmq.PAIR)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, int(OP_TIMEOUT * 1000))
        self.sock.setsockopt(zmq.SNDTIMEO, int(OP_TIMEOUT * 1000))
        self.sock.bind(addr)
        self.on_cleanup(self._close_sock)
        self.spawn(_child_zmq, addr)
        self.ready_info = self.expect("ready")
        self._more = zmq.SNDMORE

    def _close_sock(self) -> None:
        self.sock.close(0)
        self.zctx.term()

    def rt(self, k: int, arr: Any, prep: Prep | None = None) -> list[tuple[int, int]]:
        sock, more = self.sock, self._more

        def warm() -> None:
            sock.send(HDR_ENC.encode([0]))
            sock.recv()

        def body() -> list[tuple[int, int]]:
            out = []
            for i in range(k):
                if arr is None:
                    hdr = HDR_ENC.encode([i])
                else:
                    arr.flat[0] = marker(i)
                    hdr = HDR_ENC.encode([i, list(arr.shape), arr.dtype.str])
                if prep is not None:
                    prep.before(warm)
                t0 = clock()
                if arr is None:
                    sock.send(hdr)
                else:
                    sock.send(hdr, more)
                    sock.send(arr, copy=False)
                ack = sock.recv()
                t1 = clock()
                out.append((t1 - t0, HDR_DEC.decode(ack)[1] - t0))
            return out

        return self.round("zmq", k * Prep.msgs(prep), ACK, body)


class MpQueuePeer(_Peer):
    name = "multiprocessing.Queue"
    sem_names: set[str] = set()

    def setup(self) -> None:
        self.q_in = self.ctx.Queue()
        self.q_out = self.ctx.Queue()
        self.on_cleanup(self._close_qs)
        self.spawn(_child_mpq, self.q_in, self.q_out)
        self.ready_info = self.expect("ready")
        attrs = ("_rlock", "_wlock", "_sem")
        locks = [getattr(q, a, None) for q in (self.q_in, self.q_out) for a in attrs]
        self.sem_names = {lk._semlock.name for lk in locks if lk is not None}
        P.unlink_semlocks(*locks)

    def _close_qs(self) -> None:
        for q in (self.q_in, self.q_out):
            q.close()
            q.join_thread()

    def rt(self, k: int, arr: Any, prep: Prep | None = None) -> list[tuple[int, int]]:
        put, get = self.q_in.put, self.q_out.get

        def warm() -> None:
            put((0, None))
            get(timeout=OP_TIMEOUT)

        def body() -> list[tuple[int, int]]:
            out = []
            for i in range(k):
                if arr is not None:
                    arr.flat[0] = marker(i)
                if prep is not None:
                    prep.before(warm)
                t0 = clock()
                put((i, arr))
                ack = get(timeout=OP_TIMEOUT)
                t1 = clock()
                out.append((t1 - t0, ack[1] - t0))
            return out

        return self.round("mpq", k * Prep.msgs(prep), ACK, body)


@dataclass(frozen=True)
class Prep:
    """What happens before each timed sample of a large-array case (outside the clock).

    ``evict``: read a buffer twice the last-level cache, so the array and the
    destination start cold.  ``warm``: then one untimed small-record round trip on the
    same transport, so both processes' *code* paths are warm again (a server's are: it
    runs them all the time; the tensor bytes are what is cold).  ``idle_ns``: then
    busy-wait this long, so the peer has given up spinning and parked (used for the
    small-record reference of the one-way estimates)."""

    evict: Callable[[], None] | None = None
    warm: bool = False
    idle_ns: int = 0

    @staticmethod
    def msgs(prep: Prep | None) -> int:
        """Records the child serves per sample."""
        return 2 if prep is not None and prep.warm else 1

    def before(self, warm_rt: Callable[[], Any]) -> None:
        if self.evict is not None:
            self.evict()
        if self.warm:
            warm_rt()
        if self.idle_ns:
            end = clock() + self.idle_ns
            while clock() < end:
                pass


class Evictor:
    """Reads a buffer twice the size of the last-level cache, one load per cache line,
    before every sample of a large-array case: every copy starts from the same (cold,
    clean) cache, whatever case ran before it.  Without it an 8 MiB copy whose source
    and destination are still cached (L3 is 32 MiB here) runs 2-3x faster than one
    after a multiprocessing.Queue round trip trashed the cache."""

    def __init__(self) -> None:
        self.scratch = np.ones(max(2 * _llc_bytes(), 64 * MiB) // 8, np.uint64)
        self.lines = self.scratch[::8]  # one element per 64-byte line

    def evict(self) -> None:
        int(self.lines.sum())


def _llc_bytes() -> int:
    best = 0
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    try:
        for idx in base.glob("index*"):
            size = (idx / "size").read_text().strip()
            mult = {"K": KiB, "M": MiB}.get(size[-1:], 1)
            best = max(best, int(size.rstrip("KM")) * mult)
    except (OSError, ValueError):
        pass
    return best or 32 * MiB


# =========================================================================== runner


@dataclass
class Case:
    name: str
    run: Callable[[int], list[Any]]  # k -> samples (ns), or (round trip, one-way) pairs
    k: int  # samples per round
    skip: int = 0  # samples discarded at the start of every round
    peer: Any = None  # the peer whose child it needs (failures drop its other cases)
    ref: str | None = ""  # transport key of its small-RT reference; None: in-process copy


@dataclass
class Group:
    samples: dict[str, list[int]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    wrong: dict[str, str] = field(default_factory=dict)  # a wrong answer: fails the run
    refs: dict[str, str | None] = field(default_factory=dict)
    # one-way times measured directly (the consumer's clock reading, sent back in the ack)
    oneway: dict[str, list[int]] = field(default_factory=dict)
    # CPU used by everything else on the machine while the group ran (cores)
    load: dict[str, Any] = field(default_factory=dict)
    # one-way readings outside [0, round trip]: the processes' clocks disagree
    clock_bad: int = 0


def _watchdog(peer: Any, timeout: float) -> threading.Timer:
    dog = threading.Timer(timeout + 5.0, peer.kill_child if peer is not None else (lambda: None))
    dog.daemon = True
    dog.start()
    return dog


def _why(e: BaseException) -> str:
    s = f"{type(e).__name__}: {e}"
    return s.strip().splitlines()[0][:200] if "\n" not in s[:200] else s.split("\n")[0][:200]


def run_group(title: str, cases: list[Case], rounds: int, warm_rounds: int) -> Group:
    out = Group()
    live = list(cases)
    for c in live:
        out.samples[c.name] = []
        out.refs[c.name] = c.ref
    log(f"{title}: {len(cases)} cases, {warm_rounds} + {rounds} rounds")
    gc.collect()
    pids = [os.getpid()] + sorted(
        {c.peer.proc.pid for c in cases if c.peer is not None and c.peer.proc is not None}
    )
    load0 = _load_snapshot(pids)
    for r in range(warm_rounds + rounds):
        k = len(live)
        order = [live[(r + j) % k] for j in range(k)]
        for c in order:
            if c not in live:
                continue
            dog = _watchdog(c.peer, CALL_TIMEOUT)
            gc.disable()
            try:
                s = c.run(c.k + c.skip)
            except KeyboardInterrupt:
                raise
            except BaseException as e:
                why = _why(e)
                if isinstance(e, ChildFailed):
                    out.wrong[c.name] = why
                log(f"  FAILED {c.name}: {why}")
                for d in list(live):
                    if d is c or (c.peer is not None and d.peer is c.peer):
                        out.failed[d.name] = why
                        live.remove(d)
                if c.peer is not None:
                    c.peer.kill_child()
                continue
            finally:
                gc.enable()
                dog.cancel()
            if r >= warm_rounds:
                s = s[c.skip :]
                if s and isinstance(s[0], tuple):
                    out.oneway.setdefault(c.name, []).extend(x[1] for x in s)
                    out.clock_bad += sum(1 for rt, ow in s if not 0 <= ow <= rt)
                    s = [x[0] for x in s]
                out.samples[c.name].extend(s)
        gc.collect()
        log(f"  round {r + 1}/{warm_rounds + rounds} done")
    if out.clock_bad:
        log(f"  WARNING: {out.clock_bad} one-way readings outside [0, round trip]")
    load1 = _load_snapshot(pids)
    if load0 is not None and load1 is not None:
        secs = load1[3] - load0[3]
        hz = os.sysconf("SC_CLK_TCK")
        busy, steal, ours = (load1[i] - load0[i] for i in range(3))
        out.load = {
            "seconds": secs,
            "other_cores": max(0, busy - ours) / hz / secs if secs > 0 else None,
            "steal_cores": steal / hz / secs if secs > 0 else None,
        }
    return out


def _load_snapshot(pids: list[int]) -> tuple[int, int, int, float] | None:
    """(machine busy ticks, steal ticks, ticks of ``pids``, monotonic seconds)."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = v
    ours = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            ours += int(fields[11]) + int(fields[12])
        except (OSError, ValueError, IndexError):
            pass
    return user + nice + system + irq + softirq, steal, ours, time.monotonic()


# =========================================================================== config


@dataclass
class Config:
    loan_rounds: int
    loan_k: int  # loaned / small round trips per case per round
    copy_rounds: dict[int, int]  # size -> measured rounds
    copy_k: dict[int, int]  # size -> samples per case per round
    small_k: int  # small-record round trips per transport per round
    idle_k: int  # "idle peer" small-record round trips per transport per round
    rr_rounds: int
    rr_k: int  # iterations per release-to-reuse round
    warm_rounds: int = 1


QUICK = Config(
    loan_rounds=8,
    loan_k=20,
    copy_rounds={8 * MiB: 10, 64 * MiB: 6, 256 * MiB: 4},
    copy_k={8 * MiB: 2, 64 * MiB: 1, 256 * MiB: 1},
    small_k=20,
    idle_k=3,
    rr_rounds=8,
    rr_k=40,
)
FULL = Config(
    loan_rounds=20,
    loan_k=30,
    copy_rounds={8 * MiB: 30, 64 * MiB: 20, 256 * MiB: 12},
    copy_k={8 * MiB: 3, 64 * MiB: 1, 256 * MiB: 1},
    small_k=30,
    idle_k=4,
    rr_rounds=20,
    rr_k=60,
)


def main_pool() -> Any:
    from ringwire import SlotClass, SlotConfig

    return SlotConfig(
        classes=(
            SlotClass(4 * KiB, 4),
            SlotClass(1 * MiB, 4),
            SlotClass(8 * MiB, 4),
            SlotClass(64 * MiB, 4),
            SlotClass(256 * MiB, 3),
        ),
        threshold=4 * KiB,
        policy="wait",
    )


# An info row: the consumer spins up to this long before it parks, so that it is awake
# when a large copy-in lands (what the default 50 us budget cannot do for copies that
# take milliseconds); costs the consumer a core while it waits.
HOT_CONSUMER_SPIN_US = 500_000.0
IDLE_PAUSE_NS = 1_000_000  # > any default spin budget (50 us): the peer parks


def hot_pool() -> Any:
    from ringwire import SlotClass, SlotConfig

    return SlotConfig(
        classes=(SlotClass(8 * MiB, 2), SlotClass(64 * MiB, 2), SlotClass(256 * MiB, 2)),
        threshold=4 * KiB,
    )


# release-to-reuse cases: (channel name, kind, bytes, spin_us of both ends or None)
RR_CASES: tuple[tuple[str, str, int, float | None], ...] = (
    ("rr-loan-4k", "loan", 4 * KiB, None),
    ("rr-copy-4k", "copy", 4 * KiB, None),
    ("rr-copy-1m", "copy", 1 * MiB, None),
    ("rr-loan-64m", "loan", 64 * MiB, None),
    # info: both ends spin (up to 0.5 s) instead of parking: the slot machinery's own cost
    ("rr-loan-4k-spin", "loan", 4 * KiB, HOT_CONSUMER_SPIN_US),
)


def one_slot(size: int) -> Any:
    from ringwire import SlotClass, SlotConfig

    return SlotConfig(classes=(SlotClass(size, 1),), threshold=min(size, 4 * KiB), policy="wait")


# =========================================================================== report


@dataclass
class Report:
    targets: list[dict[str, Any]] = field(default_factory=list)
    tables: dict[str, str] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)

    def target(self, what: str, value: float | None, limit: float, op: str, shown: str) -> None:
        if value is None or value != value:
            status = "n/a"
        else:
            ok = value <= limit if op == "<=" else value >= limit
            status = "HIT" if ok else "MISS"
        self.targets.append(
            {
                "target": what,
                "value": value,
                "limit": limit,
                "op": op,
                "shown": shown,
                "status": status,
            }
        )

    def table(self, key: str, title: str, text: str, note: str = "") -> None:
        self.tables[key] = text + ("\n\n" + note if note else "")
        print(f"\n### {title}\n")
        print(text)
        if note:
            print("\n" + note)


def _stats(samples: list[int]) -> Any:
    return summarize(samples) if samples else None


def _cell(st: Any) -> str:
    return f"{fmt_ms(st.median_ms)} / {fmt_ms(st.p99_ms)}" if st is not None else "—"


def _x(v: float | None, digits: int = 2) -> str:
    if v is None or v != v:
        return "—"
    if v >= 100:
        return f"{v:.0f}×"
    if v >= 10:
        return f"{v:.1f}×"
    return f"{v:.{digits}f}×"


def _gbps(nbytes: int, ns: float | None) -> float | None:
    return nbytes / ns if ns and ns > 0 else None


# =========================================================================== main


def _versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for dist in ("ringwire", "msgspec", "numpy", "torch", "pyzmq", "posix_ipc"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


def _shm_thp() -> str | None:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read_text()
    except OSError:
        return None
    a, b = text.find("["), text.find("]")
    return text[a + 1 : b] if 0 <= a < b else text.strip()


def _ours(names: set[str], pids: set[int], sems: set[str]) -> list[str]:
    """The ``/dev/shm`` names this run made: ringwire's ``rw.<pid>.*`` of our
    processes, and our multiprocessing semaphores (other programs on the machine may
    create and remove names of their own meanwhile)."""
    out = []
    for n in names:
        parts = n.split(".")
        if len(parts) >= 3 and parts[1].isdigit() and int(parts[1]) in pids:
            out.append(n)
        elif n.startswith("sem.") and "/" + n[4:] in sems:
            out.append(n)
    return sorted(out)


def _shm_names() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


class Bench:
    """Builds the cases of every table from the live peers."""

    def __init__(self, cfg: Config, rw: RingwirePeer, zq: ZmqPeer | None, mq: MpQueuePeer | None):
        self.cfg, self.rw, self.zq, self.mq = cfg, rw, zq, mq
        try:
            import torch

            self.torch: Any = torch
        except ImportError:
            self.torch = None
        # small-record round trips per transport key: fn(n, prep) and the peer
        self.smalls: dict[str, tuple[Callable[[int, Any], list[Any]], Any]] = {
            "ringwire": (lambda n, pre: rw.rt("main", n, _small, pre), rw),
            "ringwire inline": (lambda n, pre: rw.rt("inline", n, _small, pre), rw),
            "ringwire (spinning consumer)": (lambda n, pre: rw.rt("hot", n, _small, pre), rw),
        }
        if zq is not None:
            self.smalls["zmq"] = (lambda n, pre: zq.rt(n, None, pre), zq)
        if mq is not None:
            self.smalls["mp.Queue"] = (lambda n, pre: mq.rt(n, None, pre), mq)

    # -- building blocks

    def small_cases(self, keys: list[str], idle: Prep | None = None) -> list[Case]:
        """Small-record round trips: back to back (both ends catch each other while
        spinning) and, with ``idle``, "idle peer": each one after the same eviction and
        warm-up as the large cases, then a pause longer than any spin budget, so that
        both ends park, as they do around a large copy."""
        out = []
        for key in keys:
            if key not in self.smalls:
                continue
            fn, peer = self.smalls[key]
            out.append(Case(f"{key} small RT", _bind(fn, None), self.cfg.small_k, 3, peer))
            if idle is not None:
                out.append(
                    Case(f"{key} small RT, idle peer", _bind(fn, idle), self.cfg.idle_k, 1, peer)
                )
        return out

    def loan_maker(self, chan: str, shape: tuple[int, ...], dtype: Any) -> Callable[[int], dict]:
        ch = self.rw.chans[chan]
        is_torch = self.torch is not None and isinstance(dtype, self.torch.dtype)

        def make(i: int) -> dict[str, Any]:
            x = ch.loan(shape, dtype, timeout=OP_TIMEOUT)
            if is_torch:
                x.view(-1)[0] = marker(i)
            else:
                x.flat[0] = marker(i)
            return {"seq": i, "x": x}

        return make

    @staticmethod
    def copy_maker(src: Any) -> Callable[[int], dict]:
        is_torch = not isinstance(src, np.ndarray)

        def make(i: int) -> dict[str, Any]:
            if is_torch:
                src.view(-1)[0] = marker(i)
            else:
                src.flat[0] = marker(i)
            return {"seq": i, "x": src}

        return make

    @staticmethod
    def memcpy_case(name: str, dst: Any, src: Any, k: int, prep: Prep | None = None) -> Case:
        if isinstance(src, np.ndarray):

            def copy() -> None:
                np.copyto(dst, src)
        else:

            def copy() -> None:
                dst.copy_(src)

        def run(n: int) -> list[int]:
            out = []
            for _ in range(n):
                if prep is not None and prep.evict is not None:
                    prep.evict()
                t0 = clock()
                copy()
                out.append(clock() - t0)
            return out

        return Case(name, run, k, 0, None, None)

    def rw_case(
        self,
        name: str,
        chan: str,
        mk: Callable[[int], dict],
        k: int,
        skip: int = 0,
        prep: Prep | None = None,
    ) -> Case:
        rw = self.rw
        return Case(name, lambda n: rw.rt(chan, n, mk, prep), k, skip, rw, CHAN_REF[chan])

    # -- the tables

    def loaned_cases(self) -> list[Case]:
        cfg, torch = self.cfg, self.torch
        cases = self.small_cases(["ringwire"])
        for size in LOAN_SIZES:
            mk = self.loan_maker("main", (size // 4,), np.float32)
            cases.append(self.rw_case(f"ringwire loaned {human(size)}", "main", mk, cfg.loan_k, 2))
        if torch is not None:
            mk = self.loan_maker("main", (32 * MiB,), torch.bfloat16)
            cases.append(
                self.rw_case("ringwire loaned torch bf16 64 MiB", "main", mk, cfg.loan_k, 2)
            )
        return cases

    def copy_cases(self, size: int, ev: Callable[[], None]) -> tuple[list[Case], Any]:
        """The cases of one copy-in size, and a loan to drop when the group is done."""
        cfg, torch, zq, mq = self.cfg, self.torch, self.zq, self.mq
        n_el = size // 4
        src = np.ones(n_el, np.float32)
        dst = np.ones(n_el, np.float32)
        # the copy-in's own destination memory: a slot of the same pool, held as a loan
        # (never sent) for the whole group
        held = self.rw.chans["main"].loan((n_el,), np.float32, timeout=OP_TIMEOUT)
        k = cfg.copy_k[size]
        prep = Prep(evict=ev, warm=True)
        cases = [
            self.memcpy_case("memcpy np.copyto (floor)", dst, src, k, prep),
            self.memcpy_case("memcpy into a slot (a held loan)", held, src, k, prep),
            self.rw_case("ringwire copy-in", "main", self.copy_maker(src), k, prep=prep),
            self.rw_case(
                "ringwire loaned",
                "main",
                self.loan_maker("main", (n_el,), np.float32),
                k,
                prep=prep,
            ),
        ]
        inline = size + 1024 <= INLINE_CAPACITY // 2 - 4
        if inline:
            mk = self.copy_maker(src)
            cases.append(
                self.rw_case("ringwire inline (Ext 3, no slots)", "inline", mk, k, prep=prep)
            )
        if zq is not None:
            cases.append(
                Case("zmq PAIR copy=False", lambda n: zq.rt(n, src, prep), k, 0, zq, "zmq")
            )
        if mq is not None:
            cases.append(
                Case("multiprocessing.Queue", lambda n: mq.rt(n, src, prep), k, 0, mq, "mp.Queue")
            )
        if size == 64 * MiB and torch is not None:
            tsrc = torch.ones(size // 2, dtype=torch.bfloat16)
            tdst = torch.ones(size // 2, dtype=torch.bfloat16)
            cases.append(
                self.memcpy_case("torch bf16: memcpy dst.copy_ (floor)", tdst, tsrc, k, prep)
            )
            mk = self.copy_maker(tsrc)
            cases.append(self.rw_case("torch bf16: ringwire copy-in", "main", mk, k, prep=prep))
        cases.append(
            self.rw_case(
                "ringwire copy-in, spinning consumer (info)",
                "hot",
                self.copy_maker(src),
                k,
                prep=prep,
            )
        )
        keys = ["ringwire", "ringwire (spinning consumer)", "zmq", "mp.Queue"]
        idle = Prep(evict=ev, warm=True, idle_ns=IDLE_PAUSE_NS)
        return cases + self.small_cases(keys + (["ringwire inline"] if inline else []), idle), held

    def rr_cases(self) -> list[Case]:
        cfg, rw = self.cfg, self.rw
        cases = []
        cases.append(self.rw_case("doorbell small RT", "doorbell", _small, cfg.small_k, 3))
        for name, kind, size, _spin in RR_CASES:
            cases.append(self.rw_case(f"{name}: small RT", name, _small, cfg.small_k, 3))
            if kind == "loan":
                mk = self.loan_maker(name, (size // 4,), np.float32)
            else:
                src = np.ones(size // 4, np.float32)
                mk = self.copy_maker(src)
                dst = np.ones(size // 4, np.float32)
                cases.append(self.memcpy_case(f"{name}: memcpy", dst, src, cfg.small_k))
            cases.append(
                Case(f"{name}: per iteration", _bind_rr(rw, name, mk), cfg.rr_k, 2, rw, None)
            )
        return cases


def _small(i: int) -> dict[str, Any]:
    return {"seq": i}


def _bind(fn: Callable[[int, Any], list[Any]], pre: Any) -> Callable[[int], list[Any]]:
    return lambda n: fn(n, pre)


def _bind_rr(rw: RingwirePeer, chan: str, mk: Callable[[int], dict]) -> Callable[[int], list[int]]:
    return lambda n: rw.rr(chan, n, mk)


# transport key (of the small-RT reference) of each ringwire channel
CHAN_REF = {
    "main": "ringwire",
    "inline": "ringwire inline",
    "hot": "ringwire (spinning consumer)",
    "doorbell": "ringwire doorbell",
    **{name: name for name, _k, _s, _c in RR_CASES},
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds (< 2 minutes)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    ap.add_argument(
        "--copy-sizes",
        type=int,
        nargs="+",
        choices=[s // MiB for s in COPY_SIZES],
        metavar="MIB",
        help="copy-in tables of only these sizes (MiB; default: "
        + ", ".join(str(s // MiB) for s in COPY_SIZES)
        + ")",
    )
    args = ap.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    copy_sizes = [s for s in COPY_SIZES if not args.copy_sizes or s // MiB in args.copy_sizes]
    t_start = time.monotonic()
    shm_before = _shm_names()
    my_pids = {os.getpid()}

    try:
        import torch

        torch_ok = True
    except ImportError:
        torch = None  # type: ignore[assignment]
        torch_ok = False

    info = machine_info()
    info["versions"] = _versions()
    info["shmem_thp"] = _shm_thp()
    info["loadavg_start"] = os.getloadavg()
    if torch_ok:
        info["torch_threads"] = torch.get_num_threads()
    print("## Tensor handoff benchmark (slots)" + (" (--quick)" if args.quick else ""))
    print()
    print(
        f"- platform: {info['platform']}; CPU: {info['cpu']}; cpus: {info['cpu_count']} "
        f"({info['cpus_usable']} usable); python {info['python']}; libc {info['libc']}"
    )
    print(
        f"- transparent huge pages: {info['thp']} (anonymous), {info['shmem_thp']} (/dev/shm)"
        + (f"; torch intra-op threads: {info['torch_threads']}" if torch_ok else "")
    )
    print("- versions: " + ", ".join(f"{k} {v}" for k, v in info["versions"].items()))
    print(f"- load average at start: {info['loadavg_start'][0]:.2f}")

    rep = Report()
    specs = [
        Spec("main", 1 * MiB, main_pool()),
        Spec("inline", INLINE_CAPACITY, None),
        Spec("hot", 1 * MiB, hot_pool(), HOT_CONSUMER_SPIN_US),
        # a "doorbell round trip": both ends park at once, every record rings
        Spec("doorbell", 1 * MiB, None, 0.0, 0.0),
    ] + [Spec(name, 1 * MiB, one_slot(size), spin, spin) for name, _kind, size, spin in RR_CASES]
    rw = RingwirePeer(specs, want_torch=torch_ok)
    zq = ZmqPeer()
    mq = MpQueuePeer()
    peers: list[Any] = [rw, zq, mq]
    live_peers: list[Any] = []
    skipped: dict[str, str] = {}
    wrong: dict[str, str] = {}  # case -> why: arrays that arrived with the wrong bytes
    try:
        for p in peers:
            log(f"starting {p.name}")
            dog = _watchdog(p, P.SETUP_TIMEOUT_S)
            try:
                try:
                    p.setup()
                finally:
                    if p.proc is not None:
                        my_pids.add(p.proc.pid)
                live_peers.append(p)
            except P.PeerUnavailable as e:
                skipped[p.name] = str(e)
                log(f"  skipped {p.name}: {e}")
                p.close()
            except Exception as e:
                skipped[p.name] = _why(e)
                log(f"  FAILED to start {p.name}: {_why(e)}")
                p.close()
            finally:
                dog.cancel()
        if rw not in live_peers:
            raise SystemExit("ringwire peer could not start: " + skipped.get(rw.name, "?"))
        bench = Bench(cfg, rw, zq if zq in live_peers else None, mq if mq in live_peers else None)

        # 1. loaned handoff
        g_loan = run_group("loaned handoff", bench.loaned_cases(), cfg.loan_rounds, cfg.warm_rounds)
        rep.data["loaned"] = {
            n: {
                "round_trip": _stats(s).to_dict(),
                "one_way": _ow(g_loan, n).to_dict() if g_loan.oneway.get(n) else None,
            }
            for n, s in g_loan.samples.items()
            if s
        }
        rep.data["other_load"] = {"loaned": g_loan.load}
        report_loaned(g_loan, rep)

        # 2. copy-in handoff, one group per size
        g_copy: dict[int, Group] = {}
        evictor = Evictor()
        for size in copy_sizes:
            cases, held = bench.copy_cases(size, evictor.evict)
            g_copy[size] = run_group(
                f"copy-in {human(size)}", cases, cfg.copy_rounds[size], cfg.warm_rounds
            )
            del cases, held  # the held loan goes back to the pool
        del evictor
        report_copy(g_copy, rep)
        rep.data["other_load"].update({human(k): g.load for k, g in g_copy.items()})

        # 3. release-to-reuse
        g_rr = run_group("release-to-reuse", bench.rr_cases(), cfg.rr_rounds, cfg.warm_rounds)
        report_rr(g_rr, rep)
        rep.data["other_load"]["release-to-reuse"] = g_rr.load

        for g in (g_loan, *g_copy.values(), g_rr):
            wrong.update(g.wrong)
        rep.data["ringwire_channel_stats"] = rw.stats()
        for name, st in rep.data["ringwire_channel_stats"].items():
            if name != "inline" and st.get("inline_fallbacks"):
                print(f"\nWARNING: channel {name}: {st['inline_fallbacks']} arrays went inline")
    finally:
        for p in peers:
            with contextlib.suppress(Exception):
                p.close()

    print("\n### Targets\n")
    print(format_targets(rep.targets))
    if skipped:
        print("\nskipped peers: " + "; ".join(f"{k}: {v}" for k, v in skipped.items()))
    elapsed = time.monotonic() - t_start
    info["loadavg_end"] = os.getloadavg()
    leaked = _ours(_shm_names() - shm_before, my_pids, mq.sem_names)
    print(
        f"\n(total {elapsed:.0f} s; load average at end: {info['loadavg_end'][0]:.2f}; "
        f"/dev/shm names of this run left: {len(leaked)})"
    )
    if leaked:
        print("left in /dev/shm: " + ", ".join(leaked))
    for name, why in wrong.items():
        print(f"WRONG ANSWER: {name}: {why}")
    if args.json:
        out = {
            "machine": info,
            "config": {
                k: (v if not isinstance(v, dict) else {str(a): b for a, b in v.items()})
                for k, v in cfg.__dict__.items()
            },
            "quick": args.quick,
            "results": rep.data,
            "targets": rep.targets,
            "tables": rep.tables,
            "elapsed_s": elapsed,
            "skipped": skipped,
            "wrong": wrong,
            "shm_left": leaked,
        }
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=2, default=str) + "\n", encoding="utf-8")
        log(f"wrote {path}")
    # a missed speed target is a result; an array that arrived wrong, or a name of this
    # run left in /dev/shm, means the run itself is wrong
    return 1 if wrong or leaked else 0


# --------------------------------------------------------------------------- reports


def _med(g: Group, name: str) -> float | None:
    s = g.samples.get(name)
    return float(statistics.median(s)) if s else None


def load_note(groups: dict[str, Group]) -> str:
    """One line: the CPU everything else on the machine used while each group ran."""
    parts = []
    for name, g in groups.items():
        ld = g.load
        if ld.get("other_cores") is not None:
            parts.append(
                f"{name} {ld['other_cores']:.2f} cores (steal {ld['steal_cores']:.2f}) "
                f"over {ld['seconds']:.0f} s"
            )
    note = ("other load on the machine while measuring: " + "; ".join(parts)) if parts else ""
    bad = sum(g.clock_bad for g in groups.values())
    if bad:
        note += f"\nWARNING: {bad} one-way readings outside [0, round trip] (clocks disagree)"
    return note


def _ow(g: Group, name: str) -> Any:
    """Stats of the directly measured one-way times of a case (None if none)."""
    return _stats(g.oneway.get(name, []))


def _ms(ns: float | None) -> str:
    return fmt_ms(ns / 1e6) if ns is not None else "—"


def report_loaned(g: Group, rep: Report) -> None:
    rt_small = _med(g, "ringwire small RT")
    headers = [
        "payload",
        "round trip ms",
        "one-way ms (consumer's clock)",
        "one-way est. ms (RT − small RT/2)",
        "one-way ÷ 4 KiB",
        "round trip ÷ 4 KiB",
    ]
    base_rt = _med(g, "ringwire loaned 4 KiB")
    base_ow = _ow(g, "ringwire loaned 4 KiB")
    rows = []
    for name, s in g.samples.items():
        st = _stats(s)
        label = name.removeprefix("ringwire loaned ")
        if name == "ringwire small RT":
            label = "small record, no array (reference)"
        if st is None:
            rows.append([label, "failed: " + g.failed.get(name, "?")[:60]] + ["—"] * 4)
            continue
        ow = _ow(g, name)
        est = st.median_ns - rt_small / 2 if rt_small and name != "ringwire small RT" else None
        rows.append(
            [
                label,
                _cell(st),
                _cell(ow),
                _ms(est),
                _x(ow.median_ns / base_ow.median_ns if ow and base_ow else None),
                _x(st.median_ns / base_rt if base_rt else None),
            ]
        )
    rep.table(
        "loaned",
        "Loaned handoff (ringwire, blocking API): send an already-filled loan → consumer "
        "holds the view (medians / p99, ms)",
        format_table(headers, rows),
        load_note({"loaned": g}),
    )
    big, ow_big = _med(g, "ringwire loaned 256 MiB"), _ow(g, "ringwire loaned 256 MiB")
    r = ow_big.median_ns / base_ow.median_ns if ow_big and base_ow else None
    r_rt = big / base_rt if big and base_rt else None
    est = (big - rt_small / 2) / (base_rt - rt_small / 2) if big and base_rt and rt_small else None
    rep.target(
        f"loaned handoff flat: 256 MiB ≤ {T_LOAN_FLAT:g}× 4 KiB (one-way)",
        r,
        T_LOAN_FLAT,
        "<=",
        f"{_x(r)} (estimate: {_x(est)}; round trip: {_x(r_rt)})",
    )


def report_copy(groups: dict[int, Group], rep: Report) -> None:
    headers = [
        "size",
        "peer",
        "round trip ms",
        "one-way ms (consumer's clock)",
        "one-way est. ms",
        "GB/s",
        "× memcpy",
        "× slot memcpy",
        "one-way ÷ ringwire copy-in",
    ]
    rows = []
    ref_rows = []
    data: dict[str, Any] = {}
    for size, g in groups.items():

        def oneway(name: str, g: Group = g) -> float | None:
            """The median one-way time: measured directly; for in-process copies, the
            copy time itself."""
            if g.refs.get(name, "") is None:
                return _med(g, name)
            st = _ow(g, name)
            return st.median_ns if st is not None else None

        def estimate(name: str, g: Group = g) -> float | None:
            m, ref = _med(g, name), g.refs.get(name)
            if m is None or not ref:
                return None
            sm = _med(g, f"{ref} small RT, idle peer")
            return m - sm / 2 if sm is not None else None

        floor_bw = _gbps(size, _med(g, "memcpy np.copyto (floor)"))
        slot_bw = _gbps(size, _med(g, "memcpy into a slot (a held loan)"))
        tfloor_bw = _gbps(size, _med(g, "torch bf16: memcpy dst.copy_ (floor)"))
        rw_ow = oneway("ringwire copy-in")
        gd: dict[str, Any] = {}
        for name, s in g.samples.items():
            if " small RT" in name:
                continue
            st = _stats(s)
            is_torch = name.startswith("torch")
            label = human(size) + (" bf16" if is_torch else "")
            if st is None:
                why = g.failed.get(name, "?")[:60]
                rows.append([label, name, "failed: " + why] + ["—"] * 6)
                continue
            in_process = g.refs.get(name, "") is None
            ow, est = oneway(name), estimate(name)
            bw = _gbps(size, ow)
            fb = tfloor_bw if is_torch else floor_bw
            rows.append(
                [
                    label,
                    name.removeprefix("torch bf16: "),
                    "—" if in_process else _cell(st),
                    f"({_cell(st)})" if in_process else _cell(_ow(g, name)),
                    _ms(est),
                    f"{bw:.1f}" if bw else "—",
                    _x(bw / fb if bw and fb else None),
                    "—" if is_torch else _x(bw / slot_bw if bw and slot_bw else None),
                    "—" if in_process or is_torch or not rw_ow or not ow else _x(ow / rw_ow),
                ]
            )
            ows = _ow(g, name)
            gd[name] = {
                "round_trip": None if in_process else st.to_dict(),
                "copy": st.to_dict() if in_process else None,
                "one_way": ows.to_dict() if ows else None,
                "one_way_median_ns": ow,
                "one_way_estimate_ns": est,
                "gbps": bw,
            }
        for key in (
            "ringwire",
            "ringwire (spinning consumer)",
            "ringwire inline",
            "zmq",
            "mp.Queue",
        ):
            hot = _stats(g.samples.get(f"{key} small RT", []))
            idle = _stats(g.samples.get(f"{key} small RT, idle peer", []))
            if hot is None and idle is None:
                continue
            ref_rows.append([human(size), key, _cell(hot), _cell(idle)])
            gd[f"{key} small RT"] = hot.to_dict() if hot else None
            gd[f"{key} small RT, idle peer"] = idle.to_dict() if idle else None
        data[human(size)] = gd

        bwr = _gbps(size, rw_ow)
        r = bwr / floor_bw if bwr and floor_bw else None
        bwe = _gbps(size, estimate("ringwire copy-in"))
        re_ = bwe / floor_bw if bwe and floor_bw else None
        rep.target(
            f"copy-in {human(size)}: bandwidth ≥ {T_COPY_BW:g}× memcpy",
            r,
            T_COPY_BW,
            ">=",
            f"{_x(r)} ({bwr or 0:.1f} vs {floor_bw or 0:.1f} GB/s; estimate: {_x(re_)})",
        )
        if size == 64 * MiB:
            tb = _gbps(size, oneway("torch bf16: ringwire copy-in"))
            r = tb / tfloor_bw if tb and tfloor_bw else None
            rep.target(
                f"(info) copy-in 64 MiB torch bf16: bandwidth ≥ {T_COPY_BW:g}× torch copy_",
                r,
                T_COPY_BW,
                ">=",
                f"{_x(r)} ({tb or 0:.1f} vs {tfloor_bw or 0:.1f} GB/s)",
            )
            mo, zo = oneway("multiprocessing.Queue"), oneway("zmq PAIR copy=False")
            lo = oneway("ringwire loaned")
            peers = (("multiprocessing.Queue", mo, T_VS_MPQ), ("zmq copy=False", zo, T_VS_ZMQ))
            for who, v, lim in peers:
                r = v / rw_ow if v and rw_ow else None
                rep.target(
                    f"copy-in 64 MiB: ≥ {lim:g}× faster than {who} (one-way)", r, lim, ">=", _x(r)
                )
            for who, v, lim in peers:
                r = v / lo if v and lo else None
                rep.target(
                    f"(info) loaned 64 MiB: ≥ {lim:g}× faster than {who} (one-way)",
                    r,
                    lim,
                    ">=",
                    _x(r),
                )
    rep.data["copy_in"] = data
    rep.table(
        "copy_in",
        "Copy-in handoff: send a private array → consumer holds it (medians / p99, ms; "
        "memcpy rows: the in-process copy, in parentheses)",
        format_table(headers, rows),
        load_note({human(size): g for size, g in groups.items()}),
    )
    rep.table(
        "copy_in_refs",
        "Small-record round trips in the same groups (ms, median / p99); the one-way "
        "estimates subtract half of the idle-peer one",
        format_table(
            ["group", "transport", "back to back", "idle peer (after eviction)"], ref_rows
        ),
    )


def report_rr(g: Group, rep: Report) -> None:
    headers = [
        "case (pool: ONE slot)",
        "per iteration ms",
        "plain small RT ms (same channel)",
        "doorbell RT ms (spin_us=0)",
        "memcpy ms",
        "(iteration − copy) ÷ plain RT",
        "(iteration − copy) ÷ doorbell RT",
    ]
    rows = []
    data = {}
    bell = _stats(g.samples.get("doorbell small RT", []))
    for name, kind, size, spin in RR_CASES:
        it = _stats(g.samples.get(f"{name}: per iteration", []))
        rt = _stats(g.samples.get(f"{name}: small RT", []))
        cp = _stats(g.samples.get(f"{name}: memcpy", [])) if kind == "copy" else None
        label = f"{'loan' if kind == 'loan' else 'copy-in'} {human(size)}"
        if spin is not None:
            label += ", both ends spinning (info)"
        if it is None or rt is None:
            why = g.failed.get(f"{name}: per iteration") or g.failed.get(f"{name}: small RT")
            rows.append([label, "failed: " + (why or "?")[:60]] + ["—"] * 5)
            continue
        copy_ns = cp.median_ns if cp is not None else 0.0
        net = it.median_ns - copy_ns
        r_plain = net / rt.median_ns
        r_bell = net / bell.median_ns if bell is not None else None
        rows.append(
            [
                label,
                _cell(it),
                _cell(rt),
                _cell(bell),
                _ms(copy_ns) if cp else "—",
                _x(r_plain),
                _x(r_bell),
            ]
        )
        data[label] = {
            "iteration": it.to_dict(),
            "small_rt": rt.to_dict(),
            "doorbell_rt": bell.to_dict() if bell else None,
            "memcpy": cp.to_dict() if cp else None,
            "ratio_plain": r_plain,
            "ratio_doorbell": r_bell,
        }
        info = "(info) " if spin is not None else ""
        rep.target(
            f"{info}release-to-reuse {label.split(',')[0]}: ≤ {T_RR_EXTRA:g} plain RT extra "
            f"((iteration − copy) ≤ {1 + T_RR_EXTRA:g}× plain RT)",
            r_plain,
            1 + T_RR_EXTRA,
            "<=",
            _x(r_plain),
        )
        rep.target(
            f"{info}release-to-reuse {label.split(',')[0]}: within one doorbell RT "
            "((iteration − copy) ≤ 1× doorbell RT)",
            r_bell,
            1.0,
            "<=",
            _x(r_bell),
        )
    rep.data["release_to_reuse"] = data
    rep.table(
        "rr",
        "Release-to-reuse: a pool of ONE slot; the consumer receives, reads one element "
        "and drops the array (no ack); medians / p99",
        format_table(headers, rows),
        load_note({"release-to-reuse": g}),
    )


if __name__ == "__main__":
    raise SystemExit(main())
