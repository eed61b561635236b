"""The lift pass's helpers: walking containers, and one plan per Struct class.

The codec (:mod:`.codec`) turns values that msgspec would encode but lose the type of
(tuples, sets, ...) into typed-leaf Ext values, in *untyped* positions only.  These
helpers walk lists and dicts without copying them when nothing changed, and compute,
once per Struct class, which fields can hold an untyped position at all.
"""

from __future__ import annotations

import typing
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import numpy as np

from .lanes import NATIVE

__all__ = ["ATOMIC", "map_list", "map_dict", "map_items", "map_tuple", "needs_lift", "struct_plan"]

needs_lift: Callable[[Any, set[type]], bool] | None = None
"""``needs_lift(obj, atomic)`` (the C fast path, ``ringwire/_wire/_cring.c``): ``False``
when every value in ``obj`` -- through exact lists and dicts' values -- has a type in
``atomic``, so the lift pass would return ``obj`` unchanged and the encoder skips it
(a dict of plain values: one C call instead of a Python walk).  ``None`` on the pure
path."""
if NATIVE:
    from ._cring import needs_lift

# Types whose values never hold anything to lift: the lift pass returns them at once.
ATOMIC: set[type] = {int, float, str, bytes, bool, type(None), bytearray, memoryview, np.ndarray}


def map_list(fn: Callable[[Any], Any], v: list[Any]) -> list[Any]:
    """``[fn(x) for x in v]``, but ``v`` itself when nothing changed (no allocation)."""
    out = None
    for i, x in enumerate(v):
        if type(x) in ATOMIC:
            continue
        y = fn(x)
        if y is not x:
            if out is None:
                out = list(v)
            out[i] = y
    return v if out is None else out


def map_dict(fn: Callable[[Any], Any], v: dict[Any, Any]) -> dict[Any, Any]:
    """``{k: fn(x)}`` over ``v``, but ``v`` itself when nothing changed."""
    out = None
    for k, x in v.items():
        if type(x) in ATOMIC:
            continue
        y = fn(x)
        if y is not x:
            if out is None:
                out = dict(v)
            out[k] = y
    return v if out is None else out


def map_items(fn: Callable[[Any], Any], v: Any) -> Any:
    """A typed list/set/frozenset/Sequence field's value with ``fn`` applied to each
    item; a set whose items changed is sent as a list (its typed decoder makes it a set)."""
    if not v:
        return v
    if type(v) is list:
        return map_list(fn, v)
    if isinstance(v, (set, frozenset)):
        items = list(v)
        new = [fn(x) for x in items]
        return v if all(a is b for a, b in zip(new, items)) else new
    return v


def map_tuple(fns: Sequence[Callable[[Any], Any]], v: tuple[Any, ...]) -> tuple[Any, ...]:
    new = tuple(f(x) for f, x in zip(fns, v))
    return v if all(a is b for a, b in zip(new, v)) else new


def _is_untyped(tp: Any) -> bool:
    return tp is object or tp is Any


def struct_plan(
    cls: type, lift_any: Callable[[Any], Any], lift_struct: Callable[[Any], Any]
) -> tuple[tuple[str, Callable[[Any], Any]], ...]:
    """For each field of ``cls`` that can hold a tuple in an untyped position (or a
    nested Struct that can), the function that lifts it."""
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # unresolvable annotations: treat every field as untyped
        hints = {name: Any for name in cls.__struct_fields__}  # type: ignore[attr-defined]
    plan = []
    for name in cls.__struct_fields__:  # type: ignore[attr-defined]
        fn = _plan_for(hints.get(name, Any), lift_any, lift_struct, depth=0)
        if fn is not None:
            plan.append((name, fn))
    return tuple(plan)


def _plan_for(
    tp: Any,
    lift_any: Callable[[Any], Any],
    lift_struct: Callable[[Any], Any],
    depth: int,
) -> Callable[[Any], Any] | None:
    if depth > 8:
        return lift_any
    if _is_untyped(tp):
        return lift_any
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Annotated:
        return _plan_for(args[0], lift_any, lift_struct, depth + 1)
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return lambda v: lift_struct(v) if isinstance(v, msgspec.Struct) else v
    if origin is typing.Union or type(tp).__name__ == "UnionType":
        subs = [_plan_for(a, lift_any, lift_struct, depth + 1) for a in args]
        if any(s is lift_any for s in subs):
            return lift_any
        if any(s is not None for s in subs):
            # Structs are the only thing worth descending into here
            return lambda v: lift_struct(v) if isinstance(v, msgspec.Struct) else v
        return None
    if origin in (list, set, frozenset, Sequence):
        item = _plan_for(args[0], lift_any, lift_struct, depth + 1) if args else lift_any
        if item is None:
            return None
        return lambda v: map_items(item, v)
    if origin is dict:
        value = _plan_for(args[1], lift_any, lift_struct, depth + 1) if args else lift_any
        if value is None:
            return None
        return lambda v: map_dict(value, v) if v and type(v) is dict else v
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            elem = _plan_for(args[0], lift_any, lift_struct, depth + 1)
            if elem is None:
                return None
            return lambda v: map_tuple([elem] * len(v), v) if isinstance(v, tuple) else v
        subs = [_plan_for(a, lift_any, lift_struct, depth + 1) for a in args]
        if all(s is None for s in subs):
            return None
        fns = [s or (lambda x: x) for s in subs]
        return lambda v: map_tuple(fns, v) if isinstance(v, tuple) and len(v) == len(fns) else v
    return None
