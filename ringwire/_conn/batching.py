"""The endpoint's per-record hot paths that run once per record of a batch.

Profiles of ``send_many`` / ``receive_many`` (issue 15) put most of a batch's time in
the Python around each record, not in the codec or the ring: a new
:class:`~ringwire._pool.protocols.Placement` per record, three nested calls per
encode, and two wrappers around every decode.  What is here takes that out:

* **Placements are used again** while they place nothing (:func:`take_placement` /
  :func:`keep_placement`): most records hold no array, and a placement that took no
  slot is an empty list.  The caller then gets :data:`NOTHING_PLACED`, so the reused
  placement is never kept by a receipt.  (Pools that declare
  ``reuses_placements``: a TCP placement carries its frames beside the list.)
* **A batch is encoded in one loop** (``Encoder.encode_many_with``) that stops only
  after a record that placed something; that record keeps the placement (the plain
  :class:`~ringwire.Encoder` and a pool that reuses placements).
* **A ring lane decodes with the raw decoder** (``Decoder.raw_decode``, msgspec's own
  bound method, called by the C ``read_many`` with no Python frame between), and the
  error handling -- the translation to :class:`~ringwire.DecodeError`, the salvage of
  a bad record's slot references -- runs only when a record fails (``on_error``).

The contracts are :class:`~ringwire._conn.endpoint.Endpoint`'s: these functions are
its methods' bodies.  They read and write an endpoint through :class:`Batching` (what
they need of one; the endpoint is one), so this module does not import the endpoint
that calls it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NoReturn, Protocol

from anyio import BrokenResourceError

from .._errors import DecodeError, NeedSlot, RingCorrupted
from .._pool.cuda import CudaNeed
from .._pool.protocols import Placed, RecvPool, SendPool
from .._wire.codec import Decoder, Encoder
from .._wire.control import DOORBELL_SPACE
from .transport import FrameReader, FrameWriter

__all__ = [
    "NOTHING_PLACED",
    "Batching",
    "decode_failed",
    "encode_batch",
    "keep_placement",
    "read_ring_batch",
    "take_placement",
]

class Batching(Protocol):
    """What these functions use of an endpoint (``spare`` / ``spare_policy``: the
    placement kept for the next record, which they take and put back)."""

    spare: Any
    spare_policy: str | None

    @property
    def tx_blocked(self) -> bool: ...
    @property
    def reuse_placement(self) -> bool: ...
    @property
    def pool(self) -> SendPool | None: ...
    @property
    def peer(self) -> RecvPool | None: ...
    @property
    def enc(self) -> Encoder: ...
    @property
    def tx(self) -> FrameWriter: ...
    @property
    def rx(self) -> FrameReader: ...
    def check_send(self) -> None: ...
    def encode_placed(self, item: Any, policy: str | None) -> tuple[bytes, Placed]: ...
    def break_(self, exc: BaseException) -> None: ...
    def ring(self, byte: bytes) -> None: ...


NOTHING_PLACED: Placed = []
"""What a record that took no slot gets as its placement (read only: never appended to)."""


def take_placement(core: Batching, pool: Any, policy: str | None) -> Any:
    """The placement for the next record: the spare one if its policy matches."""
    placement = core.spare
    core.spare = None
    if placement is None or core.spare_policy != policy:
        placement = pool.placement(policy)
        core.spare_policy = policy
    return placement


def keep_placement(core: Batching, placement: Any) -> Placed:
    """What the encoded record placed: ``placement`` itself, or (an empty placement
    of a pool that reuses placements, kept as the spare) :data:`NOTHING_PLACED`."""
    if placement or not core.reuse_placement:
        return placement
    core.spare = placement
    return NOTHING_PLACED


def encode_batch(
    core: Batching, items: Sequence[Any], start: int, policy: str | None
) -> tuple[list[bytes], list[Placed], int | CudaNeed | None]:
    """``Endpoint.encode_batch``: encode ``items[start:]`` until one needs a slot that
    is not free (policy "wait"): the payloads so far, their slots, and the bytes that
    one needs.  Raises what ``Endpoint.encode_placed`` raises (nothing is held then)."""
    pool = core.pool
    assert pool is not None
    payloads: list[bytes] = []
    placed: list[Placed] = []
    if core.reuse_placement and type(core.enc) is Encoder:
        return _encode_batch_reusing(core, pool, items, start, policy, payloads, placed)
    try:
        for k in range(start, len(items)):
            try:
                payload, p = core.encode_placed(items[k], policy)
            except NeedSlot as need:
                return payloads, placed, need.nbytes
            payloads.append(payload)
            placed.append(p)
    except BaseException:
        for p in placed:
            pool.abort(p)
        raise
    return payloads, placed, None


def _encode_batch_reusing(
    core: Batching,
    pool: Any,
    items: Sequence[Any],
    start: int,
    policy: str | None,
    payloads: list[bytes],
    placed: list[Placed],
) -> tuple[list[bytes], list[Placed], int | CudaNeed | None]:
    if core.tx_blocked:
        core.check_send()  # closed, broken or gone: nothing to place
    limit = core.tx.max_payload
    placement = take_placement(core, pool, policy)
    k = start
    try:
        while k < len(items):
            first = len(payloads)
            try:
                k = core.enc.encode_many_with(items, k, placement, payloads)
            except NeedSlot as need:
                pool.abort(placement)  # what that record placed before it needed more
                placed.extend([NOTHING_PLACED] * (len(payloads) - first))
                return payloads, placed, need.nbytes
            placed.extend([NOTHING_PLACED] * (len(payloads) - first))
            if placement:  # the chunk's last record placed something: it keeps it
                placed[-1] = placement
                placement = pool.placement(policy)
            longest = max(map(len, payloads[first:]), default=0)
            if longest > limit:
                core.tx.check_size(longest)
    except BaseException:
        pool.abort(placement)
        for p in placed:
            pool.abort(p)
        raise
    core.spare = placement
    return payloads, placed, None


def decode_failed(peer: Any, dec: Decoder, view: memoryview, exc: Exception) -> NoReturn:
    """``dec.raw_decode(view)`` raised ``exc``: raise what ``Decoder.decode`` would,
    after releasing the slot references of the undecodable record (``peer.salvage``)."""
    try:
        dec.reraise(exc)
    except DecodeError:
        if peer is not None:
            peer.salvage(view)
        raise


def read_ring_batch(
    core: Batching, dec: Decoder, max_n: int
) -> tuple[list[Any], int, tuple[bytes, str] | None]:
    """``Endpoint.try_receive_many`` on a ring lane (no undecodable record pending):
    the records, their payload bytes, and the (payload, error) of an undecodable
    frame the batch ended before (left unread; the endpoint keeps it so that frame is
    never decoded twice).  Raises :class:`DecodeError` for an undecodable first frame
    (consumed, its references salvaged) and ``BrokenResourceError`` for a corrupt
    ring (the connection is broken)."""
    peer = core.peer
    out: list[Any] = []
    # (payload, error message) of an undecodable frame; no exception objects here:
    # their tracebacks' frames would hold this batch's records
    failures: list[tuple[bytes, str]] = []

    def on_error(view: memoryview, exc: Exception) -> Any:
        try:
            dec.reraise(exc)
        except DecodeError as err:
            if peer is not None:
                failures.append((bytes(view), str(err)))
            raise

    nbytes = read_batch(core, dec.raw_decode, max_n, out, failures, on_error)
    return out, nbytes, failures[-1] if failures else None


def read_batch(
    core: Batching,
    decode: Any,
    max_n: int,
    out: list[Any],
    failures: list[tuple[bytes, str]],
    on_error: Any = None,
) -> int:
    """``core.rx.read_many`` (with ``on_error`` where given: a ring lane) into ``out``;
    its payload bytes.  Whatever happens, what was read is committed (and the writer
    rung for the space).  An undecodable frame (``DecodeError``; ``failures`` has its
    payload last) is consumed and its references salvaged; a corrupt ring breaks the
    connection (``BrokenResourceError``)."""
    rx: Any = core.rx
    try:
        if on_error is None:
            return int(rx.read_many(decode, max_n, out))
        return int(rx.read_many(decode, max_n, out, on_error))
    except DecodeError:
        peer = core.peer
        if peer is not None and failures:  # the frame was consumed
            peer.salvage(failures[-1][0])
        raise
    except RingCorrupted as exc:
        core.break_(exc)
        raise BrokenResourceError(f"connection broken: {exc}") from exc
    finally:
        if rx.pending:
            rx.commit()
            if rx.writer_needs_doorbell():
                core.ring(DOORBELL_SPACE)
