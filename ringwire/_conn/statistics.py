"""What :meth:`Channel.statistics` and :meth:`Listener.statistics` return.

:func:`channel_statistics` reads an endpoint through :class:`Counted` (what it needs
of one; :class:`~ringwire._conn.endpoint.Endpoint` is one), so this module does not
import the endpoint that calls it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from .._pool.protocols import RecvPool, SendPool
from .transport import FrameReader, FrameWriter, Transport

__all__ = ["ChannelStatistics", "Counted", "ListenerStatistics", "channel_statistics"]


class Counted(Protocol):
    """What :func:`channel_statistics` reads of an endpoint (read only)."""

    @property
    def closed(self) -> bool: ...
    @property
    def transport(self) -> Transport: ...
    @property
    def tx(self) -> FrameWriter: ...
    @property
    def rx(self) -> FrameReader: ...
    @property
    def pool(self) -> SendPool | None: ...
    @property
    def peer(self) -> RecvPool | None: ...
    @property
    def n_sent(self) -> int: ...
    @property
    def n_recv(self) -> int: ...
    @property
    def b_sent(self) -> int: ...
    @property
    def b_recv(self) -> int: ...
    @property
    def send_parks(self) -> int: ...
    @property
    def recv_parks(self) -> int: ...
    def notice_hang_up(self) -> None: ...
    def slot_safe_point(self) -> None: ...


@dataclass(frozen=True)
class ChannelStatistics:
    """A snapshot of one connection's counters."""

    records_sent: int
    records_received: int
    bytes_sent: int
    bytes_received: int
    send_capacity: int
    send_fill: int
    receive_capacity: int
    receive_fill: int
    send_parks: int
    receive_parks: int
    doorbells_sent: int
    doorbells_received: int
    # the send pool (tensor slots this side lends to the peer); zeros without one
    slots_in_use: int = 0
    slots_free: dict[int, int] = field(default_factory=dict)  # slot size -> free slots
    slot_bytes_in_use: int = 0
    releases_received: int = 0
    loans_outstanding: int = 0
    inline_fallbacks: int = 0
    slots_reclaimed: int = 0
    # arrays larger than every slot class (each in memory of its own: SlotConfig.large_limit)
    large_in_use: int = 0  # sent, not yet released by the peer
    large_bytes_in_use: int = 0
    large_sent: int = 0
    # this side's GPU pools (CUDA tensors sent by reference, Ext 5)
    cuda_pools: list[int] = field(default_factory=list)  # devices with a pool
    cuda_slots_in_use: int = 0
    cuda_slots_free: dict[str, dict[int, int]] = field(default_factory=dict)  # device -> ...
    cuda_staged: int = 0  # CUDA tensors sent through host slots (SlotConfig(cuda="stage"))
    # the receive side (slots the peer lent us)
    slot_arrays_received: int = 0
    slot_arrays_held: int = 0
    releases_pending: int = 0
    cuda_tensors_received: int = 0
    cuda_pools_opened: int = 0  # the peer's GPU pools mapped here (once per device)
    # how arrays travel: "slots" (shared memory on this host), over TCP "frames" (ZeroMQ
    # frames, Ext 20) or "nixl" (NIXL reads, Ext 21), "inline" on the in-memory test
    # transport (ringwire._conn.memory); nixl_off: why a TCP connection's
    # arrays do not go through NIXL ("" where they may)
    tensor_path: str = "slots"
    nixl_off: str = ""
    nixl_arrays_sent: int = 0
    nixl_arrays_received: int = 0


@dataclass(frozen=True)
class ListenerStatistics:
    """A snapshot of a listener's counters."""

    open_connections: int
    accepted: int
    refused: int
    broken: int
    ended: int


def channel_statistics(core: Counted, *, settle: bool = True) -> ChannelStatistics:
    """What :meth:`Endpoint.statistics` returns: a snapshot of ``core``'s counters.

    ``settle`` first notices a peer that hung up and runs a slot safe point (so slots
    the peer released or a gone peer held count as free): the owner's thread only.
    ``settle=False`` reads without touching anything, from any thread (the metrics
    collector, :mod:`ringwire._conn.observed`)."""
    if core.closed:
        tx_fill = rx_fill = 0
    else:
        tx_fill = core.tx.used()
        rx_fill = core.rx.fill()
    t = core.transport
    return ChannelStatistics(
        records_sent=core.n_sent,
        records_received=core.n_recv,
        bytes_sent=core.b_sent,
        bytes_received=core.b_recv,
        send_capacity=core.tx.capacity,
        send_fill=tx_fill,
        receive_capacity=core.rx.capacity,
        receive_fill=rx_fill,
        send_parks=core.send_parks,
        receive_parks=core.recv_parks,
        doorbells_sent=t.doorbells_sent,
        doorbells_received=t.doorbells_received,
        tensor_path=t.tensor_path,
        nixl_off=t.nixl_off,
        **_slot_statistics(core, settle),
    )


def _slot_statistics(core: Counted, settle: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    pool = core.pool
    if pool is not None:
        if settle and not core.closed:
            core.notice_hang_up()  # a gone peer's slots are free, not "in use"
            core.slot_safe_point()
        out.update(pool.statistics())
        out["slots_reclaimed"] = pool.reclaimed
    peer = core.peer
    if peer is not None:
        out.update(peer.statistics())
    return out
