"""Tests of ringwire._wire.slotlayout: slot-pool arithmetic on a plain bytearray."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringwire import DecodeError, RingwireError
from ringwire._errors import SlotRefused
from ringwire._wire.slotlayout import (
    FREE,
    LOANED,
    SENT,
    SlotAllocator,
    SlotClass,
    check_ref,
    init_pool,
    pool_size,
    read_pool,
    slot_state,
)
from ringwire.wire import SlotRef

CLASSES = [SlotClass(1 << 20, 2), SlotClass(100, 3), SlotClass(64 << 10, 4)]


def make_pool() -> tuple[bytearray, SlotAllocator]:
    buf = bytearray(pool_size(CLASSES))
    layout = init_pool(buf, CLASSES, pool_id=0xABC)
    return buf, SlotAllocator(buf, layout)


def test_layout_is_aligned_and_disjoint() -> None:
    buf, alloc = make_pool()
    layout = read_pool(buf)
    assert layout == alloc.layout and layout.nslots == 9 and layout.pool_id == 0xABC
    spans = sorted(zip(layout.offsets, layout.capacities))
    for off, cap in spans:
        assert off % 64 == 0
        assert cap < 4096 or off % 4096 == 0
    for (a, acap), (b, _) in zip(spans, spans[1:]):
        assert a + acap <= b
    assert spans[-1][0] + spans[-1][1] <= len(buf)


def test_allocate_picks_smallest_fitting_class_and_exhausts() -> None:
    _, alloc = make_pool()
    s = alloc.allocate(50)
    assert s is not None and alloc.layout.capacities[s] == 100
    got = [alloc.allocate(100) for _ in range(2)]
    assert all(alloc.layout.capacities[g] == 100 for g in got if g is not None)
    spill = alloc.allocate(100)  # the 100-byte class is exhausted: next class up
    assert spill is not None and alloc.layout.capacities[spill] == 64 << 10
    for _ in range(3):
        assert alloc.allocate(64 << 10) is not None
    assert alloc.allocate(64 << 10) is not None  # a 1 MiB slot
    assert alloc.allocate(1 << 20) is not None
    assert alloc.allocate(1) is None
    with pytest.raises(ValueError, match="largest slot"):
        alloc.allocate((1 << 20) + 1)


def test_state_machine_and_generations() -> None:
    buf, alloc = make_pool()
    s = alloc.allocate(10)
    assert s is not None
    assert slot_state(buf, s) == (0, LOANED)
    alloc.mark_sent(s)
    assert slot_state(buf, s) == (0, SENT)
    ref = alloc.ref(s, 8, (2,), "<i4", "numpy")
    check_ref(buf, alloc.layout, ref)
    alloc.release(s, 0)
    assert slot_state(buf, s) == (1, FREE)
    with pytest.raises(DecodeError, match="stale"):
        check_ref(buf, alloc.layout, ref)
    with pytest.raises(SlotRefused, match="double release"):
        alloc.release(s, 0)
    with pytest.raises(SlotRefused):
        alloc.release(s, 1)  # FREE: never sent at this generation
    with pytest.raises(SlotRefused, match="pool has"):
        alloc.release(999, 0)
    assert alloc.in_use() == 0


def test_cancel_and_reclaim() -> None:
    buf, alloc = make_pool()
    a, b, c = (alloc.allocate(10) for _ in range(3))
    assert a is not None and b is not None and c is not None
    alloc.mark_sent(a)
    alloc.mark_sent(b)
    alloc.cancel(c)
    assert alloc.status(c) == FREE
    assert alloc.reclaim_sent() == 2
    assert alloc.in_use() == 0
    assert slot_state(buf, a) == (1, FREE)
    with pytest.raises(RingwireError, match="not loaned"):
        alloc.mark_sent(a)


def _ref(alloc: SlotAllocator, **changes: object) -> SlotRef:
    s = alloc.allocate(64)
    assert s is not None
    alloc.mark_sent(s)
    return msgspec.structs.replace(alloc.ref(s, 64, (16,), "<i4", "numpy"), **changes)


def test_forged_references_are_refused() -> None:
    buf, alloc = make_pool()
    good = _ref(alloc)
    check_ref(buf, alloc.layout, good)
    start, cap = alloc.layout.offsets[good.slot], alloc.layout.capacities[good.slot]
    for bad, msg in (
        (msgspec.structs.replace(good, pool=0xDEF), "not this connection"),
        (msgspec.structs.replace(good, slot=10_000), "slot 10000"),
        (msgspec.structs.replace(good, offset=start - 64), "outside slot"),
        (msgspec.structs.replace(good, offset=start + cap - 32), "outside slot"),
        (msgspec.structs.replace(good, generation=7), "stale"),
    ):
        with pytest.raises(DecodeError, match=msg):
            check_ref(buf, alloc.layout, bad)


def test_read_pool_rejects_garbage() -> None:
    with pytest.raises(RingwireError, match="too small"):
        read_pool(bytearray(10))
    with pytest.raises(RingwireError, match="magic"):
        read_pool(bytearray(4096))
    buf, _ = make_pool()
    buf[16:24] = (10**9).to_bytes(8, "little")
    with pytest.raises(RingwireError, match="claims"):
        read_pool(buf)


def test_bad_classes_are_value_errors() -> None:
    with pytest.raises(ValueError):
        SlotClass(0, 1)
    with pytest.raises(ValueError):
        SlotClass(10, -1)
    with pytest.raises(ValueError):
        pool_size([])


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["alloc", "send", "release", "reclaim"]), st.integers(0, 70_000)),
        max_size=60,
    )
)
def test_random_operations_keep_table_and_allocator_in_step(ops: list[tuple[str, int]]) -> None:
    buf, alloc = make_pool()
    loaned: list[int] = []
    sent: list[int] = []
    for op, n in ops:
        if op == "alloc":
            s = alloc.allocate(n)
            if s is not None:
                assert alloc.layout.capacities[s] >= n
                loaned.append(s)
        elif op == "send" and loaned:
            s = loaned.pop()
            alloc.mark_sent(s)
            sent.append(s)
        elif op == "release" and sent:
            s = sent.pop(n % len(sent))
            alloc.release(s, alloc.generation(s))
        elif op == "reclaim":
            assert alloc.reclaim_sent() == len(sent)
            sent.clear()
        assert len(set(loaned + sent)) == len(loaned) + len(sent)
        assert alloc.in_use() == len(loaned) + len(sent)
        for s in range(alloc.layout.nslots):
            assert slot_state(buf, s) == (alloc.generation(s), alloc.status(s))


def test_unsend_slot_at_and_can_allocate() -> None:
    buf, alloc = make_pool()
    layout = alloc.layout
    assert alloc.can_allocate(1 << 20) and not alloc.can_allocate((1 << 20) + 1)
    slot = alloc.allocate(100)
    assert slot is not None
    off = layout.offsets[slot]
    assert alloc.slot_at(off, 100) == slot and alloc.slot_at(off + 10, 90) == slot
    assert alloc.slot_at(off + 10, 100) is None  # runs past the slot
    assert alloc.slot_at(0, 1) is None  # the header
    alloc.mark_sent(slot)
    gen = alloc.generation(slot)
    alloc.unsend(slot)  # a reference that was never published
    assert alloc.status(slot) == LOANED and slot_state(buf, slot) == (gen, LOANED)
    with pytest.raises(RingwireError):
        alloc.unsend(slot)
    alloc.cancel(slot)
    assert alloc.status(slot) == FREE
    for _ in range(2):
        big = alloc.allocate(1 << 20)
        assert big is not None
    assert not alloc.can_allocate(1 << 20) and alloc.can_allocate(100)
