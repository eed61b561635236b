"""``python -m ringwire doctor``: what this machine will use, and what to fix.

Every check (:mod:`ringwire._doctor_checks`) is a pure function of *readings* (the
text of ``/proc/meminfo``, a ``statvfs`` result, the files of a cgroup tree, what a
probe printed...), so the tests feed it fake ones; :func:`gather` takes the real
readings and calls them all.  A check returns a :class:`Check`: ``status`` is one of

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
import os
import platform
import shutil
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib import metadata
from typing import Any, TextIO

from . import _probes as probes
from ._doctor_checks import (
    SHM_DIR,
    Check,
    check_cuda,
    check_curve,
    check_huge_pages,
    check_memory_limit,
    check_native,
    check_nixl,
    check_segments,
    check_shm,
    check_torch,
    default_footprint,
    human,
    memory_limit,
)
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

PROBE_TIMEOUT = 30.0
"""Seconds a child probe (torch and CUDA; NIXL and UCX) may take before it is killed."""

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


@dataclass
class Report:
    """Every check, in :data:`CHECKS` order; the ``--need`` names; ``about``: the
    ringwire and Python versions and the platform."""

    checks: list[Check]
    needs: list[str]
    about: dict[str, str]

    def by_key(self) -> dict[str, Check]:
        return {c.key: c for c in self.checks}


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
