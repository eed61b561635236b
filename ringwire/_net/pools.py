"""Arrays beside the record on a TCP connection: the sender's budget, the receiver's views.

Sending
-------
The endpoint encodes every record with :class:`NetEncoder` and a :class:`NetPlacement`
from :meth:`NetSendPool.placement`.  A numpy array or CPU torch tensor of at least
``SlotConfig.threshold`` bytes is copied once into a buffer of the pool (a loan is
used as it is: no copy at all) and referenced from the record by an Ext 20
(:class:`~ringwire.wire.NetRef`: the frame index, the buffer's tag and generation, shape,
dtype); the encoder returns the record as a :class:`Framed` payload that carries those
buffers, and the writer sends them as zero-copy ZeroMQ frames after the record in one
message.  A CUDA tensor is staged through host memory (``.cpu()``) and its device
named in the reference.

The *budget* is the total of the config's slot classes (81 MiB by default): the bytes
of arrays sent and not yet released by the receiver plus loans out.  As on one host a
buffer is held until the receiver's last view of it dies (so a receiver that keeps
every array starves the sender, and a receiver's memory of live received arrays is
bounded by the sender's budget); policy ``"wait"`` / ``"inline"`` / ``"error"`` says
what happens when the budget is spent.

Receiving
---------
:meth:`NetRecvPool.resolve` turns an Ext 20 into a view of the received frame -- a
read-only numpy array or a torch tensor over ZeroMQ's own message buffer, no copy
after the network -- with a ``weakref.finalize`` that queues ``(tag, generation)``
on a :class:`~ringwire._wire.release.ReleaseQueue`; its sink sends an ``R`` message
if the socket lock is free and otherwise leaves the batch for the next safe point
(and rings the transport's eventfd, so an asyncio driver flushes at once).  A
reference to a frame the message does not have, of the wrong size, or named twice is
a :class:`~ringwire.DecodeError`.
"""

from __future__ import annotations

import contextlib
import itertools
import struct
import threading
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import numpy as np

from .._errors import (
    DecodeError,
    FrameTooLarge,
    NeedSlot,
    RingwireError,
    SlotMisuse,
    SlotRefused,
    SlotsExhausted,
)
from .._pool.protocols import Placement, RecvPoolBase
from .._pool.slotconfig import POLICIES, SlotConfig, check_policy
from .._pool.views import HELD
from .._wire import ext as X
from .._wire.codec import Encoder, Placer
from .._wire.descriptors import KIND_NUMPY, KIND_TORCH, NetRef, decode_descriptor
from .._wire.dtypes import (
    numpy_dtype_from_wire,
    numpy_dtype_to_wire,
    torch_dtype_from_wire,
    torch_dtype_to_wire,
    torch_module,
)
from .._wire.release import ReleaseQueue

__all__ = ["Framed", "NetEncoder", "NetPlacement", "NetRecvPool", "NetSendPool", "budget_of"]

_GEN = 1  # a tag names one use of a buffer: its generation is always 1


def budget_of(config: SlotConfig) -> int:
    """Bytes of arrays a sender with ``config`` may have in flight or on loan."""
    return sum(c.size * c.count for c in config.classes)


class Framed(bytes):
    """A record payload that carries the buffers of its arrays (``frames``)."""

    frames: list[Any]


class NetEncoder(Encoder):
    """The endpoint's encoder on a TCP connection: a record that placed arrays comes
    back as a :class:`Framed` payload."""

    def encode_with(self, obj: Any, placer: Placer) -> bytes:
        payload = super().encode_with(obj, placer)
        frames = getattr(placer, "frames", None)
        if frames:
            out = Framed(payload)
            out.frames = frames
            return out
        return payload


class NetPlacement(Placement):
    """The placer of one record: ``(tag, generation, was a loan)`` of every buffer it
    took (what a receipt waits for), and the buffers themselves (``frames``)."""

    __slots__ = ("frames",)
    frames: list[Any]


class _Buffer:
    __slots__ = ("array", "lo", "hi", "nbytes", "loan", "fin")

    def __init__(self, array: np.ndarray[Any, Any], nbytes: int, loan: bool) -> None:
        self.array = array
        self.lo = int(array.__array_interface__["data"][0])
        self.hi = self.lo + max(nbytes, 1)
        self.nbytes = nbytes
        self.loan = loan
        self.fin: Any = None  # a loan's: alive while the user holds a view of it


class NetSendPool:
    """The sender's side: the budget, buffers in flight, loans, releases, receipts (a
    :class:`~ringwire._pool.protocols.SendPool`)."""

    Placement: type[NetPlacement] = NetPlacement
    reuses_placements = False  # a placement carries its frames beside the list

    def __init__(self, config: SlotConfig, releases: deque[tuple[int, int]], max_inline: int):
        self.config = config
        self.budget = budget_of(config)
        self.largest = self.budget
        self._max_inline = max_inline
        self.lock = threading.Lock()
        self.incoming = releases  # (tag, generation) the transport received
        self.releases_ready: Callable[[], Any] = releases.__len__
        self.sent: dict[int, _Buffer] = {}
        self.loans: dict[int, _Buffer] = {}
        # sent loans the receiver released while the user still holds a view: their
        # memory is not reused (nor may they be sent again) until those views die
        self.spent: dict[int, _Buffer] = {}
        self.loan_returns: deque[tuple[int, int]] = deque()
        self._tags = itertools.count(1)
        self._cache: list[np.ndarray[Any, Any]] = []
        self._cached = 0
        self.in_use = 0
        self.gone = False
        self.closed = False
        self.releases_received = 0
        self.inline_fallbacks = 0
        self.reclaimed = 0
        self.cuda_staged = 0

    # -- queries ----------------------------------------------------------------------

    def statistics(self) -> dict[str, Any]:
        return {
            "slots_in_use": len(self.sent) + len(self.loans),
            "slots_free": {},
            "slot_bytes_in_use": self.in_use,
            "releases_received": self.releases_received,
            "loans_outstanding": len(self.loans),
            "inline_fallbacks": self.inline_fallbacks,
            "cuda_staged": self.cuda_staged,
        }

    def has_work(self) -> bool:
        return not self.gone and bool(self.incoming or self.loan_returns)

    def can_allocate(self, nbytes: Any) -> bool:
        return isinstance(nbytes, int) and self.in_use + nbytes <= self.budget

    def futile(self, need: Any = 0) -> bool:
        return not isinstance(need, int) or self.in_use == 0

    def consumed(self, pairs: Sequence[tuple[int, int]]) -> bool:
        return not any(tag in self.sent for tag, _ in pairs)

    # -- buffers ----------------------------------------------------------------------

    def _take(self, nbytes: int) -> np.ndarray[Any, Any]:
        cache = self._cache
        for i, buf in enumerate(cache):
            if nbytes <= buf.nbytes <= 2 * nbytes + 4096:
                del cache[i]
                self._cached -= buf.nbytes
                return buf
        return np.empty(max(nbytes, 1), np.uint8)

    def _give(self, buf: _Buffer, tag: int = 0) -> None:
        self.in_use -= buf.nbytes
        if buf.fin is not None and buf.fin.alive:
            self.spent[tag] = buf
            return
        self._recycle(buf)

    def _recycle(self, buf: _Buffer) -> None:
        """A buffer nobody uses any more: cached for the next array (overridden by the
        NIXL pool, whose buffers go back to its registered arena)."""
        self._cache_put(buf.array)

    def _cache_put(self, arr: np.ndarray[Any, Any]) -> None:
        if not self.gone and self._cached + arr.nbytes <= self.budget:
            self._cache.append(arr)
            self._cached += arr.nbytes

    # -- placing ----------------------------------------------------------------------

    def placement(self, policy: str | None) -> NetPlacement:
        p = self.Placement()
        p.pool = self
        p.frames = []
        p.policy = (
            policy
            if policy in POLICIES
            else (check_policy(policy) or self.config.policy)
            if policy is not None
            else self.config.policy
        )
        return p

    def abort(self, placed: Sequence[tuple[int, int, bool]]) -> None:
        """Give back the buffers of a record that was not sent."""
        if not placed or self.closed:
            return
        with self.lock:
            for tag, _, loan in placed:
                buf = self.sent.pop(tag, None)
                if buf is None:
                    continue
                if loan:
                    self.loans[tag] = buf
                else:
                    self._give(buf)

    def place(self, obj: Any, placement: NetPlacement) -> NetRef | None:
        kind: Any
        device = ""
        if isinstance(obj, np.ndarray):
            addr = int(obj.__array_interface__["data"][0])
            nbytes = obj.nbytes
            contiguous = obj.flags.c_contiguous
            wire, kind = numpy_dtype_to_wire(obj.dtype), KIND_NUMPY
        else:
            torch = torch_module()
            if not isinstance(obj, torch.Tensor) or obj.layout != torch.strided:
                return None
            if obj.device.type != "cpu":
                nbytes = obj.numel() * obj.element_size()
                if obj.device.type != "cuda" or nbytes < self.config.cuda_threshold:
                    return None  # inline (restored on its device), or the inline error
                self.cuda_staged += 1
                device = str(obj.device)
                obj = obj.detach().cpu()
            addr = obj.data_ptr()
            nbytes = obj.numel() * obj.element_size()
            contiguous = obj.is_contiguous()
            wire, kind = torch_dtype_to_wire(obj.dtype), KIND_TORCH
        if self.loans or self.sent or self.spent:
            ref = self._place_loaned(obj, addr, nbytes, contiguous, wire, kind, placement)
            if ref is not None:
                return ref
        if nbytes < self.config.threshold and not device:
            return None
        if nbytes > self.budget:
            if nbytes > self._max_inline:
                raise FrameTooLarge(
                    f"a {nbytes}-byte array is larger than this channel's send budget "
                    f"({self.budget} bytes: the total of SlotConfig.classes) and the lane "
                    f"(at most {self._max_inline} bytes per record): configure larger slot "
                    "classes (slots=SlotConfig(...))"
                )
            self.inline_fallbacks += 1
            return None
        with self.lock:
            free = self.in_use + nbytes <= self.budget
            if free:
                self.in_use += nbytes
                arr = self._take(nbytes)
            else:
                mine = {t for t, _, _ in placement}
                others = sum(1 for t in self.sent if t not in mine)
        if not free:
            self._exhausted(others, nbytes, placement.policy)
            return None
        try:
            dst = arr[:nbytes]
            if isinstance(obj, np.ndarray):
                np.copyto(dst.view(obj.dtype).reshape(obj.shape), obj, casting="no")
            elif nbytes:
                torch = torch_module()
                t = obj.detach()
                if t.is_contiguous() and not t.is_conj() and not t.is_neg():
                    np.copyto(dst, t.reshape(-1).view(torch.uint8).numpy(), casting="no")
                else:
                    torch.from_numpy(dst).view(t.dtype).reshape(t.shape).copy_(t)
        except BaseException:
            with self.lock:
                self.in_use -= nbytes
            raise
        buf = _Buffer(arr, nbytes, False)
        with self.lock:
            tag = next(self._tags)
            self.sent[tag] = buf
        placement.append((tag, _GEN, False))
        return self._refer(placement, arr, 0, nbytes, tag, tuple(obj.shape), wire, kind, device)

    def _refer(
        self,
        placement: NetPlacement,
        arr: np.ndarray[Any, Any],
        off: int,
        nbytes: int,
        tag: int,
        shape: tuple[int, ...],
        wire: str,
        kind: Any,
        device: str,
    ) -> Any:
        """The reference to bytes ``[off, off + nbytes)`` of a placed buffer: a frame
        of the message (NIXL refers to its arena instead: :mod:`.nixlpools`)."""
        placement.frames.append(arr.data[off : off + nbytes])
        return NetRef(1, tag, _GEN, len(placement.frames) - 1, nbytes, shape, wire, kind, device)

    def _place_loaned(
        self,
        obj: Any,
        addr: int,
        nbytes: int,
        contiguous: bool,
        wire: str,
        kind: Any,
        placement: NetPlacement,
    ) -> NetRef | None:
        with self.lock:
            hit = next(((t, b) for t, b in self.loans.items() if b.lo <= addr < b.hi), None)
            if hit is None:
                if any(b.loan and b.lo <= addr < b.hi for b in self.sent.values()) or any(
                    b.lo <= addr < b.hi for b in self.spent.values()
                ):
                    raise SlotMisuse(
                        "this array lives in a loaned buffer that was already sent: a "
                        "loaned buffer can be sent once, and must not be used after it was "
                        "sent (loan a new one)"
                    )
                return None
            tag, buf = hit
            if not contiguous or addr + nbytes > buf.lo + buf.nbytes:
                return None  # a strided view of a loan: copied like any array
            del self.loans[tag]
            self.sent[tag] = buf
        placement.append((tag, _GEN, True))
        off = addr - buf.lo
        return self._refer(placement, buf.array, off, nbytes, tag, tuple(obj.shape), wire, kind, "")

    def _exhausted(self, others: int, nbytes: int, policy: str) -> None:
        if policy == "inline":
            self.inline_fallbacks += 1
            return
        what = f"{nbytes} bytes ({self.in_use} of the budget of {self.budget} in use)"
        if others <= 0:
            raise SlotsExhausted(f"this record needs more than the send budget: {what}")
        if policy == "error":
            raise SlotsExhausted(f"no room in the send budget for {what}; policy 'error'")
        raise NeedSlot(nbytes)

    # -- loans ------------------------------------------------------------------------

    def loan(
        self, kind: str, np_dtype: Any, t_dtype: Any, shape: tuple[int, ...], nbytes: Any
    ) -> Any:
        if not isinstance(nbytes, int):
            raise RingwireError(
                "a TCP connection loans host memory only: loan without device= and move "
                "the tensor to the GPU on the receiving side"
            )
        if nbytes > self.budget:
            raise ValueError(
                f"a loan of {nbytes} bytes is larger than the send budget ({self.budget} "
                "bytes: the total of SlotConfig.classes)"
            )
        with self.lock:
            if self.in_use + nbytes > self.budget:
                return None
            self.in_use += nbytes
            arr = self._take(nbytes)
            tag = next(self._tags)
            buf = self.loans[tag] = _Buffer(arr, nbytes, True)
            # not arr[:nbytes]: numpy gives a view of that slice the owning array as its
            # base, so the slice (and a finalizer on it) would die at once and the loan
            # come back while the user fills it; views of a frombuffer array keep it
            base = np.frombuffer(arr.data, np.uint8, count=nbytes)
            buf.fin = fin = weakref.finalize(base, self.loan_returns.append, (tag, _GEN))
        fin.atexit = False
        if kind == KIND_NUMPY:
            return base.view(np_dtype).reshape(shape)
        return torch_module().from_numpy(base).view(t_dtype).reshape(shape)

    def loan_fallback(
        self, kind: str, np_dtype: Any, t_dtype: Any, shape: tuple[int, ...], nbytes: Any
    ) -> Any:
        self.inline_fallbacks += 1
        if kind == KIND_NUMPY:
            return np.empty(shape, np_dtype)
        return torch_module().empty(shape, dtype=t_dtype)

    # -- releases ---------------------------------------------------------------------

    def poll(self) -> bool:
        """Process the peer's releases and dropped loans.  Raises :class:`SlotRefused`
        for a release of a buffer that is not out (the connection then breaks)."""
        if self.gone or self.closed or not self.lock.acquire(False):
            return False
        try:
            incoming = self.incoming
            while incoming:
                tag, gen = incoming.popleft()
                buf = self.sent.pop(tag, None)
                if buf is None or gen != _GEN:
                    raise SlotRefused(f"release of array {tag}: it is not out")
                self._give(buf, tag)
                self.releases_received += 1
            self._take_back_loans()
        finally:
            self.lock.release()
        return False

    def _take_back_loans(self) -> None:
        returns = self.loan_returns
        while returns:
            tag, _ = returns.popleft()
            buf = self.loans.pop(tag, None)
            if buf is not None:
                self._give(buf)
            else:
                buf = self.spent.pop(tag, None)
                if buf is not None:  # sent, released, and now let go by the user too
                    self._recycle(buf)

    def reclaim(self, *, publish: bool = True) -> int:
        """The peer is gone: every buffer it held counts as released (not reused:
        ZeroMQ may still hold it)."""
        with self.lock:
            if self.gone:
                self._take_back_loans()
                return 0
            self.gone = True
            n = len(self.sent)
            for buf in self.sent.values():
                self.in_use -= buf.nbytes
            self.sent.clear()
            self._cache.clear()
            self._cached = 0
            self._take_back_loans()
            self.reclaimed += n
        return n

    def park(self) -> None:
        pass

    def unpark(self) -> None:
        pass

    def close(self, consumer_gone: bool | None = None) -> None:
        if not self.closed:
            self.reclaim(publish=False)
            self.closed = True


class NetRecvPool(RecvPoolBase):
    """The receiver's side: the resolver, the finalizers, the release sink (a
    :class:`~ringwire._pool.protocols.RecvPool`)."""

    def __init__(self, transport: Any, copy_out: bool) -> None:
        self._t = transport
        self.copy_out = copy_out
        self.queue = ReleaseQueue(self._sink, max_batch=4096)
        self.held: dict[int, int] = {}  # tag -> generation of every live view
        self._used: set[int] = set()  # frame indexes of the record being decoded
        self._resolved: dict[int, None] = {}  # tags resolved lately (for salvage)
        self.received = 0
        self.cuda_received = 0
        self.cuda_opens = 0
        self.copied_misaligned = 0
        transport.on_frame = self._new_record

    def _new_record(self, parts: list[Any]) -> None:
        self._used.clear()

    def resolve(self, ref: Any) -> Any:
        if not isinstance(ref, NetRef):
            raise DecodeError(
                f"a {type(ref).__name__} (a shared-memory reference) arrived on a TCP connection"
            )
        frames = self._t.rx.current
        if ref.index >= len(frames):
            raise DecodeError(
                f"Ext 20 names frame {ref.index}, but the record came with {len(frames)}"
            )
        if ref.index in self._used or ref.tag in self.held:
            raise DecodeError(f"Ext 20 frame {ref.index} (array {ref.tag}) is referenced twice")
        mv = memoryview(frames[ref.index])
        if mv.nbytes != ref.nbytes:
            raise DecodeError(
                f"Ext 20 says {ref.nbytes} bytes but frame {ref.index} has {mv.nbytes}"
            )
        self._used.add(ref.index)
        self._resolved[ref.tag] = None
        if len(self._resolved) > 8192:
            for k in list(itertools.islice(self._resolved, 4096)):
                del self._resolved[k]
        if ref.kind == KIND_NUMPY:
            dtype = numpy_dtype_from_wire(ref.dtype)
            align = dtype.alignment
        else:
            torch = torch_module()
            tdtype = torch_dtype_from_wire(ref.dtype)
            align = min(int(tdtype.itemsize), 16)
        base = np.frombuffer(mv, np.uint8)
        addr = int(base.__array_interface__["data"][0]) if ref.nbytes else 0
        self.received += 1
        if self.copy_out or addr % align or ref.device:
            if addr % align:
                self.copied_misaligned += 1
            base = base.copy()
            self.queue.push(ref.tag, ref.generation)
        else:
            self.held[ref.tag] = ref.generation
            fin = weakref.finalize(base, self._finalized, ref.tag, ref.generation, addr)
            fin.atexit = False
            HELD[addr] = fin
        if ref.kind == KIND_NUMPY:
            out = base.view(dtype).reshape(ref.shape)
            if not self.copy_out:
                out.flags.writeable = False
            return out
        tensor = torch.from_numpy(base).view(tdtype).reshape(ref.shape)
        if ref.device:
            if not torch.cuda.is_available():
                raise DecodeError(
                    f"a tensor that was on {ref.device} arrived, but this process has no "
                    "CUDA: send it from the host (tensor.cpu())"
                )
            self.cuda_received += 1
            return tensor.to(ref.device)
        return tensor

    def _finalized(self, tag: int, gen: int, addr: int) -> None:
        # any thread, inside GC: dict pops and a non-blocking push only
        HELD.pop(addr, None)
        self.held.pop(tag, None)
        self.queue.push(tag, gen)

    def salvage(self, payload: Any) -> int:
        """A record failed to decode: release its valid references that the decode did
        not resolve (those that were release themselves when their views die)."""
        found: list[tuple[int, int]] = []

        def hook(code: int, data: memoryview) -> None:
            if code == X.NET_REF:
                with contextlib.suppress(Exception):
                    ref = decode_descriptor(NetRef, data)
                    if ref.tag not in self._resolved and ref.tag not in self.held:
                        self._resolved[ref.tag] = None
                        found.append((ref.tag, ref.generation))
            elif code == X.TRACED:  # a traced record: the references are in its body
                with contextlib.suppress(Exception):
                    reader.decode(data)
            return None

        reader = msgspec.msgpack.Decoder(ext_hook=hook)
        with contextlib.suppress(Exception):
            reader.decode(payload)
        for tag, gen in found:
            self.queue.push(tag, gen)
        return len(found)

    def _sink(self, batch: Sequence[tuple[int, int]]) -> bool:
        flat = [x for pair in batch for x in pair]
        body = b"R" + struct.pack(f">{len(flat)}Q", *flat)
        try:
            return bool(self._t.send_control(body, wait=False))
        except Exception:
            return True  # closed: the sender reclaims when we disconnect

    def close(self, blocking: bool = True) -> int:
        self.queue.close(blocking)
        return len(self.held)

    def unmap(self) -> None:
        pass
