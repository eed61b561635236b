"""Allow-lists that turn wire strings into dtypes.

A dtype name read off the wire is only ever looked up in these tables: never
``getattr(torch, name)``, never ``np.dtype(arbitrary string)`` before the string has
matched the numpy grammar below.  Object, structured and void dtypes have no entry,
so they can neither be encoded nor decoded.

torch is imported lazily: the torch table is built the first time a torch value is
encoded or decoded, so a numpy-only user never imports torch.
"""

from __future__ import annotations

import re
import sys
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import numpy as np

from .._errors import DecodeError, EncodeError

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "numpy_dtype_from_wire",
    "numpy_dtype_to_wire",
    "torch_dtype_from_wire",
    "torch_dtype_to_wire",
    "torch_module",
    "torch_loaded",
    "MAX_NDIM",
]

# numpy refuses more dimensions than this anyway; torch accepts more but nobody sends them.
MAX_NDIM = 64

# dtype.str grammar: byte order, kind, item size, optional datetime unit.
_NUMPY_WIRE = re.compile(
    r"(?P<order>[<>|])(?:"
    r"(?P<num>[biufc])(?P<size>\d{1,2})"
    r"|(?P<time>[mM])8(?:\[(?P<unit>Y|M|W|D|h|m|s|ms|us|ns|ps|fs|as)\])?"
    r"|(?P<text>[SU])(?P<tsize>\d{1,9})"
    r")"
)
_NUMERIC_SIZES = {
    "b": {1},
    "i": {1, 2, 4, 8},
    "u": {1, 2, 4, 8},
    "f": {2, 4, 8, 12, 16},
    "c": {8, 16, 24, 32},
}
_ENCODABLE_KINDS = frozenset("biufcmMSU")


def numpy_dtype_to_wire(dtype: np.dtype[Any]) -> str:
    """Return ``dtype.str`` or raise :class:`EncodeError` for object/structured dtypes."""
    if dtype.kind not in _ENCODABLE_KINDS or dtype.fields is not None or dtype.subdtype:
        raise EncodeError(
            f"numpy dtype {dtype!r} cannot be sent: object, structured and void dtypes "
            "are refused (ringwire never pickles)"
        )
    return dtype.str


def numpy_dtype_from_wire(text: object) -> np.dtype[Any]:
    """Parse a wire dtype string through the allow-list; :class:`DecodeError` otherwise."""
    # checked before the cache, which would raise TypeError for an unhashable list
    if not isinstance(text, str) or len(text) > 16:
        raise DecodeError(f"numpy dtype must be a short string, got {text!r:.40}")
    return _numpy_dtype_from_wire(text)


@lru_cache(maxsize=256)
def _numpy_dtype_from_wire(text: str) -> np.dtype[Any]:
    m = _NUMPY_WIRE.fullmatch(text)
    if m is None:
        raise DecodeError(f"numpy dtype {text!r} is not an allowed dtype")
    if m["num"] and int(m["size"]) not in _NUMERIC_SIZES[m["num"]]:
        raise DecodeError(f"numpy dtype {text!r} has an impossible item size")
    if m["text"] and int(m["tsize"]) == 0:
        raise DecodeError(f"numpy dtype {text!r} has item size 0")
    try:
        dtype = np.dtype(text)
    except TypeError as exc:  # e.g. '<f12' on a platform without that long double
        raise DecodeError(f"numpy dtype {text!r} does not exist on this platform") from exc
    return dtype


def torch_loaded() -> bool:
    """True when torch is already imported (so values may be torch objects)."""
    return "torch" in sys.modules


def torch_module() -> Any:
    """Import torch on first use, with an actionable error when it is missing."""
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise DecodeError(
            "this message holds a torch value but torch is not installed "
            "(pip install 'ringwire[torch]')"
        ) from exc
    return torch


# Every dtype torch has shipped that is plain bits in memory.  Names are ours; each one
# that this torch build lacks is skipped.  Quantized and "bits" dtypes are left out.
_TORCH_DTYPE_NAMES = (
    "bool",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "complex32",
    "complex64",
    "complex128",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "float4_e2m1fn_x2",
)


@lru_cache(maxsize=1)
def _torch_tables() -> tuple[dict[str, torch.dtype], dict[torch.dtype, str]]:
    tm = torch_module()
    by_name: dict[str, torch.dtype] = {}
    for name in _TORCH_DTYPE_NAMES:
        dtype = getattr(tm, name, None)
        if isinstance(dtype, tm.dtype):
            by_name[str(dtype).removeprefix("torch.")] = dtype
    return by_name, {d: n for n, d in by_name.items()}


def torch_dtype_to_wire(dtype: torch.dtype) -> str:
    name = _torch_tables()[1].get(dtype)
    if name is None:
        raise EncodeError(f"torch dtype {dtype} cannot be sent (not a plain-bits dtype)")
    return name


def torch_dtype_from_wire(name: object) -> torch.dtype:
    if not isinstance(name, str):
        raise DecodeError(f"torch dtype name must be a string, got {type(name).__name__}")
    dtype = _torch_tables()[0].get(name)
    if dtype is None:
        raise DecodeError(f"torch dtype {name!r:.40} is not an allowed dtype")
    return dtype
