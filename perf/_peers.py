"""Peers for the transport benchmark (:mod:`perf.transport`).

A *peer* is one transport under test: a parent side (a class here, living in the
benchmark process) and a child side (a module-level function, run in a
``multiprocessing`` *spawn* child so nothing is inherited by accident).

Every peer speaks the same small protocol over a private control pipe
(``multiprocessing.Pipe``), which is never part of what is timed::

    child -> parent   ("ready", info)          set up, connected, waiting
    parent -> child   ("round", n)             serve exactly n messages, then ...
    child -> parent   ("done", info)           ... report and block on the pipe again
    parent -> child   None                     exit
    child -> parent   ("error", traceback)     anything went wrong

Between rounds a child is blocked in ``ctrl.recv()``: it uses no CPU, so a peer that
spins while it serves (the busy-poll floor, ringwire's hot mode) does not steal a
core from the peer being measured next.  That is what lets :mod:`perf.transport`
interleave all peers of a table round-robin in one run.

Every message is the same ~100-byte msgpack record (:class:`Req`), encoded and
decoded with msgspec on both sides: the parent encodes a request, the child decodes
it, encodes it back, the parent decodes the reply.  The floors (one byte over pipes,
a shared int64, a semaphore pair) carry no record: they are what the OS and Python
cost without any payload or codec.

Kinds of peers:

* ``rt`` (round trip), parent method ``rt_round(n) -> list[int]``: the
  ``time.perf_counter_ns`` duration of each of n round trips.
* ``tp`` (throughput), parent method ``tp_round(n) -> int``: nanoseconds from the
  first send until the child reports that it has received and decoded all n records.
* ``idle``: the child parks on an empty channel; the parent reads the child's CPU
  time from ``/proc/<pid>/stat``.

Async peers (``is_async = True``) have coroutine methods; the harness runs them on
the peer's own event loop runner (asyncio or uvloop).

Cleanup: the parent unlinks every ``/dev/shm`` name and removes every socket file it
made in ``close()``; children set ``PR_SET_PDEATHSIG`` so they cannot outlive a
killed benchmark, and every blocking wait in a child has a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import mmap
import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import msgspec

clock = time.perf_counter_ns

# Child-side limit on any single blocking wait (seconds): a child whose parent
# vanished without killing it gives up after this long.
CHILD_WAIT_S = 120.0
SETUP_TIMEOUT_S = 60.0
BATCH = 256  # records per send_many / put_many batch


class PeerUnavailable(Exception):
    """The peer's library is not installed (or not usable here): skip it."""


class PeerFailed(Exception):
    """The peer failed while running (child error, timeout, death)."""


# --------------------------------------------------------------------------- the record


class Req(msgspec.Struct, array_like=True):
    """A ~100-byte request record, the kind a tokenizer front end sends a GPU worker."""

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


ENC = msgspec.msgpack.Encoder()
DEC = msgspec.msgpack.Decoder(Req)
RECORD_BYTES = len(ENC.encode(make_record(123456)))


class Blob(msgspec.Struct, array_like=True):
    """A 4 KiB record: an id, a sequence number and an opaque 4 KiB-ish payload
    (a prompt's text, a small embedding, a chunk of a response)."""

    rid: str
    seq: int
    data: bytes


BLOB_BYTES = 4096


def _blob_data_len(total: int) -> int:
    """The ``data`` length that makes an encoded Blob (any seq < 2**31) ``total`` bytes."""
    n = total - len(ENC.encode(Blob("req-7f3a9c21-00000", 2**31 - 1, b"")))
    while n > 0 and len(ENC.encode(Blob("req-7f3a9c21-00000", 2**31 - 1, bytes(n)))) > total:
        n -= 1
    return n


_BLOB_DATA = bytes(range(256)) * (BLOB_BYTES // 256)
_BLOB_DATA = _BLOB_DATA[: _blob_data_len(BLOB_BYTES)]


def make_blob(seq: int = 0) -> Blob:
    return Blob(rid="req-7f3a9c21-00000", seq=seq, data=_BLOB_DATA)


class RecordKind:
    """One record shape of the round-trip tables: its msgspec type, a factory and a
    typed decoder.  ``suffix`` goes into peer names (empty for the 100-byte record)."""

    def __init__(self, size: int, tp: Any, make: Callable[[int], Any], suffix: str) -> None:
        self.size = size
        self.type = tp
        self.make = make
        self.dec = msgspec.msgpack.Decoder(tp)
        self.nbytes = len(ENC.encode(make(123456)))
        self.suffix = suffix


KINDS: dict[int, RecordKind] = {
    100: RecordKind(100, Req, make_record, ""),
    BLOB_BYTES: RecordKind(BLOB_BYTES, Blob, make_blob, ", 4 KiB"),
}


def _ff_dumps(obj: Any) -> bytes:  # faster-fifo serializer: msgspec instead of pickle
    return ENC.encode(obj)


def _ff_loads(buf: Any) -> Any:
    return DEC.decode(buf)


# --------------------------------------------------------------------------- child plumbing


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when the parent dies (no orphans if killed)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # pragma: no cover - not Linux
        pass


def _child_entry(fn: Callable[..., None], ctrl: Any, *args: Any) -> None:
    _die_with_parent()
    try:
        fn(ctrl, *args)
    except BaseException:  # report everything, including KeyboardInterrupt
        with contextlib.suppress(Exception):
            ctrl.send(("error", traceback.format_exc()))
        raise SystemExit(1) from None
    finally:
        with contextlib.suppress(Exception):
            ctrl.close()


def _ctrl_recv(ctrl: Any) -> Any:
    if not ctrl.poll(CHILD_WAIT_S):
        raise TimeoutError("no command from the parent")
    return ctrl.recv()


def _serve_rounds(ctrl: Any, serve: Callable[[int], Any], ready_info: Any = None) -> None:
    """The child's command loop for synchronous peers."""
    ctrl.send(("ready", ready_info))
    while True:
        cmd = _ctrl_recv(ctrl)
        if cmd is None:
            return
        _, n = cmd
        gc.disable()
        c0 = time.process_time_ns()
        try:
            info = serve(n)
        finally:
            cpu = time.process_time_ns() - c0
            gc.enable()
        ctrl.send(("done", {"cpu_ns": cpu, "info": info}))


async def _aserve_rounds(ctrl: Any, serve: Callable[[int], Any], ready_info: Any = None) -> None:
    """The child's command loop for async peers.  Blocking on the control pipe
    stalls the event loop between rounds -- deliberately: nothing else runs then."""
    ctrl.send(("ready", ready_info))
    while True:
        cmd = _ctrl_recv(ctrl)
        if cmd is None:
            return
        _, n = cmd
        gc.disable()
        c0 = time.process_time_ns()
        try:
            info = await serve(n)
        finally:
            cpu = time.process_time_ns() - c0
            gc.enable()
        ctrl.send(("done", {"cpu_ns": cpu, "info": info}))


def new_loop(loop_kind: str) -> asyncio.AbstractEventLoop:
    """A fresh event loop of the given kind ("asyncio" or "uvloop")."""
    if loop_kind == "uvloop":
        import uvloop

        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def close_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel what is left on ``loop`` and close it (what ``asyncio.run`` does)."""
    try:
        pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for t in pending:
            t.cancel()
        if pending:
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
    finally:
        loop.close()


def _run_async(loop_kind: str, coro_fn: Callable[[], Any]) -> None:
    loop = new_loop(loop_kind)
    asyncio.set_event_loop(loop)
    try:
        loop.run_until_complete(coro_fn())
    finally:
        asyncio.set_event_loop(None)
        close_loop(loop)


def proc_cpu_seconds(pid: int) -> float:
    """utime + stime of a whole process (all threads), from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        data = f.read()
    fields = data[data.rindex(b")") + 2 :].split()
    utime, stime = int(fields[11]), int(fields[12])
    return (utime + stime) / os.sysconf("SC_CLK_TCK")


# --------------------------------------------------------------------------- parent base


class Peer:
    """Parent side of a peer.  Subclasses set ``name``/``kind`` and implement setup."""

    name = "?"
    kind = "rt"  # "rt", "tp" or "idle"
    is_async = False
    loop_kind: str | None = None  # "asyncio" / "uvloop" for async peers

    def __init__(self) -> None:
        self.ctx = mp.get_context("spawn")
        self.proc: Any = None
        self.ctrl: Any = None
        self._cleanups: list[Callable[[], None]] = []
        self.ready_info: Any = None
        self.last_info: Any = None

    # -- child management
    def spawn(self, child_fn: Callable[..., None], *args: Any) -> None:
        parent_end, child_end = self.ctx.Pipe()
        self.ctrl = parent_end
        proc = self.ctx.Process(
            target=_child_entry,
            args=(child_fn, child_end, *args),
            daemon=True,
            name=f"perf-peer-{self.name}",
        )
        try:
            proc.start()
        finally:
            child_end.close()
        self.proc = proc

    def expect(self, tag: str, timeout: float = SETUP_TIMEOUT_S) -> Any:
        """Wait for ``(tag, info)`` from the child; raise PeerFailed otherwise."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                ok = self.ctrl.poll(max(0.0, min(left, 0.5)))
            except (EOFError, OSError) as e:
                raise PeerFailed(f"child gone ({e!r})") from None
            if ok:
                try:
                    msg = self.ctrl.recv()
                except (EOFError, OSError):
                    raise PeerFailed(f"child died (exit code {self.proc.exitcode})") from None
                if msg[0] == "error":
                    raise PeerFailed("child raised:\n" + msg[1])
                if msg[0] != tag:
                    raise PeerFailed(f"expected {tag!r}, got {msg!r}")
                return msg[1]
            if self.proc is not None and not self.proc.is_alive() and not self.ctrl.poll(0):
                raise PeerFailed(f"child died (exit code {self.proc.exitcode})")
            if left <= 0:
                raise PeerFailed(f"timed out after {timeout:.0f} s waiting for {tag!r}")

    def start_round(self, n: int) -> None:
        self.ctrl.send(("round", n))

    def finish_round(self, timeout: float) -> Any:
        self.last_info = self.expect("done", timeout)
        return self.last_info

    def on_cleanup(self, fn: Callable[[], None]) -> None:
        self._cleanups.append(fn)

    # -- lifecycle (sync versions; async peers override the a* ones)
    def setup(self) -> None:
        raise NotImplementedError

    async def asetup(self) -> None:
        raise NotImplementedError

    async def aclose_transport(self) -> None:
        """Async peers: close parent-side transport objects on their own loop."""

    def close(self) -> None:
        """Stop the child (politely, then by force) and release every resource."""
        proc, ctrl = self.proc, self.ctrl
        if ctrl is not None:
            with contextlib.suppress(Exception):
                ctrl.send(None)
        if proc is not None:
            proc.join(3.0)
            if proc.is_alive():
                proc.terminate()
                proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join(2.0)
        if ctrl is not None:
            with contextlib.suppress(Exception):
                ctrl.close()
        while self._cleanups:
            fn = self._cleanups.pop()
            with contextlib.suppress(Exception):
                fn()
        self.proc = self.ctrl = None

    def kill_child(self) -> None:
        if self.proc is not None and self.proc.is_alive():
            self.proc.kill()

    def child_pids(self) -> list[int]:
        """Every child process of this peer (for the CPU-load bookkeeping)."""
        return [self.proc.pid] if self.proc is not None and self.proc.pid else []


def _posix_ipc() -> Any:
    try:
        import posix_ipc
    except ImportError as e:
        raise PeerUnavailable("posix_ipc not installed") from e
    return posix_ipc


def _shm_unlinker(posix_ipc: Any, name: str) -> Callable[[], None]:
    def unlink() -> None:
        with contextlib.suppress(posix_ipc.ExistentialError):
            posix_ipc.unlink_shared_memory(name)

    return unlink


def _sem_unlinker(posix_ipc: Any, name: str) -> Callable[[], None]:
    def unlink() -> None:
        with contextlib.suppress(posix_ipc.ExistentialError):
            posix_ipc.unlink_semaphore(name)

    return unlink


def _tmpdir(peer: Peer) -> str:
    d = tempfile.mkdtemp(prefix="rwperf-")
    peer.on_cleanup(lambda: shutil.rmtree(d, ignore_errors=True))
    return d


# =========================================================================== async RT


# ---- asyncio pipe floor, callbacks: loop.add_reader + os.read/os.write, one byte.


def _child_pipe_floor(
    ctrl: Any, loop_kind: str, rconn: Any, wconn: Any, task: bool = False
) -> None:
    rfd, wfd = rconn.fileno(), wconn.fileno()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        state: dict[str, Any] = {"left": 0, "done": None, "fut": None}

        def on_readable() -> None:
            data = os.read(rfd, 4096)
            if not data:
                loop.remove_reader(rfd)
                return
            if task:  # hand the byte to the waiting task; it answers
                fut = state["fut"]
                if fut is not None and not fut.done():
                    fut.set_result(data)
                return
            os.write(wfd, data)
            state["left"] -= len(data)
            if state["left"] <= 0 and state["done"] is not None and not state["done"].done():
                state["done"].set_result(None)

        loop.add_reader(rfd, on_readable)

        async def serve(n: int) -> None:
            if task:
                for _ in range(n):
                    fut = state["fut"] = loop.create_future()
                    os.write(wfd, await fut)
                return
            state["left"] = n
            state["done"] = loop.create_future()
            await state["done"]

        try:
            await _aserve_rounds(ctrl, serve)
        finally:
            loop.remove_reader(rfd)

    _run_async(loop_kind, main)


class PipeFloor(Peer):
    """Two event loops exchanging one byte over a pair of os.pipe()s.

    A persistent ``loop.add_reader`` callback on each side does ``os.read``; the parent
    awaits a future the callback completes.  The child either answers straight from
    its callback (``task=False``: no task woken per byte -- the cheapest thing an
    asyncio program can do, the floor the targets use), or wakes a task that awaits a
    future and answers (``task=True``: what any ``await``-style receive costs)."""

    kind = "rt"
    is_async = True

    def __init__(self, loop_kind: str, task: bool = False) -> None:
        super().__init__()
        self.loop_kind = loop_kind
        self.task = task
        how = "add_reader, task echo" if task else "add_reader, callback echo"
        self.name = f"asyncio pipe floor ({how}) [{loop_kind}]"

    async def asetup(self) -> None:
        p2c_r, p2c_w = self.ctx.Pipe(duplex=False)  # os.pipe() underneath on Linux
        c2p_r, c2p_w = self.ctx.Pipe(duplex=False)
        self._keep = (p2c_w, c2p_r)
        self.spawn(_child_pipe_floor, self.loop_kind, p2c_r, c2p_w, self.task)
        p2c_r.close()
        c2p_w.close()
        self.wfd, self.rfd = p2c_w.fileno(), c2p_r.fileno()
        self.on_cleanup(p2c_w.close)
        self.on_cleanup(c2p_r.close)
        self.ready_info = self.expect("ready")
        loop = asyncio.get_running_loop()
        self._fut: asyncio.Future[None] | None = None

        def on_readable() -> None:
            os.read(self.rfd, 4096)
            fut = self._fut
            if fut is not None and not fut.done():
                fut.set_result(None)

        loop.add_reader(self.rfd, on_readable)
        self._loop = loop

    async def rt_round(self, n: int) -> list[int]:
        loop = self._loop
        wfd = self.wfd
        out = []
        self.start_round(n)
        for _ in range(n):
            t0 = clock()
            fut = self._fut = loop.create_future()
            os.write(wfd, b"x")
            await fut
            out.append(clock() - t0)
        return out

    async def aclose_transport(self) -> None:
        with contextlib.suppress(Exception):
            self._loop.remove_reader(self.rfd)


# ---- asyncio pipe floor, streams: connect_read_pipe / connect_write_pipe.


def _child_pipe_streams(ctrl: Any, loop_kind: str, rconn: Any, wconn: Any) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        # the transports own (and close) duplicates of the pipe fds
        rt, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(os.dup(rconn.fileno()), "rb", 0)
        )
        tr, pr = await loop.connect_write_pipe(
            asyncio.streams.FlowControlMixin, os.fdopen(os.dup(wconn.fileno()), "wb", 0)
        )
        writer = asyncio.StreamWriter(tr, pr, None, loop)

        async def serve(n: int) -> None:
            for _ in range(n):
                b = await reader.readexactly(1)
                writer.write(b)

        try:
            await _aserve_rounds(ctrl, serve)
        finally:
            rt.close()
            tr.close()
            await asyncio.sleep(0)

    _run_async(loop_kind, main)


class PipeStreams(Peer):
    """The same one-byte exchange with asyncio streams on both ends (a task per side)."""

    kind = "rt"
    is_async = True

    def __init__(self, loop_kind: str) -> None:
        super().__init__()
        self.loop_kind = loop_kind
        self.name = f"asyncio pipe floor (streams) [{loop_kind}]"

    async def asetup(self) -> None:
        p2c_r, p2c_w = self.ctx.Pipe(duplex=False)
        c2p_r, c2p_w = self.ctx.Pipe(duplex=False)
        self.spawn(_child_pipe_streams, self.loop_kind, p2c_r, c2p_w)
        p2c_r.close()
        c2p_w.close()
        self.ready_info = self.expect("ready")
        loop = asyncio.get_running_loop()
        self.reader = asyncio.StreamReader()
        # the transports own (and close) duplicates of the pipe fds
        self._rt, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(self.reader),
            os.fdopen(os.dup(c2p_r.fileno()), "rb", 0),
        )
        tr, pr = await loop.connect_write_pipe(
            asyncio.streams.FlowControlMixin, os.fdopen(os.dup(p2c_w.fileno()), "wb", 0)
        )
        self._wt = tr
        self.writer = asyncio.StreamWriter(tr, pr, None, loop)
        self.on_cleanup(p2c_w.close)
        self.on_cleanup(c2p_r.close)

    async def rt_round(self, n: int) -> list[int]:
        reader, writer = self.reader, self.writer
        out = []
        self.start_round(n)
        for _ in range(n):
            t0 = clock()
            writer.write(b"x")
            await reader.readexactly(1)
            out.append(clock() - t0)
        return out

    async def aclose_transport(self) -> None:
        for t in (self._rt, self._wt):
            with contextlib.suppress(Exception):
                t.close()
        await asyncio.sleep(0)


# ---- zmq.asyncio PAIR over ipc:// with msgspec


def _child_zmq(ctrl: Any, loop_kind: str, addr: str, size: int = 100) -> None:
    import zmq
    import zmq.asyncio

    dec = KINDS[size].dec.decode

    async def main() -> None:
        zctx = zmq.asyncio.Context()
        sock = zctx.socket(zmq.PAIR)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(addr)

        async def serve(n: int) -> None:
            for _ in range(n):
                rec = dec(await sock.recv(copy=True))
                await sock.send(ENC.encode(rec))

        try:
            await _aserve_rounds(ctrl, serve)
        finally:
            sock.close(0)
            zctx.term()

    _run_async(loop_kind, main)


class ZmqAsync(Peer):
    """``zmq.asyncio`` PAIR sockets over ``ipc://``, msgspec records both ways."""

    kind = "rt"
    is_async = True

    def __init__(self, loop_kind: str, size: int = 100) -> None:
        super().__init__()
        self.loop_kind = loop_kind
        self.kind_ = KINDS[size]
        self.name = f"zmq.asyncio PAIR ipc://{self.kind_.suffix} [{loop_kind}]"

    async def asetup(self) -> None:
        try:
            import zmq
            import zmq.asyncio
        except ImportError as e:
            raise PeerUnavailable("pyzmq not installed") from e
        d = _tmpdir(self)
        addr = f"ipc://{d}/pair.sock"
        self.zctx = zmq.asyncio.Context()
        self.sock = self.zctx.socket(zmq.PAIR)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(addr)
        self.spawn(_child_zmq, self.loop_kind, addr, self.kind_.size)
        self.ready_info = self.expect("ready")

    async def rt_round(self, n: int) -> list[int]:
        sock = self.sock
        rec = self.kind_.make(0)
        dec = self.kind_.dec.decode
        out = []
        self.start_round(n)
        for i in range(n):
            t0 = clock()
            rec.seq = i
            await sock.send(ENC.encode(rec))
            dec(await sock.recv(copy=True))
            out.append(clock() - t0)
        return out

    async def aclose_transport(self) -> None:
        with contextlib.suppress(Exception):
            self.sock.close(0)
            self.zctx.term()


# =========================================================================== hot RT (sync)


# ---- busy-poll floor: two processes spinning on shared int64s


def _child_busypoll(ctrl: Any, shm_name: str) -> None:
    import posix_ipc

    shm = posix_ipc.SharedMemory(shm_name)
    mm = mmap.mmap(shm.fd, 4096)
    shm.close_fd()
    mv = memoryview(mm).cast("q")
    state = {"seq": 0}

    def serve(n: int) -> None:
        seq = state["seq"]
        deadline = time.monotonic() + CHILD_WAIT_S
        for _ in range(n):
            seq += 1
            k = 0
            while mv[0] != seq:
                k += 1
                if not k & 0xFFFFF and time.monotonic() > deadline:
                    raise TimeoutError("busy-poll: parent stopped pinging")
            mv[8] = seq
        state["seq"] = seq

    try:
        _serve_rounds(ctrl, serve)
    finally:
        mv.release()
        mm.close()


class BusyPoll(Peer):
    """Two processes busy-polling one shared int64 each way (ping at byte 0, pong at
    byte 64 -- separate cache lines): the hardware-and-interpreter floor."""

    name = "busy-poll shared int64 (floor)"
    kind = "rt"

    def setup(self) -> None:
        posix_ipc = _posix_ipc()
        shm = posix_ipc.SharedMemory(None, posix_ipc.O_CREX, mode=0o600, size=4096)
        self.on_cleanup(_shm_unlinker(posix_ipc, shm.name))
        self.mm = mmap.mmap(shm.fd, 4096)
        shm.close_fd()
        self.mv = memoryview(self.mm).cast("q")
        self.on_cleanup(self._unmap)
        self.seq = 0
        self.spawn(_child_busypoll, shm.name)
        self.ready_info = self.expect("ready")
        posix_ipc.unlink_shared_memory(shm.name)

    def _unmap(self) -> None:
        self.mv.release()
        self.mm.close()

    def rt_round(self, n: int) -> list[int]:
        mv = self.mv
        seq = self.seq
        out = []
        deadline = time.monotonic() + 60.0
        self.start_round(n)
        for _ in range(n):
            seq += 1
            t0 = clock()
            mv[0] = seq
            k = 0
            while mv[8] != seq:
                k += 1
                if not k & 0xFFFFF and (time.monotonic() > deadline or not self.proc.is_alive()):
                    raise PeerFailed("busy-poll: child stopped answering")
            out.append(clock() - t0)
        self.seq = seq
        return out


# ---- posix_ipc semaphore ping-pong


def _child_sem(ctrl: Any, ping: str, pong: str, cpu: int | None = None) -> None:
    import posix_ipc

    if cpu is not None:
        os.sched_setaffinity(0, {cpu})

    s_ping = posix_ipc.Semaphore(ping)
    s_pong = posix_ipc.Semaphore(pong)

    def serve(n: int) -> None:
        acq, rel = s_ping.acquire, s_pong.release
        for _ in range(n):
            acq(CHILD_WAIT_S)
            rel()

    try:
        _serve_rounds(ctrl, serve)
    finally:
        s_ping.close()
        s_pong.close()


class SemPingPong(Peer):
    """Two POSIX named semaphores (posix_ipc), blocking ``sem_wait``: no payload."""

    name = "posix_ipc semaphore ping-pong"
    kind = "rt"

    def __init__(self, pin_cpu: int | None = None) -> None:
        super().__init__()
        self.pin_cpu = pin_cpu
        if pin_cpu is not None:
            self.name = f"posix_ipc semaphore ping-pong, both pinned to CPU {pin_cpu} (info)"

    def setup(self) -> None:
        posix_ipc = _posix_ipc()
        self.ping = posix_ipc.Semaphore(None, posix_ipc.O_CREX, mode=0o600, initial_value=0)
        self.on_cleanup(_sem_unlinker(posix_ipc, self.ping.name))
        self.on_cleanup(self.ping.close)
        self.pong = posix_ipc.Semaphore(None, posix_ipc.O_CREX, mode=0o600, initial_value=0)
        self.on_cleanup(_sem_unlinker(posix_ipc, self.pong.name))
        self.on_cleanup(self.pong.close)
        self.spawn(_child_sem, self.ping.name, self.pong.name, self.pin_cpu)
        self.ready_info = self.expect("ready")
        self.ping.unlink()
        self.pong.unlink()

    def _acquire_slowly(self, acq: Callable[[float], None]) -> None:
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline and self.proc.is_alive():
            try:
                acq(0.5)
                return
            except Exception:
                continue
        raise PeerFailed("semaphore: the child stopped answering")

    def rt_round(self, n: int) -> list[int]:
        rel, acq = self.ping.release, self.pong.acquire
        out = []
        saved = os.sched_getaffinity(0)
        if self.pin_cpu is not None:
            os.sched_setaffinity(0, {self.pin_cpu})
        try:
            self.start_round(n)
            for _ in range(n):
                t0 = clock()
                rel()
                try:
                    acq(0.5)
                except Exception:  # posix_ipc.BusyError: no answer yet -- is it alive?
                    self._acquire_slowly(acq)
                out.append(clock() - t0)
        finally:
            if self.pin_cpu is not None:
                os.sched_setaffinity(0, saved)
        return out


# ---- iceoryx2 publish-subscribe (Python binding), busy-polling subscribers

# iceoryx2 keeps its state in /dev/shm (data segments, connections, a global management
# segment) and under a root directory (default /tmp/iceoryx2/: node and service files).
# Every iceoryx2 peer here uses its own file-name prefix and a private root directory,
# so its names cannot collide with (or be confused with) anyone else's, and cleanup is
# exact: every /dev/shm/<prefix>* name and the root directory go in close(), even after
# a child was killed.


def _iox2() -> Any:
    try:
        import iceoryx2
    except Exception as e:  # ImportError, or a wheel that needs a newer glibc
        raise PeerUnavailable(f"iceoryx2 not importable ({type(e).__name__}: {e})") from e
    iceoryx2.set_log_level(iceoryx2.LogLevel.Error)  # no "no config file" chatter
    return iceoryx2


def _iox2_node(iox2: Any, prefix: str, root: str) -> Any:
    cfg = iox2.config.default()
    g = cfg.global_cfg
    g.prefix = iox2.FileName.new(prefix)
    g.root_path = iox2.Path.new(root.rstrip("/") + "/")
    return (
        iox2.NodeBuilder.new()
        .config(cfg)
        # ours are the benchmark's signals: no handler of iceoryx2's for SIGINT/SIGTERM
        .signal_handling_mode(iox2.SignalHandlingMode.Disabled)
        .create(iox2.ServiceType.Ipc)
    )


def _iox2_ports(
    iox2: Any, node: Any, pub_name: str, sub_name: str, max_len: int
) -> tuple[Any, Any, Any, Any]:
    import ctypes

    def service(name: str) -> Any:
        return (
            node.service_builder(iox2.ServiceName.new(name))
            .publish_subscribe(iox2.Slice[ctypes.c_uint8])
            .open_or_create()
        )

    ps, ss = service(pub_name), service(sub_name)
    pub = ps.publisher_builder().initial_max_slice_len(max_len).create()
    sub = ss.subscriber_builder().create()
    return ps, ss, pub, sub


def _iox2_sender(pub: Any) -> Callable[[bytes], None]:
    """Loan a slice of len(buf) bytes, copy the encoded record in, publish it."""
    import ctypes

    memmove, loan = ctypes.memmove, pub.loan_slice_uninit

    def send(buf: bytes) -> None:
        sample = loan(len(buf))
        memmove(sample.payload_ptr, buf, len(buf))
        sample.assume_init().send()

    return send


def _iox2_receiver(
    sub: Any, decode: Callable[[Any], Any], alive: Callable[[], bool]
) -> Callable[[], Any]:
    """Busy-poll the subscriber; decode straight from the shared-memory sample."""
    receive = sub.receive

    def recv() -> Any:
        k = 0
        while True:
            sample = receive()
            if sample is not None:
                break
            k += 1
            if not k & 0xFFFF and not alive():
                raise PeerFailed("iceoryx2: the other side stopped answering")
        obj = decode(sample.payload().as_memory_view())
        sample.delete()  # hand the chunk back now, not at garbage collection
        return obj

    return recv


def _child_iox2(ctrl: Any, prefix: str, root: str, base: str, size: int) -> None:
    iox2 = _iox2()
    kind = KINDS[size]
    node = _iox2_node(iox2, prefix, root)
    ports = _iox2_ports(iox2, node, base + "/pong", base + "/ping", kind.nbytes + 64)
    pub, sub = ports[2], ports[3]
    deadline = [0.0]
    send = _iox2_sender(pub)
    recv = _iox2_receiver(sub, kind.dec.decode, lambda: time.monotonic() < deadline[0])

    def serve(n: int) -> None:
        deadline[0] = time.monotonic() + CHILD_WAIT_S
        for _ in range(n):
            send(ENC.encode(recv()))

    try:
        _serve_rounds(ctrl, serve)
    finally:
        sub.delete()
        pub.delete()
        del ports, node


def iox2_leftovers(prefix: str) -> list[str]:
    """/dev/shm names that carry ``prefix`` (iceoryx2 segments of one peer)."""
    try:
        return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix))
    except OSError:
        return []


class Iceoryx2RT(Peer):
    """iceoryx2 publish-subscribe (``iceoryx2`` Python binding, IPC service type), one
    service each way with a ``Slice[c_uint8]`` payload: the msgspec-encoded record is
    copied into a loaned sample and published; the other side busy-polls
    ``Subscriber.receive()`` and decodes straight from the sample (zero-copy read)."""

    kind = "rt"
    _count = 0

    def __init__(self, size: int = 100) -> None:
        super().__init__()
        self.kind_ = KINDS[size]
        self.name = f"iceoryx2 pub/sub, busy-poll{self.kind_.suffix}"

    def setup(self) -> None:
        iox2 = _iox2()
        Iceoryx2RT._count += 1
        self.prefix = f"rwperf{os.getpid()}x{Iceoryx2RT._count}_"
        # cleanups run last-in first-out: ports and node, then stray names, then the root
        self.root = _tmpdir(self)
        self.on_cleanup(self._remove_leftovers)
        base = "rwperf/rt"
        node = _iox2_node(iox2, self.prefix, self.root)
        ports = _iox2_ports(iox2, node, base + "/ping", base + "/pong", self.kind_.nbytes + 64)
        self._iox = [node, *ports]
        self.on_cleanup(self._drop_ports)
        self.spawn(_child_iox2, self.prefix, self.root, base, self.kind_.size)
        self.ready_info = self.expect("ready")
        self._iox[3].update_connections()  # our publisher learns of the new subscriber
        self.send = _iox2_sender(self._iox[3])
        self.recv = _iox2_receiver(self._iox[4], self.kind_.dec.decode, self._alive)

    def _alive(self) -> bool:
        return self.proc is not None and self.proc.is_alive()

    def _drop_ports(self) -> None:
        for port in self._iox[3:]:
            with contextlib.suppress(Exception):
                port.delete()
        self._iox.clear()
        self.send = self.recv = None  # type: ignore[assignment]
        gc.collect()  # the node and services are freed here: their files go with them

    def _remove_leftovers(self) -> None:
        # a killed child cannot remove its own names: take every one with our prefix
        for name in iox2_leftovers(self.prefix):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join("/dev/shm", name))

    def rt_round(self, n: int) -> list[int]:
        send, recv = self.send, self.recv
        rec = self.kind_.make(0)
        out = []
        self.start_round(n)
        for i in range(n):
            t0 = clock()
            rec.seq = i
            send(ENC.encode(rec))
            recv()
            out.append(clock() - t0)
        return out


# ---- multiprocessing.Pipe


def _child_mppipe(ctrl: Any, conn: Any, size: int = 100) -> None:
    dec = KINDS[size].dec.decode

    def serve(n: int) -> None:
        recv, send = conn.recv_bytes, conn.send_bytes
        for _ in range(n):
            send(ENC.encode(dec(recv())))

    _serve_rounds(ctrl, serve)


class MpPipe(Peer):
    """``multiprocessing.Pipe()`` (a socketpair), ``send_bytes``/``recv_bytes`` of
    msgspec-encoded records."""

    kind = "rt"

    def __init__(self, size: int = 100) -> None:
        super().__init__()
        self.kind_ = KINDS[size]
        self.name = f"multiprocessing.Pipe{self.kind_.suffix}"

    def setup(self) -> None:
        a, b = self.ctx.Pipe()
        self.conn = a
        self.on_cleanup(a.close)
        self.spawn(_child_mppipe, b, self.kind_.size)
        b.close()
        self.ready_info = self.expect("ready")

    def rt_round(self, n: int) -> list[int]:
        send, recv = self.conn.send_bytes, self.conn.recv_bytes
        rec = self.kind_.make(0)
        dec = self.kind_.dec.decode
        out = []
        self.start_round(n)
        for i in range(n):
            t0 = clock()
            rec.seq = i
            send(ENC.encode(rec))
            try:
                dec(recv())
            except EOFError:
                raise PeerFailed("mp.Pipe: child closed") from None
            out.append(clock() - t0)
        return out


# =========================================================================== throughput


def _child_mpqueue(ctrl: Any, q: Any) -> None:
    def serve(n: int) -> int:
        get, dec = q.get, DEC.decode
        for _ in range(n):
            dec(get(timeout=CHILD_WAIT_S))
        return n

    _serve_rounds(ctrl, serve)


def _unlink_semlocks(*locks: Any) -> None:
    """Unlink the ``/dev/shm/sem.mp-*`` names of spawn-context locks now that the child
    has opened them (multiprocessing would keep them until the queue is collected).
    Best effort: uses multiprocessing internals, and does nothing if they changed."""
    try:
        from multiprocessing import resource_tracker, synchronize, util

        util_: Any = util  # private names: no stubs
        synchronize_: Any = synchronize
        names = {lk._semlock.name for lk in locks if lk is not None and lk._semlock.name}
        for fin in list(util_._finalizer_registry.values()):
            if (
                getattr(fin, "_callback", None) is synchronize_.SemLock._cleanup
                and fin._args[0] in names
            ):
                fin.cancel()
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                synchronize_.sem_unlink(name)
            resource_tracker.unregister(name, "semaphore")
    except Exception:  # pragma: no cover - internals moved; the names go at exit anyway
        pass


class MpQueueTP(Peer):
    """``multiprocessing.Queue``: ``put`` / ``get`` of msgspec-encoded records."""

    name = "multiprocessing.Queue"
    kind = "tp"

    def setup(self) -> None:
        self.q: Any = self.ctx.Queue()
        self.on_cleanup(self._close_q)
        self.spawn(_child_mpqueue, self.q)
        self.ready_info = self.expect("ready")
        _unlink_semlocks(*(getattr(self.q, a) for a in ("_rlock", "_wlock", "_sem")))

    def _close_q(self) -> None:
        self.q.close()
        self.q.join_thread()

    def tp_round(self, n: int, timeout: float) -> int:
        put = self.q.put
        rec = make_record()
        self.start_round(n)
        t0 = clock()
        for i in range(n):
            rec.seq = i
            put(ENC.encode(rec))
        self.finish_round(timeout)
        return clock() - t0


class CodecCeiling(Peer):
    """No transport: encode n records, decode n records, in this process.  Producer and
    consumer run in parallel in the real peers, so max(encode, decode) time bounds what
    any transport can reach with this record and codec."""

    name = "codec ceiling (no transport; max of encode, decode time)"
    kind = "tp"

    def setup(self) -> None:
        pass

    def tp_round(self, n: int, timeout: float) -> int:
        recs = [make_record(i) for i in range(BATCH)]
        enc, dec = ENC.encode, DEC.decode
        t0 = clock()
        bufs = [enc(recs[i % BATCH]) for i in range(n)]
        t1 = clock()
        for b in bufs:
            dec(b)
        t2 = clock()
        self.last_info = {"cpu_ns": 0, "info": {"encode_ns": t1 - t0, "decode_ns": t2 - t1}}
        return max(t1 - t0, t2 - t1)


def _child_ff(ctrl: Any, q: Any, batch: bool) -> None:
    from faster_fifo import Empty

    def serve(n: int) -> int:
        got = 0
        if batch:
            get_many = q.get_many
            while got < n:
                try:
                    got += len(get_many(timeout=CHILD_WAIT_S, max_messages_to_get=BATCH))
                except Empty:
                    raise TimeoutError("faster-fifo: nothing to get") from None
        else:
            get = q.get
            while got < n:
                get(timeout=CHILD_WAIT_S)
                got += 1
        return got

    _serve_rounds(ctrl, serve)


class FasterFifoTP(Peer):
    """faster-fifo ``Queue`` with msgspec as its ``dumps``/``loads`` (no pickle):
    ``put``/``get`` per record, or ``put_many``/``get_many`` in batches of BATCH."""

    kind = "tp"

    def __init__(self, batch: bool) -> None:
        super().__init__()
        self.batch = batch
        self.name = "faster-fifo put_many/get_many" if batch else "faster-fifo put/get"

    def setup(self) -> None:
        try:
            import faster_fifo
        except ImportError as e:
            raise PeerUnavailable("faster-fifo not installed") from e
        self.q = faster_fifo.Queue(max_size_bytes=8 * 1024 * 1024, dumps=_ff_dumps, loads=_ff_loads)
        self.on_cleanup(self.q.close)
        self.spawn(_child_ff, self.q, self.batch)
        self.ready_info = self.expect("ready")

    def tp_round(self, n: int, timeout: float) -> int:
        recs = [make_record(i) for i in range(BATCH)]
        q = self.q
        self.start_round(n)
        t0 = clock()
        if self.batch:
            put_many = q.put_many
            left = n
            while left > 0:
                k = min(BATCH, left)
                put_many(recs[:k] if k < BATCH else recs, timeout=timeout)
                left -= k
        else:
            put = q.put
            for i in range(n):
                put(recs[i % BATCH], timeout=timeout)
        self.finish_round(timeout)
        return clock() - t0


# =========================================================================== ringwire


def _rw_pair() -> Any:
    """A new ``pair()`` from ringwire's channel module (public name if exported)."""
    try:
        import ringwire
        from ringwire import _channel
    except ImportError as e:
        raise PeerUnavailable(f"ringwire transport not importable: {e}") from e
    pair = getattr(ringwire, "pair", None) or getattr(_channel, "pair", None)
    if pair is None:
        raise PeerUnavailable("ringwire has no pair()")
    return pair()


HOT_SPIN_US = 2_000_000.0  # "hot": spin up to 2 s before parking -- never parks in a round


# ---- async round trip


def _slots_kw(pool: bool) -> dict[str, Any]:
    """``connect`` keywords: the default tensor-slot pool, or none (``slots=None``)."""
    return {} if pool else {"slots": None}


def _rw_async_child(ctrl: Any, loop_kind: str, end: Any, make_serve: Any, **connect: Any) -> None:
    """Connect ``end`` asynchronously, serve the parent's rounds with
    ``make_serve(chan)`` (an ``async serve(n)``), close."""

    async def main() -> None:
        chan = await end.connect(**connect)
        try:
            await _aserve_rounds(ctrl, make_serve(chan))
        finally:
            await chan.aclose()

    _run_async(loop_kind, main)


def _rw_sync_child(ctrl: Any, end: Any, make_serve: Any, **connect: Any) -> None:
    """The blocking form of :func:`_rw_async_child`."""
    chan = end.connect_sync(**connect)
    try:
        _serve_rounds(ctrl, make_serve(chan))
    finally:
        chan.close()


def _child_rw_async_rt(
    ctrl: Any, loop_kind: str, end: Any, spin_us: float, size: int = 100, pool: bool = True
) -> None:
    def make_serve(chan: Any) -> Any:
        async def serve(n: int) -> dict[str, Any]:
            recv, send = chan.receive, chan.send
            for _ in range(n):
                await send(await recv())
            return _rw_stats(chan)

        return serve

    _rw_async_child(
        ctrl, loop_kind, end, make_serve, type=KINDS[size].type, spin_us=spin_us, **_slots_kw(pool)
    )


def _rw_stats(chan: Any) -> dict[str, Any]:
    try:
        st = chan.statistics()
        return {
            "receive_parks": st.receive_parks,
            "send_parks": st.send_parks,
            "doorbells_sent": st.doorbells_sent,
            "doorbells_received": st.doorbells_received,
            "records_received": st.records_received,
        }
    except Exception:
        return {}


class RingwireAsyncRT(Peer):
    """ringwire async endpoints (``ringwire.pair()``), ``send``/``receive`` of the record.

    ``spin_us=0``: both ends park on every wait (the doorbell path, every message);
    the default spin budget shows what a busy conversation gets."""

    kind = "rt"
    is_async = True

    def __init__(
        self, loop_kind: str, spin_us: float, label: str, size: int = 100, pool: bool = True
    ) -> None:
        super().__init__()
        self.loop_kind = loop_kind
        self.spin_us = spin_us
        self.kind_ = KINDS[size]
        self.pool = pool
        extra = "" if pool else ", no slot pool"
        self.name = f"ringwire {label}{extra}{self.kind_.suffix} [{loop_kind}]"

    async def asetup(self) -> None:
        a, b = _rw_pair()
        self.spawn(_child_rw_async_rt, self.loop_kind, b, self.spin_us, self.kind_.size, self.pool)
        self.chan = await a.connect(
            type=self.kind_.type,
            spin_us=self.spin_us,
            timeout=SETUP_TIMEOUT_S,
            **_slots_kw(self.pool),
        )
        self.ready_info = self.expect("ready")

    async def rt_round(self, n: int) -> list[int]:
        send, recv = self.chan.send, self.chan.receive
        rec = self.kind_.make(0)
        out = []
        self.start_round(n)
        for i in range(n):
            t0 = clock()
            rec.seq = i
            await send(rec)
            await recv()
            out.append(clock() - t0)
        return out

    async def aclose_transport(self) -> None:
        with contextlib.suppress(Exception):
            await self.chan.aclose()


# ---- hot (spinning) round trip, blocking API


def _child_rw_sync_rt(ctrl: Any, end: Any, spin_us: float, size: int = 100) -> None:
    chan = end.connect_sync(type=KINDS[size].type, spin_us=spin_us, timeout=SETUP_TIMEOUT_S)
    try:

        def serve(n: int) -> dict[str, Any]:
            recv, send = chan.receive, chan.send
            for _ in range(n):
                send(recv(CHILD_WAIT_S))
            return _rw_stats(chan)

        _serve_rounds(ctrl, serve)
    finally:
        chan.close()


class RingwireSyncRT(Peer):
    """ringwire blocking endpoints (``SyncChannel``); with a large spin budget both
    readers spin on the ring and never park during a round."""

    kind = "rt"

    def __init__(self, spin_us: float, label: str, size: int = 100) -> None:
        super().__init__()
        self.spin_us = spin_us
        self.kind_ = KINDS[size]
        self.name = f"ringwire {label}{self.kind_.suffix}"

    def setup(self) -> None:
        a, b = _rw_pair()
        self.spawn(_child_rw_sync_rt, b, self.spin_us, self.kind_.size)
        self.chan = a.connect_sync(
            type=self.kind_.type, spin_us=self.spin_us, timeout=SETUP_TIMEOUT_S
        )
        self.on_cleanup(self.chan.close)
        self.ready_info = self.expect("ready")

    def rt_round(self, n: int) -> list[int]:
        send, recv = self.chan.send, self.chan.receive
        rec = self.kind_.make(0)
        out = []
        self.start_round(n)
        for i in range(n):
            t0 = clock()
            rec.seq = i
            send(rec)
            recv(10.0)
            out.append(clock() - t0)
        return out


# ---- throughput


def _child_rw_tp(
    ctrl: Any, loop_kind: str | None, end: Any, batch: bool, pool: bool = True
) -> None:
    connect = {"type": Req, "timeout": SETUP_TIMEOUT_S, **_slots_kw(pool)}
    if loop_kind is None:  # blocking consumer

        def make_sync_serve(chan: Any) -> Any:
            def serve(n: int) -> dict[str, Any]:
                got = 0
                if batch:
                    rm = chan.receive_many
                    while got < n:
                        got += len(rm(BATCH, CHILD_WAIT_S))
                else:
                    recv = chan.receive
                    while got < n:
                        recv(CHILD_WAIT_S)
                        got += 1
                return _rw_stats(chan)

            return serve

        _rw_sync_child(ctrl, end, make_sync_serve, **connect)
        return

    def make_serve(chan: Any) -> Any:
        async def serve(n: int) -> dict[str, Any]:
            got = 0
            if batch:
                rm = chan.receive_many
                while got < n:
                    got += len(await rm(BATCH))
            else:
                recv = chan.receive
                while got < n:
                    await recv()
                    got += 1
            return _rw_stats(chan)

        return serve

    _rw_async_child(ctrl, loop_kind, end, make_serve, **connect)


class RingwireTP(Peer):
    """One producer -> one consumer over ringwire, default spin budget.  ``send`` /
    ``receive`` per record, or ``send_many`` / ``receive_many`` in batches of BATCH.
    ``loop_kind=None``: the blocking API on both ends."""

    kind = "tp"

    def __init__(self, loop_kind: str | None, batch: bool, pool: bool = True) -> None:
        super().__init__()
        self.loop_kind = loop_kind
        self.is_async = loop_kind is not None
        self.batch = batch
        self.pool = pool
        api = "send_many/receive_many" if batch else "send/receive"
        where = f"async [{loop_kind}]" if loop_kind else "sync"
        self.name = f"ringwire {where} {api}" + ("" if pool else ", no slot pool (info)")

    def setup(self) -> None:
        a, b = _rw_pair()
        self.spawn(_child_rw_tp, None, b, self.batch, self.pool)
        self.chan = a.connect_sync(type=Req, timeout=SETUP_TIMEOUT_S, **_slots_kw(self.pool))
        self.on_cleanup(self.chan.close)
        self.ready_info = self.expect("ready")

    async def asetup(self) -> None:
        a, b = _rw_pair()
        self.spawn(_child_rw_tp, self.loop_kind, b, self.batch, self.pool)
        self.chan = await a.connect(type=Req, timeout=SETUP_TIMEOUT_S, **_slots_kw(self.pool))
        self.ready_info = self.expect("ready")

    async def aclose_transport(self) -> None:
        with contextlib.suppress(Exception):
            await self.chan.aclose()

    def _records(self) -> list[Req]:
        return [make_record(i) for i in range(BATCH)]

    def tp_round(self, n: int, timeout: float) -> Any:
        if self.is_async:
            return self._atp_round(n, timeout)
        return self._stp_round(n, timeout)

    def _stp_round(self, n: int, timeout: float) -> int:
        recs = self._records()
        chan = self.chan
        self.start_round(n)
        t0 = clock()
        if self.batch:
            left = n
            while left > 0:
                k = min(BATCH, left)
                chan.send_many(recs[:k] if k < BATCH else recs, timeout)
                left -= k
        else:
            send = chan.send
            for i in range(n):
                send(recs[i % BATCH], timeout)
        self.finish_round(timeout)
        return clock() - t0

    async def _atp_round(self, n: int, timeout: float) -> int:
        recs = self._records()
        chan = self.chan
        self.start_round(n)
        t0 = clock()
        if self.batch:
            left = n
            while left > 0:
                k = min(BATCH, left)
                await chan.send_many(recs[:k] if k < BATCH else recs)
                left -= k
        else:
            send = chan.send
            for i in range(n):
                await send(recs[i % BATCH])
        self.finish_round(timeout)
        return clock() - t0


# ---- idle


def _child_rw_idle(ctrl: Any, loop_kind: str | None, end: Any) -> None:
    if loop_kind is None:

        def make_sync_serve(chan: Any) -> Any:
            def serve(n: int) -> dict[str, Any]:
                for _ in range(n):
                    chan.receive(CHILD_WAIT_S)
                return _rw_stats(chan)

            return serve

        _rw_sync_child(ctrl, end, make_sync_serve, type=Req, timeout=SETUP_TIMEOUT_S)
        return

    def make_serve(chan: Any) -> Any:
        async def serve(n: int) -> dict[str, Any]:
            for _ in range(n):
                await chan.receive()
            return _rw_stats(chan)

        return serve

    _rw_async_child(ctrl, loop_kind, end, make_serve, type=Req, timeout=SETUP_TIMEOUT_S)


class RingwireIdle(Peer):
    """A ringwire consumer (default spin budget) waiting on an empty channel."""

    kind = "idle"

    def __init__(self, loop_kind: str | None) -> None:
        super().__init__()
        self.loop_kind = loop_kind
        self.name = (
            f"ringwire async consumer [{loop_kind}], parked"
            if loop_kind
            else "ringwire blocking consumer, parked"
        )

    def setup(self) -> None:
        a, b = _rw_pair()
        self.spawn(_child_rw_idle, self.loop_kind, b)
        self.chan = a.connect_sync(type=Req, timeout=SETUP_TIMEOUT_S)
        self.on_cleanup(self.chan.close)
        self.ready_info = self.expect("ready")
