"""The active ring lane classes: the C fast path where it was built, else pure Python.

:mod:`ringwire._wire.ring` is the ring's definition (layout, frames, ordering) and its
pure-Python implementation; ``ringwire/_wire/_cring.c`` implements the same lanes in C
with C11 atomics (its header gives the ordering argument: which acquire pairs with
which release).  The wire layout is the contract: a native end and a pure end share
one ring, in one process or across two.

Which one runs:

* :data:`NATIVE` is ``True`` when the extension was built (``pip install`` with a C
  compiler) and imports, and ``RINGWIRE_PURE`` is unset, empty or ``0``;
* ``RINGWIRE_PURE=1`` (read once, at import) forces the pure path;
* :data:`REASON` says why the pure path runs (empty on the native path).

:class:`RingWriter`, :class:`RingReader` and :class:`ReleaseLaneWriter` are the
active classes; both sets stay importable (``Pure*`` and ``Native*``, the latter
``None`` where the extension is absent) for tests that run a lane on each path.
The native classes keep the pure ones' attributes that tests and tools read (the
``header`` view of the u64 words, ``head`` / ``tail_seen`` / ``_tail``...), and raise
the same exceptions with the same messages.
"""

from __future__ import annotations

import os
from typing import Any

from .._errors import FrameTooLarge, RingCorrupted
from .ring import HEADER_SIZE, TAIL, header_view
from .ring import ReleaseLaneWriter as PureReleaseLaneWriter
from .ring import RingReader as PureRingReader
from .ring import RingWriter as PureRingWriter

__all__ = [
    "NATIVE",
    "REASON",
    "NativeReleaseLaneWriter",
    "NativeRingReader",
    "NativeRingWriter",
    "PureReleaseLaneWriter",
    "PureRingReader",
    "PureRingWriter",
    "ReleaseLaneWriter",
    "RingReader",
    "RingWriter",
]

_HEAD = 16  # the head's word index (ring.py's header drawing)

NativeRingWriter: Any = None
NativeRingReader: Any = None
NativeReleaseLaneWriter: Any = None

try:
    from ._cring import RingReader as _CReader
    from ._cring import RingWriter as _CWriter
    from ._cring import init_errors
except ImportError as exc:  # not built (no compiler at install time): the pure path
    _BUILT = f"the C extension is not built ({exc})"
else:
    _BUILT = ""
    init_errors(RingCorrupted, FrameTooLarge)

    class _Views:
        """The pure lane's views of the header and data area, for what reads them
        from Python (cold paths, tools, tests)."""

        __slots__ = ()

        def _views(self, buf: Any, offset: int, capacity: int) -> tuple[Any, Any, Any]:
            q = header_view(buf, offset)
            mv = memoryview(buf)
            data = mv[offset + HEADER_SIZE : offset + HEADER_SIZE + capacity]
            mv.release()
            b = data.cast("B")
            data.release()
            return q, b, b.cast("I")

        @property
        def data(self) -> memoryview:
            """The data area, as bytes (for walks from outside: ``ring_walk``)."""
            return self._data  # type: ignore[attr-defined]

    class _NativeRingWriter(_CWriter, _Views):
        """The writing end of one ring lane, in C (see ``_cring.c``)."""

        __slots__ = ("_q", "header", "_data", "_d32")

        def __init__(self, buf: Any, offset: int = 0) -> None:
            super().__init__(buf, offset)
            self._q, self._data, self._d32 = self._views(buf, offset, self.capacity)
            self.header = self._q

        def release(self) -> None:
            """Drop the views (so the underlying mmap can be closed)."""
            for v in (self._d32, self._data, self._q):
                v.release()
            super().release()

        def check_size(self, n: int) -> None:
            if n > self.max_payload:
                raise FrameTooLarge(
                    f"a {n}-byte record does not fit a ring of {self.capacity} bytes (at "
                    f"most {self.max_payload} bytes per record); send large arrays and "
                    "tensors through tensor slots, or open the channel with a larger capacity"
                )

        def used(self) -> int:
            """Bytes published and not yet consumed (a snapshot)."""
            return self._q[TAIL] - self._q[_HEAD]

    class _NativeRingReader(_CReader, _Views):
        """The reading end of one ring lane, in C (see ``_cring.c``)."""

        __slots__ = ("_q", "header", "_data", "_d32")
        read_many_on_error = True  # read_many takes on_error (FrameReader)

        def __init__(self, buf: Any, offset: int = 0) -> None:
            super().__init__(buf, offset)
            self._q, self._data, self._d32 = self._views(buf, offset, self.capacity)
            self.header = self._q

        def release(self) -> None:
            """Drop the views (so the underlying mmap can be closed)."""
            for v in (self._d32, self._data, self._q):
                v.release()
            super().release()

        def used(self) -> int:
            """Bytes published and not yet consumed (a snapshot)."""
            return self._q[TAIL] - self._q[_HEAD]

        def fill(self) -> int:
            """Bytes published and not committed."""
            return self._q[TAIL] - self._committed

        def mark(self) -> int:
            """The private head, to undo a :meth:`next_frame` with :meth:`reset`."""
            return self.head

        def reset(self, mark: int) -> None:
            """Raises ``ValueError`` for a mark before the committed head or past the
            private head."""
            if not self._committed <= mark <= self.head:
                raise ValueError("mark out of range")
            self.head = mark

    class _NativeReleaseLaneWriter(_NativeRingWriter):
        """The release lane's writer in C: no lock at all (the C calls hold the GIL
        and run no Python code), so finalizers may call it anywhere."""

        __slots__ = ()
        ring_wanted = _CWriter.reader_needs_doorbell
        park_writer = _CWriter.park

    NativeRingWriter = _NativeRingWriter
    NativeRingReader = _NativeRingReader
    NativeReleaseLaneWriter = _NativeReleaseLaneWriter


_PURE_ENV = os.environ.get("RINGWIRE_PURE", "").strip()
if _PURE_ENV not in ("", "0"):
    REASON = f"RINGWIRE_PURE={_PURE_ENV} is set"
else:
    REASON = _BUILT
NATIVE: bool = not REASON
"""Is the C fast path active?  (``ringwire.native``.)"""

RingWriter: Any = NativeRingWriter if NATIVE else PureRingWriter
RingReader: Any = NativeRingReader if NATIVE else PureRingReader
ReleaseLaneWriter: Any = NativeReleaseLaneWriter if NATIVE else PureReleaseLaneWriter
