"""Tests of ringwire._wire.record: the Record base class."""

from __future__ import annotations

import uuid
import weakref
from typing import Optional

import msgspec
import numpy as np
import pytest

from ringwire import Decoder, Encoder, Record

enc = Encoder()


class Item(Record):
    modality: str
    hash: Optional[int] = None
    offsets: Optional[list[tuple[int, int]]] = None
    feature: object = None


def test_undeclared_attributes_travel_in_extras() -> None:
    item = Item(modality="audio")
    item.audio_feature_lens = (3, 4)
    item.scale = np.float32(0.5)
    assert item.audio_feature_lens == (3, 4)
    back = Decoder(Item).decode(enc.encode(item))
    assert back.audio_feature_lens == (3, 4) and type(back.audio_feature_lens) is tuple
    assert type(back.scale) is np.float32
    assert back.extras == {"audio_feature_lens": (3, 4), "scale": np.float32(0.5)}
    with pytest.raises(AttributeError, match="nope"):
        _ = back.nope
    del back.scale
    assert "scale" not in back.extras


def test_private_attributes_are_not_serialized() -> None:
    item = Item(modality="x")
    item._cache = object()
    assert "_cache" not in item.extras
    back = Decoder(Item).decode(enc.encode(item))
    assert not hasattr(back, "_cache")


@pytest.mark.parametrize("value", [2**64 + 5, 2**200 + 17, uuid.UUID(int=2**127 + 3).int, -1, 7])
def test_hash_is_normalized_to_low_64_bits(value: int) -> None:
    expect = value & (2**64 - 1)
    item = Item(modality="x", hash=value)
    assert item.hash == expect
    item2 = Item(modality="x")
    item2.hash = value
    assert item2.hash == expect
    assert Decoder(Item).decode(enc.encode(item)).hash == expect


def test_list_of_tuple_fields_come_back_as_tuples() -> None:
    back = Decoder(Item).decode(enc.encode(Item(modality="x", offsets=[(0, 5), (7, 9)])))
    assert back.offsets == [(0, 5), (7, 9)]
    assert all(type(p) is tuple for p in back.offsets)


def test_appending_a_field_with_default_still_decodes_old_messages() -> None:
    class V1(Record):
        a: int
        b: str = "x"

    class V2(Record):
        a: int
        b: str = "x"
        c: list[int] = []
        d: Optional[float] = None

    old = V1(a=1, b="y")
    old.tag = "kept"
    new = Decoder(V2).decode(enc.encode(old))
    assert (new.a, new.b, new.c, new.d, new.tag) == (1, "y", [], None, "kept")


def test_subclasses_are_kw_only_so_extras_stays_first_on_the_wire() -> None:
    class Sub(Record):
        a: int

    assert Sub.__struct_fields__[0] == "extras"
    with pytest.raises(TypeError):
        Sub(1)  # type: ignore[misc]
    assert msgspec.msgpack.decode(enc.encode(Sub(a=3))) == [{}, 3]


def test_records_are_weak_referenceable() -> None:
    item = Item(modality="x")
    fired = []
    weakref.finalize(item, fired.append, True)
    del item
    assert fired == [True]


def test_set_stores_in_extras() -> None:
    item = Item(modality="x")
    item.set("modality", "shadow")
    assert item.modality == "x" and item.extras["modality"] == "shadow"
