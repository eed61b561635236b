"""Tensor-slot pools: their configuration and their segments.

Every side of a connection that sends large arrays owns one *slot pool* segment (its
*send pool*); the peer attaches it read-mostly.  Only the owner (the *producer*)
allocates.  One pool segment is::

    offset              size                         written by   meaning
    ------              ----                         ----------   -------------------------
    0                   pool_size(classes)           producer     slot pool (:mod:`.._wire.slotlayout`)
    pool_size(...)      ring_size(RELEASE_CAPACITY)  consumer     release lane (:mod:`.._wire.ring`)

The pool comes first so that the offsets in its slot table, and in every
:class:`~ringwire.wire.SlotRef`, are offsets into the segment itself.  The release lane is
an ordinary SPSC ring whose frames are packed ``(slot u64, generation u64)`` pairs,
written by the consumer and read by the producer.


The producer's side is :mod:`ringwire._shm.sendpool`, the consumer's
:mod:`ringwire._shm.recvpool`, the helpers users call on received views
(:func:`release`, :func:`borrow`, :func:`copy_out`) :mod:`ringwire._pool.views`.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from .._errors import (
    RingwireError,
    SharedMemoryFull,
)
from .._wire.descriptors import KIND_NUMPY, KIND_TORCH
from .._wire.dtypes import (
    numpy_dtype_to_wire,
    torch_dtype_to_wire,
    torch_loaded,
    torch_module,
)
from .._wire.ring import (
    check_ring,
    init_ring,
    ring_size,
)
from .._wire.slotlayout import (
    PoolLayout,
    SlotClass,
    init_pool,
    pool_size,
    read_pool,
)
from .arena import DEFAULT_LARGE_LIMIT
from .cuda import (
    CudaNeed,
    cuda_backend,
)
from .segment import Segment

__all__ = [
    "DEFAULT_SLOTS",
    "RELEASE_CAPACITY",
    "attach_pool",
    "check_policy",
    "create_pool",
    "default_slots",
    "describe_classes",
    "loan_spec",
    "POLICIES",
    "Policy",
    "resolve_config",
    "SlotConfig",
]

RELEASE_CAPACITY = 64 * 1024
"""Data bytes of a pool's release lane (about 2000 releases per frame)."""

Policy = Literal["wait", "inline", "error"]
POLICIES = ("wait", "inline", "error")
_KiB, _MiB = 1 << 10, 1 << 20


@dataclass(frozen=True)
class SlotConfig:
    """How one side of a connection sends large arrays and tensors.

    ``classes``
        the slot size classes of this side's send pool (``count`` slots of ``size``
        bytes each); the pool occupies about their total in ``/dev/shm`` for the life
        of the connection.  The default holds 16 x 64 KiB, 16 x 1 MiB and 4 x 16 MiB
        (81 MiB).
    ``threshold``
        arrays of at least this many bytes travel through a slot; smaller ones inline.
    ``policy``
        when no slot is free: ``"wait"`` for a release, ``"inline"`` send it inline
        instead, ``"error"`` raise :class:`SlotsExhausted`.  A send can override it
        (``send(item, slot_policy=...)``).
    ``wait_timeout``
        policy ``"wait"`` waits at most this many seconds (default 30; ``None`` =
        forever; async waits are also cancellable), then raises
        :class:`SlotWaitTimeout` (a :class:`SlotsExhausted` and a
        :class:`TimeoutError`).  A wait longer than a second logs one warning per
        connection naming the pool and how many of its slots the peer holds: a
        receiver that keeps every array it got (a list of received tensors) starves
        the sender, and should release them, keep ``copy_out()`` copies, or connect
        with ``copy_out=True``.
    ``cuda``
        what to do with CUDA tensors of at least ``cuda_threshold`` bytes: ``"ipc"``
        sends them by reference into this side's GPU pool for their device (Ext 5; the
        consumer gets a view on the same device, no host copy); ``"stage"`` copies them
        to the host and sends them like CPU tensors (for a consumer without a GPU).
        Smaller CUDA tensors travel inline (through the host) and are restored on
        their device.
    ``cuda_classes``
        the slot classes of each GPU pool (allocated on the device the first time a
        tensor of that device is sent; default 16 x 1 MiB, 8 x 16 MiB, 2 x 128 MiB).
    ``large_limit``
        arrays larger than every slot class still travel by reference, each in memory
        reserved for it (a range of this side's *arena*, :mod:`ringwire._pool.arena`)
        and given back to the kernel when the receiver's views die.  At most this many
        bytes of them are outstanding at once (default 2 GiB); beyond that a send waits
        like a full pool (``policy``), except that one array larger than the limit goes
        when nothing else is outstanding, so no size is refused.  ``None``: no arena;
        such arrays go inline if the ring holds them, else :class:`FrameTooLarge`.

    Copying received arrays into private memory is the *receiving* side's choice, not
    part of this (send pool) configuration: the ``copy_out=`` keyword of
    :func:`~ringwire.connect`, :func:`~ringwire.listen`, :meth:`PairEnd.connect
    <ringwire.PairEnd.connect>` and :func:`~ringwire.subscribe`.
    """

    classes: tuple[SlotClass, ...] = (
        SlotClass(64 * _KiB, 16),
        SlotClass(1 * _MiB, 16),
        SlotClass(16 * _MiB, 4),
    )
    threshold: int = 64 * _KiB
    policy: Policy = "wait"
    wait_timeout: float | None = 30.0
    cuda: Literal["ipc", "stage"] = "ipc"
    cuda_threshold: int = 64 * _KiB
    cuda_classes: tuple[SlotClass, ...] = (
        SlotClass(1 * _MiB, 16),
        SlotClass(16 * _MiB, 8),
        SlotClass(128 * _MiB, 2),
    )
    large_limit: int | None = DEFAULT_LARGE_LIMIT

    def __post_init__(self) -> None:
        for field_name in ("classes", "cuda_classes"):
            classes = tuple(getattr(self, field_name))
            if not classes or not all(isinstance(c, SlotClass) for c in classes):
                raise ValueError(
                    f"SlotConfig.{field_name} must be a non-empty sequence of SlotClass"
                )
            pool_size(classes)  # checks the slot count
            object.__setattr__(self, field_name, classes)
        for field_name in ("threshold", "cuda_threshold"):
            value = getattr(self, field_name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{field_name} must be a non-negative int, not {value!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, not {self.policy!r}")
        if self.wait_timeout is not None and not self.wait_timeout >= 0:
            raise ValueError("wait_timeout must be None or >= 0")
        if self.large_limit is not None and (
            not isinstance(self.large_limit, int) or self.large_limit <= 0
        ):
            raise ValueError(f"large_limit must be None or a positive int, not {self.large_limit!r}")
        if self.cuda not in ("ipc", "stage"):
            raise ValueError(f"cuda must be 'ipc' or 'stage', not {self.cuda!r}")

    @property
    def pool_bytes(self) -> int:
        """Bytes of ``/dev/shm`` one send pool of this configuration takes."""
        return pool_size(self.classes) + ring_size(RELEASE_CAPACITY)

    def describe(self) -> str:
        """The slot classes in words, e.g. ``"16 x 64 KiB, 16 x 1 MiB, 4 x 16 MiB"`` (as
        error messages and ``python -m ringwire doctor`` name a pool)."""
        return describe_classes(self.classes)


DEFAULT_SLOTS = SlotConfig()
"""The default send-pool configuration (``slots=`` of connect, listen and pair)."""

# What ``slots=DEFAULT_SLOTS`` means when a connection is made (a test suite may swap
# in a smaller pool here to keep thousands of connections cheap).
default_slots: SlotConfig | None = DEFAULT_SLOTS


def resolve_config(slots: SlotConfig | None) -> SlotConfig | None:
    if slots is DEFAULT_SLOTS:
        return default_slots
    if slots is not None and not isinstance(slots, SlotConfig):
        raise TypeError(f"slots must be a SlotConfig or None, not {type(slots).__name__}")
    return slots


def describe_classes(classes: Sequence[SlotClass]) -> str:
    return ", ".join(f"{c.count} x {_human(c.size)}" for c in classes)


def _human(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", _MiB), ("KiB", _KiB)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} bytes"


# -- segments ---------------------------------------------------------------------------


def create_pool(
    config: SlotConfig, keep_going: Callable[[], None] | None = None
) -> tuple[Segment, PoolLayout]:
    """Create, reserve and initialise a send-pool segment (``keep_going``: see
    :meth:`Segment.create`)."""
    psize = pool_size(config.classes)
    try:
        seg = Segment.create(psize + ring_size(RELEASE_CAPACITY), keep_going)
    except SharedMemoryFull as exc:
        raise SharedMemoryFull(
            f"{exc}; this is a tensor-slot pool ({config.describe()}): configure smaller "
            "slot classes (slots=SlotConfig(...)), or slots=None to send every array inline"
        ) from None
    try:
        layout = init_pool(seg.buf, config.classes)
        init_ring(seg.buf, psize, RELEASE_CAPACITY)
    except BaseException:
        seg.unlink()
        seg.close()
        raise
    return seg, layout


def attach_pool(seg: Segment) -> PoolLayout:
    """Check the peer's pool segment once, at attach time; keep the returned layout
    (later rewrites of the table by the peer cannot move slots)."""
    layout = read_pool(seg.buf)
    if layout.total_size + ring_size(RELEASE_CAPACITY) > seg.size:
        raise RingwireError("slot pool segment has no room for its release lane")
    check_ring(seg.buf, layout.total_size, RELEASE_CAPACITY)
    return layout


def loan_spec(
    shape: Any, dtype: Any, device: Any = None
) -> tuple[str, Any, Any, tuple[int, ...], int | CudaNeed]:
    """``(kind, numpy dtype, torch dtype, shape, nbytes)`` of a loan request; for a
    CUDA ``device``, ``("cuda", device index, torch dtype, shape, CudaNeed)``."""
    if isinstance(shape, int):
        shape = (shape,)
    dims = tuple(operator.index(d) for d in shape)
    if any(d < 0 for d in dims):
        raise ValueError(f"negative dimension in shape {dims}")
    if device is not None:
        if not torch_loaded():
            raise ValueError("a loan on a device needs a torch dtype")
        torch = torch_module()
        dev = torch.device(device)
        if dev.type == "cpu":
            return loan_spec(dims, dtype)
        if dev.type != "cuda":
            raise ValueError(f"loans live in host memory or on a CUDA device, not {dev}")
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"a CUDA loan needs a torch dtype, not {dtype!r}")
        torch_dtype_to_wire(dtype)
        backend = cuda_backend()
        if backend is None:
            raise ValueError(f"{dev} is not available in this process")
        index = dev.index if dev.index is not None else backend.current_device()
        need = CudaNeed(int(index), math.prod(dims) * int(dtype.itemsize))
        return "cuda", need.device, dtype, dims, need
    if torch_loaded():
        torch = torch_module()
        if isinstance(dtype, torch.dtype):
            torch_dtype_to_wire(dtype)  # refuses dtypes that cannot be sent
            return KIND_TORCH, None, dtype, dims, math.prod(dims) * int(dtype.itemsize)
    np_dtype = np.dtype(dtype)
    numpy_dtype_to_wire(np_dtype)
    return KIND_NUMPY, np_dtype, None, dims, math.prod(dims) * np_dtype.itemsize


def check_policy(policy: str | None) -> str | None:
    if policy is not None and policy not in POLICIES:
        raise ValueError(f"slot_policy must be one of {POLICIES}, not {policy!r}")
    return policy
