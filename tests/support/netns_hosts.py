"""Two "hosts" on one machine: two network namespaces joined by a veth pair.

CI has no second machine, so one is made: namespaces ``rwtest-<pid>-<tag>-a``
(:data:`ADDR_A`, 10.77.0.1/24) and ``...-b`` (:data:`ADDR_B`, 10.77.0.2/24), processes
started in either (subprocesses under ``ip netns exec``, optionally with a host name of
their own), traffic only between those namespaces' own addresses.  Needs root and
``ip`` (:data:`NEEDS`: skipped otherwise, with the reason).  Loss -- a few % for a
lossy link, 100 % for a partition -- is ``tc netem`` where the kernel has it and a
random-drop eBPF filter where it has not (:mod:`support.bpfloss`; no delay then)
(:func:`impair`); a partition is also made by taking the link down (:func:`partition`).

Every namespace is removed by the fixture (``hosts``), whatever happens (the veth pair
goes with it), after every process started in it is killed and reaped;
``tests/conftest.py`` fails any test that leaves a namespace named with :data:`PREFIX`
and this process's pid.

Used by tests/process/test_net_hosts.py (TCP channels), test_net_security.py (CURVE
on a real address) and test_broadcast_hosts.py (remote broadcast readers).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import secrets
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

__all__ = [
    "ADDR_A",
    "ADDR_B",
    "NEEDS",
    "PREFIX",
    "Hosts",
    "hosts_fixture",
    "impair",
    "line",
    "netns_names",
    "partition",
]

# the namespaces made here are named PREFIX + "<pid>-": tests/conftest.py fails a test
# that leaves one of its own process (not another run's, on a shared machine)
PREFIX = "rwtest-"
ADDR_A, ADDR_B = "10.77.0.1", "10.77.0.2"

# the skip marks of a module that uses the fixture
NEEDS = [
    pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root"),
    pytest.mark.skipif(shutil.which("ip") is None, reason="needs the ip command (iproute2)"),
]


def ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)


@dataclass
class Hosts:
    """Two namespaces joined by a veth pair, and the processes started in them."""

    a: str
    b: str
    veth_a: str
    veth_b: str
    procs: list[subprocess.Popen[str]] = field(default_factory=list)
    lines: dict[int, queue.Queue[str | None]] = field(default_factory=dict)
    pumps: list[threading.Thread] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)  # the tensor path of each exchange
    stack: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)  # undone first

    def start(
        self, ns: str, code: str, *args: str, hostname: str | None = None
    ) -> subprocess.Popen[str]:
        """Run ``python -c code args`` in namespace ``ns`` (with ``hostname``: in a UTS
        namespace of its own, under that host name); its stdout lines go to
        :attr:`lines` (read them with :func:`line`)."""
        cmd = [sys.executable, "-c", code, *args]
        if hostname is not None:
            # unshare and sh exec in place, like ip: proc.pid is still the Python process
            cmd = ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', hostname, *cmd]
        proc = subprocess.Popen(
            ["ip", "netns", "exec", ns, *cmd],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # ip execs the interpreter: proc.pid is the Python process
        self.procs.append(proc)
        lines: queue.Queue[str | None] = queue.Queue()
        self.lines[proc.pid] = lines

        def pump() -> None:
            assert proc.stdout is not None
            for text in proc.stdout:
                lines.put(text)
            lines.put(None)

        t = threading.Thread(target=pump, daemon=True)
        t.start()
        self.pumps.append(t)
        return proc

    def run(self, ns: str, *cmd: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["ip", "netns", "exec", ns, *cmd], capture_output=True, text=True, timeout=20
        )


def netns_names() -> set[str]:
    try:
        return set(os.listdir("/run/netns"))
    except FileNotFoundError:
        return set()


@pytest.fixture(name="hosts")
def hosts_fixture() -> Iterator[Hosts]:
    tag = secrets.token_hex(3)
    base = f"{PREFIX}{os.getpid()}-{tag}"
    h = Hosts(f"{base}-a", f"{base}-b", f"rw{tag}a", f"rw{tag}b")
    made: list[str] = []
    try:
        for ns in (h.a, h.b):
            r = ip("netns", "add", ns)
            if r.returncode:
                pytest.skip(f"cannot create a network namespace: {r.stderr.strip()}")
            made.append(ns)
        steps = [
            ("-n", h.a, "link", "add", h.veth_a, "type", "veth", "peer", "name", h.veth_b,
             "netns", h.b),
            ("-n", h.a, "addr", "add", f"{ADDR_A}/24", "dev", h.veth_a),
            ("-n", h.b, "addr", "add", f"{ADDR_B}/24", "dev", h.veth_b),
            ("-n", h.a, "link", "set", h.veth_a, "up"),
            ("-n", h.b, "link", "set", h.veth_b, "up"),
            ("-n", h.a, "link", "set", "lo", "up"),
            ("-n", h.b, "link", "set", "lo", "up"),
        ]  # fmt: skip
        for step in steps:
            r = ip(*step)
            assert r.returncode == 0, f"ip {' '.join(step)}: {r.stderr.strip()}"
        yield h
    finally:
        h.stack.close()
        for proc in h.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
            assert proc.stderr is not None
            proc.stderr.close()
        for t in h.pumps:
            t.join(10)
        for proc in h.procs:
            assert proc.stdout is not None
            proc.stdout.close()
        failed = []
        for ns in made:
            r = ip("netns", "del", ns)
            if r.returncode:
                failed.append(f"{ns}: {r.stderr.strip()}")
        left = {h.a, h.b} & netns_names()
        assert not failed and not left, f"namespaces not removed: {failed or sorted(left)}"


def line(h: Hosts, proc: subprocess.Popen[str], key: str, timeout: float = 30.0) -> dict[str, Any]:
    """The next JSON line of ``proc`` with ``key`` (failing with its stderr if it dies)."""
    lines = h.lines[proc.pid]
    deadline = time.monotonic() + timeout
    while True:
        try:
            text = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            text = None
        if text is None:
            break
        if not text.startswith("{"):
            continue  # (a library's own log line: UCX writes its errors to stdout)
        d = json.loads(text)
        if key in d:
            return dict(d)
    proc.kill()
    proc.wait(10)
    assert proc.stderr is not None
    err = proc.stderr.read()
    pytest.fail(f"no {key!r} line from the peer (rc {proc.returncode}): {err[-3000:]}")


def impair(hosts: Hosts, loss: int, delay: bool = False) -> str:
    """Lose ``loss`` % of the packets both ends send (and, with ``delay``, delay them
    5 ms ± 1 ms): ``tc netem`` where the kernel has it, else a random-drop eBPF filter
    (:mod:`support.bpfloss`; no delay then).  Returns which was used; skips where
    neither can be made."""
    if shutil.which("tc") is None:
        pytest.skip("needs the tc command (iproute2)")
    links = ((hosts.a, hosts.veth_a), (hosts.b, hosts.veth_b))
    spec = [*(["delay", "5ms", "1ms"] if delay else []), "loss", f"{loss}%"]
    for i, (ns, dev) in enumerate(links):
        r = hosts.run(ns, "tc", "qdisc", "add", "dev", dev, "root", "netem", *spec)
        if r.returncode and i == 0:
            break  # no netem here
        assert r.returncode == 0, r.stderr
    else:
        return "netem"
    from support.bpfloss import Unavailable, lossy_link

    try:
        hosts.stack.enter_context(lossy_link(loss, links))
    except Unavailable as exc:
        pytest.skip(f"neither tc netem nor an eBPF drop filter can be made here: {exc}")
    return "bpf"


def partition(hosts: Hosts, how: str) -> None:
    """Cut the link: 100 % loss (``"loss"``) or both ends down (``"link-down"``)."""
    if how == "loss":
        impair(hosts, 100)
    else:
        for ns, dev in ((hosts.a, hosts.veth_a), (hosts.b, hosts.veth_b)):
            r = hosts.run(ns, "ip", "link", "set", dev, "down")
            assert r.returncode == 0, r.stderr
