"""The checks of ``python -m ringwire doctor``: each a pure function of readings.

:class:`Check` (one line of the report) and the checks themselves, by key: segments,
shm (``/dev/shm``), memory_limit (with :func:`memory_limit`, which reads a cgroup
tree), huge_pages, native, torch, cuda, nixl and curve.  Nothing here reads the machine
except :func:`memory_limit` (the cgroup files under the mounts it is given) and
:func:`default_footprint`; :func:`ringwire._doctor.gather` takes the real readings and
calls these, and :mod:`ringwire._doctor` documents the statuses, keys and exit status.
"""

from __future__ import annotations

import mmap
import sys
from dataclasses import dataclass, field
from typing import Any

from ._pool.cgroup import memory_limit
from ._pool.segment import ENV_KIND

__all__ = [
    "SHM_DIR",
    "STATUSES",
    "Check",
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
    "human",
    "memory_limit",
]

SHM_DIR = "/dev/shm"  # where named segments live (ringwire._pool.segment.SHM_DIR)

STATUSES = ("ok", "warn", "fail", "absent")
_KiB, _MiB, _GiB = 1 << 10, 1 << 20, 1 << 30


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
# (the reading itself, :func:`memory_limit`, is ringwire._pool.cgroup's: a memory file's
# SharedMemoryFull names the same limit)


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
