"""Every waiting loop of an endpoint, written once, for both drivers.

A loop is a generator over an :class:`~ringwire._conn.endpoint.Endpoint`.  It does
the whole cycle itself -- try the operation, spin, park, re-check -- and *yields* a
:class:`Wait` when only waiting is left: "wake me when the wake generation moves past
``gen``, or at ``until`` (a ``time.monotonic()`` value; ``None``: no limit)".  The
driver performs that wait and resumes the loop, which tries again; the loop's
``return`` value is the operation's result, and an exception in it is the operation's
error.  A driver that is cancelled mid-wait closes the loop, whose ``finally`` blocks
unpark and give back what was not sent.

=================  ==================================  =================================
loop               waits for                           until
=================  ==================================  =================================
:func:`room`       room in the send lane for a frame   the wait limit (``stalled``)
:func:`room_many`  room for the rest of a batch        the wait limit (``stalled``)
:func:`slot`       a free slot of ``nbytes``           the slot wait (``slot_timeout``:
                                                       SlotsExhausted) or the wait limit
                                                       (``stalled``); re-checks every
                                                       50 ms while loans are out (a
                                                       dropped loan rings no doorbell)
:func:`consumed`   the peer's release of given slots   ``deadline`` (TimeoutError)
:func:`receive`    a record                            ``deadline`` (TimeoutError);
                                                       EndOfStream / BrokenResourceError
                                                       once the peer is done
=================  ==================================  =================================

Composite operations are loops made of these (:func:`send_placed`,
:func:`send_many_placed`, :func:`loan`, :func:`receive_many`).  The async driver
passes ``deadline=None`` (anyio's cancel scopes bound it instead); the blocking
driver passes its ``timeout`` as a deadline.  Every loop is entered after the
operation's fast path failed once, so the fast paths never pay for a generator.

The wait limit of a send (:func:`wait_limit`) is the earlier of ``deadline`` and the
endpoint's stall deadline (its ``stall_timeout`` from the start of the wait; a channel
has none, a broadcast writer has its readers' ``stall_timeout``).  What a send that
reached it raises is the endpoint's ``stalled(need, waited, slot)`` hook's to say (a
broadcast writer's :class:`~ringwire.ReaderStalled` names the readers it waited for),
a plain ``TimeoutError`` where it has none.  A record that placed slots is reported to
the endpoint's ``on_published`` (where it has one) right after it was published.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Generator, Sequence
from typing import Any, NamedTuple, TypeVar

from .._errors import NeedSlot
from .._pool.protocols import Placed
from .._wire.codec import Decoder
from .endpoint import EMPTY, UNSET, Endpoint

__all__ = [
    "Loop",
    "Wait",
    "consumed",
    "loan",
    "receive",
    "receive_many",
    "room",
    "room_many",
    "send_many_placed",
    "send_placed",
    "slot",
    "wait_limit",
]

T = TypeVar("T")
LOAN_TICK = 0.05  # a sender waiting for a slot re-checks this often while loans are out
SLOW_SLOT_WAIT = 1.0  # a slot wait longer than this logs a warning (once per connection)


class Wait(NamedTuple):
    """What a loop waits for: a wake-up after generation ``gen``, or ``until``."""

    gen: int
    until: float | None


Loop = Generator[Wait, None, T]

_RX, _TX, _SLOTS = 0, 1, 2


def _timed_out(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() >= deadline


def _park(
    core: Endpoint,
    lane: int,
    ready: Callable[..., bool],
    args: tuple[Any, ...],
    deadline: float | None,
    until: float | None,
) -> Loop[None]:
    """Park on ``lane``, re-check ``ready(*args)``, and wait unless it became true.

    The park comes first and the re-check after it: a peer that makes ``ready`` true
    after the check sees the parked flag and rings (the eventcount, see
    :mod:`ringwire._wire.ring`), so the wait below cannot miss it."""
    gen = core.wake_gen
    pool = core.pool
    if lane == _RX:
        core.park_rx()
    elif lane == _TX:
        core.park_tx()
    else:
        assert pool is not None
        pool.park()
    try:
        if ready(*args):
            return
        if _timed_out(deadline):
            raise TimeoutError("ringwire channel operation timed out")
        if lane == _RX:
            core.recv_parks += 1
        elif lane == _TX:
            core.send_parks += 1
        else:
            core.slot_waits += 1
        yield Wait(gen, until)
    finally:
        if lane == _RX:
            core.unpark_rx()
        elif lane == _TX:
            core.unpark_tx()
        elif pool is not None:
            pool.unpark()


def wait_limit(core: Endpoint, deadline: float | None) -> float | None:
    """The earlier of ``deadline`` and the endpoint's ``stall_timeout`` from now."""
    stall = core.stall_timeout
    if stall is None:
        return deadline
    limit = time.monotonic() + stall
    return limit if deadline is None or limit < deadline else deadline


def _stalled(core: Endpoint, need: Any, waited: float, slot: bool) -> TimeoutError:
    """What a send that waited ``waited`` s for room (``slot``: a slot) raises."""
    if core.stalled is None:
        return TimeoutError("ringwire channel operation timed out")
    return core.stalled(need, waited, slot)


def room(core: Endpoint, payload: bytes, deadline: float | None = None) -> Loop[None]:
    """Until ``payload`` is published."""
    size = len(payload)
    limit = wait_limit(core, deadline)
    started = time.monotonic()
    while not core.try_send(payload):
        if not core.spin(core.send_ready, size):
            if limit is not None and time.monotonic() >= limit:
                raise _stalled(core, size, time.monotonic() - started, False)
            yield from _park(core, _TX, core.send_ready, (size,), None, limit)


def room_many(
    core: Endpoint,
    payloads: Sequence[bytes],
    placed: Sequence[Placed] | None,
    deadline: float | None = None,
) -> Loop[None]:
    """Until every payload is published; the slots of those that were not (an error,
    a timeout, a cancellation) are given back."""
    limit = wait_limit(core, deadline)
    started = time.monotonic()
    told = core.on_published if placed is not None else None
    i = 0
    try:
        i = core.try_send_many(payloads, 0)
        if told is not None:
            _tell(told, placed, 0, i)
        while i < len(payloads):
            size = len(payloads[i])
            if not core.spin(core.send_ready, size):
                if limit is not None and time.monotonic() >= limit:
                    raise _stalled(core, size, time.monotonic() - started, False)
                yield from _park(core, _TX, core.send_ready, (size,), None, limit)
            n = core.try_send_many(payloads, i)
            if told is not None and n:
                _tell(told, placed, i, i + n)
            i += n
    finally:
        pool = core.pool
        if placed is not None and pool is not None:
            for p in placed[i:]:
                pool.abort(p)


def _tell(told: Callable[[Placed], None], placed: Any, start: int, stop: int) -> None:
    for k in range(start, stop):
        if placed[k]:
            told(placed[k])


def publish_placed(
    core: Endpoint, payload: bytes, placed: Placed, deadline: float | None = None
) -> Loop[None]:
    """Publish a record that took slots; give them back if it is not published."""
    published = False
    try:
        if not core.try_send(payload):
            yield from room(core, payload, deadline)
        published = True
        if core.on_published is not None:
            core.on_published(placed)
    finally:
        if not published and core.pool is not None:
            core.pool.abort(placed)


def slot(
    core: Endpoint,
    nbytes: Any,
    deadline: float | None = None,
    slot_deadline: float | None = None,
) -> Loop[None]:
    """Until a slot for ``nbytes`` (an ``int``, or a ``CudaNeed``) is free."""
    pool = core.require_pool()
    limit = wait_limit(core, deadline)
    started: float | None = None
    while not core.check_slot_wait(nbytes):
        if core.spin(core.slot_wait_ready, nbytes):
            continue
        now = time.monotonic()
        if started is None:
            started = now
        elif now - started > SLOW_SLOT_WAIT:
            core.warn_slow_slot_wait(nbytes, now - started)
        if limit is not None and now >= limit:
            raise _stalled(core, nbytes, now - started, True)
        if slot_deadline is not None and now >= slot_deadline:
            raise core.slot_timeout(nbytes)
        until = math.inf
        for t in (limit, slot_deadline):
            if t is not None:
                until = min(until, t)
        if pool.loans:
            until = min(until, now + LOAN_TICK)  # a dropped loan rings no doorbell
        if started + SLOW_SLOT_WAIT > now and not core.slot_wait_warned:
            until = min(until, started + SLOW_SLOT_WAIT + 0.001)  # to warn on time
        yield from _park(
            core,
            _SLOTS,
            core.slot_wait_ready,
            (nbytes,),
            None,
            None if until == math.inf else until,
        )


def _first_slot_deadline(core: Endpoint, current: float | None) -> float | None:
    return core.slot_deadline() if current is UNSET else current


def send_placed(
    core: Endpoint, item: Any, policy: str | None, deadline: float | None = None
) -> Loop[Placed]:
    """Encode ``item`` into slots (waiting for free ones under policy "wait") and
    publish it; return the slots it took."""
    core.slot_safe_point()
    slot_deadline: float | None = UNSET
    while True:
        try:
            payload, placed = core.encode_placed(item, policy)
            break
        except NeedSlot as need:
            slot_deadline = _first_slot_deadline(core, slot_deadline)
            yield from slot(core, need.nbytes, deadline, slot_deadline)
    yield from publish_placed(core, payload, placed, deadline)
    return placed


def send_many_placed(
    core: Endpoint, items: Sequence[Any], policy: str | None, deadline: float | None = None
) -> Loop[None]:
    """Send ``items`` in batches: each batch ends before a record that waits for a
    slot, and the batch goes out before the wait."""
    core.slot_safe_point()
    slot_deadline: float | None = UNSET
    i = 0
    while i < len(items):
        payloads, placed, need = core.encode_batch(items, i, policy)
        if payloads:
            yield from room_many(core, payloads, placed, deadline)
            i += len(payloads)
        if need is not None:
            slot_deadline = _first_slot_deadline(core, slot_deadline)
            yield from slot(core, need, deadline, slot_deadline)


def loan(core: Endpoint, spec: Any, policy: str, deadline: float | None = None) -> Loop[Any]:
    """A loaned array (see ``loan_spec``), waiting for a slot under policy "wait"."""
    pool = core.require_pool()
    slot_deadline: float | None = UNSET
    while True:
        arr = core.loan_now(pool, spec, policy)
        if arr is not None:
            return arr
        slot_deadline = _first_slot_deadline(core, slot_deadline)
        yield from slot(core, spec[-1], deadline, slot_deadline)


def consumed(
    core: Endpoint, pairs: Sequence[tuple[int, int]], deadline: float | None = None
) -> Loop[None]:
    """Until the peer has released every ``(slot, generation)`` in ``pairs``."""
    pool = core.require_pool()
    while not core.consumed(pairs):
        yield from _park(core, _SLOTS, _not_idle, (pool,), deadline, deadline)


def _not_idle(pool: Any) -> bool:
    return bool(pool.has_work())


def receive(core: Endpoint, dec: Decoder, deadline: float | None = None) -> Loop[Any]:
    """The next record (entered after a try found none)."""
    while True:
        core.check_finished()
        if not core.spin(core.receive_ready):
            yield from _park(core, _RX, core.receive_ready, (), deadline, deadline)
        obj = core.try_receive(dec)
        if obj is not EMPTY:
            return obj


def receive_many(
    core: Endpoint, dec: Decoder, max_n: int, deadline: float | None = None
) -> Loop[list[Any]]:
    """At least one record, then every published one up to ``max_n``."""
    while True:
        core.check_finished()
        if not core.spin(core.receive_ready):
            yield from _park(core, _RX, core.receive_ready, (), deadline, deadline)
        out = core.try_receive_many(dec, max_n)
        if out:
            return out
