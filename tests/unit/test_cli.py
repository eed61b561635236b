"""``python -m ringwire inspect | cleanup``: the pieces, in this process (the command
itself, in subprocesses, is in tests/process/test_cli.py)."""

from __future__ import annotations

import io
import json
import os

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
