"""iceoryx2 publish-subscribe (the Python binding), busy-polling subscribers."""

from __future__ import annotations

import contextlib
import gc
import os
import time
from collections.abc import Callable
from typing import Any

from perf.peers.base import (
    CHILD_WAIT_S,
    ENC,
    KINDS,
    Peer,
    PeerFailed,
    PeerUnavailable,
    clock,
    serve_rounds,
    tmpdir,
)

# iceoryx2 keeps its state in /dev/shm (data segments, connections, a global management
# segment) and under a root directory (default /tmp/iceoryx2/: node and service files).
# Every iceoryx2 peer here uses its own file-name prefix and a private root directory,
# so its names cannot collide with (or be confused with) anyone else's, and cleanup is
# exact: every /dev/shm/<prefix>* name and the root directory go in close(), even after
# a child was killed.


def _iox2() -> Any:
    try:
        import iceoryx2
    except Exception as e:  # ImportError, or a wheel that needs a newer glibc
        raise PeerUnavailable(f"iceoryx2 not importable ({type(e).__name__}: {e})") from e
    iceoryx2.set_log_level(iceoryx2.LogLevel.Error)  # no "no config file" chatter
    return iceoryx2


def _iox2_node(iox2: Any, prefix: str, root: str) -> Any:
    cfg = iox2.config.default()
    g = cfg.global_cfg
    g.prefix = iox2.FileName.new(prefix)
    g.root_path = iox2.Path.new(root.rstrip("/") + "/")
    return (
        iox2.NodeBuilder.new()
        .config(cfg)
        # ours are the benchmark's signals: no handler of iceoryx2's for SIGINT/SIGTERM
        .signal_handling_mode(iox2.SignalHandlingMode.Disabled)
        .create(iox2.ServiceType.Ipc)
    )


def _iox2_ports(
    iox2: Any, node: Any, pub_name: str, sub_name: str, max_len: int
) -> tuple[Any, Any, Any, Any]:
    import ctypes

    def service(name: str) -> Any:
        return (
            node.service_builder(iox2.ServiceName.new(name))
            .publish_subscribe(iox2.Slice[ctypes.c_uint8])
            .open_or_create()
        )

    ps, ss = service(pub_name), service(sub_name)
    pub = ps.publisher_builder().initial_max_slice_len(max_len).create()
    sub = ss.subscriber_builder().create()
    return ps, ss, pub, sub


def _iox2_sender(pub: Any) -> Callable[[bytes], None]:
    """Loan a slice of len(buf) bytes, copy the encoded record in, publish it."""
    import ctypes

    memmove, loan = ctypes.memmove, pub.loan_slice_uninit

    def send(buf: bytes) -> None:
        sample = loan(len(buf))
        memmove(sample.payload_ptr, buf, len(buf))
        sample.assume_init().send()

    return send


def _iox2_receiver(
    sub: Any, decode: Callable[[Any], Any], alive: Callable[[], bool]
) -> Callable[[], Any]:
    """Busy-poll the subscriber; decode straight from the shared-memory sample."""
    receive = sub.receive

    def recv() -> Any:
        k = 0
        while True:
            sample = receive()
            if sample is not None:
                break
            k += 1
            if not k & 0xFFFF and not alive():
                raise PeerFailed("iceoryx2: the other side stopped answering")
        obj = decode(sample.payload().as_memory_view())
        sample.delete()  # hand the chunk back now, not at garbage collection
        return obj

    return recv


def _child_iox2(ctrl: Any, prefix: str, root: str, base: str, size: int) -> None:
    iox2 = _iox2()
    kind = KINDS[size]
    node = _iox2_node(iox2, prefix, root)
    ports = _iox2_ports(iox2, node, base + "/pong", base + "/ping", kind.nbytes + 64)
    pub, sub = ports[2], ports[3]
    deadline = [0.0]
    send = _iox2_sender(pub)
    recv = _iox2_receiver(sub, kind.dec.decode, lambda: time.monotonic() < deadline[0])

    def serve(n: int) -> None:
        deadline[0] = time.monotonic() + CHILD_WAIT_S
        for _ in range(n):
            send(ENC.encode(recv()))

    try:
        serve_rounds(ctrl, serve)
    finally:
        sub.delete()
        pub.delete()
        del ports, node


def iox2_leftovers(prefix: str) -> list[str]:
    """/dev/shm names that carry ``prefix`` (iceoryx2 segments of one peer)."""
    try:
        return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix))
    except OSError:
        return []


class Iceoryx2RT(Peer):
    """iceoryx2 publish-subscribe (``iceoryx2`` Python binding, IPC service type), one
    service each way with a ``Slice[c_uint8]`` payload: the msgspec-encoded record is
    copied into a loaned sample and published; the other side busy-polls
    ``Subscriber.receive()`` and decodes straight from the sample (zero-copy read)."""

    kind = "rt"
    _count = 0

    def __init__(self, size: int = 100) -> None:
        super().__init__()
        self.kind_ = KINDS[size]
        self.name = f"iceoryx2 pub/sub, busy-poll{self.kind_.suffix}"

    def setup(self) -> None:
        iox2 = _iox2()
        Iceoryx2RT._count += 1
        self.prefix = f"rwperf{os.getpid()}x{Iceoryx2RT._count}_"
        # cleanups run last-in first-out: ports and node, then stray names, then the root
        self.root = tmpdir(self)
        self.on_cleanup(self._remove_leftovers)
        base = "rwperf/rt"
        node = _iox2_node(iox2, self.prefix, self.root)
        ports = _iox2_ports(iox2, node, base + "/ping", base + "/pong", self.kind_.nbytes + 64)
        self._iox = [node, *ports]
        self.on_cleanup(self._drop_ports)
        self.spawn(_child_iox2, self.prefix, self.root, base, self.kind_.size)
        self.ready_info = self.expect("ready")
        self._iox[3].update_connections()  # our publisher learns of the new subscriber
        self.send = _iox2_sender(self._iox[3])
        self.recv = _iox2_receiver(self._iox[4], self.kind_.dec.decode, self._alive)

    def _alive(self) -> bool:
        return self.proc is not None and self.proc.is_alive()

    def _drop_ports(self) -> None:
        for port in self._iox[3:]:
            with contextlib.suppress(Exception):
                port.delete()
        self._iox.clear()
        self.send = self.recv = None  # type: ignore[assignment]
        gc.collect()  # the node and services are freed here: their files go with them

    def _remove_leftovers(self) -> None:
        # a killed child cannot remove its own names: take every one with our prefix
        for name in iox2_leftovers(self.prefix):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join("/dev/shm", name))

    def rt_round(self, n: int) -> list[int]:
        send, recv = self.send, self.recv
        rec = self.kind_.make(0)
        out = []
        self.start_round(n)
        for i in range(n):
            t0 = clock()
            rec.seq = i
            send(ENC.encode(rec))
            recv()
            out.append(clock() - t0)
        return out
