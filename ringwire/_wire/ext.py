"""The Ext code table: a stable wire contract.

Changing a number here breaks every peer running an older ringwire; the golden-bytes
tests in ``tests/unit/test_codec.py`` pin each of them.

=====  ============================  =====================================================
code   meaning                       payload
=====  ============================  =====================================================
1      ``array.array``               buffer layout; metadata = typecode
2      ``torch.Tensor`` inline copy  buffer layout; metadata = [shape, dtype name, device]
3      ``numpy.ndarray`` inline copy buffer layout; metadata = [shape, dtype.str]
4      SHM slot reference            msgpack :class:`ringwire.wire.SlotRef` (versioned)
5      CUDA IPC reference            msgpack :class:`ringwire.wire.CudaRef` (versioned)
6      ``tuple``                     msgpack array of the items (each encoded again)
7      ``torch.Size``                msgpack array of ints
8      ``torch.dtype``               msgpack str, the name without ``torch.``
9      ``torch.device``              msgpack str, ``str(device)``
10     ``numpy.dtype``               msgpack str, ``dtype.str``
11     numpy scalar                  msgpack [dtype.str, bin raw bytes]
12     ``set``                       msgpack array of the items (each encoded again)
13     ``frozenset``                 msgpack array of the items (each encoded again)
14     ``datetime.datetime``         msgpack str, ``isoformat()`` (offset when aware)
15     ``datetime.date``             msgpack str, ``isoformat()``
16     ``datetime.time``             msgpack str, ``isoformat()`` (offset when aware)
17     ``datetime.timedelta``        msgpack [days, seconds, microseconds]
18     ``uuid.UUID``                 msgpack bin, the 16 bytes
19     ``decimal.Decimal``           msgpack str, ``str(value)``
20     network tensor reference      msgpack :class:`ringwire.wire.NetRef` (versioned): an array
                                     that travels as a frame of its own beside the record
                                     (TCP connections, :mod:`ringwire._net`)
21     NIXL tensor reference         msgpack :class:`ringwire.wire.NixlRef` (versioned): an array
                                     the receiver reads through NIXL from the sender's
                                     registered memory (:mod:`ringwire._net.nixl`)
22     traced record                 msgpack [traceparent, tracestate, the record]: a
                                     record and its sender's W3C trace context
                                     (:mod:`.traced`; only at the top of a message)
=====  ============================  =====================================================

Codes 6-19 are *typed leaves*: values msgspec would encode as something else (an
array, a string) and so lose their type.  They are written only in untyped positions
(see :mod:`.codec`); a typed field keeps msgspec's own form.

The SGLang profile (:mod:`.sglang`) writes only codes 1-5, with SGLang's meanings for
4 and 5 (the msgpack state of its ``ShmPointerMMData`` / ``CudaIpcTensorTransportProxy``),
and reads 6-19 as unknown codes, as SGLang does.

Buffer layout (codes 1-3, byte-compatible with SGLang's ``msgpack_utils``)::

    [u32 big-endian metadata length][msgpack metadata][raw C-contiguous bytes]

Codes outside this table decode to :class:`msgspec.msgpack.Ext` unchanged, so a newer
peer's extensions pass through an older one.
"""

from __future__ import annotations

import enum

__all__ = ["ExtCode"]

# Plain ints (msgspec.msgpack.Ext wants an exact int); ExtCode names the same numbers.
ARRAY = 1
TORCH_TENSOR = 2
NUMPY_ARRAY = 3
SHM_REF = 4
CUDA_REF = 5
TUPLE = 6
TORCH_SIZE = 7
TORCH_DTYPE = 8
TORCH_DEVICE = 9
NUMPY_DTYPE = 10
NUMPY_SCALAR = 11
SET = 12
FROZENSET = 13
DATETIME = 14
DATE = 15
TIME = 16
TIMEDELTA = 17
UUID = 18
DECIMAL = 19
NET_REF = 20
NIXL_REF = 21
TRACED = 22


class ExtCode(enum.IntEnum):
    """The Ext codes ringwire uses (see the module docstring for each payload)."""

    ARRAY = ARRAY
    TORCH_TENSOR = TORCH_TENSOR
    NUMPY_ARRAY = NUMPY_ARRAY
    SHM_REF = SHM_REF
    CUDA_REF = CUDA_REF
    TUPLE = TUPLE
    TORCH_SIZE = TORCH_SIZE
    TORCH_DTYPE = TORCH_DTYPE
    TORCH_DEVICE = TORCH_DEVICE
    NUMPY_DTYPE = NUMPY_DTYPE
    NUMPY_SCALAR = NUMPY_SCALAR
    SET = SET
    FROZENSET = FROZENSET
    DATETIME = DATETIME
    DATE = DATE
    TIME = TIME
    TIMEDELTA = TIMEDELTA
    UUID = UUID
    DECIMAL = DECIMAL
    NET_REF = NET_REF
    NIXL_REF = NIXL_REF
    TRACED = TRACED
