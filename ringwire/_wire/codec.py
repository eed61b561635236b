"""The ringwire codec: msgpack records with tensors, typed leaves and references.

Theory of operation
-------------------
Encoding is ``msgspec.msgpack`` plus two things msgspec cannot do alone:

* an ``enc_hook`` for values msgspec does not know (arrays, tensors, dtypes, numpy
  scalars, descriptors), each becoming one Ext from the table in :mod:`._ext`;
* a *lift* pass for values msgspec encodes natively but loses the type of: ``tuple``
  and ``torch.Size`` become msgpack arrays, ``set`` and ``frozenset`` too, and
  ``datetime``/``date``/``time``/``timedelta``/``UUID``/``Decimal`` strings, so inside
  *untyped* positions (anything annotated ``object``/``Any``, and everything outside a
  Struct) they are turned into Ext 6/7 and 12-19 (:mod:`.leaves`) before msgspec sees
  them.  Typed positions (``List[Tuple[int, int]]``) are left alone: the typed decoder
  restores them.  The plan of what to lift is computed once per Struct class, so a
  record with only typed fields costs nothing; any other type found to hold nothing to
  lift is remembered and skipped at once afterwards.

``Encoder(profile="sglang")`` / ``Decoder(profile="sglang")`` speak SGLang's own
``msgpack_utils`` dialect instead (:mod:`.sglang`).

Arrays and tensors use the buffer layout ``[u32 BE metadata length][msgpack
metadata][raw C-contiguous bytes]`` (byte-compatible with SGLang's ``msgpack_utils``):
one copy into the Ext payload, one copy by msgspec into the message; no nested
msgpack layer around the raw bytes.

Decoding trusts nothing.  Every length, shape, item size and dtype name is checked
against the payload and the allow-lists in :mod:`._dtypes` before any array is made,
so a view can never reach past the Ext payload; anything wrong is a
:class:`~ringwire.DecodeError` saying what was wrong.  Unknown Ext codes come back as
:class:`msgspec.msgpack.Ext`, unchanged.

Threads: an :class:`Encoder` or :class:`Decoder` holds no per-call state (msgspec's
own encoders and decoders are safe to share), so one instance may be shared by any
number of threads.  They are also cheap to build.
"""

from __future__ import annotations

import array
import math
import re
import struct
from collections.abc import Callable, Sequence
from typing import Any, Literal, NoReturn

import msgspec
import numpy as np

from .._errors import DecodeError, EncodeError
from . import ext as X
from .descriptors import CudaRef, NetRef, NixlRef, SlotRef, decode_descriptor
from .dtypes import (
    MAX_NDIM,
    numpy_dtype_from_wire,
    numpy_dtype_to_wire,
    torch_dtype_from_wire,
    torch_dtype_to_wire,
    torch_loaded,
    torch_module,
)
from .leaves import LEAF_ENCODERS, leaf_decoders, leaf_encoder
from .lift import ATOMIC, map_dict, map_list, needs_lift, struct_plan
from .traced import body as traced_body

__all__ = ["Encoder", "Decoder", "encode", "decode"]

Ext = msgspec.msgpack.Ext

_U32 = struct.Struct(">I")
_MAX_INLINE = 0xFFFFFFFF  # msgpack ext32 limit
_MAX_DIM = 2**48
_ARRAY_TYPECODES = frozenset("bBhHiIlLqQfd")
_DEVICE_RE = re.compile(r"(cpu|cuda|mps|xpu|meta)(?::(\d{1,4}))?")
_SMALL_PAYLOAD = 64 * 1024
_UNSIZED = frozenset({"<U0", ">U0", "|S0"})  # as Ext 10 only: arrays and scalars need a size

_meta_encoder = msgspec.msgpack.Encoder()
_meta_decoder = msgspec.msgpack.Decoder()

Placer = Callable[[Any], "SlotRef | CudaRef | NetRef | NixlRef | None"]
# called with a SlotRef / CudaRef (an SGLangState in the SGLang profile)
Resolver = Callable[[Any], Any]
Profile = Literal["ringwire", "sglang"]
# profile -> the Encoder / Decoder subclass that speaks it (each registers itself when
# its class is made: the "sglang" ones in .sglang, which the package imports)
_ENCODER_PROFILES: dict[str, type[Encoder]] = {}
_DECODER_PROFILES: dict[str, type[Decoder]] = {}


# --------------------------------------------------------------------------- encoding


def _pack_buffer(code: int, metadata: object, arr: np.ndarray[Any, Any]) -> Ext:
    meta = _meta_encoder.encode(metadata)
    start = 4 + len(meta)
    total = start + arr.nbytes
    if total > _MAX_INLINE:
        raise EncodeError(
            f"a {arr.nbytes}-byte buffer cannot travel inline (msgpack's limit is 4 GiB); "
            "send it through a slot instead"
        )
    head = _U32.pack(len(meta)) + meta
    if total <= _SMALL_PAYLOAD or not arr.size:
        # small: one join beats numpy's per-call overhead
        return Ext(code, b"".join((head, arr.tobytes())))
    # large: an uninitialised numpy buffer (no zero-fill; numpy asks for huge pages),
    # filled by one copy; msgspec accepts the memoryview as the Ext payload.
    payload = np.empty(total, np.uint8)
    payload[:start] = np.frombuffer(head, np.uint8)
    dst = payload[start:].view(arr.dtype) if arr.dtype.itemsize else payload[start:]
    dst.reshape(arr.shape)[...] = arr  # also makes a non-contiguous source contiguous
    return Ext(code, payload.data)


def _base_ndarray(arr: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """An ndarray subclass as a plain ndarray; a masked array is refused (its mask
    would be lost)."""
    if isinstance(arr, np.ma.MaskedArray):
        raise EncodeError(
            "a numpy masked array cannot be sent: its mask would be lost; send "
            "arr.data and np.ma.getmaskarray(arr) as two arrays"
        )
    return arr.view(np.ndarray)


def _encode_ndarray(arr: np.ndarray[Any, Any]) -> Ext:
    wire = numpy_dtype_to_wire(arr.dtype)
    return _pack_buffer(X.NUMPY_ARRAY, [list(arr.shape), wire], arr)


def _tensor_host_bytes(t: Any) -> np.ndarray[Any, Any]:
    """A uint8 numpy view of a contiguous host copy of tensor ``t``'s bytes."""
    torch = torch_module()
    if t.layout != torch.strided:
        raise EncodeError(f"{t.layout} tensors cannot be sent; call .to_dense() first")
    if t.device.type == "meta":
        raise EncodeError("meta tensors have no data to send")
    t = t.detach()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8).numpy()


def _encode_tensor(t: Any) -> Ext:
    wire = torch_dtype_to_wire(t.dtype)
    raw = _tensor_host_bytes(t)
    return _pack_buffer(X.TORCH_TENSOR, [list(t.shape), wire, str(t.device)], raw)


def _encode_array(a: array.array[Any]) -> Ext:
    if a.typecode not in _ARRAY_TYPECODES:
        raise EncodeError(f"array.array typecode {a.typecode!r} cannot be sent")
    raw = np.frombuffer(a, dtype=np.uint8) if len(a) else np.empty(0, np.uint8)
    return _pack_buffer(X.ARRAY, a.typecode, raw)


def _encode_numpy_scalar(x: np.generic) -> Ext:
    wire = numpy_dtype_to_wire(x.dtype)
    raw = x.tobytes()
    if not x.dtype.itemsize:
        # np.str_("") / np.bytes_(b"") have an unsized dtype, which the decoder refuses
        # for items; one NUL item decodes to the same empty scalar
        wire = wire[:-1] + "1"
        raw = bytes(np.dtype(wire).itemsize)
    return Ext(X.NUMPY_SCALAR, _meta_encoder.encode([wire, raw]))


class Encoder:
    """Encode Python objects and :class:`~ringwire.Record` s to msgpack bytes.

    Parameters
    ----------
    placer:
        Called with every numpy array and torch tensor before it is copied inline.
        Return a :class:`SlotRef` / :class:`CudaRef` to send a reference instead
        (the transport's slot pools do this), or ``None`` for the inline Ext 2/3 copy.
        :meth:`encode_with` takes a placer for one call, which overrides this one: a
        transport passes an object that records what it placed for that record.
    enc_hook:
        Called, as in msgspec, for any other type ringwire does not know; it must
        return something encodable.

    profile:
        ``"ringwire"`` (default) or ``"sglang"``: write what SGLang's own
        ``msgpack_utils`` writes (see :mod:`ringwire._wire.sglang`; it takes no placer).

    Raises :class:`~ringwire.EncodeError` for values that cannot be sent (object or
    structured dtypes, unsupported types, integers beyond 64 bits, payloads over 4 GiB).
    Instances are safe to share between threads.
    """

    profile: Profile = "ringwire"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "profile" in cls.__dict__:  # a profile: Encoder(profile=...) makes one
            _ENCODER_PROFILES[cls.profile] = cls

    def __new__(cls, *, profile: Profile = "ringwire", **_: Any) -> Encoder:
        if profile == cls.profile:
            return super().__new__(cls)
        sub = _ENCODER_PROFILES.get(profile) if cls is Encoder else None
        if sub is None:
            raise ValueError(f"{cls.__name__} has no profile {profile!r}")
        return super().__new__(sub)

    def __init__(
        self,
        *,
        placer: Placer | None = None,
        enc_hook: Callable[[Any], Any] | None = None,
        profile: Profile = "ringwire",
    ) -> None:
        self._placer = placer
        self._call_placer: Placer | None = None  # the placer of the encode() in progress
        self._user_hook = enc_hook
        self._msg = msgspec.msgpack.Encoder(enc_hook=self._hook)
        self._plans: dict[type, tuple[tuple[str, Callable[[Any], Any]], ...]] = {}
        # types the lift pass returns unchanged: the universal ones, plus every Struct
        # class found to have no untyped position (so encoding it costs one set lookup)
        self._atomic: set[type] = set(ATOMIC)

    # -- public API -----------------------------------------------------------------

    def encode(self, obj: Any) -> bytes:
        """Return ``obj`` as msgpack bytes.  Raises :class:`~ringwire.EncodeError`."""
        try:
            if type(obj) not in self._atomic and (
                needs_lift is None or needs_lift(obj, self._atomic)
            ):
                obj = self._lift_any(obj)
            return self._msg.encode(obj)
        except EncodeError:
            raise
        except (msgspec.EncodeError, OverflowError, TypeError, ValueError) as exc:
            raise EncodeError(str(exc)) from exc

    def encode_with(self, obj: Any, placer: Placer) -> bytes:
        """:meth:`encode`, calling ``placer`` instead of the constructor's placer for
        every array and tensor of this one call -- a transport passes an object that
        records what it placed for that record.  An encoder given per-call placers
        must be used by one thread at a time (a transport's encoder belongs to one
        endpoint, whose sends are serialised).  Raises what :meth:`encode` raises, and
        whatever the placer raises."""
        self._call_placer = placer  # (placers never encode: no call nests in another)
        try:  # encode(), inlined: this runs once per record on a channel with slots
            if type(obj) not in self._atomic and (
                needs_lift is None or needs_lift(obj, self._atomic)
            ):
                obj = self._lift_any(obj)
            return self._msg.encode(obj)
        except EncodeError:
            raise
        except (msgspec.EncodeError, OverflowError, TypeError, ValueError) as exc:
            raise EncodeError(str(exc)) from exc
        finally:
            self._call_placer = None  # drop the record's placement

    def encode_many_with(
        self, items: Sequence[Any], start: int, placer: Any, out: list[bytes]
    ) -> int:
        """Encode ``items[start:]`` with ``placer`` (as :meth:`encode_with`), appending
        each payload to ``out``, until one record has placed something (``placer`` is
        a list, empty until it places): return the index after the last record encoded.
        A batch's records without arrays cost one loop turn each.  Raises what
        :meth:`encode_with` raises (``out`` then holds the records encoded before)."""
        self._call_placer = placer
        encode = self._msg.encode
        atomic = self._atomic
        append = out.append
        n = len(items)
        try:
            for i in range(start, n):
                obj = items[i]
                if type(obj) not in atomic and (needs_lift is None or needs_lift(obj, atomic)):
                    obj = self._lift_any(obj)
                append(encode(obj))
                if placer:
                    return i + 1
            return n
        except EncodeError:
            raise
        except (msgspec.EncodeError, OverflowError, TypeError, ValueError) as exc:
            raise EncodeError(str(exc)) from exc
        finally:
            self._call_placer = None

    def encode_into(self, obj: Any, buffer: bytearray, offset: int = 0) -> None:
        """Encode ``obj`` into ``buffer`` at ``offset`` (msgspec semantics: the
        buffer is resized to end exactly after the message; ``offset=-1`` appends)."""
        try:
            if type(obj) not in self._atomic and (
                needs_lift is None or needs_lift(obj, self._atomic)
            ):
                obj = self._lift_any(obj)
            self._msg.encode_into(obj, buffer, offset)
        except EncodeError:
            raise
        except (msgspec.EncodeError, OverflowError, TypeError, ValueError) as exc:
            raise EncodeError(str(exc)) from exc

    # -- enc_hook ---------------------------------------------------------------------

    def _hook(self, obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            if type(obj) is not np.ndarray:
                obj = _base_ndarray(obj)
            return self._place(obj) or _encode_ndarray(obj)
        if isinstance(obj, np.generic):
            return _encode_numpy_scalar(obj)
        if isinstance(obj, np.dtype):
            return Ext(X.NUMPY_DTYPE, _meta_encoder.encode(numpy_dtype_to_wire(obj)))
        if isinstance(obj, SlotRef):
            return Ext(X.SHM_REF, _meta_encoder.encode(obj))
        if isinstance(obj, CudaRef):
            return Ext(X.CUDA_REF, _meta_encoder.encode(obj))
        if isinstance(obj, NetRef):
            return Ext(X.NET_REF, _meta_encoder.encode(obj))
        if isinstance(obj, NixlRef):
            return Ext(X.NIXL_REF, _meta_encoder.encode(obj))
        if isinstance(obj, array.array):
            return _encode_array(obj)
        if torch_loaded():
            torch = torch_module()
            if isinstance(obj, torch.Tensor):
                return self._place(obj) or _encode_tensor(obj)
            if isinstance(obj, torch.dtype):
                return Ext(X.TORCH_DTYPE, _meta_encoder.encode(torch_dtype_to_wire(obj)))
            if isinstance(obj, torch.device):
                return Ext(X.TORCH_DEVICE, _meta_encoder.encode(str(obj)))
        if self._user_hook is not None:
            return self._user_hook(obj)
        raise EncodeError(f"values of type {type(obj).__qualname__} cannot be encoded")

    def _place(self, obj: Any) -> Ext | None:
        placer = self._call_placer
        if placer is None:
            placer = self._placer
        if placer is None:
            return None
        ref = placer(obj)
        if ref is None:
            return None
        return self._hook(ref)

    # -- lifting tuples out of untyped positions ----------------------------------------

    def _lift_any(self, v: Any) -> Any:
        t = type(v)
        if t in self._atomic:
            return v
        if t is list:
            return map_list(self._lift_any, v)
        if t is dict:
            return map_dict(self._lift_any, v)
        if t is tuple:
            return Ext(X.TUPLE, self._msg.encode([self._lift_any(x) for x in v]))
        if t is SlotRef or t is CudaRef or t is NetRef or t is NixlRef:  # msgspec: plain arrays
            return self._hook(v)
        if isinstance(v, msgspec.Struct):
            return self._lift_struct(v)
        if t is set or t is frozenset:
            return self._lift_set(v, X.SET if t is set else X.FROZENSET)
        leaf = LEAF_ENCODERS.get(t)
        if leaf is not None:
            return leaf(v)
        if torch_loaded():
            torch = torch_module()
            if t is torch.Size:
                return Ext(X.TORCH_SIZE, self._msg.encode(list(v)))
            if t is torch.Tensor:
                ATOMIC.add(t)  # from now on skipped without a lookup
                return v
        return self._lift_other(v, t)

    def _lift_set(self, v: set[Any] | frozenset[Any], code: int) -> Ext:
        # Items in the order of their encoded bytes, not the set's iteration order
        # (which follows the string hash seed and the insertion history): equal sets
        # encode to equal bytes in every process, so a message can be hashed, cached
        # or compared, and encode(decode(x)) == x.
        enc = self._msg.encode
        items = sorted(enc(self._lift_any(x)) for x in v)
        return Ext(code, enc([msgspec.Raw(b) for b in items]))

    def _lift_other(self, v: Any, t: type) -> Any:
        """Subclasses of the types above (a NamedTuple is sent as a tuple, an
        OrderedDict as a dict, ...), else a type with nothing to lift: remembered."""
        if isinstance(v, tuple):
            return Ext(X.TUPLE, self._msg.encode([self._lift_any(x) for x in v]))
        if isinstance(v, list):
            return map_list(self._lift_any, v)
        if isinstance(v, dict):
            return map_dict(self._lift_any, v)
        if isinstance(v, (set, frozenset)):
            return self._lift_set(v, X.SET if isinstance(v, set) else X.FROZENSET)
        leaf = leaf_encoder(t)
        if leaf is not None:
            return leaf(v)
        self._atomic.add(t)  # no value of this type holds anything to lift
        return v

    def _lift_struct(self, v: msgspec.Struct) -> Any:
        cls = type(v)
        plan = self._plans.get(cls)
        if plan is None:
            plan = self._plans[cls] = struct_plan(cls, self._lift_any, self._lift_struct)
            if not plan:
                self._atomic.add(cls)
        if not plan:
            return v
        changes = None
        for name, lift in plan:
            old = getattr(v, name)
            new = lift(old)
            if new is not old:
                if changes is None:
                    changes = {}
                changes[name] = new
        if changes is None:
            return v
        return msgspec.structs.replace(v, **changes)


# --------------------------------------------------------------------------- decoding


def _split_buffer(data: memoryview, what: str) -> tuple[Any, memoryview]:
    n = len(data)
    if n < 4:
        raise DecodeError(f"{what}: payload of {n} bytes is too short for its metadata length")
    (mlen,) = _U32.unpack_from(data)
    end = 4 + mlen
    if end > n:
        raise DecodeError(f"{what}: metadata length {mlen} runs past the {n}-byte payload")
    try:
        meta = _meta_decoder.decode(data[4:end])
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise DecodeError(f"{what}: malformed metadata ({exc})") from exc
    return meta, data[end:]


def _check_shape(shape: Any, what: str) -> tuple[int, ...]:
    if not isinstance(shape, list) or len(shape) > MAX_NDIM:
        raise DecodeError(f"{what}: shape must be a list of at most {MAX_NDIM} dimensions")
    for d in shape:
        if type(d) is not int or not 0 <= d < _MAX_DIM:
            raise DecodeError(f"{what}: dimension {d!r:.40} is negative, absurd or not an int")
    return tuple(shape)


def _check_raw(raw: memoryview, shape: tuple[int, ...], itemsize: int, what: str) -> int:
    count = math.prod(shape)
    if count * itemsize != len(raw):
        raise DecodeError(
            f"{what}: {len(raw)} raw bytes do not match shape {list(shape)} "
            f"x itemsize {itemsize} = {count * itemsize}"
        )
    return count


def _check_text(raw: Any, dtype: np.dtype[Any], what: str) -> None:
    """numpy ``U`` items are UCS-4 code points: one past U+10FFFF would make reading
    the item fail later (a SystemError deep in numpy), so it is refused here."""
    if dtype.kind == "U" and len(raw):
        codes = np.frombuffer(raw, dtype=dtype.byteorder + "u4")
        if int(codes.max()) > 0x10FFFF:
            raise DecodeError(f"{what}: {dtype} text holds a code point past U+10FFFF")


def _check_device(text: Any) -> str:
    if not isinstance(text, str) or _DEVICE_RE.fullmatch(text) is None:
        raise DecodeError(f"device {text!r:.40} is not an allowed device string")
    return text


check_device = _check_device  # the public name (the SGLang profile checks devices too)


class Decoder:
    """Decode msgpack bytes produced by :class:`Encoder`.

    Parameters
    ----------
    type:
        The expected type (a :class:`~ringwire.Record` subclass, ``list[int]``, ...);
        ``Any`` (the default) decodes untyped.  Fields annotated ``np.ndarray`` or
        ``torch.Tensor`` are accepted.
    resolver:
        Turns an Ext 4/5 descriptor into memory (the transport supplies it).  Without
        one, the validated :class:`SlotRef` / :class:`CudaRef` itself is returned.
    zero_copy:
        ``False`` (default): inline arrays and tensors are copied out of the message,
        writable and independent of it.  ``True``: numpy arrays are read-only views of
        the message buffer (kept alive by them); torch tensors are still copied,
        because torch has no read-only tensors.
    cuda_fallback:
        What to do with an inline tensor that was on a CUDA device this process does
        not have: ``"error"`` (default) raises :class:`DecodeError`, ``"cpu"`` returns
        it on the CPU.
    profile:
        ``"ringwire"`` (default) or ``"sglang"``: read SGLang's ``msgpack_utils``
        dialect into the values SGLang's decoder gives (see
        :mod:`ringwire._wire.sglang`; the resolver then receives each
        :class:`~ringwire.SGLangState`).

    :meth:`decode` raises :class:`~ringwire.DecodeError` (a ``ValueError``) for any
    malformed, truncated, inconsistent or disallowed input, and never anything else
    for bad bytes.  Instances are safe to share between threads.
    """

    profile: Profile = "ringwire"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "profile" in cls.__dict__:  # a profile: Decoder(profile=...) makes one
            _DECODER_PROFILES[cls.profile] = cls

    def __new__(cls, type: Any = Any, *, profile: Profile = "ringwire", **_: Any) -> Decoder:
        if profile == cls.profile:
            return super().__new__(cls)
        sub = _DECODER_PROFILES.get(profile) if cls is Decoder else None
        if sub is None:
            raise ValueError(f"{cls.__name__} has no profile {profile!r}")
        return super().__new__(sub)

    def __init__(
        self,
        type: Any = Any,
        *,
        resolver: Resolver | None = None,
        zero_copy: bool = False,
        cuda_fallback: Literal["error", "cpu"] = "error",
        dec_hook: Callable[[type, Any], Any] | None = None,
        profile: Profile = "ringwire",
    ) -> None:
        if cuda_fallback not in ("error", "cpu"):
            raise ValueError(f"cuda_fallback must be 'error' or 'cpu', not {cuda_fallback!r}")
        self.type = type
        self._resolver = resolver
        self._zero_copy = bool(zero_copy)
        self._cuda_fallback = cuda_fallback
        self._user_dec_hook = dec_hook
        self._msg = msgspec.msgpack.Decoder(type, ext_hook=self._ext_hook, dec_hook=self._dec_hook)
        self._any = msgspec.msgpack.Decoder(ext_hook=self._ext_hook)
        # decode() without its error translation (one Python frame less per record, for
        # a hot loop): what it raises must go through reraise()
        self.raw_decode: Callable[[Any], Any] = (
            self._msg.decode if self.__class__.decode is Decoder.decode else self.decode
        )
        self._ext_table: dict[int, Callable[[memoryview], Any]] = {
            X.ARRAY: self._array,
            X.TORCH_TENSOR: self._tensor,
            X.NUMPY_ARRAY: self._ndarray,
            X.SHM_REF: self._shm_ref,
            X.CUDA_REF: self._cuda_ref,
            X.NET_REF: self._net_ref,
            X.NIXL_REF: self._nixl_ref,
            X.TRACED: self._traced,
            X.TUPLE: self._tuple,
            X.TORCH_SIZE: self._torch_size,
            X.TORCH_DTYPE: self._torch_dtype,
            X.TORCH_DEVICE: self._torch_device,
            X.NUMPY_DTYPE: self._numpy_dtype,
            X.NUMPY_SCALAR: self._numpy_scalar,
            **leaf_decoders(self._decode_any),
        }

    def decode(self, buf: bytes | bytearray | memoryview) -> Any:
        """Decode one message.  Raises :class:`~ringwire.DecodeError`."""
        try:
            return self._msg.decode(buf)
        except DecodeError:
            raise
        except (msgspec.DecodeError, UnicodeDecodeError) as exc:
            raise DecodeError(str(exc)) from exc
        except RecursionError as exc:
            raise DecodeError("message is nested too deeply") from exc

    @staticmethod
    def reraise(exc: BaseException) -> NoReturn:
        """Raise what :meth:`decode` would have raised where :attr:`raw_decode` raised
        ``exc``: a :class:`~ringwire.DecodeError` for a malformed message, else ``exc``."""
        if isinstance(exc, (msgspec.DecodeError, UnicodeDecodeError)) and not isinstance(
            exc, DecodeError
        ):
            raise DecodeError(str(exc)) from exc
        if isinstance(exc, RecursionError):
            raise DecodeError("message is nested too deeply") from exc
        raise exc

    # -- hooks --------------------------------------------------------------------------

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        handler = self._ext_table.get(code)
        if handler is None:
            return Ext(code, bytes(data))
        try:
            return handler(data)
        except DecodeError:
            raise
        except Exception as exc:  # a bug or an unforeseen bad input: still a DecodeError
            raise DecodeError(f"Ext {code}: {type(exc).__name__}: {exc}") from exc

    def _dec_hook(self, tp: type, obj: Any) -> Any:
        if isinstance(tp, type) and isinstance(obj, tp):
            return obj
        if self._user_dec_hook is not None:
            return self._user_dec_hook(tp, obj)
        raise TypeError(f"Expected `{getattr(tp, '__qualname__', tp)}`, got `{type(obj).__name__}`")

    # -- Ext handlers -------------------------------------------------------------------

    def _array(self, data: memoryview) -> array.array[Any]:
        typecode, raw = _split_buffer(data, "Ext 1 (array.array)")
        if not isinstance(typecode, str) or typecode not in _ARRAY_TYPECODES:
            raise DecodeError(f"Ext 1 (array.array): typecode {typecode!r:.20} is not allowed")
        out = array.array(typecode)
        if len(raw) % out.itemsize:
            raise DecodeError(
                f"Ext 1 (array.array): {len(raw)} bytes is not a multiple of the "
                f"{out.itemsize}-byte item size"
            )
        out.frombytes(raw)
        return out

    def _ndarray(self, data: memoryview) -> np.ndarray[Any, Any]:
        what = "Ext 3 (numpy array)"
        meta, raw = _split_buffer(data, what)
        if not isinstance(meta, list) or len(meta) != 2:
            raise DecodeError(f"{what}: metadata must be [shape, dtype]")
        shape = _check_shape(meta[0], what)
        dtype = numpy_dtype_from_wire(meta[1])
        count = _check_raw(raw, shape, dtype.itemsize, what)
        _check_text(raw, dtype, what)
        if not count:
            return np.empty(shape, dtype)
        if self._zero_copy:
            view = np.frombuffer(raw, dtype=dtype, count=count).reshape(shape)
            view.flags.writeable = False
            return view
        return np.frombuffer(raw, dtype=dtype, count=count).reshape(shape).copy()

    def _tensor(self, data: memoryview) -> Any:
        what = "Ext 2 (torch tensor)"
        meta, raw = _split_buffer(data, what)
        if not isinstance(meta, list) or len(meta) != 3:
            raise DecodeError(f"{what}: metadata must be [shape, dtype, device]")
        shape = _check_shape(meta[0], what)
        torch = torch_module()
        dtype = torch_dtype_from_wire(meta[1])
        device = _check_device(meta[2])
        _check_raw(raw, shape, dtype.itemsize, what)
        # Allocate raw bytes and view them as the dtype: no dtype-specific allocation
        # path (complex32's warns), and bfloat16/float8 need no numpy equivalent.
        # The copy is made by numpy, whose allocator asks for huge pages (torch.empty's
        # does not: 4x slower at 64 MiB from page faults alone).
        if len(raw):
            flat = torch.from_numpy(np.frombuffer(raw, np.uint8).copy())
            out = flat.view(dtype).reshape(shape)
        else:
            out = torch.empty(0, dtype=torch.uint8).view(dtype).reshape(shape)
        if device == "cpu":
            return out
        return self._to_device(out, device, what)

    def _to_device(self, t: Any, device: str, what: str) -> Any:
        torch = torch_module()
        dev = torch.device(device)
        available = False
        if dev.type == "cuda":
            available = torch.cuda.is_available() and (dev.index or 0) < torch.cuda.device_count()
        elif dev.type == "mps":
            available = (
                bool(getattr(torch.backends, "mps", None)) and torch.backends.mps.is_available()
            )
        elif dev.type == "xpu":
            xpu = getattr(torch, "xpu", None)
            available = (
                xpu is not None and xpu.is_available() and (dev.index or 0) < xpu.device_count()
            )
        if available:
            return t.to(dev)
        if self._cuda_fallback == "cpu":
            return t
        raise DecodeError(
            f"{what}: the tensor was on {device}, which this process does not have "
            "(pass Decoder(cuda_fallback='cpu') to receive it on the CPU)"
        )

    def _shm_ref(self, data: memoryview) -> Any:
        ref = decode_descriptor(SlotRef, data)
        return ref if self._resolver is None else self._resolver(ref)

    def _cuda_ref(self, data: memoryview) -> Any:
        ref = decode_descriptor(CudaRef, data)
        return ref if self._resolver is None else self._resolver(ref)

    def _net_ref(self, data: memoryview) -> Any:
        ref = decode_descriptor(NetRef, data)
        return ref if self._resolver is None else self._resolver(ref)

    def _nixl_ref(self, data: memoryview) -> Any:
        ref = decode_descriptor(NixlRef, data)
        return ref if self._resolver is None else self._resolver(ref)

    def _traced(self, data: memoryview) -> Any:
        # a traced record this decoder does not continue (the context is dropped)
        return self._any.decode(traced_body(data)[2])

    def _tuple(self, data: memoryview) -> tuple[Any, ...]:
        items = self._decode_any(data, "Ext 6 (tuple)")
        if not isinstance(items, list):
            raise DecodeError("Ext 6 (tuple): payload is not an array")
        return tuple(items)

    def _torch_size(self, data: memoryview) -> Any:
        dims = _check_shape(self._decode_any(data, "Ext 7 (torch.Size)"), "Ext 7 (torch.Size)")
        return torch_module().Size(dims)

    def _torch_dtype(self, data: memoryview) -> Any:
        return torch_dtype_from_wire(self._decode_any(data, "Ext 8 (torch.dtype)"))

    def _torch_device(self, data: memoryview) -> Any:
        return torch_module().device(_check_device(self._decode_any(data, "Ext 9 (torch.device)")))

    def _numpy_dtype(self, data: memoryview) -> np.dtype[Any]:
        text = self._decode_any(data, "Ext 10 (numpy dtype)")
        if isinstance(text, str) and text in _UNSIZED:
            return np.dtype(text)  # np.dtype(str) / np.dtype(bytes): a dtype, never items
        return numpy_dtype_from_wire(text)

    def _numpy_scalar(self, data: memoryview) -> np.generic:
        what = "Ext 11 (numpy scalar)"
        meta = self._decode_any(data, what)
        if not (isinstance(meta, list) and len(meta) == 2 and isinstance(meta[1], bytes)):
            raise DecodeError(f"{what}: payload must be [dtype, raw bytes]")
        dtype = numpy_dtype_from_wire(meta[0])
        if len(meta[1]) != dtype.itemsize:
            raise DecodeError(f"{what}: {len(meta[1])} bytes for a {dtype.itemsize}-byte {dtype}")
        _check_text(meta[1], dtype, what)
        return np.frombuffer(meta[1], dtype=dtype)[0]

    def _decode_any(self, data: memoryview, what: str) -> Any:
        try:
            return self._any.decode(data)
        except DecodeError:
            raise
        except (msgspec.DecodeError, UnicodeDecodeError) as exc:
            raise DecodeError(f"{what}: {exc}") from exc


_default_encoder: Encoder | None = None
_default_decoder: Decoder | None = None


def encode(obj: Any) -> bytes:
    """``obj`` as msgpack bytes, with a shared default :class:`Encoder` (arrays and
    tensors inline: Ext 1-3).  Raises :class:`EncodeError` for a value ringwire cannot
    encode (it names the type and where it was)."""
    global _default_encoder
    if _default_encoder is None:
        _default_encoder = Encoder()
    return _default_encoder.encode(obj)


def decode(buf: bytes | bytearray | memoryview, *, type: Any = Any) -> Any:
    """The value encoded in ``buf``, with a default :class:`Decoder` (a new one when
    ``type`` is given: the value is decoded as that type).  Raises
    :class:`DecodeError` for bytes that are not a valid message of that type (it says
    what was wrong)."""
    global _default_decoder
    if type is not Any:
        return Decoder(type).decode(buf)
    if _default_decoder is None:
        _default_decoder = Decoder()
    return _default_decoder.decode(buf)
