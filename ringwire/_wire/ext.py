"""The Ext code table: a stable wire contract.

Changing a number here breaks every peer running an older ringwire; the golden-bytes
tests in ``tests/unit/test_codec.py`` pin each of them.

=====  ============================  =====================================================
code   meaning                       payload
=====  ============================  =====================================================
1      ``array.array``               buffer layout; metadata = typecode
2      ``torch.Tensor`` inline copy  buffer layout; metadata = [shape, dtype name, device]
3      ``numpy.ndarray`` inline copy buffer layout; metadata = [shape, dtype.str]
4      SHM slot reference            msgpack :class:`ringwire.SlotRef` (versioned)
5      CUDA IPC reference            msgpack :class:`ringwire.CudaRef` (versioned)
6      ``tuple``                     msgpack array of the items (each encoded again)
7      ``torch.Size``                msgpack array of ints
8      ``torch.dtype``               msgpack str, the name without ``torch.``
9      ``torch.device``              msgpack str, ``str(device)``
10     ``numpy.dtype``               msgpack str, ``dtype.str``
11     numpy scalar                  msgpack [dtype.str, bin raw bytes]
=====  ============================  =====================================================

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
