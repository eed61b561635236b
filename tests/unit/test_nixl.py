"""NIXL on a TCP connection (ringwire._net.nixl, ringwire._net.nixlpools) in one process:
the arena allocator, the transfer list, the negotiation, and -- where nixl-cu12 is
installed -- arrays, loans and receipts through NIXL, forged references and transfer
lists, registrations released."""

from __future__ import annotations

import gc
import os
import threading
import time
from typing import Any

import anyio
import msgspec
import numpy as np
import pytest
from support.channel import small_slot_pools  # noqa: F401  (an autouse fixture)
from support.extras import needs_torch, torch

import ringwire

zmq = pytest.importorskip("zmq")

from support.net import tcp_pair  # noqa: E402

from ringwire._net import nixl  # noqa: E402
from ringwire._net.nixlpools import manifest, parse_manifest  # noqa: E402
from ringwire._wire.net_control import Hello, Welcome  # noqa: E402

pytestmark = pytest.mark.anyio
BIG = ringwire.SlotConfig(classes=(ringwire.SlotClass(1 << 20, 8),))  # an 8 MiB budget


def _have_nixl() -> bool:
    try:
        import nixl_cu12  # noqa: F401
    except ImportError:
        return False
    return nixl.process() is not None


needs_nixl = pytest.mark.skipif(not _have_nixl(), reason="nixl-cu12 is not installed/usable")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class _FakeAgent:
    def register(self, arena: Any) -> None:
        return None


def test_arena_allocates_first_fit_and_coalesces() -> None:
    arena = nixl.Arena(_FakeAgent(), np.empty(16 * nixl.ALIGN, np.uint8), 0, "DRAM", 0)  # type: ignore[arg-type]
    a = arena.alloc(1)
    b = arena.alloc(nixl.ALIGN + 1)  # two units
    c = arena.alloc(nixl.ALIGN)
    assert (a, b, c) == (0, nixl.ALIGN, 3 * nixl.ALIGN)
    assert arena.alloc(13 * nixl.ALIGN) is None  # 12 units left at the end
    arena.free(b)
    assert arena.alloc(2 * nixl.ALIGN) == b  # the hole is reused
    arena.free(a)
    arena.free(b)
    arena.free(c)
    assert arena.alloc(16 * nixl.ALIGN) == 0  # everything merged back into one extent
    view = arena.host_view(nixl.ALIGN, 8)
    assert view.nbytes == 8 and view.base is not arena.memory  # a root of its own


def test_transfer_list_round_trip_and_garbage() -> None:
    entries = [(0, 4096, 1 << 20), (1, 0, 7)]
    wire = manifest(entries)
    assert wire.hex().startswith("0002" + "00000000" + "0000000000001000" + "0000000000100000")
    assert parse_manifest(wire) == entries
    assert parse_manifest(manifest([])) == []
    for bad in (b"", b"\x00", wire[:-1], b"\x00\x01"):
        with pytest.raises(ringwire.ProtocolError, match="NIXL transfer list"):
            parse_manifest(bad)


def test_a_failed_read_delivers_nothing_after_it() -> None:
    """Records wait in order behind their reads: when one read fails, the records
    behind it -- even those whose reads finished -- are dropped with it (delivering
    them would leave a gap the reader never hears of), and the connection breaks."""
    from ringwire._net.nixlpools import Link, _Held

    class Inbox:
        inbox: list[Any] = []

    link = Link(None, 0, 0)  # type: ignore[arg-type]
    link.peer_name = "peer"
    ok, failed, later = _Held(b"1", [], 0), _Held(b"2", [], 0, 4096), _Held(b"3", [], 0)
    failed.error = "NIXL_ERR_REMOTE_DISCONNECT"
    waiting = _Held(b"4", [], 1)
    link.pending.extend([ok, failed, later, waiting])
    rx = Inbox()
    with pytest.raises(ringwire.ProtocolError, match="read of 4096 bytes from peer failed"):
        link.settle(rx)
    assert rx.inbox == [(b"1", [])] and not link.pending


def test_an_older_peer_says_nothing_about_nixl() -> None:
    """The handshake's ``nixl`` field is appended with a default: a hello or welcome
    from a ringwire without it decodes as 'no NIXL', and a newer one is still read by
    an older decoder (msgspec ignores trailing fields of an array-like struct)."""
    old_hello = msgspec.msgpack.encode(["hello", 1, b"s" * 16, 1024, 0, 1, "h"])
    old_welcome = msgspec.msgpack.encode(["welcome", 1, 5, b"t" * 16, 1024, 0, 1])
    dec = msgspec.msgpack.Decoder(Hello | Welcome)
    assert dec.decode(old_hello).nixl == "" and dec.decode(old_welcome).nixl == ""
    new = msgspec.msgpack.encode(Hello(1, b"s" * 16, 1024, 0, 1, "h", "DRAM"))

    class OldHello(msgspec.Struct, array_like=True, tag="hello"):
        version: int
        session: bytes
        capacity: int
        budget: int
        pid: int
        host: str

    assert msgspec.msgpack.decode(new, type=OldHello).host == "h"


def test_offer_is_off_when_disabled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RINGWIRE_NIXL", "0")
    assert nixl.offer() == ""
    assert nixl.peer_vram("DRAM,VRAM:2") == 2 and nixl.peer_vram("DRAM") == 0


async def test_without_nixl_on_one_side_arrays_are_frames(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RINGWIRE_NIXL", "0")
    a, b = await tcp_pair(slots=BIG)
    async with a, b:
        x = np.arange(1 << 16, dtype=np.float32)
        await a.send(x)
        np.testing.assert_array_equal(await b.receive(), x)
        assert not hasattr(a._core.pool, "nixl_sent")  # the ZeroMQ pool


@needs_torch
@needs_nixl
async def test_arrays_go_through_nixl_and_the_receipt_waits_for_the_view() -> None:
    a, b = await tcp_pair(slots=BIG)
    async with a, b:
        assert a._core.transport.holder is not None  # negotiated
        x = np.arange(1 << 16, dtype=np.float32)  # 256 KiB: above the threshold
        t = torch.arange(1 << 15, dtype=torch.bfloat16)
        receipt = await a.send_tracked({"x": x, "t": t, "small": np.arange(3)})
        rec = await b.receive()
        assert a._core.pool.nixl_sent == 2 and b._core.peer.nixl_received == 2
        np.testing.assert_array_equal(rec["x"], x)
        assert not rec["x"].flags.writeable
        assert torch.equal(rec["t"], t) and rec["t"].dtype == torch.bfloat16
        mirror = b._core.transport.holder.mirrors[0]
        addr = rec["x"].__array_interface__["data"][0]
        assert mirror.base <= addr < mirror.end  # a view of the receiver's own buffer
        view = rec["x"][10:20]  # a derived view keeps the array held
        with anyio.move_on_after(0.2) as scope:
            await receipt.wait()
        assert scope.cancelled_caught
        del rec
        gc.collect()
        await b.send("tick")
        with anyio.move_on_after(0.2) as scope:
            await receipt.wait()
        assert scope.cancelled_caught  # `view` still holds x
        del view
        gc.collect()
        await b.send("tock")
        with anyio.fail_after(5):
            await receipt.wait()
        assert await a.receive() == "tick" and await a.receive() == "tock"
        assert a.statistics().slot_bytes_in_use == 0


@needs_nixl
async def test_a_loan_is_read_from_the_arena_without_a_copy() -> None:
    a, b = await tcp_pair(slots=BIG)
    async with a, b:
        buf = await a.loan((256, 256), np.float32)
        arena = a._core.transport.holder.send_arenas[0]
        assert arena.base <= buf.__array_interface__["data"][0] < arena.end
        buf[:] = 7.0
        await a.send({"buf": buf})
        got = await b.receive()
        assert float(got["buf"].sum()) == 7.0 * 65536
        assert a._core.pool.nixl_sent == 1
        del got


@needs_nixl
async def test_the_budget_bounds_what_is_in_flight() -> None:
    cfg = ringwire.SlotConfig(classes=(ringwire.SlotClass(64 << 10, 2),), policy="error")
    a, b = await tcp_pair(slots=cfg)
    async with a, b:
        x = np.ones(64 << 10, np.uint8)
        await a.send(x)
        await a.send(x)
        with pytest.raises(ringwire.SlotsExhausted):
            await a.send(x)
        first, second = await b.receive(), await b.receive()
        assert a._core.pool.nixl_sent == 2
        del first, second
        gc.collect()
        await b.send(0)
        assert await a.receive() == 0
        await a.send(x, slot_policy="error")  # released: room again
        assert int((await b.receive()).sum()) == 64 << 10


@needs_nixl
async def test_a_forged_nixl_reference_is_a_decode_error() -> None:
    a, b = await tcp_pair(slots=BIG)
    async with a, b:
        await a.send({"x": ringwire.wire.NixlRef(1, 99, 1, 0, 8, (2,), "<f4", "numpy")})
        with pytest.raises(ringwire.DecodeError, match="without NIXL transfers"):
            await b.receive()
        await a.send("next")
        assert await b.receive() == "next"


async def _raw(chan: Any, parts: list[bytes]) -> None:
    t = chan._core.transport
    with t._lock:
        t._sock.send_multipart(parts)
        t.tx.sent += len(parts[0]) + 4


@needs_nixl
@pytest.mark.parametrize(
    ("entries", "match"),
    [
        ([(0, 1 << 40, 8)], "bytes at"),
        ([(5, 0, 8)], "never announced"),
        ([(0, 0, 4096), (0, 1024, 8)], "still alive"),
    ],
)
async def test_a_forged_transfer_list_breaks_only_that_connection(
    entries: list[tuple[int, int, int]], match: str
) -> None:
    a, b = await tcp_pair(slots=BIG)
    c, d = await tcp_pair(slots=BIG)
    async with a, b, c, d:
        payload = ringwire.Encoder().encode({"x": 1})
        await _raw(a, [payload, manifest(entries), b""])
        with pytest.raises(anyio.BrokenResourceError) as info:
            with anyio.fail_after(5):
                await b.receive()
        assert match in str(info.value.__cause__)
        await c.send(np.ones(1 << 17, np.uint8))
        assert int((await d.receive()).sum()) == 1 << 17


@needs_nixl
async def test_registrations_are_released_when_the_connection_closes() -> None:
    with anyio.fail_after(10):  # the earlier tests' connections (a closed sender lingers)
        while nixl.registrations():
            await anyio.sleep(0.01)
    before = 0
    a, b = await tcp_pair(slots=BIG)
    assert nixl.registrations() == 4  # two send arenas, two mirrors
    async with a, b:
        await a.send(np.ones(1 << 17, np.uint8))
        got = await b.receive()
        assert int(got.sum()) == 1 << 17
        del got
        gc.collect()
    with anyio.fail_after(5):
        while nixl.registrations() > before:
            await anyio.sleep(0.01)


@needs_nixl
async def test_a_failed_read_breaks_only_that_connection_with_a_clear_error() -> None:
    """A note that moves the sender's region to memory it never registered: the
    receiver's read is refused by NIXL, and that connection breaks saying so."""
    from ringwire._net.nixl import Note
    from ringwire._net.nixlpools import _note_encoder

    a, b = await tcp_pair(slots=BIG)
    c, d = await tcp_pair(slots=BIG)
    async with a, b, c, d:
        link = a._core.transport.holder
        arena = link.send_arenas[0]
        agent = link.agent
        forged = Note(agent.name, agent.metadata(), True, 0, [(0, "DRAM", 0, 4096, arena.size)])
        a._core.transport.send_control(b"N" + _note_encoder.encode(forged))
        await a.send(np.ones(1 << 17, np.uint8))
        with pytest.raises(anyio.BrokenResourceError) as info:
            with anyio.fail_after(5):
                await b.receive()
        assert "NIXL" in str(info.value.__cause__)
        await c.send(np.ones(1 << 17, np.uint8))
        assert int((await d.receive()).sum()) == 1 << 17


@needs_nixl
@pytest.mark.parametrize("failing", ["listener", "client"])
async def test_a_side_that_cannot_load_the_peers_note_turns_nixl_off_for_both(
    failing: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """UCX may find no way to the peer's agent (between two namespaces it says
    "Destination is unreachable"): whichever side fails to load the other's note,
    the connection is made, both ends send frames, say why, and give NIXL's memory
    back.  The listener loads the client's note first, then the client the
    listener's."""
    with anyio.fail_after(10):  # the earlier tests' connections (a closed sender lingers)
        while nixl.registrations():
            await anyio.sleep(0.01)
    calls: list[str] = []
    real = nixl.Agent.add_remote

    def add_remote(self: Any, metadata: bytes, known: bool, name: str) -> str:
        calls.append(name)
        if len(calls) == (1 if failing == "listener" else 2):
            raise RuntimeError("NIXL_ERR_BACKEND")
        return real(self, metadata, known, name)

    monkeypatch.setattr(nixl.Agent, "add_remote", add_remote)
    client, server = await tcp_pair(slots=BIG)
    async with client, server:
        x = np.arange(1 << 16, dtype=np.float32)  # above the threshold
        await client.send(x)  # (behind the client's O, if it sent one)
        np.testing.assert_array_equal(await server.receive(), x)
        await server.send(x * 2)
        np.testing.assert_array_equal(await client.receive(), x * 2)
        for ch in (client, server):
            st = ch.statistics()
            assert st.tensor_path == "frames", (failing, st)
            assert "NIXL could not load the metadata" in st.nixl_off, st.nixl_off
            assert st.nixl_arrays_sent == st.nixl_arrays_received == 0
        assert "UCX_TLS" in server.statistics().nixl_off  # what to do about it
        with anyio.fail_after(5):  # the fallen-back links' arenas are deregistered
            while nixl.registrations():
                await anyio.sleep(0.01)
    assert len(calls) == (1 if failing == "listener" else 2)
    warned = [r for r in caplog.records if "NIXL is off on the connection" in r.getMessage()]
    assert len(warned) == 2, [r.getMessage() for r in caplog.records]


@needs_nixl
async def test_the_listener_hands_out_a_connection_once_nixl_is_settled() -> None:
    """The client answers the listener's note (Y) before the listener's connection
    exists: the listener's very first array goes through NIXL."""
    client, server = await tcp_pair(slots=BIG)
    async with client, server:
        x = np.arange(1 << 16, dtype=np.float32)
        await server.send(x)  # at once: nothing to wait for
        np.testing.assert_array_equal(await client.receive(), x)
        st = server.statistics()
        assert (st.tensor_path, st.nixl_off, st.nixl_arrays_sent) == ("nixl", "", 1)
        assert client.statistics().nixl_arrays_received == 1


@needs_nixl
async def test_a_client_that_never_answers_the_note_is_refused_in_time(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A client whose Y never comes (lost, or a peer that stops there) holds an attach
    in progress only until the handshake timeout: refused with the reason, its port and
    NIXL memory given back."""
    from ringwire._net import handshake as hs

    real = hs._send_now

    def no_y(sock: Any, parts: list[bytes]) -> None:
        if parts != [b"", b"Y"]:
            real(sock, parts)

    monkeypatch.setattr(hs, "_send_now", no_y)
    with anyio.fail_after(10):  # the earlier tests' connections (a closed sender lingers)
        while nixl.registrations():
            await anyio.sleep(0.01)
    async with ringwire.listen("tcp://127.0.0.1:0", slots=BIG, handshake_timeout=0.5) as lst:
        async with await ringwire.connect(lst.path, slots=BIG) as client:
            with pytest.raises(anyio.BrokenResourceError), anyio.fail_after(5):
                await client.receive()  # the listener's abort
            with anyio.fail_after(5):
                while lst.statistics().refused < 1:
                    await anyio.sleep(0.01)
        assert lst.statistics().accepted == 0
    assert any("did not confirm NIXL within 0.5 s" in r.getMessage() for r in caplog.records)
    with anyio.fail_after(5):
        while nixl.registrations():
            await anyio.sleep(0.01)


@needs_nixl
def test_an_idle_agent_uses_no_cpu() -> None:
    """NIXL's Python agent would start a progress thread that spins (sched_yield, no
    delay): a third of a core or more in every process, idle.  Ours runs without it."""
    assert nixl.process() is not None
    time.sleep(nixl.CLOSE_PROGRESS + 0.1)  # (the earlier tests' closes progressed)
    t0 = time.process_time()
    time.sleep(1.0)
    assert time.process_time() - t0 < 0.1


def _exchange_sync() -> tuple[bool, bool]:
    """One array over a fresh tcp:// pair of this process: (intact, through NIXL)."""
    with ringwire.SyncListener("tcp://127.0.0.1:0") as sl:
        out: list[Any] = []
        t = threading.Thread(target=lambda: out.append(ringwire.connect_sync(sl.path)))
        t.start()
        conn = sl.accept(10)
        t.join()
        with out[0] as c, conn:
            x = np.arange(1 << 16, dtype=np.float32)
            c.send(x, timeout=10)
            y = conn.receive(timeout=10)
            ok = bool((y == x).all())
            through = getattr(conn._core.peer, "nixl_received", 0) == 1
            del y
        return ok, through


@needs_nixl
def test_a_forked_child_uses_frames_and_leaves_the_parents_agent_alone() -> None:
    """UCX does not survive a fork: a forked child offers no NIXL (frames), and the
    parent's agent keeps working after the child is gone."""
    agent = nixl.process()
    assert _exchange_sync() == (True, True)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 3
        try:
            ok, through = _exchange_sync()
            code = 0 if ok and not through and nixl.process() is None and not nixl.offer() else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert nixl.process() is agent and _exchange_sync() == (True, True)
