"""What ``python -m ringwire inspect`` finds: the scan of ``/proc`` behind it.

Every process's ``maps`` and ``fd`` are parsed for ringwire segments (memory files and
named POSIX segments), grouped by inode into segments, and each segment's header is read
(through a held descriptor, ``map_files`` or ``mem``) to say what it holds: a
connection's rings, a broadcast ring and its readers' cursors, a slot pool, a TCP status
table.  :func:`scan` returns the report as plain data; the rendering and the command
line are in :mod:`ringwire._cli` (``top``'s in :mod:`ringwire._top`), and the
module docstring there says where each piece of information comes from.  Nothing is
written and nothing is mapped.
"""

from __future__ import annotations

import os
import re
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ._net import sockdiag
from ._pool.segment import SHM_DIR, pid_alive, stale_segments
from ._wire import netstatus
from ._wire.broadcast_ring import BROADCAST_WORDS, ENTRY_SIZE, ENTRY_WORDS, MAX_READERS
from ._wire.names import is_memfd_label, is_segment_name, name_pid
from ._wire.ring import HEADER_SIZE, HEADER_WORDS, RING_MAGIC, validate_capacity
from ._wire.slotlayout import (
    FREE,
    LOANED,
    MAX_SLOTS,
    POOL_ENTRY,
    POOL_HEADER,
    POOL_MAGIC,
    POOL_TABLE_OFFSET,
    SENT,
)

__all__ = [
    "PROC",
    "Held",
    "Holder",
    "Mapping",
    "Reader",
    "parse_maps_line",
    "parse_segment_path",
    "scan",
]

PROC = "/proc"
_MAPS_LINE = re.compile(
    r"^(?P<start>[0-9a-f]+)-(?P<end>[0-9a-f]+) \S+ (?P<offset>[0-9a-f]+) "
    r"(?P<dev>\S+) (?P<inode>\d+)\s+(?P<path>.*)$"
)
_DELETED = " (deleted)"
_MEMFD = "/memfd:"  # how a memory file's label shows in maps and descriptor links


@dataclass(frozen=True)
class Mapping:
    """One mapping of a ringwire segment in one process."""

    pid: int
    start: int
    end: int
    offset: int
    dev: str
    inode: int
    name: str  # "/rw.<pid>.<hex>" (named) or "memfd:rw.<pid>.<hex>" (a memory file's label)
    deleted: bool
    kind: str = "named"  # or "memfd"


@dataclass(frozen=True)
class Holder:
    """One descriptor of a ringwire segment held by one process."""

    pid: int
    fd: int
    dev: str
    inode: int
    name: str
    deleted: bool
    kind: str


def parse_segment_path(path: str) -> tuple[str, str, bool] | None:
    """``(name, kind, deleted)`` for the path of a ringwire segment as ``/proc`` shows it
    (a maps line's path, a descriptor's link): ``/dev/shm/rw.<pid>.<hex>[ (deleted)]``
    is ``("/rw.<pid>.<hex>", "named", ...)``, ``/memfd:rw.<pid>.<hex> (deleted)`` is
    ``("memfd:rw.<pid>.<hex>", "memfd", True)``; anything else ``None``."""
    deleted = path.endswith(_DELETED)
    if deleted:
        path = path[: -len(_DELETED)]
    if path.startswith(SHM_DIR + "/"):
        name = path[len(SHM_DIR) :]
        return (name, "named", deleted) if is_segment_name(name) else None
    if path.startswith(_MEMFD):
        label = path[1:]
        return (label, "memfd", True) if is_memfd_label(label) else None
    return None


def parse_maps_line(pid: int, line: str) -> Mapping | None:
    """A ``/proc/<pid>/maps`` line that maps a ringwire segment (named or a memory
    file), else ``None``."""
    m = _MAPS_LINE.match(line.rstrip("\n"))
    if m is None:
        return None
    found = parse_segment_path(m["path"])
    if found is None:
        return None
    name, kind, deleted = found
    return Mapping(
        pid, int(m["start"], 16), int(m["end"], 16), int(m["offset"], 16), m["dev"],
        int(m["inode"]), name, deleted, kind,
    )  # fmt: skip


def _is_candidate(text: str) -> bool:
    return "/rw." in text or _MEMFD + "rw." in text


def _pids(proc: str) -> list[int]:
    try:
        return sorted(int(e) for e in os.listdir(proc) if e.isdigit())
    except OSError:
        return []


def _mappings(proc: str, pids: Sequence[int]) -> tuple[list[Mapping], list[dict[str, Any]]]:
    """Every ringwire mapping of every readable process; and the processes whose maps
    could not be read (pid, command name, uid, why): a segment only they map is missing
    from the report.

    A process of another uid is left out of the second list unless we are root: ringwire
    connects processes of one uid only (the control socket's peer check, the segments'
    owner check), so such a process holds no segment of ours, and one of its own uid's
    we could not read anyway."""
    found: list[Mapping] = []
    unreadable: list[dict[str, Any]] = []
    me = os.geteuid()
    for pid in pids:
        try:
            with open(f"{proc}/{pid}/maps", encoding="utf-8", errors="replace") as f:
                lines = [line for line in f if _is_candidate(line)]
        except FileNotFoundError:
            continue  # exited meanwhile
        except OSError as exc:
            uid = _uid(proc, pid)
            if me == 0 or uid is None or uid == me:
                why = exc.strerror or type(exc).__name__
                unreadable.append({"pid": pid, "comm": _comm(proc, pid), "uid": uid, "error": why})
            continue
        for line in lines:
            mapping = parse_maps_line(pid, line)
            if mapping is not None:
                found.append(mapping)
    return found, unreadable


def _dev(st_dev: int) -> str:
    """``st_dev`` as ``/proc/<pid>/maps`` writes a device (``%02x:%02x``)."""
    return f"{os.major(st_dev):02x}:{os.minor(st_dev):02x}"


def _descriptors(
    proc: str, pids: Sequence[int], sockets: dict[int, list[int]] | None = None
) -> list[Holder]:
    """Every descriptor of a ringwire segment that a readable process holds (a memory
    file not yet passed on or kept for late joiners; a named segment's kept descriptor).
    A process whose ``fd`` directory cannot be read is skipped: its ``maps`` (read by
    :func:`_mappings`, which names unreadable processes) says the rest.  ``sockets``:
    filled with the socket inodes each process holds (pid -> inodes)."""
    found: list[Holder] = []
    for pid in pids:
        base = f"{proc}/{pid}/fd"
        try:
            fds = os.listdir(base)
        except OSError:
            continue
        for entry in fds:
            if not entry.isdigit():
                continue
            try:
                target = os.readlink(f"{base}/{entry}")
            except OSError:
                continue  # closed meanwhile
            if target.startswith(_SOCKET) and sockets is not None:
                sockets.setdefault(pid, []).append(int(target[len(_SOCKET) : -1]))
                continue
            if not _is_candidate(target):
                continue
            parsed = parse_segment_path(target)
            if parsed is None:
                continue
            try:
                st = os.stat(f"{base}/{entry}")
            except OSError:
                continue
            name, kind, deleted = parsed
            found.append(Holder(pid, int(entry), _dev(st.st_dev), st.st_ino, name, deleted, kind))
    return found


_SOCKET = "socket:["  # a socket descriptor's link: socket:[<inode>]
_ACCEPTCON = 0x10000  # /proc/net/unix Flags of a listening socket (__SO_ACCEPTCON)


def _unix_paths(proc: str) -> dict[int, tuple[bool, str]]:
    """Every Unix socket with a path, from ``/proc/net/unix``: inode -> (listening,
    path).  An accepted socket shows its listener's path; a connecting one none."""
    found: dict[int, tuple[bool, str]] = {}
    try:
        with open(f"{proc}/net/unix", encoding="utf-8", errors="replace") as f:
            next(f, None)  # the header line
            for line in f:
                cols = line.split(None, 7)
                if len(cols) == 8 and cols[6].isdigit() and cols[7].startswith("/"):
                    listening = int(cols[3], 16) & _ACCEPTCON != 0
                    found[int(cols[6])] = (listening, cols[7].rstrip("\n"))
    except (OSError, ValueError):
        pass
    return found


def _listening(
    proc: str, sockets: dict[int, list[int]], pids: Sequence[int]
) -> list[dict[str, Any]]:
    """The Unix sockets that ``pids`` listen on (a :class:`~ringwire.Listener`'s, a
    broadcast's; or any other of theirs: a socket does not say whose it is), each with
    the connections it accepted that the process still holds."""
    paths = _unix_paths(proc)
    out = []
    for pid in pids:
        held = [paths[i] for i in sockets.get(pid, []) if i in paths]
        for path in sorted({p for listening, p in held if listening}):
            accepted = sum(1 for listening, p in held if p == path and not listening)
            out.append({"pid": pid, "path": path, "accepted": accepted})
    return out


def _comm(proc: str, pid: int) -> str | None:
    try:
        with open(f"{proc}/{pid}/comm", encoding="utf-8", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return None


def _uid(proc: str, pid: int) -> int | None:
    """The effective uid of a process (``/proc/<pid>/status``, readable by anybody)."""
    try:
        with open(f"{proc}/{pid}/status", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("Uid:"):
                    return int(line.split()[2])
    except (OSError, ValueError, IndexError):
        pass
    return None


Reader = Callable[[int, int], bytes]


def _fd_reader(fd: int) -> Reader:
    return lambda off, n: os.pread(fd, n, off)


def _open_reader(
    proc: str, maps: Sequence[Mapping], holders: Sequence[Holder] = ()
) -> tuple[Reader, int, Any] | str:
    """A ``read(offset, n)`` over the segment's bytes, its size and a closer; or why
    none of the descriptors and mappings could be read."""
    why = "no mapping or descriptor"
    held = ""  # why no descriptor could be read, if one was tried
    for h in holders:  # a descriptor a process holds: the file itself, whole
        try:
            fd = os.open(f"{proc}/{h.pid}/fd/{h.fd}", os.O_RDONLY)
        except OSError as exc:
            why = held = f"fd: {exc.strerror}; "
            continue
        try:
            size = os.fstat(fd).st_size
        except OSError as exc:
            os.close(fd)
            why = held = f"fd: {exc.strerror}; "
            continue
        return _fd_reader(fd), size, lambda fd=fd: os.close(fd)
    for mp in maps:
        try:  # the mapped file itself
            fd = os.open(f"{proc}/{mp.pid}/map_files/{mp.start:x}-{mp.end:x}", os.O_RDONLY)
        except OSError as exc:
            why = f"{held}map_files: {exc.strerror}"
        else:
            try:
                size = os.fstat(fd).st_size
            except OSError as exc:
                os.close(fd)
                why = f"{held}map_files: {exc.strerror}"
                continue
            return _fd_reader(fd), size, lambda fd=fd: os.close(fd)
        try:  # the process's memory
            fd = os.open(f"{proc}/{mp.pid}/mem", os.O_RDONLY)
        except OSError as exc:
            why = f"{why}; mem: {exc.strerror}"
            continue

        def read_mem(
            off: int, n: int, fd: int = fd, start: int = mp.start, end: int = mp.end,
            base: int = mp.offset,
        ) -> bytes:  # fmt: skip
            lo = start + off - base
            if off < base or lo >= end:
                return b""
            return os.pread(fd, min(n, end - lo), lo)

        try:
            read_mem(mp.offset, 8)
        except OSError as exc:
            os.close(fd)
            why = f"{why}; mem: {exc.strerror}"
            continue
        return read_mem, mp.offset + mp.end - mp.start, lambda fd=fd: os.close(fd)
    return why.rstrip("; ")


def _read_exact(read: Reader, off: int, n: int) -> bytes:
    data = read(off, n)
    if len(data) != n:
        raise ValueError(f"short read at offset {off}")
    return data


def _lane(read: Reader, off: int) -> dict[str, Any]:
    words = struct.unpack("=64Q", _read_exact(read, off, HEADER_SIZE))
    if struct.pack("=Q", words[0])[:6] != RING_MAGIC:
        raise ValueError(f"no ring header at offset {off}")
    capacity = validate_capacity(words[HEADER_WORDS["capacity"]])
    tail, head = words[HEADER_WORDS["tail"]], words[HEADER_WORDS["head"]]
    return {
        "capacity": capacity,
        "fill": tail - head if head <= tail <= head + capacity else None,
        "tail": tail,
        "head": head,
        **{
            flag: words[HEADER_WORDS[flag]] != 0
            for flag in ("reader_parked", "writer_parked", "writer_closed", "reader_closed")
        },
    }


def _read_rings(read: Reader) -> list[dict[str, Any]]:
    first = _lane(read, 0)
    return [first, _lane(read, HEADER_SIZE + first["capacity"])]


def _read_pool(read: Reader, size: int) -> dict[str, Any]:
    magic, pool_id, nslots, data_offset, data_size = POOL_HEADER.unpack(
        _read_exact(read, 0, POOL_HEADER.size)
    )
    if magic[:6] != POOL_MAGIC:
        raise ValueError("bad slot pool magic")
    if not 0 < nslots <= MAX_SLOTS:
        raise ValueError(f"slot pool claims {nslots} slots")
    table = _read_exact(read, POOL_TABLE_OFFSET, nslots * POOL_ENTRY.size)
    by_size: dict[int, dict[str, int]] = {}
    counts = {"free": 0, "loaned": 0, "sent": 0}
    bytes_in_use = 0
    names = {FREE: "free", LOANED: "loaned", SENT: "sent"}
    for _, cap, state, _ in POOL_ENTRY.iter_unpack(table):
        status = names.get(state & 3, "sent")
        row = by_size.setdefault(cap, {"size": cap, "count": 0, "free": 0, "loaned": 0, "sent": 0})
        row["count"] += 1
        row[status] += 1
        counts[status] += 1
        if status != "free":
            bytes_in_use += cap
    release: dict[str, Any] | None = None
    if data_offset + data_size + HEADER_SIZE <= size:
        try:
            release = _lane(read, data_offset + data_size)
        except ValueError:
            release = None
    return {
        "pool_id": f"{pool_id:#018x}",
        "slots": nslots,
        **counts,
        "in_use": counts["loaned"] + counts["sent"],
        "bytes_in_use": bytes_in_use,
        "by_size": [by_size[cap] for cap in sorted(by_size)],
        "releases_pending_bytes": None if release is None else release["fill"],
    }


_BROADCAST_MAGIC = b"RWBCST"  # the first six bytes of word 2 of a broadcast ring's header


def _kind_of(read: Reader) -> str:
    head = read(0, 8 * (BROADCAST_WORDS["broadcast_magic"] + 1))
    magic = head[:6]
    if (
        magic == RING_MAGIC
        and head[8 * BROADCAST_WORDS["broadcast_magic"] :][:6] == _BROADCAST_MAGIC
    ):
        return "broadcast"
    return {RING_MAGIC: "rings", POOL_MAGIC: "slots", netstatus.MAGIC: "tcp"}.get(magic, "unknown")


def _read_broadcast(read: Reader, size: int) -> dict[str, Any]:
    """A broadcast ring's header and the entries of its reader table that are taken
    (:mod:`ringwire._wire.broadcast_ring` draws the layout): per reader its rank, pid,
    head, bytes behind the tail, parked and closed flags."""
    words = struct.unpack("=64Q", _read_exact(read, 0, HEADER_SIZE))
    capacity = validate_capacity(words[BROADCAST_WORDS["capacity"]])
    n, table = words[BROADCAST_WORDS["readers"]], words[BROADCAST_WORDS["table_offset"]]
    if not 1 <= n <= MAX_READERS or table != HEADER_SIZE + capacity:
        raise ValueError(f"broadcast ring claims {n} readers, reader table at {table}")
    if table + n * ENTRY_SIZE > size:
        raise ValueError("the broadcast ring's reader table lies outside the segment")
    tail = words[BROADCAST_WORDS["tail"]]
    raw = _read_exact(read, table, n * ENTRY_SIZE)
    readers = []
    for rank in range(n):
        e = struct.unpack_from(f"={ENTRY_SIZE // 8}Q", raw, rank * ENTRY_SIZE)
        pid = e[ENTRY_WORDS["state"]]
        if pid == 0:
            continue  # a free entry
        head = e[ENTRY_WORDS["head"]]
        readers.append(
            {
                "rank": rank,
                "pid": pid,
                "head": head,
                "start": e[ENTRY_WORDS["start"]],
                "fill": tail - head if head <= tail <= head + capacity else None,
                "parked": e[ENTRY_WORDS["parked"]] != 0,
                "closed": e[ENTRY_WORDS["closed"]] != 0,
            }
        )
    return {
        "capacity": capacity,
        "tail": tail,
        "horizon": words[BROADCAST_WORDS["horizon"]],
        "writer_parked": words[BROADCAST_WORDS["writer_parked"]] != 0,
        "writer_closed": words[BROADCAST_WORDS["writer_closed"]] != 0,
        "reader_entries": n,
        "readers": readers,
    }


def _read_tcp(read: Reader, size: int) -> list[dict[str, Any]]:
    """The open connections of a TCP status table."""
    creator, slots = netstatus.parse(_read_exact(read, 0, min(size, netstatus.SEGMENT_SIZE)))
    now = time.monotonic_ns()
    rows = []
    for v in slots:
        rows.append(
            {
                "pid": creator,
                "side": "server" if v["server"] else "client",
                "address": v["address"],
                "peer": v["peer"] or None,
                "local": v["local"] or None,
                "peer_pid": v["peer_pid"] or None,
                "state": "live" if v["state"] == netstatus.OPEN else "peer gone",
                "in_flight_bytes": max(0, v["sent"] - v["acked"]),
                "send_capacity": v["send_capacity"],
                "inbox_records": v["inbox_records"],
                "inbox_bytes": v["inbox_bytes"],
                "receive_capacity": v["receive_capacity"],
                "array_bytes_out": v["array_bytes_out"],
                "array_budget": v["array_budget"],
                "sent_bytes": v["sent"],
                "consumed_bytes": v["consumed"],
                "heard_s_ago": max(0, now - v["heard_ns"]) / 1e9,
                "message_s_ago": max(0, now - v["heard_ns"]) / 1e9,
                "kernel": None,
                "heartbeat_s": v["heartbeat_ms"] / 1000,
                "open_s": max(0, now - v["opened_ns"]) / 1e9,
            }
        )
    return rows


@dataclass
class _Segment:
    name: str
    kind: str  # "memfd" or "named"
    maps: list[Mapping] = field(default_factory=list)
    holders: list[Holder] = field(default_factory=list)


_SEGMENT_FIELDS = (
    "segment", "segment_kind", "size", "kind", "creator_pid", "creator_alive", "mapped_by",
    "held_by", "unlinked",
)  # fmt: skip
"""The fields of each entry of ``segments`` in the report: every segment found."""


@dataclass(frozen=True)
class Held:
    """A segment whose reader :func:`scan` left open for its caller (``hold=``): the
    report's entry for it, ``read(offset, n)`` over its bytes, and the closer the
    caller must call."""

    entry: dict[str, Any]
    read: Reader
    close: Callable[[], None]


def scan(
    proc: str = PROC,
    shm_dir: str = SHM_DIR,
    pid: int | None = None,
    hold: list[Held] | None = None,
) -> dict[str, Any]:
    """What ``inspect`` reports, as plain data (the ``--json`` output).

    ``pid``: only segments that process maps, holds or created.  ``segments`` lists
    every segment found (``segment_kind``: ``"memfd"`` or ``"named"``; ``kind``: what
    it holds: ``rings``, ``broadcast``, ``slots``, ``tcp``, ``unknown`` or
    ``unreadable``); the sections ``connections``, ``broadcasts``, ``tcp_connections``,
    ``pools`` and ``other_segments`` say what is in them; ``listening``: the Unix
    sockets the processes listed listen on (path, and the connections accepted there
    they still hold: a listener's, a broadcast's readers).  ``hold``: a list to which the
    readers of the connections' and broadcasts' segments are appended, open, instead of
    being closed (``python -m ringwire top`` samples their headers again); the caller
    closes each.  Raises ``OSError`` when ``proc`` is not a Linux ``/proc``.
    """
    if not os.path.isdir(proc) or not os.path.exists(f"{proc}/self"):
        raise OSError(f"{proc} is not available: inspect needs Linux /proc")
    pids_here = _pids(proc)
    maps, unreadable = _mappings(proc, pids_here)
    segments: dict[tuple[str, int, str], _Segment] = {}
    for mp in maps:
        key = (mp.dev, mp.inode, mp.name)
        segments.setdefault(key, _Segment(mp.name, mp.kind)).maps.append(mp)
    sockets: dict[int, list[int]] = {}
    for h in _descriptors(proc, pids_here, sockets):
        key = (h.dev, h.inode, h.name)
        segments.setdefault(key, _Segment(h.name, h.kind)).holders.append(h)

    processes: dict[int, dict[str, Any]] = {}

    def proc_info(p: int) -> dict[str, Any]:
        if p not in processes:
            processes[p] = {"pid": p, "comm": _comm(proc, p), "alive": pid_alive(p)}
        return processes[p]

    connections: list[dict[str, Any]] = []
    broadcasts: list[dict[str, Any]] = []
    tcp: list[dict[str, Any]] = []
    pools: list[dict[str, Any]] = []
    others: list[dict[str, Any]] = []
    listed: list[dict[str, Any]] = []
    mapped_names: dict[str, list[int]] = {}
    for seg in sorted(segments.values(), key=lambda s: (name_pid(s.name), s.name)):
        creator = name_pid(seg.name)
        mapped_by = sorted({m.pid for m in seg.maps})
        held_by = sorted({h.pid for h in seg.holders})
        pids = sorted({*mapped_by, *held_by})
        if pid is not None and pid != creator and pid not in pids:
            continue
        for p in pids:
            proc_info(p)
        entry: dict[str, Any] = {
            "segment": seg.name.lstrip("/"),
            "segment_kind": seg.kind,
            "creator_pid": creator,
            "creator_alive": proc_info(creator)["alive"],
            "unlinked": all(m.deleted for m in seg.maps) and all(h.deleted for h in seg.holders),
            "pids": pids,
            "mapped_by": mapped_by,
            "held_by": held_by,
            "size": None,
            "kind": "unreadable",
            "error": None,
        }
        listed.append(entry)
        if not entry["unlinked"]:
            mapped_names.setdefault(seg.name, []).extend(pids)
        opened = _open_reader(proc, seg.maps, seg.holders)
        if isinstance(opened, str):
            entry["error"] = opened
            others.append(entry)
            continue
        read, size, close = opened
        keep = False
        try:
            entry["size"] = size
            entry["kind"] = _kind_of(read)
            peers = [p for p in pids if p != creator]
            peer = peers[0] if len(peers) == 1 else None
            if entry["kind"] == "rings":
                lanes = _read_rings(read)
                lanes[0].update(writer_pid=creator, reader_pid=peer)
                lanes[1].update(writer_pid=peer, reader_pid=creator)
                entry["lanes"] = lanes
                connections.append(entry)
                keep = hold is not None
            elif entry["kind"] == "broadcast":
                entry["writer_pid"] = creator
                entry.update(_read_broadcast(read, size))
                broadcasts.append(entry)
                keep = hold is not None
            elif entry["kind"] == "slots":
                entry["owner_pid"] = creator
                entry["peer_pids"] = peers
                entry.update(_read_pool(read, size))
                pools.append(entry)
            elif entry["kind"] == "tcp":
                tcp.extend(_read_tcp(read, size))
            else:
                others.append(entry)
        except (OSError, ValueError) as exc:
            entry["kind"] = "unreadable" if isinstance(exc, OSError) else "unknown"
            entry["error"] = str(exc)
            others.append(entry)
        finally:
            if keep and hold is not None:
                hold.append(Held(entry, read, close))
            else:
                close()

    if tcp:  # the kernel's view: queues, and data last received (heartbeats included)
        kernel = sockdiag.connections()
        for t in tcp:
            k = kernel.get((t["local"], t["peer"]))
            if k is not None:
                t["kernel"] = k
                if k["heard_ms"] is not None:
                    t["heard_s_ago"] = min(t["heard_s_ago"], k["heard_ms"] / 1000)

    names = []
    try:
        entries = sorted(os.listdir(shm_dir))
    except OSError:
        entries = []
    stale = set(stale_segments(shm_dir))
    for e in entries:
        name = "/" + e
        if not is_segment_name(name):
            continue
        creator = name_pid(name)
        if pid is not None and pid != creator and pid not in mapped_names.get(name, []):
            continue
        path = os.path.join(shm_dir, e)
        info: dict[str, Any] = {
            "name": e,
            "creator_pid": creator,
            "creator_alive": proc_info(creator)["alive"],
            "stale": name in stale,
            "size": None,
            "uid": None,
            "kind": "unreadable",
            "mapped_by": sorted(set(mapped_names.get(name, []))),
        }
        try:
            st = os.stat(path)
            info["size"], info["uid"] = st.st_size, st.st_uid
            fd = os.open(path, os.O_RDONLY)
            try:
                info["kind"] = _kind_of(_fd_reader(fd))
            finally:
                os.close(fd)
        except OSError:
            pass
        names.append(info)

    return {
        "version": 1,
        "uid": os.geteuid(),
        "connections": connections,
        "broadcasts": broadcasts,
        "listening": _listening(proc, sockets, sorted(processes)),
        "tcp_connections": tcp,
        "pools": pools,
        "other_segments": others,
        "segments": [{k: e[k] for k in _SEGMENT_FIELDS} for e in listed],
        "names": names,
        "processes": [processes[p] for p in sorted(processes)],
        "unreadable_processes": len(unreadable),
        "unreadable": unreadable,
    }
