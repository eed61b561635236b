"""The seam between an endpoint and the thing that carries its frames.

Theory of operation
-------------------
An endpoint (:class:`~ringwire._conn.endpoint.Endpoint`) is the logic of one end of a
connection -- ordering, batching, slot safe points, receipts, statistics, errors --
and does no I/O of its own: every byte goes through a :class:`Transport`.  The
blocking and async drivers (:mod:`.sync_channel`, :mod:`.async_channel`) add only the
waiting, and they wait only on what the transport hands them (:meth:`Transport.fileno`).
The shared-memory ring (:class:`ringwire._shm.transport.ShmTransport`) is the first
transport; :class:`ringwire._conn.memory.MemoryTransport` (two lists in one process)
is the second, and drives the endpoint in tests with no process, socket or segment.

The endpoint's states, and what each operation does in them::

    state        entered when                           send                 receive
    -----------  -------------------------------------  -------------------  ------------------------
    open         the handshake finished                 publishes            reads
    eof sent     send_eof() (our writer-closed flag)    ClosedResourceError  reads
    peer closed  the peer's reader-closed flag is set   BrokenResourceError  reads
    peer gone    the transport reports the hang-up      BrokenResourceError  the rest, then EndOfStream
                 (drain() or hung_up(): the peer's                           (its writer-closed flag is
                 process closed or died)                                     set) or BrokenResourceError
    broken       a protocol violation: a corrupt        BrokenResourceError  BrokenResourceError
                 frame, garbage doorbell, forged        (cause attached)     (cause attached)
                 release (we abort: the peer is told
                 why; the transport is shut down)
    aborted      the peer's abort arrived: it dropped   BrokenResourceError  the rest, then
                 the connection and said why            (with the reason)    BrokenResourceError
    closed       close() / aclose()                     ClosedResourceError  ClosedResourceError

A receiver that finds no frame checks, in that order: the peer's writer-closed flag
(``EndOfStream`` once the lane is empty), the hang-up (``BrokenResourceError`` once the
lane is empty), and otherwise waits.  Every state but *open* and *eof sent* is final.

What a transport guarantees
---------------------------
1. **Ordering.**  The frames of one lane reach the reader once each, whole, in the
   order they were published.  :meth:`FrameWriter.try_write` publishes one frame or
   nothing (``False``: no room now); :meth:`FrameWriter.write_many` publishes a prefix.
2. **The fence.**  A frame's bytes are visible to the reader no later than the frame
   itself (publish is a release, :meth:`FrameReader.next_frame` an acquire), and the
   space of a frame is not reused before the reader's :meth:`FrameReader.commit` (so
   the reader may decode from a view of the frame until then).
3. **Wake-ups (an eventcount).**  An end about to wait calls ``park()`` on its lane,
   then re-checks.  A peer that publishes (or commits) after that ``park()`` sees
   ``reader_needs_doorbell()`` (``writer_needs_doorbell()``) true and calls
   :meth:`Transport.ring`, which makes the parked end's :meth:`Transport.fileno`
   readable.  No wake-up is lost; a spurious one is harmless (every wake-up re-checks).
4. **Liveness.**  When the peer closes or its process dies, :meth:`Transport.fileno`
   becomes readable and :meth:`Transport.drain` reports the hang-up;
   :meth:`Transport.hung_up` answers the same question without reading.  Nothing is
   guessed from a timeout.
5. **Close.**  :meth:`Transport.shutdown` wakes everything waiting on ``fileno()`` and
   tells the peer (it sees the hang-up); :meth:`Transport.close` frees everything.

A transport may also lend tensor pools (``send_pool`` / ``recv_pool``: arrays beside
the record, :mod:`ringwire._pool.protocols`); one that has none sets both to ``None``
and every array travels inline.  It brings the :class:`~ringwire.Encoder` its endpoint
encodes with (one of a subclass where records carry more than their bytes: the TCP
frames).  What differs between transports that the endpoint must know is declared
here or on the pools as attributes, read once when the endpoint is made (never found
out with ``isinstance`` on one transport's classes): ``FrameReader.read_many_on_error``,
``SendPool.releases_ready``, ``SendPool.reuses_placements``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from .._pool.protocols import RecvPool, SendPool
from .._wire.codec import Encoder

__all__ = ["FrameReader", "FrameWriter", "Transport"]


@runtime_checkable
class FrameWriter(Protocol):
    """The sending lane of a connection (one writer at a time)."""

    capacity: int  # bytes of the lane
    max_payload: int  # the largest frame it carries

    def check_size(self, n: int) -> None:
        """Raise :class:`~ringwire.FrameTooLarge` if an ``n``-byte frame can never fit."""

    def try_write(self, payload: Any) -> bool | None:
        """Publish one frame; ``False`` (nothing written) if there is no room now,
        ``None`` (nothing written) if the reader closed its end."""

    def write_many(self, payloads: Sequence[Any], start: int = 0) -> tuple[int, int]:
        """Publish ``payloads[start:]`` while they fit: ``(frames, payload bytes)``."""

    def fits_now(self, n: int) -> bool:
        """Would an ``n``-byte frame fit now?"""

    def used(self) -> int:
        """Bytes published and not yet consumed."""

    @property
    def reader_closed(self) -> bool:
        """The peer will read no more (its receiving end closed)."""

    def reader_needs_doorbell(self) -> bool:
        """After publishing: is the reader parked (and not rung for this park yet)?"""

    def reader_wants_doorbell_for_close(self) -> bool:
        """After :meth:`close`: is the reader parked at all?"""

    def park(self) -> None:
        """This end is about to wait for room (the caller re-checks after)."""

    def unpark(self) -> None: ...

    def close(self) -> None:
        """This end will publish no more (the peer's receive ends with ``EndOfStream``)."""

    def release(self) -> None:
        """Drop every view of the lane's memory."""


@runtime_checkable
class FrameReader(Protocol):
    """The receiving lane of a connection (one reader at a time).

    Reading is two-phase: :meth:`next_frame` / :meth:`read_many` hand out payload views
    one after the other; :meth:`commit` hands their space back to the writer."""

    capacity: int
    # read_many takes a fourth argument, on_error(payload, exc), called when fn raises
    # (with the payload still valid): so fn can be a raw decoder and the error handling
    # stays off the per-record path (the ring lanes)
    read_many_on_error: bool

    @property
    def pending(self) -> bool:
        """Frames were read and not committed."""

    def next_frame(self) -> memoryview | None:
        """The next frame's payload (valid until :meth:`commit`), or ``None``."""

    def read_many(self, fn: Callable[[memoryview], Any], max_n: int, out: list[Any]) -> int:
        """Append ``fn(payload)`` of up to ``max_n`` frames to ``out``; return the bytes
        read.  If ``fn`` raises on the first frame, that frame counts as read and the
        error propagates; on a later frame the batch ends before it."""

    def commit(self) -> None: ...

    def available(self) -> bool:
        """Is a frame published and not yet read?"""

    def fill(self) -> int:
        """Bytes published and not committed."""

    @property
    def writer_closed(self) -> bool:
        """The peer will publish no more."""

    def writer_needs_doorbell(self) -> bool:
        """After :meth:`commit`: is the writer parked for room (and not rung yet)?"""

    def park(self) -> None: ...

    def unpark(self) -> None: ...

    def close(self) -> None:
        """This end will read no more (the peer's sends fail)."""

    def release(self) -> None: ...


@runtime_checkable
class Transport(Protocol):
    """One end of a connection: two lanes, a doorbell, liveness, and its resources."""

    # (read-only for the endpoint; properties here so that a transport may declare
    # its own lane classes)
    @property
    def tx(self) -> FrameWriter: ...
    @property
    def rx(self) -> FrameReader: ...

    @property
    def send_pool(self) -> SendPool | None:
        """The pool this end places its arrays in (``None``: every array inline)."""

    @property
    def recv_pool(self) -> RecvPool | None:
        """The peer's pool, which resolves its references (``None``: it has none)."""

    encoder: Encoder  # what the endpoint encodes with (see the module docstring)
    # how arrays travel, and why not through NIXL ("" where they may, or no NIXL at all):
    # ChannelStatistics.tensor_path / nixl_off
    @property
    def tensor_path(self) -> str: ...

    nixl_off: str
    peer_pid: int  # the peer's process (0 if it has none)
    version: int  # the protocol version both ends speak
    doorbells_sent: int
    doorbells_received: int

    def fileno(self) -> int:
        """A descriptor that is readable while a doorbell or the hang-up is pending
        (what the drivers wait on)."""

    def ring(self, byte: bytes) -> bool:
        """Wake the peer (one of the ``DOORBELL_*`` bytes); ``False`` if it is gone."""

    def drain(self) -> bool:
        """Consume every pending doorbell without waiting; ``True`` if the peer hung
        up or aborted (then :attr:`peer_reason` says why).  Raises
        :class:`~ringwire.ProtocolError` for anything but doorbells and one last abort."""

    @property
    def peer_reason(self) -> str | None:
        """Why the peer dropped the connection, once its abort arrived (``None``: no
        abort, or not yet read)."""

    def abort(self, reason: str) -> None:
        """Tell the peer why this end drops the connection (best effort, never
        blocks; the caller closes right after)."""

    def hung_up(self) -> bool:
        """Has the peer hung up?  Never waits, consumes nothing."""

    def shutdown(self) -> None:
        """Wake everything waiting on :meth:`fileno`; the peer sees the hang-up."""

    def close(self) -> None:
        """Free everything (the slot pools are the endpoint's to close)."""
