"""What :meth:`Channel.statistics` and :meth:`Listener.statistics` return."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["ChannelStatistics", "ListenerStatistics"]


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


@dataclass(frozen=True)
class ListenerStatistics:
    """A snapshot of a listener's counters."""

    open_connections: int
    accepted: int
    refused: int
    broken: int
    ended: int
