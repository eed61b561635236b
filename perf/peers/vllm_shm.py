"""vLLM's real ``MessageQueue`` (``vllm/distributed/device_communicators/shm_broadcast.py``),
loaded from a vLLM distribution for :mod:`perf.broadcast`, with a small shim for its
``vllm.*`` imports.

No vLLM code is kept in this repository: the file is read, unmodified, from where a
vLLM release put it, in this order:

1. ``$RINGWIRE_VLLM`` -- a vLLM wheel (``vllm-*.whl``), or a directory holding a
   ``vllm/`` package tree (a site-packages directory, an unpacked wheel);
2. an installed ``vllm`` distribution (found through :mod:`importlib.metadata`,
   never imported: importing vLLM pulls in CUDA, transformers, ...).

The cheapest way to get one (no dependency is installed, torch is left alone)::

    python -m pip download vllm --no-deps --only-binary :all: -d /tmp/vllm
    RINGWIRE_VLLM=/tmp/vllm/vllm-*.whl python -m perf.broadcast --arrays

The file then runs as vLLM runs it: its pickling (protocol 5, out-of-band buffers of
1 MiB and more copied into the ring chunk by the writer and out of it into a
``bytearray`` by every reader), its ``SpinCondition`` (a reader spins with
``sched_yield`` for ``busy_loop_s`` = 1 s after each read, then waits on a ZeroMQ
notify), its memory fences.  The shim provides only what the module imports from
the rest of vLLM, each as vLLM defines it or as a no-op where it is a pre-flight check
(:data:`SHIM_NOTES` lists them; :func:`describe` prints them with the version).

Only :mod:`perf` imports this, and only inside the benchmark's processes: the fake
``vllm`` package it registers in ``sys.modules`` never reaches ringwire.
"""

from __future__ import annotations

import importlib.metadata
import ipaddress
import logging
import os
import socket
import sys
import tempfile
import types
import uuid
import zipfile
from pathlib import Path
from typing import Any

__all__ = [
    "SHIM_NOTES",
    "VllmUnavailable",
    "describe",
    "handle_fields",
    "load_message_queue",
    "reader_from_fields",
]

MODULE = "vllm.distributed.device_communicators.shm_broadcast"
RELPATH = "vllm/distributed/device_communicators/shm_broadcast.py"

SHIM_NOTES = (
    "vllm.envs: VLLM_USE_SPINLOOP_EXT=0, VLLM_RINGBUFFER_WARNING_INTERVAL=60, "
    "VLLM_RPC_BASE_PATH=$TMPDIR (vLLM's defaults)",
    "vllm.distributed.utils.sched_yield: os.sched_yield (vLLM's, Python >= 3.11.1)",
    "vllm.utils.network_utils: get_open_zmq_ipc_path / inproc_path as vLLM's (uuid4 "
    "paths), get_ip, is_valid_ipv6_address",
    "vllm.utils.cpu_resource_utils.check_cgroup_memory_available: a no-op (a pre-flight check)",
    "vllm.platforms.current_platform: raises if touched (used only with a process group or CUDA)",
)


class VllmUnavailable(ImportError):
    """No vLLM distribution to read ``shm_broadcast.py`` from (the message says how to
    get one)."""


_loaded: tuple[types.ModuleType, str] | None = None


def _source() -> tuple[str, str, str]:
    """(source text, where it came from, vLLM version)."""
    spec = os.environ.get("RINGWIRE_VLLM")
    if spec:
        p = Path(spec)
        if p.is_file() and p.suffix == ".whl":
            with zipfile.ZipFile(p) as zf:
                try:
                    text = zf.read(RELPATH).decode()
                except KeyError:
                    raise VllmUnavailable(f"{p} has no {RELPATH}: not a vLLM wheel") from None
            version = p.name.split("-")[1] if p.name.count("-") >= 2 else "?"
            return text, f"{p}!{RELPATH}", version
        f = p / RELPATH
        if f.is_file():
            return f.read_text(), str(f), "?"
        raise VllmUnavailable(
            f"RINGWIRE_VLLM={spec!r} is neither a vLLM wheel nor a directory holding {RELPATH}"
        )
    try:
        dist = importlib.metadata.distribution("vllm")
    except importlib.metadata.PackageNotFoundError:
        raise VllmUnavailable(
            "vLLM's MessageQueue needs a vLLM release to read shm_broadcast.py from: "
            "`python -m pip download vllm --no-deps --only-binary :all: -d /tmp/vllm` "
            "and set RINGWIRE_VLLM to the wheel (or install vllm)"
        ) from None
    f = Path(str(dist.locate_file(RELPATH)))
    if not f.is_file():
        raise VllmUnavailable(f"vllm {dist.version} is installed but has no {RELPATH}")
    return f.read_text(), str(f), dist.version


def _package(name: str) -> types.ModuleType:
    mod = sys.modules.get(name)
    if mod is None:
        mod = types.ModuleType(name)
        mod.__path__ = []
        sys.modules[name] = mod
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(_package(parent), child, mod)
    return mod


def _module(name: str, **attrs: Any) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    sys.modules[name] = mod
    parent, _, child = name.rpartition(".")
    setattr(_package(parent), child, mod)
    return mod


def _get_ip() -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("127.0.0.1", 80))  # no packet is sent: it picks the route
            return str(s.getsockname()[0])
        except OSError:
            return "127.0.0.1"


def _is_valid_ipv6_address(address: str) -> bool:
    try:
        ipaddress.IPv6Address(address)
        return True
    except ValueError:
        return False


class _StatelessProcessGroup:  # only named in an annotation of the file
    pass


class _NoPlatform:
    """vLLM's ``current_platform``: used only with a torch process group or CUDA,
    which the benchmark does not use; touching it says so."""

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(f"current_platform.{name}: the perf shim has no vLLM platform")


def _install_shim(rpc_dir: str) -> None:
    _package("vllm")
    _module(
        "vllm.envs",
        VLLM_USE_SPINLOOP_EXT=False,
        VLLM_RINGBUFFER_WARNING_INTERVAL=60,
        VLLM_RPC_BASE_PATH=rpc_dir,
    )
    _module("vllm.logger", init_logger=logging.getLogger)
    _module(
        "vllm.distributed.utils",
        StatelessProcessGroup=_StatelessProcessGroup,
        sched_yield=os.sched_yield,
    )
    _module("vllm.platforms", current_platform=_NoPlatform())
    _module(
        "vllm.utils.cpu_resource_utils",
        check_cgroup_memory_available=lambda *a, **k: None,
    )
    _module(
        "vllm.utils.network_utils",
        get_ip=_get_ip,
        get_open_zmq_inproc_path=lambda: f"inproc://{uuid.uuid4()}",
        get_open_zmq_ipc_path=lambda: f"ipc://{rpc_dir}/{uuid.uuid4()}",
        is_valid_ipv6_address=_is_valid_ipv6_address,
    )
    _package("vllm.distributed.device_communicators")


def load_message_queue(rpc_dir: str | None = None) -> Any:
    """vLLM's ``MessageQueue`` class, from the real file (once per process).

    ``rpc_dir``: where its ZeroMQ ``ipc://`` sockets go (vLLM: ``VLLM_RPC_BASE_PATH``;
    default the temporary directory).  Raises :class:`VllmUnavailable` when no vLLM
    release is found, ``ImportError`` when torch or pyzmq (which the file imports)
    is missing."""
    global _loaded
    if _loaded is None:
        text, where, _ = _source()
        _install_shim(rpc_dir or tempfile.gettempdir())
        mod = types.ModuleType(MODULE)
        mod.__file__ = where
        sys.modules[MODULE] = mod
        try:
            exec(compile(text, where, "exec"), mod.__dict__)  # noqa: S102 -- the file as shipped
        except BaseException:
            del sys.modules[MODULE]
            raise
        _loaded = (mod, where)
    return _loaded[0].MessageQueue


def handle_fields(mq: Any) -> dict[str, Any]:
    """The writer's ``Handle`` as a plain dict (a spawn child unpickles it before the
    shim exists there)."""
    import dataclasses

    return dataclasses.asdict(mq.export_handle())


def reader_from_fields(fields: dict[str, Any], rank: int) -> Any:
    """``MessageQueue.create_from_handle`` from :func:`handle_fields`' dict."""
    mq_cls = load_message_queue()
    mod = sys.modules[MODULE]
    handle = mod.Handle(**{**fields, "buffer_handle": tuple(fields["buffer_handle"])})
    return mq_cls.create_from_handle(handle, rank)


def describe() -> str:
    """Where the file comes from, its vLLM version, and the shim (for the report)."""
    _, where, version = _source()
    return f"vLLM {version} shm_broadcast.py from {where}; shim: " + "; ".join(SHIM_NOTES)
