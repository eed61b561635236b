"""A large tensor one way over loopback: ringwire through NIXL, ringwire through ZeroMQ
frames, the bare socket floor and bare NIXL, side by side.

Run from the repository root (pyzmq and nixl-cu12 installed)::

    python -m perf.nixl --quick         # < 60 s on a 2-core VM
    python -m perf.nixl                 # more rounds
    python -m perf.nixl --json PATH     # default perf/results/nixl.json

One question: how close does a ``tcp://`` connection that negotiated NIXL come to the
bandwidth of the loopback itself for a 256 MiB (and a 64 MiB) ``uint8`` array sent one
way?  This process sends; a child receives and answers with a small ack once it has
the bytes.  Peers, each with a child of its own, timed round-robin in the same run
(the first peer rotated every turn), medians reported:

* **ringwire NIXL send**: ``send`` copies the array once into the connection's
  registered send arena; the child's worker READs it into its registered mirror
  (Ext 21) and the child gets a view;
* **ringwire NIXL loan**: the same with a ``loan`` (no copy at all; not filled);
* **ringwire ZeroMQ frames send**: the child runs with ``RINGWIRE_NIXL=0``, so the
  handshake says no NIXL and the array goes as a zero-copy frame (Ext 20);
* **socket floor**: a bare TCP socket, ``sendall`` of the array and ``recv_into`` a
  preallocated buffer, then a 1-byte ack;
* **bare NIXL**: two ``nixl_agent`` s with the UCX backend, metadata exchanged once,
  the child READs the parent's registered buffer into its own (``initialize_xfer``
  + ``transfer`` + polling ``check_xfer_state``) and acks over a socket.

Which transport UCX chose for the NIXL rows is printed (``UCX_TLS`` as set, or what
UCX picked: on one host it is ``cma``, a kernel copy between the two processes'
memories, not TCP).  Ratios are bandwidth ÷ the socket floor (above 1: faster than
the floor).  The issue-17 target checked: 256 MiB one way through ringwire NIXL ≥ 0.8×
the socket floor.

Clean-up: the children are started with ``PR_SET_PDEATHSIG``, told to stop, killed in
a ``finally`` and waited for.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `perf` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from perf._common import (
    die_with_parent,
    format_table,
    format_targets,
    interleaved_async,
    machine_info,
    summarize,
    write_report,
)

MiB = 1 << 20
SIZES = (64 * MiB, 256 * MiB)
TARGET = 0.8
_HDR = struct.Struct(">Q")

MODES = {
    "quick": dict(warmup=1, rounds=5),
    "full": dict(warmup=2, rounds=15),
}


def _slots() -> Any:
    import ringwire

    return ringwire.SlotConfig(classes=tuple(ringwire.SlotClass(s, 1) for s in SIZES))


# -- the children --------------------------------------------------------------------------


def _child_ringwire(url: str) -> None:  # pragma: no cover - child
    import ringwire

    with ringwire.connect_sync(url, slots=_slots(), handshake_timeout=30) as ch:
        while True:
            msg = ch.receive()
            if msg[0] != "a":
                return
            nbytes = msg[1].nbytes
            del msg  # the view dies: the release goes back
            ch.send(nbytes)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        got = sock.recv(n - len(out))
        if not got:
            raise EOFError
        out += got
    return out


def _child_socket(port: int) -> None:  # pragma: no cover - child
    import numpy as np

    buf = np.empty(max(SIZES), np.uint8)
    view = memoryview(buf)
    sock = socket.create_connection(("127.0.0.1", port))
    while True:
        (n,) = _HDR.unpack(_recv_exact(sock, 8))
        if n == 0:
            return
        got = 0
        while got < n:
            k = sock.recv_into(view[got:n])
            if not k:
                return
            got += k
        sock.sendall(b"k")


def _child_nixl(port: int) -> None:  # pragma: no cover - child
    import numpy as np
    from nixl_cu12._api import nixl_agent

    sock = socket.create_connection(("127.0.0.1", port))
    (mlen,) = _HDR.unpack(_recv_exact(sock, 8))
    meta = _recv_exact(sock, mlen)
    (remote_addr,) = _HDR.unpack(_recv_exact(sock, 8))
    agent = nixl_agent(f"bench-child-{os.getpid()}")
    buf = np.empty(max(SIZES), np.uint8)
    addr = int(buf.__array_interface__["data"][0])
    reg = agent.register_memory([(addr, buf.nbytes, 0, "")], "DRAM")
    peer = agent.add_remote_agent(meta)
    sock.sendall(b"k")
    while True:
        (n,) = _HDR.unpack(_recv_exact(sock, 8))
        if n == 0:
            break
        local = agent.get_xfer_descs([(addr, n, 0)], "DRAM")
        remote = agent.get_xfer_descs([(remote_addr, n, 0)], "DRAM")
        h = agent.initialize_xfer("READ", local, remote, peer)
        state = agent.transfer(h)
        while state == "PROC":
            state = agent.check_xfer_state(h)
        assert state == "DONE", state
        agent.release_xfer_handle(h)
        sock.sendall(b"k")
    agent.remove_remote_agent(peer)
    agent.deregister_memory(reg)


def _spawn(kind: str, arg: Any, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    code = f"import perf.nixl as m; m._child_{kind}({arg!r})"
    return subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=Path(__file__).resolve().parent.parent,
        preexec_fn=die_with_parent,
        env={**os.environ, **(env or {})},
    )


# -- this side -------------------------------------------------------------------------------


class _Ringwire:
    def __init__(self, nixl: bool) -> None:
        self.nixl = nixl

    async def open(self) -> None:
        import ringwire

        self._lst = ringwire.listen("tcp://127.0.0.1:0", slots=_slots())
        await self._lst.__aenter__()
        env = {} if self.nixl else {"RINGWIRE_NIXL": "0"}
        self.proc = _spawn("ringwire", self._lst.path, env)
        self.ch = await asyncio.wait_for(self._lst.accept(), 60)
        negotiated = self.ch._core.transport.holder is not None
        if negotiated != self.nixl:
            raise RuntimeError(f"NIXL negotiated: {negotiated}, expected {self.nixl}")

    async def close(self) -> None:
        try:
            await asyncio.wait_for(self.ch.send(("stop",)), 5)
            await asyncio.wait_for(asyncio.to_thread(self.proc.wait, 10), 11)
        finally:
            await self.ch.aclose()
            await self._lst.__aexit__(None, None, None)

    async def send(self, arr: Any) -> list[int]:
        t0 = time.perf_counter_ns()
        await self.ch.send(("a", arr))
        assert await self.ch.receive() == arr.nbytes
        return [time.perf_counter_ns() - t0]

    async def loan(self, arr: Any) -> list[int]:
        t0 = time.perf_counter_ns()
        buf = await self.ch.loan(arr.shape, arr.dtype)
        await self.ch.send(("a", buf))
        del buf
        assert await self.ch.receive() == arr.nbytes
        return [time.perf_counter_ns() - t0]

    def sent_through_nixl(self) -> int:
        return int(getattr(self.ch._core.pool, "nixl_sent", 0))


class _Bare:
    """The socket floor (``kind="socket"``) or bare NIXL (``kind="nixl"``)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    async def open(self) -> None:
        import numpy as np

        lst = socket.create_server(("127.0.0.1", 0))
        self.proc = _spawn(self.kind, lst.getsockname()[1])
        lst.settimeout(60)
        self.sock, _ = lst.accept()
        lst.close()
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.kind == "nixl":
            from nixl_cu12._api import nixl_agent

            self.agent = nixl_agent(f"bench-parent-{os.getpid()}")
            self.buf = np.full(max(SIZES), 7, np.uint8)
            addr = int(self.buf.__array_interface__["data"][0])
            self.reg = self.agent.register_memory([(addr, self.buf.nbytes, 0, "")], "DRAM")
            meta = self.agent.get_agent_metadata()
            self.sock.sendall(_HDR.pack(len(meta)) + meta + _HDR.pack(addr))
            self.sock.settimeout(60)
            assert _recv_exact(self.sock, 1) == b"k"

    async def close(self) -> None:
        try:
            self.sock.sendall(_HDR.pack(0))
            await asyncio.wait_for(asyncio.to_thread(self.proc.wait, 10), 11)
        finally:
            self.sock.close()
            if self.kind == "nixl":
                self.agent.deregister_memory(self.reg)

    async def send(self, arr: Any) -> list[int]:
        t0 = time.perf_counter_ns()
        if self.kind == "socket":
            self.sock.sendall(_HDR.pack(arr.nbytes))
            self.sock.sendall(memoryview(arr))
        else:
            self.sock.sendall(_HDR.pack(arr.nbytes))
        assert _recv_exact(self.sock, 1) == b"k"
        return [time.perf_counter_ns() - t0]


# -- timing ----------------------------------------------------------------------------------


FLOOR = "socket floor (sendall / recv_into)"
RW_NIXL = "ringwire NIXL send (one copy into the arena)"


async def _run(mode: dict[str, int]) -> dict[str, Any]:
    import numpy as np

    nx, zq, floor, bare = _Ringwire(True), _Ringwire(False), _Bare("socket"), _Bare("nixl")
    opened: list[Any] = []
    try:
        for p in (nx, zq, floor, bare):
            await p.open()
            opened.append(p)
        res: dict[str, Any] = {}
        for size in SIZES:
            arr = np.full(size, 7, np.uint8)
            peers = _peers(nx, zq, floor, bare, arr)
            s = await interleaved_async(peers, rounds=mode["rounds"], warmup=mode["warmup"])
            res[f"{size // MiB} MiB"] = {n: _stats_ms(v) for n, v in s.items()}
            del arr, s
        res["nixl_sent"] = nx.sent_through_nixl()
        res["zeromq_sent_through_nixl"] = zq.sent_through_nixl()
        return res
    finally:
        for p in reversed(opened):  # (each listener's task group: the last one first)
            try:
                await p.close()
            except Exception as exc:  # noqa: BLE001 - report, then kill below
                print(f"closing {type(p).__name__}: {exc!r}", file=sys.stderr)
        for p in (nx, zq, floor, bare):
            proc = getattr(p, "proc", None)
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


def _peers(
    nx: _Ringwire, zq: _Ringwire, floor: _Bare, bare: _Bare, arr: Any
) -> dict[str, Callable[[], Awaitable[list[int]]]]:
    return {
        RW_NIXL: lambda: nx.send(arr),
        "ringwire NIXL loan (no copy, not filled)": lambda: nx.loan(arr),
        "ringwire ZeroMQ frames send (Ext 20)": lambda: zq.send(arr),
        FLOOR: lambda: floor.send(arr),
        "bare NIXL agent to agent (READ)": lambda: bare.send(arr),
    }


def _stats_ms(v: list[int]) -> dict[str, float]:
    st = summarize(v)
    return {"median": st.median_ns / 1e6, "p99": st.p99_ns / 1e6, "n": st.n}


def report(res: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    rows, targets = [], []
    for size in SIZES:
        key = f"{size // MiB} MiB"
        peers = res[key]
        floor_gbps = size / (peers[FLOOR]["median"] / 1e3) / 1e9
        for n, v in peers.items():
            gbps = size / (v["median"] / 1e3) / 1e9
            rows.append(
                [
                    key,
                    n,
                    f"{v['median']:.1f}",
                    f"{v['p99']:.1f}",
                    f"{gbps:.2f}",
                    v["n"],
                    f"{gbps / floor_gbps:.2f}×",
                ]
            )
        r = (size / (peers[RW_NIXL]["median"] / 1e3) / 1e9) / floor_gbps
        targets.append(
            {
                "target": f"{key} one way: ringwire NIXL ≥ {TARGET}× the socket floor"
                if size == max(SIZES)
                else f"(info) {key} one way: ringwire NIXL ÷ the socket floor",
                "value": r,
                "shown": f"{r:.2f}×",
                "status": ("HIT" if r >= TARGET else "MISS") if size == max(SIZES) else "info",
            }
        )
    text = "### one way + 1-byte ack (ms, GB/s; × floor: bandwidth ÷ the socket floor)\n\n"
    text += format_table(
        ["size", "peer", "median", "p99", "GB/s", "samples", "× floor"], rows, "llrrrrr"
    )
    text += (
        f"\n\narrays through NIXL on the NIXL connection: {res['nixl_sent']}; on the "
        f"ZeroMQ one: {res['zeromq_sent_through_nixl']}\n\n### Ratios\n\n"
    )
    text += format_targets(targets)
    return text, targets


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="short runs (< 60 s)")
    ap.add_argument("--json", default="perf/results/nixl.json", help="where the JSON goes")
    args = ap.parse_args(argv)
    try:
        import nixl_cu12  # noqa: F401
        import zmq  # noqa: F401
    except ImportError as exc:
        print(f"perf.nixl needs pyzmq and nixl-cu12 ({exc})", file=sys.stderr)
        return 2
    mode_name = "quick" if args.quick else "full"
    load0 = os.getloadavg()
    t0 = time.monotonic()
    res = asyncio.run(_run(MODES[mode_name]))
    seconds = time.monotonic() - t0
    load1 = os.getloadavg()
    text, targets = report(res)
    machine = machine_info(["ringwire", "numpy", "pyzmq", "nixl-cu12"])
    tls = os.environ.get("UCX_TLS", "UCX's choice (cma on one host)")
    print(
        f"perf.nixl ({mode_name}, {seconds:.0f} s): CPU {machine.get('cpu')}, "
        f"{machine.get('cpu_count')} cpus; load average {load0[0]:.2f} at start, "
        f"{load1[0]:.2f} at end; UCX transports: {tls}\n"
    )
    print(text)
    write_report(
        args.json, "nixl", mode_name, seconds, (load0, load1), machine, res, targets, ucx_tls=tls
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
