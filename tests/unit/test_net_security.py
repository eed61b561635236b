"""CURVE over tcp:// (ringwire._net.keys, ringwire._net.curve) in one process: the right
key connects, a wrong key or none is refused at once and the refusal is logged, the
listener keeps serving, key files are checked, keygen writes what it should."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import shutil
import socket
import stat
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

import ringwire
from ringwire._cli import main as cli_main

zmq = pytest.importorskip("zmq")

from ringwire._net.keys import default_name, keygen  # noqa: E402

pytestmark = pytest.mark.anyio
REFUSAL_BOUND = 2.0  # seconds: a refused client knows within this, never hangs


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Keys:
    """A listener's and two clients' key pairs; only ``client`` is listed."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.server_pub, self.server_sec = keygen(root / "server", "server")
        self.client_pub, self.client_sec = keygen(root / "client", "client")
        self.other_pub, self.other_sec = keygen(root / "other", "other")
        self.clients = root / "clients"
        self.clients.mkdir()
        shutil.copy(self.client_pub, self.clients)
        self.server = ringwire.ServerKeys(secret=self.server_sec, clients=self.clients)
        self.client = ringwire.ClientKeys(secret=self.client_sec, server=self.server_pub)
        self.unlisted = ringwire.ClientKeys(secret=self.other_sec, server=self.server_pub)
        # the right client key, but the wrong key for the listener
        self.wrong_server = ringwire.ClientKeys(secret=self.client_sec, server=self.other_pub)


@pytest.fixture
def keys(tmp_path: Path) -> Keys:
    return Keys(tmp_path)


def _auth_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "ringwire-zap"]


def _refusals(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "ringwire" and "refused a connection" in r.getMessage()
    ]


async def _exchange(client: ringwire.Channel, listener: ringwire.Listener) -> ringwire.Channel:
    x = np.arange(1 << 16, dtype=np.float32)  # 256 KiB: an Ext 20 frame beside the record
    await client.send({"n": 1, "x": x})
    with anyio.fail_after(10):
        conn, rec = await listener.receive()
    assert rec["n"] == 1
    np.testing.assert_array_equal(rec["x"], x)
    await conn.send_many([{"reply": i} for i in range(3)])
    assert [await client.receive() for _ in range(3)] == [{"reply": i} for i in range(3)]
    del rec
    return conn


async def _refused_within_bound(url: str, keys: Any, match: str) -> None:
    t0 = time.monotonic()
    with pytest.raises(ringwire.PeerCredentialsError, match=match) as info:
        await ringwire.connect(url, keys=keys, handshake_timeout=30)
    assert time.monotonic() - t0 < REFUSAL_BOUND
    assert isinstance(info.value, ringwire.HandshakeError) and isinstance(
        info.value, PermissionError
    )


async def _wait_logged(caplog: pytest.LogCaptureFixture, n: int) -> list[str]:
    with anyio.fail_after(5):
        while len(_refusals(caplog)) < n:
            await anyio.sleep(0.01)
    return _refusals(caplog)


# -- connecting ----------------------------------------------------------------------------


async def test_the_right_key_connects_and_exchanges_records_and_an_array(keys: Keys) -> None:
    assert not _auth_threads()
    async with ringwire.listen("tcp://127.0.0.1:0", keys=keys.server) as lst:
        assert len(_auth_threads()) == 1
        async with await ringwire.connect(lst.path, keys=keys.client) as c:
            await _exchange(c, lst)
        assert lst.statistics().refused == 0
    assert not _auth_threads()  # stopped and joined with the last keyed listener


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_keys_under_trio(keys: Keys) -> None:
    async with ringwire.listen("tcp://127.0.0.1:0", keys=keys.server) as lst:
        await _refused_within_bound(lst.path, keys.unlisted, "refused this client's CURVE key")
        async with await ringwire.connect(lst.path, keys=keys.client) as c:
            await _exchange(c, lst)
        assert lst.statistics().refused == 1
    assert not _auth_threads()


async def test_an_unlisted_key_is_refused_at_once_logged_and_others_still_served(
    keys: Keys, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="ringwire")
    async with ringwire.listen("tcp://127.0.0.1:0", keys=keys.server) as lst:
        await _refused_within_bound(lst.path, keys.unlisted, "refused this client's CURVE key")
        logged = await _wait_logged(caplog, 1)
        other = keys.unlisted.public_key.decode()
        assert "127.0.0.1" in logged[0] and other in logged[0] and lst.path in logged[0]
        assert str(keys.clients) in logged[0]
        assert lst.statistics().refused == 1
        async with await ringwire.connect(lst.path, keys=keys.client) as c:
            await _exchange(c, lst)


async def test_a_refusal_quicker_than_the_hello_is_still_reported(
    keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the handshake can fail between the client's connect and its hello (a loaded
    # machine): the socket's pipe is gone then, and a blocking send waited forever
    from ringwire._net import handshake

    real = handshake.encode_rendezvous

    def slow(msg: Any) -> bytes:
        time.sleep(0.3)  # the refusal arrives meanwhile
        return real(msg)

    monkeypatch.setattr(handshake, "encode_rendezvous", slow)
    async with ringwire.listen("tcp://127.0.0.1:0", keys=keys.server) as lst:
        for k, match in ((keys.unlisted, "refused this client's"), (None, "requires CURVE")):
            t0 = time.monotonic()
            with pytest.raises(ringwire.PeerCredentialsError, match=match):
                with anyio.fail_after(10):
                    await ringwire.connect(lst.path, keys=k, handshake_timeout=5)
            assert time.monotonic() - t0 < 0.3 + REFUSAL_BOUND


async def test_no_key_is_refused_and_logged(keys: Keys, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="ringwire")
    async with ringwire.listen("tcp://127.0.0.1:0", keys=keys.server) as lst:
        await _refused_within_bound(lst.path, None, "requires CURVE keys")
        assert "without CURVE keys" in (await _wait_logged(caplog, 1))[0]
        async with await ringwire.connect(lst.path, keys=keys.client) as c:
            await _exchange(c, lst)


async def test_a_wrong_server_key_is_refused_and_logged(
    keys: Keys, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="ringwire")
    async with ringwire.listen("tcp://127.0.0.1:0", keys=keys.server) as lst:
        await _refused_within_bound(lst.path, keys.wrong_server, "does not hold the secret key")
        msg = (await _wait_logged(caplog, 1))[0]
        assert "did not decrypt" in msg and keys.server.public_key.decode() in msg


async def test_keys_never_talk_to_a_listener_without_them(keys: Keys) -> None:
    async with ringwire.listen("tcp://127.0.0.1:0") as lst:
        await _refused_within_bound(lst.path, keys.client, "does not use CURVE keys")
        assert lst.statistics().accepted == 0


async def test_the_sync_api_connects_and_refuses(
    keys: Keys, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="ringwire")
    errors: list[BaseException] = []
    with ringwire.SyncListener("tcp://127.0.0.1:0", keys=keys.server) as sl:

        def clients() -> None:
            try:
                ringwire.connect_sync(sl.path, keys=keys.unlisted, handshake_timeout=30)
            except ringwire.PeerCredentialsError as exc:
                errors.append(exc)
            with ringwire.connect_sync(sl.path, keys=keys.client) as c:
                c.send({"arr": np.ones(1 << 17, np.uint8)})
                assert c.receive(timeout=10) == "ok"

        t = threading.Thread(target=clients)
        t.start()
        try:
            with sl.accept(timeout=10) as server_end:
                rec = server_end.receive(timeout=10)
                assert int(rec["arr"].sum()) == 1 << 17
                del rec
                server_end.send("ok")
        finally:
            t.join(20)
        assert len(errors) == 1 and "refused this client's CURVE key" in str(errors[0])
        assert sl.statistics().refused == 1 and "127.0.0.1" in _refusals(caplog)[0]
    assert not _auth_threads()


async def test_listeners_share_one_authenticator_and_each_admits_only_its_own(
    keys: Keys, tmp_path: Path
) -> None:
    clients2 = tmp_path / "clients2"
    clients2.mkdir()
    shutil.copy(keys.other_pub, clients2)
    second = ringwire.ServerKeys(secret=keys.server_sec, clients=clients2)
    async with ringwire.listen("tcp://127.0.0.1:0", keys=keys.server) as a:
        async with ringwire.listen("tcp://127.0.0.1:0", keys=second) as b:
            assert len(_auth_threads()) == 1
            await _refused_within_bound(b.path, keys.client, "refused this client's")
            async with await ringwire.connect(b.path, keys=keys.unlisted) as c:
                await _exchange(c, b)
        assert len(_auth_threads()) == 1  # a still holds it: still refusing, still admitting
        await _refused_within_bound(a.path, keys.unlisted, "refused this client's")
        async with await ringwire.connect(a.path, keys=keys.client) as c:
            await _exchange(c, a)
    assert not _auth_threads()


async def test_the_clients_directory_is_read_again_when_it_changes(keys: Keys) -> None:
    async with ringwire.listen("tcp://127.0.0.1:0", keys=keys.server) as lst:
        await _refused_within_bound(lst.path, keys.unlisted, "refused")
        shutil.copy(keys.other_pub, keys.clients)  # admit "other" while the listener runs
        async with await ringwire.connect(lst.path, keys=keys.unlisted) as c:
            await _exchange(c, lst)
        (keys.clients / "other.key").unlink()  # and revoke it
        await _refused_within_bound(lst.path, keys.unlisted, "refused")
        (keys.clients / "client.key").unlink()  # an empty directory admits nobody
        await _refused_within_bound(lst.path, keys.client, "refused")
        assert lst.statistics().refused == 3


async def test_a_knock_on_an_open_connections_port_does_not_break_it(keys: Keys) -> None:
    async with ringwire.listen("tcp://127.0.0.1:0", keys=keys.server) as lst:
        async with await ringwire.connect(lst.path, keys=keys.client) as c:
            conn = await _exchange(c, lst)
            # the connection's own port (the client's PAIR is connected there)
            port_url = c._core.transport._sock.getsockopt(zmq.LAST_ENDPOINT).decode()
            # a failed handshake's event value is an error code (400: a ZAP refusal), not a
            # descriptor: let the connection's descriptor number be that, to be sure
            conn._core.transport._peer_fd = 400
            ctx = zmq.Context()
            failed = (
                zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                | zmq.EVENT_HANDSHAKE_FAILED_AUTH
            )
            try:
                for k in (keys.unlisted, None, keys.wrong_server):
                    knock = ctx.socket(zmq.PAIR)
                    knock.linger = 0
                    if k is not None:
                        knock.curve_secretkey = k.secret_key
                        knock.curve_publickey = k.public_key
                        knock.curve_serverkey = k.server_key
                    mon = knock.get_monitor_socket(failed)
                    knock.connect(port_url)
                    assert mon.poll(5000), "the knock's handshake did not fail"
                    knock.disable_monitor()
                    mon.close(0)
                    knock.close(0)
            finally:
                ctx.term()
            await anyio.sleep(0.2)
            await _exchange(c, lst)  # still the same, healthy connection
            assert lst.statistics().broken == 0


# -- what a listener accepts as options --------------------------------------------------------


async def test_non_loopback_binds_need_keys_or_insecure(keys: Keys) -> None:
    with pytest.raises(ValueError, match="keys=ringwire.ServerKeys"):
        ringwire.listen("tcp://0.0.0.0:0")
    with pytest.raises(ValueError, match="insecure=True"):
        ringwire.SyncListener("tcp://0.0.0.0:0")
    with pytest.raises(ValueError, match="both keys= and insecure=True"):
        ringwire.listen("tcp://0.0.0.0:0", keys=keys.server, insecure=True)
    async with ringwire.listen("tcp://0.0.0.0:0", keys=keys.server) as lst:
        url = "tcp://127.0.0.1:" + lst.path.rsplit(":", 1)[1]
        async with await ringwire.connect(url, keys=keys.client) as c:
            await _exchange(c, lst)
        await _refused_within_bound(url, None, "requires CURVE keys")


async def test_keys_of_the_wrong_kind_or_place_are_refused(keys: Keys, tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="ServerKeys"):
        ringwire.listen("tcp://127.0.0.1:0", keys=keys.client)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="ClientKeys"):
        await ringwire.connect("tcp://127.0.0.1:9", keys=keys.server)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="ClientKeys"):
        ringwire.connect_sync("tcp://127.0.0.1:9", keys="client.key_secret")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Unix socket"):
        ringwire.listen(tmp_path / "sock", keys=keys.server)
    with pytest.raises(ValueError, match="Unix socket"):
        await ringwire.connect(tmp_path / "sock", keys=keys.client)
    with pytest.raises(ValueError, match="Unix socket"):
        ringwire.connect_sync(str(tmp_path / "sock"), keys=keys.client)


# -- key files -----------------------------------------------------------------------------------


def test_bad_key_paths_name_themselves_and_say_what_to_do(keys: Keys, tmp_path: Path) -> None:
    missing = tmp_path / "nope.key_secret"
    with pytest.raises(FileNotFoundError, match="nope.key_secret.*keygen"):
        ringwire.ServerKeys(secret=missing, clients=keys.clients)
    with pytest.raises(IsADirectoryError, match=str(keys.clients)):
        ringwire.ServerKeys(secret=keys.clients, clients=keys.clients)
    with pytest.raises(ValueError, match="server.key is a public certificate.*key_secret"):
        ringwire.ServerKeys(secret=keys.server_pub, clients=keys.clients)
    with pytest.raises(ValueError, match="client.key is a public certificate"):
        ringwire.ClientKeys(secret=keys.client_pub, server=keys.server_pub)
    with pytest.raises(ValueError, match="server.key_secret holds a secret key"):
        ringwire.ClientKeys(secret=keys.client_sec, server=keys.server_sec)
    junk = tmp_path / "junk.key_secret"
    junk.write_bytes(b"\x00\xffnot a certificate\n")
    with pytest.raises(ValueError, match="junk.key_secret is not a ZeroMQ CURVE certificate"):
        ringwire.ClientKeys(secret=junk, server=keys.server_pub)
    bad = tmp_path / "bad.key"
    bad.write_text('curve\n    public-key = "tooshort"\n')
    with pytest.raises(ValueError, match="bad.key holds a malformed key"):
        ringwire.ClientKeys(secret=keys.client_sec, server=bad)
    swapped = tmp_path / "swapped.key_secret"  # a secret key whose public half is another's
    text = keys.client_sec.read_text().replace(
        keys.client.public_key.decode(), keys.server.public_key.decode()
    )
    swapped.write_text(text)
    with pytest.raises(ValueError, match="swapped.key_secret holds a malformed key"):
        ringwire.ClientKeys(secret=swapped, server=keys.server_pub)
    with pytest.raises(TypeError, match="path"):
        ringwire.ClientKeys(secret=None, server=keys.server_pub)  # type: ignore[arg-type]
    fifo = tmp_path / "fifo.key_secret"  # would block a reader forever
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="fifo.key_secret is not .*a regular file"):
        ringwire.ClientKeys(secret=fifo, server=keys.server_pub)
    with pytest.raises(ValueError, match="not a regular file"):
        ringwire.ClientKeys(secret=keys.client_sec, server="/dev/zero")


def test_bad_clients_directories_name_themselves(keys: Keys, tmp_path: Path) -> None:
    sec = keys.server_sec
    with pytest.raises(FileNotFoundError, match="nowhere.*copy each client"):
        ringwire.ServerKeys(secret=sec, clients=tmp_path / "nowhere")
    with pytest.raises(NotADirectoryError, match="server.key is not a directory"):
        ringwire.ServerKeys(secret=sec, clients=keys.server_pub)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "README").write_text("no keys here")
    with pytest.raises(ValueError, match="empty has no client certificate"):
        ringwire.ServerKeys(secret=sec, clients=empty)
    leaked = tmp_path / "leaked"
    leaked.mkdir()
    shutil.copy(keys.client_sec, leaked / "client.key")  # a secret where a public one goes
    with pytest.raises(ValueError, match="client.key holds a secret key"):
        ringwire.ServerKeys(secret=sec, clients=leaked)
    ghost = tmp_path / "ghost"
    ghost.mkdir()
    shutil.copy(keys.client_pub, ghost)
    (ghost / "gone.key").symlink_to(tmp_path / "missing")  # a dangling link
    with pytest.raises(FileNotFoundError, match="gone.key cannot be read"):
        ringwire.ServerKeys(secret=sec, clients=ghost)


def test_a_secret_file_others_can_read_is_warned_about(
    keys: Keys, caplog: pytest.LogCaptureFixture
) -> None:
    os.chmod(keys.client_sec, 0o644)
    with caplog.at_level(logging.WARNING, logger="ringwire"):
        ringwire.ClientKeys(secret=keys.client_sec, server=keys.server_pub)
    assert any("readable by other users" in r.getMessage() for r in caplog.records)


def test_repr_never_shows_a_secret(keys: Keys) -> None:
    for k in (keys.server, keys.client):
        assert k.secret_key.decode() not in repr(k) and "key_secret" in repr(k)


# -- keygen ------------------------------------------------------------------------------------


def test_keygen_writes_a_pair_0600_and_never_overwrites(tmp_path: Path) -> None:
    d = tmp_path / "new" / "dir"
    public, secret = keygen(d, "node-1")
    assert (public.name, secret.name) == ("node-1.key", "node-1.key_secret")
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert stat.S_IMODE(public.stat().st_mode) == 0o644
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    assert sorted(p.name for p in d.iterdir()) == ["node-1.key", "node-1.key_secret"]  # no temp
    pub, sec = zmq.auth.load_certificate(secret)
    assert zmq.auth.load_certificate(public) == (pub, None) and zmq.curve_public(sec) == pub
    before = (public.read_bytes(), secret.read_bytes())
    with pytest.raises(FileExistsError, match="node-1.key.*--force"):
        keygen(d, "node-1")
    assert (public.read_bytes(), secret.read_bytes()) == before
    secret.unlink()  # half a pair: still refused, the public file kept
    with pytest.raises(FileExistsError, match="node-1.key exists"):
        keygen(d, "node-1")
    assert not secret.exists() and public.read_bytes() == before[0]
    keygen(d, "node-1", force=True)
    assert public.read_bytes() != before[0]
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    for bad in ("", "../x", "a/b", ".hidden", "-x", "x" * 101):
        with pytest.raises(ValueError, match="bad key name"):
            keygen(d, bad)
    with pytest.raises(NotADirectoryError):
        keygen(public, "x")


def test_the_keygen_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = io.StringIO()
    assert cli_main(["keygen", str(tmp_path), "--name", "srv"], out=out) == 0
    assert "srv.key" in out.getvalue() and "srv.key_secret" in out.getvalue()
    z85 = zmq.auth.load_certificate(tmp_path / "srv.key")[0].decode()
    assert z85 in out.getvalue()
    assert cli_main(["keygen", str(tmp_path), "--name", "srv"], out=io.StringIO()) == 1
    assert "exists" in capsys.readouterr().err
    assert cli_main(["keygen", str(tmp_path), "--name", "srv", "--force"], out=out) == 0
    assert cli_main(["keygen", str(tmp_path)], out=io.StringIO()) == 0
    assert (tmp_path / f"{default_name()}.key_secret").exists()  # the host's name
    assert cli_main(["keygen", str(tmp_path), "--name", "../up"], out=io.StringIO()) == 1
    assert "bad key name" in capsys.readouterr().err


# -- floods ------------------------------------------------------------------------------------

GREETING = b"\xff" + bytes(8) + b"\x7f\x03\x00" + b"GARBAGE".ljust(20, b"\x00") + bytes(32)


def _knock(port: int, n: int, threads: int = 1) -> None:
    """``n`` connections to ``port`` that each fail the ZeroMQ handshake (a bogus
    security mechanism), as fast as they go (from ``threads`` threads: a listen queue
    that overflows costs a SYN retransmit, a second); a connect that stalls fails."""
    errors: list[BaseException] = []

    def run(k: int) -> None:
        try:
            for _ in range(k):
                s = socket.create_connection(("127.0.0.1", port), timeout=5)
                with contextlib.suppress(OSError):
                    s.sendall(GREETING)
                s.close()
        except BaseException as exc:
            errors.append(exc)

    ts = [threading.Thread(target=run, args=(n // threads,)) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not errors, errors


def test_a_flood_of_failed_handshakes_stops_nothing(
    keys: Keys, caplog: pytest.LogCaptureFixture
) -> None:
    # libzmq's I/O thread sends monitor events blocking: a monitor pipe nobody reads,
    # filled by failed handshakes, would stop every socket of the process (its default
    # high-water mark is about 2000 events)
    caplog.set_level(logging.WARNING, logger="ringwire")
    with ringwire.SyncListener("tcp://127.0.0.1:0", keys=keys.server, backlog=4096) as sl:
        port = int(sl.path.rsplit(":", 1)[1])
        out: list[ringwire.SyncChannel] = []
        t = threading.Thread(
            target=lambda: out.append(ringwire.connect_sync(sl.path, keys=keys.client))
        )
        t.start()
        server_end = sl.accept(timeout=10)
        t.join(10)
        client = out[0]
        # the rendezvous (its monitor read only inside accept) ...
        _knock(port, 3000)
        # ... and the open connection's own port (its monitor read only when it is used)
        conn_port = int(
            client._core.transport._sock.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1]
        )
        _knock(conn_port, 1200, threads=8)  # (two events each: a failure, a hang-up)
        with client, server_end:
            client.send("still here", timeout=5)
            assert server_end.receive(timeout=5) == "still here"
        with pytest.raises(TimeoutError):
            sl.accept(timeout=0.5)  # takes the refusals: logged in a bounded number of lines
        assert (
            sl.statistics().refused >= 2900
        )  # (a knock cut short can count as no handshake at all)
        assert len(_refusals(caplog)) <= 25 and "a flood" in _refusals(caplog)[-1]


def test_a_keyed_listener_that_cannot_bind_leaves_no_thread(keys: Keys) -> None:
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    try:
        with pytest.raises(OSError, match="cannot listen at tcp://127.0.0.1"):
            ringwire.SyncListener(f"tcp://127.0.0.1:{busy.getsockname()[1]}", keys=keys.server)
    finally:
        busy.close()
    assert not _auth_threads()


def test_the_authenticator_answers_under_a_uvloop_policy(keys: Keys) -> None:
    # pyzmq's ThreadAuthenticator ran its thread on a loop of the global policy: under
    # uvloop.install() it never answered, and every keyed connect hung
    uvloop = pytest.importorskip("uvloop")
    import asyncio

    old = asyncio.get_event_loop_policy()
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    try:
        with ringwire.SyncListener("tcp://127.0.0.1:0", keys=keys.server) as sl:
            with pytest.raises(ringwire.PeerCredentialsError, match="refused this client's"):
                ringwire.connect_sync(sl.path, keys=keys.unlisted, handshake_timeout=5)
            out: list[ringwire.SyncChannel] = []
            t = threading.Thread(
                target=lambda: out.append(
                    ringwire.connect_sync(sl.path, keys=keys.client, handshake_timeout=5)
                )
            )
            t.start()
            with sl.accept(timeout=10) as server_end:
                t.join(10)
                with out[0] as client:
                    client.send("under uvloop", timeout=5)
                    assert server_end.receive(timeout=5) == "under uvloop"
    finally:
        asyncio.set_event_loop_policy(old)
    assert not _auth_threads()
