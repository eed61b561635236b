"""A re-implementation of vLLM's shared-memory broadcast scheme (``MessageQueue``), for
``perf.broadcast`` to measure ringwire's broadcast against.

Written from the public description of vLLM's ``shm_broadcast.py`` (its docstrings,
and the issues and pull requests the ringwire issue cites) -- the scheme, not its
code.  What it does, faithfully:

* **Fixed chunks.**  One shared-memory buffer of ``max_chunks`` chunks of
  ``max_chunk_bytes`` each, then one metadata block per chunk: a *written* flag byte
  and one *read* flag byte per reader.  A chunk is writable when it is not written or
  every reader has read it; readable by reader r when it is written and r's flag is
  0.  The writer clears the written flag, writes the chunk, resets every read flag,
  fences, sets the written flag, fences; a reader reads the chunk, sets its read flag,
  fences.  (The fences are a lock acquire/release, as vLLM's ``memory_fence``; the
  aarch64 fix of vLLM #27858.)  A message larger than a chunk would go through the
  ZeroMQ socket instead (the "overflow"); the benchmark's records never do.
* **Spinning, then a ZeroMQ notify.**  After every write the writer sends one byte on
  a ZeroMQ ``PUB`` socket (``SNDHWM=1``: extra notifies are dropped).  A reader that
  finds nothing to read spins with ``sched_yield`` while its last read is less than
  ``busy_loop_s`` old (vLLM's default: 1 s -- the "a core for a second after every
  read" of vLLM #19036), and otherwise waits on its ``SUB`` socket (``CONFLATE=1``)
  for a notify, at most 5 s (the recheck interval added because notifies can be
  lost, vLLM PR #45224), then re-reads the flags.
* **The writer spins** (``sched_yield``) while the next chunk is still being read.

What is changed, and why: records are msgspec-encoded, not pickled (the table compares
transports, and ringwire's rows use msgspec too); the segment is a ``posix_ipc``
segment unlinked at close (not ``multiprocessing.shared_memory``); readiness is a sleep
after the readers subscribe (vLLM's ``wait_until_ready`` handshake is a startup cost,
not measured here).
"""

from __future__ import annotations

import mmap
import os
import threading
import time

import posix_ipc

__all__ = ["MQReader", "MQWriter"]

_fence_lock = threading.Lock()


def memory_fence() -> None:
    with _fence_lock:
        pass


class _Buffer:
    def __init__(self, name: str, n_reader: int, chunk: int, chunks: int, create: bool) -> None:
        self.n_reader = n_reader
        self.chunk = chunk
        self.chunks = chunks
        self.meta_size = 1 + n_reader
        self.meta_offset = chunk * chunks
        size = chunks * (chunk + self.meta_size)
        flags = posix_ipc.O_CREX if create else 0
        shm = posix_ipc.SharedMemory(name, flags, mode=0o600, size=size if create else 0)
        try:
            self.buf = mmap.mmap(shm.fd, size)
        finally:
            shm.close_fd()
        self.name = name
        self.mv = memoryview(self.buf)

    def data(self, idx: int) -> memoryview:
        return self.mv[idx * self.chunk : (idx + 1) * self.chunk]

    def meta(self, idx: int) -> memoryview:
        start = self.meta_offset + idx * self.meta_size
        return self.mv[start : start + self.meta_size]

    def close(self) -> None:
        self.mv.release()
        self.buf.close()


class MQWriter:
    """The writer: ``enqueue(bytes)``."""

    def __init__(
        self, n_reader: int, notify_addr: str, max_chunk_bytes: int = 1 << 20, max_chunks: int = 10
    ) -> None:
        import zmq

        self.name = f"/rwb-vllm-{os.getpid()}-{id(self) & 0xFFFF:x}"
        self.buffer = _Buffer(self.name, n_reader, max_chunk_bytes, max_chunks, create=True)
        self.idx = 0
        self._zctx = zmq.Context()
        self.notify = self._zctx.socket(zmq.PUB)
        self.notify.setsockopt(zmq.SNDHWM, 1)
        self.notify.setsockopt(zmq.LINGER, 0)
        self.notify.bind(notify_addr)
        self.addr = notify_addr

    def handle(self) -> tuple[str, int, int, int, str]:
        b = self.buffer
        return self.name, b.n_reader, b.chunk, b.chunks, self.addr

    def enqueue(self, payload: bytes, timeout: float | None = None) -> None:
        b = self.buffer
        if len(payload) + 5 > b.chunk:
            raise ValueError("this benchmark's records never overflow a chunk")
        start = time.monotonic()
        while True:
            meta = b.meta(self.idx)
            memory_fence()
            written = meta[0]
            read_count = sum(meta[1:])
            if written and read_count != b.n_reader:
                meta.release()
                os.sched_yield()  # the writer spins while the chunk is being read
                if timeout is not None and time.monotonic() - start > timeout:
                    raise TimeoutError
                continue
            meta[0] = 0
            data = b.data(self.idx)
            data[0] = 0  # not overflow
            data[1:5] = len(payload).to_bytes(4, "big")
            data[5 : 5 + len(payload)] = payload
            data.release()
            for i in range(1, b.n_reader + 1):
                meta[i] = 0
            memory_fence()
            meta[0] = 1
            memory_fence()
            meta.release()
            self.idx = (self.idx + 1) % b.chunks
            break
        try:
            self.notify.send(b"\x00", flags=1)  # zmq.NOBLOCK: a full HWM drops it
        except Exception:
            pass

    def close(self) -> None:
        self.notify.close(0)
        self._zctx.term()
        self.buffer.close()
        try:
            posix_ipc.unlink_shared_memory(self.name)
        except posix_ipc.ExistentialError:
            pass


class MQReader:
    """Reader ``rank``: ``dequeue() -> bytes``."""

    RECHECK_MS = 5000

    def __init__(
        self, handle: tuple[str, int, int, int, str], rank: int, busy_loop_s: float = 1.0
    ) -> None:
        import zmq

        name, n_reader, chunk, chunks, addr = handle
        self.buffer = _Buffer(name, n_reader, chunk, chunks, create=False)
        self.rank = rank
        self.idx = 0
        self.busy_loop_s = busy_loop_s
        self.last_read = time.monotonic()
        self._zctx = zmq.Context()
        self.sub = self._zctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.CONFLATE, 1)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, "")
        self.sub.connect(addr)
        self.poller = zmq.Poller()
        self.poller.register(self.sub, zmq.POLLIN)
        self._zmq = zmq

    def _wait(self) -> None:
        if time.monotonic() <= self.last_read + self.busy_loop_s:
            os.sched_yield()  # busy loop for busy_loop_s after the last read
            return
        if self.poller.poll(self.RECHECK_MS):
            try:
                self.sub.recv(flags=self._zmq.NOBLOCK, copy=False)
            except self._zmq.Again:
                pass

    def dequeue(self) -> bytes:
        b = self.buffer
        while True:
            meta = b.meta(self.idx)
            memory_fence()
            if not meta[0] or meta[self.rank + 1]:
                meta.release()
                self._wait()
                continue
            data = b.data(self.idx)
            n = int.from_bytes(data[1:5], "big")
            out = bytes(data[5 : 5 + n])
            data.release()
            meta[self.rank + 1] = 1
            memory_fence()
            meta.release()
            self.idx = (self.idx + 1) % b.chunks
            self.last_read = time.monotonic()
            return out

    def close(self) -> None:
        self.sub.close(0)
        self._zctx.term()
        self.buffer.close()
