"""Victims and producers for tests/chaos/test_chaos.py (through harness.py) and
tests/load/test_load.py.

Run as a script (``python tests/chaos/workers.py``) the process imports ringwire, prints
``ready`` and waits for one JSON line on stdin naming its role and options; a harness
keeps a few of these started ahead of time, so the cost of starting Python is paid
while the previous round runs.  A closed stdin without a line means "not needed":
exit 0.  Lines on stdout tell the harness what happened:

``P <point> <json>``  a point of interest was reached (the harness may kill now)
``E <text>``          a check failed here (the harness fails the test)
``done <json>``       the role finished normally

The runtime's worker entries (``chaos.workers:chaos_echo``) are imported by spawned workers.

Records carry their sequence number and checksums end to end: ``[seq, crc(payload),
payload, array or None, crc(array)]``.  Every fourth or so carries a numpy array: a
few KiB (a small slot), tens of KiB (a large slot) or a few hundred bytes (inline);
the receiver checks the sequence (no gap, no duplicate, in order) and both checksums,
and re-checks every array it held when it lets it go (a slot reused too early would
show up there).
"""

from __future__ import annotations

import json
import os
import struct
import sys
import time
import zlib
from collections import deque
from typing import Any

import anyio
import numpy as np

import ringwire
from ringwire import SlotClass, SlotConfig

KiB = 1 << 10

# a small pool: cheap to create, quick to exhaust
CHAOS_SLOTS = SlotConfig(classes=(SlotClass(4 * KiB, 8), SlotClass(64 * KiB, 4)), threshold=1024)

_ARRAY_WORDS = (1000, 12_000, 64)  # 4 KB (small slot), 48 KB (large slot), 256 B (inline)


# -- records ----------------------------------------------------------------------------


def payload_for(seq: int, salt: int) -> bytes:
    n = 8 + (seq * 2654435761 + salt) % 240
    unit = struct.pack("<QQ", seq, salt ^ 0x5A5A5A5A5A5A5A5A)
    return (unit * (n // 16 + 1))[:n]


def array_kind(seq: int, salt: int) -> int:
    """-1: no array; 0, 1, 2: an index into _ARRAY_WORDS."""
    k = (seq * 7 + salt) % 12
    return k if k < 3 else -1


def make_array(seq: int, salt: int, kind: int, out: Any = None) -> Any:
    words = _ARRAY_WORDS[kind]
    arr = np.arange(words, dtype=np.uint32) if out is None else out
    if out is not None:
        arr[:] = np.arange(words, dtype=np.uint32)
    arr ^= np.uint32((seq * 40503 + salt) & 0xFFFFFFFF)
    return arr


def make_record(seq: int, salt: int, arrays: bool = True) -> list[Any]:
    payload = payload_for(seq, salt)
    kind = array_kind(seq, salt) if arrays else -1
    arr = make_array(seq, salt, kind) if kind >= 0 else None
    return [seq, zlib.crc32(payload), payload, arr, zlib.crc32(arr) if arr is not None else 0]


def check_record(rec: Any, expected: int, salt: int | None = None) -> str | None:
    """``None`` if ``rec`` is record ``expected`` (of the sender using ``salt``, when
    given), intact; else what is wrong."""
    try:
        seq, crc, payload, arr, acrc = rec
    except (TypeError, ValueError):
        return f"not a record: {rec!r:.80}"
    if seq != expected:
        kind = "duplicate" if isinstance(seq, int) and seq < expected else "gap"
        return f"{kind}: got seq {seq}, expected {expected}"
    if zlib.crc32(payload) != crc:
        return f"seq {seq}: payload checksum mismatch"
    if salt is not None and payload != payload_for(seq, salt):
        return f"seq {seq}: not the payload its sender made"
    if arr is not None and zlib.crc32(_bytes_of(arr)) != acrc:
        return f"seq {seq}: array checksum mismatch"
    return None


def _bytes_of(arr: Any) -> Any:
    return arr if isinstance(arr, np.ndarray) else arr.numpy()  # a torch tensor


def recheck(rec: Any) -> str | None:
    """Check a held record's array again (its slot must not have been reused)."""
    arr = rec[3]
    if arr is not None and zlib.crc32(_bytes_of(arr)) != rec[4]:
        return f"seq {rec[0]}: a held array changed under us (slot reused?)"
    return None


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# -- the script's protocol ------------------------------------------------------------------


class Child:
    """This script as a child process, driven from blocking code (the test's side):
    ``Child()`` starts it, :meth:`begin` gives it its role (waiting for ``ready``
    first), :meth:`until` reads up to a line, :meth:`finish` collects the rest."""

    def __init__(self, cfg: dict[str, Any] | None = None) -> None:
        import subprocess

        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.log: list[str] = []
        if cfg is not None:
            self.begin(cfg)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def begin(self, cfg: dict[str, Any]) -> None:
        assert self.readline() == "ready", self.log
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cfg) + "\n")
        self.proc.stdin.flush()

    def readline(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().rstrip("\n")
        self.log.append(line)
        assert not line.startswith("E "), self.log
        return line

    def until(self, prefix: str) -> str:
        while True:
            line = self.readline()
            if line.startswith(prefix):
                return line
            assert line, f"the child ended before {prefix!r}: {self.log}"

    def finish(self, timeout: float = 30) -> int:
        import subprocess

        try:
            out, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
        self.log += out.splitlines()
        return self.proc.returncode

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            import signal

            try:
                os.kill(self.pid, signal.SIGCONT)
                self.proc.kill()
            except ProcessLookupError:
                pass
        self.finish()


def say(*parts: Any) -> None:
    print(*parts, flush=True)


def point(name: str, **info: Any) -> None:
    say("P", name, json.dumps(info))


def fail(text: str) -> None:
    say("E", text.replace("\n", " | "))
    sys.stdout.flush()
    os._exit(3)


def slots_from(cfg: dict[str, Any]) -> SlotConfig | None:
    spec = cfg.get("slots", "chaos")
    if spec == "chaos":
        return CHAOS_SLOTS
    if spec == "default":
        return ringwire.DEFAULT_SLOTS
    if spec is None:
        return None
    return SlotConfig(
        classes=tuple(SlotClass(size, count) for size, count in spec["classes"]),
        threshold=spec.get("threshold", 1024),
        policy=spec.get("policy", "wait"),
    )


# -- roles (async: asyncio or trio) ---------------------------------------------------------


async def _connect(cfg: dict[str, Any]) -> ringwire.Channel:
    point("connecting")
    ch = await ringwire.connect(
        cfg["path"],
        capacity=cfg.get("capacity", ringwire.DEFAULT_CAPACITY),
        spin_us=cfg.get("spin_us", 50),
        slots=slots_from(cfg),
        handshake_timeout=10,
    )
    point("connected")
    return ch


async def role_consumer(cfg: dict[str, Any]) -> None:
    """Receive and check records; hold the last ``hold`` of them (re-checked when let
    go); send ``["ack", n]`` every ``ack_every`` records; ``holding`` once ``hold``
    slot arrays are held."""
    salt, hold, ack_every = cfg["salt"], cfg.get("hold", 0), cfg.get("ack_every", 16)
    ch = await _connect(cfg)
    held: deque[Any] = deque()
    slot_held = 0
    said_holding = False
    n = 0
    async with ch:
        while True:
            try:
                rec = await ch.receive()
            except ringwire.EndOfStream:
                break
            err = check_record(rec, n, salt)
            if err:
                fail(err)
            n += 1
            if hold:
                held.append(rec)
                if rec[3] is not None and rec[3].nbytes >= 1024:
                    slot_held += 1
                if len(held) > hold:
                    old = held.popleft()
                    if old[3] is not None and old[3].nbytes >= 1024:
                        slot_held -= 1
                    err = recheck(old)
                    if err:
                        fail(err)
                if not said_holding and slot_held >= cfg.get("holding_at", 1 << 30):
                    said_holding = True
                    point("holding", n=n)
            del rec
            if n % ack_every == 0:
                await ch.send(["ack", n])
        for old in held:
            err = recheck(old)
            if err:
                fail(err)
        held.clear()
        say("done", json.dumps({"n": n}))


async def role_producer(cfg: dict[str, Any]) -> None:
    """Send ``count`` records (forever if 0), ``pace`` seconds apart (0: flat out),
    then ``sent_all`` and wait to be killed or for the peer to close."""
    salt, count, pace = cfg["salt"], cfg.get("count", 0), cfg.get("pace", 0.0)
    loans = cfg.get("loans", False)
    ch = await _connect(cfg)
    async with ch:
        seq = 0
        try:
            while not count or seq < count:
                rec = make_record(seq, salt)
                kind = array_kind(seq, salt)
                if loans and kind >= 0 and ch._core.pool is not None and seq % 2:
                    out = await ch.loan((_ARRAY_WORDS[kind],), np.uint32)
                    rec[3] = make_array(seq, salt, kind, out)
                    del out
                await ch.send(rec)
                del rec
                seq += 1
                if pace:
                    await anyio.sleep(pace)
            point("sent_all", n=seq)
            await ch.receive()  # parked until the peer closes (or we are killed)
        except (ringwire.EndOfStream, ringwire.BrokenResourceError):
            pass
    say("done", json.dumps({"n": seq}))


async def role_echo_client(cfg: dict[str, Any]) -> None:
    """Request/response: send record i, wait for the echo of record i, check it."""
    salt = cfg["salt"]
    ch = await _connect(cfg)
    async with ch:
        seq = 0
        while not cfg.get("count") or seq < cfg["count"]:
            await ch.send(make_record(seq, salt))
            reply = await ch.receive()
            err = check_record(reply, seq)
            if err:
                fail("echo: " + err)
            del reply
            seq += 1
    say("done", json.dumps({"n": seq}))


async def role_server(cfg: dict[str, Any]) -> None:
    """Listen at ``path``; echo every record of the one connection, checking them."""
    async with ringwire.listen(
        cfg["path"], slots=slots_from(cfg), spin_us=cfg.get("spin_us", 50)
    ) as lst:
        point("listening", path=lst.path)  # (tcp://127.0.0.1:0: the port it got)
        conn = await lst.accept()
        point("accepted")
        n = 0
        try:
            while True:
                rec = await conn.receive()
                err = check_record(rec, n)
                if err:
                    fail("server: " + err)
                await conn.send(rec)
                del rec
                n += 1
        except ringwire.EndOfStream:
            pass
    say("done", json.dumps({"n": n}))


def role_consumer_sync(cfg: dict[str, Any]) -> None:
    """The consumer role on the blocking API."""
    salt, hold, ack_every = cfg["salt"], cfg.get("hold", 0), cfg.get("ack_every", 16)
    point("connecting")
    ch = ringwire.connect_sync(
        cfg["path"],
        capacity=cfg.get("capacity", ringwire.DEFAULT_CAPACITY),
        spin_us=cfg.get("spin_us", 50),
        slots=slots_from(cfg),
        handshake_timeout=10,
    )
    point("connected")
    held: deque[Any] = deque()
    n = 0
    with ch:
        while True:
            try:
                rec = ch.receive()
            except ringwire.EndOfStream:
                break
            err = check_record(rec, n, salt)
            if err:
                fail(err)
            n += 1
            if hold:
                held.append(rec)
                if len(held) > hold:
                    err = recheck(held.popleft())
                    if err:
                        fail(err)
            del rec
            if n % ack_every == 0:
                ch.send(["ack", n])
        held.clear()
    say("done", json.dumps({"n": n}))


async def role_idle(cfg: dict[str, Any]) -> None:
    """Connect and never touch the channel again: never receives, so never parks
    (a peer that dies like this rings no doorbell failure).  Holds the arrays of the
    first ``hold`` records."""
    ch = await _connect(cfg)
    held = [await ch.receive() for _ in range(cfg.get("hold", 0))]
    point("idle", held=len(held))
    await anyio.sleep(3600)
    await ch.aclose()


async def role_broadcast_reader(cfg: dict[str, Any]) -> None:
    """Subscribe to the broadcast at ``path`` (a Unix path, or its ``tcp://`` address:
    a remote reader) and check every record (from
    0, or -- ``mid_stream``: it joins while the writer sends -- from the first one's
    sequence number on); say ``reading`` after the first; hold the last ``hold``
    records (re-checked when let go), saying ``holding`` once ``holding_at`` slot
    arrays are held."""
    salt, hold = cfg["salt"], cfg.get("hold", 0)
    point("connecting")
    sub = await ringwire.subscribe(
        cfg["path"],
        spin_us=cfg.get("spin_us", 50),
        handshake_timeout=10,
    )
    point("connected", rank=sub.rank)
    held: deque[Any] = deque()
    slot_held = n = 0
    first: int | None = None  # the first record's sequence number
    async with sub:
        while True:
            try:
                rec = await sub.receive()
            except ringwire.EndOfStream:
                break
            if first is None:
                first = 0
                if cfg.get("mid_stream") and isinstance(rec, list) and rec:
                    n = first = rec[0]  # (checked below: an int, and the record intact)
            err = check_record(rec, n, salt)
            if err:
                fail(err)
            n += 1
            if n == first + 1:
                point("reading", first=first)
            if hold:
                held.append(rec)
                slot_held += rec[3] is not None and rec[3].nbytes >= 1024
                if len(held) > hold:
                    err = recheck(held.popleft())
                    if err:
                        fail(err)
                if slot_held == cfg.get("holding_at", 1 << 30):
                    point("holding", n=n)
            del rec
        for old in held:
            err = recheck(old)
            if err:
                fail(err)
        say("done", json.dumps({"n": n}))


async def role_call_server(cfg: dict[str, Any]) -> None:
    """Listen at ``path`` and ``ringwire.serve`` the one connection: the handler checks
    each request, says ``busy`` once ``busy_at`` handlers run at once, and either holds
    the call (``hold``: until cancelled) or echoes it."""
    running = 0

    async def handler(rec: Any) -> Any:
        nonlocal running
        err = check_record(rec, rec[0] if isinstance(rec, list) and rec else -1)
        if err:
            fail("call server: " + err)
        running += 1
        try:
            if running == cfg.get("busy_at", 1 << 30):
                point("busy", n=running)
            if cfg.get("hold"):
                await anyio.sleep(3600)
            return rec
        finally:
            running -= 1

    async with ringwire.listen(
        cfg["path"], slots=slots_from(cfg), spin_us=cfg.get("spin_us", 50)
    ) as lst:
        point("listening", path=lst.path)  # (tcp://127.0.0.1:0: the port it got)
        conn = await lst.accept()
        point("accepted")
        async with conn:
            await ringwire.serve(
                conn, handler, concurrency=cfg["concurrency"], max_queued=cfg.get("max_queued")
            )
    say("done", "{}")


async def role_call_client(cfg: dict[str, Any]) -> None:
    """``calls`` concurrent ``ringwire.Client`` calls over one connection, each a
    checksummed record; says ``calling`` once all are sent (the server holds them)."""
    salt = cfg["salt"]
    ch = await _connect(cfg)

    async def one(i: int) -> None:
        await client.call(make_record(i, salt))

    async with ringwire.Client(ch) as client, anyio.create_task_group() as tg:
        for i in range(cfg["calls"]):
            tg.start_soon(one, i)
        while client.pending < cfg["calls"]:
            await anyio.sleep(0.001)
        point("calling", n=client.pending)
        await anyio.sleep(3600)


ASYNC_ROLES = {
    "call_server": role_call_server,
    "call_client": role_call_client,
    "broadcast_reader": role_broadcast_reader,
    "idle": role_idle,
    "consumer": role_consumer,
    "producer": role_producer,
    "echo_client": role_echo_client,
    "server": role_server,
}


# -- load producers (tests/load/test_load.py) ---------------------------------------------------


def role_load_producer(cfg: dict[str, Any]) -> None:
    """Send ``count`` records to the listener at ``path`` (blocking API, batches of
    ``batch`` via send_many, loans for every other slot array, torch tensors when
    ``torch`` is set); report RSS samples at the end, then close cleanly."""
    salt, count, batch = cfg["salt"], cfg["count"], cfg.get("batch", 1)
    use_torch = cfg.get("torch", False)
    torch: Any = None
    if use_torch:
        import torch  # noqa: F811 - only this producer pays for it
    ch = ringwire.connect_sync(
        cfg["path"], capacity=cfg.get("capacity", ringwire.DEFAULT_CAPACITY), slots=CHAOS_SLOTS
    )
    samples: list[tuple[int, int]] = []
    marks = {max(1, count // 10), count // 2, count}
    slot_arrays = 0
    t0 = time.perf_counter()
    with ch:
        seq = 0
        pending: list[Any] = []
        while seq < count:
            rec = make_record(seq, salt)
            kind = array_kind(seq, salt)
            if kind >= 0:
                slot_arrays += kind < 2  # 4 KB and 48 KB go through slots
                if seq % 2 and kind < 2:  # a loan: filled in place, no copy
                    out = ch.loan((_ARRAY_WORDS[kind],), np.uint32, timeout=60)
                    rec[3] = make_array(seq, salt, kind, out)
                    del out
                if use_torch and seq % 3 == 0:
                    rec[3] = torch.from_numpy(np.array(rec[3]))
            if batch > 1 and kind < 0:
                pending.append(rec)
                if len(pending) >= batch:
                    ch.send_many(pending, timeout=60)
                    pending.clear()
            else:
                if pending:
                    ch.send_many(pending, timeout=60)
                    pending.clear()
                ch.send(rec, timeout=60)
            del rec
            seq += 1
            if seq in marks:
                samples.append((seq, rss()))
        if pending:
            ch.send_many(pending, timeout=60)
        elapsed = time.perf_counter() - t0
        stats = ch.statistics()
        ch.send(["end", salt, seq, samples, elapsed], timeout=60)
        # the consumer has let go of everything of ours: every slot comes back by a
        # release (not by a reclaim: the connection is still up)
        bye = ch.receive(timeout=120)
        if bye != "bye":
            fail(f"expected bye, got {bye!r:.80}")
        deadline = time.monotonic() + 10
        while ch.statistics().slots_in_use and time.monotonic() < deadline:
            time.sleep(0.005)
        stats = ch.statistics()
    say(
        "done",
        json.dumps(
            {
                "n": seq,
                "slots_in_use": stats.slots_in_use,
                "loans_outstanding": stats.loans_outstanding,
                "releases": stats.releases_received,
                "slot_arrays": slot_arrays,
                "reclaimed": stats.slots_reclaimed,
            }
        ),
    )


# -- runtime workers (spawned by runtime.Topology in tests/chaos/harness.py) --------------------


async def chaos_echo(ctx: Any) -> None:
    """Check every request ``[seq, ...]`` (gap-free from 0 per incarnation) and echo it."""
    expected = 0
    salt = ctx.options.get("salt", 0)
    async for request in ctx.channel:
        if isinstance(request, list) and request and request[0] == "sleep":
            await anyio.sleep(request[1])
            continue
        err = check_record(request, expected)
        if err:
            raise AssertionError(f"worker {ctx.name} incarnation {ctx.incarnation}: {err}")
        expected += 1
        if salt and expected % 7 == 0:
            await anyio.sleep(0.001)  # let the front run ahead a little
        await ctx.channel.send(request)
        del request


# -- main ---------------------------------------------------------------------------------


def main() -> None:
    say("ready")
    line = sys.stdin.readline()
    if not line.strip():
        return  # a spare that was not needed
    cfg = json.loads(line)
    role = cfg["role"]
    try:
        if role == "load_producer":
            role_load_producer(cfg)
        elif role == "consumer" and cfg.get("backend") == "sync":
            role_consumer_sync(cfg)
        else:
            anyio.run(ASYNC_ROLES[role], cfg, backend=cfg.get("backend", "asyncio"))
    except Exception as exc:  # a failure the harness did not cause by killing us
        import traceback

        fail(f"{role}: {type(exc).__name__}: {exc}: {traceback.format_exc()}")


if __name__ == "__main__":
    main()
