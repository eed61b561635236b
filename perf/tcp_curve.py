"""What CURVE costs: ringwire over ``tcp://127.0.0.1`` with keys against without.

Run from the repository root (pyzmq installed: ``pip install -e '.[bench]'``)::

    python -m perf.tcp_curve --quick          # < 40 s on a 2-core VM
    python -m perf.tcp_curve                  # more rounds
    python -m perf.tcp_curve --json PATH      # default perf/results/tcp_curve.json

One question: what does encryption and authentication (ZeroMQ's CURVE, ``keys=``)
cost a ringwire TCP connection over the same connection without keys?  Each peer is a
pair of processes joined by one loopback connection: this process (asyncio,
``ringwire.listen`` with or without ``keys=ServerKeys(...)``) and a child (blocking
API, ``ringwire.connect_sync`` with or without ``keys=ClientKeys(...)``), the two peers
identical but for the keys.  Both are timed in the same run, round-robin (one round
of each per turn, the first peer rotated every turn), and medians are reported:

* **(a) round trip** of a 100-byte record (a dict, decoded and re-encoded by the echo);
* **(b) one-way 64 MiB array + small ack**: ringwire ``send`` (copied once into the
  sender's pool, then an Ext 20 zero-copy frame -- which CURVE encrypts, so it is
  copied again by libzmq); the receiver views it and answers with its size;
* **(c) connect**: ``ringwire.connect`` + ``aclose`` to a listener of this process
  (the CURVE handshakes of both sockets and the two ZAP checks are in it).

Ratios are keys ÷ insecure (times: above 1 is what CURVE costs).  The key files are
made with ``ringwire._net.keys.keygen`` in a temporary directory, removed at the end.

Clean-up: the children are started with ``PR_SET_PDEATHSIG``, told to stop, killed in
a ``finally`` and waited for; nothing touches ``/dev/shm``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
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
RECORD = {"seq": 0, "body": "x" * 80}  # ~100 bytes of msgpack
SIZE = 64 * MiB

MODES = {
    #        warmup, rounds, rt per round, handoffs per round, connects per round
    "quick": dict(warmup=1, rounds=7, rt=100, handoffs=1, connects=3),
    "full": dict(warmup=2, rounds=15, rt=200, handoffs=2, connects=3),
}


def _slots() -> Any:
    import ringwire

    return ringwire.SlotConfig(classes=(ringwire.SlotClass(SIZE, 2),))


# -- the child (blocking API) -------------------------------------------------------------


def _child(url: str, secret: str, server: str) -> None:  # pragma: no cover - child
    import ringwire

    keys = ringwire.ClientKeys(secret=secret, server=server) if secret else None
    with ringwire.connect_sync(url, slots=_slots(), handshake_timeout=30, keys=keys) as ch:
        while True:
            msg = ch.receive()
            op = msg[0]
            if op == "e":
                ch.send(msg[1])
            elif op == "a":
                nbytes = msg[1].nbytes
                del msg  # the view dies: the sender's slot comes back
                ch.send(nbytes)
            else:
                return


def _child_zmq(url: str, server: str) -> None:  # pragma: no cover - child
    import msgspec
    import numpy as np
    import zmq

    enc, dec = msgspec.msgpack.Encoder().encode, msgspec.msgpack.Decoder().decode
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.linger = 0
    if server:  # a CURVE client (a fresh key pair: the bare peer has no authenticator)
        sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
        sock.curve_serverkey = server.encode()
    sock.connect(url)
    try:
        while True:
            msg = dec(sock.recv())
            if msg[0] == "e":
                sock.send(enc(msg[1]))
            elif msg[0] == "a":
                _, dtype, shape = msg
                body = sock.recv(copy=False)  # the second part of the same message
                arr = np.frombuffer(body.buffer, dtype).reshape(shape)
                nbytes = arr.nbytes
                del arr, body
                sock.send(enc(nbytes))
            else:
                return
    finally:
        sock.close()
        ctx.term()


def _spawn(*args: str, kind: str = "") -> subprocess.Popen[bytes]:
    code = f"import perf.tcp_curve as m; m._child{kind}{args!r}"
    return subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=Path(__file__).resolve().parent.parent,
        preexec_fn=die_with_parent,
    )


# -- the two peers, this side -------------------------------------------------------------


class _Peer:
    """ringwire over tcp://127.0.0.1, with ``keys`` (a key directory) or without."""

    def __init__(self, keydir: Path | None) -> None:
        self.keydir = keydir
        self.name = "ringwire tcp:// keys (CURVE)" if keydir else "ringwire tcp:// insecure"

    def _keys(self) -> tuple[Any, Any, str, str]:
        import ringwire

        if self.keydir is None:
            return None, None, "", ""
        d = self.keydir
        server = ringwire.ServerKeys(secret=d / "server.key_secret", clients=d / "clients")
        client = ringwire.ClientKeys(secret=d / "client.key_secret", server=d / "server.key")
        return server, client, str(d / "client.key_secret"), str(d / "server.key")

    async def open(self) -> None:
        import ringwire

        server, self.client_keys, secret, public = self._keys()
        self._lst = ringwire.listen("tcp://127.0.0.1:0", slots=_slots(), keys=server)
        await self._lst.__aenter__()
        self.proc = _spawn(self._lst.path, secret, public)
        self.ch = await asyncio.wait_for(self._lst.accept(), 30)

    async def close(self) -> None:
        try:
            await asyncio.wait_for(self.ch.send(("stop",)), 5)
            await asyncio.wait_for(asyncio.to_thread(self.proc.wait, 10), 11)
        finally:
            await self.ch.aclose()
            await self._lst.__aexit__(None, None, None)

    async def rt(self, n: int) -> list[int]:
        ch, out, clock = self.ch, [], time.perf_counter_ns
        for i in range(n):
            rec = {"seq": i, "body": RECORD["body"]}
            t0 = clock()
            await ch.send(("e", rec))
            await ch.receive()
            out.append(clock() - t0)
        return out

    async def handoff(self, arr: Any, n: int) -> list[int]:
        ch, out, clock = self.ch, [], time.perf_counter_ns
        for _ in range(n):
            t0 = clock()
            await ch.send(("a", arr))
            got = await ch.receive()
            out.append(clock() - t0)
            assert got == arr.nbytes, got
        return out

    async def connect(self, n: int) -> list[int]:
        import ringwire

        out, clock = [], time.perf_counter_ns
        for _ in range(n):
            t0 = clock()
            c = await ringwire.connect(self._lst.path, slots=None, keys=self.client_keys)
            await c.aclose()
            out.append(clock() - t0)
            extra = await asyncio.wait_for(self._lst.accept(), 10)  # the listener's end
            await extra.aclose()
        return out


class _Zmq:
    """The floor under both: a bare zmq.asyncio PAIR + msgspec, CURVE or NULL."""

    def __init__(self, curve: bool) -> None:
        self.curve = curve
        self.name = "zmq PAIR + msgspec, CURVE" if curve else "zmq PAIR + msgspec, NULL"

    async def open(self) -> None:
        import msgspec
        import zmq
        import zmq.asyncio

        self._enc = msgspec.msgpack.Encoder().encode
        self._dec = msgspec.msgpack.Decoder().decode
        self._ctx = zmq.asyncio.Context()
        self.sock = self._ctx.socket(zmq.PAIR)
        self.sock.linger = 0
        server = ""
        if self.curve:
            public, secret = zmq.curve_keypair()
            self.sock.curve_server = True
            self.sock.curve_publickey, self.sock.curve_secretkey = public, secret
            server = public.decode()
        self.sock.bind("tcp://127.0.0.1:*")
        self.proc = _spawn(self.sock.getsockopt_string(zmq.LAST_ENDPOINT), server, kind="_zmq")
        await self.rt(1)  # the child is connected

    async def close(self) -> None:
        try:
            await asyncio.wait_for(self.sock.send(self._enc(("stop",))), 5)
            await asyncio.wait_for(asyncio.to_thread(self.proc.wait, 10), 11)
        finally:
            self.sock.close()
            self._ctx.term()

    async def rt(self, n: int) -> list[int]:
        sock, enc, dec, out, clock = self.sock, self._enc, self._dec, [], time.perf_counter_ns
        for i in range(n):
            rec = {"seq": i, "body": RECORD["body"]}
            t0 = clock()
            await sock.send(enc(("e", rec)))
            dec(await sock.recv())
            out.append(clock() - t0)
        return out

    async def handoff(self, arr: Any, n: int) -> list[int]:
        sock, enc, out, clock = self.sock, self._enc, [], time.perf_counter_ns
        for _ in range(n):
            t0 = clock()
            await sock.send_multipart([enc(("a", arr.dtype.str, arr.shape)), arr], copy=False)
            got = self._dec(await sock.recv())
            out.append(clock() - t0)
            assert got == arr.nbytes, got
        return out


# -- timing --------------------------------------------------------------------------------


def _stats(v: list[int], scale: float) -> dict[str, float]:
    st = summarize(v)
    return {"median": st.median_ns / scale, "p99": st.p99_ns / scale, "n": st.n}


def _make_keys(root: Path) -> None:
    from ringwire._net.keys import keygen

    keygen(root, "server")
    public, _ = keygen(root, "client")
    (root / "clients").mkdir()
    shutil.copy(public, root / "clients")


async def _run(mode: dict[str, int], keydir: Path) -> dict[str, Any]:
    import numpy as np

    peers: list[Any] = [_Peer(None), _Peer(keydir), _Zmq(False), _Zmq(True)]
    opened: list[Any] = []
    try:
        for p in peers:
            await p.open()
            opened.append(p)
        kw = dict(rounds=mode["rounds"], warmup=mode["warmup"])
        res: dict[str, Any] = {}
        s = await interleaved_async({p.name: (lambda p=p: p.rt(mode["rt"])) for p in opened}, **kw)
        res["rt_100B_us"] = {n: _stats(v, 1e3) for n, v in s.items()}
        arr = np.full(SIZE, 7, np.uint8)
        s = await interleaved_async(
            {p.name: (lambda p=p, a=arr: p.handoff(a, mode["handoffs"])) for p in opened}, **kw
        )
        res["handoff_64MiB_ms"] = {n: _stats(v, 1e6) for n, v in s.items()}
        del arr
        ours = [p for p in opened if isinstance(p, _Peer)]  # (the bare peers: no listener)
        s = await interleaved_async(
            {p.name: (lambda p=p: p.connect(mode["connects"])) for p in ours}, **kw
        )
        res["connect_ms"] = {n: _stats(v, 1e6) for n, v in s.items()}
        return res
    finally:
        for p in reversed(opened):  # each holds a listener's task group: LIFO
            try:
                await p.close()
            except Exception as exc:  # noqa: BLE001 - report, then kill below
                print(f"closing {p.name}: {exc!r}", file=sys.stderr)
        for p in peers:
            proc = getattr(p, "proc", None)
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


def _ratio_text(r: float) -> str:
    return f"{r:.3f}×" if r < 1 else f"{r:.2f}×"


def report(res: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    insecure, keyed = _Peer(None).name, _Peer(Path(".")).name
    null, curve = _Zmq(False).name, _Zmq(True).name
    sections = (
        ("rt_100B_us", "(a) async round trip, 100 B record (µs, smaller is better)", "RT 100 B"),
        (
            "handoff_64MiB_ms",
            "(b) 64 MiB array one way + small ack (ms, smaller is better)",
            "64 MiB one way",
        ),
        ("connect_ms", "(c) connect + close (ms, smaller is better)", "connect"),
    )
    lines: list[str] = []
    targets = []
    for key, title, short in sections:
        peers = res[key]
        rows = []
        for n, v in peers.items():
            own = peers[null if n.startswith("zmq") else insecure]["median"]
            row = [
                n,
                f"{v['median']:.3f}",
                f"{v['p99']:.3f}",
                v["n"],
                _ratio_text(v["median"] / own),
            ]
            if key.startswith("handoff"):
                row.insert(3, f"{SIZE / (v['median'] / 1e3) / 1e9:.2f}")
            rows.append(row)
        head = ["peer", "median", "p99", "samples", "× its own without keys"]
        if key.startswith("handoff"):
            head.insert(3, "GB/s")
        lines.append(f"### {title}\n")
        lines.append(format_table(head, rows, "l" + "r" * (len(head) - 1)))
        lines.append("")
        pairs = [(f"(info) {short}: ringwire keys ÷ ringwire insecure (time)", keyed, insecure)]
        if curve in peers:
            pairs.append((f"(info) {short}: zmq CURVE ÷ zmq NULL (time)", curve, null))
            pairs.append((f"(info) {short}: ringwire keys ÷ zmq CURVE (time)", keyed, curve))
        for what, a, b in pairs:
            r = peers[a]["median"] / peers[b]["median"]
            targets.append({"target": what, "value": r, "shown": _ratio_text(r), "status": "info"})
    lines.append("### Ratios\n")
    lines.append(format_targets(targets))
    return "\n".join(lines), targets


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="short runs (< 40 s)")
    ap.add_argument("--json", default="perf/results/tcp_curve.json", help="where the JSON goes")
    args = ap.parse_args(argv)
    try:
        import zmq
    except ImportError:
        print("perf.tcp_curve needs pyzmq: pip install -e '.[bench]'", file=sys.stderr)
        return 2
    mode_name = "quick" if args.quick else "full"
    load0 = os.getloadavg()
    t0 = time.monotonic()
    keydir = Path(tempfile.mkdtemp(prefix="ringwire-curve-"))
    try:
        _make_keys(keydir)
        res = asyncio.run(_run(MODES[mode_name], keydir))
    finally:
        shutil.rmtree(keydir, ignore_errors=True)
    seconds = time.monotonic() - t0
    load1 = os.getloadavg()
    text, targets = report(res)
    machine = machine_info(["ringwire", "numpy", "msgspec", "pyzmq"])
    print(
        f"perf.tcp_curve ({mode_name}, {seconds:.0f} s): CPU {machine.get('cpu')}, "
        f"{machine.get('cpu_count')} cpus; libzmq {zmq.zmq_version()}; load average "
        f"{load0[0]:.2f} at start, {load1[0]:.2f} at end\n"
    )
    print(text)
    write_report(args.json, "tcp_curve", mode_name, seconds, (load0, load1), machine, res, targets)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
