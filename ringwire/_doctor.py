"""``python -m ringwire doctor``: what this machine will use, and what to fix.

Every check is a pure function of *readings* (the text of ``/proc/meminfo``, a
``statvfs`` result, the files of a cgroup tree, what a probe printed...), so the tests
feed it fake ones; :func:`gather` takes the real readings and calls them all.  A
check returns a :class:`Check`: ``status`` is one of

* ``ok``     -- present and usable;
* ``warn``   -- works, but something limits it (the fix says what to change);
* ``fail``   -- broken: what depends on it cannot work;
* ``absent`` -- not installed or not offered here (an optional capability).

The checks, by key (the keys and the four fields ``status``, ``detail``, ``fix``,
``facts`` of ``--json`` are stable; ``facts`` holds the numbers behind ``detail``):

``segments``      the kind of segment this process creates (:func:`segment_kind`): memory
                  files (``memfd``), or named POSIX segments and why (``RINGWIRE_SEGMENTS``
                  set, or no sealed memory files here)
``shm``           ``/dev/shm``: size, free space, how many default connections it holds;
                  informational (``ok``, "not used") when segments are memory files
``memory_limit``  the memory cgroup's limit (v2 ``memory.max``, v1 ``memory.limit_in_bytes``):
                  what memory files (and ``/dev/shm``) are charged to
``huge_pages``    reserved huge pages (``MFD_HUGETLB`` memory files could use them) and
                  transparent huge pages for shared memory (``shmem_enabled``)
``native``        the C ring (``ringwire.native``) or why not
``torch``         torch's version                    (probed in a child process)
``cuda``          CUDA devices, and whether CUDA IPC (Ext 5) can work (same child)
``nixl``          NIXL, its UCX backend and the UCX transports it reaches (a child)
``curve``         pyzmq, libzmq and whether libzmq has CURVE

Exit status (:func:`exit_status`): 1 when a check the *defaults* need fails
(``segments``, ``shm``, ``memory_limit``: a default ``connect()`` would fail) or when a
capability named with ``--need`` is not ``ok``; else 0.  (2: bad usage, from argparse.)
``shm`` fails only for named segments (memory files do not live in ``/dev/shm``);
``memory_limit`` fails only for memory files, when the limit cannot hold one default
connection at all (named segments in ``/dev/shm`` are charged to it too, but then
``/dev/shm``'s size is the limit that speaks first: it only warns).

Nothing here initialises CUDA or UCX in this process: torch and NIXL are probed in
child processes bounded by :data:`PROBE_TIMEOUT` (:mod:`ringwire._probes`: a broken
driver can hang ``cuInit``), so the doctor itself never hangs and stays fork-safe.
:func:`add_command` registers ``doctor`` with ``python -m ringwire`` (:mod:`ringwire._cli`).
"""

from __future__ import annotations

import importlib.util
import json
import mmap
import os
import platform
import shutil
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, TextIO

from . import _probes as probes
from ._errors import SegmentError
from ._pool.segment import ENV_KIND, memfd_supported, segment_kind
from ._pool.segment import memory_limit as memory_file_limit

__all__ = [
    "CHECKS",
    "DEFAULT_CHECKS",
    "NEEDS",
    "PROBE_TIMEOUT",
    "Check",
    "Report",
    "add_command",
    "check_cuda",
    "check_curve",
    "check_huge_pages",
    "check_memory_limit",
    "check_native",
    "check_nixl",
    "check_segments",
    "check_shm",
    "check_torch",
    "default_footprint",
    "exit_status",
    "gather",
    "human",
    "memory_limit",
    "parse_needs",
    "render_json",
    "render_text",
    "segment_kind",
    "unmet",
]

SHM_DIR = "/dev/shm"  # where named segments live (ringwire._pool.segment.SHM_DIR)
PROBE_TIMEOUT = 30.0
"""Seconds a child probe (torch and CUDA; NIXL and UCX) may take before it is killed."""

STATUSES = ("ok", "warn", "fail", "absent")
CHECKS = (
    "segments", "shm", "memory_limit", "huge_pages", "native", "torch", "cuda", "nixl", "curve",
)  # fmt: skip
DEFAULT_CHECKS = ("segments", "shm", "memory_limit")
"""What a default ``connect()`` depends on: one of these failing is exit status 1."""
NEEDS = {
    "native": "native",
    "torch": "torch",
    "cuda": "cuda",
    "nixl": "nixl",
    "curve": "curve",
    "hugepages": "huge_pages",
}
"""``--need`` names and the check each one requires to be ``ok``."""

_KiB, _MiB, _GiB = 1 << 10, 1 << 20, 1 << 30
_UNLIMITED = 1 << 62  # a v1 limit at or above this (PAGE_COUNTER_MAX rounded) is none


@dataclass(frozen=True)
class Check:
    """One line of the report."""

    key: str
    status: str
    detail: str
    fix: str = ""
    facts: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, not {self.status!r}")


@dataclass
class Report:
    """Every check, in :data:`CHECKS` order; the ``--need`` names; ``about``: the
    ringwire and Python versions and the platform."""

    checks: list[Check]
    needs: list[str]
    about: dict[str, str]

    def by_key(self) -> dict[str, Check]:
        return {c.key: c for c in self.checks}


def human(n: int | float) -> str:
    """``n`` bytes, rounded, in the largest unit that keeps a digit before the point."""
    for unit, size in (("GiB", _GiB), ("MiB", _MiB), ("KiB", _KiB)):
        if abs(n) >= size:
            text = f"{n / size:.1f}"
            return f"{text[:-2] if text.endswith('.0') else text} {unit}"
    return f"{int(n)} bytes"


# -- segments ---------------------------------------------------------------------------


def check_segments(
    kind: str | None,
    memfd: str | None,
    posix_ipc_error: str | None,
    requested: str = "",
    error: str | None = None,
    limit: str = "",
) -> Check:
    """``kind``: what :func:`segment_kind` (:func:`ringwire._pool.segment.segment_kind`)
    returned, ``None`` when it raised (``error`` is its message); ``memfd``: ``None``
    where sealed memory files work here, else why not (:func:`_probes.memfd_support`);
    ``posix_ipc_error``: why ``import posix_ipc`` failed (``None``: it imports);
    ``requested``: the ``RINGWIRE_SEGMENTS`` environment variable (``""``: unset);
    ``limit``: words for the limit memory files run into
    (:func:`ringwire._pool.segment.memory_limit`, what a ``SharedMemoryFull`` names)."""
    offered = "available here" if memfd is None else f"not available here: {memfd}"
    facts = {
        "kind": kind, "memfd_available": memfd is None, "memfd_reason": memfd or "",
        "requested": requested, "memory_limit": limit,
    }  # fmt: skip
    if kind is None:
        return Check(
            "segments", "fail", f"no segment kind: {error}",
            f"unset {ENV_KIND} (or set it to memfd, named or auto)", facts,
        )  # fmt: skip
    if kind == "memfd":
        if memfd is not None:
            return Check("segments", "fail", f"memory files, but {offered}",
                         f"unset {ENV_KIND} to use named segments in {SHM_DIR}",
                         facts)  # fmt: skip
        bound = f"; they count against {limit}" if limit else ""
        return Check("segments", "ok", "memory files (memfd_create, sealed, passed over the "
                     f"control socket): no names in {SHM_DIR}, nothing to clean up{bound}",
                     facts=facts)  # fmt: skip
    if posix_ipc_error is not None:
        return Check(
            "segments", "fail",
            f"named POSIX segments, but posix_ipc does not import: {posix_ipc_error}",
            "pip install --force-reinstall posix_ipc (it needs a C compiler where no wheel fits)",
            facts,
        )  # fmt: skip
    if requested.strip().lower() == "named":
        why = f", as {ENV_KIND}={requested} asks (memory files: {offered})"
    elif memfd is not None:
        why = f": memory files are {offered}"
    else:
        why = f" (memory files: {offered})"
    return Check("segments", "ok", f"named POSIX segments in {SHM_DIR}{why}",
                 facts=facts)  # fmt: skip


# -- /dev/shm ----------------------------------------------------------------------------


def _page_round(n: int) -> int:
    return (n + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE


def default_footprint() -> dict[str, Any]:
    """What one ``connect()`` with default settings reserves in ``/dev/shm``, both sides
    together: the connecting side's two ring lanes in one segment, and each side's send
    pool of ``DEFAULT_SLOTS`` (its slot classes plus a release lane)."""
    from . import DEFAULT_CAPACITY, DEFAULT_SLOTS
    from ._wire.ring import ring_size

    rings = _page_round(2 * ring_size(DEFAULT_CAPACITY))
    pool = _page_round(DEFAULT_SLOTS.pool_bytes)
    return {
        "bytes": rings + 2 * pool,
        "rings": rings,
        "pool": pool,
        "pools": 2,
        "slot_classes": DEFAULT_SLOTS.describe(),
    }


def check_shm(stat: Any, footprint: dict[str, Any], kind: str | None = "named") -> Check:
    """``stat``: ``os.statvfs(SHM_DIR)`` (anything with ``f_frsize``, ``f_blocks``,
    ``f_bavail``), or the ``OSError`` it raised; ``footprint``: :func:`default_footprint`;
    ``kind``: the segment kind (memory files do not use ``/dev/shm``: then this check
    only informs, with the numbers; ``None``, no kind, is judged as named)."""
    need = int(footprint["bytes"])
    what = (
        f"a default connection reserves {human(need)} (rings {human(footprint['rings'])} + "
        f"{footprint['pools']} slot pools of {human(footprint['pool'])}: "
        f"{footprint['slot_classes']})"
    )
    if isinstance(stat, OSError):
        if kind == "memfd":
            return Check("shm", "ok", f"not used: memory files ({SHM_DIR} cannot be read: "
                         f"{stat.strerror or stat})", facts={"used": False,
                         "footprint": need})  # fmt: skip
        return Check(
            "shm", "fail", f"{SHM_DIR} cannot be read: {stat.strerror or stat}",
            "mount a tmpfs there: mount -t tmpfs -o size=1g tmpfs /dev/shm "
            "(containers: docker run --shm-size=1g, or --ipc=host)",
            {"used": True, "footprint": need},
        )  # fmt: skip
    size = stat.f_frsize * stat.f_blocks
    free = stat.f_frsize * stat.f_bavail
    fits = free // need if need else 0
    fits_empty = size // need if need else 0
    facts = {"used": kind != "memfd", "size": size, "free": free, "footprint": need,
             "fits": fits, "fits_when_empty": fits_empty}  # fmt: skip
    head = f"{human(size)}, {human(free)} free; {what}"
    if kind == "memfd":
        return Check("shm", "ok", f"not used: memory files; {head}; named segments "
                     f"({ENV_KIND}=named) would have room for {fits}", facts=facts)  # fmt: skip
    fix = (
        "give /dev/shm more room: docker run --shm-size=1g (or --ipc=host); Kubernetes: "
        "an emptyDir with medium: Memory mounted at /dev/shm (sizeLimit: 1Gi); on a host: "
        "mount -o remount,size=1g /dev/shm.  Or make each connection smaller: "
        "connect(..., slots=SlotConfig(classes=(SlotClass(1 << 20, 8),))), "
        "or slots=None (arrays inline)"
    )
    if fits == 0:
        where = (
            f"{SHM_DIR} cannot hold one default connection"
            if fits_empty == 0
            else f"{SHM_DIR} has no room left for a default connection (an empty "
            f"{SHM_DIR} would hold {fits_empty}: `python -m ringwire cleanup` removes "
            f"what dead processes left)"
        )
        return Check("shm", "fail", f"{head}: {where}", fix, facts)
    if fits < 4:
        return Check("shm", "warn", f"{head}: room for {fits} more", fix, facts)
    return Check("shm", "ok", f"{head}: room for {fits} more", facts=facts)


# -- memory cgroup -----------------------------------------------------------------------


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


def check_memory_limit(
    reading: dict[str, Any], footprint: dict[str, Any], kind: str | None = "named"
) -> Check:
    """``reading`` from :func:`memory_limit`; ``kind``: the segment kind.  Shared memory
    is charged to the memory cgroup of the process that first touches it, like any
    memory: for memory files (``kind="memfd"``) this is *the* limit, and one that cannot
    hold a default connection at all fails."""
    limit, usage, version = reading["limit"], reading["usage"], reading["version"]
    facts = dict(reading)
    charged = "; memory files count against the machine's memory" if kind == "memfd" else ""
    if version is None:
        return Check("memory_limit", "ok", f"none (no memory cgroup found){charged}", facts=facts)
    used = "" if usage is None else f", {human(usage)} in use"
    if limit is None:
        return Check("memory_limit", "ok", f"none (cgroup v{version}{used}){charged}", facts=facts)
    detail = f"{human(limit)} (cgroup v{version} {reading['where']}{used})"
    left = limit - (usage or 0)
    need = int(footprint["bytes"])
    if kind == "memfd" and limit < need:
        return Check(
            "memory_limit", "fail",
            f"{detail}: cannot hold one default connection ({human(need)}) in memory files",
            "raise the limit: docker run --memory=..., Kubernetes resources.limits.memory; "
            "or make each connection smaller: slots=SlotConfig(classes=(SlotClass(1 << 20, "
            "8),)), or slots=None (arrays inline)",
            facts,
        )  # fmt: skip
    if left < need:
        return Check(
            "memory_limit", "warn",
            f"{detail}: {human(max(left, 0))} left, less than a default connection "
            f"({human(footprint['bytes'])}); shared memory counts against it",
            "raise the limit: docker run --memory=..., Kubernetes resources.limits.memory",
            facts,
        )  # fmt: skip
    if kind == "memfd":
        detail += "; memory files count against it"
    return Check("memory_limit", "ok", detail, facts=facts)


# -- huge pages ---------------------------------------------------------------------------


def _meminfo(text: str) -> dict[str, int]:
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        words = value.split()
        if words and words[0].isdigit():
            n = int(words[0])
            out[key.strip()] = n * 1024 if len(words) > 1 and words[1] == "kB" else n
    return out


_THP_SHMEM = ("always", "within_size", "advise", "force")
"""``shmem_enabled`` settings under which shared memory (memory files, which live in
the kernel's internal mount that this setting governs) can get transparent huge pages
(``advise``: where ``madvise(MADV_HUGEPAGE)`` asks); ``never`` and ``deny`` cannot."""


def check_huge_pages(meminfo: str, shmem_enabled: str | None) -> Check:
    """``meminfo``: the text of ``/proc/meminfo`` (``HugePages_Total``, ``_Free``: the
    reserved pages ``MFD_HUGETLB`` takes); ``shmem_enabled``: of
    ``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` (``None``: no such file)."""
    info = _meminfo(meminfo)
    total, free = info.get("HugePages_Total", 0), info.get("HugePages_Free", 0)
    size = info.get("Hugepagesize", 0)
    thp = None
    if shmem_enabled is not None:
        words = shmem_enabled.split()
        thp = next((w[1:-1] for w in words if w.startswith("[")), None)
    thp_possible = thp in _THP_SHMEM
    facts = {"reserved": total, "free": free, "page_size": size, "shmem_thp": thp,
             "shmem_thp_possible": thp_possible}  # fmt: skip
    if thp is None:
        thp_text = "no transparent huge pages for shared memory"
    else:
        thp_text = (
            f"transparent huge pages for shared memory (memory files): {thp}, "
            f"{'possible' if thp_possible else 'not possible'}"
        )
    detail = (
        f"{total} reserved ({free} free) of {human(size) if size else '?'} (what "
        f"MFD_HUGETLB memory files would take); {thp_text}; not used by this build"
    )
    usable = free > 0 or thp_possible
    if usable:
        return Check("huge_pages", "ok", detail, facts=facts)
    return Check(
        "huge_pages", "absent", detail,
        "echo advise > /sys/kernel/mm/transparent_hugepage/shmem_enabled (as root), or "
        "reserve pages: sysctl vm.nr_hugepages=<n>",
        facts,
    )  # fmt: skip


# -- the C ring -------------------------------------------------------------------------


def check_native(native: bool, reason: str) -> Check:
    """``native``, ``reason``: :data:`ringwire.native`, :data:`ringwire.native_reason`."""
    facts = {"native": native, "reason": reason}
    if native:
        return Check("native", "ok", "the C ring is built and active", facts=facts)
    if reason.startswith("RINGWIRE_PURE"):
        fix = "unset RINGWIRE_PURE"
    else:
        fix = (
            "install a C compiler and the Python headers (apt-get install gcc python3-dev), "
            "then reinstall ringwire: pip install --force-reinstall --no-deps ringwire "
            "(pip install -e . in a checkout)"
        )
    return Check("native", "warn", f"pure-Python ring (slower): {reason}", fix, facts)


# -- torch and CUDA (a child process) -----------------------------------------------------


def check_torch(probe: dict[str, Any] | None) -> Check:
    """``probe``: what the torch probe printed (``{"version", "cuda_build", "available",
    "devices"}``, or ``{"error"}`` / ``{"timeout"}``); ``None``: torch is not installed."""
    if probe is None:
        return Check("torch", "absent", "not installed (tensors need it; numpy arrays do not)",
                     "pip install torch  (or pip install 'ringwire[torch]')")  # fmt: skip
    if "timeout" in probe:
        return Check("torch", "fail", f"importing torch took more than {probe['timeout']:.0f} s",
                     "check the installation: python -c 'import torch'", dict(probe))  # fmt: skip
    if "error" in probe:
        return Check("torch", "fail", f"installed but does not import: {probe['error']}",
                     "reinstall it: pip install --force-reinstall torch", dict(probe))  # fmt: skip
    cuda = probe.get("cuda_build")
    built = f"built for CUDA {cuda}" if cuda else "CPU-only build"
    return Check("torch", "ok", f"{probe['version']} ({built})", facts=dict(probe))


def check_cuda(probe: dict[str, Any] | None, visible: str | None) -> Check:
    """``probe``: as for :func:`check_torch`; ``visible``: ``CUDA_VISIBLE_DEVICES``."""
    if probe is None or "error" in probe:
        return Check("cuda", "absent", "no torch, so no CUDA tensors",
                     "pip install torch (a CUDA build)")  # fmt: skip
    if "timeout" in probe:
        return Check(
            "cuda", "fail",
            f"torch.cuda did not answer within {probe['timeout']:.0f} s (a driver problem?)",
            "check the driver: nvidia-smi", dict(probe),
        )  # fmt: skip
    devices = probe.get("devices") or []
    facts = {"devices": devices, "ipc": False, "visible": visible}
    if "cuda_error" in probe:
        return Check("cuda", "fail", f"torch.cuda failed: {probe['cuda_error']}",
                     "check the driver: nvidia-smi", facts)  # fmt: skip
    if not probe.get("cuda_build"):
        return Check("cuda", "absent", "torch is a CPU-only build: CUDA tensors travel "
                     "through the host only", "install a CUDA build of torch "
                     "(https://pytorch.org/get-started/locally/)", facts)  # fmt: skip
    if not probe.get("available") or not devices:
        hide = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        return Check("cuda", "absent", f"no CUDA device visible{hide}",
                     "check the driver (nvidia-smi) and CUDA_VISIBLE_DEVICES; containers: "
                     "docker run --gpus all", facts)  # fmt: skip
    ipc = sys.platform.startswith("linux")
    facts["ipc"] = ipc
    names = ", ".join(f"{i}: {name}" for i, name in enumerate(devices))
    if not ipc:
        return Check("cuda", "warn", f"{len(devices)} device(s) ({names}); CUDA IPC needs "
                     "Linux: CUDA tensors are staged through the host", "", facts)  # fmt: skip
    return Check("cuda", "ok", f"{len(devices)} device(s) ({names}); CUDA IPC possible",
                 facts=facts)  # fmt: skip


# -- NIXL and UCX (a child process) -------------------------------------------------------


_RDMA = ("rc", "dc", "ud", "srd", "ib")
"""UCX transport families that are RDMA (``rc_mlx5``, ``dc_mlx5``, ``ud_verbs``, EFA's
``srd``...): the part of a transport's name before ``_``."""


def check_nixl(
    version: str | None, disabled: str | None, probe: dict[str, Any] | None, ucx_tls: str | None
) -> Check:
    """``version``: nixl-cu12's installed version (``None``: not installed);
    ``disabled``: why ringwire will not use it (``RINGWIRE_NIXL=0``) or ``None``;
    ``probe``: what the NIXL probe printed (``{"ucx_backend", "ucx_version",
    "transports"}``, ``{"error"}``, ``{"ucx_error"}`` or ``{"timeout"}``);
    ``ucx_tls``: the ``UCX_TLS`` environment variable."""
    facts: dict[str, Any] = {"version": version, "disabled": disabled or ""}
    if version is None:
        return Check("nixl", "absent", "not installed: tcp:// arrays travel as ZeroMQ frames",
                     "pip install 'ringwire[nixl]'  (nixl-cu12)", facts)  # fmt: skip
    version = f"nixl-cu12 {version}"
    if disabled is not None:
        return Check("nixl", "warn", f"{version} installed, but off: {disabled}",
                     "unset RINGWIRE_NIXL", facts)  # fmt: skip
    probe = probe or {}
    facts.update(probe)
    if "timeout" in probe:
        return Check(
            "nixl",
            "fail",
            f"{version}: creating an agent took more than {probe['timeout']:.0f} s",
            "check UCX: UCX_LOG_LEVEL=info",
            facts,
        )
    if "error" in probe or not probe.get("ucx_backend", False):
        why = probe.get("error", "the UCX backend did not load")
        return Check("nixl", "fail", f"{version}: no agent with the UCX backend: {why}",
                     "pip install --force-reinstall nixl-cu12", facts)  # fmt: skip
    tls = f", UCX_TLS={ucx_tls}" if ucx_tls else ""
    if "ucx_error" in probe:
        return Check("nixl", "warn", f"{version}, UCX agent made; its transports could not "
                     f"be listed: {probe['ucx_error']}{tls}", "", facts)  # fmt: skip
    transports = probe.get("transports") or []
    kinds = sorted({t.split("/")[0] for t in transports})
    rdma = [t for t in transports if t.split("/")[0].split("_")[0] in _RDMA]
    reach = ", ".join(transports) or "none"
    ucx = f"UCX {probe.get('ucx_version', '?')}"
    if not transports:
        return Check("nixl", "fail", f"{version}, {ucx}: no transport reachable{tls}",
                     "unset UCX_TLS or list a transport this host has", facts)  # fmt: skip
    facts["rdma"] = bool(rdma)
    more = "" if rdma else " (no RDMA device: reads go over TCP)"
    return Check("nixl", "ok", f"{version}, {ucx}: {reach}{more}{tls}",
                 facts=facts | {"kinds": kinds})  # fmt: skip


# -- libzmq and CURVE ---------------------------------------------------------------------


def check_curve(pyzmq: str | None, libzmq: str | None, curve: bool) -> Check:
    """``pyzmq``: its version (``None``: not installed); ``libzmq``: ``zmq.zmq_version()``;
    ``curve``: ``zmq.has("curve")``."""
    facts = {"pyzmq": pyzmq, "libzmq": libzmq, "curve": curve}
    if pyzmq is None:
        return Check("curve", "absent", "pyzmq is not installed: no tcp:// addresses",
                     "pip install 'ringwire[net]'  (pyzmq)", facts)  # fmt: skip
    if not curve:
        return Check("curve", "absent", f"pyzmq {pyzmq}, libzmq {libzmq} without CURVE: "
                     "tcp:// works, encrypted tcp:// (keys=) does not",
                     "pip install --force-reinstall pyzmq  (its wheels bundle libzmq with "
                     "CURVE)", facts)  # fmt: skip
    return Check("curve", "ok", f"pyzmq {pyzmq}, libzmq {libzmq} with CURVE", facts=facts)


# -- the whole report -----------------------------------------------------------------------


def exit_status(checks: Iterable[Check], needs: Sequence[str]) -> int:
    """1 when a check the defaults need (:data:`DEFAULT_CHECKS`) fails or a capability
    named in ``needs`` (keys of :data:`NEEDS`) is not ``ok``; else 0."""
    by_key = {c.key: c for c in checks}
    for key in DEFAULT_CHECKS:
        if key in by_key and by_key[key].status == "fail":
            return 1
    for need in needs:
        check = by_key.get(NEEDS[need])
        if check is None or check.status != "ok":
            return 1
    return 0


def unmet(report: Report) -> list[str]:
    """The default checks that fail and the ``--need`` names not met, in that order."""
    by_key = report.by_key()
    out = [k for k in DEFAULT_CHECKS if k in by_key and by_key[k].status == "fail"]
    out += [n for n in report.needs if by_key.get(NEEDS[n], Check(n, "absent", "")).status != "ok"]
    return out


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def _installed(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def gather(
    needs: Sequence[str] = (), timeout: float = PROBE_TIMEOUT,
) -> Report:  # fmt: skip
    """Take every reading on this machine and run every check (the torch and NIXL
    probes run in child processes at once, each killed after ``timeout`` seconds).
    Raises nothing: a reading that fails is a check's ``fail`` or ``absent``."""
    import ringwire

    torch_proc = probes.start(probes.TORCH_PROBE) if importlib.util.find_spec("torch") else None
    nixl_version = _installed("nixl-cu12")
    nixl_disabled = None
    if os.environ.get("RINGWIRE_NIXL", "1").strip().lower() in ("0", "no", "off", "false"):
        nixl_disabled = f"RINGWIRE_NIXL={os.environ['RINGWIRE_NIXL']}"
    nixl_proc = (
        probes.start(probes.NIXL_PROBE)
        if nixl_version is not None and nixl_disabled is None
        else None
    )
    try:
        requested = os.environ.get(ENV_KIND, "")
        kind_error = None
        try:
            kind: str | None = segment_kind()
        except SegmentError as exc:
            kind, kind_error = None, str(exc)
        memfd = None if memfd_supported() else (
            probes.memfd_support() or "ringwire's own sealed memory file failed"
        )  # fmt: skip
        try:
            import posix_ipc  # noqa: F401

            posix_error = None
        except ImportError as exc:
            posix_error = str(exc)
        footprint = default_footprint()
        try:
            stat: Any = os.statvfs(SHM_DIR)
        except OSError as exc:
            stat = exc
        checks = [
            check_segments(kind, memfd, posix_error, requested, kind_error, memory_file_limit()),
            check_shm(stat, footprint, kind),
            check_memory_limit(
                memory_limit(_read("/proc/self/cgroup") or "", _read("/proc/self/mountinfo") or ""),
                footprint,
                kind,
            ),
            check_huge_pages(
                _read("/proc/meminfo") or "",
                _read("/sys/kernel/mm/transparent_hugepage/shmem_enabled"),
            ),
            check_native(ringwire.native, ringwire.native_reason),
        ]
        try:
            import zmq

            checks_zmq = check_curve(zmq.pyzmq_version(), zmq.zmq_version(), bool(zmq.has("curve")))
        except ImportError:
            checks_zmq = check_curve(None, None, False)
        torch_probe = probes.collect(torch_proc, timeout) if torch_proc else None
        checks.append(check_torch(torch_probe))
        checks.append(check_cuda(torch_probe, os.environ.get("CUDA_VISIBLE_DEVICES")))
        nixl_probe = probes.collect(nixl_proc, timeout) if nixl_proc else None
        checks.append(
            check_nixl(nixl_version, nixl_disabled, nixl_probe, os.environ.get("UCX_TLS"))
        )
        checks.append(checks_zmq)
    finally:
        for proc in (torch_proc, nixl_proc):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.communicate()
    about = {
        "ringwire": ringwire.__version__,
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.release()} {platform.machine()}",
    }
    return Report(checks, list(needs), about)


_TITLES = {
    "segments": "segments",
    "shm": SHM_DIR,
    "memory_limit": "memory limit",
    "huge_pages": "huge pages",
    "native": "C ring",
    "torch": "torch",
    "cuda": "CUDA",
    "nixl": "NIXL / UCX",
    "curve": "ZeroMQ CURVE",
}


def render_json(report: Report) -> str:
    """One JSON object: ``about``, ``needs``, ``exit_status``, ``unmet`` and ``checks``
    (key -> ``{"status", "detail", "fix", "facts"}``)."""
    return json.dumps(
        {
            "about": report.about,
            "needs": report.needs,
            "exit_status": exit_status(report.checks, report.needs),
            "unmet": unmet(report),
            "checks": {
                c.key: {"status": c.status, "detail": c.detail, "fix": c.fix, "facts": c.facts}
                for c in report.checks
            },
        },
        indent=2,
    )


def render_text(report: Report, width: int = 100) -> str:
    """One screen: a line per check (status, what, detail), the fix under a problem."""
    import textwrap

    about = report.about
    lines = [f"ringwire {about['ringwire']} on Python {about['python']}, {about['platform']}", ""]
    name_w = max(len(t) for t in _TITLES.values())
    indent = " " * (2 + 6 + 2 + name_w + 2)
    for c in report.checks:
        head = f"  {c.status.upper() if c.status == 'fail' else c.status:<6}  {_TITLES[c.key]:<{name_w}}  "
        body = textwrap.wrap(c.detail, max(width - len(indent), 30), break_on_hyphens=False) or [""]
        lines.append(head + body[0])
        lines.extend(indent + rest for rest in body[1:])
        if c.fix and c.status != "ok":
            fix = textwrap.wrap(
                "fix: " + c.fix, max(width - len(indent), 30), break_on_hyphens=False
            )
            lines.extend(indent + part for part in fix)
    lines.append("")
    missing = unmet(report)
    status = exit_status(report.checks, report.needs)
    if status == 0:
        asked = f"; asked for: {', '.join(report.needs)}" if report.needs else ""
        lines.append(f"result: the defaults work here{asked} (exit status 0)")
    else:
        what = [_TITLES[m] if m in _TITLES else f"--need {m}" for m in missing]
        lines.append(f"result: not usable as asked: {', '.join(what)} (exit status {status})")
    return "\n".join(lines) + "\n"


# -- the command ----------------------------------------------------------------------------


def add_command(sub: Any) -> None:
    """Register ``doctor`` with the ``python -m ringwire`` subcommands ``sub``."""
    d = sub.add_parser(
        "doctor",
        help="what this machine will use (segments, /dev/shm, limits, C ring, torch, CUDA, "
        "NIXL, CURVE) and what to fix",
        description=(
            "Check this machine for ringwire: the segment kind (memory files, or named "
            "segments in /dev/shm and why), /dev/shm's size and free space against what a "
            "default connection reserves (informational with memory files), the memory "
            "cgroup's limit (what memory files count against), huge pages, the C ring, torch and CUDA (devices, IPC), NIXL and the UCX "
            "transports it reaches, libzmq with CURVE; each problem with its fix.  torch "
            "and NIXL are probed in child processes, killed after --timeout seconds.  "
            "Exit status 1 when the defaults cannot work here (no shared memory; named "
            f"segments and {SHM_DIR} cannot hold one default connection; memory files and "
            "the memory limit cannot) or when a capability named "
            "with --need is not ok; else 0: optional capabilities that are absent are "
            "reported, not errors.  2: bad usage."
        ),
    )
    d.add_argument("--json", action="store_true", help="one JSON object (stable keys)")
    d.add_argument(
        "--need",
        action="append",
        default=[],
        metavar="NAME[,NAME...]",
        help=f"exit status 1 unless these are ok: {', '.join(NEEDS)} (repeatable)",
    )
    d.add_argument(
        "--timeout",
        type=float,
        default=PROBE_TIMEOUT,
        help="seconds each child probe (torch, NIXL) may take (default %(default)s)",
    )
    d.set_defaults(func=_command)


def parse_needs(values: Iterable[str]) -> list[str]:
    """``--need`` values (comma-separated, repeatable) as a list of :data:`NEEDS` keys.
    Raises ``ValueError`` naming an unknown one and the known ones."""
    needs: list[str] = []
    for value in values:
        for name in filter(None, (part.strip().lower() for part in value.split(","))):
            if name not in NEEDS:
                raise ValueError(f"unknown --need {name!r}; one of: {', '.join(NEEDS)}")
            if name not in needs:
                needs.append(name)
    return needs


def _command(args: Any, out: TextIO) -> int:
    try:
        needs = parse_needs(args.need)
    except ValueError as exc:
        print(f"ringwire doctor: {exc}", file=sys.stderr)
        return 2
    if not args.timeout > 0:
        print(
            f"ringwire doctor: --timeout must be > 0 seconds, not {args.timeout}", file=sys.stderr
        )
        return 2
    report = gather(needs, timeout=args.timeout)
    if args.json:
        out.write(render_json(report) + "\n")
    else:
        width = shutil.get_terminal_size((100, 24)).columns if out.isatty() else 100
        out.write(render_text(report, width=max(width, 60)))
    return exit_status(report.checks, report.needs)
