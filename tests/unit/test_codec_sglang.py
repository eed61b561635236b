"""The SGLang profile against a model of SGLang's own codec (tests/support/sglang_model.py).

The contract, both directions:

* what ``Encoder(profile="sglang")`` writes, SGLang's decoder reads into exactly what
  it reads from SGLang's own bytes for the same value -- checked as the strongest
  form: the bytes are equal;
* what SGLang writes, ``Decoder(profile="sglang")`` reads into the values SGLang's
  decoder gives (its transport objects as :class:`ringwire.SGLangState`).
"""

from __future__ import annotations

import array
import dataclasses
import datetime
import decimal
import random
import uuid
import weakref
from typing import Any, List, Optional, Tuple

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.extras import NO_TORCH

from ringwire import DecodeError, Decoder, EncodeError, Encoder, SGLangRecord, SGLangState
from ringwire.wire import SlotRef

# SGLang runs on torch, and so does the model of its codec that every test here checks
# against (tests/unit/test_codec.py's SGLANG_GOLDEN checks the profile's bytes without it).
torch = pytest.importorskip("torch", reason=NO_TORCH + ": the SGLang model needs it")

from support import sglang_model as sg  # noqa: E402

Ext = msgspec.msgpack.Ext


def _to_state(obj: Any) -> Any:
    """The enc_hook an SGLang process gives ringwire: its transport objects as states."""
    if isinstance(obj, sg.ShmPointerMMData):
        return SGLangState(SGLangState.SHM_POINTER, obj.__getstate__())
    if isinstance(obj, sg.CudaIpcTensorTransportProxy):
        state = {"proxy_state": obj.proxy_state, "sync_data_meta": obj.sync_data_meta}
        return SGLangState(SGLangState.CUDA_IPC_PROXY, state)
    raise TypeError(f"no SGLang form for {type(obj).__name__}")


enc = Encoder(profile="sglang", enc_hook=_to_state)
dec = Decoder(profile="sglang")


def normalize(v: Any) -> Any:
    """A value the model decoded, with its transport objects as ringwire's states."""
    if isinstance(v, sg.ShmPointerMMData):
        return SGLangState(4, normalize(v.__getstate__()))
    if isinstance(v, sg.CudaIpcTensorTransportProxy):
        return SGLangState(
            5,
            {
                "proxy_state": normalize(v.proxy_state),
                "sync_data_meta": normalize(v.sync_data_meta),
            },
        )
    if isinstance(v, dict):
        return {k: normalize(x) for k, x in v.items()}
    if type(v) in (list, tuple):
        return type(v)(normalize(x) for x in v)
    return v


def same(a: Any, b: Any) -> bool:
    """Equal values of exactly the same types, all the way down."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return (
            a.dtype == b.dtype
            and a.shape == b.shape
            and a.device == b.device
            and bytes(a.contiguous().reshape(-1).view(torch.uint8).numpy())
            == bytes(b.contiguous().reshape(-1).view(torch.uint8).numpy())
        )
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and not isinstance(a, torch.Size):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, SGLangState):
        return a.code == b.code and same(a.state, b.state)
    if isinstance(a, msgspec.Struct):
        fields = a.__struct_fields__
        return all(same(getattr(a, f), getattr(b, f)) for f in fields)
    if isinstance(a, float) and a != a:
        return b != b
    return bool(a == b)


class Item(SGLangRecord):
    """SGLang's MultimodalDataItem declared on ringwire's SGLang record base."""

    modality: sg.Modality
    hash: Optional[int] = None
    pad_value: Optional[int] = None
    offsets: Optional[List[Tuple[int, int]]] = None
    format: sg.MultimodalInputFormat = sg.MultimodalInputFormat.NORMAL
    feature: Optional[object] = None
    precomputed_embeddings: Optional[object] = None
    keep_device_embedding: bool = False


class Output(SGLangRecord, model_specific_data=False):
    mm_items: List[Item]
    input_ids: Optional[List[int]] = None
    padded_input_ids: Optional[List[int]] = None
    im_token_id: Optional[int] = None
    mrope_positions: Optional[torch.Tensor] = None


@dataclasses.dataclass
class Point:
    x: int


def _values() -> list[Any]:
    ts = torch.arange(12, dtype=torch.int64).reshape(3, 4)
    return [
        ts,
        ts.T,  # non-contiguous
        torch.empty((0, 3), dtype=torch.float16),
        torch.ones(2, 2, dtype=torch.bfloat16),
        torch.tensor([1.5, -2.0]).to(torch.float8_e4m3fn),
        torch.tensor(3.0),
        np.arange(6, dtype=">f8").reshape(2, 3),
        np.arange(10, dtype=np.int32)[::3],
        np.array(7, dtype=np.int16),  # 0-d: SGLang makes it [7]
        np.array(["ab", "c"]),
        np.zeros((2, 0), dtype=np.uint8),
        np.array(["2026-01-01"], dtype="M8[D]"),
        array.array("i", [3, -1, 7]),
        array.array("d", []),
        np.float32(1.5),
        np.float16(0.25),
        np.float64(2.5),
        np.int64(-3),
        np.uint64(2**64 - 1),
        np.uint8(7),
        np.bool_(True),
        (1, 2),
        ((1, (2,)), [3, (4, 5)]),
        torch.Size([2, 3]),
        {1, 2},
        frozenset({"a"}),
        datetime.datetime(2026, 11, 29, 9, 0),
        datetime.datetime(2026, 11, 29, 9, 0, tzinfo=datetime.timezone.utc),
        datetime.date(2026, 11, 29),
        datetime.timedelta(seconds=90),
        uuid.UUID(int=5),
        decimal.Decimal("1.25"),
        sg.Modality.VIDEO,
        Point(3),
        bytearray(b"ab"),
        {"a": [1, None, True, 1.5, "s", b"b"], "nested": {"t": (np.int32(4), torch.ones(1))}},
        sg.ShmPointerMMData("psm_1234", torch.Size([2, 3]), torch.float32),
        sg.CudaIpcTensorTransportProxy(
            {
                "handle": b"\x01\x02",
                "shape": torch.Size([4]),
                "dtype": torch.bfloat16,
                "device": torch.device("cpu"),
                "strides": (1,),
            },
            {"event": None, "np": np.dtype("<i4"), "sizes": [torch.Size([1]), (1, 2)]},
        ),
        {"feature": sg.ShmPointerMMData("psm_9", torch.Size([1]), torch.int8), "k": 1},
    ]


VALUES = _values()


@pytest.mark.parametrize("value", VALUES, ids=lambda v: type(v).__name__)
def test_bytes_equal_sglangs_own(value: Any) -> None:
    assert enc.encode(value) == sg.encode(value)


@pytest.mark.parametrize("value", VALUES, ids=lambda v: type(v).__name__)
def test_reads_what_sglang_writes_as_sglang_does(value: Any) -> None:
    wire = sg.encode(value)
    expected = normalize(sg.decode(wire))
    assert same(dec.decode(wire), expected)
    assert same(normalize(sg.decode(enc.encode(value))), expected)


def _item(feature: Any = None) -> tuple[sg.MultimodalDataItem, Item]:
    msd = {
        "image_grid_thw": torch.tensor([[1, 1, 2]]),
        "patch_counts": np.array([2], dtype=np.int32),
        "names": ["image0"],
        "count": np.int64(2),
        "enabled": np.bool_(True),
        "size": (336, 336),
    }
    kw: dict[str, Any] = dict(
        modality=sg.Modality.IMAGE, hash=2**70 + 5, offsets=[(0, 1)], feature=feature
    )
    theirs = sg.MultimodalDataItem(**kw, model_specific_data=dict(msd))
    ours = Item(**kw, model_specific_data=dict(msd))
    theirs.audio_feature_lens = (3, 4)  # dynamic attributes, routed the same way
    ours.audio_feature_lens = (3, 4)
    return theirs, ours


def test_records_match_sglangs_structs_field_for_field() -> None:
    assert Item.__struct_fields__ == sg.MultimodalDataItem.__struct_fields__
    theirs, ours = _item(feature=torch.ones(1, 2))
    assert enc.encode(ours) == sg.encode(theirs)
    out_theirs = sg.MultimodalProcessorOutput(mm_items=[theirs], input_ids=[1, 2])
    out_ours = Output(mm_items=[ours], input_ids=[1, 2])
    assert Output.__struct_fields__ == sg.MultimodalProcessorOutput.__struct_fields__
    assert enc.encode(out_ours) == sg.encode(out_theirs)
    back = Decoder(Output, profile="sglang").decode(sg.encode(out_theirs))
    assert back.mm_items[0].audio_feature_lens == [3, 4]
    out_ours.note = "local"  # no model_specific_data: a private attribute, never sent
    assert enc.encode(out_ours) == sg.encode(out_theirs) and out_ours.note == "local"


def test_typed_records_read_like_sglang() -> None:
    theirs, ours = _item(feature=sg.ShmPointerMMData("psm_7", torch.Size([2]), torch.int32))
    wire = sg.encode(theirs)
    expect = sg.decode(wire, type=sg.MultimodalDataItem)
    back = Decoder(Item, profile="sglang").decode(wire)
    assert back.offsets == [(0, 1)] and back.hash == (2**70 + 5) & (2**64 - 1)
    assert back.modality is sg.Modality.IMAGE
    for name in Item.__struct_fields__:
        assert same(getattr(back, name), normalize(getattr(expect, name))), name
    assert back.audio_feature_lens == [3, 4]  # a list, as in SGLang
    assert enc.encode(back) == enc.encode(ours) == wire


def test_values_sglang_cannot_encode_are_refused() -> None:
    for value in (
        torch.float32,
        torch.device("cpu"),
        np.dtype("<f4"),
        np.complex64(1j),
        np.datetime64("2026-01-01"),
        np.str_("x"),
        1 + 2j,
        object(),
    ):
        with pytest.raises(TypeError):
            sg.encode(value)
        with pytest.raises(EncodeError):
            Encoder(profile="sglang").encode({"x": value})
    ref = SlotRef(
        version=1,
        pool=1,
        slot=0,
        generation=0,
        offset=0,
        nbytes=4,
        shape=(1,),
        dtype="<i4",
        kind="numpy",
    )
    assert enc.encode(ref) == sg.encode(ref)  # a Struct like any other: its fields
    with pytest.raises(EncodeError, match="no SGLang form"):  # but never as a reference
        enc.encode_with({"a": np.zeros(1, np.int32)}, lambda a: ref)
    with pytest.raises(EncodeError, match="masked"):
        enc.encode(np.ma.masked_array([1, 2], mask=[0, 1]))


def test_writes_what_sglang_cannot_but_reads_right() -> None:
    """Tensors SGLang's own encoder chokes on (grad, conjugate) are still written in
    its layout, and its decoder reads them as their values."""
    for t in (torch.ones(2, requires_grad=True), torch.tensor([1 + 2j]).conj()):
        back = sg.decode(enc.encode(t))
        assert torch.equal(back, t.detach().resolve_conj())


def test_ringwire_typed_leaves_are_unknown_codes_as_in_sglang() -> None:
    wire = Encoder().encode(
        [
            (1, 2),
            torch.Size([1]),
            torch.float32,
            torch.device("cpu"),
            np.dtype("<i2"),
            np.int8(1),
            {1},
            frozenset(),
            datetime.date(2026, 1, 1),
        ]
    )
    expected = sg.decode(wire)
    assert all(type(x) is Ext for x in expected)
    assert dec.decode(wire) == expected
    assert enc.encode(dec.decode(wire)) == wire  # relayed unchanged


def test_states_come_back_with_sglangs_types() -> None:
    shm = sg.ShmPointerMMData("psm_1", torch.Size([2, 3]), torch.bfloat16)
    st_ = dec.decode(sg.encode({"f": shm}))["f"]
    assert st_ == SGLangState(
        4, {"shm_name": "psm_1", "shape": torch.Size([2, 3]), "dtype": torch.bfloat16}
    )
    assert type(st_.state["shape"]) is torch.Size
    rebuilt = Decoder(profile="sglang", resolver=lambda s: ("rebuilt", s.code)).decode(
        sg.encode(shm)
    )
    assert rebuilt == ("rebuilt", 4)


def test_hostile_states_are_decode_errors() -> None:
    """SGLang's getattr(torch, name) would hand out torch.load; ringwire's allow-list
    refuses, as it refuses every malformed state."""
    evil = Ext(
        4,
        msgspec.msgpack.encode(
            {"shm_name": "x", "shape": [], "dtype": {"__torch_dtype__": "load"}}
        ),
    )
    assert sg.decode(msgspec.msgpack.encode(evil)).dtype is torch.load
    cases = {
        "not an allowed": evil,
        "must be a map": Ext(4, msgspec.msgpack.encode([1, 2])),
        "lacks": Ext(5, msgspec.msgpack.encode({"proxy_state": {}})),
        "__tuple__ must": Ext(4, msgspec.msgpack.encode({"x": {"__tuple__": "abc"}})),
        "__torch_size__": Ext(4, msgspec.msgpack.encode({"x": {"__torch_size__": ["a"]}})),
        "device": Ext(4, msgspec.msgpack.encode({"x": {"__torch_device__": "/dev/x"}})),
        "not a map": Ext(4, msgspec.msgpack.encode({"__tuple__": [1]})),
        "numpy dtype": Ext(4, msgspec.msgpack.encode({"x": {"__np_dtype__": "|O8"}})),
    }
    for msg, ext in cases.items():
        with pytest.raises(DecodeError, match=msg):
            dec.decode(msgspec.msgpack.encode(ext))


def test_older_list_forms_of_typed_fields() -> None:
    class Typed(msgspec.Struct, array_like=True):
        a: array.array
        n: np.ndarray
        t: torch.Tensor
        t4: torch.Tensor

    raw = np.arange(3, dtype="<i4").tobytes()
    wire = msgspec.msgpack.encode(
        [["i", raw], [[3], "<i4", raw], [[3], "int32", raw], [[3], "int32", raw, "cpu"]]
    )
    theirs = sg.decode(wire, type=Typed)
    ours = Decoder(Typed, profile="sglang").decode(wire)
    for name in Typed.__struct_fields__:
        assert same(getattr(ours, name), getattr(theirs, name)), name
    bad = msgspec.msgpack.encode(
        [["i", raw], [[4], "<i4", raw], [[3], "int32", raw], [[3], "int32", raw]]
    )
    with pytest.raises(DecodeError, match="do not match"):
        Decoder(Typed, profile="sglang").decode(bad)


def test_profile_api() -> None:
    assert isinstance(enc, Encoder) and enc.profile == "sglang" and Encoder().profile == "ringwire"
    assert isinstance(dec, Decoder) and dec.profile == "sglang"
    with pytest.raises(ValueError, match="profile"):
        Encoder(profile="pickle")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="profile"):
        Decoder(profile="pickle")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="placer"):
        Encoder(profile="sglang", placer=lambda a: None)
    buf = bytearray(b"xx")
    enc.encode_into((1, 2), buf, 2)
    assert bytes(buf) == b"xx" + sg.encode((1, 2))
    assert enc.encode_with(np.int8(1), lambda a: None) == sg.encode(1)
    with pytest.raises(ValueError):
        SGLangState(6, {})
    with pytest.raises(TypeError):
        SGLangState(4, [])  # type: ignore[arg-type]


# ------------------------------------------------------------------ the record base


def test_record_base_puts_model_specific_data_last() -> None:
    class Declared(SGLangRecord):
        model_specific_data: dict[str, int] = {}  # declared first: still moved last
        a: int = 0

    assert Declared.__struct_fields__ == ("a", "model_specific_data")

    class Plain(SGLangRecord):
        pass

    assert Plain.__struct_fields__ == ("model_specific_data",)

    class WithMethods(Item):
        def double(self) -> int:
            return 2 * (self.hash or 0)

    assert WithMethods.__struct_fields__ == Item.__struct_fields__
    with pytest.raises(TypeError, match="model_specific_data"):

        class MoreFields(Item):
            extra: int = 0

    with pytest.raises(TypeError, match="cannot drop"):

        class Dropped(Item, model_specific_data=False):
            pass

    class MoreOutput(Output):  # no model_specific_data to keep last: fields may follow
        extra: int = 0

    assert MoreOutput.__struct_fields__ == (*Output.__struct_fields__, "extra")


def test_record_base_routes_attributes_like_sglang() -> None:
    item = Item(modality=sg.Modality.AUDIO, hash=-1)
    theirs = sg.MultimodalDataItem(modality=sg.Modality.AUDIO, hash=-1)
    assert item.hash == theirs.hash == 2**64 - 1
    for obj in (item, theirs):
        obj.hash = 2**65 + 3
        obj.lens = [1]
        obj._private = 2  # SGLang sends these too
    item["k"] = 1
    item.set("pad_value", 9)  # a field: set as the field
    theirs.k = 1
    theirs.pad_value = 9
    assert item.hash == 3 and item.lens == [1] and item.pad_value == 9
    assert (
        item.model_specific_data
        == theirs.model_specific_data
        == {"lens": [1], "_private": 2, "k": 1}
    )
    assert enc.encode(item) == sg.encode(theirs)
    with pytest.raises(AttributeError, match="nope"):
        _ = item.nope
    assert weakref.ref(item)() is item


# ------------------------------------------------------------------ random values

_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=False),
    st.text(max_size=5),
    st.binary(max_size=5),
    st.builds(np.int32, st.integers(-(2**31), 2**31 - 1)),
    st.builds(np.float32, st.floats(width=32, allow_nan=False)),
    st.builds(np.bool_, st.booleans()),
    st.lists(st.integers(0, 5), max_size=3).map(torch.Size),
    st.lists(st.integers(-5, 5), max_size=4).map(lambda xs: torch.tensor(xs, dtype=torch.int16)),
    st.lists(st.floats(width=32, allow_nan=False), max_size=4).map(
        lambda xs: np.array(xs, dtype="<f4")
    ),
    st.builds(
        lambda n: sg.ShmPointerMMData(f"psm_{n}", torch.Size([n]), torch.uint8), st.integers(0, 9)
    ),
)
_nested = st.recursive(
    _leaf,
    lambda kids: st.one_of(
        st.lists(kids, max_size=4),
        st.lists(kids, max_size=4).map(tuple),
        st.dictionaries(st.text(max_size=4), kids, max_size=4),
    ),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_nested)
def test_random_values_agree_with_the_model(value: Any) -> None:
    wire = sg.encode(value)
    assert enc.encode(value) == wire
    assert same(dec.decode(wire), normalize(sg.decode(wire)))


def test_mutated_sglang_messages_raise_only_decode_error() -> None:
    """Truncations and byte flips of SGLang's own messages (states, tensors, records):
    DecodeError or a successful decode, never another exception."""
    theirs, _ = _item(feature=sg.ShmPointerMMData("psm_7", torch.Size([2]), torch.int32))
    seeds = [sg.encode(theirs), sg.encode(VALUES[-3]), sg.encode(VALUES[-2])]
    rng = random.Random(29656)
    errors = 0
    for decoder in (dec, Decoder(Item, profile="sglang")):
        for base in seeds:
            for i in range(600):
                buf = bytearray(base)
                if i % 2:
                    buf = buf[: rng.randrange(len(buf))]
                else:
                    for _ in range(rng.randint(1, 4)):
                        buf[rng.randrange(len(buf))] = rng.randrange(256)
                try:
                    decoder.decode(bytes(buf))
                except DecodeError:
                    errors += 1
    assert errors > 1000
