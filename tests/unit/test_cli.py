"""``python -m ringwire inspect | cleanup``: the pieces, in this process (the command
itself, in subprocesses, is in tests/process/test_cli.py)."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest

from ringwire import _cli
from ringwire._shm.segment import Segment

# -- pieces, in process --------------------------------------------------------------------


def test_parse_maps_line() -> None:
    line = (
        "7f4f4e18c000-7f4f4e18e000 rw-s 00000000 00:1b 16539                      "
        "/dev/shm/rw.985.4478dd5c8521 (deleted)\n"
    )
    m = _cli.parse_maps_line(42, line)
    assert m is not None
    assert (m.pid, m.start, m.end, m.offset) == (42, 0x7F4F4E18C000, 0x7F4F4E18E000, 0)
    assert (m.inode, m.name, m.deleted) == (16539, "/rw.985.4478dd5c8521", True)
    named = _cli.parse_maps_line(1, line.replace(" (deleted)", ""))
    assert named is not None and not named.deleted
    for other in (
        "7f4f4e18c000-7f4f4e18e000 r--p 00000000 08:01 1234 /usr/lib/libc.so.6",
        "7f4f4e18c000-7f4f4e18e000 rw-s 00000000 00:1b 16539 /dev/shm/psm_abc (deleted)",
        "7f4f4e18c000-7f4f4e18e000 rw-s 00000000 00:1b 16539 /dev/shm/rw.1.xyz",
        "7ffd1b5e2000-7ffd1b603000 rw-p 00000000 00:00 0                          [stack]",
        "garbage",
    ):
        assert _cli.parse_maps_line(1, other) is None, other


def test_inspect_in_process_and_renderers() -> None:
    seg = Segment.create(4096)  # a named segment that is not a ring or a pool (yet)
    try:
        buf = io.StringIO()
        assert _cli.main(["inspect", "--json", "--pid", str(os.getpid())], out=buf) == 0
        report = json.loads(buf.getvalue())
        [other] = report["other_segments"]
        assert other["segment"] == seg.name[1:] and other["kind"] == "unknown"
        assert not other["unlinked"] and other["pids"] == [os.getpid()]
        buf = io.StringIO()
        assert _cli.main(["inspect", "--pid", str(os.getpid())], out=buf) == 0
        text = buf.getvalue()
        assert text.startswith("ringwire on this host: 0 connections, 0 slot pools, 1 name")
        assert "Other segments:" in text and seg.name[1:] in text and "live" in text
        pytest.importorskip("rich")
        buf = io.StringIO()
        _cli.render_rich(report, buf)
        assert seg.name[1:] in buf.getvalue()
    finally:
        seg.unlink()
        seg.close()


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
