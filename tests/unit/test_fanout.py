"""Remote broadcast readers (ringwire._net.fanout) in one process: the record rewrite
without any I/O, then a writer and its readers as threads over tcp://127.0.0.1."""

from __future__ import annotations

import select
import struct
import threading
import time
from typing import Any

import anyio
import msgspec
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from support.broadcast import SLOTS, SMALL, bpath_fixture, digest, step  # noqa: F401
from support.net import port_free

import ringwire
from ringwire import (
    BrokenResourceError,
    EndOfStream,
    HandshakeError,
    ReaderStalled,
)
from ringwire._conn.netconn import connect_transport, drive_sync
from ringwire._net.fanout import to_frames
from ringwire._wire import ext as X
from ringwire._wire.broadcast_control import Join, encode_remote
from ringwire._wire.descriptors import NetRef, SlotRef

LOOPBACK = "tcp://127.0.0.1:0"
Ext = msgspec.msgpack.Ext
enc = msgspec.msgpack.Encoder()


# -- the rewrite: Ext 4 -> Ext 20 + frames (no I/O) ----------------------------------


def slot_ref(slot: int, nbytes: int, shape: tuple[int, ...], gen: int = 3) -> Ext:
    ref = SlotRef(
        version=1,
        pool=77,
        slot=slot,
        generation=gen,
        offset=slot * 4096,
        nbytes=nbytes,
        shape=shape,
        dtype="<f4",
        kind="numpy",
    )
    return Ext(X.SHM_REF, enc.encode(ref))


def net_refs(payload: bytes) -> tuple[Any, list[NetRef]]:
    """``payload`` decoded, with every Ext 20 collected (nested ones too)."""
    refs: list[NetRef] = []

    def hook(code: int, data: memoryview) -> Any:
        if code == X.NET_REF:
            refs.append(msgspec.msgpack.decode(data, type=NetRef))
            return ("net", refs[-1].index)
        if code == X.TUPLE:
            return tuple(dec.decode(data))
        return Ext(code, bytes(data))

    dec = msgspec.msgpack.Decoder(ext_hook=hook)
    return dec.decode(payload), refs


def test_a_record_without_slot_references_goes_as_it_is() -> None:
    payload = enc.encode({"step": 7, "note": "x" * 100, "inline": Ext(X.NUMPY_ARRAY, b"\0" * 8)})
    assert to_frames(payload, pytest.fail) is payload  # not even looked at twice


def test_slot_references_become_frames_of_the_slots_memory_in_order() -> None:
    memory = {1: memoryview(b"a" * 16), 2: memoryview(b"b" * 32)}
    asked: list[SlotRef] = []

    def memory_of(ref: SlotRef) -> tuple[Any, int]:
        asked.append(ref)
        return memory[ref.slot], 1000 + ref.slot

    payload = enc.encode(
        {
            "x": slot_ref(1, 16, (4,)),
            "pair": Ext(X.TUPLE, enc.encode([5, slot_ref(2, 32, (2, 4))])),  # nested
            "f": 1.5,
        }
    )
    out = to_frames(payload, memory_of)
    assert out.frames == [memory[1], memory[2]]  # type: ignore[attr-defined]
    obj, refs = net_refs(out)
    assert obj == {"x": ("net", 0), "pair": (5, ("net", 1)), "f": 1.5}
    assert [(r.tag, r.generation, r.index, r.nbytes, r.shape, r.dtype) for r in refs] == [
        (1001, 3, 0, 16, (4,), "<f4"),
        (1002, 3, 1, 32, (2, 4), "<f4"),
    ]
    assert [r.slot for r in asked] == [1, 2]


def test_a_false_match_is_rewritten_to_the_same_record() -> None:
    # the bytes of an Ext 4 header inside a binary field: rewritten, nothing changes
    payload = enc.encode({"blob": b"\xc7\x10\x04" * 3, "n": [1, 2, 3]})
    out = to_frames(payload, pytest.fail)
    assert not getattr(out, "frames", None)
    assert msgspec.msgpack.decode(out) == msgspec.msgpack.decode(payload)


@pytest.mark.parametrize("with_slot", [True, False])
def test_a_cuda_ipc_reference_cannot_leave_the_host(with_slot: bool) -> None:
    rec: dict[str, Any] = {"t": Ext(X.CUDA_REF, b"\x90" + b"\0" * 40)}  # (an ext 8)
    if with_slot:
        rec["x"] = slot_ref(1, 16, (4,))
    with pytest.raises(ValueError, match="CUDA IPC tensor cannot reach"):
        to_frames(enc.encode(rec), lambda ref: (memoryview(b"a" * 16), 1))


def test_a_malformed_slot_reference_is_a_decode_error() -> None:
    payload = enc.encode({"x": Ext(X.SHM_REF, b"\x93\x01\x02\x03")})
    with pytest.raises(ringwire.DecodeError, match="SlotRef"):
        to_frames(payload, pytest.fail)


_leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=False),
    st.text(max_size=20),
    st.binary(max_size=20),
)
_values = st.recursive(
    _leaves,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=20,
)


@given(_values)
def test_any_record_without_references_keeps_its_value(value: Any) -> None:
    payload = enc.encode(value)
    assert msgspec.msgpack.decode(to_frames(payload, lambda ref: (b"", 0))) == value


# -- a writer and its readers over tcp://127.0.0.1 (threads) -----------------------------


def remote_reader(url: str, out: dict[str, Any], ready: threading.Event, **kw: Any) -> None:
    """A remote reader thread: every record's digest, then how it ended."""
    got: list[Any] = []
    out["got"] = got
    try:
        with ringwire.subscribe_sync(url, **kw) as sub:
            out["rank"], out["start"] = sub.rank, sub.start
            ready.set()
            while True:
                rec = sub.receive(timeout=30)
                if kw.get("type") is None and isinstance(rec, dict):
                    assert not rec["a"].flags.writeable  # a view of the received frame
                got.append(digest(rec))
                del rec
    except EndOfStream:
        got.append("eos")
    except (BrokenResourceError, HandshakeError) as exc:
        got.append(f"{type(exc).__name__}: {exc}")
    finally:
        ready.set()


def start_remote(url: str, **kw: Any) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}
    ready = threading.Event()
    t = threading.Thread(target=remote_reader, args=(url, out, ready), kwargs=kw, daemon=True)
    t.start()
    assert ready.wait(20)
    return t, out


def test_local_and_remote_readers_share_one_rank_space_and_every_step(bpath: str) -> None:
    with ringwire.broadcast_sync(bpath, readers=3, slots=SLOTS, tcp=LOOPBACK) as bc:
        url = bc.tcp_address
        assert url is not None and url.startswith("tcp://127.0.0.1:") and not url.endswith(":0")
        local = ringwire.subscribe_sync(bpath, rank=0)
        with pytest.raises(HandshakeError, match="rank 0 is taken"):
            ringwire.subscribe_sync(url, rank=0)
        t, out = start_remote(url)
        assert out["rank"] == 1 and out["start"] == 0
        assert bc.wait_ready(2, timeout=10) == 2
        infos = {i.rank: i for i in bc.readers()}
        assert infos[0].host == "" and infos[1].host != "" and infos[1].ready
        with pytest.raises(HandshakeError, match="rank 0 is taken"):
            ringwire.subscribe_sync(bpath, rank=0)
        sent = [step(0), step(1, 32 * 1024), step(2, 5 << 20), step(3)]  # inline, slot, arena
        for rec in sent:
            bc.send(rec)
        want = [digest(rec) for rec in sent]
        assert [digest(local.receive(timeout=10)) for _ in sent] == want
        stats = bc.statistics()
        assert stats.remote_readers == 1 and stats.readers == 2
        local.close()
    t.join(20)
    assert out["got"] == [*want, "eos"]
    assert port_free(url)


def test_a_late_remote_reader_starts_at_the_step_it_joined(bpath: str) -> None:
    with ringwire.broadcast_sync(bpath, readers=2, slots=SLOTS, tcp=LOOPBACK) as bc:
        for i in range(5):
            bc.send(step(i, 8192))
        t, out = start_remote(bc.tcp_address)
        assert out["start"] > 0
        for i in range(5, 8):
            bc.send(step(i, 8192))
    t.join(20)
    assert [g[0] for g in out["got"][:-1]] == [5, 6, 7] and out["got"][-1] == "eos"


def test_a_tracked_send_completes_when_the_remote_reader_releases(bpath: str) -> None:
    with ringwire.broadcast_sync(bpath, readers=1, slots=SLOTS, tcp=LOOPBACK) as bc:
        sub = ringwire.subscribe_sync(bc.tcp_address)
        receipt = bc.send_tracked(step(1, 32 * 1024))
        rec = sub.receive(timeout=10)
        with pytest.raises(TimeoutError):
            receipt.wait(0.3)  # the remote reader holds the array
        assert bc.readers()[0].slots_held == 1
        del rec
        receipt.wait(10)  # its release came back over the connection
        assert bc.statistics().slots_in_use == 0
        sub.close()


def test_a_remote_reader_that_stops_reading_is_named_by_reader_stalled(bpath: str) -> None:
    with ringwire.broadcast_sync(
        bpath, readers=2, capacity=SMALL, slots=None, tcp=LOOPBACK, stall_timeout=0.5
    ) as bc:
        sub = ringwire.subscribe_sync(bc.tcp_address, rank=1)  # its window: SMALL
        bc.wait_ready(1, timeout=10)
        with pytest.raises(ReaderStalled) as info:
            for i in range(10_000):
                bc.send(step(i))
        assert info.value.ranks == (1,)
        assert "rank 1" in str(info.value) and "remote" in str(info.value)
        assert bc.statistics().remote_bytes_queued > SMALL // 2
        # it is bounded: what waits for it is its window, not the writer's memory
        assert bc.drop_reader(1, "too slow")
        bc.send(step(-5))  # goes on without it
        with pytest.raises(BrokenResourceError, match="too slow"):
            while True:
                sub.receive(timeout=10)
        sub.close()


def raw_client(url: str, capacity: int = 1 << 20) -> Any:
    """A bare TCP connection to the writer (its NetTransport): a hostile reader."""
    _, gen = connect_transport(
        url, capacity=capacity, slots=None, heartbeat=3.0, timeout=10, max_message=-1
    )
    return drive_sync(gen)


def raw_next(t: Any, timeout: float = 10) -> bytes | None:
    """The next record the writer sent on ``t``, or ``None`` once it hung up."""
    deadline = time.monotonic() + timeout
    while True:
        gone = t.drain()
        view = t.rx.next_frame()
        if view is not None:
            data = bytes(view)
            view.release()
            t.rx.commit()
            return data
        if gone:
            return None
        assert time.monotonic() < deadline, "the writer neither sent nor hung up"
        select.select([t.fileno()], [], [], 0.05)


def join(t: Any, rank: int) -> bytes | None:
    assert t.tx.try_write(encode_remote(Join(versions=[1], pid=4242, rank=rank)))
    return raw_next(t)


def release_pairs(t: Any, *pairs: tuple[int, int]) -> None:
    flat = [v for pair in pairs for v in pair]
    t.send_control(b"R" + struct.pack(f">{len(flat)}Q", *flat))


def first_ref(data: bytes) -> NetRef:
    return net_refs(data)[1][0]


HOSTILE = {
    # what the peer does after the connection's handshake -> what the writer says
    "garbage instead of a join": (
        lambda t: t.tx.try_write(b"\x93\x01\x02\x03") and raw_next(t),
        "not a broadcast join",
    ),
    "a rank that is taken": (lambda t: join(t, 0), "rank 0 is taken"),
    "a rank outside the table": (lambda t: join(t, 9), "outside this broadcast's table"),
    "a lane smaller than the broadcast's": (lambda t: join(t, 1), "smaller than this broadcast"),
}
LOSSES = {
    # after a valid join and one step with an array -> why it is lost
    "a record after its join": (
        lambda t, data: t.tx.try_write(b"\x01"),
        "sent a record",
    ),
    "a release of a slot never sent": (
        lambda t, data: release_pairs(t, (99, 1)),
        "did not hold",
    ),
    "a release of another generation": (
        lambda t, data: release_pairs(t, (first_ref(data).tag, first_ref(data).generation + 1)),
        "did not hold",
    ),
    "a release sent twice": (
        lambda t, data: release_pairs(
            t, *[(first_ref(data).tag, first_ref(data).generation)] * 2
        ),
        "did not hold",
    ),
    "an abort": (lambda t, data: t.abort("leaving rudely"), "leaving rudely"),
}


def wait_lost(bc: Any, n: int = 1) -> None:
    deadline = time.monotonic() + 10
    while bc.statistics().lost < n:
        assert time.monotonic() < deadline, "the writer did not notice"
        bc.poll_readers()
        time.sleep(0.01)


@pytest.mark.parametrize("attack", sorted(HOSTILE))
def test_a_hostile_join_is_refused_and_the_broadcast_goes_on(bpath: str, attack: str) -> None:
    act, reason = HOSTILE[attack]
    with ringwire.broadcast_sync(bpath, readers=2, slots=SLOTS, tcp=LOOPBACK) as bc:
        local = ringwire.subscribe_sync(bpath, rank=0)
        t = raw_client(bc.tcp_address, 4096 if "smaller" in attack else 1 << 20)
        try:
            assert act(t) is None  # the writer hung up on it...
            assert reason in (t.peer_reason or "")  # ...saying why
        finally:
            t.close()
        assert bc.statistics().refused == 1 and bc.statistics().lost == 0
        bc.send(step(1, 32 * 1024))
        assert digest(local.receive(timeout=10))[0] == 1
        ok = ringwire.subscribe_sync(bc.tcp_address)  # an honest one still joins
        assert ok.rank == 1
        ok.close()
        local.close()


@pytest.mark.parametrize("policy", ["fail", "drop"])
@pytest.mark.parametrize("attack", sorted(LOSSES))
def test_a_remote_reader_that_breaks_the_protocol_is_lost(
    bpath: str, policy: str, attack: str
) -> None:
    act, reason = LOSSES[attack]
    with ringwire.broadcast_sync(
        bpath, readers=2, slots=SLOTS, tcp=LOOPBACK, on_reader_loss=policy
    ) as bc:
        local = ringwire.subscribe_sync(bpath, rank=0)
        t = raw_client(bc.tcp_address)
        try:
            assert join(t, 1) is not None  # RemoteJoined
            bc.send(step(1, 32 * 1024))
            data = raw_next(t)
            assert data is not None
            act(t, data)
            wait_lost(bc)
            if attack != "an abort":
                assert raw_next(t) is None and reason in (t.peer_reason or "")
        finally:
            t.close()
        assert digest(local.receive(timeout=10))[0] == 1
        if policy == "fail":
            with pytest.raises(BrokenResourceError, match=f"rank 1 .*{reason}"):
                bc.send(step(2))
            with pytest.raises(BrokenResourceError, match="rank 1"):
                local.receive(timeout=10)
        else:
            bc.send(step(2, 32 * 1024))
            assert digest(local.receive(timeout=10))[0] == 2
            deadline = time.monotonic() + 10
            while bc.statistics().slots_in_use:  # its shares given up, nothing twice
                assert time.monotonic() < deadline
                bc.poll_readers()
                time.sleep(0.01)
        local.close()


def test_async_remote_readers_on_asyncio_and_trio(bpath: str) -> None:
    with ringwire.broadcast_sync(bpath, readers=2, slots=SLOTS, tcp=LOOPBACK) as bc:
        url = bc.tcp_address

        def writer() -> None:
            bc.wait_ready(2, timeout=20)
            for i in range(20):
                bc.send(step(i, 16 * 1024 if i % 2 else 0))
            bc.close()

        async def read(rank: int) -> list[Any]:
            got: list[Any] = []
            async with await ringwire.subscribe(url, rank=rank) as sub:
                async for rec in sub:
                    got.append(digest(rec))
                    del rec  # (no view alive at the close)
            return got

        results: dict[str, list[Any]] = {}

        def reader(backend: str, rank: int) -> None:
            results[backend] = anyio.run(read, rank, backend=backend)

        threads = [
            threading.Thread(target=reader, args=("asyncio", 0)),
            threading.Thread(target=reader, args=("trio", 1)),
            threading.Thread(target=writer),
        ]
        for th in threads:
            th.start()
        for th in threads:
            th.join(30)
    want = [digest(step(i, 16 * 1024 if i % 2 else 0)) for i in range(20)]
    assert results == {"asyncio": want, "trio": want}


def test_an_async_writer_serves_remote_readers(bpath: str) -> None:
    async def main() -> list[Any]:
        async with ringwire.broadcast(bpath, readers=1, slots=SLOTS, tcp=LOOPBACK) as bc:
            out: dict[str, Any] = {}
            ready = threading.Event()
            th = threading.Thread(target=remote_reader, args=(bc.tcp_address, out, ready))
            th.start()
            with anyio.fail_after(20):
                await bc.wait_ready(1)
            for i in range(10):
                await bc.send(step(i, 32 * 1024))
            receipt = await bc.send_tracked(step(10, 32 * 1024))
            with anyio.fail_after(20):
                await receipt.wait()
        await anyio.to_thread.run_sync(th.join, 20)
        got: list[Any] = out["got"]
        return got

    got = anyio.run(main)
    assert got == [*(digest(step(i, 32 * 1024)) for i in range(11)), "eos"]


def test_batches_and_loans_reach_remote_readers(bpath: str) -> None:
    sent = [step(i, 16 * 1024 if i % 3 == 0 else 0) for i in range(30)]
    with ringwire.broadcast_sync(bpath, readers=1, slots=SLOTS, tcp=LOOPBACK) as bc:
        t, out = start_remote(bc.tcp_address)
        bc.wait_ready(1, timeout=10)
        bc.send_many(sent)
        for seq, n in ((30, 4096), (31, 1 << 20)):  # a loan in a slot, one in the arena
            a = bc.loan((n,), np.int64)
            a[:] = seq
            rec = {"seq": seq, "a": a}
            bc.send(rec)
            sent.append({"seq": seq, "a": np.full(n, seq, dtype=np.int64)})
            del a, rec
    t.join(20)
    assert out["got"] == [*(digest(r) for r in sent), "eos"]


def test_a_quiet_writer_refuses_a_reader_that_never_joins(bpath: str) -> None:
    """Nothing else happens at the writer: its join deadline alone wakes it."""
    with ringwire.broadcast_sync(
        bpath, readers=2, slots=None, tcp=LOOPBACK, handshake_timeout=0.5
    ) as bc:
        t = raw_client(bc.tcp_address)  # attached, and then silent
        try:
            assert raw_next(t, timeout=5) is None  # hung up on, untouched by the test...
            assert "did not join within 0.5 s" in (t.peer_reason or "")
        finally:
            t.close()
        assert bc.statistics().refused == 1


def test_without_remote_readers_records_are_not_rewritten(bpath: str) -> None:
    """A broadcast with ``tcp=`` but no remote reader now sends as a local-only one."""
    with ringwire.broadcast_sync(bpath, readers=1, slots=SLOTS, tcp=LOOPBACK) as bc:
        fan = bc._core.hub.remote  # noqa: SLF001
        payload = b"\xc7\x30\x05" + b"\0" * 48  # an Ext 5 header: refused only for remote readers
        assert fan.prepare(payload) is payload
