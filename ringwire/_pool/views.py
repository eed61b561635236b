"""What users call on received slot views: release now, borrow, copy out.

Every received slot array / tensor has a finalizer (see :mod:`ringwire._shm.recvpool`)
that releases its slot when the last view of it dies.  :func:`release` runs those
finalizers now; :func:`borrow` is a context manager that does it on exit;
:func:`copy_out` replaces the views by private copies and releases the slots.
:data:`HELD` maps the base address of every received slot array alive in this process
to its finalizer, so any view of it -- a numpy slice, ``torch.from_numpy``, a torch
view -- finds its slot.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import numpy as np

from .._wire.dtypes import (
    torch_loaded,
    torch_module,
)

__all__ = [
    "HELD",
    "borrow",
    "copy_out",
    "release",
]


# Every received slot array alive in this process: base address -> its finalizer
# (so release() / copy_out() can find the slot of any view of it).
HELD: dict[int, weakref.finalize[Any, Any]] = {}

# -- public helpers -----------------------------------------------------------------------


def _holder(x: Any) -> weakref.finalize[Any, Any] | None:
    """The finalizer of the received slot behind array / tensor ``x``, if any."""
    for _ in range(64):
        if isinstance(x, np.ndarray):
            fin = HELD.get(x.__array_interface__["data"][0])
            if fin is not None:
                return fin
            x = x.base
            continue
        if torch_loaded():
            torch = torch_module()
            if isinstance(x, torch.Tensor):
                try:
                    addr = x.untyped_storage().data_ptr()
                except Exception:
                    return None
                return HELD.get(addr)
        return None
    return None


def _is_array(x: Any) -> bool:
    if isinstance(x, np.ndarray):
        return True
    return torch_loaded() and isinstance(x, torch_module().Tensor)


def _walk(
    obj: Any, leaf: Callable[[Any], Any], seen: set[int], depth: int = 0
) -> Any:  # returns the (possibly) rebuilt object
    if depth > 100:
        return obj
    t = type(obj)
    if t in (int, float, str, bytes, bool, type(None)):
        return obj
    if _is_array(obj):
        return leaf(obj)
    if id(obj) in seen:
        return obj
    seen.add(id(obj))
    if isinstance(obj, list):
        new = [_walk(v, leaf, seen, depth + 1) for v in obj]
        return obj if all(a is b for a, b in zip(new, obj)) else type(obj)(new)
    if isinstance(obj, tuple):
        new = [_walk(v, leaf, seen, depth + 1) for v in obj]
        if all(a is b for a, b in zip(new, obj)):
            return obj
        return type(obj)(*new) if hasattr(obj, "_fields") else type(obj)(new)
    if isinstance(obj, dict):
        newd = {k: _walk(v, leaf, seen, depth + 1) for k, v in obj.items()}
        if all(newd[k] is v for k, v in obj.items()):
            return obj
        return newd if t is dict else t(newd)
    if isinstance(obj, msgspec.Struct):
        changes = {}
        for name in obj.__struct_fields__:
            old = getattr(obj, name)
            new_v = _walk(old, leaf, seen, depth + 1)
            if new_v is not old:
                changes[name] = new_v
        return msgspec.structs.replace(obj, **changes) if changes else obj
    return obj


def release(obj: Any) -> int:
    """Release now every received slot array / tensor in ``obj`` (an array, or a
    record / list / tuple / dict holding them); return how many slots were released.

    Idempotent.  After it, the arrays still point at the slot memory, which the
    producer may reuse at any moment: do not read them any more (see
    :func:`copy_out` to keep the data)."""
    fins: list[weakref.finalize[Any, Any]] = []

    def leaf(x: Any) -> Any:
        fin = _holder(x)
        if fin is not None:
            fins.append(fin)
        return x

    _walk(obj, leaf, set())
    n = 0
    for fin in fins:
        if fin.alive:
            fin()
            n += 1
    return n


@contextlib.contextmanager
def borrow(obj: Any) -> Iterator[Any]:
    """``with borrow(record) as rec:`` -- on exit, release every received slot array or
    tensor in ``record`` (as :func:`release`), whatever views of them are still alive:
    using such a view afterwards reads memory the sender may reuse.  Yields ``record``
    itself; raises nothing of its own."""
    try:
        yield obj
    finally:
        release(obj)


def copy_out(obj: Any) -> Any:
    """A copy of ``obj`` in which every received slot array / tensor is replaced by a
    private (writable) copy, and those slots released.  Containers are rebuilt only
    where something changed; other values are shared."""
    fins: list[weakref.finalize[Any, Any]] = []

    def leaf(x: Any) -> Any:
        fin = _holder(x)
        if fin is None:
            return x
        fins.append(fin)
        if isinstance(x, np.ndarray):
            return np.array(x, copy=True)
        return x.clone()

    out = _walk(obj, leaf, set())
    for fin in fins:
        if fin.alive:
            fin()
    return out
