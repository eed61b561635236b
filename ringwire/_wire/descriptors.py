"""Ext 4 and Ext 5 payloads: references to tensors that live outside the message.

A descriptor says *where* a tensor is (pool, slot, generation, byte range) and *what*
it is (shape, dtype, kind).  It never carries a pointer or a path: the pool id is a
number the transport handed out for this connection, so a decoder can only be pointed
at memory it was given.  The codec validates a descriptor's own consistency (version,
non-negative numbers, ``nbytes == prod(shape) * itemsize``, allow-listed dtype); the
transport's resolver checks the pool, slot, generation and bounds against what it owns.

Both are versioned: the first array element is the layout version, and a decoder
refuses versions it does not know with a clear :class:`~ringwire.DecodeError`.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

import msgspec

from .._errors import DecodeError
from .dtypes import MAX_NDIM, numpy_dtype_from_wire, torch_dtype_from_wire

__all__ = [
    "SlotRef",
    "CudaRef",
    "NetRef",
    "NixlRef",
    "DESCRIPTOR_VERSION",
    "KIND_NUMPY",
    "KIND_TORCH",
]

DESCRIPTOR_VERSION = 1
KIND_NUMPY = "numpy"
KIND_TORCH = "torch"

_U64 = Annotated[int, msgspec.Meta(ge=0)]  # msgpack itself caps ints at 2**64 - 1
_Dim = Annotated[int, msgspec.Meta(ge=0, lt=2**48)]
_Shape = Annotated[tuple[_Dim, ...], msgspec.Meta(max_length=MAX_NDIM)]
_Kind = Literal["numpy", "torch"]


def _itemsize(kind: str, dtype: str) -> int:
    if kind == KIND_NUMPY:
        return numpy_dtype_from_wire(dtype).itemsize
    return int(torch_dtype_from_wire(dtype).itemsize)


def _check_nbytes(ref: SlotRef | CudaRef | NetRef | NixlRef) -> None:
    if ref.version != DESCRIPTOR_VERSION:
        raise DecodeError(
            f"{type(ref).__name__} version {ref.version} is not supported "
            f"(this ringwire speaks version {DESCRIPTOR_VERSION})"
        )
    expected = math.prod(ref.shape) * _itemsize(ref.kind, ref.dtype)
    if expected != ref.nbytes:
        raise DecodeError(
            f"{type(ref).__name__} says {ref.nbytes} bytes but shape {list(ref.shape)} of "
            f"{ref.dtype} needs {expected}"
        )


class SlotRef(msgspec.Struct, array_like=True, frozen=True):
    """Ext 4: an array or tensor held in a slot of the producer's SHM pool.

    ``dtype`` is ``numpy.dtype.str`` when ``kind == "numpy"`` and the torch dtype
    name without ``torch.`` when ``kind == "torch"``.
    """

    version: int
    pool: _U64
    slot: _U64
    generation: _U64
    offset: _U64
    nbytes: _U64
    shape: _Shape
    dtype: str
    kind: _Kind

    def validate(self) -> SlotRef:
        _check_nbytes(self)
        return self


class CudaRef(msgspec.Struct, array_like=True, frozen=True):
    """Ext 5: a tensor held in a slot of the producer's CUDA IPC pool.

    ``event`` is the interprocess CUDA event handle recorded after the producer's
    writes (empty when the producer synchronised instead).  ``kind`` is always
    ``"torch"``.  ``pool_handle`` announces the pool (its exported IPC handle, size and
    slot classes, msgpack): the consumer opens the pool the first time it sees its id
    and ignores the announcement afterwards.  ``device`` is the producer's index of
    the device (it names the pool); ``device_uuid`` (16 bytes) says which device that
    is, so that a consumer with other device numbers (``CUDA_VISIBLE_DEVICES``) finds
    its own.  ``lease`` (8 bytes) names the export's lease, which a consumer in another
    process holds while it maps the pool (see ``ringwire._pool.cudablocks``).

    Fields are only ever appended, with defaults: ``pool_handle`` came as the twelfth,
    ``device_uuid`` and ``lease`` as the thirteenth and fourteenth; a shorter form
    still decodes (the missing ones empty), and a decoder that knows fewer fields
    ignores the ones it does not know.
    """

    version: int
    pool: _U64
    device: Annotated[int, msgspec.Meta(ge=0, lt=1024)]
    slot: _U64
    generation: _U64
    offset: _U64
    nbytes: _U64
    shape: _Shape
    dtype: str
    event: Annotated[bytes, msgspec.Meta(max_length=256)] = b""
    kind: Literal["torch"] = "torch"
    pool_handle: Annotated[bytes, msgspec.Meta(max_length=4096)] = b""
    device_uuid: Annotated[bytes, msgspec.Meta(max_length=16)] = b""
    lease: Annotated[bytes, msgspec.Meta(max_length=16)] = b""

    def validate(self) -> CudaRef:
        _check_nbytes(self)
        if len(self.device_uuid) not in (0, 16):
            raise DecodeError(
                f"CudaRef device_uuid has {len(self.device_uuid)} bytes (a UUID has 16)"
            )
        if len(self.lease) not in (0, 8):
            raise DecodeError(f"CudaRef lease has {len(self.lease)} bytes (a lease has 8)")
        return self


class NetRef(msgspec.Struct, array_like=True, frozen=True):
    """Ext 20: an array or tensor that travels beside the record, as frame ``index`` (0
    is the first frame after the record) of the same network message.

    ``tag`` and ``generation`` name the sender's buffer (the receiver hands them back
    when its view dies: the release that completes a receipt); ``dtype`` and ``kind``
    as in :class:`SlotRef`; ``device`` is where the tensor lived on the sender (``""``
    for the host; a CUDA tensor is staged through host memory and restored on the
    receiver's device of that index when it has one).
    """

    version: int
    tag: _U64
    generation: _U64
    index: Annotated[int, msgspec.Meta(ge=0, lt=1 << 16)]
    nbytes: _U64
    shape: _Shape
    dtype: str
    kind: _Kind
    device: Annotated[str, msgspec.Meta(max_length=32)] = ""

    def validate(self) -> NetRef:
        _check_nbytes(self)
        if self.device and not self.device.startswith("cuda"):
            raise DecodeError(f"NetRef device {self.device!r} is not a CUDA device")
        return self


class NixlRef(msgspec.Struct, array_like=True, frozen=True):
    """Ext 21: an array or tensor that the receiver reads through NIXL from the
    sender's registered memory (TCP connections that negotiated NIXL, see
    :mod:`ringwire._net.nixl`).

    ``entry`` is the index of its transfer in the message's transfer list (the frame
    the message carries after the record: region, offset, byte count of each array);
    the receiver's transfer lands at the same offset of its own registered region.
    ``tag``, ``generation``, ``dtype``, ``kind`` and ``device`` as in :class:`NetRef`
    (``device`` is where the tensor lived on the sender; whether it landed in the
    receiver's GPU memory or was staged through host memory says the region).
    """

    version: int
    tag: _U64
    generation: _U64
    entry: Annotated[int, msgspec.Meta(ge=0, lt=1 << 16)]
    nbytes: _U64
    shape: _Shape
    dtype: str
    kind: _Kind
    device: Annotated[str, msgspec.Meta(max_length=32)] = ""

    def validate(self) -> NixlRef:
        _check_nbytes(self)
        if self.device and not self.device.startswith("cuda"):
            raise DecodeError(f"NixlRef device {self.device!r} is not a CUDA device")
        return self


def decode_descriptor(cls: Any, data: memoryview) -> Any:
    try:
        ref = msgspec.msgpack.decode(data, type=cls)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise DecodeError(f"malformed {cls.__name__}: {exc}") from exc
    return ref.validate()
