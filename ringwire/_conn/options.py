"""The keywords every entry point that makes a connection shares, checked in one place.

:func:`~ringwire.connect`, :func:`~ringwire.listen`, :meth:`PairEnd.connect
<ringwire.PairEnd.connect>` (and their blocking twins) take the same options with the
same meaning, and refuse a bad one before anything is created:

``spin_us``
    how long a waiting endpoint spins before it parks (microseconds, >= 0).
``handshake_timeout``
    seconds one handshake may take (> 0); per-operation waits take ``timeout=``.
``copy_out``
    the *receiving* side's choice: every array that arrives in one of the peer's slots
    is copied into private memory and its slot released at once (the arrays are
    writable, nothing holds the peer's pool).  It is set on the transport's receive
    pool by :func:`receiving`, before the endpoint decodes its first record; a
    connection with no receive pool (the peer sends every array inline) ignores it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DEFAULT_HANDSHAKE_TIMEOUT", "check_options", "receiving"]

DEFAULT_HANDSHAKE_TIMEOUT = 10.0
"""Seconds one handshake may take unless ``handshake_timeout=`` says otherwise."""


def check_options(spin_us: float, handshake_timeout: float, copy_out: bool = False) -> None:
    """Refuse bad ``spin_us`` / ``handshake_timeout`` / ``copy_out`` before anything
    is made (``ValueError`` / ``TypeError`` naming the keyword and the value)."""
    if isinstance(spin_us, bool) or not isinstance(spin_us, (int, float)) or not spin_us >= 0:
        raise ValueError(f"spin_us must be a number of microseconds >= 0, not {spin_us!r}")
    if (
        isinstance(handshake_timeout, bool)
        or not isinstance(handshake_timeout, (int, float))
        or not handshake_timeout > 0
    ):
        raise ValueError(
            f"handshake_timeout must be a number of seconds > 0, not {handshake_timeout!r}"
        )
    if not isinstance(copy_out, bool):
        raise TypeError(f"copy_out must be a bool, not {copy_out!r}")


def receiving(transport: Any, copy_out: bool) -> Any:
    """``transport``, its receive pool (if it has one) set to ``copy_out``; call it
    before an endpoint is made over the transport (no record is decoded before)."""
    pool = transport.recv_pool
    if pool is not None:
        pool.copy_out = copy_out
    return transport
