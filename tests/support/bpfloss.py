"""Random packet loss on a link without ``tc netem``: a five-instruction eBPF filter.

Some kernels (this CI's among them) have no ``sch_netem`` but do have ``cls_bpf`` and
the ``clsact`` qdisc.  :func:`lossy_link` loads, through the ``bpf(2)`` system call,
a ``BPF_PROG_TYPE_SCHED_CLS`` program that drops a packet with probability
``percent`` / 100 (``bpf_get_prandom_u32() % 100 < percent``: ``TC_ACT_SHOT``, else
``TC_ACT_OK``), pins it in a private ``bpf`` file system mounted for the purpose, and
attaches it with ``tc filter add dev DEV ingress bpf da object-pinned PATH`` in each
given namespace.  It adds no delay (that needs netem).  Everything it made -- the
mount, the pinned program, the descriptors -- is removed when the context ends; the
filters go with their namespaces (or are deleted here when they are not).

Ingress, not egress: a packet the clsact *egress* hook drops is a local drop
(``NET_XMIT_DROP``) that the sending TCP sees at once and simply sends again, not
counted as a retransmission -- no loss on the wire at all.  Dropped where it arrives,
after it crossed the link, it is lost as on a real network: the sender finds out from
duplicate ACKs or its retransmission timer (netem's loss, on the sender's qdisc, also
looks like success to TCP).

:class:`Unavailable` (a skip reason) when the kernel, the permissions or ``tc`` do
not allow it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import shutil
import struct
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

__all__ = ["Unavailable", "drop_program", "lossy_link"]

_SYS_BPF = 321  # x86_64
_BPF_PROG_LOAD = 5
_BPF_OBJ_PIN = 6
_SCHED_CLS = 3
_TC_ACT_OK, _TC_ACT_SHOT = 0, 2
_PRANDOM_U32 = 7  # the bpf_get_prandom_u32 helper


class Unavailable(Exception):
    """Random loss cannot be made here (the message says why)."""


def _insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    return struct.pack("<BBhi", code, (src << 4) | dst, off, imm)


def drop_program(percent: int) -> bytes:
    """The eBPF instructions: drop ``percent`` % of packets at random."""
    if not 0 <= percent <= 100:
        raise ValueError(f"a loss of {percent} %")
    return b"".join(
        [
            _insn(0x85, imm=_PRANDOM_U32),  # call bpf_get_prandom_u32 -> r0
            _insn(0x97, dst=0, imm=100),  # r0 %= 100 (ALU64 MOD K)
            _insn(0xA5, dst=0, off=2, imm=percent),  # if r0 < percent: goto drop (JLT K)
            _insn(0xB7, dst=0, imm=_TC_ACT_OK),  # r0 = TC_ACT_OK
            _insn(0x95),  # exit
            _insn(0xB7, dst=0, imm=_TC_ACT_SHOT),  # drop: r0 = TC_ACT_SHOT
            _insn(0x95),  # exit
        ]
    )


def _bpf(cmd: int, attr: ctypes.Array[ctypes.c_char]) -> int:
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    fd = int(libc.syscall(_SYS_BPF, cmd, attr, len(attr)))
    if fd < 0:
        err = ctypes.get_errno()
        raise Unavailable(f"bpf({cmd}) failed: {os.strerror(err)}")
    return fd


def _load(percent: int) -> int:
    insns = ctypes.create_string_buffer(drop_program(percent))
    license_ = ctypes.create_string_buffer(b"GPL")
    log = ctypes.create_string_buffer(4096)
    attr = ctypes.create_string_buffer(128)  # union bpf_attr, BPF_PROG_LOAD's part
    struct.pack_into(
        "<IIQQIIQ",
        attr,
        0,
        _SCHED_CLS,
        len(insns.raw) // 8,
        ctypes.addressof(insns),
        ctypes.addressof(license_),
        1,  # log_level
        len(log),
        ctypes.addressof(log),
    )
    try:
        return _bpf(_BPF_PROG_LOAD, attr)
    except Unavailable as exc:
        raise Unavailable(f"{exc} (verifier: {log.value.decode(errors='replace')[:300]})") from None


def _pin(fd: int, path: str) -> None:
    name = ctypes.create_string_buffer(path.encode())
    attr = ctypes.create_string_buffer(128)  # BPF_OBJ_PIN's part: pathname, bpf_fd
    struct.pack_into("<QI", attr, 0, ctypes.addressof(name), fd)
    try:
        _bpf(_BPF_OBJ_PIN, attr)
    except Unavailable as exc:
        raise Unavailable(f"pinning the program at {path}: {exc}") from None


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=20)


@contextmanager
def lossy_link(percent: int, links: Sequence[tuple[str, str]]) -> Iterator[None]:
    """Drop ``percent`` % of the packets each ``(namespace, device)`` receives, at
    random, while the context lasts (both ends of a link given: loss both ways)."""
    if shutil.which("tc") is None:
        raise Unavailable("needs the tc command (iproute2)")
    root = tempfile.mkdtemp(prefix="rwbpf-")
    mounted = False
    attached: list[tuple[str, str]] = []
    fd = -1
    try:
        r = _run("mount", "-t", "bpf", "bpf", root)
        if r.returncode:
            raise Unavailable(f"cannot mount a bpf file system: {r.stderr.strip()}")
        mounted = True
        fd = _load(percent)
        pin = os.path.join(root, "drop")
        _pin(fd, pin)
        for ns, dev in links:
            steps = [
                ("tc", "qdisc", "add", "dev", dev, "clsact"),
                ("tc", "filter", "add", "dev", dev, "ingress", "bpf", "da", "object-pinned", pin),
            ]
            for step in steps:
                r = _run("ip", "netns", "exec", ns, *step)
                if r.returncode:
                    raise Unavailable(f"{' '.join(step)} in {ns}: {r.stderr.strip()}")
                if step[2] == "add" and step[1] == "qdisc":
                    attached.append((ns, dev))
        yield
    finally:
        for ns, dev in attached:  # (gone already when the namespace was removed)
            _run("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "clsact")
        if fd >= 0:
            os.close(fd)
        if mounted:
            _run("umount", root)
        os.rmdir(root)
