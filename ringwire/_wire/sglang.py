"""The SGLang profile: SGLang's own ``msgpack_utils`` dialect, spoken by ringwire.

``Encoder(profile="sglang")`` writes what SGLang's encoder (``msgspec.msgpack`` with
its ``enc_hook``) writes for the same value, byte for byte, so a process still on
SGLang's codec decodes it to exactly what SGLang would have produced itself.
``Decoder(profile="sglang")`` reads what SGLang writes into the values SGLang's decoder
(its ``ext_hook`` / ``dec_hook``) gives.  A team can move one end to ringwire at a time.

SGLang's rules, as the profile applies them
-------------------------------------------
* Ext 1-3 (``array.array``, tensors, numpy arrays) are the buffer layout both
  dialects share.  SGLang makes a 0-d numpy array 1-d (``np.ascontiguousarray``): so
  does this profile.
* No lift pass: a tuple or ``torch.Size`` is a msgpack array (a list once decoded,
  unless a typed field says tuple), a set is an array, a datetime is msgspec's form.
* numpy scalars become plain msgpack values: ``float()`` of a floating scalar,
  ``int()`` of an integer one, ``bool()`` of ``np.bool_``.  Other numpy scalars
  (complex, datetime64, str_, ...) and ``torch.dtype`` / ``torch.device`` /
  ``numpy.dtype`` outside a state have no SGLang form: :class:`~ringwire.EncodeError`.
* Ext 4 and 5 are SGLang's transport objects, ``ShmPointerMMData`` and
  ``CudaIpcTensorTransportProxy``, as the msgpack of their state (a map), in which
  dtypes, devices, ``torch.Size`` and tuples are SGLang's marker maps
  (``{"__torch_dtype__": "float32"}``, ``{"__torch_device__": "cuda:0"}``,
  ``{"__np_dtype__": "<f4"}``, ``{"__torch_size__": [2, 3]}``,
  ``{"__tuple__": [...]}``).  ringwire carries such a state as an
  :class:`SGLangState` (it never imports SGLang, and decoding never builds a class
  named by the wire); a resolver given to the decoder receives each one.  ringwire's
  own slot references (:class:`SlotRef`, :class:`CudaRef`) have no SGLang form, so the
  profile takes no placer.
* Ext 6 and above are not SGLang's: they decode to :class:`msgspec.msgpack.Ext`,
  unchanged, as in SGLang.
* A typed ``array.array`` / ``np.ndarray`` / ``torch.Tensor`` field also accepts
  SGLang's older list forms (``[typecode, bytes]``, ``[shape, dtype, bytes]``,
  ``[shape, dtype, bytes, device]``).

Where ringwire is stricter than SGLang, it still refuses: dtype names are looked up in
the allow-lists (never ``getattr(torch, name)``), object dtypes and masked arrays are
refused, every length is checked.  A value SGLang could not encode either is an
:class:`~ringwire.EncodeError` here too.

:class:`SGLangRecord` is the record base of this dialect: SGLang's structs put
``model_specific_data`` (the dynamic-attribute dict) *last*, where :class:`Record`
puts ``extras`` first.
"""

from __future__ import annotations

import array
import importlib
import struct
import sys
from collections.abc import Callable
from typing import Any, Literal

import msgspec
import numpy as np

from .._errors import DecodeError, EncodeError
from . import ext as X
from .codec import Decoder, Encoder, check_device
from .descriptors import CudaRef, SlotRef
from .dtypes import (
    MAX_NDIM,
    numpy_dtype_from_wire,
    numpy_dtype_to_wire,
    torch_dtype_from_wire,
    torch_dtype_to_wire,
    torch_loaded,
    torch_module,
)
from .record import HASH_MASK

__all__ = [
    "SGLangEncoder",
    "SGLangDecoder",
    "SGLangState",
    "SGLangRecord",
    "to_state",
    "from_state",
]

Ext = msgspec.msgpack.Ext
_U32 = struct.Struct(">I")
_TORCH_DTYPE = "__torch_dtype__"
_TORCH_DEVICE = "__torch_device__"
_NP_DTYPE = "__np_dtype__"
_TORCH_SIZE = "__torch_size__"
_TUPLE = "__tuple__"
_UNSIZED = frozenset({"<U0", ">U0", "|S0"})


class SGLangState:
    """The state of an SGLang transport object, as SGLang's Ext 4 / Ext 5 carry it.

    ``code`` is :attr:`SHM_POINTER` (4, ``ShmPointerMMData``: ``state`` is its
    ``__getstate__()``, e.g. ``{"shm_name", "shape", "dtype"}``) or
    :attr:`CUDA_IPC_PROXY` (5, ``CudaIpcTensorTransportProxy``: ``state`` is
    ``{"proxy_state": ..., "sync_data_meta": ...}``).  ``state`` holds Python values
    (``torch.Size``, dtypes, tuples): the profile writes them in SGLang's marker forms
    and reads them back.  A process with SGLang installed rebuilds the object from it
    (``obj.__setstate__(s.state)``) in the decoder's resolver, or wraps its objects
    as ``SGLangState`` in the encoder's ``enc_hook``.
    """

    __slots__ = ("code", "state")
    SHM_POINTER = X.SHM_REF
    CUDA_IPC_PROXY = X.CUDA_REF

    def __init__(self, code: int, state: dict[Any, Any]) -> None:
        if code not in (X.SHM_REF, X.CUDA_REF):
            raise ValueError(f"an SGLang state travels as Ext 4 or Ext 5, not {code!r}")
        if not isinstance(state, dict):
            raise TypeError(f"an SGLang state is a dict, not {type(state).__name__}")
        self.code = code
        self.state = state

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SGLangState):
            return NotImplemented
        return self.code == other.code and self.state == other.state

    __hash__ = None  # type: ignore[assignment]  # a dict inside: not hashable

    def __repr__(self) -> str:
        return f"SGLangState({self.code}, {self.state!r})"


# --------------------------------------------------------------------------- state forms


def to_state(obj: Any) -> Any:
    """SGLang's state form of ``obj``: dtypes, devices, ``torch.Size`` and tuples as
    marker maps, dicts and lists walked, anything else as it is (checked in SGLang's
    order: dtype, device, numpy dtype, dict, ``torch.Size``, tuple, list)."""
    torch = torch_module() if torch_loaded() else None
    if torch is not None:
        if isinstance(obj, torch.dtype):
            return {_TORCH_DTYPE: torch_dtype_to_wire(obj)}
        if isinstance(obj, torch.device):
            return {_TORCH_DEVICE: str(obj)}
    if isinstance(obj, np.dtype):
        return {_NP_DTYPE: numpy_dtype_to_wire(obj)}
    if isinstance(obj, dict):
        return {k: to_state(v) for k, v in obj.items()}
    if torch is not None and isinstance(obj, torch.Size):
        return {_TORCH_SIZE: list(obj)}
    if isinstance(obj, tuple):
        return {_TUPLE: [to_state(v) for v in obj]}
    if isinstance(obj, list):
        return [to_state(v) for v in obj]
    return obj


def from_state(obj: Any) -> Any:
    """The inverse of :func:`to_state` over decoded msgpack, checked: a map holding a
    marker key *is* that value (SGLang's rule, tested in the same order)."""
    if isinstance(obj, dict):
        if _TORCH_DTYPE in obj:
            return torch_dtype_from_wire(obj[_TORCH_DTYPE])
        if _TORCH_DEVICE in obj:
            return torch_module().device(check_device(obj[_TORCH_DEVICE]))
        if _NP_DTYPE in obj:
            text = obj[_NP_DTYPE]
            if isinstance(text, str) and text in _UNSIZED:
                return np.dtype(text)
            return numpy_dtype_from_wire(text)
        if _TORCH_SIZE in obj:
            dims = obj[_TORCH_SIZE]
            if not (
                isinstance(dims, list)
                and len(dims) <= MAX_NDIM
                and all(type(d) is int and -(2**63) <= d < 2**63 for d in dims)
            ):
                raise DecodeError("SGLang state: __torch_size__ must be a list of ints")
            return torch_module().Size(dims)
        if _TUPLE in obj:
            items = obj[_TUPLE]
            if not isinstance(items, list):
                raise DecodeError("SGLang state: __tuple__ must hold an array")
            return tuple([from_state(v) for v in items])
        return {k: from_state(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [from_state(v) for v in obj]
    return obj


# --------------------------------------------------------------------------- encoding


class SGLangEncoder(Encoder):
    """:class:`Encoder` in the SGLang profile: make it with ``Encoder(profile="sglang")``."""

    profile: Literal["ringwire", "sglang"] = "sglang"

    def __init__(
        self,
        *,
        placer: Any = None,
        enc_hook: Callable[[Any], Any] | None = None,
        profile: Literal["ringwire", "sglang"] = "sglang",
    ) -> None:
        if placer is not None:
            raise ValueError(
                "the SGLang profile takes no placer: SGLang reads Ext 4/5 as its own "
                "ShmPointerMMData / CudaIpcTensorTransportProxy, not ringwire slot references"
            )
        super().__init__(enc_hook=enc_hook, profile=profile)

    def encode(self, obj: Any) -> bytes:
        """Return ``obj`` as SGLang's encoder would.  Raises :class:`~ringwire.EncodeError`."""
        try:
            return self._msg.encode(obj)
        except EncodeError:
            raise
        except (msgspec.EncodeError, OverflowError, TypeError, ValueError) as exc:
            raise EncodeError(str(exc)) from exc

    def encode_with(self, obj: Any, placer: Any) -> bytes:
        """:meth:`encode`; any reference ``placer`` returns is an EncodeError (see the
        constructor), so this exists only for the transport's sake."""
        self._call_placer = placer
        try:
            return self.encode(obj)
        finally:
            self._call_placer = None

    def encode_into(self, obj: Any, buffer: bytearray, offset: int = 0) -> None:
        """:meth:`encode` into ``buffer`` at ``offset`` (msgspec semantics)."""
        try:
            self._msg.encode_into(obj, buffer, offset)
        except EncodeError:
            raise
        except (msgspec.EncodeError, OverflowError, TypeError, ValueError) as exc:
            raise EncodeError(str(exc)) from exc

    def _hook(self, obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            if obj.ndim == 0:  # SGLang's np.ascontiguousarray makes it 1-d
                obj = obj.reshape(1)
            return super()._hook(obj)
        if isinstance(obj, np.generic):
            if isinstance(obj, np.floating):
                return float(obj)
            if isinstance(obj, np.integer):
                return int(obj)
            if isinstance(obj, np.bool_):
                return bool(obj)
            raise EncodeError(
                f"SGLang's codec has no form for a numpy {obj.dtype} scalar "
                "(use the default profile, or send .item())"
            )
        if isinstance(obj, SGLangState):
            return Ext(obj.code, self._msg.encode(to_state(obj.state)))
        if isinstance(obj, (SlotRef, CudaRef)):
            raise EncodeError(
                f"a ringwire {type(obj).__name__} has no SGLang form: SGLang reads "
                f"Ext {X.SHM_REF}/{X.CUDA_REF} as its own transport objects"
            )
        if isinstance(obj, np.dtype) or (
            torch_loaded() and isinstance(obj, (torch_module().dtype, torch_module().device))
        ):
            raise EncodeError(
                f"SGLang's codec carries a {type(obj).__name__} only inside an Ext 4/5 "
                "state (an SGLangState); use the default profile to send it alone"
            )
        return super()._hook(obj)


# --------------------------------------------------------------------------- decoding


def _layout(meta: Any, raw: Any, what: str) -> memoryview:
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        raise DecodeError(f"{what}: the raw data must be bytes")
    m = msgspec.msgpack.encode(meta)
    return memoryview(b"".join((_U32.pack(len(m)), m, raw)))


class SGLangDecoder(Decoder):
    """:class:`Decoder` in the SGLang profile: make it with ``Decoder(profile="sglang")``.
    ``resolver``, if given, is called with each :class:`SGLangState` and its result
    replaces it."""

    profile: Literal["ringwire", "sglang"] = "sglang"

    def __init__(
        self,
        type: Any = Any,
        *,
        resolver: Callable[[Any], Any] | None = None,
        zero_copy: bool = False,
        cuda_fallback: Literal["error", "cpu"] = "error",
        dec_hook: Callable[[type, Any], Any] | None = None,
        profile: Literal["ringwire", "sglang"] = "sglang",
    ) -> None:
        super().__init__(
            type,
            resolver=resolver,
            zero_copy=zero_copy,
            cuda_fallback=cuda_fallback,
            dec_hook=dec_hook,
            profile=profile,
        )
        table = self._ext_table
        for code in [c for c in table if c > X.CUDA_REF]:
            del table[code]  # not SGLang's: passed through as Ext, as SGLang does
        table[X.SHM_REF] = self._shm_pointer
        table[X.CUDA_REF] = self._cuda_proxy

    def _state(self, data: memoryview, code: int, what: str) -> dict[Any, Any]:
        state = self._decode_any(data, what)
        if not isinstance(state, dict):
            raise DecodeError(f"{what}: payload must be a map (the object's state)")
        if code == X.CUDA_REF:
            missing = {"proxy_state", "sync_data_meta"} - state.keys()
            if missing:
                raise DecodeError(f"{what}: the state lacks {sorted(missing)}")
            return {k: from_state(state[k]) for k in ("proxy_state", "sync_data_meta")}
        out = from_state(state)
        if not isinstance(out, dict):
            raise DecodeError(f"{what}: the state is a {type(out).__name__}, not a map")
        return out

    def _shm_pointer(self, data: memoryview) -> Any:
        value = SGLangState(X.SHM_REF, self._state(data, X.SHM_REF, "Ext 4 (ShmPointerMMData)"))
        return value if self._resolver is None else self._resolver(value)

    def _cuda_proxy(self, data: memoryview) -> Any:
        what = "Ext 5 (CudaIpcTensorTransportProxy)"
        value = SGLangState(X.CUDA_REF, self._state(data, X.CUDA_REF, what))
        return value if self._resolver is None else self._resolver(value)

    def _dec_hook(self, tp: type, obj: Any) -> Any:
        # SGLang's older list forms of typed array / ndarray / tensor fields
        if isinstance(obj, list) and not (isinstance(tp, type) and isinstance(obj, tp)):
            n = len(obj)
            if tp is array.array and n == 2:
                return self._array(_layout(obj[0], obj[1], "array.array"))
            if tp is np.ndarray and n == 3:
                return self._ndarray(_layout([obj[0], obj[1]], obj[2], "numpy array"))
            if torch_loaded() and tp is torch_module().Tensor and n in (3, 4):
                device = obj[3] if n == 4 else "cpu"
                return self._tensor(_layout([obj[0], obj[1], device], obj[2], "torch tensor"))
        return super()._dec_hook(tp, obj)


# --------------------------------------------------------------------------- records

_MSD = "model_specific_data"


def _annotations(namespace: dict[str, Any]) -> dict[str, Any]:
    """The class body's annotations, as a dict the metaclass may change."""
    if "__annotations__" in namespace:
        return namespace["__annotations__"]
    if sys.version_info >= (3, 14):  # pragma: no cover - lazily evaluated annotations
        annotationlib = importlib.import_module("annotationlib")
        annotate = annotationlib.get_annotate_from_class_namespace(namespace)
        ann: dict[str, Any] = {}
        if annotate is not None:
            ann = annotationlib.call_annotate_function(annotate, annotationlib.Format.FORWARDREF)
            for key in ("__annotate__", "__annotate_func__"):
                namespace.pop(key, None)
        namespace["__annotations__"] = ann
        return ann
    return namespace.setdefault("__annotations__", {})


class _SGLangRecordMeta(msgspec.StructMeta):
    """Makes every subclass ``kw_only`` and puts ``model_specific_data`` last (or, with
    the class keyword ``model_specific_data=False``, leaves it out)."""

    def __new__(
        mcls,
        name: str,
        bases: Any,
        namespace: Any,
        model_specific_data: bool | None = None,
        **kwargs: Any,
    ) -> Any:
        kwargs.setdefault("kw_only", True)
        records = [b for b in bases if isinstance(b, _SGLangRecordMeta)]
        inherited = any(_MSD in getattr(b, "__struct_fields__", ()) for b in bases)
        if model_specific_data is None:
            model_specific_data = all(getattr(b, "_sglang_msd", True) for b in records)
        if records and model_specific_data and not inherited:
            ann = _annotations(namespace)
            tp = ann.pop(_MSD, dict[str, object])
            ann[_MSD] = tp  # declared or not, it goes last
            namespace.setdefault(_MSD, msgspec.field(default_factory=dict))
        if inherited and not model_specific_data:
            raise TypeError(f"{name} cannot drop the model_specific_data it inherits")
        cls = super().__new__(mcls, name, bases, namespace, **kwargs)
        fields = cls.__struct_fields__
        if _MSD in fields and fields[-1] != _MSD:
            raise TypeError(
                f"{name} adds fields after model_specific_data, which SGLang's structs "
                "keep last: derive it from SGLangRecord directly"
            )
        if records:
            type.__setattr__(cls, "_sglang_msd", _MSD in fields)
        return cls


class SGLangRecord(
    msgspec.Struct,
    metaclass=_SGLangRecordMeta,
    kw_only=True,
    array_like=True,
    dict=True,
    weakref=True,
):
    """The record base of the SGLang profile, shaped like SGLang's structs
    (``MultimodalDataItem``): ``msgspec.Struct`` with ``kw_only``, ``array_like``,
    ``dict`` and ``weakref``, and a ``model_specific_data: dict[str, object]`` field
    added *last*, after the subclass's own fields (declare it yourself to change its
    type; it is moved last).  As in SGLang:

    * assigning any attribute the class does not declare stores it in
      ``model_specific_data`` (so it is sent), and reading one reads it back;
      ``rec[key] = value`` and ``rec.set(key, value)`` assign too;
    * an int ``hash`` field is masked to its low 64 bits on construction and
      assignment.

    SGLang's structs without that dict (``MultimodalProcessorOutput``) are declared
    ``class Output(SGLangRecord, model_specific_data=False)``: then an undeclared
    attribute is a private one in the instance ``__dict__``, never sent (as there).

    Fields are positional on the wire and ``model_specific_data`` ends the array, so
    a new field shifts it: both ends must run the same definitions (as SGLang's
    processes do).  A subclass of a record with ``model_specific_data`` may add
    methods, not fields.
    """

    _sglang_msd = True  # whether subclasses get model_specific_data (a class attribute)

    def __post_init__(self) -> None:
        if "hash" in self.__struct_fields__:
            h = getattr(self, "hash")  # noqa: B009 - a subclass field, not the builtin
            if isinstance(h, int):
                msgspec.Struct.__setattr__(self, "hash", h & HASH_MASK)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self.__struct_fields__:
            if name == "hash" and isinstance(value, int):
                value &= HASH_MASK
            msgspec.Struct.__setattr__(self, name, value)
        elif _MSD in self.__struct_fields__:
            getattr(self, _MSD)[name] = value
        else:
            msgspec.Struct.__setattr__(self, name, value)  # the instance __dict__

    def __getattr__(self, name: str) -> Any:
        # only called when normal lookup failed
        if not name.startswith("__"):
            try:
                data = msgspec.Struct.__getattribute__(self, _MSD)
            except AttributeError:
                data = None
            if data is not None and name in data:
                return data[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __setitem__(self, key: str, value: Any) -> None:
        setattr(self, key, value)

    def set(self, key: str, value: Any) -> None:
        """``setattr(self, key, value)``: a field if ``key`` is one, else
        ``model_specific_data[key]`` (SGLang's ``set``)."""
        setattr(self, key, value)
