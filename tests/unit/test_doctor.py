"""``python -m ringwire doctor``: every check as a function of fake readings (a fake
``statvfs``, ``/proc/meminfo`` text, cgroup trees in ``tmp_path``, probe answers), the
exit-status rule, ``--need`` parsing and both renderings.  Nothing here starts a
process: the command itself, and the probes for real, are in
tests/process/test_cli.py and tests/process/test_probes.py."""

from __future__ import annotations

import io
import json
import mmap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import ringwire
from ringwire import _cli, _doctor
from ringwire._doctor import Check, Report
from ringwire._errors import SegmentError
from ringwire._pool.segment import memfd_supported
from ringwire._wire.ring import ring_size

MiB, GiB = 1 << 20, 1 << 30
FOOT = _doctor.default_footprint()


def statvfs(size: int, free: int, frsize: int = 4096) -> SimpleNamespace:
    return SimpleNamespace(f_frsize=frsize, f_blocks=size // frsize, f_bavail=free // frsize)


# -- segments --------------------------------------------------------------------------------


def test_the_doctor_reports_the_kind_ringwire_creates(monkeypatch: pytest.MonkeyPatch) -> None:
    # the real choice (ringwire._pool.segment), not a copy of it
    monkeypatch.delenv("RINGWIRE_SEGMENTS", raising=False)
    assert _doctor.segment_kind() == ("memfd" if memfd_supported() else "named")
    monkeypatch.setenv("RINGWIRE_SEGMENTS", "named")
    assert _doctor.segment_kind() == "named"


def test_memory_files_say_what_limits_them() -> None:
    limit = "the memory cgroup's limit (/sys/fs/cgroup/x/memory.max = 1073741824 bytes)"
    c = _doctor.check_segments("memfd", None, None, "", None, limit)
    assert c.status == "ok" and c.detail.startswith("memory files (memfd_create, sealed")
    assert "no names in /dev/shm" in c.detail and f"they count against {limit}" in c.detail
    assert c.facts == {
        "kind": "memfd", "memfd_available": True, "memfd_reason": "", "requested": "",
        "memory_limit": limit,
    }  # fmt: skip


def test_named_segments_say_why() -> None:
    asked = _doctor.check_segments("named", None, None, "named")
    assert asked.status == "ok"
    assert asked.detail.startswith("named POSIX segments in /dev/shm")
    assert "as RINGWIRE_SEGMENTS=named asks (memory files: available here)" in asked.detail
    assert asked.facts["requested"] == "named" and asked.facts["memfd_available"] is True
    none = _doctor.check_segments("named", "os.memfd_create is not available (darwin)", None)
    assert none.status == "ok"
    assert "memory files are not available here: os.memfd_create" in none.detail
    assert none.facts["memfd_available"] is False


def test_a_bad_segments_setting_fails_the_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RINGWIRE_SEGMENTS", "ramdisk")
    with pytest.raises(SegmentError) as raised:
        _doctor.segment_kind()
    c = _doctor.check_segments(None, None, None, "ramdisk", str(raised.value))
    assert c.status == "fail" and "'ramdisk' is not a segment kind" in c.detail
    assert "unset RINGWIRE_SEGMENTS" in c.fix
    assert _doctor.exit_status([c], []) == 1


def test_no_posix_ipc_is_a_failure_of_the_defaults() -> None:
    c = _doctor.check_segments("named", None, "No module named 'posix_ipc'")
    assert c.status == "fail"
    assert "posix_ipc" in c.detail and "pip install" in c.fix
    assert _doctor.exit_status([c], []) == 1


def test_memfd_kind_fails_only_where_the_kernel_lacks_it() -> None:
    assert _doctor.check_segments("memfd", None, None).status == "ok"
    assert _doctor.check_segments("memfd", "no sealing", "gone").status == "fail"


# -- /dev/shm ----------------------------------------------------------------------------------


def test_the_default_footprint_is_the_rings_and_both_sides_pools() -> None:
    page = mmap.PAGESIZE

    def rounded(n: int) -> int:
        return -(-n // page) * page

    rings = rounded(2 * ring_size(ringwire.DEFAULT_CAPACITY))
    pool = rounded(ringwire.DEFAULT_SLOTS.pool_bytes)
    assert FOOT["rings"] == rings and FOOT["pool"] == pool and FOOT["pools"] == 2
    assert FOOT["bytes"] == rings + 2 * pool
    assert FOOT["slot_classes"] == ringwire.DEFAULT_SLOTS.describe()
    assert FOOT["bytes"] > 64 * MiB  # the container case: this is why it fails


def test_a_64_mib_dev_shm_cannot_hold_a_default_connection() -> None:
    c = _doctor.check_shm(statvfs(64 * MiB, 64 * MiB), FOOT)
    assert c.status == "fail"
    assert "64 MiB, 64 MiB free" in c.detail
    assert "cannot hold one default connection" in c.detail
    assert "--shm-size=1g" in c.fix and "--ipc=host" in c.fix and "emptyDir" in c.fix
    assert "slots=None" in c.fix
    assert c.facts["fits"] == 0 and c.facts["fits_when_empty"] == 0
    assert c.facts["footprint"] == FOOT["bytes"]
    assert _doctor.exit_status([c], []) == 1


def test_a_full_dev_shm_points_at_cleanup() -> None:
    c = _doctor.check_shm(statvfs(GiB, 100 * MiB), FOOT)
    assert c.status == "fail"
    assert "no room left" in c.detail and "ringwire cleanup" in c.detail
    assert c.facts["fits_when_empty"] == GiB // FOOT["bytes"]


def test_dev_shm_counts_how_many_default_connections_fit() -> None:
    few = _doctor.check_shm(statvfs(GiB, 2 * FOOT["bytes"] + MiB), FOOT)
    assert few.status == "warn" and "room for 2 more" in few.detail and few.fix
    many = _doctor.check_shm(statvfs(32 * GiB, 30 * GiB), FOOT)
    assert many.status == "ok" and many.facts["fits"] == 30 * GiB // FOOT["bytes"]
    assert "32 GiB, 30 GiB free" in many.detail
    assert f"a default connection reserves {_doctor.human(FOOT['bytes'])}" in many.detail
    assert _doctor.exit_status([few, many], []) == 0


def test_an_unreadable_dev_shm_fails_for_named_segments_only() -> None:
    err = FileNotFoundError(2, "No such file or directory")
    c = _doctor.check_shm(err, FOOT)
    assert c.status == "fail" and "No such file or directory" in c.detail
    assert "mount -t tmpfs" in c.fix and c.facts["used"] is True
    c = _doctor.check_shm(err, FOOT, kind="memfd")
    assert c.status == "ok" and c.detail.startswith("not used: memory files (/dev/shm cannot")
    assert c.facts["used"] is False


def test_with_memory_files_a_small_dev_shm_is_only_reported() -> None:
    """The issue's container case with memory files: /dev/shm is not used by default,
    so its 64 MiB are information (with the numbers), not a failure."""
    c = _doctor.check_shm(statvfs(64 * MiB, 60 * MiB), FOOT, kind="memfd")
    assert c.status == "ok" and c.fix == ""
    assert c.detail.startswith("not used: memory files; 64 MiB, 60 MiB free")
    assert "named segments (RINGWIRE_SEGMENTS=named) would have room for 0" in c.detail
    assert c.facts["used"] is False and c.facts["size"] == 64 * MiB and c.facts["fits"] == 0
    assert _doctor.exit_status([c], []) == 0
    named = _doctor.check_shm(statvfs(64 * MiB, 60 * MiB), FOOT, kind="named")
    assert named.status == "fail" and named.facts["used"] is True
    assert _doctor.exit_status([named], []) == 1


# -- memory cgroup ---------------------------------------------------------------------------


def mountinfo(*mounts: tuple[str, str, str, str]) -> str:
    """(root, mount point, fstype, super options) -> /proc/self/mountinfo text."""
    lines = [
        f"{30 + i} 1 0:{i} {root} {point.replace(' ', chr(92) + '040')} rw,relatime - "
        f"{fstype} {fstype} {opts}"
        for i, (root, point, fstype, opts) in enumerate(mounts)
    ]
    return "\n".join(["22 1 8:1 / / rw - ext4 /dev/sda1 rw", *lines]) + "\n"


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def test_cgroup_v2_takes_the_smallest_limit_of_the_cgroup_and_its_ancestors(
    tmp_path: Path,
) -> None:
    root = tmp_path / "cg 2"  # a space: mountinfo escapes it
    write(root / "kubepods" / "memory.max", str(GiB))
    write(root / "kubepods" / "pod1" / "memory.max", "max")
    write(root / "kubepods" / "pod1" / "memory.current", str(300 * MiB))
    reading = _doctor.memory_limit(
        "0::/kubepods/pod1\n", mountinfo(("/", str(root), "cgroup2", "rw"))
    )
    assert reading == {
        "version": "2",
        "limit": GiB,
        "usage": 300 * MiB,
        "where": str(root / "kubepods"),
    }
    c = _doctor.check_memory_limit(reading, FOOT)
    assert c.status == "ok" and c.detail.startswith("1 GiB (cgroup v2 ")
    assert "300 MiB in use" in c.detail


def test_cgroup_v2_unlimited_is_none(tmp_path: Path) -> None:
    write(tmp_path / "memory.max", "max")
    write(tmp_path / "memory.current", "12345")
    reading = _doctor.memory_limit("0::/\n", mountinfo(("/", str(tmp_path), "cgroup2", "rw")))
    assert reading["version"] == "2" and reading["limit"] is None and reading["usage"] == 12345
    assert _doctor.check_memory_limit(reading, FOOT).detail.startswith("none (cgroup v2")


def test_a_container_namespace_root_maps_to_the_mount_point(tmp_path: Path) -> None:
    # the cgroup namespace's root is /docker/abc, mounted at tmp_path
    write(tmp_path / "memory.max", str(512 * MiB))
    write(tmp_path / "memory.current", str(400 * MiB))
    reading = _doctor.memory_limit(
        "0::/docker/abc\n", mountinfo(("/docker/abc", str(tmp_path), "cgroup2", "rw"))
    )
    assert reading["limit"] == 512 * MiB and reading["where"] == str(tmp_path)
    c = _doctor.check_memory_limit(reading, FOOT)
    assert c.status == "warn"  # 112 MiB left, a default connection takes more
    assert "less than a default connection" in c.detail and "--memory" in c.fix
    assert _doctor.check_memory_limit(reading, FOOT, "memfd").status == "warn"  # (usage varies)


def test_memory_files_fail_where_the_limit_cannot_hold_a_default_connection(
    tmp_path: Path,
) -> None:
    write(tmp_path / "memory.max", str(128 * MiB))  # less than a default connection
    write(tmp_path / "memory.current", str(MiB))
    reading = _doctor.memory_limit("0::/\n", mountinfo(("/", str(tmp_path), "cgroup2", "rw")))
    c = _doctor.check_memory_limit(reading, FOOT, "memfd")
    assert c.status == "fail" and "cannot hold one default connection" in c.detail
    assert "--memory" in c.fix and "slots=None" in c.fix
    assert _doctor.exit_status([c], []) == 1
    # named segments live in /dev/shm: its size is the limit that speaks, this one warns
    assert _doctor.check_memory_limit(reading, FOOT, "named").status == "warn"
    write(tmp_path / "memory.max", str(4 * GiB))
    reading = _doctor.memory_limit("0::/\n", mountinfo(("/", str(tmp_path), "cgroup2", "rw")))
    c = _doctor.check_memory_limit(reading, FOOT, "memfd")
    assert c.status == "ok" and c.detail.endswith("; memory files count against it")


def test_hybrid_hosts_fall_back_to_the_v1_memory_controller(tmp_path: Path) -> None:
    unified, memory = tmp_path / "unified", tmp_path / "memory"
    unified.mkdir()  # a v2 hierarchy without the memory controller
    write(memory / "memory.limit_in_bytes", "9223372036854771712")  # "unlimited" in v1
    write(memory / "job" / "memory.limit_in_bytes", str(2 * GiB))
    write(memory / "job" / "memory.usage_in_bytes", str(GiB))
    info = mountinfo(
        ("/", str(unified), "cgroup2", "rw"),
        ("/", str(tmp_path / "cpu"), "cgroup", "rw,cpu"),
        ("/", str(memory), "cgroup", "rw,memory"),
    )
    reading = _doctor.memory_limit("4:memory:/job\n1:cpu:/\n0::/\n", info)
    assert reading == {"version": "1", "limit": 2 * GiB, "usage": GiB, "where": str(memory / "job")}
    write(memory / "job" / "memory.limit_in_bytes", "9223372036854771712")
    assert _doctor.memory_limit("4:memory:/job\n0::/\n", info)["limit"] is None


def test_no_memory_cgroup_at_all() -> None:
    reading = _doctor.memory_limit("", "")
    assert reading == {"version": None, "limit": None, "usage": None, "where": ""}
    c = _doctor.check_memory_limit(reading, FOOT)
    assert c.status == "ok" and c.detail.startswith("none")


# -- huge pages, the C ring ------------------------------------------------------------------

MEMINFO = """MemTotal:       65536000 kB
HugePages_Total:       {total}
HugePages_Free:        {free}
HugePages_Rsvd:        0
Hugepagesize:       2048 kB
"""


def test_huge_pages_reserved_or_transparent() -> None:
    never = "always within_size advise [never] deny force\n"
    c = _doctor.check_huge_pages(MEMINFO.format(total=0, free=0), never)
    assert c.status == "absent"
    assert "0 reserved (0 free) of 2 MiB" in c.detail and "never" in c.detail
    assert "shmem_enabled" in c.fix and "nr_hugepages" in c.fix
    assert "what MFD_HUGETLB memory files would take" in c.detail and "not possible" in c.detail
    assert c.facts == {
        "reserved": 0, "free": 0, "page_size": 2 * MiB, "shmem_thp": "never",
        "shmem_thp_possible": False,
    }  # fmt: skip
    reserved = _doctor.check_huge_pages(MEMINFO.format(total=64, free=60), never)
    assert reserved.status == "ok" and "64 reserved (60 free)" in reserved.detail
    advise = _doctor.check_huge_pages(MEMINFO.format(total=0, free=0), "always [advise] never")
    assert advise.status == "ok" and advise.facts["shmem_thp"] == "advise"
    assert advise.facts["shmem_thp_possible"] is True and "advise, possible" in advise.detail
    for mode, possible in (("always", True), ("within_size", True), ("deny", False)):
        c = _doctor.check_huge_pages(MEMINFO.format(total=0, free=0), f"never [{mode}]")
        assert c.facts["shmem_thp_possible"] is possible, mode
        assert c.status == ("ok" if possible else "absent"), mode
    assert _doctor.check_huge_pages("", None).facts["shmem_thp"] is None
    assert _doctor.exit_status([c], []) == 0
    assert _doctor.exit_status([c], ["hugepages"]) == 1


def test_the_c_ring_or_why_not() -> None:
    assert _doctor.check_native(True, "").status == "ok"
    pure = _doctor.check_native(False, "RINGWIRE_PURE=1 is set")
    assert pure.status == "warn" and pure.fix == "unset RINGWIRE_PURE"
    built = _doctor.check_native(False, "the extension was not built (no compiler)")
    assert built.status == "warn" and "gcc" in built.fix and "reinstall" in built.fix
    assert _doctor.exit_status([built], []) == 0
    assert _doctor.exit_status([built], ["native"]) == 1


# -- torch, CUDA, NIXL, CURVE -------------------------------------------------------------------


def test_torch_and_cuda_from_the_probe() -> None:
    assert _doctor.check_torch(None).status == "absent"
    assert _doctor.check_cuda(None, None).status == "absent"
    cpu = {"version": "2.13.0+cpu", "cuda_build": None, "available": False, "devices": []}
    assert _doctor.check_torch(cpu).detail == "2.13.0+cpu (CPU-only build)"
    c = _doctor.check_cuda(cpu, None)
    assert c.status == "absent" and "CPU-only" in c.detail and "CUDA build" in c.fix
    gpu = {"version": "2.5.1", "cuda_build": "12.4", "available": True, "devices": ["H200"]}
    assert _doctor.check_torch(gpu).detail == "2.5.1 (built for CUDA 12.4)"
    c = _doctor.check_cuda(gpu, None)
    assert c.status == "ok" and c.facts["ipc"] is True
    assert c.detail == "1 device(s) (0: H200); CUDA IPC possible"
    hidden = _doctor.check_cuda(gpu | {"available": False, "devices": []}, "")
    assert hidden.status == "absent" and "CUDA_VISIBLE_DEVICES=''" in hidden.detail
    assert "--gpus all" in hidden.fix
    broken = _doctor.check_cuda(gpu | {"cuda_error": "RuntimeError: driver too old"}, None)
    assert broken.status == "fail" and "driver too old" in broken.detail


def test_a_probe_that_hangs_or_breaks_is_a_failure_not_a_hang() -> None:
    assert _doctor.check_torch({"timeout": 30.0}).status == "fail"
    hang = _doctor.check_cuda({"timeout": 30.0}, None)
    assert hang.status == "fail" and "within 30 s" in hang.detail and "nvidia-smi" in hang.fix
    bad = _doctor.check_torch({"error": "ImportError: libcudart.so.12"})
    assert bad.status == "fail" and "libcudart" in bad.detail
    assert _doctor.exit_status([bad], []) == 0  # torch is optional...
    assert _doctor.exit_status([bad], ["torch"]) == 1  # ...unless asked for


def test_nixl_and_the_ucx_transports_it_reaches() -> None:
    absent = _doctor.check_nixl(None, None, None, None)
    assert absent.status == "absent" and "ringwire[nixl]" in absent.fix
    off = _doctor.check_nixl("1.5.1", "RINGWIRE_NIXL=0", None, None)
    assert off.status == "warn" and off.fix == "unset RINGWIRE_NIXL"
    tcp = {
        "ucx_backend": True,
        "ucx_version": "1.23.0",
        "transports": ["self/memory", "tcp/eth0", "tcp/lo", "posix/memory"],
    }
    c = _doctor.check_nixl("1.5.1", None, tcp, None)
    assert c.status == "ok" and c.facts["rdma"] is False
    assert c.detail.startswith("nixl-cu12 1.5.1, UCX 1.23.0: self/memory, tcp/eth0")
    assert "no RDMA device" in c.detail
    rdma = tcp | {"transports": ["rc_mlx5/mlx5_0:1", "tcp/eth0"]}
    c = _doctor.check_nixl("1.5.1", None, rdma, "rc,tcp")
    assert c.facts["rdma"] is True and "RDMA" not in c.detail and "UCX_TLS=rc,tcp" in c.detail
    none = _doctor.check_nixl("1.5.1", None, tcp | {"transports": []}, "bogus")
    assert none.status == "fail" and "UCX_TLS" in none.fix
    unlisted = _doctor.check_nixl(
        "1.5.1", None, {"ucx_backend": True, "ucx_error": "OSError"}, None
    )
    assert unlisted.status == "warn"
    assert _doctor.exit_status([unlisted], ["nixl"]) == 1
    failed = _doctor.check_nixl("1.5.1", None, {"error": "RuntimeError: no UCX"}, None)
    assert failed.status == "fail" and "no UCX" in failed.detail
    assert _doctor.check_nixl("1.5.1", None, {"timeout": 5.0}, None).status == "fail"


def test_curve() -> None:
    assert _doctor.check_curve(None, None, False).status == "absent"
    no = _doctor.check_curve("27.3.0", "4.3.5", False)
    assert no.status == "absent" and "without CURVE" in no.detail and "pyzmq" in no.fix
    yes = _doctor.check_curve("27.3.0", "4.3.5", True)
    assert yes.status == "ok" and yes.detail == "pyzmq 27.3.0, libzmq 4.3.5 with CURVE"


# -- exit status, --need, rendering -----------------------------------------------------------


def test_exit_status_rule() -> None:
    ok = [Check(k, "ok", "fine") for k in _doctor.CHECKS]
    assert _doctor.exit_status(ok, list(_doctor.NEEDS)) == 0
    optional_missing = [*ok[:5], *(Check(k, "absent", "no") for k in _doctor.CHECKS[5:])]
    assert _doctor.exit_status(optional_missing, []) == 0
    assert _doctor.exit_status(optional_missing, ["curve"]) == 1
    shm_warn = [Check("shm", "warn", "tight"), *ok[2:]]
    assert _doctor.exit_status(shm_warn, []) == 0
    shm_fail = [Check("shm", "fail", "64 MiB"), *ok[2:]]
    assert _doctor.exit_status(shm_fail, []) == 1
    with pytest.raises(ValueError, match="status must be one of"):
        Check("shm", "bad", "")


def test_parse_needs() -> None:
    assert _doctor.parse_needs(["torch,CUDA", " nixl ", "torch", ""]) == ["torch", "cuda", "nixl"]
    assert _doctor.parse_needs([]) == []
    with pytest.raises(ValueError, match="unknown --need 'gpu'; one of: native, torch"):
        _doctor.parse_needs(["torch,gpu"])


def report(needs: list[str] | None = None, shm: str = "fail") -> Report:
    checks = [
        _doctor.check_segments("named", None, None),
        _doctor.check_shm(
            statvfs(64 * MiB, 64 * MiB) if shm == "fail" else statvfs(GiB, GiB), FOOT
        ),
        _doctor.check_memory_limit(_doctor.memory_limit("", ""), FOOT),
        _doctor.check_huge_pages(MEMINFO.format(total=0, free=0), "[never]"),
        _doctor.check_native(True, ""),
        _doctor.check_torch(None),
        _doctor.check_cuda(None, None),
        _doctor.check_nixl(None, None, None, None),
        _doctor.check_curve("27.3.0", "4.3.5", True),
    ]
    about = {"ringwire": "0.1.0", "python": "3.11.7", "platform": "Linux 6.1 x86_64"}
    return Report(checks, needs or [], about)


def test_render_text_is_one_aligned_screen() -> None:
    text = _doctor.render_text(report(), width=90)
    lines = text.splitlines()
    assert lines[0] == "ringwire 0.1.0 on Python 3.11.7, Linux 6.1 x86_64"
    assert all(len(line) <= 90 for line in lines), text
    assert len(lines) <= 40
    rows = [line for line in lines if line[:2] == "  " and line[2] != " "]
    assert [r.split()[0] for r in rows] == ["ok", "FAIL", "ok", "absent", "ok", "absent",
                                           "absent", "absent", "ok"]  # fmt: skip
    fixes = [line for line in lines if line.strip().startswith("fix:")]
    column = len(fixes[0]) - len(fixes[0].lstrip())  # where details and fixes start
    for row in rows:  # every detail starts in that column: names and details aligned
        assert row[column - 2 : column] == "  " and row[column] != " ", text
    assert all(len(f) - len(f.lstrip()) == column for f in fixes)
    assert len(fixes) == 5  # /dev/shm, huge pages, torch, cuda, nixl: not the ok ones
    assert lines[-1] == "result: not usable as asked: /dev/shm (exit status 1)"
    ok = _doctor.render_text(report(["curve"], shm="ok"))
    assert ok.splitlines()[-1] == "result: the defaults work here; asked for: curve (exit status 0)"
    unmet = _doctor.render_text(report(["torch", "curve"], shm="ok"))
    assert unmet.splitlines()[-1] == "result: not usable as asked: torch (exit status 1)"


def test_render_json_has_stable_keys() -> None:
    data = json.loads(_doctor.render_json(report(["torch"])))
    assert set(data) == {"about", "needs", "exit_status", "unmet", "checks"}
    assert data["needs"] == ["torch"] and data["exit_status"] == 1
    assert data["unmet"] == ["shm", "torch"]
    assert list(data["checks"]) == list(_doctor.CHECKS)
    for check in data["checks"].values():
        assert set(check) == {"status", "detail", "fix", "facts"}
        assert check["status"] in ("ok", "warn", "fail", "absent")
    assert data["checks"]["shm"]["facts"]["fits"] == 0


def test_the_command_formats_what_gather_found(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[dict[str, Any]] = []

    def fake_gather(needs: list[str], timeout: float) -> Report:
        seen.append({"needs": needs, "timeout": timeout})
        return report(needs, shm="ok")

    monkeypatch.setattr(_doctor, "gather", fake_gather)
    out = io.StringIO()
    assert _cli.main(["doctor", "--json", "--need", "curve", "--timeout", "5"], out=out) == 0
    assert seen == [{"needs": ["curve"], "timeout": 5.0}]
    assert json.loads(out.getvalue())["exit_status"] == 0
    out = io.StringIO()
    assert _cli.main(["doctor", "--need", "torch"], out=out) == 1
    assert "result: not usable as asked: torch" in out.getvalue()
    assert _cli.main(["doctor", "--need", "gpu"], out=io.StringIO()) == 2
    assert _cli.main(["doctor", "--timeout", "0"], out=io.StringIO()) == 2
    assert len(seen) == 2  # neither usage error gathered anything
