"""The pools of a TCP connection that negotiated NIXL (see :mod:`.nixl` for the design).

Sending
-------
:class:`NixlSendPool` is the ZeroMQ pool (:class:`~ringwire._net.pools.NetSendPool`)
whose buffers come from the connection's send arena: the same budget, policies,
loans, releases and receipts.  Once the peer's note said it reads through NIXL, a
placed array is referenced by an Ext 21 (:class:`~ringwire.wire.NixlRef`) naming an
*entry* of the message's transfer list instead of a frame; the message is
``[record, *frames, transfer list, b""]`` -- the empty last frame marks it (a frame
of an array is never empty on such a connection: an empty one is followed by an
empty list).  The transfer list is ``u16`` count, then per entry ``u32`` region,
``u64`` offset, ``u64`` byte count (big-endian).  An array that finds no room in the
arena (fragmentation), or any before the peer's note, goes as a frame (Ext 20).

A CUDA tensor goes into the sender's GPU arena of its device (registered once, on
first use) when the peer's reads can land on a GPU of that index, after a copy on
the current stream and a synchronize; otherwise it is staged through the host arena
and restored on the receiver's device, as over ZeroMQ.  A CUDA tensor that can be
neither (a failing copy, say) is a :class:`~ringwire.RingwireError` naming both.

Receiving
---------
:class:`Link` is the transport's ``holder``.  ``hold`` takes a marked message off the
socket: it checks every entry (a region the peer announced, bounds, no overlap with
an array of that region still alive here: ``ProtocolError`` otherwise, which breaks
this connection only) and hands the reads to the process's worker; that message and
every one after it wait in ``pending`` until its reads are done, then ``settle``
moves them, in order, to the reader's inbox, the transfer list replaced by a
:class:`Landed` marker.  :class:`NixlRecvPool` resolves an Ext 21 into a view of the
mirror (numpy read-only, torch; a CUDA tensor over the GPU mirror) whose finalizer
frees its span and sends the release, as for Ext 20.  A failed read is a
``ProtocolError`` naming the peer and the bytes.

Turning NIXL on, or off
-----------------------
Both ends offering NIXL does not make it work: UCX may find no way to the peer's
agent (a firewall, interfaces it cannot route, "Destination is unreachable").  So
NIXL is on only when both ends loaded the other's metadata, and off -- ZeroMQ frames
both ways, the link's memory deregistered -- when either could not:

==========================  =================================================
the listener, at the attach  loads the client's note (``H`` ... note): on success
                             it answers ``K`` + its note, else ``K O`` + why
                             (and drops its link)
the client, at ``K`` note    loads it: on success it sends ``Y``, else ``O`` +
                             why (and drops its link); at ``K O`` it drops its
                             link
the listener, at ``Y``/``O`` hands the connection out: with NIXL at ``Y``,
                             without (its link dropped) at ``O``
==========================  =================================================

So the listener's connection exists only once both ends know, and the client may send
through NIXL at once (``K`` + note says the listener read its metadata); it costs the
listener's accept one more message from the client.  A fallback is logged (a warning on the ``ringwire`` logger, both ends) and
``statistics().tensor_path`` / ``nixl_off`` say which path a connection's tensors take.
"""

from __future__ import annotations

import contextlib
import itertools
import struct
import threading
import weakref
from collections import deque
from typing import Any

import msgspec
import numpy as np

from .._errors import DecodeError, NeedSlot, NixlUnreachable, ProtocolError, RingwireError
from .._pool.cuda import cuda_backend
from .._pool.slotconfig import SlotConfig
from .._pool.views import HELD
from .._wire import ext as X
from .._wire.codec import Encoder, Placer
from .._wire.descriptors import KIND_NUMPY, KIND_TORCH, NetRef, NixlRef, decode_descriptor
from .._wire.dtypes import (
    numpy_dtype_from_wire,
    torch_dtype_from_wire,
    torch_dtype_to_wire,
    torch_loaded,
    torch_module,
)
from . import nixl
from .nixl import Agent, Arena, Job, Note, arena_size
from .pools import Framed, NetEncoder, NetPlacement, NetRecvPool, NetSendPool

__all__ = [
    "Landed",
    "Link",
    "NixlEncoder",
    "NixlPlacement",
    "NixlRecvPool",
    "NixlSendPool",
    "manifest",
    "nixl_pools",
    "parse_manifest",
]

_COUNT = struct.Struct(">H")
_ENTRY = struct.Struct(">IQQ")
MAX_ENTRIES = 0xFFFF
_note_encoder = msgspec.msgpack.Encoder()
_note_decoder = msgspec.msgpack.Decoder(Note)


def manifest(xfers: list[tuple[int, int, int]]) -> bytes:
    """The transfer-list frame for ``(region, offset, nbytes)`` entries."""
    return _COUNT.pack(len(xfers)) + b"".join(_ENTRY.pack(*e) for e in xfers)


def parse_manifest(data: bytes) -> list[tuple[int, int, int]]:
    """The entries of a transfer-list frame; ``ProtocolError`` if it is malformed."""
    if len(data) < 2:
        raise ProtocolError(f"a NIXL transfer list of {len(data)} bytes")
    (n,) = _COUNT.unpack_from(data)
    if len(data) != 2 + n * _ENTRY.size:
        raise ProtocolError(f"a NIXL transfer list of {len(data)} bytes for {n} entries")
    return [_ENTRY.unpack_from(data, 2 + i * _ENTRY.size) for i in range(n)]


def prepare(budget: int, peer_budget: int) -> Link:
    """The NIXL side of a connection being made: its send arena (for ``budget``) and
    its mirror (for the peer's ``peer_budget``) made and registered."""
    agent = nixl.process()
    assert agent is not None  # offer() said yes
    link = Link(agent, budget, peer_budget)
    link.start()
    return link


def nixl_pools(
    t: Any, link: Link, slots: SlotConfig | None, peer_capacity: int
) -> tuple[Any, Any, Any]:
    """``(send pool, receive pool, encoder)`` of a transport that negotiated NIXL (the
    peer's note loaded in the handshake); the link becomes its ``holder``."""
    link.t = t
    send = None
    if slots is not None:
        send = NixlSendPool(slots, t.releases, peer_capacity // 2 - 1024, link)
    recv = NixlRecvPool(t, False, link)  # (copy_out: set by whoever makes the endpoint)
    t.holder = link
    return send, recv, NixlEncoder()


class Landed:
    """Stands for the transfer list at the end of a delivered record's frames:
    ``(region, offset, nbytes, mirror)`` of each entry."""

    __slots__ = ("entries",)

    def __init__(self, entries: list[tuple[int, int, int, Arena]]) -> None:
        self.entries = entries


class _Held:
    __slots__ = ("first", "parts", "left", "error", "nbytes", "jobs")

    def __init__(self, first: bytes, parts: list[Any], left: int, nbytes: int = 0) -> None:
        self.first = first
        self.parts = parts
        self.left = left
        self.error: str | None = None
        self.nbytes = nbytes
        self.jobs: list[Job] = []


class Link:
    """The NIXL side of one connection: arenas, mirrors, the peer's note, the held
    records (see the module docstring)."""

    def __init__(self, agent: Agent, budget: int, peer_budget: int) -> None:
        self.t: Any = None
        self._peer_reads = False  # the peer's note said it reads through NIXL
        self.agent = agent
        self.budget = budget
        self.peer_budget = peer_budget
        self.pending: deque[_Held] = deque()
        self.peer_name: str | None = None
        self.peer_ready = False
        self.peer_vram = 0
        self.peer_regions: dict[int, tuple[str, int, int, int]] = {}
        self.send_arenas: dict[int, Arena] = {}
        self.mirrors: dict[int, Arena] = {}
        self.live: dict[int, dict[int, int]] = {}  # region -> {offset: end} landed, alive
        self.freed: deque[tuple[int, int]] = deque()  # (region, offset) released views
        self.failed: dict[int, str] = {}  # region -> why its arena could not be made
        self._lock = threading.Lock()
        self.closed_send = self.closed_recv = False
        self.reads = 0

    # -- setting up -------------------------------------------------------------------

    def start(self) -> None:
        try:
            if self.budget:
                memory = np.empty(arena_size(self.budget), np.uint8)
                self.send_arenas[0] = Arena(self.agent, memory, 0, "DRAM", 0)
            if self.peer_budget:
                memory = np.empty(arena_size(self.peer_budget), np.uint8)
                self.mirrors[0] = Arena(self.agent, memory, 0, "DRAM", 0)
        except Exception as exc:  # noqa: BLE001 - no NIXL on this connection: frames
            self.failed[0] = f"{type(exc).__name__}: {exc}"
            for arena in (*self.send_arenas.values(), *self.mirrors.values()):
                self.agent.retire(arena)
            self.send_arenas.clear()
            self.mirrors.clear()

    def note(self, body: bytes | None = None) -> Any:
        """This side's note (``body`` ``None``), or read the peer's note ``body``."""
        if body is None:
            return b"N" + self._note()
        return self._read_note(body[1:] if body[:1] == b"N" else body)

    def load(self, body: bytes) -> None:
        """Read the peer's note in the handshake.  Raises
        :class:`~ringwire._errors.NixlUnreachable` when NIXL cannot load its metadata
        (fall back to frames), :class:`ProtocolError` for a malformed note."""
        self._read_note(body[1:] if body[:1] == b"N" else body, handshake=True)

    def send_note(self) -> None:
        """Send this side's note again (a new region was registered)."""
        self.t.send_control(self.note())

    def _update_ready(self) -> None:
        self.peer_ready = self._peer_reads and 0 in self.send_arenas

    def _note(self) -> bytes:
        note = Note(
            self.agent.name,
            self.agent.metadata(),
            0 in self.mirrors,
            nixl.peer_vram(nixl.offer()),
            [a.descriptor() for a in self.send_arenas.values()],
        )
        return _note_encoder.encode(note)

    def _read_note(self, body: bytes, handshake: bool = False) -> None:
        """The peer's note (from the handshake, or an ``N`` message in the transport's
        pump).  Raises :class:`ProtocolError` for a malformed or contradictory note
        (or, after the handshake, metadata NIXL refuses),
        :class:`~ringwire._errors.NixlUnreachable` for metadata NIXL refuses in the
        handshake."""
        try:
            n = _note_decoder.decode(body)
        except (msgspec.DecodeError, UnicodeDecodeError) as exc:
            raise ProtocolError(f"a malformed NIXL note: {exc}") from exc
        if self.closed_recv:
            return
        if self.peer_name is not None and n.agent != self.peer_name:
            raise ProtocolError(f"a NIXL note from agent {n.agent!r}, not {self.peer_name!r}")
        limit = arena_size(self.peer_budget)
        regions = {}
        for region, mem, device, base, size in n.regions:
            if mem not in ("DRAM", "VRAM") or (region == 0) != (mem == "DRAM"):
                raise ProtocolError(f"NIXL region {region} of memory kind {mem!r}")
            if not 0 <= device < 1024 or size > limit or base < 0:
                raise ProtocolError(
                    f"NIXL region {region}: {size} bytes on device {device} (the peer's "
                    f"budget allows {limit})"
                )
            regions[region] = (mem, device, base, size)
        try:
            name = self.agent.add_remote(n.metadata, self.peer_name is not None, n.agent)
        except Exception as exc:  # noqa: BLE001
            why = (
                f"NIXL could not load the metadata of agent {n.agent!r}: {exc} (UCX "
                "found no transport to it; UCX_TLS=tcp or UCX_NET_DEVICES choose others)"
            )
            if handshake:
                raise NixlUnreachable(why) from exc
            raise ProtocolError(why) from exc
        if name != n.agent:
            raise ProtocolError(f"NIXL metadata of agent {name!r} in a note of {n.agent!r}")
        self.peer_name = name
        self.peer_regions.update(regions)
        self.peer_vram = max(0, min(int(n.vram), 1024))
        self._peer_reads = bool(n.ready)
        self._update_ready()

    def arena_at(self, addr: int) -> Arena | None:
        for arena in self.send_arenas.values():
            if arena.base <= addr < arena.end:
                return arena
        return None

    def gpu_arena(self, device: int) -> Arena | None:
        """The send arena of CUDA device ``device`` (made and announced on first use);
        ``None`` when it cannot be made (``failed`` says why)."""
        region = 1 + device
        arena = self.send_arenas.get(region)
        if self.closed_send:
            return None
        if arena is None and region not in self.failed:
            try:
                torch = torch_module()
                memory = torch.empty(
                    arena_size(self.budget), dtype=torch.uint8, device=f"cuda:{device}"
                )
                arena = Arena(self.agent, memory, region, "VRAM", device)
            except Exception as exc:  # noqa: BLE001
                self.failed[region] = f"{type(exc).__name__}: {exc}"
                return None
            self.send_arenas[region] = arena
            self.send_note()
        return arena

    # -- receiving (the transport's pump, under its lock) --------------------------------

    def hold(self, first: bytes, parts: list[Any]) -> bool:
        """Keep a record that must wait (``True``); ``False``: deliver it now."""
        marked = len(parts) >= 2 and len(parts[-1]) == 0
        if not marked:
            if not self.pending:
                return False
            self.pending.append(_Held(first, parts, 0))
            return True
        entries = parse_manifest(parts[-2].bytes)
        if entries and self.peer_name is None:
            raise ProtocolError("a NIXL transfer list before the peer's NIXL note")
        if entries and self.closed_recv:
            raise ProtocolError("a NIXL transfer list after this side closed")
        while self.freed:
            region, offset = self.freed.popleft()
            self.live.get(region, {}).pop(offset, None)
        landed: list[tuple[int, int, int, Arena]] = []
        spans: dict[int, list[tuple[int, int, int]]] = {}
        total = 0
        for region, offset, nbytes in entries:
            peer = self.peer_regions.get(region)
            if peer is None:
                raise ProtocolError(f"a NIXL transfer from region {region}, never announced")
            mem, device, base, size = peer
            mirror = self._mirror(region, mem, device)
            if offset + nbytes > min(size, mirror.size):
                raise ProtocolError(
                    f"a NIXL transfer of {nbytes} bytes at {offset} of region {region} "
                    f"({size} bytes)"
                )
            live = self.live.setdefault(region, {})
            if nbytes and any(o < offset + nbytes and offset < e for o, e in live.items()):
                raise ProtocolError(
                    f"a NIXL transfer into bytes {offset}..{offset + nbytes} of region "
                    f"{region}, where an array received before is still alive"
                )
            if nbytes:
                live[offset] = offset + nbytes
                spans.setdefault(region, []).append((mirror.base + offset, base + offset, nbytes))
            landed.append((region, offset, nbytes, mirror))
            total += nbytes
        held = _Held(first, [*parts[:-2], Landed(landed)], len(spans), total)
        self.pending.append(held)
        assert self.peer_name is not None or not spans
        for region, s in spans.items():
            mem, device, _, _ = self.peer_regions[region]
            job = Job(
                self.peer_name or "", self.mirrors[region], (mem, device), s, self._done(held)
            )
            held.jobs.append(job)
            self.agent.submit(job)
        if not spans:
            self.settle(self.t.rx)
        return True

    def _done(self, held: _Held) -> Any:
        def done(error: str | None) -> None:  # the worker thread
            with self._lock:
                if error is not None and held.error is None:
                    held.error = error
                held.left -= 1
                ready = held.left == 0
            if ready:
                self.t.wake()

        return done

    def settle(self, rx: Any) -> None:
        """Move the records whose reads are done, in order, to ``rx``'s inbox.  Raises
        :class:`ProtocolError` for a failed read."""
        pending = self.pending
        while pending and pending[0].left == 0:
            held = pending.popleft()
            if held.error is not None:
                # the connection breaks here: nothing after this record may be delivered
                # (a later record whose reads finished would otherwise leave a gap)
                pending.clear()
                raise ProtocolError(
                    f"a NIXL read of {held.nbytes} bytes from {self.peer_name} failed: {held.error}"
                )
            self.reads += len(held.jobs)
            rx.inbox.append((held.first, held.parts))

    def _mirror(self, region: int, mem: str, device: int) -> Arena:
        mirror = self.mirrors.get(region)
        if mirror is not None:
            return mirror
        if mem != "VRAM" or region in self.failed:
            raise ProtocolError(f"a NIXL transfer from region {region}, which has no mirror here")
        try:
            torch = torch_module()
            if device >= torch.cuda.device_count():
                raise RuntimeError(f"this process has no CUDA device {device}")
            memory = torch.empty(
                arena_size(self.peer_budget), dtype=torch.uint8, device=f"cuda:{device}"
            )
            mirror = Arena(self.agent, memory, region, "VRAM", device)
        except Exception as exc:  # noqa: BLE001
            self.failed[region] = str(exc)
            raise ProtocolError(f"a NIXL transfer into GPU {device}: {exc}") from exc
        self.mirrors[region] = mirror
        return mirror

    # -- closing ------------------------------------------------------------------------

    def close_send(self, linger: bool) -> None:
        if not self.closed_send:
            self.closed_send = True
            for arena in self.send_arenas.values():
                self.agent.retire(arena, nixl.LINGER if linger else 0.0)

    def close_recv(self) -> None:
        if not self.closed_recv:
            self.closed_recv = True
            for held in self.pending:
                for job in held.jobs:
                    job.cancelled = True
            self.pending.clear()
            for arena in self.mirrors.values():
                self.agent.retire(arena)
            if self.peer_name is not None:
                self.agent.drop_remote(self.peer_name)


# -- sending --------------------------------------------------------------------------------


class NixlPlacement(NetPlacement):
    """A placement that also lists the record's NIXL transfers (``xfers``)."""

    __slots__ = ("xfers",)

    def __init__(self) -> None:
        super().__init__()
        self.xfers: list[tuple[int, int, int]] = []


class NixlEncoder(NetEncoder):
    """Appends the transfer list and the empty marker frame to a record that has one."""

    def encode_with(self, obj: Any, placer: Placer) -> bytes:
        payload = Encoder.encode_with(self, obj, placer)
        frames = getattr(placer, "frames", None)
        xfers = getattr(placer, "xfers", None)
        if xfers or (frames and not len(frames[-1])):
            frames = [*(frames or ()), manifest(xfers or []), b""]
        if frames:
            out = Framed(payload)
            out.frames = frames
            return out
        return payload


class _GpuBuffer:
    __slots__ = ("array", "lo", "hi", "nbytes", "loan")

    def __init__(self, array: Any, lo: int, nbytes: int) -> None:
        self.array = array
        self.lo = lo
        self.hi = lo + max(nbytes, 1)
        self.nbytes = nbytes
        self.loan = False


class NixlSendPool(NetSendPool):
    """The sender's pool over the connection's arenas (see the module docstring)."""

    Placement = NixlPlacement

    def __init__(
        self, config: SlotConfig, releases: deque[tuple[int, int]], max_inline: int, link: Link
    ) -> None:
        super().__init__(config, releases, max_inline)
        self.link = link
        self.nixl_sent = 0
        self.vram_sent = 0
        link.agent.senders.add(self)

    def statistics(self) -> dict[str, Any]:
        out = super().statistics()
        out["nixl_arrays_sent"] = self.nixl_sent + self.vram_sent
        return out

    def _take(self, nbytes: int) -> np.ndarray[Any, Any]:
        arena = self.link.send_arenas.get(0)
        if arena is not None and self.link.peer_ready and not self.gone:
            offset = arena.alloc(nbytes)
            if offset is not None:
                return arena.host_view(offset, max(nbytes, 1))
        return super()._take(nbytes)

    def _recycle(self, buf: Any) -> None:
        arena = self.link.arena_at(buf.lo)
        if arena is None:
            super()._recycle(buf)
        elif not self.gone:
            arena.free(buf.lo - arena.base)

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
        addr = int(arr.__array_interface__["data"][0]) + off
        arena = self.link.arena_at(addr)
        xfers = getattr(placement, "xfers", None)
        if arena is None or xfers is None or len(xfers) >= MAX_ENTRIES:
            return super()._refer(placement, arr, off, nbytes, tag, shape, wire, kind, device)
        xfers.append((arena.region, addr - arena.base, nbytes))
        self.nixl_sent += 1
        self.link.agent.serve()
        return NixlRef(1, tag, 1, len(xfers) - 1, nbytes, shape, wire, kind, device)

    def place(self, obj: Any, placement: NetPlacement) -> Any:
        cuda = (
            not isinstance(obj, np.ndarray)
            and torch_loaded()
            and isinstance(obj, torch_module().Tensor)
            and obj.device.type == "cuda"
        )
        if cuda and self.link.peer_vram and self.link.peer_ready:
            ref = self._place_vram(obj, placement)
            if ref is not None:
                return ref
        try:
            return super().place(obj, placement)
        except (NeedSlot, RingwireError):
            raise
        except Exception as exc:
            if not cuda:
                raise
            why = self.link.failed.get(1 + (obj.device.index or 0)) or (
                "the peer's reads cannot land on a GPU of that index"
                if obj.device.index is not None and obj.device.index >= self.link.peer_vram
                else "no room in the GPU arena"
            )
            raise RingwireError(
                f"a CUDA tensor on {obj.device} can be sent neither through NIXL ({why}) "
                f"nor staged through host memory ({type(exc).__name__}: {exc})"
            ) from exc

    def _place_vram(self, obj: Any, placement: NetPlacement) -> NixlRef | None:
        torch = torch_module()
        if obj.layout != torch.strided:
            return None
        nbytes = obj.numel() * obj.element_size()
        device = obj.device.index or 0
        if (
            nbytes < self.config.cuda_threshold
            or nbytes > self.budget
            or device >= self.link.peer_vram
        ):
            return None
        arena = self.link.gpu_arena(device)
        if arena is None:
            return None
        with self.lock:
            offset = arena.alloc(nbytes) if self.in_use + nbytes <= self.budget else None
            if offset is not None:
                self.in_use += nbytes
            else:
                mine = {t for t, _, _ in placement}
                others = sum(1 for t in self.sent if t not in mine)
        if offset is None:
            self._exhausted(others, nbytes, placement.policy)
            return None
        try:
            dst = arena.memory[offset : offset + nbytes]
            dst.view(obj.dtype).view(obj.shape).copy_(obj.detach())
            torch.cuda.current_stream(obj.device).synchronize()
        except BaseException:
            with self.lock:
                self.in_use -= nbytes
                arena.free(offset)
            raise
        with self.lock:
            tag = next(self._tags)
            self.sent[tag] = _GpuBuffer(dst, arena.base + offset, nbytes)  # type: ignore[assignment]
        placement.append((tag, 1, False))
        xfers: list[tuple[int, int, int]] = getattr(placement, "xfers", [])
        xfers.append((arena.region, offset, nbytes))
        self.vram_sent += 1
        self.link.agent.serve()
        wire = torch_dtype_to_wire(obj.dtype)
        shape = tuple(obj.shape)
        return NixlRef(1, tag, 1, len(xfers) - 1, nbytes, shape, wire, "torch", str(obj.device))

    def close(self, consumer_gone: bool | None = None) -> None:
        linger = bool(self.sent) and not self.gone
        super().close(consumer_gone)
        self.link.close_send(linger)


# -- receiving ------------------------------------------------------------------------------


class NixlRecvPool(NetRecvPool):
    """Resolves Ext 21 into views of the mirrors, and Ext 20 as before."""

    def __init__(self, transport: Any, copy_out: bool, link: Link) -> None:
        super().__init__(transport, copy_out)
        self.link = link
        self._landed: Landed | None = None
        self._entries_used: set[int] = set()
        self.nixl_received = 0

    def statistics(self) -> dict[str, Any]:
        return {**super().statistics(), "nixl_arrays_received": self.nixl_received}

    def _new_record(self, parts: list[Any]) -> None:
        super()._new_record(parts)
        last = parts[-1] if parts else None
        self._landed = last if type(last) is Landed else None
        self._entries_used.clear()

    def resolve(self, ref: Any) -> Any:
        if isinstance(ref, NixlRef):
            return self._resolve_nixl(ref)
        if isinstance(ref, NetRef) and self._landed is not None:
            frames = len(self._t.rx.current) - 1
            if ref.index >= frames:
                raise DecodeError(
                    f"Ext 20 names frame {ref.index}, but the record came with {frames}"
                )
        return super().resolve(ref)

    def _resolve_nixl(self, ref: NixlRef) -> Any:
        landed = self._landed
        if landed is None:
            raise DecodeError("an Ext 21 in a record that came without NIXL transfers")
        if ref.entry >= len(landed.entries):
            raise DecodeError(
                f"Ext 21 names transfer {ref.entry}, but the record came with {len(landed.entries)}"
            )
        if ref.entry in self._entries_used or ref.tag in self.held:
            raise DecodeError(f"Ext 21 transfer {ref.entry} (array {ref.tag}) is referenced twice")
        region, offset, nbytes, mirror = landed.entries[ref.entry]
        if nbytes != ref.nbytes:
            raise DecodeError(f"Ext 21 says {ref.nbytes} bytes but its transfer has {nbytes}")
        self._entries_used.add(ref.entry)
        self._resolved[ref.tag] = None
        if len(self._resolved) > 8192:
            for k in list(itertools.islice(self._resolved, 4096)):
                del self._resolved[k]
        self.received += 1
        self.nixl_received += 1
        if mirror.mem == "VRAM":
            return self._cuda_view(ref, region, offset, mirror)
        base = mirror.host_view(offset, nbytes)
        if ref.kind == KIND_NUMPY:
            if self.copy_out:
                base = base.copy()
                self._release_now(ref, region, offset)
            else:
                self._hold(base, ref, region, offset)
            out = base.view(numpy_dtype_from_wire(ref.dtype)).reshape(ref.shape)
            if not self.copy_out:
                out.flags.writeable = False
            return out
        torch = torch_module()
        tdtype = torch_dtype_from_wire(ref.dtype)
        if ref.device:
            if not torch.cuda.is_available():
                self._release_now(ref, region, offset)
                raise DecodeError(
                    f"a tensor that was on {ref.device} arrived, but this process has no "
                    "CUDA: send it from the host (tensor.cpu())"
                )
            tensor = torch.from_numpy(base).view(tdtype).reshape(ref.shape).to(ref.device)
            self.cuda_received += 1
            self._release_now(ref, region, offset)
            return tensor
        if self.copy_out:
            base = base.copy()
            self._release_now(ref, region, offset)
        else:
            self._hold(base, ref, region, offset)
        return torch.from_numpy(base).view(tdtype).reshape(ref.shape)

    def _cuda_view(self, ref: NixlRef, region: int, offset: int, mirror: Arena) -> Any:
        backend = cuda_backend(import_torch=True)
        if backend is None or ref.kind != KIND_TORCH:
            self._release_now(ref, region, offset)
            raise DecodeError("an Ext 21 into GPU memory, but this process has no CUDA")
        tdtype = torch_dtype_from_wire(ref.dtype)
        tensor, span = backend.view(mirror.memory, offset, ref.nbytes, tdtype, ref.shape)
        self.cuda_received += 1
        if self.copy_out:
            tensor = tensor.clone()
            self._release_now(ref, region, offset)
            return tensor
        self.held[ref.tag] = ref.generation
        fin = weakref.finalize(
            span, self._finalized_cuda, ref.tag, ref.generation, region, offset, mirror.device
        )
        fin.atexit = False
        return tensor

    def _hold(self, base: np.ndarray[Any, Any], ref: NixlRef, region: int, offset: int) -> None:
        addr = int(base.__array_interface__["data"][0])
        self.held[ref.tag] = ref.generation
        fin = weakref.finalize(
            base, self._finalized_nixl, ref.tag, ref.generation, addr, region, offset
        )
        fin.atexit = False
        HELD[addr] = fin

    def _release_now(self, ref: NixlRef, region: int, offset: int) -> None:
        self.link.freed.append((region, offset))
        self.queue.push(ref.tag, ref.generation)

    def _finalized_nixl(self, tag: int, gen: int, addr: int, region: int, offset: int) -> None:
        # any thread, inside GC: dict pops and non-blocking pushes only
        HELD.pop(addr, None)
        self.held.pop(tag, None)
        self.link.freed.append((region, offset))
        self.queue.push(tag, gen)

    def _finalized_cuda(self, tag: int, gen: int, region: int, offset: int, device: int) -> None:
        # the kernels queued on the tensor must be done before the sender overwrites it
        with contextlib.suppress(Exception):
            torch_module().cuda.current_stream(device).synchronize()
        self.held.pop(tag, None)
        self.link.freed.append((region, offset))
        self.queue.push(tag, gen)

    def salvage(self, payload: Any) -> int:
        n = super().salvage(payload)
        landed = self._landed
        if landed is None:
            return n
        found: list[tuple[NixlRef, int, int]] = []

        def hook(code: int, data: memoryview) -> None:
            if code == X.NIXL_REF:
                with contextlib.suppress(Exception):
                    ref = decode_descriptor(NixlRef, data)
                    if (
                        ref.tag not in self._resolved
                        and ref.tag not in self.held
                        and ref.entry < len(landed.entries)
                    ):
                        self._resolved[ref.tag] = None
                        region, offset, _, _ = landed.entries[ref.entry]
                        found.append((ref, region, offset))
            elif code == X.TRACED:  # a traced record: the references are in its body
                with contextlib.suppress(Exception):
                    reader.decode(data)
            return None

        reader = msgspec.msgpack.Decoder(ext_hook=hook)
        with contextlib.suppress(Exception):
            reader.decode(payload)
        for ref, region, offset in found:
            self._release_now(ref, region, offset)
        return n + len(found)

    def close(self, blocking: bool = True) -> int:
        n = super().close(blocking)
        self.link.close_recv()
        return n
