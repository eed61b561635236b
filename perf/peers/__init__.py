"""Peers for the transport benchmark (:mod:`perf.transport`), one module per family.

A *peer* is one transport under test: a parent side (a class, living in the
benchmark process) and a child side (a module-level function, run in a
``multiprocessing`` *spawn* child so nothing is inherited by accident).

Every peer speaks the same small protocol over a private control pipe
(``multiprocessing.Pipe``), which is never part of what is timed::

    child -> parent   ("ready", info)          set up, connected, waiting
    parent -> child   ("round", n)             serve exactly n messages, then ...
    child -> parent   ("done", info)           ... report and block on the pipe again
    parent -> child   None                     exit
    child -> parent   ("error", traceback)     anything went wrong

Between rounds a child is blocked in ``ctrl.recv()``: it uses no CPU, so a peer that
spins while it serves (the busy-poll floor, ringwire's hot mode) does not steal a
core from the peer being measured next.  That is what lets :mod:`perf.transport`
interleave all peers of a table round-robin in one run.

Every message is the same ~100-byte msgpack record (:class:`Req`), encoded and
decoded with msgspec on both sides: the parent encodes a request, the child decodes
it, encodes it back, the parent decodes the reply.  The floors (one byte over pipes,
a shared int64, a semaphore pair) carry no record: they are what the OS and Python
cost without any payload or codec.

Kinds of peers:

* ``rt`` (round trip), parent method ``rt_round(n) -> list[int]``: the
  ``time.perf_counter_ns`` duration of each of n round trips.
* ``tp`` (throughput), parent method ``tp_round(n) -> int``: nanoseconds from the
  first send until the child reports that it has received and decoded all n records.
* ``idle``: the child parks on an empty channel; the parent reads the child's CPU
  time from ``/proc/<pid>/stat``.

Async peers (``is_async = True``) have coroutine methods; the harness runs them on
the peer's own event loop runner (asyncio or uvloop).

Cleanup: the parent unlinks every ``/dev/shm`` name and removes every socket file it
made in ``close()``; children set ``PR_SET_PDEATHSIG`` so they cannot outlive a
killed benchmark, and every blocking wait in a child has a timeout.

Modules (everything public is re-exported here: ``from perf import peers as P``)::

    base        records (Req, Blob, RecordKind), Peer, PeerUnavailable/PeerFailed, the
                child plumbing (child_entry, serve_rounds, aserve_rounds, run_async,
                new_loop, close_loop, ctrl_recv), proc_cpu_seconds, tmpdir, constants
    pipes       PipeFloor, PipeStreams          (asyncio pipe floors)
    zmq_pair    ZmqAsync                        (zmq.asyncio PAIR over ipc://)
    shm_floors  BusyPoll, SemPingPong           (busy-poll int64, posix_ipc semaphores)
    iceoryx     Iceoryx2RT, iox2_leftovers      (iceoryx2 pub/sub)
    mproc       MpPipe, MpQueueTP, unlink_semlocks, child_mpqueue
    fifo        FasterFifoTP, ff_dumps, ff_loads, child_ff
    ceiling     CodecCeiling                    (encode + decode, no transport)
    rw          RingwireAsyncRT, RingwireSyncRT, RingwireTP, RingwireIdle, rw_pair,
                rw_stats, HOT_SPIN_US
"""

from __future__ import annotations

from perf.peers.base import (
    BATCH,
    BLOB_BYTES,
    CHILD_WAIT_S,
    DEC,
    ENC,
    KINDS,
    RECORD_BYTES,
    SETUP_TIMEOUT_S,
    Blob,
    Peer,
    PeerFailed,
    PeerUnavailable,
    RecordKind,
    Req,
    aserve_rounds,
    child_entry,
    clock,
    close_loop,
    ctrl_recv,
    make_blob,
    make_record,
    new_loop,
    proc_cpu_seconds,
    run_async,
    serve_rounds,
    tmpdir,
)
from perf.peers.ceiling import CodecCeiling
from perf.peers.fifo import FasterFifoTP, child_ff, ff_dumps, ff_loads
from perf.peers.iceoryx import Iceoryx2RT, iox2_leftovers
from perf.peers.mproc import MpPipe, MpQueueTP, child_mpqueue, unlink_semlocks
from perf.peers.pipes import PipeFloor, PipeStreams
from perf.peers.rw import (
    HOT_SPIN_US,
    RingwireAsyncRT,
    RingwireIdle,
    RingwireSyncRT,
    RingwireTP,
    rw_pair,
    rw_stats,
)
from perf.peers.shm_floors import BusyPoll, SemPingPong
from perf.peers.zmq_pair import ZmqAsync

__all__ = [
    "BATCH",
    "BLOB_BYTES",
    "Blob",
    "BusyPoll",
    "CHILD_WAIT_S",
    "CodecCeiling",
    "DEC",
    "ENC",
    "FasterFifoTP",
    "HOT_SPIN_US",
    "Iceoryx2RT",
    "KINDS",
    "MpPipe",
    "MpQueueTP",
    "Peer",
    "PeerFailed",
    "PeerUnavailable",
    "PipeFloor",
    "PipeStreams",
    "RECORD_BYTES",
    "RecordKind",
    "Req",
    "RingwireAsyncRT",
    "RingwireIdle",
    "RingwireSyncRT",
    "RingwireTP",
    "SETUP_TIMEOUT_S",
    "SemPingPong",
    "ZmqAsync",
    "aserve_rounds",
    "child_entry",
    "child_ff",
    "child_mpqueue",
    "clock",
    "close_loop",
    "ctrl_recv",
    "ff_dumps",
    "ff_loads",
    "iox2_leftovers",
    "make_blob",
    "make_record",
    "new_loop",
    "proc_cpu_seconds",
    "run_async",
    "rw_pair",
    "rw_stats",
    "serve_rounds",
    "tmpdir",
    "unlink_semlocks",
]
