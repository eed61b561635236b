"""The base of every peer: the records, the child-process plumbing and :class:`Peer`
(see :mod:`perf.peers` for the protocol)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
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


# --------------------------------------------------------------------------- child plumbing


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when the parent dies (no orphans if killed)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # pragma: no cover - not Linux
        pass


def child_entry(fn: Callable[..., None], ctrl: Any, *args: Any) -> None:
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


def ctrl_recv(ctrl: Any) -> Any:
    if not ctrl.poll(CHILD_WAIT_S):
        raise TimeoutError("no command from the parent")
    return ctrl.recv()


def serve_rounds(ctrl: Any, serve: Callable[[int], Any], ready_info: Any = None) -> None:
    """The child's command loop for synchronous peers."""
    ctrl.send(("ready", ready_info))
    while True:
        cmd = ctrl_recv(ctrl)
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


async def aserve_rounds(ctrl: Any, serve: Callable[[int], Any], ready_info: Any = None) -> None:
    """The child's command loop for async peers.  Blocking on the control pipe
    stalls the event loop between rounds -- deliberately: nothing else runs then."""
    ctrl.send(("ready", ready_info))
    while True:
        cmd = ctrl_recv(ctrl)
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


def run_async(loop_kind: str, coro_fn: Callable[[], Any]) -> None:
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
            target=child_entry,
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


def tmpdir(peer: Peer) -> str:
    """A new ``/tmp/rwperf-*`` directory, removed (with its contents) at ``peer.close()``."""
    d = tempfile.mkdtemp(prefix="rwperf-")
    peer.on_cleanup(lambda: shutil.rmtree(d, ignore_errors=True))
    return d
