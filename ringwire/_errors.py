"""The ringwire exception hierarchy.

Every error ringwire raises on purpose derives from :class:`RingwireError`, so one
``except RingwireError`` catches them all.  The codec errors are also msgspec's own
(``EncodeError`` is a :class:`msgspec.EncodeError`, ``DecodeError`` is a
:class:`msgspec.DecodeError` and therefore a :class:`ValueError`), so code written
against msgspec keeps working.

Transport failures use anyio's exceptions (``BrokenResourceError``,
``ClosedResourceError``, ``EndOfStream``, ``WouldBlock``) with the meaning anyio gives
them; they are re-exported from :mod:`ringwire` for convenience.
"""

from __future__ import annotations

import msgspec

__all__ = ["RingwireError", "EncodeError", "DecodeError"]


class RingwireError(Exception):
    """Base class of every error ringwire raises on purpose."""


class EncodeError(RingwireError, msgspec.EncodeError):
    """A value cannot be put on the wire (unsupported type, object dtype, too large...)."""


class DecodeError(RingwireError, msgspec.DecodeError):
    """Bytes from the wire are malformed, truncated, or refer to something not given.

    Also a :class:`msgspec.DecodeError` and a :class:`ValueError`.
    """
