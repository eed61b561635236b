"""The memory cgroup limit that applies to this process (v2 ``memory.max``, else v1
``memory.limit_in_bytes``; the smallest of its cgroup and their ancestors).

Memory files are charged to the memory cgroup like any memory, so when one cannot be
reserved :class:`~ringwire.SharedMemoryFull` names this limit
(:func:`ringwire._pool.segment.memory_limit`), and ``python -m ringwire doctor``
reports it.  Pure functions over the text of ``/proc/self/cgroup`` and
``/proc/self/mountinfo`` plus reads of the cgroup files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["memory_limit", "read_memory_limit"]

_UNLIMITED = 1 << 62  # a v1 limit at or above this (PAGE_COUNTER_MAX rounded) is none


def _unescape(path: str) -> str:
    # mountinfo octal-escapes space, tab, newline and backslash
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        path = path.replace(code, char)
    return path


def _cgroup_mounts(mountinfo: str) -> tuple[tuple[str, str] | None, tuple[str, str] | None]:
    """``(root, mount point)`` of the cgroup v2 mount and of the v1 memory mount."""
    v2 = v1 = None
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or not tail:
            continue
        root, point = _unescape(fields[3]), _unescape(fields[4])
        if tail[0] == "cgroup2" and v2 is None:
            v2 = (root, point)
        elif tail[0] == "cgroup" and len(tail) >= 3 and "memory" in tail[2].split(","):
            v1 = (root, point)
    return v2, v1


def _dirs(mount: tuple[str, str], path: str) -> list[Path]:
    """The directories of cgroup ``path`` and of each ancestor, deepest first, under a
    mount of ``mount = (root, point)`` of the hierarchy."""
    root, point = mount
    rel = path
    if root != "/" and (rel == root or rel.startswith(root.rstrip("/") + "/")):
        rel = rel[len(root.rstrip("/")) :]
    parts = [p for p in rel.split("/") if p]
    return [Path(point, *parts[:i]) for i in range(len(parts), -1, -1)]


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return -1
    try:
        return int(text)
    except ValueError:
        return None


def memory_limit(cgroup: str, mountinfo: str) -> dict[str, Any]:
    """The memory limit that applies to this process: the smallest limit of its cgroup
    and their ancestors (v2 ``memory.max``, else v1 ``memory.limit_in_bytes``), with
    that cgroup's usage.  ``cgroup``, ``mountinfo``: the text of ``/proc/self/cgroup``
    and ``/proc/self/mountinfo``.  Returns ``{"version", "limit", "usage", "where"}``
    (``limit`` ``None``: unlimited; ``version`` ``None``: no memory cgroup found)."""
    v2_mount, v1_mount = _cgroup_mounts(mountinfo)
    v2_path = v1_path = None
    for line in cgroup.splitlines():
        hid, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hid == "0" and controllers == "":
            v2_path = path
        elif "memory" in controllers.split(","):
            v1_path = path
    candidates: list[tuple[str, list[Path], str, str]] = []
    if v2_mount is not None and v2_path is not None:
        candidates.append(("2", _dirs(v2_mount, v2_path), "memory.max", "memory.current"))
    if v1_mount is not None and v1_path is not None:
        candidates.append(
            ("1", _dirs(v1_mount, v1_path), "memory.limit_in_bytes", "memory.usage_in_bytes")
        )
    for version, dirs, limit_file, usage_file in candidates:
        limits = [(d, _read_int(d / limit_file)) for d in dirs]
        present = [(d, v) for d, v in limits if v is not None]
        if not present:
            continue  # no memory controller in this hierarchy (a hybrid host's v2)
        bounded = [(d, v) for d, v in present if 0 <= v < _UNLIMITED]
        usage = next((u for d, _ in present if (u := _read_int(d / usage_file)) is not None), None)
        if not bounded:
            return {"version": version, "limit": None, "usage": usage, "where": str(dirs[0])}
        where, limit = min(bounded, key=lambda dv: dv[1])
        usage = _read_int(where / usage_file) if usage is None else usage
        return {"version": version, "limit": limit, "usage": usage, "where": str(where)}
    return {"version": None, "limit": None, "usage": None, "where": ""}




def read_memory_limit() -> dict[str, Any]:
    """:func:`memory_limit` of this process (from ``/proc/self``)."""
    try:
        with open("/proc/self/cgroup") as f:
            cgroup = f.read()
        with open("/proc/self/mountinfo") as f:
            mountinfo = f.read()
    except OSError:
        return {"version": None, "limit": None, "usage": None, "where": ""}
    return memory_limit(cgroup, mountinfo)
