"""What both drivers share: the face of an endpoint (its name, state, descriptor,
statistics), receipts of sent records, and the warning on closing while received
slot arrays are alive."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

from .endpoint import Endpoint
from .observed import track
from .statistics import ChannelStatistics

__all__ = ["EndpointFacade", "ReceiptBase", "warn_held"]


class EndpointFacade:
    """What :class:`~ringwire.Channel` and :class:`~ringwire.SyncChannel` show alike:
    ``peer_pid``, ``protocol_version``, ``name``, :attr:`closed`, :meth:`fileno`,
    :meth:`statistics`."""

    def __init__(self, core: Endpoint) -> None:
        self._core = core
        self.peer_pid = core.peer_pid
        self.protocol_version = core.version
        self.name = core.name
        track(self, core, "channel")  # weakly: ringwire.metrics reads it when scraped

    def __repr__(self) -> str:
        label = f" {self.name}" if self.name else ""
        return f"<{type(self).__name__}{label} peer pid {self.peer_pid} {self._core.state()}>"

    @property
    def closed(self) -> bool:
        """Did *we* close this endpoint?"""
        return self._core.closed

    def fileno(self) -> int:
        """The transport's descriptor (readable when a doorbell or hang-up is pending)."""
        return self._core.transport.fileno()

    def statistics(self) -> ChannelStatistics:
        """A snapshot of this connection's counters."""
        return self._core.statistics()


def warn_held(owner: Any, held: int) -> None:
    """``owner`` was closed while ``held`` received slot arrays are alive."""
    warnings.warn(
        f"{owner!r} closed while {held} received slot array(s) are alive: their "
        "memory stays mapped until they die, but the peer will reuse the slots; "
        "release them first, or keep ringwire.copy_out() copies",
        ResourceWarning,
        stacklevel=3,
    )


class ReceiptBase:
    """What both receipts share: the slots of one sent record, and whether the peer
    has released them all.  ``run`` is the driver's loop runner (its ``wait`` runs
    :func:`ringwire._conn.waits.consumed`)."""

    __slots__ = ("_core", "_pairs", "_run")

    def __init__(self, core: Endpoint, pairs: Sequence[tuple[int, int]], run: Any = None) -> None:
        self._core = core
        self._pairs = tuple(pairs)
        self._run = run

    def __repr__(self) -> str:
        state = "consumed" if self.consumed else "in flight"
        return f"<{type(self).__name__} {len(self._pairs)} slot(s) {state}>"

    @property
    def slots(self) -> int:
        """How many slots the record used."""
        return len(self._pairs)

    @property
    def consumed(self) -> bool:
        """Has the peer released every slot of the record?  (Also ``True`` once the
        connection is gone: its slots came back to the pool then.)"""
        return not self._pairs or self._core.consumed(self._pairs)
