"""A model of SGLang's own msgpack codec, to test ringwire's SGLang profile against.

What it models: ``python/sglang/srt/utils/msgpack_utils.py`` from SGLang PR #29656
("make mm_inputs msgpack-native"), as read in the public repository
(sgl-project/sglang, commit 8a690823bfc8eeeaca8fd20a2b19e52a48095fe1, and the
identical copy in wow-look-at-my/sglang 0fb95b55), together with the structs of
``python/sglang/srt/managers/schedule_batch.py`` (``MultimodalDataItem``,
``MultimodalProcessorOutput``), the ``__getstate__`` of ``ShmPointerMMData`` in
``managers/mm_utils.py`` and the PR's review (``shared/seed/000_4f67c3d2da60aeb8.txt``).
It is written here from those rules, not copied, and without SGLang's imports: the
two transport classes are stand-ins that hold only the state SGLang sends.

SGLang's rules, as modelled:

* encoding is plain ``msgspec.msgpack.encode(obj, enc_hook=...)``: msgspec's native
  forms for everything it knows (tuples and ``torch.Size`` are arrays, sets are
  arrays, datetimes msgspec's forms), and the hook, tried in this order, for
  ``array.array`` (Ext 1), ``torch.Tensor`` (Ext 2: metadata ``(shape, dtype name,
  device)``), ``np.ndarray`` (Ext 3, after ``np.ascontiguousarray``: a 0-d array
  becomes 1-d), numpy floating / integer / bool scalars (``float`` / ``int`` /
  ``bool``), the CUDA IPC proxy (Ext 5) and ``ShmPointerMMData`` (Ext 4); anything
  else is a ``TypeError``;
* Ext 1-3 payloads use the buffer layout ``[u32 BE metadata length][msgpack
  metadata][raw bytes]``; Ext 4/5 payloads are the msgpack (with the same hook) of
  the object's state after the *state* conversion: ``torch.dtype`` ->
  ``{"__torch_dtype__": name}``, ``torch.device`` -> ``{"__torch_device__": str}``,
  ``np.dtype`` -> ``{"__np_dtype__": dtype.str}``, dicts walked, ``torch.Size`` ->
  ``{"__torch_size__": list}``, tuples -> ``{"__tuple__": [...]}``, lists walked;
* decoding is ``msgspec.msgpack.Decoder(type, ext_hook=..., dec_hook=...)``: codes 1-5
  are rebuilt (dtype names by ``getattr(torch, name)`` / ``np.dtype(text)``, arrays
  and tensors copied, a non-CPU tensor moved with ``.to(device)``), the state's
  marker maps are turned back (a map holding a marker key is that value, checked in
  the order dtype, device, numpy dtype, size, tuple), any other code is an ``Ext``;
  the ``dec_hook`` of typed ``array`` / ``torch.Tensor`` / ``np.ndarray`` fields
  accepts the value itself, or the older list forms ``[typecode, raw]``,
  ``[shape, dtype, raw, device?]``, ``[shape, dtype, raw]``.
"""

from __future__ import annotations

import enum
import struct
from array import array
from typing import Any, Dict, List, Optional, Tuple

import msgspec
import numpy as np
import torch

Ext = msgspec.msgpack.Ext
_HEAD = struct.Struct(">I")
MASK64 = (1 << 64) - 1

# the wire ids SGLang fixes
ARRAY, TENSOR, NDARRAY, SHM_POINTER, CUDA_IPC = 1, 2, 3, 4, 5


class ShmPointerMMData:
    """Stand-in for ``sglang.srt.managers.mm_utils.ShmPointerMMData``: what matters on
    the wire is its ``__getstate__`` (segment name, ``torch.Size`` shape, dtype)."""

    def __init__(self, shm_name: str, shape: torch.Size, dtype: torch.dtype) -> None:
        self.shm_name, self.shape, self.dtype = shm_name, shape, dtype

    def __getstate__(self) -> dict[str, Any]:
        return {"shm_name": self.shm_name, "shape": self.shape, "dtype": self.dtype}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.shm_name, self.shape, self.dtype = state["shm_name"], state["shape"], state["dtype"]


class CudaIpcTensorTransportProxy:
    """Stand-in for SGLang's CUDA IPC proxy: only ``proxy_state`` and
    ``sync_data_meta`` travel; the receiver's local fields start empty."""

    def __init__(self, proxy_state: Any, sync_data_meta: Any) -> None:
        self.proxy_state = proxy_state
        self.sync_data_meta = sync_data_meta
        self.reconstruct_tensor = None
        self.sync_buffer = None
        self._consumer_acknowledged = False


# ------------------------------------------------------------------ state conversion


def state_of(value: Any) -> Any:
    """SGLang's ``_to_msgpack_state`` rule."""
    if isinstance(value, torch.dtype):
        return {"__torch_dtype__": str(value).replace("torch.", "", 1)}
    if isinstance(value, torch.device):
        return {"__torch_device__": str(value)}
    if isinstance(value, np.dtype):
        return {"__np_dtype__": value.str}
    if isinstance(value, dict):
        return {key: state_of(item) for key, item in value.items()}
    if isinstance(value, torch.Size):
        return {"__torch_size__": [int(d) for d in value]}
    if isinstance(value, tuple):
        return {"__tuple__": [state_of(item) for item in value]}
    if isinstance(value, list):
        return [state_of(item) for item in value]
    return value


_MARKERS = (
    ("__torch_dtype__", lambda name: getattr(torch, name)),
    ("__torch_device__", torch.device),
    ("__np_dtype__", np.dtype),
    ("__torch_size__", torch.Size),
    ("__tuple__", lambda items: tuple(value_of(item) for item in items)),
)


def value_of(state: Any) -> Any:
    """SGLang's ``_from_msgpack_state`` rule."""
    if isinstance(state, list):
        return [value_of(item) for item in state]
    if not isinstance(state, dict):
        return state
    for key, build in _MARKERS:
        if key in state:
            return build(state[key])
    return {key: value_of(item) for key, item in state.items()}


# ------------------------------------------------------------------ encoding


def _buffer_ext(code: int, metadata: Any, raw: memoryview) -> Ext:
    meta = msgspec.msgpack.encode(metadata)
    return Ext(code, _HEAD.pack(len(meta)) + meta + bytes(raw))


def _tensor_ext(t: torch.Tensor) -> Ext:
    host = t.cpu().contiguous()
    raw = host.reshape(-1).view(torch.uint8).numpy().data
    name = str(t.dtype).replace("torch.", "", 1)
    return _buffer_ext(TENSOR, (tuple(t.shape), name, str(t.device)), raw)


def _ndarray_ext(a: np.ndarray) -> Ext:
    c = np.ascontiguousarray(a)
    return _buffer_ext(NDARRAY, (c.shape, c.dtype.str), c.reshape(-1).view(np.uint8).data)


def enc_hook(obj: Any) -> Any:
    if isinstance(obj, array):
        return _buffer_ext(ARRAY, obj.typecode, memoryview(obj).cast("B"))
    if isinstance(obj, torch.Tensor):
        return _tensor_ext(obj)
    if isinstance(obj, np.ndarray):
        return _ndarray_ext(obj)
    for kind, convert in ((np.floating, float), (np.integer, int), (np.bool_, bool)):
        if isinstance(obj, kind):
            return convert(obj)
    if isinstance(obj, CudaIpcTensorTransportProxy):
        state = {"proxy_state": state_of(obj.proxy_state)}
        state["sync_data_meta"] = state_of(obj.sync_data_meta)
        return Ext(CUDA_IPC, encode(state))
    if isinstance(obj, ShmPointerMMData):
        return Ext(SHM_POINTER, encode(state_of(obj.__getstate__())))
    raise TypeError(f"SGLang cannot msgpack-encode {type(obj)}")


def encode(obj: Any) -> bytes:
    return msgspec.msgpack.encode(obj, enc_hook=enc_hook)


# ------------------------------------------------------------------ decoding


def _split(data: memoryview) -> tuple[Any, memoryview]:
    if len(data) < _HEAD.size:
        raise msgspec.DecodeError("buffer extension is missing metadata")
    (size,) = _HEAD.unpack_from(data)
    if _HEAD.size + size > len(data):
        raise msgspec.DecodeError("buffer extension has invalid metadata")
    return msgspec.msgpack.decode(data[_HEAD.size : _HEAD.size + size]), data[_HEAD.size + size :]


def _array(typecode: str, raw: Any) -> array:
    out = array(typecode)
    out.frombytes(raw)
    return out


def _tensor(shape: Any, dtype: str, raw: Any, device: str = "cpu") -> torch.Tensor:
    tdtype = getattr(torch, dtype)
    if len(raw):
        t = torch.frombuffer(bytearray(raw), dtype=tdtype).reshape(shape)
    else:
        t = torch.empty(shape, dtype=tdtype, device="cpu")
    return t if device == "cpu" else t.to(device)


def _ndarray(shape: Any, dtype: str, raw: Any) -> np.ndarray:
    return np.frombuffer(raw, dtype=np.dtype(dtype)).copy().reshape(shape)


def ext_hook(code: int, data: memoryview) -> Any:
    if code == ARRAY:
        typecode, raw = _split(data)
        return _array(typecode, raw)
    if code == TENSOR:
        (shape, dtype, device), raw = _split(data)
        return _tensor(shape, dtype, raw, device)
    if code == NDARRAY:
        (shape, dtype), raw = _split(data)
        return _ndarray(shape, dtype, raw)
    if code == SHM_POINTER:
        obj = ShmPointerMMData.__new__(ShmPointerMMData)
        obj.__setstate__(value_of(msgspec.msgpack.decode(data, ext_hook=ext_hook)))
        return obj
    if code == CUDA_IPC:
        state = msgspec.msgpack.decode(data, ext_hook=ext_hook)
        return CudaIpcTensorTransportProxy(
            value_of(state["proxy_state"]), value_of(state["sync_data_meta"])
        )
    return Ext(code, bytes(data))


def dec_hook(tp: Any, obj: Any) -> Any:
    if isinstance(obj, tp):
        return obj
    if tp is array:
        return _array(*obj)
    if tp is torch.Tensor:
        shape, dtype, raw, *rest = obj
        return _tensor(shape, dtype, raw, rest[0] if rest else "cpu")
    if tp is np.ndarray:
        return _ndarray(*obj)
    raise TypeError(f"SGLang cannot decode {type(obj)} as {tp}")


def decode(buf: bytes, type: Any = Any) -> Any:
    return msgspec.msgpack.Decoder(type, ext_hook=ext_hook, dec_hook=dec_hook).decode(buf)


# ------------------------------------------------------------------ SGLang's structs


class Modality(enum.Enum):
    IMAGE = enum.auto()
    VIDEO = enum.auto()
    AUDIO = enum.auto()


class MultimodalInputFormat(enum.Enum):
    NORMAL = enum.auto()
    PROCESSOR_OUTPUT = enum.auto()
    PRECOMPUTED_EMBEDDING = enum.auto()


class MultimodalDataItem(msgspec.Struct, kw_only=True, dict=True, array_like=True):
    """SGLang's struct, field for field, with its attribute routing."""

    modality: Modality
    hash: Optional[int] = None
    pad_value: Optional[int] = None
    offsets: Optional[List[Tuple[int, int]]] = None
    format: MultimodalInputFormat = MultimodalInputFormat.NORMAL
    feature: Optional[object] = None
    precomputed_embeddings: Optional[object] = None
    keep_device_embedding: bool = False
    model_specific_data: Dict[str, object] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.hash is not None:
            msgspec.Struct.__setattr__(self, "hash", self.hash & MASK64)

    def __getattr__(self, name: str) -> Any:
        if name in self.model_specific_data:
            return self.model_specific_data[name]
        raise AttributeError(name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in self.__struct_fields__:
            self.model_specific_data[name] = value
            return
        if name == "hash" and isinstance(value, int):
            value &= MASK64
        msgspec.Struct.__setattr__(self, name, value)


class MultimodalProcessorOutput(
    msgspec.Struct, kw_only=True, dict=True, array_like=True, weakref=True
):
    """The start of SGLang's struct (enough fields to check the layout)."""

    mm_items: List[MultimodalDataItem]
    input_ids: Optional[List[int]] = None
    padded_input_ids: Optional[List[int]] = None
    im_token_id: Optional[int] = None
    mrope_positions: Optional[torch.Tensor] = None
