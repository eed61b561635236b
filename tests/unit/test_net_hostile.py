"""Hostile TCP peers (ringwire._net): a raw pyzmq peer that speaks the protocol badly
against a real ringwire listener, while a good client is served at the same time.

Each attack: the listener drops that connection with a clear reason -- it logs it,
counts it (``statistics().broken`` / ``refused``) and tells the peer (``A`` + reason)
where the connection got that far -- and the good client's traffic carries on
untouched throughout (checked in order, and once more after the attack).  The raw peer
does the handshake by hand (:class:`RawPeer`), then lies: about lengths (an Ext 20
naming a frame size that differs, frames missing), references (a release of an array
never sent, a release twice), credit (backwards, past what was sent, records past it),
the order (a record after ``E``), sizes (a message past the largest), garbage (an
unknown control byte, a control message of three frames, a record that is no
msgpack, NIXL's messages where NIXL is off); at the handshake (a wrong token, a stale
session id, a malformed NIXL note); and at the rendezvous (a flood of hellos that
never attach).  The raw peer offers no NIXL, so its arrays are frames; the good
client uses NIXL where nixl-cu12 is installed.
"""

from __future__ import annotations

import gc
import logging
import os
import secrets
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import anyio
import msgspec
import numpy as np
import pytest

import ringwire

zmq = pytest.importorskip("zmq")

from ringwire._net import handshake as hs  # noqa: E402
from ringwire._wire import ext as X  # noqa: E402
from ringwire._wire.control import PROTOCOL_VERSION  # noqa: E402
from ringwire._wire.descriptors import NetRef  # noqa: E402
from ringwire._wire.net_control import (  # noqa: E402
    Hello,
    Refused,
    Welcome,
    decode_rendezvous,
    encode_control,
    encode_rendezvous,
)

pytestmark = pytest.mark.anyio
LANE = 4096  # the raw peer's lane: the listener's receiving lane of its connection
WAIT_MS = 5000
SLOTS = ringwire.SlotConfig(classes=(ringwire.SlotClass(64 << 10, 4),), threshold=1024)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class RawPeer:
    """A ZeroMQ peer that does ringwire's TCP handshake by hand (blocking: run it in a
    thread), then sends whatever it is told to."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.ctx = zmq.Context()
        self.dealer: Any = None
        self.pair: Any = None
        self.session = secrets.token_bytes(16)
        self.welcome: Welcome | None = None

    def hello(self, **kw: Any) -> Welcome | Refused:
        if self.dealer is None:
            self.dealer = self.ctx.socket(zmq.DEALER)
            self.dealer.setsockopt(zmq.LINGER, 0)
            self.dealer.connect(self.url)
        args = dict(
            version=PROTOCOL_VERSION,
            session=self.session,
            capacity=LANE,
            budget=0,
            pid=os.getpid(),
            host="hostile",
        )
        args.update(kw)
        self.dealer.send(encode_rendezvous(Hello(**args)))
        assert self.dealer.poll(WAIT_MS), "no answer at the rendezvous"
        reply = decode_rendezvous(self.dealer.recv(), "reply")
        assert isinstance(reply, (Welcome, Refused))
        if isinstance(reply, Welcome):
            self.welcome = reply
        return reply

    def attach(
        self, token: bytes | None = None, session: bytes | None = None, note: bytes = b""
    ) -> list[bytes]:
        """Connect to the port of the welcome and send the attach; the answer (``[]``
        if none came: the listener dropped the port)."""
        if self.welcome is None:
            assert isinstance(self.hello(), Welcome)
        assert self.welcome is not None
        self.pair = self.ctx.socket(zmq.PAIR)
        self.pair.setsockopt(zmq.LINGER, 0)
        self.pair.connect(f"tcp://127.0.0.1:{self.welcome.port}")
        tok = self.welcome.token if token is None else token
        self.pair.send_multipart([b"", b"H" + tok + (session or self.session) + note])
        return self.recv(WAIT_MS / 1000) or []

    def connect(self) -> RawPeer:
        assert self.attach() == [b"", b"K"]
        return self

    def send(self, *frames: bytes) -> None:
        self.pair.send_multipart(list(frames))

    def control(self, body: bytes) -> None:
        self.send(b"", body)

    def recv(self, timeout: float) -> list[bytes] | None:
        if not self.pair.poll(int(timeout * 1000)):
            return None
        return self.pair.recv_multipart()

    def recv_record(self, timeout: float = 5.0) -> list[bytes]:
        """The next record (control messages -- credits, releases -- skipped)."""
        deadline = time.monotonic() + timeout
        while True:
            msg = self.recv(max(0.0, deadline - time.monotonic()))
            assert msg is not None, "no record came"
            if msg[0]:
                return msg

    def abort_reason(self, timeout: float = 5.0) -> str:
        """Read until the listener's abort (``A`` + reason) and return the reason."""
        deadline = time.monotonic() + timeout
        seen = []
        while time.monotonic() < deadline:
            msg = self.recv(max(0.0, deadline - time.monotonic()))
            if msg is None:
                break
            seen.append(msg[:2])
            if len(msg) == 2 and msg[0] == b"" and msg[1][:1] == b"A":
                return msg[1][1:].decode()
        raise AssertionError(f"no abort from the listener; it sent {seen[-5:]}")

    def close(self) -> None:
        for s in (self.dealer, self.pair):
            if s is not None:
                s.close(0)
        self.ctx.term()


def _record(obj: Any) -> bytes:
    return ringwire.Encoder().encode(obj)


def _netref(index: int, nbytes: int, tag: int = 7) -> bytes:
    ref = NetRef(1, tag, 1, index, nbytes, (nbytes // 4,), "<f4", "numpy")
    return msgspec.msgpack.encode(
        {"x": msgspec.msgpack.Ext(X.NET_REF, msgspec.msgpack.encode(ref))}
    )


async def _good_traffic(good: ringwire.Channel, stop: anyio.Event, counter: list[int]) -> None:
    """The good client: request/response through the listener's echo, in order."""
    i = 0
    while not stop.is_set():
        await good.send({"i": i, "a": np.full(300, i, np.uint32)})  # a frame beside it
        rec = await good.receive()
        assert rec["i"] == i and int(rec["a"][0]) == i and rec["a"].shape == (300,)
        del rec
        i += 1
        counter[0] = i
        await anyio.sleep(0.001)


async def _serve(lst: ringwire.Listener, fan_in: bool) -> None:
    """Echo every record of every connection (the raw peer's too, until it is dropped);
    without ``fan_in``, only the first connection's (the good client's)."""
    if not fan_in:
        conn = await lst.accept()
        while True:
            await conn.send(await conn.receive())
    async for conn, rec in lst:
        try:
            await conn.send(rec)
        except (ringwire.BrokenResourceError, ringwire.ClosedResourceError):
            pass
        del rec


async def run_attack(
    attack: Callable[[RawPeer], Any],
    caplog: pytest.LogCaptureFixture,
    *,
    dropped: str | None = None,
    refused: int = 0,
    fan_in: bool = True,
) -> Any:
    """Run ``attack`` (in a thread) against a listener that serves a good client at
    the same time; then check the good client, the listener's counts and its log (the
    connection ``dropped`` with a reason matching that, or ``refused`` handshakes)."""
    caplog.set_level(logging.WARNING, logger="ringwire")
    async with ringwire.listen("tcp://127.0.0.1:0", slots=SLOTS) as lst:
        good = await ringwire.connect(lst.path, slots=SLOTS, capacity=1 << 16)
        stop = anyio.Event()
        counter = [0]
        async with good, anyio.create_task_group() as tg:
            tg.start_soon(_serve, lst, fan_in)
            tg.start_soon(_good_traffic, good, stop, counter)
            with anyio.fail_after(3):  # the good client is going before the attack
                while counter[0] < 3:
                    await anyio.sleep(0.005)
            peer = RawPeer(lst.path)
            try:
                with anyio.fail_after(30):
                    result = await anyio.to_thread.run_sync(attack, peer)
            finally:
                await anyio.to_thread.run_sync(peer.close)
            before = counter[0]
            with anyio.fail_after(5):  # ... and still going after it
                while counter[0] < before + 5:
                    await anyio.sleep(0.005)
            stop.set()
            tg.cancel_scope.cancel()
        # a serve task cancelled inside conn.send(rec) leaves rec in its frame, held by
        # the traceback's cycle until a collection: before the listener closes it
        gc.collect()
        st = lst.statistics()
        if dropped is not None and not fan_in:  # broken, not read: still in the fan-in
            logs = [r.getMessage() for r in caplog.records]
            assert any(dropped in m and "broken" in m for m in logs), logs
        elif dropped is not None:
            # dropped from the fan-in: broken (or ended, where the peer sent E first)
            with anyio.fail_after(5):
                while lst.statistics().broken + lst.statistics().ended < 1:
                    await anyio.sleep(0.01)
            st = lst.statistics()
            assert st.broken + st.ended == 1 and st.open_connections == 1, st
            logs = [r.getMessage() for r in caplog.records]
            assert any(dropped in m and ("dropped" in m or "broken" in m) for m in logs), logs
        assert st.refused == refused, (st, [r.getMessage() for r in caplog.records])
    return result


def _expect_abort(peer: RawPeer, pattern: str) -> str:
    reason = peer.abort_reason()
    assert pattern in reason, reason
    return reason


# ======================================================================================
# lying lengths, forged references


async def test_netref_naming_a_frame_of_another_size(caplog: Any) -> None:
    def attack(peer: RawPeer) -> str:
        peer.connect()
        peer.send(_netref(0, 400), b"\x00" * 256)  # says 400 bytes, the frame has 256
        return _expect_abort(peer, "Ext 20 says 400 bytes but frame 0 has 256")

    await run_attack(attack, caplog, dropped="Ext 20 says 400 bytes")


async def test_netref_naming_a_frame_that_is_missing(caplog: Any) -> None:
    def attack(peer: RawPeer) -> str:
        peer.connect()
        peer.send(_netref(1, 256), b"\x00" * 256)  # frame 1 of a record that has one
        return _expect_abort(peer, "names frame 1, but the record came with 1")

    await run_attack(attack, caplog, dropped="names frame 1")


async def test_a_frame_named_twice(caplog: Any) -> None:
    def attack(peer: RawPeer) -> str:
        peer.connect()
        ref = msgspec.msgpack.Ext(
            X.NET_REF, msgspec.msgpack.encode(NetRef(1, 9, 1, 0, 8, (2,), "<f4", "numpy"))
        )
        peer.send(msgspec.msgpack.encode([ref, ref]), b"\x00" * 8)
        return _expect_abort(peer, "referenced twice")

    await run_attack(attack, caplog, dropped="referenced twice")


async def test_release_of_an_array_never_sent(caplog: Any) -> None:
    def attack(peer: RawPeer) -> str:
        peer.connect()
        peer.control(encode_control(b"R", [(12345, 1)]))
        peer.send(_record("poke"))  # a record: the listener's side reads (a safe point)
        return _expect_abort(peer, "release of array 12345: it is not out")

    await run_attack(attack, caplog, dropped="it is not out")


async def test_release_twice(caplog: Any) -> None:
    def attack(peer: RawPeer) -> str:
        peer.connect()
        peer.send(_record({"a": np.zeros(2048, np.uint8)}))  # echoed with a frame
        echo = peer.recv_record()
        assert len(echo) == 2, echo  # the record and its frame
        tag = _find_tag(echo[0])
        peer.control(encode_control(b"R", [(tag, 1)]))
        peer.control(encode_control(b"R", [(tag, 1)]))  # again
        peer.send(_record("poke"))
        return _expect_abort(peer, f"release of array {tag}: it is not out")

    await run_attack(attack, caplog, dropped="it is not out")


def _find_tag(payload: bytes) -> int:
    tags: list[int] = []

    def hook(code: int, data: memoryview) -> None:
        if code == X.NET_REF:
            tags.append(msgspec.msgpack.decode(data, type=NetRef).tag)

    msgspec.msgpack.Decoder(ext_hook=hook).decode(payload)
    assert len(tags) == 1, tags
    return tags[0]


async def test_unknown_tags_and_extra_frames_are_the_senders_business(caplog: Any) -> None:
    """A tag and generation name the *sender's* buffer, so any value resolves: the
    receiver hands it back in its release (a lying sender only confuses its own
    budget).  A frame no reference names is freed with its message.  Neither breaks
    the connection: the records are echoed and the release comes back."""

    def attack(peer: RawPeer) -> list[tuple[int, int]]:
        peer.connect()
        ref = NetRef(1, 2**63 + 5, 7, 0, 256, (64,), "<f4", "numpy")
        ext = msgspec.msgpack.Ext(X.NET_REF, msgspec.msgpack.encode(ref))
        frame = np.arange(64, dtype=np.float32).tobytes()
        peer.send(msgspec.msgpack.encode({"x": ext}), frame, b"an extra frame")
        echo: list[bytes] = []
        releases: list[tuple[int, int]] = []
        deadline = time.monotonic() + 5
        while not (echo and releases) and time.monotonic() < deadline:
            msg = peer.recv(0.1)
            if msg is None:
                peer.send(_record("poke"))  # a safe point on the listener's side
            elif msg[0] and not echo:
                echo = msg
            elif msg[0] == b"" and msg[1][:1] == b"R":
                body = msg[1][1:]
                releases += [struct.unpack_from(">QQ", body, i) for i in range(0, len(body), 16)]
            elif msg[0] == b"" and msg[1][:1] == b"A":
                raise AssertionError(f"dropped: {msg}")
        assert len(echo) == 1, echo  # 256 bytes: below the threshold, echoed inline
        assert ringwire.Decoder().decode(echo[0])["x"].tobytes() == frame
        return releases

    releases = await run_attack(attack, caplog)
    assert releases == [(2**63 + 5, 7)]


# ======================================================================================
# credit, order, sizes


async def test_credit_past_what_was_sent(caplog: Any) -> None:
    def attack(peer: RawPeer) -> str:
        peer.connect()
        peer.control(encode_control(b"C", 100))  # the listener sent nothing yet
        return _expect_abort(peer, "a credit of 100 bytes (sent 0, credited 0)")

    await run_attack(attack, caplog, dropped="a credit of 100 bytes")


async def test_credit_going_backwards(caplog: Any) -> None:
    def attack(peer: RawPeer) -> str:
        peer.connect()
        payload = _record("x" * 100)
        peer.send(payload)
        assert peer.recv_record() == [payload]  # echoed: the listener sent len + 4 bytes
        peer.control(encode_control(b"C", len(payload) + 4))
        peer.control(encode_control(b"C", 10))
        return _expect_abort(peer, "a credit of 10 bytes")

    await run_attack(attack, caplog, dropped="a credit of 10 bytes")


async def test_records_past_the_credit(caplog: Any) -> None:
    """Records past the lane's credit (the raw peer never waits for one).  Nobody reads
    its connection here, so what it sent stays unconsumed: a reader that keeps up
    grants credit as it goes, and the peer's records would then be within it."""

    def attack(peer: RawPeer) -> str:
        peer.connect()
        payload = _record("y" * 500)
        for _ in range(2 * LANE // len(payload)):
            peer.send(payload)
        return _expect_abort(peer, "more than the lane's credit of 4096")

    await run_attack(attack, caplog, dropped="more than the lane's credit", fan_in=False)


async def test_a_record_after_the_end_of_stream(caplog: Any) -> None:
    """(Nobody reads the raw peer's connection here: a reader could see the end and
    close it before the record after it arrives.)"""

    def attack(peer: RawPeer) -> str:
        peer.connect()
        peer.control(b"E")
        peer.send(_record("late"))
        return _expect_abort(peer, "a record arrived after the peer's end of stream")

    await run_attack(attack, caplog, dropped="after the peer's end of stream", fan_in=False)


async def test_an_oversized_message(caplog: Any) -> None:
    """Past the connection's largest message (its lane, the peer's budget 0): libzmq
    drops the TCP connection itself, which the listener sees as the peer gone."""

    def attack(peer: RawPeer) -> None:
        peer.connect()
        mon = peer.pair.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            peer.send(b"\x91" + b"\xc4" * (LANE + 200))
            assert mon.poll(5000), "the oversized message did not end the connection"
        finally:
            peer.pair.disable_monitor()
            mon.close(0)
        while (msg := peer.recv(0.05)) is not None:
            assert not msg[0], "the oversized record got through"

    await run_attack(attack, caplog, dropped="died or dropped the connection")


# ======================================================================================
# garbage


async def test_an_unknown_control_message(caplog: Any) -> None:
    def attack(peer: RawPeer) -> str:
        peer.connect()
        peer.control(b"Z?")
        return _expect_abort(peer, "an unknown control message")

    await run_attack(attack, caplog, dropped="an unknown control message")


async def test_a_control_message_of_three_frames(caplog: Any) -> None:
    def attack(peer: RawPeer) -> str:
        peer.connect()
        peer.send(b"", b"C", b"extra")
        return _expect_abort(peer, "a control message of 3 frames")

    await run_attack(attack, caplog, dropped="a control message of 3 frames")


async def test_control_messages_with_bad_bodies(caplog: Any) -> None:
    def attack(peer: RawPeer) -> str:
        peer.connect()
        peer.control(b"R" + b"\x00" * 15)
        return _expect_abort(peer, "a release message of 15 bytes")

    await run_attack(attack, caplog, dropped="a release message of 15 bytes")


async def test_a_handshake_message_after_the_attach(caplog: Any) -> None:
    def attack(peer: RawPeer) -> str:
        peer.connect()
        peer.control(b"K")
        return _expect_abort(peer, "a handshake message b'K' after the attach")

    await run_attack(attack, caplog, dropped="after the attach")


async def test_nixl_messages_on_a_connection_without_nixl(caplog: Any) -> None:
    def attack(peer: RawPeer) -> str:
        peer.connect()  # (offered no NIXL)
        peer.control(b"Yes")
        return _expect_abort(peer, "a Y message with 2 bytes of body")

    await run_attack(attack, caplog, dropped="a Y message")


@pytest.mark.skipif(not hs.nixl.offer(), reason="NIXL is not usable here")
async def test_an_attach_with_a_malformed_nixl_note(caplog: Any) -> None:
    def attack(peer: RawPeer) -> list[bytes]:
        assert isinstance(peer.hello(nixl="DRAM"), Welcome)
        assert peer.welcome is not None and peer.welcome.nixl  # both offered
        return peer.attach(note=b"N\xc1 not a note")

    answer = await run_attack(attack, caplog, refused=1)
    assert answer[1].startswith(b"A") and b"bad NIXL note" in answer[1], answer


async def test_a_record_that_is_not_msgpack(caplog: Any) -> None:
    def attack(peer: RawPeer) -> str:
        peer.connect()
        peer.send(b"\xc1\xc1\xc1 garbage")
        return _expect_abort(peer, "DecodeError")

    await run_attack(attack, caplog, dropped="MessagePack data is malformed")


# ======================================================================================
# the handshake and the rendezvous


async def test_an_attach_with_a_wrong_token(caplog: Any) -> None:
    def attack(peer: RawPeer) -> list[bytes]:
        return peer.attach(token=b"\x00" * 16)

    answer = await run_attack(attack, caplog, refused=1)
    assert answer[0] == b"" and answer[1].startswith(b"Aa bad attach (wrong token"), answer
    assert any("a bad attach" in r.getMessage() for r in caplog.records)


async def test_an_attach_with_a_stale_session_id(caplog: Any) -> None:
    def attack(peer: RawPeer) -> list[bytes]:
        assert isinstance(peer.hello(), Welcome)
        return peer.attach(session=secrets.token_bytes(16))  # not the hello's session

    answer = await run_attack(attack, caplog, refused=1)
    assert answer[1].startswith(b"Aa bad attach (wrong token or session id"), answer


async def test_bad_hellos_are_refused_with_the_reason(caplog: Any) -> None:
    def attack(peer: RawPeer) -> list[str]:
        out = []
        for kw in ({"version": 999}, {"capacity": 1000}, {"session": b"short"}):
            reply = peer.hello(**kw)
            assert isinstance(reply, Refused), reply
            out.append(reply.reason)
        peer.dealer.send(b"\xc1 not msgpack")
        reply = decode_rendezvous(peer.dealer.recv() if peer.dealer.poll(WAIT_MS) else b"", "r")
        assert isinstance(reply, Refused) and "malformed hello" in reply.reason
        return out

    reasons = await run_attack(attack, caplog, refused=4)
    assert "protocol version 999" in reasons[0]
    assert "lane capacity 1000" in reasons[1] and "16 bytes" in reasons[2]


async def test_a_flood_of_hellos_that_never_attach(caplog: Any) -> None:
    """Every hello takes a socket and a port until its attach or the handshake timeout:
    past MAX_PENDING of them the listener refuses (instead of running out of descriptors
    and ports, which used to end its accept loop); the good client is served all along."""
    n = hs.MAX_PENDING + 40

    def attack(peer: RawPeer) -> tuple[int, int]:
        welcomed = refused = 0
        for i in range(n):
            reply = peer.hello(session=struct.pack(">QQ", i, 0))
            if isinstance(reply, Welcome):
                welcomed += 1
            else:
                assert "handshakes are in progress" in reply.reason, reply
                refused += 1
        return welcomed, refused

    welcomed, refused = await run_attack(attack, caplog, refused=40)
    assert (welcomed, refused) == (hs.MAX_PENDING, 40)


async def test_the_pending_attaches_of_a_flood_expire_and_free_their_ports() -> None:
    acc = hs.NetAcceptor(
        "tcp://127.0.0.1:0",
        max_capacity=1 << 20,
        slots=None,
        heartbeat=3.0,
        handshake_timeout=0.3,
        capacity_default=1 << 16,
    )
    peer = RawPeer(acc.address.url)
    try:
        box: list[Any] = []
        t = threading.Thread(target=lambda: box.append([peer.hello() for _ in range(20)]))
        t.start()
        deadline = time.monotonic() + 10
        refusals: list[BaseException] = []
        while t.is_alive() and time.monotonic() < deadline:
            refusals += acc.step()[1]
            time.sleep(0.001)
        t.join()
        assert all(isinstance(w, Welcome) for w in box[0])
        ports = {w.port for w in box[0]}
        assert acc.next_deadline() is not None
        while acc.next_deadline() is not None and time.monotonic() < deadline:
            refusals += acc.step()[1]
            time.sleep(0.01)
        assert acc.next_deadline() is None  # every attach timed out
        assert len(refusals) == 20 and all("did not attach" in str(e) for e in refusals)
        listening = _listening_ports()
        assert not ports & listening, ports & listening  # their ports are closed
    finally:
        peer.close()
        acc.close()


def _listening_ports() -> set[int]:
    out = set()
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            parts = line.split()
            if parts[3] == "0A":  # LISTEN
                out.add(int(parts[1].rsplit(":", 1)[1], 16))
    return out


# ======================================================================================
# a listener that goes away during the handshake (the client is the one checked)


@pytest.mark.parametrize("when", ["before the welcome", "during the attach"])
async def test_a_listener_gone_during_the_handshake_is_seen_at_once(when: str) -> None:
    """A raw rendezvous takes the hello, then (after a welcome naming a port nobody
    answers on) its process goes away: the client's connect fails at once with a
    HandshakeError, not at its timeout (it watched only for a refused connection)."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    silent = ctx.socket(zmq.PAIR)  # bound, never answers an attach
    silent.setsockopt(zmq.LINGER, 0)
    silent_port = silent.bind_to_random_port("tcp://127.0.0.1")

    def rendezvous() -> None:
        assert router.poll(WAIT_MS)
        rid, _hello = router.recv_multipart()
        if when == "during the attach":
            welcome = Welcome(PROTOCOL_VERSION, silent_port, b"t" * 16, LANE, 0, os.getpid())
            router.send_multipart([rid, encode_rendezvous(welcome)])
            assert silent.poll(WAIT_MS)  # the attach arrived
        time.sleep(0.05)
        router.close(0)  # as a killed listener's sockets

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(anyio.to_thread.run_sync, rendezvous)
            t0 = time.monotonic()
            with pytest.raises(ringwire.HandshakeError, match="went away during the handshake"):
                await ringwire.connect(f"tcp://127.0.0.1:{port}", handshake_timeout=10)
            assert time.monotonic() - t0 < 2
    finally:
        router.close(0)
        silent.close(0)
        ctx.term()
