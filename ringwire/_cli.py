"""``python -m ringwire``: inspect live connections, clean up what dead processes left.

::

    python -m ringwire inspect [--json] [--pid PID] [--plain]
    python -m ringwire top [--once] [--json] [--interval S] [--stall S] [--pid PID]
                                                            (ringwire._top)
    python -m ringwire cleanup [--dry-run] [--json]
    python -m ringwire keygen DIR [--name NAME] [--force]   (CURVE keys: ringwire._net.keys)
    python -m ringwire doctor [--json] [--need NAME,...]    (ringwire._doctor)

Where the information comes from
--------------------------------
A segment is a *memory file* (``memfd_create``, the default on Linux) or a *named*
POSIX segment (``RINGWIRE_SEGMENTS=named``).  A memory file has no name anywhere: it
travels to the peer as a descriptor and is seen only in ``/proc/<pid>/maps`` and
``/proc/<pid>/fd`` as ``/memfd:rw.<pid>.<12 hex> (deleted)`` (its label, carrying the
creator's pid).  A named segment's name is unlinked as soon as both sides attached, so
a *live* connection has no name in ``/dev/shm`` either, and its mappings show as
``/dev/shm/rw.<pid>.<12 hex> (deleted)``.  ``inspect`` scans every process's maps and
descriptors (the descriptors matter: after the handshake only mappings remain, but a
broadcast writer keeps its segments' descriptors for late joiners, a process holds them
during a handshake, and the TCP status table keeps its own), groups what it finds by
inode (one inode = one segment, whatever process maps or holds it), and reads the
segment's header through a descriptor a process holds (``/proc/<pid>/fd/<n>``), else
``/proc/<pid>/map_files/<start>-<end>`` (allowed for root, or with
``CAP_CHECKPOINT_RESTORE``), else ``/proc/<pid>/mem`` (allowed where ptrace is).  A
segment that cannot be read is still listed, with its processes.  Every segment found
is listed with its kind (``memfd`` or ``named``), size, creator and the processes that
map it and that hold a descriptor of it (a Python process holds one for each of its
mappings: ``mmap.mmap`` keeps a duplicate of the descriptor it mapped).  Nothing is written and nothing is mapped: the
reads are ``pread`` s of a few headers.
A process whose ``maps`` cannot be read is named (pid, command, uid, why: the summary
line, a table, ``"unreadable"`` in ``--json``), since a segment only it maps is missing
from the report; one of another uid is not counted unless we are root (ringwire connects
processes of one uid only, so it holds none of our segments).
The scan is :func:`ringwire._inspect.scan` (re-exported here); this module renders
its report and runs the commands.

* A ring segment (magic ``RWRING``) holds a connection's two lanes: the first is
  written by the segment's creator (the connecting side), the second by its peer.
  *Fill* is ``tail - head``: bytes published and not yet consumed.
* A slot pool (magic ``RWPOOL``) belongs to its creator (the producer); the slot table
  says which slots are free, loaned (being filled) or sent (in flight or held by the
  consumer).
* A TCP status table (magic ``RWNETS``, :mod:`ringwire._wire.netstatus`) is one
  process's table of its open TCP connections: peer and local address, state,
  in-flight record bytes (sent, not yet credited by the peer), records received and not
  yet read, bytes of arrays out (sent and not released, or on loan) against the
  budget, and how long ago the peer was last heard from (the kernel's
  ``tcpi_last_data_recv``, heartbeats included, through :mod:`ringwire._net.sockdiag`;
  else ringwire's last message).
* Names still in ``/dev/shm`` are listed with their creator pid (from the name) and
  whether it is alive: a name whose creator is dead is *stale*, and ``cleanup``
  removes it (:func:`ringwire.sweep_segments`; names of live processes are never
  touched).  Memory files need no cleanup: the kernel frees one when the last process
  holding or mapping it is gone, so ``cleanup`` only ever looks in ``/dev/shm``.

Exit status: 0 success; 1 ``cleanup --dry-run`` found stale names (``cleanup`` could
not remove some), or ``/proc`` is unavailable, or ``doctor`` found that the defaults (or
a capability named with ``--need``) cannot work here; 2 bad usage.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from ._doctor import add_command as add_doctor_command
from ._inspect import scan
from ._net.keys import add_command as add_keygen_command
from ._pool.segment import SHM_DIR, pid_alive, stale_segments, sweep
from ._top import add_command as add_top_command
from ._wire.names import name_pid

__all__ = ["main", "scan"]


# -- rendering ------------------------------------------------------------------------------


def _size(n: int | None) -> str:
    if n is None:
        return "?"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            value = n / size
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{n} B"


def _who(report: dict[str, Any], pid: int | None) -> str:
    if pid is None:
        return "?"
    for p in report["processes"]:
        if p["pid"] == pid:
            state = "" if p["alive"] else " (dead)"
            return f"{pid} {p['comm'] or ''}".rstrip() + state
    return f"{pid}{'' if pid_alive(pid) else ' (dead)'}"


def _flags(lane: dict[str, Any]) -> str:
    flags = []
    if lane["writer_closed"]:
        flags.append("writer closed")
    if lane["reader_closed"]:
        flags.append("reader closed")
    if lane["reader_parked"]:
        flags.append("reader parked")
    if lane["writer_parked"]:
        flags.append("writer parked (ring full)")
    return ", ".join(flags)


Section = tuple[str, list[str], list[list[str]]]


def _sections(report: dict[str, Any]) -> list[Section]:
    out: list[Section] = []
    rows: list[list[str]] = []
    for c in report["connections"]:
        for i, lane in enumerate(c["lanes"]):
            fill = lane["fill"]
            pct = "" if fill is None else f" ({100 * fill / lane['capacity']:.1f}%)"
            rows.append(
                [
                    c["segment"] if i == 0 else "",
                    _who(report, c["creator_pid"]) if i == 0 else "",
                    f"{lane['writer_pid'] or '?'} -> {lane['reader_pid'] or '?'}",
                    f"{_size(fill)} / {_size(lane['capacity'])}{pct}",
                    _flags(lane),
                ]
            )
    out.append(("Connections", ["SEGMENT", "CREATED BY", "LANE", "FILL", "STATE"], rows))
    rows = []
    for b in report.get("broadcasts", []):
        head = [
            b["segment"],
            _who(report, b["writer_pid"]),
            f"{len(b['readers'])}/{b['reader_entries']} readers",
            f"{_size(b['tail'])} published, ring {_size(b['capacity'])}",
            ", ".join(
                f for f, on in (("writer closed", b["writer_closed"]),
                                ("writer parked (ring full)", b["writer_parked"])) if on
            ),
        ]  # fmt: skip
        rows.append(head)
        for r in b["readers"]:
            fill = r["fill"]
            pct = "" if fill is None else f" ({100 * fill / b['capacity']:.1f}%)"
            state = ", ".join(
                f for f, on in (("closed", r["closed"]), ("parked", r["parked"])) if on
            )
            rows.append(
                ["", "", f"rank {r['rank']}: {_who(report, r['pid'])}",
                 f"{_size(fill)} unread{pct}", state]
            )  # fmt: skip
    out.append(("Broadcasts", ["SEGMENT", "WRITER", "READER", "FILL", "STATE"], rows))
    rows = [
        [
            _who(report, t["pid"]),
            f"{t['side']} {t['local'] or '?'}",
            f"{t['peer'] or '?'}" + (f" (pid {t['peer_pid']})" if t["peer_pid"] else ""),
            t["state"],
            f"{_size(t['in_flight_bytes'])} / {_size(t['send_capacity'])}",
            f"{t['inbox_records']} ({_size(t['inbox_bytes'])})",
            f"{_size(t['array_bytes_out'])} / {_size(t['array_budget'])}",
            f"{t['heard_s_ago']:.1f} s ago (bound {t['heartbeat_s']:g} s)",
        ]
        for t in report.get("tcp_connections", [])
    ]
    headers = ["PROCESS", "SIDE", "PEER", "STATE", "IN FLIGHT", "UNREAD", "ARRAYS OUT", "HEARD"]
    out.append(("TCP connections", headers, rows))
    rows = []
    for p in report["pools"]:
        sizes = ", ".join(
            f"{r['count'] - r['free']}/{r['count']} x {_size(r['size'])}" for r in p["by_size"]
        )
        rows.append(
            [
                p["segment"],
                _who(report, p["owner_pid"]),
                ", ".join(map(str, p["peer_pids"])) or "-",
                f"{p['in_use']}/{p['slots']}",
                str(p["loaned"]),
                str(p["sent"]),
                _size(p["bytes_in_use"]),
                sizes,
            ]
        )
    out.append(
        (
            "Slot pools",
            ["SEGMENT", "OWNER", "PEERS", "IN USE", "LOANED", "SENT", "BYTES", "BY SIZE (in use)"],
            rows,
        )
    )
    if report.get("listening"):
        rows = [
            [_who(report, x["pid"]), x["path"], str(x["accepted"])] for x in report["listening"]
        ]
        title = "Listening Unix sockets of these processes (a listener's, a broadcast's)"
        out.append((title, ["PROCESS", "PATH", "ACCEPTED"], rows))
    if report["other_segments"]:
        rows = [
            [
                o["segment"],
                o["segment_kind"],
                _who(report, o["creator_pid"]),
                ", ".join(map(str, o["pids"])),
                o["kind"],
                o["error"] or "",
            ]
            for o in report["other_segments"]
        ]
        headers = ["SEGMENT", "KIND", "CREATED BY", "USED BY", "CONTENT", "NOTE"]
        out.append(("Other segments", headers, rows))
    rows = [
        [
            g["segment"],
            g["segment_kind"],
            _size(g["size"]),
            g["kind"],
            _who(report, g["creator_pid"]),
            ", ".join(map(str, g["mapped_by"])) or "-",
            ", ".join(map(str, g["held_by"])) or "-",
        ]
        for g in report.get("segments", [])
    ]
    headers = ["SEGMENT", "KIND", "SIZE", "CONTENT", "CREATED BY", "MAPPED BY", "HELD BY"]
    out.append(("Segments (memory files and named)", headers, rows))
    rows = []
    for n in report["names"]:
        state = (
            "stale: cleanup removes it"
            if n["stale"]
            else "live"
            if n["creator_alive"]
            else "dead creator, other uid"
        )
        rows.append(
            [
                n["name"],
                _who(report, n["creator_pid"]),
                _size(n["size"]),
                n["kind"],
                ", ".join(map(str, n["mapped_by"])) or "-",
                state,
            ]
        )
    out.append(
        (f"Names in {SHM_DIR}", ["NAME", "CREATOR", "SIZE", "CONTENT", "MAPPED BY", "STATE"], rows)
    )
    if report["unreadable"]:
        rows = [
            [
                str(u["pid"]),
                u["comm"] or "?",
                "?" if u["uid"] is None else str(u["uid"]),
                u["error"],
            ]
            for u in report["unreadable"]
        ]
        title = "Processes not readable (a segment only they map is missing above)"
        out.append((title, ["PID", "COMMAND", "UID", "WHY"], rows))
    return out


def _summary(report: dict[str, Any]) -> str:
    def n(count: int, what: str) -> str:
        return f"{count} {what}{'' if count == 1 else 'es' if what.endswith('s') else 's'}"

    stale = sum(1 for x in report["names"] if x["stale"])
    tcp = report.get("tcp_connections")
    bcs = report.get("broadcasts")
    text = (
        f"ringwire on this host: {n(len(report['connections']), 'connection')}, "
        f"{n(len(bcs), 'broadcast') + ', ' if bcs else ''}"
        f"{n(len(tcp), 'TCP connection') + ', ' if tcp else ''}"
        f"{n(len(report['pools']), 'slot pool')}, "
        f"{n(len(report['names']), 'name')} in {SHM_DIR} ({stale} stale)"
    )
    segments = report.get("segments", [])
    if segments:
        memfd = sum(1 for g in segments if g["segment_kind"] == "memfd")
        text += (
            f"; {n(len(segments), 'segment')} in use ({n(memfd, 'memory file')}, "
            f"{len(segments) - memfd} named)"
        )
    unreadable = report["unreadable"]
    if unreadable:
        text += f"; {n(len(unreadable), 'process')} not readable"
        if len(unreadable) <= 3:
            who = (f"pid {u['pid']} {u['comm'] or ''}".rstrip() for u in unreadable)
            text += f" ({', '.join(who)})"
    return text


def render_text(report: dict[str, Any]) -> str:
    """The plain-text tables."""
    lines = [_summary(report)]
    for title, headers, rows in _sections(report):
        lines.append("")
        if not rows:
            lines.append(f"{title}: none")
            continue
        lines.append(f"{title}:")
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
        for row in [headers, *rows]:
            lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    return "\n".join(lines) + "\n"


def render_rich(report: dict[str, Any], file: TextIO) -> None:
    """The same tables with rich (when it is installed and the output is a terminal)."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = Console(file=file, highlight=False)
    console.print(Text(_summary(report)))
    for title, headers, rows in _sections(report):
        if not rows:
            console.print(Text(f"{title}: none", style="dim"))
            continue
        table = Table(title=title, title_justify="left")
        for h in headers:  # a segment's name whole on one line: it is what one copies
            table.add_column(h, no_wrap=h in ("SEGMENT", "NAME"))
        for row in rows:
            table.add_row(*(Text(cell) for cell in row))  # process names are not markup
        console.print(table)


# -- commands -------------------------------------------------------------------------------


def _inspect(args: argparse.Namespace, out: TextIO) -> int:
    try:
        report = scan(pid=args.pid)
    except OSError as exc:
        print(f"ringwire inspect: {exc}", file=sys.stderr)
        return 1
    if args.json:
        json.dump(report, out, indent=2)
        out.write("\n")
        return 0
    if not args.plain and out.isatty():
        try:
            render_rich(report, out)
            return 0
        except ImportError:
            pass
    out.write(render_text(report))
    return 0


_MEMFD_NOTE = (
    "memory files (the default segments, memfd) need no cleanup: the kernel frees each "
    "one when the last process holding or mapping it exits"
)


def _cleanup(args: argparse.Namespace, out: TextIO) -> int:
    stale = stale_segments()
    sizes: dict[str, int | None] = {}
    for name in stale:
        try:
            sizes[name] = os.stat(SHM_DIR + name).st_size
        except OSError:
            sizes[name] = None
    if args.dry_run:
        removed: list[str] = []
        left = stale
    else:
        removed = sweep()
        left = [name for name in stale_segments() if name in stale]
    if args.json:
        json.dump(
            {
                "dry_run": args.dry_run,
                "stale": [n.lstrip("/") for n in stale],
                "removed": [n.lstrip("/") for n in removed],
                "left": [n.lstrip("/") for n in left],
                "memory_files": _MEMFD_NOTE,
            },
            out,
            indent=2,
        )
        out.write("\n")
    else:
        verb = "would remove" if args.dry_run else "removed"
        for name in stale if args.dry_run else removed:
            out.write(
                f"{verb} {name.lstrip('/')} (creator pid {name_pid(name)} is dead, "
                f"{_size(sizes.get(name))})\n"
            )
        if not args.dry_run:
            for name in left:
                out.write(f"could not remove {name.lstrip('/')}\n")
        if not stale:
            out.write(f"nothing to clean up in {SHM_DIR}\n")
        out.write(_MEMFD_NOTE + "\n")
    return 1 if left else 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m ringwire",
        description=(
            "Inspect ringwire connections on this host, watch them live (top); clean up "
            "after dead processes."
        ),
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser(
        "inspect",
        help="live segments and connections: owner pid, alive or dead, ring fill, slots in use",
        description=(
            "List ringwire shared-memory segments mapped or held by processes on this "
            "host -- memory files (memfd) and named segments, whose names are unlinked "
            f"once both sides attached -- and names left in {SHM_DIR}."
        ),
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--plain", action="store_true", help="plain text even on a terminal")
    p.add_argument("--pid", type=int, help="only segments this process maps, holds or created")
    p.set_defaults(func=_inspect)
    add_top_command(sub)
    c = sub.add_parser(
        "cleanup",
        help=f"remove {SHM_DIR} names whose creator process is dead",
        description=(
            f"Remove ringwire names in {SHM_DIR} (ours, rw.<pid>.<hex>) whose creator "
            "process is dead.  Names of live processes are never touched.  Memory files "
            "(the default segments on Linux) need no cleanup: the kernel frees one when "
            "the last process holding it exits; only named segments "
            "(RINGWIRE_SEGMENTS=named) can be left behind.  Exit status 1: "
            "stale names remain (with --dry-run: there are stale names to remove)."
        ),
    )
    c.add_argument("--dry-run", action="store_true", help="list what would be removed")
    c.add_argument("--json", action="store_true", help="machine-readable output")
    c.set_defaults(func=_cleanup)
    add_doctor_command(sub)
    add_keygen_command(sub)
    return parser


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    args = _parser().parse_args(argv)
    result: int = args.func(args, out if out is not None else sys.stdout)
    return result
