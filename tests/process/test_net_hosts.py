"""TCP channels between two "hosts": two network namespaces joined by a veth pair.

CI has no second machine, so one is made: namespaces ``rwtest-<pid>-<tag>-a``
(10.77.0.1/24) and ``...-b`` (10.77.0.2/24), a listener in one and a client in the other (both
subprocesses under ``ip netns exec``), traffic only between those namespaces' own
addresses.  Needs root and ``ip`` (skipped otherwise, with the reason).  Loss -- 1 %
for the lossy link, 100 % for a partition -- is ``tc netem`` where the kernel has it
and a random-drop eBPF filter where it has not (:mod:`support.bpfloss`; no delay
then); the same partition is also made by taking the link down.

Every namespace is removed by the fixture, whatever happens (the veth pair goes with
it); ``tests/conftest.py`` fails any test that leaves a namespace named with
:data:`PREFIX` and this process's pid.
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

pytest.importorskip("zmq")

# the namespaces this module makes are named PREFIX + "<pid>-": tests/conftest.py fails a
# test that leaves one of its own process (not another run's, on a shared machine)
PREFIX = "rwtest-"
ADDR_A, ADDR_B = "10.77.0.1", "10.77.0.2"
HEARTBEAT = 0.5

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root"),
    pytest.mark.skipif(shutil.which("ip") is None, reason="needs the ip command (iproute2)"),
]


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
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

    def start(self, ns: str, code: str, *args: str) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, "-c", code, *args],
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
            for line in proc.stdout:
                lines.put(line)
            lines.put(None)

        t = threading.Thread(target=pump, daemon=True)
        t.start()
        self.pumps.append(t)
        return proc

    def run(self, ns: str, *cmd: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["ip", "netns", "exec", ns, *cmd], capture_output=True, text=True, timeout=20
        )


def _nixl_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("nixl_cu12") is not None and os.environ.get(
        "RINGWIRE_NIXL", "1"
    ) not in ("0", "no", "off", "false")


def _netns_names() -> set[str]:
    try:
        return set(os.listdir("/run/netns"))
    except FileNotFoundError:
        return set()


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    tag = secrets.token_hex(3)
    base = f"{PREFIX}{os.getpid()}-{tag}"
    h = Hosts(f"{base}-a", f"{base}-b", f"rw{tag}a", f"rw{tag}b")
    made: list[str] = []
    try:
        for ns in (h.a, h.b):
            r = _ip("netns", "add", ns)
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
            r = _ip(*step)
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
            r = _ip("netns", "del", ns)
            if r.returncode:
                failed.append(f"{ns}: {r.stderr.strip()}")
        left = {h.a, h.b} & _netns_names()
        assert not failed and not left, f"namespaces not removed: {failed or sorted(left)}"


# The listener (namespace a): receives the client's records and array, checks them,
# answers, then waits on receive() and reports what ended it and when (CLOCK_MONOTONIC
# is system-wide: the test compares it with its own clock).
_LISTENER = """
import json, sys, time, zlib
import numpy as np
import ringwire

def say(**kw):
    print(json.dumps(kw), flush=True)

hb = float(sys.argv[2])
with ringwire.SyncListener(f"tcp://{sys.argv[1]}:0", insecure=True, heartbeat=hb) as lst:
    say(url=lst.path)
    ch = lst.accept(timeout=30)
    got = [ch.receive(timeout=30) for _ in range(1000)]
    in_order = [r["i"] for r in got] == list(range(1000)) and all(
        r["pad"] == "p" * 90 for r in got
    )
    msg = ch.receive(timeout=30)
    arr = msg["array"]
    ok = (
        in_order
        and isinstance(arr, np.ndarray)
        and arr.shape == (1 << 20,)
        and zlib.crc32(arr) == msg["crc"]
    )
    del arr, msg
    st = ch.statistics()
    ch.send({"ok": ok})
    say(exchanged=ok, path=st.tensor_path, why=st.nixl_off, nixl=st.nixl_arrays_received)
    try:
        ch.receive(timeout=60)
        say(ended="a record", at=time.monotonic())
    except BaseException as exc:
        say(ended=type(exc).__name__, reason=str(exc), at=time.monotonic())
    ch.close()
"""

# The client (namespace b): sends 1000 records in order and a 4 MiB array (an Ext 20
# frame), reads the verdict, then waits on receive() like the listener.
_CLIENT = """
import json, sys, time, zlib
import numpy as np
import ringwire

def say(**kw):
    print(json.dumps(kw), flush=True)

ch = ringwire.connect_sync(sys.argv[1], heartbeat=float(sys.argv[2]), handshake_timeout=30)
ch.send_many({"i": i, "pad": "p" * 90} for i in range(1000))
arr = np.random.default_rng(7).random(1 << 20, dtype=np.float32)
ch.send({"array": arr, "crc": zlib.crc32(arr)})
st = ch.statistics()
say(verdict=ch.receive(timeout=30), path=st.tensor_path, why=st.nixl_off, nixl=st.nixl_arrays_sent)
try:
    ch.receive(timeout=60)
    say(ended="a record", at=time.monotonic())
except BaseException as exc:
    say(ended=type(exc).__name__, reason=str(exc), at=time.monotonic())
ch.close()
"""


def _line(h: Hosts, proc: subprocess.Popen[str], key: str, timeout: float = 30.0) -> dict[str, Any]:
    """The next JSON line of ``proc`` with ``key`` (failing with its stderr if it dies)."""
    lines = h.lines[proc.pid]
    deadline = time.monotonic() + timeout
    while True:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            line = None
        if line is None:
            break
        if not line.startswith("{"):
            continue  # (a library's own log line: UCX writes its errors to stdout)
        d = json.loads(line)
        if key in d:
            return d
    proc.kill()
    proc.wait(10)
    assert proc.stderr is not None
    err = proc.stderr.read()
    pytest.fail(f"no {key!r} line from the peer (rc {proc.returncode}): {err[-3000:]}")


def _exchange(hosts: Hosts) -> tuple[subprocess.Popen[str], subprocess.Popen[str]]:
    """A listener in a, a client in b, records and an array across; both then wait.
    Both ends agree on the array's path (NIXL, or the frames NIXL fell back to)."""
    lst = hosts.start(hosts.a, _LISTENER, ADDR_A, str(HEARTBEAT))
    url = _line(hosts, lst, "url")["url"]
    assert url.startswith(f"tcp://{ADDR_A}:"), url
    cli = hosts.start(hosts.b, _CLIENT, url, str(HEARTBEAT))
    got = _line(hosts, lst, "exchanged")
    sent = _line(hosts, cli, "verdict")
    assert got["exchanged"] is True and sent["verdict"] == {"ok": True}
    assert got["path"] == sent["path"], (got, sent)
    hosts.paths.append(got["path"])
    if got["path"] == "nixl":  # the 4 MiB array went through NIXL
        assert got["nixl"] == sent["nixl"] == 1, (got, sent)
    else:
        assert got["nixl"] == sent["nixl"] == 0, (got, sent)
        if _nixl_installed():
            assert "NIXL" in got["why"] and "NIXL" in sent["why"], (got, sent)
    return lst, cli


@pytest.mark.parametrize("ucx", ["default", "tcp"])
def test_records_and_an_array_cross_and_kill_9_is_seen(
    hosts: Hosts, ucx: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With NIXL installed the array goes through it or, where UCX finds no way to
    the peer's agent (its default transports between two namespaces of one kernel
    answer "Destination is unreachable"), as frames on both ends; with UCX on TCP
    only it must go through NIXL across the link."""
    if ucx == "tcp":
        monkeypatch.setenv("UCX_TLS", "tcp")  # (the children inherit it)
    lst, cli = _exchange(hosts)
    if ucx == "tcp" and _nixl_installed():
        assert hosts.paths == ["nixl"]
    t_kill = time.monotonic()
    cli.kill()
    cli.wait(10)
    end = _line(hosts, lst, "ended", timeout=10)
    assert end["ended"] == "BrokenResourceError", end
    # the remote kernel resets the connection: seen at once (the 100 ms), not
    # after a heartbeat
    assert end["at"] - t_kill < 0.1, end  # (14-18 ms here, the machine loaded)


def _impair(hosts: Hosts, loss: int, delay: bool = False) -> str:
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


def test_records_and_an_array_cross_a_lossy_slow_link_intact(hosts: Hosts) -> None:
    """1 % loss both ways (and 5 ms delay where netem exists): records intact and in
    order, the array's crc32 checked, nothing mistaken for a dead peer."""
    _impair(hosts, 1, delay=True)
    lst, cli = _exchange(hosts)  # 1000 records in order, the array's crc32 checked
    cli.kill()
    assert _line(hosts, lst, "ended", timeout=10)["ended"] == "BrokenResourceError"


def _partition(hosts: Hosts, how: str) -> None:
    if how == "loss":
        _impair(hosts, 100)
    else:
        for ns, dev in ((hosts.a, hosts.veth_a), (hosts.b, hosts.veth_b)):
            r = hosts.run(ns, "ip", "link", "set", dev, "down")
            assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("how", ["loss", "link-down"])
def test_a_partition_is_reported_within_the_heartbeat_bound(hosts: Hosts, how: str) -> None:
    lst, cli = _exchange(hosts)
    time.sleep(2 * HEARTBEAT)  # heartbeats flow: the connection stays up while the link does
    assert lst.poll() is None and cli.poll() is None
    t_cut = time.monotonic()
    _partition(hosts, how)
    # both sides still run; each must notice the silence on its own
    for proc in (lst, cli):
        end = _line(hosts, proc, "ended", timeout=10 + 4 * HEARTBEAT)
        assert end["ended"] == "BrokenResourceError", end
        # ZMQ_HEARTBEAT_TIMEOUT is the heartbeat; the last ping may be up to a quarter
        # of it old, and the monitor event takes a poll to be seen
        assert end["at"] - t_cut < 3 * HEARTBEAT + 0.5, (how, end, end["at"] - t_cut)
