"""Tests of ringwire._wire.codec: wire bytes, round trips, and hostile input."""

from __future__ import annotations

import array
import collections
import dataclasses
import datetime
import decimal
import enum
import random
import threading
import uuid
from typing import Any, NamedTuple, Optional

import attrs
import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from support.extras import TORCH_ABSENT_ERROR, needs_torch, torch, torch_error, torch_params

import ringwire
from ringwire import (
    DecodeError,
    Decoder,
    EncodeError,
    Encoder,
    Record,
    RingwireError,
    SGLangRecord,
    SGLangState,
)
from ringwire.wire import CudaRef, ExtCode, NetRef, NixlRef, SlotRef

enc = Encoder()
dec = Decoder()
Ext = msgspec.msgpack.Ext


def rt(obj: Any, decoder: Decoder = dec) -> Any:
    return decoder.decode(enc.encode(obj))


# ------------------------------------------------------------------ golden wire bytes
# Each expected value is written out by hand from the layout in ringwire/_ext.py, not
# produced by the encoder: a change to any of them is a wire break.

GOLDEN = [
    pytest.param(
        array.array("h", [1, 2]),
        "c70a0100000002a16801000200",
        id="ext1-array",
    ),
    *torch_params(
        lambda: [
            pytest.param(
                torch.tensor([1, 2], dtype=torch.int16),
                "c715020000000d939102a5696e743136a363707501000200",
                id="ext2-torch",
            )
        ],
        width=2,
        id="ext2-torch",
    ),
    pytest.param(
        np.array([1, 2], dtype="<i2"),
        "c70f0300000007929102a33c693201000200",
        id="ext3-numpy",
    ),
    pytest.param(
        SlotRef(
            version=1,
            pool=7,
            slot=2,
            generation=3,
            offset=128,
            nbytes=8,
            shape=(2,),
            dtype="<i4",
            kind="numpy",
        ),
        "c714049901070203cc80089102a33c6934a56e756d7079",
        id="ext4-slotref",
    ),
    pytest.param(
        CudaRef(
            version=1,
            pool=7,
            device=0,
            slot=2,
            generation=3,
            offset=0,
            nbytes=4,
            shape=(2,),
            dtype="bfloat16",
            event=b"\x01",
            kind="torch",
        ),
        # pool_handle (empty here) was appended as a twelfth field, device_uuid and
        # lease as the thirteenth and fourteenth; the eleven- and twelve-field forms
        # still decode (test_cudaref_without_pool_handle_decodes,
        # test_cudaref_without_device_uuid_or_lease_decodes)
        "c722059e010700020300049102a862666c6f61743136c40101a5746f726368c400c400c400",
        id="ext5-cudaref",
    ),
    pytest.param(
        CudaRef(
            version=1,
            pool=7,
            device=1,
            slot=2,
            generation=3,
            offset=0,
            nbytes=4,
            shape=(2,),
            dtype="bfloat16",
            event=b"\x01",
            kind="torch",
            pool_handle=b"\x02",
            device_uuid=bytes(range(16)),
            lease=bytes([0x39, 0x30, 0, 0, 7, 0, 0, 0]),
        ),
        # 59 bytes: ... c4 01 02 (pool_handle), c4 10 00..0f (the UUID), c4 08 (pid 12345, fd 7)
        "c73b059e010701020300049102a862666c6f61743136c40101a5746f726368c40102"
        "c410000102030405060708090a0b0c0d0e0fc4083930000007000000",
        id="ext5-cudaref-uuid-lease",
    ),
    pytest.param((1, 2), "c70306920102", id="ext6-tuple"),
    *torch_params(
        lambda: [
            pytest.param(torch.Size([2, 3]), "c70307920203", id="ext7-torch-size"),
            pytest.param(torch.float32, "d708a7666c6f61743332", id="ext8-torch-dtype"),
            pytest.param(torch.device("cpu"), "d609a3637075", id="ext9-torch-device"),
        ],
        width=2,
        id="ext7-9-torch",
    ),
    pytest.param(np.dtype("<f4"), "d60aa33c6634", id="ext10-numpy-dtype"),
    pytest.param(np.int64(2), "c70f0b92a33c6938c4080200000000000000", id="ext11-numpy-scalar"),
    # Ext 12-19 (ringwire/_wire/leaves.py): types msgspec would turn into an array or a str
    pytest.param({1, 2}, "c7030c920102", id="ext12-set"),
    pytest.param(frozenset({1, 2}), "c7030d920102", id="ext13-frozenset"),
    pytest.param(
        datetime.datetime(2026, 11, 29, 9, 0),
        "c7140eb3323032362d31312d32395430393a30303a3030",  # "2026-11-29T09:00:00"
        id="ext14-datetime",
    ),
    pytest.param(
        datetime.datetime(
            2026, 11, 29, 9, 0, tzinfo=datetime.timezone(datetime.timedelta(hours=1))
        ),
        "c71a0eb9323032362d31312d32395430393a30303a30302b30313a3030",  # ... "+01:00"
        id="ext14-datetime-aware",
    ),
    pytest.param(datetime.date(2026, 11, 29), "c70b0faa323032362d31312d3239", id="ext15-date"),
    pytest.param(datetime.time(9, 30), "c70910a830393a33303a3030", id="ext16-time"),
    pytest.param(
        datetime.timedelta(days=1, seconds=2, microseconds=3), "d61193010203", id="ext17-timedelta"
    ),
    pytest.param(uuid.UUID(int=1), "c71212c410" + "00" * 15 + "01", id="ext18-uuid"),
    pytest.param(decimal.Decimal("1.5"), "d613a3312e35", id="ext19-decimal"),
    # Ext 20: [version 1, tag 7, generation 2, frame 0, 8 bytes, shape [2], "<f4", "numpy", ""]
    pytest.param(
        NetRef(1, 7, 2, 0, 8, (2,), "<f4", "numpy"),
        "c713149901070200089102a33c6634a56e756d7079a0",
        id="ext20-netref",
    ),
    # Ext 21: [version 1, tag 7, generation 1, entry 0, 8 bytes, shape [2], "<f4", "numpy", ""]
    pytest.param(
        NixlRef(1, 7, 1, 0, 8, (2,), "<f4", "numpy"),
        "c713159901070100089102a33c6634a56e756d7079a0",
        id="ext21-nixlref",
    ),
    # ... a tensor that was on cuda:0: [1, 7, 1, 0, 8, [2], "float32", "torch", "cuda:0"]
    pytest.param(
        NixlRef(1, 7, 1, 0, 8, (2,), "float32", "torch", "cuda:0"),
        "c71d159901070100089102a7666c6f61743332a5746f726368a6637564613a30",
        id="ext21-nixlref-cuda",
    ),
]


@pytest.mark.parametrize(
    ("ref", "match"),
    [
        (NetRef(1, 7, 2, 0, 9, (2,), "<f4", "numpy"), "needs 8"),
        (NetRef(2, 7, 2, 0, 8, (2,), "<f4", "numpy"), "version 2"),
        (NetRef(1, 7, 2, 0, 8, (2,), "<f4", "numpy", "mps:0"), "not a CUDA device"),
        (NetRef(1, 7, 2, 0, 16, (2,), "|O", "numpy"), "not an allowed dtype"),
        (NixlRef(1, 7, 1, 0, 9, (2,), "<f4", "numpy"), "needs 8"),
        (NixlRef(2, 7, 1, 0, 8, (2,), "<f4", "numpy"), "version 2"),
        (NixlRef(1, 7, 1, 0, 8, (2,), "<f4", "numpy", "cpu"), "not a CUDA device"),
    ],
)
def test_netref_is_checked(ref: NetRef | NixlRef, match: str) -> None:
    with pytest.raises(DecodeError, match=match):
        dec.decode(enc.encode(ref))


def test_cudaref_without_pool_handle_decodes() -> None:
    """The first Ext 5 layout (eleven fields, no pool_handle) is still understood."""
    wire = bytes.fromhex("c71c059b010700020300049102a862666c6f61743136c40101a5746f726368")
    if torch is None:  # its torch dtype cannot be checked: refused with the install hint
        with pytest.raises(DecodeError, match=TORCH_ABSENT_ERROR):
            Decoder().decode(wire)
        return
    ref = Decoder().decode(wire)
    assert isinstance(ref, CudaRef)
    assert ref.pool_handle == b"" and ref.dtype == "bfloat16" and ref.event == b"\x01"
    assert ref.device_uuid == b"" and ref.lease == b""


def test_cudaref_without_device_uuid_or_lease_decodes() -> None:
    """The twelve-field Ext 5 layout (before device_uuid and lease) is still understood:
    the consumer then uses the device number as is, and takes no lease."""
    wire = bytes.fromhex("c71e059c010700020300049102a862666c6f61743136c40101a5746f726368c400")
    if torch is None:  # its torch dtype cannot be checked: refused with the install hint
        with pytest.raises(DecodeError, match=TORCH_ABSENT_ERROR):
            Decoder().decode(wire)
        return
    ref = Decoder().decode(wire)
    assert isinstance(ref, CudaRef)
    assert ref.pool_handle == b"" and ref.device_uuid == b"" and ref.lease == b""


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [("device_uuid", b"\0" * 15, "UUID has 16"), ("lease", b"\0" * 4, "lease has 8")],
)
def test_cudaref_uuid_and_lease_sizes_are_checked(field: str, value: bytes, match: str) -> None:
    ref = msgspec.structs.replace(CudaRef(1, 7, 0, 2, 3, 0, 4, (2,), "bfloat16"), **{field: value})
    with pytest.raises(DecodeError, match=torch_error(match)):
        dec.decode(enc.encode(ref))


@pytest.mark.parametrize(("value", "hexbytes"), GOLDEN)
def test_golden_bytes(value: Any, hexbytes: str) -> None:
    wire = bytes.fromhex(hexbytes)
    assert enc.encode(value) == wire
    if torch is None and getattr(value, "kind", None) == "torch":
        # a descriptor of a tensor: its torch dtype cannot be checked without torch
        with pytest.raises(DecodeError, match=TORCH_ABSENT_ERROR):
            dec.decode(wire)
        return
    back = dec.decode(wire)
    assert type(back) is type(value)
    if isinstance(value, np.ndarray):
        np.testing.assert_array_equal(back, value)
        assert back.dtype == value.dtype
    elif torch is not None and isinstance(value, torch.Tensor):
        assert torch.equal(back, value)
    else:
        assert back == value


def test_ext_code_table_is_stable() -> None:
    assert {c.name: int(c) for c in ExtCode} == {
        "ARRAY": 1,
        "TORCH_TENSOR": 2,
        "NUMPY_ARRAY": 3,
        "SHM_REF": 4,
        "CUDA_REF": 5,
        "TUPLE": 6,
        "TORCH_SIZE": 7,
        "TORCH_DTYPE": 8,
        "TORCH_DEVICE": 9,
        "NUMPY_DTYPE": 10,
        "NUMPY_SCALAR": 11,
        "SET": 12,
        "FROZENSET": 13,
        "DATETIME": 14,
        "DATE": 15,
        "TIME": 16,
        "TIMEDELTA": 17,
        "UUID": 18,
        "DECIMAL": 19,
        "NET_REF": 20,
        "NIXL_REF": 21,
        "TRACED": 22,
    }


class GoldenItem(Record):
    modality: str
    hash: Optional[int] = None
    offsets: Optional[list[tuple[int, int]]] = None
    feature: object = None


def test_golden_traced_record_bytes() -> None:
    """Ext 22: [traceparent, tracestate, the record as is] (ringwire._wire.traced)."""
    from ringwire._wire.traced import wrap

    tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    item = GoldenItem(modality="image", hash=5, offsets=[(0, 1)], feature=(1, 2))
    record = bytes.fromhex("9580a5696d6167650591920001c70306920102")
    # ext 8, 81 bytes, code 22: array of 3, str8 of 55, fixstr "k=v", then the record
    wire = bytes.fromhex("c7511693d937") + tp.encode() + bytes.fromhex("a36b3d76") + record
    assert wrap(enc.encode(item), tp, "k=v") == wire
    assert Decoder(GoldenItem).decode(wire[6 + 55 + 4 :]) == item
    assert dec.decode(wire) == [{}, "image", 5, [[0, 1]], (1, 2)]  # untyped: unwrapped


def test_golden_record_bytes() -> None:
    item = GoldenItem(modality="image", hash=5, offsets=[(0, 1)], feature=(1, 2))
    # [extras={}, "image", 5, [[0, 1]], Ext6([1, 2])]
    wire = bytes.fromhex("9580a5696d6167650591920001c70306920102")
    assert enc.encode(item) == wire
    back = Decoder(GoldenItem).decode(wire)
    assert back == item
    assert back.offsets == [(0, 1)] and type(back.feature) is tuple


def test_sglang_buffer_layout_is_length_prefixed_metadata_then_raw() -> None:
    """The Ext 3 payload of a large array is exactly [u32 BE][metadata][raw bytes]."""
    arr = np.arange(1000, dtype=np.float32).reshape(10, 100)
    ext = msgspec.msgpack.decode(enc.encode(arr))
    assert isinstance(ext, msgspec.msgpack.Ext) and ext.code == 3
    mlen = int.from_bytes(ext.data[:4], "big")
    assert msgspec.msgpack.decode(ext.data[4 : 4 + mlen]) == [[10, 100], "<f4"]
    assert ext.data[4 + mlen :] == arr.tobytes()


# The SGLang profile's forms (ringwire/_wire/sglang.py), written out by hand from SGLang's
# rules; tests/unit/test_codec_sglang.py checks them against a model of SGLang's codec.


class GoldenSGLangItem(SGLangRecord):
    modality: str
    hash: Optional[int] = None


SGLANG_GOLDEN = [
    pytest.param((1, 2), "920102", id="tuple-is-an-array"),
    *torch_params(
        lambda: [pytest.param(torch.Size([2, 3]), "920203", id="torch-size-is-an-array")],
        width=2,
        id="torch-size-is-an-array",
    ),
    pytest.param({1, 2}, "920102", id="set-is-an-array"),
    pytest.param(np.int64(2), "02", id="numpy-int-is-an-int"),
    pytest.param(np.float32(1.5), "cb3ff8000000000000", id="numpy-float-is-a-float64"),
    pytest.param(np.bool_(True), "c3", id="numpy-bool-is-a-bool"),
    pytest.param(
        np.array(7, dtype="<i2"),  # 0-d: SGLang's np.ascontiguousarray makes it 1-d
        "c70d0300000007929101a33c69320700",
        id="ext3-0d-array-as-1d",
    ),
    *torch_params(
        lambda: [
            pytest.param(
                SGLangState(
                    4, {"shm_name": "psm_1", "shape": torch.Size([2]), "dtype": torch.float32}
                ),
                "c74704"
                "83"
                "a8"
                "73686d5f6e616d65"
                "a5"
                "70736d5f31"  # "shm_name": "psm_1"
                "a5"
                "7368617065"
                "81"
                "ae"
                "5f5f746f7263685f73697a655f5f"
                "9102"  # "shape": {"__torch_size__": [2]}
                "a5"
                "6474797065"
                "81"
                "af"
                "5f5f746f7263685f64747970655f5f"
                "a7"
                "666c6f61743332",  # "dtype": {"__torch_dtype__": "float32"}
                id="ext4-shm-pointer-state",
            ),
            pytest.param(
                SGLangState(
                    5,
                    {
                        "proxy_state": {"t": (1,), "dev": torch.device("cpu")},
                        "sync_data_meta": None,
                    },
                ),
                "c74705"
                "82"
                "ab"
                "70726f78795f7374617465"
                "82"  # "proxy_state": {
                "a1"
                "74"
                "81"
                "a9"
                "5f5f7475706c655f5f"
                "9101"  # "t": {"__tuple__": [1]}
                "a3"
                "646576"
                "81"
                "b0"
                "5f5f746f7263685f6465766963655f5f"
                "a3"
                "637075"  # "dev": {"__torch_device__": "cpu"}}
                "ae"
                "73796e635f646174615f6d657461"
                "c0",  # "sync_data_meta": None
                id="ext5-cuda-proxy-state",
            ),
        ],
        width=2,
        id="ext4-5-sglang-states",
    ),
    # model_specific_data last: ["image", 5, {}] (Record puts extras first)
    pytest.param(
        GoldenSGLangItem(modality="image", hash=5), "93a5696d6167650580", id="sglang-record"
    ),
]


@pytest.mark.parametrize(("value", "hexbytes"), SGLANG_GOLDEN)
def test_sglang_profile_golden_bytes(value: Any, hexbytes: str) -> None:
    assert Encoder(profile="sglang").encode(value) == bytes.fromhex(hexbytes)
    if isinstance(value, (SGLangState, SGLangRecord)):
        tp = type(value) if isinstance(value, SGLangRecord) else Any
        assert Decoder(tp, profile="sglang").decode(bytes.fromhex(hexbytes)) == value


# ------------------------------------------------------------------ what each type becomes


class _Color(enum.Enum):
    RED = "red"


class _Level(enum.IntEnum):
    HIGH = 2


class _Pair(NamedTuple):
    a: int
    b: int


@dataclasses.dataclass
class _Point:
    x: int


class _Plain(msgspec.Struct):
    x: int


@attrs.define
class _AttrsPoint:
    x: int


_TZ = datetime.timezone(datetime.timedelta(hours=-5, minutes=-30))

# (value, what it is once decoded in an untyped position): the table of docs/guide/codec.md
AUDIT: list[tuple[Any, Any]] = [
    ({1, (2, 3)}, {1, (2, 3)}),
    (frozenset({"a"}), frozenset({"a"})),
    (type("MySet", (set,), {})({1}), {1}),
    (datetime.datetime(2026, 1, 2, 3, 4, 5, 6), datetime.datetime(2026, 1, 2, 3, 4, 5, 6)),
    (
        datetime.datetime(2026, 1, 2, 3, 4, tzinfo=_TZ),
        datetime.datetime(2026, 1, 2, 3, 4, tzinfo=_TZ),
    ),
    (datetime.date(2026, 1, 2), datetime.date(2026, 1, 2)),
    (datetime.time(3, 4, 5, 6, tzinfo=_TZ), datetime.time(3, 4, 5, 6, tzinfo=_TZ)),
    (datetime.timedelta(days=-1, microseconds=5), datetime.timedelta(days=-1, microseconds=5)),
    (uuid.UUID(int=2**128 - 1), uuid.UUID(int=2**128 - 1)),
    (decimal.Decimal("-0.000"), decimal.Decimal("-0.000")),
    (decimal.Decimal("NaN"), None),  # NaN != NaN: checked by str below
    (_Pair(1, (2,)), (1, (2,))),  # a NamedTuple is a tuple (its class is not sent)
    (type("MyTuple", (tuple,), {})((1,)), (1,)),
    (collections.OrderedDict(a=(1,)), {"a": (1,)}),
    (collections.Counter("aa"), {"a": 2}),
    (type("MyList", (list,), {})([(1,)]), [(1,)]),
    (_Color.RED, "red"),  # user classes: their msgspec form; a typed field restores them
    (_Level.HIGH, 2),
    (_Point(1), {"x": 1}),
    (_AttrsPoint(1), {"x": 1}),
    (_Plain(1), {"x": 1}),
    (bytearray(b"ab"), b"ab"),
    (memoryview(b"ab"), b"ab"),
    (np.arange(3).view(type("MyArray", (np.ndarray,), {})), np.arange(3)),  # a plain ndarray
    *torch_params(
        lambda: [(torch.nn.Parameter(torch.ones(2)), torch.ones(2))], width=2, id="Parameter"
    ),
]


@pytest.mark.parametrize(("value", "expected"), AUDIT, ids=lambda v: type(v).__name__)
def test_what_each_type_becomes(value: Any, expected: Any) -> None:
    back = rt({"x": value})["x"]
    if expected is None:
        assert type(back) is type(value) and str(back) == str(value)
        return
    assert type(back) is type(expected)
    if isinstance(expected, np.ndarray):
        np.testing.assert_array_equal(back, expected)
    elif torch is not None and isinstance(expected, torch.Tensor):
        assert torch.equal(back, expected)
    else:
        assert back == expected
    if isinstance(expected, (datetime.datetime, datetime.time)):
        assert back.utcoffset() == value.utcoffset()


def test_types_that_are_refused() -> None:
    for value in (
        collections.deque([1]),
        1 + 2j,
        range(3),
        np.ma.masked_array([1, 2], mask=[0, 1]),
        type("MyInt", (int,), {})(3),
    ):
        with pytest.raises(EncodeError):
            enc.encode({"x": value})


def test_typed_positions_keep_msgspecs_forms() -> None:
    """Typed fields are left to msgspec, whose typed decoder restores each type."""

    class T(Record):
        tags: set[str] = set()
        pairs: set[object] = set()  # untyped items: lifted, so tuples stay tuples
        frozen: frozenset[int] = frozenset()
        when: Optional[datetime.datetime] = None
        id: Optional[uuid.UUID] = None
        color: Optional[_Color] = None
        point: Optional[_Pair] = None
        dc: Optional[_Point] = None

    v = T(
        tags={"a", "b"},
        pairs={(1, 2), (3, (4,))},
        frozen=frozenset({1}),
        when=datetime.datetime(2026, 1, 1),
        id=uuid.UUID(int=3),
        color=_Color.RED,
        point=_Pair(1, 2),
        dc=_Point(4),
    )
    wire = enc.encode(v)
    assert msgspec.msgpack.decode(wire)[4] == "2026-01-01T00:00:00"  # msgspec's own form
    back = Decoder(T).decode(wire)
    assert back == v
    assert type(back.point) is _Pair and type(back.dc) is _Point and back.color is _Color.RED


def test_equal_sets_encode_to_equal_bytes_whatever_their_history() -> None:
    """A set's items go in the order of their encoded bytes, not its iteration order
    (which follows the insertion history and the string hash seed): equal sets are
    equal messages.  0 and 8 share a hash slot, so these two sets iterate in opposite
    orders; a fuzz input once re-encoded to other bytes under one hash seed."""
    assert list({8, 0}) != list({0, 8})
    for kind in (set, frozenset):
        a = enc.encode({"s": kind([8, 0]), "t": [kind(["<f1", b"\x00>", 8, 0, (1, "a")])]})
        b = enc.encode({"s": kind([0, 8]), "t": [kind([(1, "a"), 0, 8, b"\x00>", "<f1"])]})
        assert a == b
        assert enc.encode(dec.decode(a)) == a
        assert dec.decode(a)["t"][0] == kind(["<f1", b"\x00>", 8, 0, (1, "a")])


def test_set_items_must_be_hashable() -> None:
    forged = msgspec.msgpack.encode(Ext(12, msgspec.msgpack.encode([[1]])))
    with pytest.raises(DecodeError, match="hashable"):
        dec.decode(forged)
    for code, payload, msg in (
        (14, "not a date", "ISO 8601"),
        (14, 5, "ISO 8601"),
        (15, "2026-13-01", "ISO 8601"),
        (17, [1, 2], "days, seconds"),
        (17, [10**10, 0, 0], "out of range"),
        (18, b"short", "16 bytes"),
        (19, "one", "not a number"),
        (13, {"a": 1}, "not an array"),
    ):
        with pytest.raises(DecodeError, match=msg):
            dec.decode(msgspec.msgpack.encode(Ext(code, msgspec.msgpack.encode(payload))))


# ------------------------------------------------------------------ numpy round trips

NUMPY_DTYPES = [
    "?",
    "i1",
    "i2",
    "i4",
    "i8",
    "u1",
    "u2",
    "u4",
    "u8",
    "f2",
    "f4",
    "f8",
    "g",
    "c8",
    "c16",
    "G",
    "M8[ns]",
    "m8[us]",
    "S5",
    "U3",
]


@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
@pytest.mark.parametrize("shape", [(), (0,), (3,), (2, 3, 4), (1, 0, 5)])
def test_numpy_round_trip(dtype: str, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(0)
    arr = np.asarray(rng.integers(0, 100, size=shape)).astype(dtype)
    back = rt(arr)
    assert type(back) is np.ndarray
    assert back.dtype == arr.dtype and back.shape == arr.shape
    np.testing.assert_array_equal(back, arr)
    assert back.flags.writeable and back.flags.c_contiguous


def test_numpy_byte_swapped_keeps_byte_order() -> None:
    arr = np.arange(10, dtype=">f8")
    back = rt(arr)
    assert back.dtype.str == ">f8"
    np.testing.assert_array_equal(back, arr)


def test_numpy_non_contiguous_is_made_contiguous() -> None:
    base = np.arange(100, dtype=np.int32).reshape(10, 10)
    for view in (base[::2, 1::3], base.T, base[:, 3]):
        back = rt(view)
        np.testing.assert_array_equal(back, view)
        assert back.flags.c_contiguous


def test_numpy_large_array() -> None:
    arr = np.random.default_rng(1).random((1024, 1024, 4))  # 32 MiB
    back = rt(arr)
    assert np.array_equal(back, arr)


def test_zero_copy_decoder_returns_read_only_views() -> None:
    arr = np.arange(16, dtype=np.int64)
    wire = bytearray(enc.encode(arr))
    back = Decoder(zero_copy=True).decode(wire)
    np.testing.assert_array_equal(back, arr)
    assert not back.flags.writeable
    assert np.shares_memory(back, np.frombuffer(wire, np.uint8))


def test_object_and_structured_dtypes_are_refused() -> None:
    for bad in (
        np.array([object()]),
        np.zeros(2, dtype=[("a", "i4"), ("b", "f8")]),
        np.zeros(2, dtype="V8"),
    ):
        with pytest.raises(EncodeError, match="refused"):
            enc.encode(bad)
    with pytest.raises(EncodeError):
        enc.encode({"x": np.array([None, 1], dtype=object)})


# ------------------------------------------------------------------ torch round trips

TORCH_DTYPES = torch_params(
    lambda: [
        d
        for d in (
            torch.bool,
            torch.uint8,
            torch.int8,
            torch.int16,
            torch.int32,
            torch.int64,
            torch.uint16,
            torch.uint32,
            torch.uint64,
            torch.float16,
            torch.bfloat16,
            torch.float32,
            torch.float64,
            torch.complex32,
            torch.complex64,
            torch.complex128,
            getattr(torch, "float8_e4m3fn", None),
            getattr(torch, "float8_e4m3fnuz", None),
            getattr(torch, "float8_e5m2", None),
            getattr(torch, "float8_e5m2fnuz", None),
            getattr(torch, "float8_e8m0fnu", None),
            getattr(torch, "float4_e2m1fn_x2", None),
        )
        if d is not None
    ],
    width=1,
    id="torch",
)


def _random_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    raw = torch.randint(0, 256, shape + (dtype.itemsize,), dtype=torch.uint8)
    return raw.view(dtype).reshape(shape) if shape else raw.view(dtype)[..., 0].reshape(())


@needs_torch
@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (5,), (2, 3, 4)])
def test_torch_round_trip_bit_exact(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    t = _random_tensor(shape, dtype)
    back = rt(t)
    assert type(back) is torch.Tensor
    assert back.dtype == dtype and back.shape == t.shape and back.device == t.device
    assert torch.equal(back.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))


@needs_torch
def test_torch_non_contiguous_grad_and_conj() -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    assert torch.equal(rt(base.T), base.T)
    assert torch.equal(rt(base[:, ::2]), base[:, ::2])
    p = torch.nn.Parameter(torch.ones(3))
    assert torch.equal(rt(p), torch.ones(3))
    c = torch.tensor([1 + 2j, 3 - 1j]).conj()
    assert torch.equal(rt(c), c.resolve_conj())
    assert torch.equal(rt(-base), -base)


@needs_torch
def test_torch_sparse_is_refused() -> None:
    with pytest.raises(EncodeError, match="to_dense"):
        enc.encode(torch.eye(3).to_sparse())


@needs_torch
def test_cuda_tensor_without_cuda_is_a_clear_error_or_cpu_by_choice() -> None:
    """An inline tensor recorded as cuda:0 restores to cuda:0 only where it exists."""
    t = torch.arange(3, dtype=torch.int16)
    wire = msgspec.msgpack.encode(
        msgspec.msgpack.Ext(2, _layout([[3], "int16", "cuda:0"], t.numpy().tobytes()))
    )
    if torch.cuda.is_available():
        assert rt(t.cuda()).device.type == "cuda"
        assert dec.decode(wire).device == torch.device("cuda:0")
    else:
        with pytest.raises(DecodeError, match="cuda:0"):
            dec.decode(wire)
        assert torch.equal(Decoder(cuda_fallback="cpu").decode(wire), t)


# ------------------------------------------------------------------ typed leaves


def test_typed_leaves_keep_their_type() -> None:
    values: list[Any] = [
        (1, 2),
        (1, (2, (3, "x")), [4, (5,)]),
        (),
        *(
            [
                torch.Size([2, 3]),
                torch.Size([]),
                torch.bfloat16,
                torch.device("cuda", 1),
                torch.device("cpu"),
            ]
            if torch is not None  # without torch: the other leaves
            else []
        ),
        np.dtype(">i8"),
        np.int64(2),
        np.bool_(True),
        np.float16(1.5),
        np.complex64(1 + 2j),
        np.uint8(255),
        np.datetime64("2026-11-29T09:00", "ns"),
    ]
    for v in values:
        back = rt(v)
        assert type(back) is type(v), v
        assert back == v


@needs_torch
def test_typed_leaves_nested_inside_containers() -> None:
    v = {"size": (336, 336), "grid": [torch.Size([1, 2]), (np.int32(7), torch.int8)]}
    back = rt(v)
    assert back == v
    assert type(back["size"]) is tuple
    assert type(back["grid"][0]) is torch.Size
    assert type(back["grid"][1][0]) is np.int32


def test_unknown_ext_codes_pass_through_unchanged() -> None:
    ext = msgspec.msgpack.Ext(42, b"future")
    wire = msgspec.msgpack.encode({"x": ext})
    back = dec.decode(wire)
    assert back == {"x": ext}
    assert enc.encode(back) == wire


def test_unsupported_type_is_encode_error() -> None:
    class Opaque:
        pass

    with pytest.raises(EncodeError, match="Opaque"):
        enc.encode({"x": Opaque()})
    with pytest.raises(EncodeError):
        enc.encode(1 << 70)


def test_user_hooks() -> None:
    class Point:
        def __init__(self, x: int) -> None:
            self.x = x

    e = Encoder(enc_hook=lambda p: {"x": p.x})
    assert Decoder().decode(e.encode(Point(3))) == {"x": 3}


def test_placer_and_resolver_hooks() -> None:
    """Arrays handed to a placer travel as Ext 4 references and come back through the
    resolver; the codec itself never turns a reference into memory."""
    store: dict[int, np.ndarray] = {}

    def placer(arr: Any) -> SlotRef | None:
        if not isinstance(arr, np.ndarray) or arr.nbytes < 64:
            return None
        slot = len(store)
        store[slot] = arr
        return SlotRef(
            version=1,
            pool=9,
            slot=slot,
            generation=0,
            offset=0,
            nbytes=arr.nbytes,
            shape=arr.shape,
            dtype=arr.dtype.str,
            kind="numpy",
        )

    big, small = np.arange(64, dtype=np.int32), np.arange(2, dtype=np.int32)
    wire = Encoder(placer=placer).encode({"big": big, "small": small})
    refs = Decoder().decode(wire)
    assert isinstance(refs["big"], SlotRef) and refs["big"].slot == 0
    assert isinstance(refs["small"], np.ndarray)
    resolved = Decoder(resolver=lambda ref: store[ref.slot]).decode(wire)
    assert resolved["big"] is big


def test_descriptor_consistency_is_checked() -> None:
    good = SlotRef(
        version=1,
        pool=1,
        slot=0,
        generation=0,
        offset=0,
        nbytes=16,
        shape=(4,),
        dtype="<i4",
        kind="numpy",
    )
    assert rt(good) == good
    for bad, msg in (
        (msgspec.structs.replace(good, nbytes=17), "needs 16"),
        (msgspec.structs.replace(good, version=2), "version 2"),
        (msgspec.structs.replace(good, dtype="|O8"), "not an allowed"),
        (
            msgspec.structs.replace(good, kind="torch", dtype="float128"),
            torch_error("not an allowed"),
        ),
    ):
        with pytest.raises(DecodeError, match=msg):
            rt(bad)
    neg = msgspec.msgpack.encode(
        msgspec.msgpack.Ext(4, msgspec.msgpack.encode([1, 1, 0, 0, -5, 16, [4], "<i4", "numpy"]))
    )
    with pytest.raises(DecodeError, match="malformed SlotRef"):
        dec.decode(neg)


# ------------------------------------------------------------------ records


class Item(Record):
    modality: str
    hash: Optional[int] = None
    offsets: Optional[list[tuple[int, int]]] = None
    feature: object = None
    model_specific_data: dict[str, object] = {}


@needs_torch
def test_record_round_trip_like_sglang_mm_item() -> None:
    item = Item(
        modality="image",
        offsets=[(0, 1), (5, 9)],
        feature=torch.tensor([[1.0, 2.0]]),
        model_specific_data={
            "image_grid_thw": torch.tensor([[1, 1, 2]]),
            "patch_counts": np.array([2], dtype=np.int32),
            "names": ["image0"],
            "count": np.int64(2),
            "enabled": np.bool_(True),
            "size": (336, 336),
        },
    )
    back = Decoder(Item).decode(enc.encode(item))
    assert back.offsets == [(0, 1), (5, 9)]
    assert torch.equal(back.feature, item.feature)
    msd = back.model_specific_data
    assert type(msd["count"]) is np.int64 and type(msd["enabled"]) is np.bool_
    assert msd["size"] == (336, 336) and type(msd["size"]) is tuple
    np.testing.assert_array_equal(msd["patch_counts"], [2])


def test_encoding_does_not_mutate_the_record() -> None:
    item = Item(modality="x", feature=(1, 2))
    enc.encode(item)
    assert item.feature == (1, 2) and type(item.feature) is tuple


@needs_torch
def test_typed_tensor_fields() -> None:
    class Typed(Record):
        t: torch.Tensor
        a: np.ndarray
        n: Optional[np.ndarray] = None

    v = Typed(t=torch.ones(2), a=np.zeros(3))
    back = Decoder(Typed).decode(enc.encode(v))
    assert torch.equal(back.t, v.t) and back.n is None
    wrong = Typed(t=torch.ones(1), a=torch.ones(1))  # type: ignore[arg-type]
    with pytest.raises(DecodeError, match="ndarray"):
        Decoder(Typed).decode(enc.encode(wrong))


# ------------------------------------------------------------------ hostile input


def test_truncated_and_inconsistent_buffers_are_decode_errors() -> None:
    def ext(code: int, payload: bytes) -> bytes:
        return msgspec.msgpack.encode(msgspec.msgpack.Ext(code, payload))

    meta = msgspec.msgpack.encode([[4], "<i4"])
    cases = {
        "too short": ext(3, b"\x00\x00"),
        "runs past": ext(3, (1000).to_bytes(4, "big") + meta),
        "do not match": ext(3, len(meta).to_bytes(4, "big") + meta + b"\x00" * 15),
        "negative": ext(3, _layout([[-1], "<i4"], b"")),
        "absurd": ext(3, _layout([[2**60, 0], "<i4"], b"")),
        "not an allowed dtype": ext(3, _layout([[1], "|O8"], b"\x00" * 8)),
        "metadata must be": ext(3, _layout({"shape": [1]}, b"")),
        "torch dtype": ext(2, _layout([[1], "Tensor", "cpu"], b"\x00")),
        "allowed device": ext(2, _layout([[1], "uint8", "/etc/passwd"], b"\x00")),
        "typecode": ext(1, _layout("O", b"")),
        "multiple": ext(1, _layout("i", b"\x00" * 3)),
        "malformed metadata": ext(3, b"\x00\x00\x00\x01\xc1"),
        "dimensions": ext(3, _layout([[1] * 65, "<i4"], b"\x00" * 4)),
    }
    tensors = {"torch dtype", "allowed device"}  # Ext 2: checked only where torch is
    for msg, wire in cases.items():
        with pytest.raises(DecodeError, match=torch_error(msg) if msg in tensors else msg):
            dec.decode(wire)


def _layout(meta: Any, raw: bytes) -> bytes:
    m = msgspec.msgpack.encode(meta)
    return len(m).to_bytes(4, "big") + m + raw


def test_dtype_names_are_never_looked_up_by_getattr() -> None:
    wire = msgspec.msgpack.encode(msgspec.msgpack.Ext(8, msgspec.msgpack.encode("load")))
    with pytest.raises(DecodeError, match=torch_error("not an allowed")):
        dec.decode(wire)


def _corpus() -> list[bytes]:
    item = Item(
        modality="video",
        hash=2**100 + 7,
        offsets=[(1, 2)],
        feature=np.arange(12, dtype=np.float32).reshape(3, 4),
        model_specific_data={
            **(
                {
                    "t": torch.arange(6, dtype=torch.bfloat16),
                    "s": torch.Size([3]),
                    "d": (torch.float16, np.dtype("<u2"), torch.device("cpu")),
                }
                if torch is not None  # without torch: the rest of the corpus
                else {}
            ),
            "k": np.uint16(9),
            "a": array.array("d", [1.0, 2.0]),
            "ref": SlotRef(
                version=1,
                pool=1,
                slot=0,
                generation=0,
                offset=0,
                nbytes=8,
                shape=(2,),
                dtype="<i4",
                kind="numpy",
            ),
        },
    )
    leaves = {
        "s": {1, (2, 3), frozenset({4})},
        "t": [datetime.datetime(2026, 1, 2, 3, 4, tzinfo=_TZ), datetime.date(2026, 1, 2)],
        "u": (datetime.time(1, 2), datetime.timedelta(days=3), uuid.UUID(int=9)),
        "d": decimal.Decimal("-1.5e-7"),
    }
    return [
        enc.encode(item),
        enc.encode(
            [np.arange(5), (1, (2,)), {"x": np.ones((2, 2)) if torch is None else torch.ones(2, 2)}]
        ),
        enc.encode(leaves),
    ]


@pytest.mark.parametrize("typed", [False, True])
def test_mutated_messages_raise_only_decode_error(typed: bool) -> None:
    """Thousands of truncations, byte flips and length changes: DecodeError or a
    successful decode, never any other exception and never a crash."""
    decoder = Decoder(Item) if typed else dec
    rng = random.Random(1234)
    outcomes = {"ok": 0, "err": 0}
    for base in _corpus():
        for i in range(2500):
            buf = bytearray(base)
            op = i % 4
            if op == 0:
                buf = buf[: rng.randrange(len(buf))]
            elif op == 1:
                for _ in range(rng.randint(1, 4)):
                    buf[rng.randrange(len(buf))] = rng.randrange(256)
            elif op == 2:  # corrupt a length-like field: a u32 big-endian somewhere
                pos = rng.randrange(max(1, len(buf) - 4))
                buf[pos : pos + 4] = rng.choice(
                    [0, 1, 0xFFFFFFFF, 0x7FFFFFFF, len(buf), rng.randrange(2**32)]
                ).to_bytes(4, "big")
            else:
                pos = rng.randrange(len(buf))
                buf[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
            try:
                decoder.decode(bytes(buf))
                outcomes["ok"] += 1
            except DecodeError:
                outcomes["err"] += 1
    assert outcomes["err"] > 1000  # the mutations really did break messages


def test_deep_nesting_is_a_decode_error() -> None:
    payload = msgspec.msgpack.encode([])
    for _ in range(5000):
        payload = msgspec.msgpack.encode(msgspec.msgpack.Ext(6, payload))
    with pytest.raises(DecodeError):
        dec.decode(payload)


# ------------------------------------------------------------------ hypothesis

_np_dtypes = st.sampled_from(
    ["?", "i1", "<i2", ">i4", "<i8", "u1", ">u2", "<u4", "u8", "<f2", ">f4", "<f8", "<c8", ">c16"]
)


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(
    hnp.arrays(
        dtype=_np_dtypes.map(np.dtype),
        shape=hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5),
    )
)
def test_hypothesis_numpy_round_trip(arr: np.ndarray) -> None:
    back = rt(arr)
    assert back.dtype == arr.dtype and back.shape == arr.shape
    assert back.tobytes() == arr.tobytes()


_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=False),
    st.text(max_size=5),
    st.binary(max_size=5),
    st.builds(np.int32, st.integers(-(2**31), 2**31 - 1)),
    st.builds(np.float64, st.floats(allow_nan=False)),
    *(
        [
            st.sampled_from([torch.float32, torch.bfloat16, torch.device("cpu"), np.dtype("<u4")]),
            st.lists(st.integers(0, 5), max_size=3).map(torch.Size),
        ]
        if torch is not None  # without torch: the other leaves
        else [st.sampled_from([np.dtype("<u4")])]
    ),
)
_nested = st.recursive(
    _leaf,
    lambda kids: st.one_of(
        st.lists(kids, max_size=4),
        st.lists(kids, max_size=4).map(tuple),
        st.dictionaries(st.text(max_size=4), kids, max_size=4),
    ),
    max_leaves=25,
)


@settings(max_examples=300, deadline=None)
@given(_nested)
def test_hypothesis_nested_typed_leaves(value: Any) -> None:
    back = rt(value)
    assert back == value
    assert _types(back) == _types(value)


def _types(v: Any) -> Any:
    if isinstance(v, dict):
        return ("dict", {k: _types(x) for k, x in v.items()})
    if isinstance(v, (list, tuple)) and not (torch is not None and isinstance(v, torch.Size)):
        return (type(v), [_types(x) for x in v])
    return type(v)


# ------------------------------------------------------------------ misc contract


def test_exception_hierarchy() -> None:
    assert issubclass(DecodeError, msgspec.DecodeError) and issubclass(DecodeError, ValueError)
    assert issubclass(EncodeError, msgspec.EncodeError)
    assert issubclass(DecodeError, RingwireError) and issubclass(EncodeError, RingwireError)


def test_encoder_and_decoder_are_shareable_between_threads() -> None:
    values = [np.arange(i, dtype=np.int16) for i in range(50)]
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(50):
                for v in values:
                    assert np.array_equal(dec.decode(enc.encode(v)), v)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_module_level_helpers() -> None:
    assert ringwire.decode(ringwire.encode((1, 2))) == (1, 2)
    assert ringwire.decode(ringwire.encode([1, 2]), type=tuple[int, int]) == (1, 2)


def test_untyped_positions_inside_typed_tuples_keep_tuples() -> None:
    class T(Record):
        pair: tuple[int, object] = (0, None)
        many: tuple[object, ...] = ()
        nested: list[dict[str, object]] = []

    v = T(pair=(1, (2, 3)), many=((1,), (2,)), nested=[{"k": (4, 5)}])
    back = Decoder(T).decode(enc.encode(v))
    assert back == v
    assert type(back.pair[1]) is tuple and type(back.many[0]) is tuple
    assert type(back.nested[0]["k"]) is tuple


def test_lift_pass_does_not_copy_records_without_tuples() -> None:
    """A record with nothing to lift is encoded as is (no per-send copy of it)."""
    calls = []

    class T(Record):
        a: int
        b: dict[str, object] = {}

    orig = msgspec.structs.replace

    def spy(*args: Any, **kw: Any) -> Any:
        calls.append(1)
        return orig(*args, **kw)

    msgspec.structs.replace = spy
    try:
        enc.encode(T(a=1, b={"x": 1, "y": [1, 2]}))
        assert calls == []
        enc.encode(T(a=1, b={"x": (1, 2)}))
        assert calls == [1]
    finally:
        msgspec.structs.replace = orig


def test_encode_many_with_stops_after_a_record_that_placed() -> None:
    class Placer(list):  # the shape of a slot pool's placement: a list, empty until used
        def __call__(self, arr: Any) -> SlotRef | None:
            if arr.nbytes < 64:
                return None
            self.append(arr)
            return SlotRef(
                version=1,
                pool=9,
                slot=len(self) - 1,
                generation=0,
                offset=0,
                nbytes=arr.nbytes,
                shape=arr.shape,
                dtype=arr.dtype.str,
                kind="numpy",
            )

    e = Encoder()
    items = [1, (2, 3), np.arange(2), {"a": np.arange(64)}, "x", np.arange(100)]
    out: list[bytes] = []
    p = Placer()
    assert e.encode_many_with(items, 0, p, out) == 4  # stopped after the placing record
    assert len(p) == 1 and len(out) == 4
    assert e.encode_many_with(items, 4, Placer(), out) == 6
    assert [dec.decode(b) for b in out[:3]][:2] == [1, (2, 3)]
    assert out[0] == enc.encode(1) and out[1] == enc.encode((2, 3)) and out[4] == enc.encode("x")
    assert isinstance(dec.decode(out[3])["a"], SlotRef)
    assert e.encode_many_with(items, 6, Placer(), out) == 6
    with pytest.raises(EncodeError):
        e.encode_many_with([1, object()], 0, Placer(), out)
    assert out[-1] == enc.encode(1)  # what was encoded before the error is kept


def test_raw_decode_and_reraise_match_decode() -> None:
    d = Decoder(int)
    assert d.raw_decode(enc.encode(5)) == 5
    for bad in (b"\xc1", enc.encode("not an int")):
        with pytest.raises(DecodeError) as want:
            d.decode(bad)
        try:
            d.raw_decode(bad)
        except Exception as exc:
            with pytest.raises(DecodeError) as got:
                d.reraise(exc)
            assert str(got.value) == str(want.value)
        else:
            raise AssertionError("raw_decode accepted a bad message")
    with pytest.raises(KeyError):
        d.reraise(KeyError("other errors pass through"))


_plain = st.one_of(st.integers(-(2**63), 2**63 - 1), st.text(max_size=5), st.floats(), st.none())
_values = st.recursive(
    st.one_of(_plain, st.tuples(_plain), st.frozensets(st.integers(0, 99), max_size=2)),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=3), inner, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(_values)
def test_the_c_lift_scan_agrees_with_the_lift_pass(v: Any) -> None:
    from ringwire._wire import lanes, lift

    if not lanes.NATIVE:
        pytest.skip(f"the C ring is not active: {lanes.REASON}")
    from ringwire._wire._cring import needs_lift

    e = Encoder()
    # exact here (every non-plain leaf of these values is lifted): skipping is safe
    assert needs_lift(v, e._atomic) == (e._lift_any(v) is not v)
    assert lift.needs_lift is needs_lift
    if not _has_nan(v):
        assert dec.decode(e.encode(v)) == v


def _has_nan(v: Any) -> bool:
    if isinstance(v, float):
        return v != v
    if isinstance(v, dict):
        return any(map(_has_nan, v.values()))
    if isinstance(v, (list, tuple)):
        return any(map(_has_nan, v))
    return False


def test_the_c_lift_scan_on_deep_and_odd_values() -> None:
    from ringwire._wire import lanes

    if not lanes.NATIVE:
        pytest.skip(f"the C ring is not active: {lanes.REASON}")
    from ringwire._wire._cring import needs_lift

    atomic = set(Encoder()._atomic)
    deep: list[Any] = [1]
    for _ in range(200):
        deep = [deep]
    assert needs_lift(deep, atomic)  # too deep for the scan: the Python pass decides
    assert not needs_lift([[[[1]]], {"a": {"b": [None, b"x", 2.5, True]}}], atomic)
    assert needs_lift({"a": [1, (2,)]}, atomic) and needs_lift([{1, 2}], atomic)
    assert needs_lift(collections.OrderedDict(a=1), atomic)  # subclasses: the Python pass
    assert not needs_lift({(1, 2): 3}, atomic)  # keys are not lifted (as the Python pass)
    with pytest.raises(TypeError):
        needs_lift(1, [int])  # type: ignore[arg-type]
