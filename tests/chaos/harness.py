"""The chaos harness: kill rounds against victim processes (the tests are test_chaos.py).

Each kill round starts a victim process (``workers.py`` in this folder, run as a script,
started ahead of time so its start-up overlaps the previous round), lets it exchange
sequence-numbered, checksummed records -- a quarter of them with numpy arrays, most of
those through tensor slots -- with this process (the *survivor*), kills it with SIGKILL
at a random moment (a random delay, or a point the victim announces), and checks:

* the survivor's pending and next operations raise ``BrokenResourceError`` (or, during
  a handshake, a handshake error) within ``DETECT_S`` = 100 ms of the kill, and never
  hang (``HANG_S``);
* every record received was checked: sequence numbers gap-free, duplicate-free and in
  order, payload and array checksums intact (held arrays are checked again when let go,
  and after the producer died);
* every slot of the survivor's send pool is free again once the consumer died;
* no ``/dev/shm`` name of the victim or of this process is left, nor a socket file
  (the autouse guard in tests/conftest.py checks the whole test as well).

A round whose detection took longer than 100 ms is run again with the same seed (the
machine has 2 vCPUs shared with other work); only a bound missed on every attempt
fails.  The seed is printed; ``RINGWIRE_CHAOS_SEED=<seed>`` replays a run and
``RINGWIRE_CHAOS_KILLS=<n>`` changes its length (``pytest --long`` runs 1000 kills).

Calls: a call server (``ringwire.serve``) killed with calls pending -- every pending
call, those still in the ring or waiting for room included, fails at once with
``BrokenResourceError``, the client's slots all come back, and every later call fails
too; and a client killed while our ``serve`` runs its handlers (async, or blocking in
threads) -- ``serve`` raises ``BrokenResourceError`` at once and every handler is
cancelled.  (A server holding ``concurrency + max_queued`` calls has stopped reading and
checks its client every ``callcore.POLL_PEER_S`` = 250 ms: that round's bound is 100 ms beyond
the poll.)

Broadcast readers on "another host" (``tcp://127.0.0.1``, :func:`remote_broadcast_round`):
one killed while it streams, while it holds slots, or during its handshake and join,
beside a local reader that is not killed -- the writer (policy "drop") goes on, the
local reader gets every step in order, the dead reader's slot shares come back, and
the descriptors and TCP sockets its connection took on the writer's side are closed.
(These run in the shared-memory runs: the scenario is the writer's, whatever the
transport of the other rounds.)

The runtime's chaos (:func:`runtime_chaos`) kills ``ringwire.runtime`` workers, whose
entry point ``chaos.workers:chaos_echo`` the spawned workers import by name (tests/ is
on sys.path, and spawn passes sys.path on).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream
from support.procs import children

import ringwire
from chaos.workers import CHAOS_SLOTS, check_record, make_record, recheck
from ringwire import BrokenResourceError, EndOfStream, SlotConfig, runtime
from ringwire._conn import callcore
from ringwire._wire.names import is_segment_name, name_pid

try:
    from ringwire._net import zmqlife as net_transport
except ModuleNotFoundError:  # no pyzmq: the tcp:// runs skip
    net_transport = None  # type: ignore[assignment]

WORKER = str(Path(__file__).resolve().parent / "workers.py")  # run as a script, by path
DETECT_S = 0.100  # a survivor reports the death within this
HANG_S = 5.0  # nothing may take longer than this once the victim is dead
RETRIES = 2  # a round that misses DETECT_S is run again (same seed) this often
KiB = 1 << 10
FULL_POOL = {4 * KiB: 8, 64 * KiB: 4}  # CHAOS_SLOTS, every slot free
FULL_POLL_S = callcore.POLL_PEER_S  # how often a full call server checks its client


def chaos_seed() -> int:
    env = os.environ.get("RINGWIRE_CHAOS_SEED")
    return int(env) if env else random.SystemRandom().randrange(1 << 32)


def shm_names_of(pids: set[int]) -> set[str]:
    out = set()
    for n in os.listdir("/dev/shm"):
        if is_segment_name("/" + n) and name_pid("/" + n) in pids:
            out.add(n)
    return out


def _socket_inodes() -> set[int]:
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/self/fd/{fd}")
            if link.startswith("socket:["):
                out.add(int(link[8:-1]))
    return out


def _proc_net_tcp() -> list[list[str]]:
    rows = []
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(name) as f:
            rows += [line.split() for line in f.readlines()[1:]]
    return rows


def tcp_sockets() -> int:
    """TCP sockets this process holds (ZeroMQ's, in its I/O thread, included)."""
    mine = _socket_inodes()
    return sum(1 for row in _proc_net_tcp() if int(row[9]) in mine)


def tcp_listening_ports() -> set[int]:
    return {int(row[1].rsplit(":", 1)[1], 16) for row in _proc_net_tcp() if row[3] == "0A"}


# ======================================================================================
# victims: child processes started ahead of time, told their role on stdin
# ======================================================================================


class VictimFailed(AssertionError):
    pass


class Victim:
    def __init__(self, proc: anyio.abc.Process) -> None:
        self.proc = proc
        self.pid = proc.pid
        assert proc.stdout is not None
        self._out = BufferedByteReceiveStream(proc.stdout)
        self.log: list[str] = []
        self.errors: list[str] = []
        self.points: dict[str, dict[str, Any]] = {}
        self.killed_at: float | None = None
        self.reaped = False

    async def line(self) -> str | None:
        try:
            raw = await self._out.receive_until(b"\n", 1 << 20)
        except (anyio.EndOfStream, anyio.IncompleteRead, anyio.ClosedResourceError):
            return None
        text = raw.decode(errors="replace")
        self.log.append(text)
        if text.startswith("E "):
            self.errors.append(text[2:])
        elif text.startswith("P "):
            name, _, info = text[2:].partition(" ")
            self.points[name] = json.loads(info or "{}")
        return text

    async def until(self, name: str, timeout: float = 20.0) -> dict[str, Any]:
        with anyio.fail_after(timeout):
            while name not in self.points:
                if self.errors:
                    raise VictimFailed(f"victim {self.pid}: {self.errors}")
                if await self.line() is None:
                    raise VictimFailed(f"victim {self.pid} ended before {name!r}: {self.log}")
        return self.points[name]

    async def begin(self, cfg: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        await self.proc.stdin.send((json.dumps(cfg) + "\n").encode())

    def kill(self) -> float:
        self.killed_at = time.perf_counter()
        os.kill(self.pid, signal.SIGKILL)
        return self.killed_at

    async def reap(self) -> int:
        """Read what it said, wait for it; its exit status."""
        if not self.reaped:
            with anyio.fail_after(HANG_S), anyio.CancelScope(shield=True):
                while await self.line() is not None:
                    pass
                await self.proc.wait()
                await self.proc.aclose()
            self.reaped = True
        code = self.proc.returncode
        assert code is not None
        return code

    async def dispose(self) -> None:
        """Make sure it is gone (after a failed round)."""
        if self.reaped:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            await self.reap()


class Victims:
    """A few victims started ahead of time: a round takes a started one."""

    def __init__(self, tg: anyio.abc.TaskGroup, spares: int = 2) -> None:
        self._tg = tg
        self._spares = spares
        self._ready: deque[Victim] = deque()
        self._starting = 0
        self._changed = anyio.Event()
        self._error: BaseException | None = None
        self.started = 0

    async def _start_one(self) -> None:
        try:
            proc = await anyio.open_process(
                [sys.executable, WORKER],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
            v = Victim(proc)
            with anyio.fail_after(60):
                first = await v.line()
            if first != "ready":
                await v.dispose()
                raise VictimFailed(f"a victim did not start: {first!r} {v.log}")
            self._ready.append(v)
            self.started += 1
        except BaseException as exc:
            self._error = exc
            raise
        finally:
            self._starting -= 1
            self._changed.set()

    def _top_up(self) -> None:
        while len(self._ready) + self._starting < self._spares + 1:
            self._starting += 1
            self._tg.start_soon(self._start_one)

    async def get(self) -> Victim:
        while True:
            self._top_up()
            if self._ready:
                v = self._ready.popleft()
                self._top_up()
                return v
            if self._error is not None:
                raise self._error
            self._changed = anyio.Event()
            await self._changed.wait()

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True), anyio.fail_after(60):
            while self._starting:
                self._changed = anyio.Event()
                await self._changed.wait()
            while self._ready:
                v = self._ready.popleft()
                assert v.proc.stdin is not None
                await v.proc.stdin.aclose()  # "not needed": it exits 0
                await v.reap()


# ======================================================================================
# the survivor's side: one interface over Channel (asyncio, trio) and SyncChannel
# ======================================================================================


class Side:
    """The survivor's end of one connection.  Records when each kind of operation
    first raised ``BrokenResourceError`` (``perf_counter``)."""

    def __init__(self, ch: Any) -> None:
        self.ch = ch
        self.broken: dict[str, float] = {}

    def _mark(self, op: str) -> None:
        self.broken.setdefault(op, time.perf_counter())

    async def send(self, item: Any) -> None:
        raise NotImplementedError

    async def receive(self) -> Any:
        raise NotImplementedError

    async def aclose(self) -> None:
        raise NotImplementedError

    def statistics(self) -> ringwire.ChannelStatistics:
        return self.ch.statistics()


class AsyncSide(Side):
    async def send(self, item: Any) -> None:
        try:
            await self.ch.send(item)
        except BrokenResourceError:
            self._mark("send")
            raise

    async def receive(self) -> Any:
        try:
            return await self.ch.receive()
        except BrokenResourceError:
            self._mark("receive")
            raise

    async def aclose(self) -> None:
        await self.ch.aclose()


class SyncSide(Side):
    """Each operation runs the blocking API in a worker thread (one sender and one
    receiver at a time, as SyncChannel allows)."""

    def _send(self, item: Any) -> None:
        try:
            self.ch.send(item, timeout=HANG_S)
        except BrokenResourceError:
            self._mark("send")
            raise

    def _receive(self) -> list[Any]:
        try:
            # boxed: a worker thread keeps its last result alive until its next job,
            # and a received slot array must not outlive the test's references
            return [self.ch.receive(timeout=HANG_S)]
        except BrokenResourceError:
            self._mark("receive")
            raise

    async def send(self, item: Any) -> None:
        await anyio.to_thread.run_sync(self._send, item)

    async def receive(self) -> Any:
        return (await anyio.to_thread.run_sync(self._receive)).pop()

    async def aclose(self) -> None:
        self.ch.close()


# ======================================================================================
# rounds
# ======================================================================================


@dataclass
class Round:
    scenario: str
    survivor: str  # "asyncio", "trio", "sync"
    seed: int
    victim: str = ""  # what was killed: "consumer", "producer", "client", "listener", ...
    latencies: dict[str, float] = field(default_factory=dict)  # operation -> seconds
    records: int = 0  # records checked end to end
    outcome: str = ""  # for handshake kills: "refused", "accepted", "no contact", ...
    sends_after: int | None = None  # a sender that never waits: records sent after the kill

    @property
    def worst(self) -> float:
        return max(self.latencies.values(), default=0.0)


class Harness:
    def __init__(
        self,
        tmp: Path,
        backend: str,
        lst: ringwire.Listener,
        sync_lst: Any,
        victims: Victims,
        transport: str = "shm",
    ) -> None:
        self.tmp = tmp
        self.backend = backend
        self.lst = lst
        self.sync_lst = sync_lst
        self.victims = victims
        self.transport = transport  # "shm" (Unix socket paths) or "tcp" (tcp://127.0.0.1)
        self.strays = 0
        self.n_server_paths = 0
        self.tcp_baseline = tcp_sockets() if transport == "tcp" else 0

    def server_path(self, stem: str) -> str:
        """Where a victim listens: a socket file, or any free port on loopback (the
        victim says which when it is listening)."""
        if self.transport == "tcp":
            return "tcp://127.0.0.1:0"
        self.n_server_paths += 1
        return str(self.tmp / f"{stem}{self.n_server_paths}.sock")

    # -- connections from victims ------------------------------------------------------

    async def accept_from(self, pid: int, survivor: str, timeout: float = 20.0) -> Side:
        if survivor == "sync":
            deadline = time.monotonic() + timeout
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no connection from victim {pid}")
                try:
                    sch = await anyio.to_thread.run_sync(self.sync_lst.accept, min(left, 1.0))
                except TimeoutError:
                    continue
                if sch.peer_pid == pid:
                    return SyncSide(sch)
                await self._stray(SyncSide(sch))
        with anyio.fail_after(timeout):
            while True:
                ch = await self.lst.accept()
                if ch.peer_pid == pid:
                    return AsyncSide(ch)
                await self._stray(AsyncSide(ch))

    async def _stray(self, side: Side) -> None:
        """A connection whose victim was killed around its handshake in an earlier
        round: it must report the death (its process is long gone)."""
        self.strays += 1
        with anyio.fail_after(HANG_S):
            with pytest.raises((BrokenResourceError, EndOfStream)):
                await side.receive()
        await side.aclose()

    def victim_cfg(self, rng: random.Random, role: str, survivor: str, **kw: Any) -> dict[str, Any]:
        cfg = {
            "role": role,
            "path": self.sync_lst.path if survivor == "sync" else self.lst.path,
            "backend": rng.choice(["asyncio", "trio"]),
            "salt": rng.randrange(1 << 30),
            "capacity": rng.choice([8 * KiB, 64 * KiB]),
            "spin_us": rng.choice([0, 50]),
        }
        cfg.update(kw)
        return cfg

    # -- after a kill ------------------------------------------------------------------

    async def finish(self, v: Victim, r: Round, before: set[str]) -> None:
        code = await v.reap()
        assert not v.errors, f"victim {v.pid} ({r.scenario}) reported: {v.errors}"
        assert code == -signal.SIGKILL, f"victim {v.pid} exited {code}: {v.log[-5:]}"
        # the listener sweeps names of a client that died before its Hello at once
        deadline = time.monotonic() + 2.0
        while True:
            left = shm_names_of({v.pid}) | (shm_names_of({os.getpid()}) - before)
            if not left or time.monotonic() > deadline:
                break
            await anyio.sleep(0.01)
        assert not left, f"{r.scenario}: /dev/shm names left behind: {sorted(left)}"
        if self.transport == "tcp":
            await self.tcp_settled(r)

    async def tcp_settled(self, r: Round) -> None:
        """No TCP socket of ours is left beyond the listeners' (a closed connection's
        socket is kept until its peer is gone or for zmqlife.GRACE, then closed), and
        no connection is left in the listener's fan-in."""
        deadline = time.monotonic() + net_transport.GRACE + 2.0
        while True:
            net_transport.reap()
            n = tcp_sockets()
            conns = len(self.lst.connections)
            if (n <= self.tcp_baseline and not conns) or time.monotonic() > deadline:
                break
            await anyio.sleep(0.02)
        assert not conns, f"{r.scenario}: {conns} connections left in the listener's fan-in"
        assert n <= self.tcp_baseline, (
            f"{r.scenario}: {n} TCP sockets open, {self.tcp_baseline} before the round"
        )


async def _killer(v: Victim, delay: float, after: str | None = None) -> None:
    if after is not None:
        await v.until(after)
    await anyio.sleep(delay)
    v.kill()


def _latency(r: Round, side: Side, v: Victim, *ops: str) -> None:
    assert v.killed_at is not None
    for op in ops:
        assert op in side.broken, f"{r.scenario}: {op} never raised BrokenResourceError"
        r.latencies[op] = side.broken[op] - v.killed_at


def _slots_all_back(side: Side, r: Round) -> None:
    stats = side.statistics()
    assert stats.slots_in_use == 0, f"{r.scenario}: {stats.slots_in_use} slots still in use"
    assert stats.loans_outstanding == 0
    assert stats.slot_bytes_in_use == 0, stats.slot_bytes_in_use
    if stats.slots_free:  # (a TCP send budget has no slots: bytes only)
        assert stats.slots_free == FULL_POOL, stats.slots_free


# -- the victim consumes: the survivor produces ------------------------------------------


async def consumer_round(h: Harness, v: Victim, r: Round, rng: random.Random, mode: str) -> None:
    """Kill a consumer: streaming flat out / slowly, holding every slot, or parked."""
    r.victim = "consumer"
    kw: dict[str, Any] = {"ack_every": rng.choice([1, 8, 64])}
    quiet = mode.startswith("quiet")  # we only send: nothing to receive, no acks
    if quiet:
        kw["ack_every"] = 1 << 40
    if mode == "hold":
        kw.update(hold=1 << 30, holding_at=rng.randint(1, 4))  # blocks at >= 4
    elif mode == "parked":
        kw.update(ack_every=1)
    else:
        kw.update(hold=rng.choice([0, 0, 4, 11]))
    if mode != "hold":
        kw["backend"] = rng.choice(["asyncio", "trio", "sync"])
    cfg = h.victim_cfg(rng, "consumer", r.survivor, **kw)
    salt = cfg["salt"]
    pace = rng.uniform(0.0005, 0.003) if mode in ("slow", "quiet-slow") else 0.0
    await v.begin(cfg)
    side = await h.accept_from(v.pid, r.survivor)
    sent = 0  # records whose send began (an ack can overtake the send's return)
    acked = 0

    async def produce() -> None:
        nonlocal sent
        with contextlib.suppress(BrokenResourceError):
            while True:
                sent += 1
                await side.send(make_record(sent - 1, salt))
                if pace:
                    await anyio.sleep(pace)

    async def acks(until: int | None = None) -> None:
        nonlocal acked
        while until is None or acked < until:
            msg = await side.receive()
            assert msg[0] == "ack" and acked < msg[1] <= sent, (msg, acked, sent)
            acked = msg[1]

    try:
        if mode == "parked":
            k = rng.randint(1, 40)
            for _ in range(k):
                sent += 1
                await side.send(make_record(sent - 1, salt))
            with anyio.fail_after(HANG_S):
                await acks(k)
            # both sides park: the victim in receive, we in receive
            with anyio.fail_after(HANG_S):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(_killer, v, rng.uniform(0.005, 0.05))
                    with pytest.raises(BrokenResourceError):
                        await acks()
            with pytest.raises(BrokenResourceError):
                await side.send(make_record(sent, salt))
            _latency(r, side, v, "receive")
        elif quiet:
            at_kill: list[int] = []

            async def kill_and_count() -> None:
                await _killer(v, rng.uniform(0.002, 0.12), "connected")
                at_kill.append(sent)

            with anyio.fail_after(HANG_S * 4):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(kill_and_count)
                    await produce()
            _latency(r, side, v, "send")
            r.sends_after = sent - at_kill[0]
            r.records = 0  # nothing acknowledged
        else:
            after = "holding" if mode == "hold" else "connected"
            delay = rng.uniform(0, 0.02) if mode == "hold" else rng.uniform(0.002, 0.12)
            with anyio.fail_after(HANG_S * 4):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(_killer, v, delay, after)
                    tg.start_soon(produce)
                    with contextlib.suppress(BrokenResourceError):
                        await acks()
            with anyio.fail_after(HANG_S):
                with pytest.raises(BrokenResourceError):
                    await side.send(make_record(sent, salt))
            _latency(r, side, v, "receive", "send")
        r.records = max(r.records, acked)  # checked by the victim, acknowledged to us
        _slots_all_back(side, r)
    finally:
        await side.aclose()


# -- the victim produces: the survivor consumes ------------------------------------------


async def producer_round(h: Harness, v: Victim, r: Round, rng: random.Random, mode: str) -> None:
    """Kill a producer: streaming, parked on a full ring, waiting for a slot, slow,
    with loans, or idle after sending everything."""
    r.victim = "producer"
    kw: dict[str, Any] = {}
    if mode == "slow":
        kw["pace"] = rng.uniform(0.0005, 0.003)
    elif mode == "loans":
        kw["loans"] = True
    elif mode == "sent_all":
        kw["count"] = rng.randint(1, 300)
    cfg = h.victim_cfg(rng, "producer", r.survivor, **kw)
    salt = cfg["salt"]
    await v.begin(cfg)
    side = await h.accept_from(v.pid, r.survivor)
    hold = 1 << 30 if mode == "slotwait" else rng.choice([0, 0, 3, 10])
    held: deque[Any] = deque()
    n = 0

    async def consume() -> None:
        nonlocal n
        with contextlib.suppress(BrokenResourceError):
            while True:
                rec = await side.receive()
                err = check_record(rec, n)
                assert err is None, f"{r.scenario}: {err}"
                n += 1
                if hold:
                    held.append(rec)
                    if len(held) > hold:
                        err = recheck(held.popleft())
                        assert err is None, err
                del rec

    try:
        if mode == "full":
            await v.until("connected")
            await anyio.sleep(rng.uniform(0.01, 0.06))  # the victim fills the ring, parks
            v.kill()
            with anyio.fail_after(HANG_S):
                await consume()
        elif mode == "sent_all":
            count = cfg["count"]
            with anyio.fail_after(HANG_S * 4):
                while n < count:
                    rec = await side.receive()
                    assert check_record(rec, n) is None, check_record(rec, n)
                    n += 1
                    del rec
                await v.until("sent_all")
            with anyio.fail_after(HANG_S):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(_killer, v, rng.uniform(0.005, 0.03))
                    await consume()
            assert n == count, f"{count} records sent, {n} received"
        else:
            delay = rng.uniform(0.02, 0.1) if mode == "slotwait" else rng.uniform(0.002, 0.12)
            with anyio.fail_after(HANG_S * 4):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(_killer, v, delay, "connected")
                    await consume()
        _latency(r, side, v, "receive")
        with pytest.raises(BrokenResourceError):
            await side.send(make_record(0, salt))
        # views of the dead producer's slots stay valid and unchanged
        while held:
            err = recheck(held.popleft())
            assert err is None, err
        r.records = n
    finally:
        held.clear()
        await side.aclose()


# -- request/response: the victim is the client ---------------------------------------------


async def echo_round(h: Harness, v: Victim, r: Round, rng: random.Random, mode: str) -> None:
    """Kill a client in a request/response loop (mid-send, mid-receive or parked)."""
    r.victim = "client"
    cfg = h.victim_cfg(rng, "echo_client", r.survivor)
    await v.begin(cfg)
    side = await h.accept_from(v.pid, r.survivor)
    n = 0
    try:
        with anyio.fail_after(HANG_S * 4):
            async with anyio.create_task_group() as tg:
                tg.start_soon(_killer, v, rng.uniform(0.002, 0.1), "connected")
                with contextlib.suppress(BrokenResourceError):
                    while True:
                        req = await side.receive()
                        assert check_record(req, n) is None, check_record(req, n)
                        await side.send(req)  # its array goes back through our slots
                        n += 1
                        del req
        # whichever comes first learns of the death: the receive, or a send (a sender
        # nobody watches asks the transport every ALIVE_EVERY records)
        assert "receive" in side.broken or "send" in side.broken, side.broken
        r.latencies["first"] = min(side.broken.values()) - (v.killed_at or 0.0)
        r.records = n
        _slots_all_back(side, r)
    finally:
        await side.aclose()


# -- the victim listens: the survivor is the client ------------------------------------------


async def server_round(h: Harness, v: Victim, r: Round, rng: random.Random, mode: str) -> None:
    """Kill a listener during the handshake, or while it echoes our requests."""
    r.victim = "listener"
    path = h.server_path("srv")
    cfg = h.victim_cfg(rng, "server", r.survivor, path=path)
    spin_us = rng.choice([0, 50])
    await v.begin(cfg)
    path = (await v.until("listening")).get("path", path)
    side: Side | None = None
    try:
        if mode in ("handshake", "handshake-big-pool"):
            errors: list[BaseException] = []
            failed_at: list[float] = []
            # the big pool is the default 81 MiB one: the client is busy reserving it
            # (tens of ms on a busy machine) when the listener dies
            slots = SlotConfig() if mode == "handshake-big-pool" else CHAOS_SLOTS

            async def dial() -> None:
                nonlocal side
                try:
                    if r.survivor == "sync":
                        side = SyncSide(
                            await anyio.to_thread.run_sync(
                                lambda: ringwire.connect_sync(
                                    path, slots=slots, spin_us=spin_us, handshake_timeout=HANG_S
                                )
                            )
                        )
                    else:
                        side = AsyncSide(
                            await ringwire.connect(
                                path, slots=slots, spin_us=spin_us, handshake_timeout=HANG_S
                            )
                        )
                except (ringwire.HandshakeError, OSError) as exc:
                    failed_at.append(time.perf_counter())
                    errors.append(exc)
                    side = None

            with anyio.fail_after(HANG_S * 2):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(dial)
                    await anyio.sleep(rng.uniform(0, 0.004))
                    v.kill()
            if side is not None:
                r.outcome = "connected"
                with anyio.fail_after(HANG_S), pytest.raises(BrokenResourceError):
                    await side.receive()
                _latency(r, side, v, "receive")
            else:
                r.outcome = "refused"
                assert v.killed_at is not None and failed_at, errors
                if failed_at[0] < v.killed_at:
                    raise AssertionError(f"connect failed before the kill: {errors}")
                r.latencies["connect"] = failed_at[0] - v.killed_at
        else:
            if r.survivor == "sync":
                side = SyncSide(
                    await anyio.to_thread.run_sync(
                        lambda: ringwire.connect_sync(path, slots=CHAOS_SLOTS, spin_us=spin_us)
                    )
                )
            else:
                side = AsyncSide(await ringwire.connect(path, slots=CHAOS_SLOTS, spin_us=spin_us))
            salt = cfg["salt"]
            n = 0
            with anyio.fail_after(HANG_S * 4):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(_killer, v, rng.uniform(0.002, 0.1), "accepted")
                    with contextlib.suppress(BrokenResourceError):
                        while True:
                            await side.send(make_record(n, salt))
                            reply = await side.receive()
                            assert check_record(reply, n) is None, check_record(reply, n)
                            n += 1
                            del reply
            assert "receive" in side.broken or "send" in side.broken
            r.latencies["first"] = min(side.broken.values()) - (v.killed_at or 0.0)
            r.records = n
            _slots_all_back(side, r)
    finally:
        if side is not None:
            await side.aclose()
    # the dead listener's socket file stays; a new listener at that path replaces it
    await v.reap()  # (a dying listener's socket may still accept for a moment)
    if h.transport == "tcp":
        port = int(path.rsplit(":", 1)[1])
        assert port not in tcp_listening_ports(), f"the dead listener's port {port} listens"
        return
    if os.path.exists(path):
        async with ringwire.listen(path, slots=None):
            pass
    assert not os.path.exists(path)


# -- killed during the handshake: the survivor is the listener --------------------------------


async def handshake_round(h: Harness, v: Victim, r: Round, rng: random.Random, mode: str) -> None:
    """Kill a client while it connects (creating and announcing its segments)."""
    r.victim = "client"
    slots = "default" if mode == "bigpool" else "chaos"
    cfg = h.victim_cfg(rng, "consumer", r.survivor, slots=slots, backend="asyncio")
    window = 0.04 if slots == "default" else 0.004
    lst = h.sync_lst if r.survivor == "sync" else h.lst
    before = lst.statistics().refused
    if h.transport == "tcp":
        window = 0.02  # the attach is a round trip later than on one host
    await v.begin(cfg)
    await v.until("connecting")
    await anyio.sleep(rng.uniform(0, window))
    v.kill()
    side: Side | None = None
    # what did the listener see?  A refused handshake, a connection, or nothing yet
    with anyio.fail_after(HANG_S):
        while True:
            if r.survivor == "sync":
                with contextlib.suppress(TimeoutError):
                    sch = await anyio.to_thread.run_sync(h.sync_lst.accept, 0.05)
                    side = SyncSide(sch)
                refused = h.sync_lst.statistics().refused
            else:
                with anyio.move_on_after(0.05):
                    side = AsyncSide(await h.lst.accept())
                refused = h.lst.statistics().refused
            if side is not None:
                assert side.ch.peer_pid == v.pid, "a connection from an earlier victim"
                r.outcome = "accepted"
                break
            if refused > before:
                r.outcome = "refused"
                break
            if time.perf_counter() - (v.killed_at or 0.0) > 0.3:
                r.outcome = "no contact"  # killed before it reached the listener
                break
    if side is not None:
        try:
            with anyio.fail_after(HANG_S), pytest.raises(BrokenResourceError):
                await side.receive()
            _latency(r, side, v, "receive")
        finally:
            await side.aclose()


# -- the victim reads a broadcast: the survivor writes it -----------------------------------


def broadcast_send(bc: Any, sync: bool) -> Callable[[Any], Awaitable[Any]]:
    """``bc.send`` as a coroutine function: a blocking broadcaster's in a worker thread,
    with the HANG_S timeout."""
    if sync:
        return lambda rec: anyio.to_thread.run_sync(bc.send, rec, HANG_S)
    return bc.send  # type: ignore[no-any-return]


async def broadcast_round(h: Harness, v: Victim, r: Round, rng: random.Random, mode: str) -> None:
    """Kill a broadcast reader: while it streams (policy "drop": the writer goes on;
    "fail": its next send raises) or while it holds slots the writer waits for."""
    r.victim = "broadcast reader"
    policy = "fail" if mode == "fail" else "drop"
    path = h.tmp / f"bc{v.pid}.sock"
    hold = 1 << 30 if mode == "hold" else rng.choice([0, 0, 3])
    cfg = h.victim_cfg(rng, "broadcast_reader", r.survivor, path=str(path), hold=hold)
    cfg["holding_at"] = rng.randint(1, 4)
    salt = cfg["salt"]
    sync = r.survivor == "sync"
    make = ringwire.broadcast_sync if sync else ringwire.broadcast
    bc: Any = make(
        path,
        readers=2,
        capacity=cfg["capacity"],
        slots=CHAOS_SLOTS,
        on_reader_loss=policy,
        stall_timeout=HANG_S,
    )
    sent, stop, broken_at = 0, False, []

    send = broadcast_send(bc, sync)

    async def produce() -> None:
        nonlocal sent
        try:
            while not stop:
                await send(make_record(sent, salt))
                sent += 1
                if mode == "slow":
                    await anyio.sleep(rng.uniform(0.0005, 0.003))
                elif sent % 64 == 0:
                    await anyio.sleep(0)
        except BrokenResourceError:
            broken_at.append(time.perf_counter())

    async def lost() -> float:
        while True:
            stats = await (anyio.to_thread.run_sync(bc.statistics) if sync else _now(bc.statistics))
            if stats.lost:
                return time.perf_counter()
            await anyio.sleep(0.0005)

    async with contextlib.AsyncExitStack() as stack:
        if sync:
            stack.callback(bc.close)
        else:
            await stack.enter_async_context(bc)
        await v.begin(cfg)
        with anyio.fail_after(20):
            if sync:
                await anyio.to_thread.run_sync(bc.wait_ready, 1, 20.0)
            else:
                await bc.wait_ready(1)
        after = "holding" if mode == "hold" else "reading"
        with anyio.fail_after(HANG_S * 4):
            async with anyio.create_task_group() as tg:
                tg.start_soon(
                    _killer,
                    v,
                    rng.uniform(0, 0.02) if mode == "hold" else rng.uniform(0.002, 0.1),
                    after,
                )
                tg.start_soon(produce)
                while v.killed_at is None:
                    await anyio.sleep(0.0005)
                noticed = await lost()
                if policy == "fail":
                    with anyio.fail_after(HANG_S):
                        while not broken_at:
                            await anyio.sleep(0.0005)
                    r.latencies["send"] = broken_at[0] - v.killed_at
                else:
                    await anyio.sleep(0.01)  # the writer goes on without it
                    stop = True
                r.latencies["noticed"] = noticed - v.killed_at
        stats = await (anyio.to_thread.run_sync(bc.statistics) if sync else _now(bc.statistics))
        assert stats.lost == 1 and stats.readers == 0, stats
        if policy == "drop":
            assert not broken_at, f"{r.scenario}: a send failed under policy 'drop'"
            # its share of every slot came back with its death: nobody holds one now
            assert stats.slots_in_use == 0, f"{r.scenario}: {stats.slots_in_use} slots in use"
            assert stats.slots_free == FULL_POOL, stats.slots_free
        r.records = sent


# -- the victim reads a broadcast from "another host" (tcp://127.0.0.1) ----------------------


def writer_fds() -> Counter[str]:
    """This process's descriptors that a remote reader's connection takes on the
    writer's side: TCP sockets (ZeroMQ's, in its I/O thread), eventfds (a ZeroMQ
    socket's mailbox, a transport's wake-up) and epoll instances.  (Pipes, Unix sockets
    and pidfds are left out: the spare victims start beside the round.)"""
    tcp = {int(row[9]) for row in _proc_net_tcp()}
    out: Counter[str] = Counter()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:[") and int(link[8:-1]) in tcp:
            out["tcp"] += 1
        elif link in ("anon_inode:[eventfd]", "anon_inode:[eventpoll]"):
            out[link[11:-1]] += 1
    return out


async def remote_broadcast_round(
    h: Harness, v: Victim, r: Round, rng: random.Random, mode: str
) -> None:
    """Kill a broadcast reader on "another host" (``tcp://127.0.0.1``) beside a local
    one (a second worker, subscribed at the Unix path, not killed): while it streams,
    while it holds slots, or during its handshake and join (``join``: before it
    connected, in ZeroMQ's handshake, between its Join and the answer, or just
    admitted).  Policy "drop": the writer never fails; the local reader gets every
    step in order (it checks them) up to the end; the writer notices the death
    (within DETECT_S of it, once it was admitted), gives up the dead reader's slot
    shares, and its connection's descriptors and TCP sockets are closed (back to what
    the writer held before the victim came); no ``/dev/shm`` name of the victim is
    left (:meth:`Harness.finish`) and no child is left a zombie."""
    r.victim = "remote broadcast reader"
    path = h.tmp / f"rbc{v.pid}.sock"
    hold = 1 << 30 if mode == "hold" else rng.choice([0, 0, 3])
    cfg = h.victim_cfg(rng, "broadcast_reader", r.survivor, hold=hold, mid_stream=True)
    if mode == "join":
        # without the NIXL agent its handshake (which makes one, ~0.5 s of UCX set-up)
        # takes milliseconds: the kill lands before, in or after it
        cfg["nixl"] = False
    cfg["holding_at"] = rng.randint(1, 4)
    salt = cfg["salt"]
    local_cfg = h.victim_cfg(rng, "broadcast_reader", r.survivor, path=str(path), salt=salt)
    # ZeroMQ's context and its threads (their eventfds and epolls) live as long as this
    # process: made before the count
    net_transport.context().socket(net_transport.zmq.PAIR).close(0)
    before_bc = writer_fds()
    local = await h.victims.get()
    try:
        await _remote_broadcast_round(h, v, r, rng, mode, local, cfg, local_cfg, before_bc)
    finally:
        await local.dispose()
    await v.reap()
    assert not children(zombies=True), f"{r.scenario}: zombie children {children(zombies=True)}"


async def _remote_broadcast_round(
    h: Harness,
    v: Victim,
    r: Round,
    rng: random.Random,
    mode: str,
    local: Victim,
    cfg: dict[str, Any],
    local_cfg: dict[str, Any],
    before_bc: Counter[str],
) -> None:
    """:func:`remote_broadcast_round` once it has its local reader (disposed of by
    the caller, whatever happens here)."""
    sync = r.survivor == "sync"
    salt = cfg["salt"]
    path = local_cfg["path"]
    make = ringwire.broadcast_sync if sync else ringwire.broadcast
    bc: Any = make(
        path,
        readers=3,
        capacity=cfg["capacity"],
        slots=CHAOS_SLOTS,
        on_reader_loss="drop",
        stall_timeout=HANG_S,
        handshake_timeout=1.0,  # an attach the victim never finished is given up soon
        tcp="tcp://127.0.0.1:0",
    )
    cfg["path"] = bc.tcp_address
    sent, stop, failed = 0, False, []

    async def call(fn: Callable[..., Any], *args: Any) -> Any:
        return await anyio.to_thread.run_sync(fn, *args) if sync else fn(*args)

    send = broadcast_send(bc, sync)

    async def produce() -> None:
        nonlocal sent
        try:
            while not stop:
                await send(make_record(sent, salt))
                sent += 1
                if mode == "join" or sent % 8 == 0:
                    await anyio.sleep(rng.uniform(0, 0.002))
        except BrokenResourceError as exc:
            failed.append(exc)

    fan = bc._core.hub.remote

    def remote_gone() -> bool:
        return not fan._by_fd and fan.acceptor.next_deadline() is None

    async with contextlib.AsyncExitStack() as stack:
        if sync:
            stack.callback(bc.close)
        else:
            await stack.enter_async_context(bc)
        await local.begin(local_cfg)
        with anyio.fail_after(20):
            if sync:
                await anyio.to_thread.run_sync(bc.wait_ready, 1, 20.0)
            else:
                await bc.wait_ready(1)
        baseline = writer_fds()
        with anyio.fail_after(HANG_S * 4):
            async with anyio.create_task_group() as tg:
                tg.start_soon(produce)
                await v.begin(cfg)
                if mode == "join":
                    await _killer(v, rng.uniform(0, 0.15), "connecting")
                elif mode == "hold":
                    await _killer(v, rng.uniform(0, 0.02), "holding")
                else:
                    await _killer(v, rng.uniform(0.002, 0.1), "reading")
                assert v.killed_at is not None
                # the writer forgets it: lost once admitted, else its attach or join
                # given up (at most handshake_timeout later)
                while True:
                    stats = await call(bc.statistics)
                    if stats.lost or (stats.joined == 1 and await call(remote_gone)):
                        break
                    await anyio.sleep(0.0005)
                if stats.lost:  # admitted, then lost
                    r.latencies["noticed"] = time.perf_counter() - v.killed_at
                await anyio.sleep(rng.uniform(0.005, 0.03))  # the writer goes on
                stop = True
        assert not failed, f"{r.scenario}: a send failed under policy 'drop': {failed}"
        # the dead reader's connection is closed: no descriptor or socket of it left
        deadline = time.monotonic() + net_transport.GRACE + 2.0
        while True:
            net_transport.reap()
            now = writer_fds()
            if (now - baseline).total() == 0 and await call(remote_gone):
                break
            assert time.monotonic() < deadline, (
                f"{r.scenario}: the writer holds {dict(now - baseline)} more than before "
                "the remote reader came"
            )
            await anyio.sleep(0.02)
        stats = await call(bc.statistics)
        assert stats.readers == 1 and stats.remote_readers == 0, stats
        # admitted (it joined): lost; else its attach or join was given up (refused:
        # a handshake or join the writer saw fail) or never made
        r.outcome = "remote: " + (
            "admitted" if stats.joined == 2 else "refused" if stats.refused else "gone"
        )
        assert stats.lost == stats.joined - 1 and stats.left == 0, stats
        # every slot back once the local reader let go (the dead one's shares given up)
        with anyio.fail_after(HANG_S):
            while (await call(bc.statistics)).slots_in_use:
                await anyio.sleep(0.002)
        stats = await call(bc.statistics)
        assert stats.slots_free == FULL_POOL, stats.slots_free
    # closed: the local reader got every step, in order (it checked each), then the end
    with anyio.fail_after(HANG_S):
        while True:
            text = await local.line()
            assert text is not None, f"{r.scenario}: the local reader ended: {local.log}"
            assert not local.errors, f"{r.scenario}: the local reader: {local.errors}"
            if text.startswith("done "):
                break
    got = json.loads(text[5:])["n"]
    assert got == sent, f"{r.scenario}: the local reader got {got} of {sent} steps"
    assert await local.reap() == 0, local.log[-5:]
    r.records = sent
    # nothing of the broadcast left: its listening socket and everything else closed
    deadline = time.monotonic() + net_transport.GRACE + 2.0
    while (writer_fds() - before_bc).total():
        net_transport.reap()
        assert time.monotonic() < deadline, (
            f"{r.scenario}: {dict(writer_fds() - before_bc)} left after the broadcast closed"
        )
        await anyio.sleep(0.02)


# -- calls: the victim serves them, or makes them ----------------------------------------------


async def call_server_round(h: Harness, v: Victim, r: Round, rng: random.Random, mode: str) -> None:
    """Kill a call server (``ringwire.serve``) with calls pending: handlers holding
    them (``hold``: every pending call, those still in the ring or waiting for a
    handler included, must fail at once with ``BrokenResourceError``), or while it
    echoes a stream of calls (``echo``: each call returns its own record or fails)."""
    r.victim = "call server"
    h.n_server_paths += 1
    path = str(h.tmp / f"calls{h.n_server_paths}.sock")
    conc = rng.choice([1, 2, 4])
    max_queued = rng.choice([0, 1, 4])
    hold = mode == "hold"
    calls = conc + max_queued + rng.randint(1, 6) if hold else rng.randint(1, 8)
    cfg = h.victim_cfg(
        rng, "call_server", r.survivor, path=path, concurrency=conc, max_queued=max_queued,
        hold=hold, busy_at=conc,
    )  # fmt: skip
    spin_us = rng.choice([0, 50])
    salt = cfg["salt"]
    await v.begin(cfg)
    await v.until("listening")
    sync = r.survivor == "sync"
    if sync:
        chan: Any = await anyio.to_thread.run_sync(
            lambda: ringwire.connect_sync(path, slots=CHAOS_SLOTS, spin_us=spin_us)
        )
        client: Any = ringwire.SyncClient(chan)
    else:
        chan = await ringwire.connect(path, slots=CHAOS_SLOTS, spin_us=spin_us)
        client = ringwire.Client(chan)
    failed: list[float] = []
    answered = 0
    seqs = iter(range(1 << 30))

    async def call(rec: Any) -> Any:
        if sync:
            return await anyio.to_thread.run_sync(lambda: client.call(rec, timeout=HANG_S * 4))
        return await client.call(rec, timeout=HANG_S * 4)

    async def caller() -> None:
        nonlocal answered
        try:
            while True:
                n = next(seqs)
                reply = await call(make_record(n, salt))
                err = check_record(reply, n)
                assert err is None, f"{r.scenario}: {err}"
                del reply
                answered += 1
                if hold:
                    raise AssertionError(f"{r.scenario}: a held call was answered")
        except BrokenResourceError:
            failed.append(time.perf_counter())

    async with contextlib.AsyncExitStack() as stack:
        if sync:
            stack.callback(client.close)
        else:
            await stack.enter_async_context(client)
        with anyio.fail_after(HANG_S * 4):
            async with anyio.create_task_group() as tg:
                for _ in range(calls):
                    tg.start_soon(caller)
                if hold:
                    await v.until("busy")
                    while client.pending < calls:  # every call sent (or in its send)
                        await anyio.sleep(0.0005)
                        if client.pending >= conc + max_queued and rng.random() < 0.01:
                            break  # sometimes kill while a send still waits for room
                    await anyio.sleep(rng.uniform(0, 0.005))
                    v.kill()
                else:
                    tg.start_soon(_killer, v, rng.uniform(0.002, 0.08), "accepted")
        assert v.killed_at is not None
        assert len(failed) == calls, f"{r.scenario}: {calls - len(failed)} calls did not fail"
        assert client.pending == 0, f"{r.scenario}: {client.pending} calls still pending"
        r.latencies["all calls failed"] = max(failed) - v.killed_at
        stats = chan.statistics()
        assert stats.slots_in_use == 0 and stats.loans_outstanding == 0, stats
        assert stats.slots_free == FULL_POOL, stats.slots_free
        r.records = answered
        with pytest.raises(BrokenResourceError):  # and every later call at once
            await call(make_record(0, salt))
    await v.reap()
    if os.path.exists(path):  # a dead listener's socket file stays: replace and remove it
        async with ringwire.listen(path, slots=None):
            pass
    assert not os.path.exists(path)


async def call_client_round(h: Harness, v: Victim, r: Round, rng: random.Random, mode: str) -> None:
    """Kill a ``ringwire.Client`` while our ``serve`` has its handlers running (async
    handlers, or blocking ones in threads for the "sync" survivor): ``serve`` raises
    ``BrokenResourceError`` at once and every running handler is cancelled."""
    r.victim = "call client"
    conc = rng.choice([1, 2, 4, 8])
    calls = conc + rng.randint(0, 4)
    sync = r.survivor == "sync"
    survivor = "trio" if r.survivor == "trio" else "asyncio"  # the async listener either way
    cfg = h.victim_cfg(rng, "call_client", survivor, calls=calls)
    started = cancelled = 0
    all_running = anyio.Event()
    cancelled_exc = anyio.get_cancelled_exc_class()  # (a worker thread has no backend)

    async def handler(rec: Any) -> Any:
        nonlocal started, cancelled
        assert check_record(rec, rec[0]) is None, check_record(rec, rec[0])
        started += 1
        if started == conc:
            all_running.set()
        try:
            await anyio.sleep(HANG_S * 10)
        except cancelled_exc:
            cancelled += 1
            raise
        raise AssertionError("a handler outlived its dead client")

    def blocking(rec: Any) -> Any:
        nonlocal started, cancelled
        assert check_record(rec, rec[0]) is None, check_record(rec, rec[0])
        # an idle worker thread keeps its last job's arguments: let the slot go now
        ringwire.release(rec)
        started += 1
        if started == conc:
            anyio.from_thread.run_sync(all_running.set)
        deadline = time.monotonic() + HANG_S * 10
        try:
            while time.monotonic() < deadline:
                time.sleep(0.002)
                anyio.from_thread.check_cancelled()
        except cancelled_exc:
            cancelled += 1
            raise
        raise AssertionError("a blocking handler outlived its dead client")

    await v.begin(cfg)
    side = await h.accept_from(v.pid, survivor)
    raised: list[float] = []

    async def serving() -> None:
        try:
            await ringwire.serve(side.ch, blocking if sync else handler, concurrency=conc)
        except BrokenResourceError:
            raised.append(time.perf_counter())
            return
        raise AssertionError(f"{r.scenario}: serve returned although its client was killed")

    try:
        with anyio.fail_after(HANG_S * 4):
            async with anyio.create_task_group() as tg:
                tg.start_soon(serving)
                await v.until("calling")
                await all_running.wait()
                await anyio.sleep(rng.uniform(0, 0.01))
                v.kill()
        assert raised, f"{r.scenario}: serve did not raise"
        lat = raised[0] - (v.killed_at or 0.0)
        if calls >= 2 * conc:  # concurrency + max_queued admitted: the server stopped reading,
            # and a full server looks at its client only every callcore.POLL_PEER_S
            r.latencies["serve raised, less the full server's poll"] = max(0.0, lat - FULL_POLL_S)
        else:
            r.latencies["serve raised"] = lat
        assert started == conc, (started, conc)
        assert cancelled == started, f"{r.scenario}: {started - cancelled} handlers not cancelled"
        r.records = started
        if sync:  # an idle worker thread keeps its last job (a call it was handed as the
            # cancellation came) until its next: give every thread of the pool a new one
            async with anyio.create_task_group() as flush:
                for _ in range(calls + conc):
                    flush.start_soon(anyio.to_thread.run_sync, time.sleep, 0.02)
        gc.collect()  # the cancelled handlers' frames (reference cycles through their tracebacks)
        held = side.statistics().slot_arrays_held
        assert held == 0, f"{r.scenario}: {held} requests' slot arrays outlived their handlers"
    finally:
        await side.aclose()


async def _now(fn: Callable[[], Any]) -> Any:
    return fn()


SCENARIOS: dict[str, tuple[Callable[..., Awaitable[None]], str]] = {
    "call-server/calls-pending": (call_server_round, "hold"),
    "call-server/echoing": (call_server_round, "echo"),
    "call-client/handlers-running": (call_client_round, "running"),
    "broadcast-reader/stream": (broadcast_round, "stream"),
    "broadcast-reader/slow": (broadcast_round, "slow"),
    "broadcast-reader/holding-slots": (broadcast_round, "hold"),
    "broadcast-reader/policy-fail": (broadcast_round, "fail"),
    "remote-broadcast-reader/stream": (remote_broadcast_round, "stream"),
    "remote-broadcast-reader/holding-slots": (remote_broadcast_round, "hold"),
    "remote-broadcast-reader/joining": (remote_broadcast_round, "join"),
    "consumer/stream": (consumer_round, "stream"),
    "consumer/slow": (consumer_round, "slow"),
    "consumer/holding-slots": (consumer_round, "hold"),
    "consumer/parked": (consumer_round, "parked"),
    "consumer/we-only-send": (consumer_round, "quiet"),
    "consumer/we-only-send-slowly": (consumer_round, "quiet-slow"),
    "producer/stream": (producer_round, "stream"),
    "producer/slow": (producer_round, "slow"),
    "producer/loans": (producer_round, "loans"),
    "producer/ring-full": (producer_round, "full"),
    "producer/slot-wait": (producer_round, "slotwait"),
    "producer/parked-after-all": (producer_round, "sent_all"),
    "client/request-response": (echo_round, "echo"),
    "listener/handshake": (server_round, "handshake"),
    "listener/handshake-big-pool": (server_round, "handshake-big-pool"),
    "listener/request-response": (server_round, "echo"),
    "client/handshake": (handshake_round, "small"),
    "client/handshake-big-pool": (handshake_round, "bigpool"),
}


@dataclass
class Report:
    seed: int
    kills: int = 0
    records: int = 0
    retried: list[str] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    by_kind: Counter[str] = field(default_factory=Counter)
    outcomes: Counter[str] = field(default_factory=Counter)
    worst: float = 0.0
    latencies: list[float] = field(default_factory=list)
    sends_after: list[int] = field(default_factory=list)

    def summary(self) -> str:
        lat = sorted(self.latencies) or [0.0]
        p50 = lat[len(lat) // 2]
        p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))]
        return (
            f"seed {self.seed}: {self.kills} kills, {self.records} records checked, detection "
            f"p50 {p50 * 1e3:.1f} ms p99 {p99 * 1e3:.1f} ms max {self.worst * 1e3:.1f} ms; "
            f"reruns {len(self.retried)}; by kind {dict(sorted(self.by_kind.items()))}; "
            f"handshake outcomes {dict(self.outcomes)}; sends that succeeded after the kill "
            f"(a sender that never waits) max {max(self.sends_after, default=0)}"
        )


async def run_round(h: Harness, name: str, survivor: str, seed: int, report: Report) -> Round:
    fn, mode = SCENARIOS[name]
    v = await h.victims.get()
    r = Round(name, survivor, seed)
    before = shm_names_of({os.getpid()})
    try:
        await fn(h, v, r, random.Random(seed), mode)
    except BaseException as exc:
        await v.dispose()
        if isinstance(exc, Exception):
            raise AssertionError(
                f"chaos round {name} (survivor {survivor}, seed {seed}, victim pid {v.pid}) "
                f"failed: {exc!r}\nvictim said: {v.log[-8:]}"
            ) from exc
        raise
    report.kills += 1
    await h.finish(v, r, before)
    return r


# the scenarios that run over tcp:// as well: one connection's (broadcast is a
# shared-memory ring, the calls ride on a channel like the echo rounds, the big pool is
# a shared-memory segment)
TCP_SCENARIOS = [
    name
    for name in SCENARIOS
    if name.split("/")[0] in ("consumer", "producer", "client", "listener")
    and "big-pool" not in name
]


async def chaos(tmp: Path, backend: str, kills: int, seed: int, transport: str = "shm") -> Report:
    rng = random.Random(seed)
    report = Report(seed)
    survivors = ["asyncio", "sync"] if backend == "asyncio" else ["trio"]
    only = os.environ.get("RINGWIRE_CHAOS_ONLY")  # e.g. "consumer/parked,producer/slow"
    names = only.split(",") if only else list(SCENARIOS if transport == "shm" else TCP_SCENARIOS)
    if net_transport is None:  # no pyzmq: no remote broadcast readers
        names = [name for name in names if not name.startswith("remote-")]
    if transport == "tcp":
        # an attach a killed client never made is given up after 1 s (and checked below)
        where: dict[str, Any] = {"handshake_timeout": 1.0}
        async_at: Any = "tcp://127.0.0.1:0"
        sync_at: Any = "tcp://127.0.0.1:0"
    else:
        where = {}
        async_at, sync_at = tmp / "async.sock", tmp / "sync.sock"
    sync_lst = None
    try:
        async with anyio.create_task_group() as tg:
            victims = Victims(tg)
            try:
                async with ringwire.listen(
                    async_at, slots=CHAOS_SLOTS, spin_us=rng.choice([0, 50]), **where
                ) as lst:
                    sync_lst = ringwire.SyncListener(
                        sync_at, slots=CHAOS_SLOTS, spin_us=rng.choice([0, 50]), **where
                    )
                    h = Harness(tmp, backend, lst, sync_lst, victims, transport)
                    i = 0
                    while report.kills < kills:
                        name = names[i % len(names)] if i < len(names) else rng.choice(names)
                        survivor = rng.choice(survivors)
                        i += 1
                        round_seed = rng.randrange(1 << 32)
                        for attempt in range(RETRIES + 1):
                            r = await run_round(h, name, survivor, round_seed, report)
                            if r.worst <= DETECT_S:
                                break
                            what = (
                                f"{name} (survivor {survivor}, seed {round_seed}): "
                                f"{ {k: round(x * 1e3, 1) for k, x in r.latencies.items()} } ms"
                            )
                            if attempt < RETRIES:
                                report.retried.append(what)
                            else:
                                report.violations.append(what)
                        report.by_kind[f"{r.victim}"] += 1
                        if os.environ.get("RINGWIRE_CHAOS_VERBOSE"):
                            print(
                                f"  {name:28} {survivor:7} {r.outcome or r.sends_after or '':10} "
                                f"records {r.records:6} "
                                + " ".join(f"{k}={x * 1e3:.1f}ms" for k, x in r.latencies.items())
                            )
                        if r.outcome:
                            report.outcomes[r.outcome] += 1
                        if r.sends_after is not None:
                            report.sends_after.append(r.sends_after)
                        report.records += r.records
                        report.latencies.extend(r.latencies.values())
                        report.worst = max(report.worst, r.worst)
                    if transport == "tcp":  # every attach a killed client left is given up
                        with anyio.fail_after(5):
                            while lst._acceptor.next_deadline() is not None:
                                await anyio.sleep(0.05)
            finally:
                await victims.aclose()
    finally:
        if sync_lst is not None:
            sync_lst.close()
    return report


def run_chaos(tmp_path: Path, backend: str, kills: int, transport: str = "shm") -> Report:
    seed = chaos_seed()
    what = f"{backend}, {transport}"
    print(f"chaos[{what}]: seed {seed} (RINGWIRE_CHAOS_SEED={seed} replays it), {kills} kills")
    t0 = time.monotonic()
    report = anyio.run(chaos, tmp_path, backend, kills, seed, transport, backend=backend)
    print(f"chaos[{what}]: {report.summary()} in {time.monotonic() - t0:.1f} s")
    for what in report.retried:
        print(f"  rerun (missed {DETECT_S * 1e3:.0f} ms once): {what}")
    assert not report.violations, (
        f"seed {seed}: survivors missed the {DETECT_S * 1e3:.0f} ms bound on every attempt: "
        f"{report.violations}"
    )
    assert report.kills >= kills
    return report


async def runtime_chaos(kills: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    policy = runtime.Restart(max_restarts=1_000_000, window=1.0, backoff=0.0)
    workers = [
        runtime.Worker(
            f"w{i}",
            "chaos.workers:chaos_echo",
            policy=policy,
            slots=CHAOS_SLOTS,
            spin_us=rng.choice([0, 50]),
            backend=rng.choice(["asyncio", "trio"]),
            capacity=rng.choice([8 * KiB, 64 * KiB]),
            options={"salt": rng.randrange(1, 1 << 30)},
        )
        for i in range(2)
    ]
    killed: dict[int, tuple[float, str]] = {}  # pid -> (perf_counter at the kill, when)
    broken: dict[int, float] = {}  # pid -> when the front's channel reported it
    stats = Counter[str]()
    latencies: list[float] = []
    done = anyio.Event()
    topo = runtime.Topology(workers, slots=CHAOS_SLOTS, ready_timeout=60, drain_timeout=5)

    async def drive(name: str) -> None:
        """Request/response with worker ``name``: record i, echo of record i, checked;
        after a death, wait for the restarted worker and start again from 0."""
        salt = rng.randrange(1 << 30)
        chan: ringwire.Channel | None = None
        while not done.is_set():
            try:
                chan = await topo.wait_channel(name, replacing=chan)
            except runtime.WorkerGone:
                return
            n = 0
            try:
                while not done.is_set():
                    await chan.send(make_record(n, salt))
                    reply = await chan.receive()
                    assert check_record(reply, n) is None, check_record(reply, n)
                    n += 1
                    del reply
            except BrokenResourceError:
                broken[chan.peer_pid] = time.perf_counter()
            except EndOfStream:
                return  # the topology is stopping
            finally:
                stats["records"] += n

    async def killer() -> None:
        while stats["kills"] < kills:
            await anyio.sleep(rng.uniform(0.02, 0.25))
            name = rng.choice(topo.names)
            when = rng.choice(["serving", "serving", "starting"])
            if when == "starting":
                # wait for this worker's next start-up (kill the serving one first)
                st = topo.status()[name]
                if st.state == "ready" and st.pid:
                    killed[st.pid] = (time.perf_counter(), "serving")
                    os.kill(st.pid, signal.SIGKILL)
                    stats["kills"] += 1
                    stats["kills serving"] += 1
                with anyio.fail_after(30):
                    while True:
                        st = topo.status()[name]
                        if st.state == "starting" and st.pid and st.pid not in killed:
                            break
                        await anyio.sleep(0.001)
                await anyio.sleep(rng.uniform(0, 0.4))  # imports, then the handshake
            else:
                with anyio.fail_after(30):
                    while True:
                        st = topo.status()[name]
                        if st.state == "ready" and st.pid and st.pid not in killed:
                            break
                        await anyio.sleep(0.005)
            st = topo.status()[name]
            if st.pid and st.pid not in killed and st.state in ("starting", "ready"):
                killed[st.pid] = (time.perf_counter(), st.state)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(st.pid, signal.SIGKILL)
                stats["kills"] += 1
                stats[f"kills {'starting' if st.state == 'starting' else 'serving'}"] += 1
        done.set()

    async with topo:
        with topo.subscribe(max_buffer=10_000) as events:

            async def watch() -> None:
                async for ev in events:
                    if isinstance(ev, runtime.WorkerExit) and not ev.expected:
                        assert ev.signal == signal.SIGKILL, ev.describe()
                        assert ev.pid in killed, f"a worker died that we did not kill: {ev}"
                        assert ev.slots_in_use_after == 0, ev.describe()
                        stats["slots reclaimed"] += ev.slots_reclaimed
                        stats["names swept by the supervisor"] += len(ev.swept)
                        stats["exits"] += 1

            async with anyio.create_task_group() as tg:
                tg.start_soon(watch)
                with anyio.fail_after(HANG_S * 2 * kills + 60):
                    async with anyio.create_task_group() as work:
                        for name in topo.names:
                            work.start_soon(drive, name)
                        await killer()
                        # every death reported, the last restarts settled: stop the drivers
                        while stats["exits"] < stats["kills"]:
                            await anyio.sleep(0.01)
                        for name in topo.names:
                            await topo.wait_channel(name, replacing=None)
                        work.cancel_scope.cancel()
                await topo.stop()
                tg.cancel_scope.cancel()
    assert topo.state == "stopped"
    # a worker killed while serving: the front's channel reported it within DETECT_S
    for pid, (at, when) in killed.items():
        if when == "ready" or when == "serving":
            if pid in broken:
                latencies.append(broken[pid] - at)
    return {"stats": stats, "latencies": latencies, "killed": killed, "broken": broken}


def run_runtime_chaos(kills: int) -> None:
    seed = chaos_seed()
    print(f"runtime chaos: seed {seed} (RINGWIRE_CHAOS_SEED={seed} replays it), {kills} kills")
    t0 = time.monotonic()
    out = anyio.run(runtime_chaos, kills, seed)
    stats, lat = out["stats"], sorted(out["latencies"])
    print(
        f"runtime chaos: seed {seed}: {dict(stats)}; front detection over {len(lat)} kills "
        f"while serving: max {max(lat, default=0) * 1e3:.1f} ms, in {time.monotonic() - t0:.1f} s"
    )
    assert stats["kills"] >= kills and stats["exits"] >= kills, stats
    assert stats["kills serving"] and lat, "no worker was killed while serving"
    slow = [x for x in lat if x > DETECT_S]
    # the front may be between a reply and its next request, or restarting: a latency
    # is only counted when its channel was in use; allow scheduling outliers, not hangs
    assert len(slow) <= max(1, len(lat) // 10), f"seed {seed}: detections over 100 ms: {slow}"
    assert max(lat) < 1.0, f"seed {seed}: a front took {max(lat):.3f} s to notice a death"
