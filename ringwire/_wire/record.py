"""``Record``: the base class for IPC records.

A record is a ``msgspec.Struct`` with ``kw_only=True, array_like=True, dict=True,
weakref=True``:

* ``array_like`` puts fields on the wire by position, not by name: compact, and the
  reason fields are *append-only* -- add new fields at the end, with a default, and
  messages written before them still decode.  Never reorder or remove a field.
* ``weakref`` lets the transport attach finalizers to a received record.
* ``dict`` gives instances a ``__dict__`` for private (``_name``) attributes, which are
  never serialized.

Assigning an attribute the class does not declare stores it in ``extras`` (the
first field on the wire), so it crosses the process boundary and reads back as an
attribute -- code that grew attributes dynamically keeps working.  A field named
``hash`` is normalized to its low 64 bits on construction and assignment, so a
128/256-bit digest or ``uuid4().int`` can be stored.

SGLang's own structs keep their dynamic-attribute dict (``model_specific_data``) *last*:
:class:`ringwire.SGLangRecord` (in :mod:`.sglang`) is the base shaped like them, for
the SGLang profile of the codec.
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = ["Record", "HASH_MASK"]

HASH_MASK = (1 << 64) - 1


class _RecordMeta(msgspec.StructMeta):
    """Makes every subclass ``kw_only`` too.

    msgspec orders positional fields before keyword-only ones; a subclass that forgot
    ``kw_only=True`` would put its own fields *before* ``extras`` on the wire, and
    appending a field later would shift ``extras`` -- breaking old messages.
    """

    def __new__(mcls, name: str, bases: Any, namespace: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("kw_only", True)
        return super().__new__(mcls, name, bases, namespace, **kwargs)


class Record(
    msgspec.Struct,
    metaclass=_RecordMeta,
    kw_only=True,
    array_like=True,
    dict=True,
    weakref=True,
):
    """Base class for records sent through ringwire (see the module docstring)."""

    extras: dict[str, object] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        if "hash" in self.__struct_fields__:
            h = getattr(self, "hash")  # noqa: B009 - a subclass field, not the builtin
            if isinstance(h, int) and not 0 <= h <= HASH_MASK:
                msgspec.Struct.__setattr__(self, "hash", h & HASH_MASK)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self.__struct_fields__:
            if name == "hash" and isinstance(value, int) and not 0 <= value <= HASH_MASK:
                value &= HASH_MASK
            msgspec.Struct.__setattr__(self, name, value)
        elif name.startswith("_"):
            msgspec.Struct.__setattr__(self, name, value)  # into __dict__, not on the wire
        else:
            self.extras[name] = value

    def __getattr__(self, name: str) -> Any:
        # only called when normal lookup failed
        if not name.startswith("__"):
            try:
                extras = msgspec.Struct.__getattribute__(self, "extras")
            except AttributeError:
                extras = None
            if extras is not None and name in extras:
                return extras[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __delattr__(self, name: str) -> None:
        if name not in self.__struct_fields__ and name in self.extras:
            del self.extras[name]
        else:
            msgspec.Struct.__delattr__(self, name)

    def set(self, name: str, value: Any) -> None:
        """Store ``value`` in :attr:`extras` under ``name`` (even if ``name`` is a field)."""
        self.extras[name] = value
