"""asyncio pipe floors: one byte each way over two ``os.pipe()``, with ``add_reader``
callbacks or with streams."""

from __future__ import annotations

import asyncio
import contextlib
import os
from typing import Any

from perf.peers.base import Peer, aserve_rounds, clock, run_async

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
            await aserve_rounds(ctrl, serve)
        finally:
            loop.remove_reader(rfd)

    run_async(loop_kind, main)


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
            await aserve_rounds(ctrl, serve)
        finally:
            rt.close()
            tr.close()
            await asyncio.sleep(0)

    run_async(loop_kind, main)


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
