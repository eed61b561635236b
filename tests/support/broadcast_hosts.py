"""The processes of tests/process/test_broadcast_hosts.py: a broadcast writer and its
readers, local or on the other "host" (:mod:`support.netns_hosts`), and the steps they
exchange.

Each runs as ``python -c RUN TESTS_DIR ROLE JSON`` (:data:`RUN`, so that it can be
started under ``ip netns exec``) and says what happens as JSON lines on stdout (read
with :func:`support.netns_hosts.line`).  ``CLOCK_MONOTONIC`` is system-wide: the times
they report compare with the test's own clock.

Step ``i`` is a small record, or (every ``array_every``-th) a record with a 4 MiB
array whose content is derived from ``i``; :func:`digest` is what a reader reports of
each step received, :func:`expected` what it must have reported.
"""

from __future__ import annotations

import json
import sys
import time
import zlib
from typing import Any

import numpy as np

import ringwire
from ringwire import SlotClass, SlotConfig

RUN = (
    "import sys; sys.path.insert(0, sys.argv[1]); "
    "from support.broadcast_hosts import main; main(sys.argv[2], sys.argv[3])"
)

MiB = 1 << 20
ARRAY_BYTES = 4 * MiB
# the writer's pool: 4 MiB arrays through slots of their own size, six in flight
SLOTS = SlotConfig(
    classes=(SlotClass(64 * 1024, 16), SlotClass(ARRAY_BYTES, 6)), threshold=4096, wait_timeout=None
)


def step(i: int, array_every: int) -> dict[str, Any]:
    """Step ``i``: a small record, or every ``array_every``-th a 4 MiB array."""
    if array_every and i % array_every == 0:
        a = np.arange(ARRAY_BYTES // 8, dtype=np.uint64)
        a *= np.uint64(0x9E3779B97F4A7C15)
        a ^= np.uint64(i * 0x5851F42D4C957F2D % (1 << 64))
        return {"i": i, "a": a}
    return {"i": i, "s": f"step {i} " * (1 + i % 7)}


def digest(rec: Any) -> list[int]:
    """``[i, crc]`` of a received step (the array's bytes, or the text)."""
    if "a" in rec:
        a = rec["a"]
        assert a.dtype == np.uint64 and a.shape == (ARRAY_BYTES // 8,), (a.dtype, a.shape)
        return [rec["i"], zlib.crc32(a)]
    return [rec["i"], zlib.crc32(rec["s"].encode())]


def expected(n: int, array_every: int, first: int = 0) -> list[list[int]]:
    """What a reader that received steps ``first .. n - 1`` reports."""
    return [digest(step(i, array_every)) for i in range(first, n)]


def say(**kw: Any) -> None:
    print(json.dumps(kw), flush=True)


def writer(cfg: dict[str, Any]) -> None:
    """A broadcast at ``path`` (and ``tcp``, with ``keys``: [secret, clients dir]):
    says ``url``; waits for ``wait`` readers (``ready``: their ranks and hosts); sends
    ``steps`` steps ``pace`` s apart -- with ``until_lost``, as many as it takes to lose
    a reader and then ``after_loss`` more -- saying ``lost`` when a reader is lost;
    then ``sent_all`` (with ``slowest``: the longest a send took) and closes (the
    readers get ``EndOfStream``).  A send that fails says ``broken``."""
    keys = None
    if cfg.get("keys"):
        keys = ringwire.ServerKeys(secret=cfg["keys"][0], clients=cfg["keys"][1])
    every = cfg["array_every"]
    with ringwire.broadcast_sync(
        cfg["path"],
        readers=4,
        slots=SLOTS,
        tcp=cfg["tcp"],
        keys=keys,
        on_reader_loss=cfg["policy"],
        heartbeat=cfg["heartbeat"],
        stall_timeout=30,
    ) as bc:
        say(url=bc.tcp_address)
        bc.wait_ready(cfg["wait"], timeout=60)
        st = bc.statistics()
        say(
            ready=[[r.rank, r.host] for r in bc.readers()],
            readers=st.readers,
            remote=st.remote_readers,
            refused=st.refused,
        )
        lost = i = 0
        lost_at: int | None = None
        slowest = 0.0  # the longest a send took
        deadline = time.monotonic() + cfg.get("limit", 40.0)
        try:
            while True:
                if not cfg.get("until_lost"):
                    if i >= cfg["steps"]:
                        break
                elif lost_at is not None:
                    if i >= lost_at + cfg["after_loss"]:
                        break
                elif time.monotonic() > deadline:
                    say(no_loss=i)
                    break
                t = time.monotonic()
                bc.send(step(i, every), timeout=30)
                slowest = max(slowest, time.monotonic() - t)
                i += 1
                st = bc.statistics()
                if st.lost > lost:
                    lost, lost_at = st.lost, i
                    say(lost=lost, at=time.monotonic(), sent=i, readers=st.readers,
                        remote=st.remote_readers)  # fmt: skip
                if cfg.get("pace"):
                    time.sleep(cfg["pace"])
        except ringwire.BrokenResourceError as exc:
            say(broken=str(exc), at=time.monotonic(), sent=i)
            return
        # every slot back (a lost reader's shares given up with it)
        end = time.monotonic() + 10
        while bc.statistics().slots_in_use and time.monotonic() < end:
            time.sleep(0.01)
        st = bc.statistics()
        say(sent_all=i, lost=st.lost, left=st.left, refused=st.refused, readers=st.readers,
            remote=st.remote_readers, slots_in_use=st.slots_in_use,
            slowest=slowest)  # fmt: skip


def reader(cfg: dict[str, Any]) -> None:
    """Subscribe at ``url`` (``keys``: [secret, server public key]); says ``joined``,
    ``got`` after ``report_at`` steps, and how it ended (``end``: ``eos`` or
    ``broken``, with the digests of every step received); ``refused`` if the writer
    would not have it."""
    keys = None
    if cfg.get("keys"):
        keys = ringwire.ClientKeys(secret=cfg["keys"][0], server=cfg["keys"][1])
    t0 = time.monotonic()
    try:
        sub = ringwire.subscribe_sync(
            cfg["url"],
            rank=cfg.get("rank"),
            keys=keys,
            heartbeat=cfg.get("heartbeat", 3.0),
            handshake_timeout=cfg.get("handshake_timeout", 20.0),
        )
    except (ringwire.HandshakeError, TimeoutError, OSError) as exc:
        say(refused=type(exc).__name__, reason=str(exc), after=time.monotonic() - t0)
        return
    got: list[list[int]] = []
    with sub:
        say(joined=sub.rank)
        try:
            while True:
                rec = sub.receive(timeout=60)
                got.append(digest(rec))
                del rec
                if len(got) == cfg.get("report_at"):
                    say(got=len(got))
        except ringwire.EndOfStream:
            say(end="eos", at=time.monotonic(), digests=got)
        except ringwire.BrokenResourceError as exc:
            say(end="broken", reason=str(exc), at=time.monotonic(), digests=got)


def bind(cfg: dict[str, Any]) -> None:
    """Try to bind a broadcast at ``tcp`` without keys: ``refused`` (a ValueError's
    text) or ``bound``; then with ``insecure=True``."""
    out: dict[str, Any] = {}
    for insecure in (False, True):
        try:
            with ringwire.broadcast_sync(cfg["path"], tcp=cfg["tcp"], insecure=insecure) as bc:
                out[str(insecure)] = ["bound", bc.tcp_address]
        except ValueError as exc:
            out[str(insecure)] = ["ValueError", str(exc)]
    say(bind=out)


def main(role: str, cfg: str) -> None:
    {"writer": writer, "reader": reader, "bind": bind}[role](json.loads(cfg))
    sys.stdout.flush()
