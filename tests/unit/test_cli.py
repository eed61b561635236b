"""``python -m ringwire inspect | cleanup``: the pieces, in this process (the command
itself, in subprocesses, is in tests/process/test_cli.py)."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

import pytest

from ringwire import _cli, _inspect
from ringwire._pool.segment import SHM_DIR, Segment, memfd_supported

# -- pieces, in process --------------------------------------------------------------------


def test_parse_maps_line() -> None:
    line = (
        "7f4f4e18c000-7f4f4e18e000 rw-s 00000000 00:1b 16539                      "
        "/dev/shm/rw.985.4478dd5c8521 (deleted)\n"
    )
    m = _inspect.parse_maps_line(42, line)
    assert m is not None
    assert (m.pid, m.start, m.end, m.offset) == (42, 0x7F4F4E18C000, 0x7F4F4E18E000, 0)
    assert (m.inode, m.name, m.deleted, m.kind) == (16539, "/rw.985.4478dd5c8521", True, "named")
    named = _inspect.parse_maps_line(1, line.replace(" (deleted)", ""))
    assert named is not None and not named.deleted
    memfd = _inspect.parse_maps_line(
        7, "7f4f4e18c000-7f4f4e18e000 rw-s 00000000 00:01 2051 /memfd:rw.985.4478dd5c8521 (deleted)"
    )
    assert memfd is not None
    assert (memfd.name, memfd.kind, memfd.deleted) == ("memfd:rw.985.4478dd5c8521", "memfd", True)
    assert (memfd.dev, memfd.inode) == ("00:01", 2051)
    for other in (
        "7f4f4e18c000-7f4f4e18e000 r--p 00000000 08:01 1234 /usr/lib/libc.so.6",
        "7f4f4e18c000-7f4f4e18e000 rw-s 00000000 00:1b 16539 /dev/shm/psm_abc (deleted)",
        "7f4f4e18c000-7f4f4e18e000 rw-s 00000000 00:1b 16539 /dev/shm/rw.1.xyz",
        "7f4f4e18c000-7f4f4e18e000 rw-s 00000000 00:01 2051 /memfd:rw-fake-cuda (deleted)",
        "7f4f4e18c000-7f4f4e18e000 rw-s 00000000 00:01 2051 /memfd:rw.1.xyz (deleted)",
        "7ffd1b5e2000-7ffd1b603000 rw-p 00000000 00:00 0                          [stack]",
        "garbage",
    ):
        assert _inspect.parse_maps_line(1, other) is None, other
    # a descriptor's link says the same as a maps line's path
    assert _inspect.parse_segment_path("/memfd:rw.985.4478dd5c8521 (deleted)") == (
        "memfd:rw.985.4478dd5c8521", "memfd", True,
    )  # fmt: skip
    assert _inspect.parse_segment_path("/dev/shm/rw.985.4478dd5c8521") == (
        "/rw.985.4478dd5c8521", "named", False,
    )  # fmt: skip
    assert _inspect.parse_segment_path("socket:[12345]") is None


def _inspect_me() -> tuple[dict[str, Any], str]:
    buf = io.StringIO()
    assert _cli.main(["inspect", "--json", "--pid", str(os.getpid())], out=buf) == 0
    report = json.loads(buf.getvalue())
    buf = io.StringIO()
    assert _cli.main(["inspect", "--pid", str(os.getpid())], out=buf) == 0
    return report, buf.getvalue()


def _row(text: str, title: str, label: str) -> list[str]:
    """The words of ``label``'s row in the table ``title`` of inspect's text."""
    table = text[text.index(title + ":") :].split("\n\n")[0]
    [row] = [line.split() for line in table.splitlines() if line.strip().startswith(label)]
    return row


SEGMENTS = "Segments (memory files and named)"


@pytest.mark.parametrize("kind", ["memfd", "named"])
def test_inspect_in_process_and_renderers(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if kind == "memfd" and not memfd_supported():
        pytest.skip("no sealed memory files here")
    monkeypatch.setenv("RINGWIRE_SEGMENTS", kind)
    seg = Segment.create(4096)  # a segment that is not a ring or a pool (yet)
    assert seg.kind == kind
    me = os.getpid()
    label = seg.name.lstrip("/")  # "rw.<pid>.<hex>" or "memfd:rw.<pid>.<hex>"
    try:
        report, text = _inspect_me()
        # (segments an earlier test of this process still maps -- a view kept alive by
        # a traceback, say -- are theirs, not this test's)
        [other] = [g for g in report["other_segments"] if g["segment"] == label]
        assert other["kind"] == "unknown"
        assert other["segment_kind"] == kind and other["size"] == 4096
        assert other["creator_pid"] == me and other["pids"] == [me]
        # (Python's mmap keeps a descriptor of what it maps: both kinds are held too)
        assert other["mapped_by"] == other["held_by"] == [me]
        assert other["unlinked"] is (kind == "memfd")
        # This process's TCP status table (ringwire._net.status) lives as long as the
        # process: an earlier test's TCP connection leaves one, of the kind that was the
        # default then (RINGWIRE_SEGMENTS).  It is ours, and counted below.
        tables = [g for g in report["segments"] if g["kind"] == "tcp"]
        assert all(t["creator_pid"] == me and t["unlinked"] for t in tables), tables
        [listed] = [g for g in report["segments"] if g["segment"] == label]
        assert listed == {k: other[k] for k in listed}
        names = 1 if kind == "named" else 0
        assert text.startswith(
            f"ringwire on this host: 0 connections, 0 slot pools, {names} name"
        ), text
        in_use = 1 + len(tables)
        memfds = (kind == "memfd") + sum(t["segment_kind"] == "memfd" for t in tables)
        plural = "" if in_use == 1 else "s"
        assert f"{in_use} segment{plural} in use ({memfds} memory file" in text.splitlines()[0]
        assert "Other segments:" in text and label in text
        row = _row(text, "Other segments", label)
        assert row[:3] == [label, kind, str(me)], row
        row = _row(text, SEGMENTS, label)
        assert row[:5] == [label, kind, "4", "KiB", "unknown"], row
        assert row[-2:] == [str(me), str(me)], row  # MAPPED BY, HELD BY
        if kind == "named":
            assert "live" in text and f"Names in {SHM_DIR}:" in text
            [name] = report["names"]
            assert name["name"] == label and name["mapped_by"] == [me]
        else:
            assert report["names"] == [] and f"Names in {SHM_DIR}: none" in text
        pytest.importorskip("rich")
        buf = io.StringIO()
        _cli.render_rich(report, buf)
        assert label in buf.getvalue()
    finally:
        seg.unlink()
        seg.close()


def _map_without_a_descriptor(fd: int, size: int) -> tuple[Any, int]:
    """Map ``fd`` with libc's ``mmap`` (Python's ``mmap`` keeps a descriptor of what it
    maps, a process written in C need not): ``(libc, address)``."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]  # fmt: skip
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    addr = libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap")
    return libc, addr


def test_inspect_finds_a_memory_file_by_its_descriptor_or_its_mapping_alone() -> None:
    """After a handshake a process written in C holds only mappings (the descriptors are
    closed); a broadcast writer keeps descriptors for late joiners, and a handshake holds
    one before the peer maps it.  Either alone is enough to find the segment and read its
    size and content."""
    if not memfd_supported():
        pytest.skip("no sealed memory files here")
    me = os.getpid()
    mapped = Segment.create(8192, kind="memfd")
    unmapped = Segment.create(3 * 4096, kind="memfd")
    held = os.dup(unmapped.fd)
    libc, addr = _map_without_a_descriptor(mapped.fd, 8192)
    try:
        mapped.close()  # only libc's mapping is left
        unmapped.close()  # only a descriptor (our dup) is left
        report, text = _inspect_me()
        segments = {g["segment"]: g for g in report["segments"]}
        m, u = segments[mapped.name], segments[unmapped.name]
        assert (m["mapped_by"], m["held_by"], m["size"]) == ([me], [], 8192)
        assert (u["mapped_by"], u["held_by"], u["size"]) == ([], [me], 3 * 4096)
        for g in (m, u):  # read (through /proc/<pid>/mem, through the descriptor): zeros
            assert (g["segment_kind"], g["kind"], g["creator_pid"]) == ("memfd", "unknown", me)
        assert _row(text, SEGMENTS, mapped.name)[-2:] == [str(me), "-"]  # mapped, not held
        assert _row(text, SEGMENTS, unmapped.name)[-2:] == ["-", str(me)]  # the other way
    finally:
        os.close(held)
        libc.munmap(addr, 8192)
    after, _ = _inspect_me()
    assert not [g for g in after["segments"] if g["segment"] in (mapped.name, unmapped.name)]


def _fake_proc(root: Path, pid: int, comm: str, uid: int, *, readable: bool) -> None:
    d = root / str(pid)
    d.mkdir()
    (d / "comm").write_text(comm + "\n")
    (d / "status").write_text(f"Name:\t{comm}\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n")
    if readable:
        (d / "maps").write_text("7ffd1b5e2000-7ffd1b603000 rw-p 00000000 00:00 0   [stack]\n")
    else:
        (d / "maps").mkdir()  # open() fails with an OSError other than FileNotFoundError


def test_inspect_names_the_processes_it_cannot_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 14 item 9: "1 process not readable (permission)", and never which one.  The
    unreadable process is named (pid, command, uid, why) in the summary, in a table and
    in --json; one of another uid is not counted unless we are root (it cannot share a
    ringwire connection with us)."""
    proc, shm = tmp_path / "proc", tmp_path / "shm"
    proc.mkdir()
    shm.mkdir()
    (proc / "self").mkdir()
    _fake_proc(proc, 7, "fine", 1000, readable=True)
    _fake_proc(proc, 4242, "secretd", 1000, readable=False)
    _fake_proc(proc, 4343, "someone-else", 1001, readable=False)

    monkeypatch.setattr(os, "geteuid", lambda: 1000)  # not root: another uid's is not counted
    report = _cli.scan(proc=str(proc), shm_dir=str(shm))
    assert report["unreadable_processes"] == 1
    [u] = report["unreadable"]
    assert u["pid"] == 4242 and u["comm"] == "secretd" and u["uid"] == 1000 and u["error"]
    json.dumps(report)  # the --json output
    text = _cli.render_text(report)
    first, *rest = text.splitlines()
    assert first.endswith("; 1 process not readable (pid 4242 secretd)"), first
    assert "Processes not readable" in text
    [row] = [line for line in rest if line.strip().startswith("4242")]
    assert row.split()[:3] == ["4242", "secretd", "1000"], row

    monkeypatch.setattr(os, "geteuid", lambda: 0)  # root: every unreadable process counts
    report = _cli.scan(proc=str(proc), shm_dir=str(shm))
    assert [u["pid"] for u in report["unreadable"]] == [4242, 4343]
    assert "2 processes not readable (pid 4242 secretd, pid 4343 someone-else)" in (
        _cli.render_text(report)
    )

    (proc / "4242" / "maps").rmdir()  # everything readable: nothing said at all
    (proc / "4343" / "maps").rmdir()
    report = _cli.scan(proc=str(proc), shm_dir=str(shm))
    assert report["unreadable"] == [] and report["unreadable_processes"] == 0
    assert "not readable" not in _cli.render_text(report)


def test_inspect_on_this_host_names_every_process_it_counts() -> None:
    """On the real /proc (where, in a container, pid 1 is often unreadable even to root):
    the count in --json is the length of the named list, and the text names them."""
    buf = io.StringIO()
    assert _cli.main(["inspect", "--json"], out=buf) == 0
    report = json.loads(buf.getvalue())
    assert report["unreadable_processes"] == len(report["unreadable"])
    assert all({"pid", "comm", "uid", "error"} <= set(u) for u in report["unreadable"])
    first = _cli.render_text(report).splitlines()[0]
    if 0 < len(report["unreadable"]) <= 3:
        assert all(f"pid {u['pid']}" in first for u in report["unreadable"]), first
    assert "(permission)" not in first


# -- TCP connections (their status table) ----------------------------------------------------


def test_inspect_lists_tcp_connections_and_forgets_closed_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("zmq")
    monkeypatch.setenv("RINGWIRE_NIXL", "0")  # the array as a ZeroMQ frame: its bytes out
    import anyio
    import numpy as np

    import ringwire
    from ringwire._net import sockdiag
    from ringwire._wire import netstatus

    def ours(report: dict[str, Any]) -> list[dict[str, Any]]:
        return [t for t in report["tcp_connections"] if t["pid"] == os.getpid()]

    async def main() -> None:
        cfg = ringwire.SlotConfig(classes=(ringwire.SlotClass(1 << 20, 4),), threshold=1024)
        async with ringwire.listen("tcp://127.0.0.1:0", slots=cfg) as listener:
            client = await ringwire.connect(listener.path, slots=cfg, heartbeat=2.0)
            server = await listener.accept()
            await client.send({"n": 1})
            assert await server.receive() == {"n": 1}
            big = np.ones(100_000, np.uint8)  # out: an array beside the record
            await client.send({"big": big})
            await client.send({"n": 3})
            await anyio.sleep(0.2)  # both arrive ...
            got = await server.receive()  # ... the server pulls both, reads one (held)
            assert got["big"].nbytes == 100_000
            await server.send("pong")  # the client hears from the server
            assert await client.receive() == "pong"
            report = _cli.scan(pid=os.getpid())
            rows = {t["side"]: t for t in ours(report)}
            assert set(rows) == {"client", "server"}, report["tcp_connections"]
            c, s = rows["client"], rows["server"]
            # each side's peer address is the other's local address
            assert c["peer"] == s["local"] and s["peer"] == c["local"]
            assert c["peer"].startswith("127.0.0.1:") and c["address"] == listener.path
            assert c["state"] == s["state"] == "live"
            assert c["peer_pid"] == s["peer_pid"] == os.getpid()
            assert c["in_flight_bytes"] > 0  # sent, not yet credited (the server has not read)
            assert c["array_bytes_out"] == 100_000 and c["array_budget"] == 4 << 20
            # (as of the pull that took both in: the row is written when records arrive)
            assert s["inbox_records"] == 2 and s["inbox_bytes"] > 0
            assert c["heartbeat_s"] == 2.0 and 0 <= c["heard_s_ago"] < 5
            assert c["heard_s_ago"] <= c["message_s_ago"]
            if sockdiag.connections():  # netlink sock_diag here: the kernel's view too
                assert c["kernel"]["tcp_state"] == s["kernel"]["tcp_state"] == "established"
                assert c["kernel"]["heard_ms"] is not None
            text = _cli.render_text(report)
            assert "TCP connections:" in text and c["peer"] in text
            assert "TCP connection" in text.splitlines()[0]
            json.dumps(report)  # --json works
            assert await server.receive() == {"n": 3}
            del got
            await client.aclose()
            await server.aclose()
            assert ours(_cli.scan(pid=os.getpid())) == []  # closed: the rows are gone
        assert netstatus.MAGIC == b"RWNETS"

    anyio.run(main)


def test_the_tcp_status_table_layout_is_checked() -> None:
    from ringwire._wire import netstatus as N

    table = bytearray(N.SEGMENT_SIZE)
    N.HEADER.pack_into(table, 0, N.MAGIC + b"\0\0", N.VERSION, N.NSLOTS, 1234)
    assert N.parse(bytes(table)) == (1234, [])
    base = N.HEADER_SIZE + 3 * N.SLOT_SIZE
    import struct

    struct.pack_into("=Q", table, base + 8 * N.word("state"), N.OPEN)
    struct.pack_into("=Q", table, base + 8 * N.word("sent"), 99)
    off, _ = N.string_offsets()["peer"]
    table[base + off : base + off + 12] = b"10.0.0.5:123"
    pid, rows = N.parse(bytes(table))
    assert pid == 1234 and len(rows) == 1
    assert rows[0]["slot"] == 3 and rows[0]["sent"] == 99 and rows[0]["peer"] == "10.0.0.5:123"
    with pytest.raises(ValueError, match="magic"):
        N.parse(bytes(N.SEGMENT_SIZE))
    bad = bytearray(table)
    N.HEADER.pack_into(bad, 0, N.MAGIC + b"\0\0", N.VERSION, 10_000, 1234)
    with pytest.raises(ValueError, match="claims 10000 slots"):
        N.parse(bytes(bad))
    with pytest.raises(ValueError, match="version"):
        N.HEADER.pack_into(bad, 0, N.MAGIC + b"\0\0", 99, 1, 1234)
        N.parse(bytes(bad))


def test_sock_diag_messages_are_parsed() -> None:
    import socket
    import struct

    from ringwire._net import sockdiag

    msg = bytearray(72)
    msg[0], msg[1] = socket.AF_INET, 1  # established
    struct.pack_into(">HH", msg, 4, 7100, 41234)
    msg[8:12] = socket.inet_aton("10.0.0.1")
    msg[24:28] = socket.inet_aton("10.0.0.5")
    struct.pack_into("=IIII", msg, 56, 3, 7, 0, 99)
    info = bytearray(60)
    struct.pack_into("=I", info, 52, 250)  # tcpi_last_data_recv
    attr = struct.pack("=HH", 4 + len(info), 2) + bytes(info)
    key, row = sockdiag._parse(socket.AF_INET, bytes(msg) + attr)  # type: ignore[misc]
    assert key == ("10.0.0.1:7100", "10.0.0.5:41234")
    assert row == {
        "tcp_state": "established", "recv_queue": 3, "send_queue": 7, "heard_ms": 250,
        "inode": 99,
    }  # fmt: skip
    assert sockdiag._parse(socket.AF_INET, bytes(10)) is None
    assert isinstance(sockdiag.connections(), dict)  # never raises (empty without netlink)


def test_a_status_row_ignores_a_descriptor_that_is_no_longer_tcp() -> None:
    # libzmq may close a connection's descriptor (an oversized message) before the
    # listener fills its row, and the number may name another socket by then: nothing
    # is written to the row (addresses of a TCP descriptor are, and stay), and the
    # connection is not harmed (it once was: IndexError)
    pytest.importorskip("zmq")
    import socket

    from ringwire._net import status
    from ringwire._wire import netstatus as N

    taken = status._take()
    if taken is None:
        pytest.skip("no shared memory for the status table here")
    table, index = taken
    row = status.Slot(taken)

    def strings() -> tuple[str, str]:
        rows = [r for r in N.parse(bytes(table.seg.buf))[1] if r["slot"] == index]
        assert len(rows) == 1
        return rows[0]["peer"], rows[0]["local"]

    try:
        row.set(state=N.OPEN)
        with socket.create_server(("127.0.0.1", 0)) as srv:
            c = socket.create_connection(srv.getsockname())
            s, _ = srv.accept()
            with c, s:
                row.endpoints(s.fileno())  # a TCP descriptor: both addresses written
                seen = strings()
                assert seen == (
                    f"127.0.0.1:{c.getsockname()[1]}",
                    f"127.0.0.1:{srv.getsockname()[1]}",
                )
        a, b = socket.socketpair()
        with a, b:
            row.endpoints(a.fileno())  # an AF_UNIX socket: no error, nothing written
            assert strings() == seen
            row.endpoints(1 << 20)  # no such descriptor
            assert strings() == seen
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
            u.connect(("127.0.0.1", 9))  # a connected UDP socket has both addresses too
            row.endpoints(u.fileno())  # ...but is no TCP connection: nothing written
            assert strings() == seen
    finally:
        row.close()


def test_a_broadcast_ring_is_told_from_a_connection_and_its_readers_are_read() -> None:
    from ringwire._wire.broadcast_ring import (
        BroadcastReader,
        BroadcastWriter,
        broadcast_ring_size,
        init_broadcast_ring,
    )

    cap = 4096
    buf = bytearray(broadcast_ring_size(cap, 3))
    init_broadcast_ring(buf, 0, cap, 3)
    w = BroadcastWriter(buf)
    w.admit(0, 111)
    w.admit(2, 333)
    for n in (10, 20, 30):
        assert w.try_write(b"s" * n)
    r = BroadcastReader(buf, 2)
    assert r.next_frame() is not None
    r.commit()

    def read(off: int, n: int) -> bytes:
        return bytes(buf[off : off + n])

    assert _inspect._kind_of(read) == "broadcast"
    got = _inspect._read_broadcast(read, len(buf))
    tail = w.position
    assert (got["capacity"], got["tail"], got["reader_entries"]) == (cap, tail, 3)
    assert not got["writer_parked"] and not got["writer_closed"]
    by_rank = {x["rank"]: x for x in got["readers"]}
    assert sorted(by_rank) == [0, 2]  # rank 1's entry is free
    assert (by_rank[0]["pid"], by_rank[0]["head"], by_rank[0]["fill"]) == (111, 0, tail)
    assert (by_rank[2]["pid"], by_rank[2]["fill"]) == (333, tail - by_rank[2]["head"])
    assert 0 < by_rank[2]["head"] < tail
    with pytest.raises(ValueError, match="outside the segment"):
        _inspect._read_broadcast(read, len(buf) - 1)
    w.release()
    r.release()
