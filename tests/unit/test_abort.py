"""A receiver that drops a connection tells the sender why (the abort), and the sender
gets ``BrokenResourceError`` carrying that reason -- never a bare ``EndOfStream``."""

from __future__ import annotations

import pathlib
import threading

import anyio
import pytest
from anyio import BrokenResourceError, EndOfStream

import ringwire
from ringwire import ProtocolError, Record
from ringwire._conn.endpoint import Endpoint
from ringwire._conn.memory import memory_pair
from ringwire._wire.control import MAX_ABORT_REASON, ControlReader, encode_abort


class Order(Record):
    item: str
    qty: int


# -- the control stream ---------------------------------------------------------------


def test_doorbells_and_a_last_abort_parse_in_any_split() -> None:
    wire = b"DSDC" + encode_abort("bad record: DecodeError")
    for cut in range(len(wire) + 1):
        r = ControlReader()
        n = r.feed(wire[:cut]) + r.feed(wire[cut:])
        assert n == 4 and r.reason == "bad record: DecodeError", cut


@pytest.mark.parametrize(
    "wire",
    [b"DQ", b"X\xff\xff" + b"x" * 70000, encode_abort("a") + b"D", b"DX\x00\x01ab"],
    ids=["garbage", "too long", "bytes after abort", "length lies"],
)
def test_malformed_control_bytes_are_protocol_errors(wire: bytes) -> None:
    with pytest.raises(ProtocolError):
        ControlReader().feed(wire)


def test_a_long_reason_is_cut_at_a_character() -> None:
    msg = encode_abort("é" * 1000)
    r = ControlReader()
    r.feed(msg)
    assert r.reason is not None and len(r.reason.encode()) <= MAX_ABORT_REASON
    assert set(r.reason) == {"é"}


# -- the endpoint -----------------------------------------------------------------------


def test_the_sender_of_a_dropped_connection_learns_why() -> None:
    ta, tb = memory_pair()
    a, b = Endpoint(ta, spin_us=0), Endpoint(tb, spin_us=0)
    assert b.try_send(b.encode("reply 1"))
    b.abort("DecodeError: this message holds a torch value but torch is not installed")
    b.mark_closed()
    b.release()
    with pytest.raises(BrokenResourceError, match="torch is not installed"):
        a.try_send(a.encode("next"))
    assert a.receive_nowait(a.dec) == "reply 1"  # what was published still arrives
    with pytest.raises(BrokenResourceError, match="dropped the connection: DecodeError"):
        a.receive_nowait(a.dec)


def test_a_clean_close_is_still_end_of_stream() -> None:
    ta, tb = memory_pair()
    a, b = Endpoint(ta, spin_us=0), Endpoint(tb, spin_us=0)
    b.mark_closed()
    b.release()
    with pytest.raises(EndOfStream):
        a.receive_nowait(a.dec)


# -- real channels -----------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_listener_dropping_an_undecodable_record_tells_the_sender(
    tmp_path: pathlib.Path,
) -> None:
    path = tmp_path / "orders.sock"
    async with ringwire.listen(path, type=Order, slots=None) as lst:
        chan = await ringwire.connect(path, slots=None)
        await chan.send(Order(item="tea", qty=1))
        _, order = await lst.receive()
        assert order == Order(item="tea", qty=1)
        await chan.send({"not": "an order"})  # the listener cannot decode this: it drops us
        async with anyio.create_task_group() as tg:
            tg.start_soon(lst.receive)
            with anyio.fail_after(5):
                while lst.statistics().broken == 0:
                    await anyio.sleep(0.005)
            tg.cancel_scope.cancel()
        with pytest.raises(BrokenResourceError) as info:
            await chan.send(Order(item="more", qty=2))
        text = str(info.value)
        assert "dropped the connection" in text and "DecodeError" in text, text
        with pytest.raises(BrokenResourceError, match="DecodeError"):
            await chan.receive()  # not EndOfStream: the close was not clean
        await chan.aclose()


def test_abort_on_a_blocking_channel_reaches_the_peer() -> None:
    a, b = ringwire.pair()
    out: dict[str, object] = {}
    t = threading.Thread(target=lambda: out.setdefault("b", b.connect_sync(slots=None)))
    t.start()
    ca = a.connect_sync(slots=None)
    t.join()
    cb = out["b"]
    assert isinstance(cb, ringwire.SyncChannel)
    with pytest.raises(TypeError):
        cb.abort(42)  # type: ignore[arg-type]
    cb.abort("the worker refuses this client")
    with pytest.raises(BrokenResourceError, match="refuses this client"):
        ca.receive(timeout=5)
    with pytest.raises(BrokenResourceError, match="refuses this client"):
        ca.send("x")
    ca.close()


# -- connecting to nothing ------------------------------------------------------------------


@pytest.mark.anyio
async def test_connect_errors_name_the_path_and_keep_their_type(tmp_path: pathlib.Path) -> None:
    missing = tmp_path / "nobody.sock"
    with pytest.raises(FileNotFoundError, match=rf"no ringwire listener at {missing}"):
        await ringwire.connect(missing)
    with pytest.raises(FileNotFoundError, match="start the listener"):
        ringwire.connect_sync(missing)
    plain = tmp_path / "plain-file"
    plain.write_text("not a socket")
    with pytest.raises(ConnectionRefusedError, match=rf"no ringwire listener at {plain}"):
        ringwire.connect_sync(plain)
    with pytest.raises(ConnectionRefusedError) as info:
        await ringwire.connect(plain)
    assert isinstance(info.value.__cause__, ConnectionRefusedError)  # the original, chained
    assert not [p for p in tmp_path.iterdir() if p.name != "plain-file"]
