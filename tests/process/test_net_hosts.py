"""TCP channels between two "hosts": two network namespaces joined by a veth pair.

CI has no second machine, so one is made: namespaces ``rwtest-<pid>-<tag>-a``
(10.77.0.1/24) and ``...-b`` (10.77.0.2/24), a listener in one and a client in the other (both
subprocesses under ``ip netns exec``), traffic only between those namespaces' own
addresses.  Needs root and ``ip`` (skipped otherwise, with the reason).  Loss -- 1 %
for the lossy link, 100 % for a partition -- is ``tc netem`` where the kernel has it
and a random-drop eBPF filter where it has not (:mod:`support.bpfloss`; no delay
then); the same partition is also made by taking the link down.

The namespaces, the fixture ``hosts`` and the loss and partition helpers are
:mod:`support.netns_hosts` (shared with test_net_security.py and
test_broadcast_hosts.py).  Every namespace is removed by the fixture, whatever happens
(the veth pair goes with it); ``tests/conftest.py`` fails any test that leaves a
namespace named with ``rwtest-`` and this process's pid.
"""

from __future__ import annotations

import os
import subprocess
import time

import pytest

pytest.importorskip("zmq")

from support.netns_hosts import (  # noqa: E402 - after the zmq skip
    ADDR_A,
    NEEDS,
    Hosts,
    hosts_fixture,  # noqa: F401 - the fixture "hosts"
    impair,
    line,
    partition,
)

HEARTBEAT = 0.5

pytestmark = [pytest.mark.multiprocess, *NEEDS]


def _nixl_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("nixl_cu12") is not None and os.environ.get(
        "RINGWIRE_NIXL", "1"
    ) not in ("0", "no", "off", "false")


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


def _exchange(hosts: Hosts) -> tuple[subprocess.Popen[str], subprocess.Popen[str]]:
    """A listener in a, a client in b, records and an array across; both then wait.
    Both ends agree on the array's path (NIXL, or the frames NIXL fell back to)."""
    lst = hosts.start(hosts.a, _LISTENER, ADDR_A, str(HEARTBEAT))
    url = line(hosts, lst, "url")["url"]
    assert url.startswith(f"tcp://{ADDR_A}:"), url
    cli = hosts.start(hosts.b, _CLIENT, url, str(HEARTBEAT))
    got = line(hosts, lst, "exchanged")
    sent = line(hosts, cli, "verdict")
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
    end = line(hosts, lst, "ended", timeout=10)
    assert end["ended"] == "BrokenResourceError", end
    # the remote kernel resets the connection: seen at once (the 100 ms), not
    # after a heartbeat
    assert end["at"] - t_kill < 0.1, end  # (14-18 ms here, the machine loaded)


def test_records_and_an_array_cross_a_lossy_slow_link_intact(hosts: Hosts) -> None:
    """1 % loss both ways (and 5 ms delay where netem exists): records intact and in
    order, the array's crc32 checked, nothing mistaken for a dead peer."""
    impair(hosts, 1, delay=True)
    lst, cli = _exchange(hosts)  # 1000 records in order, the array's crc32 checked
    cli.kill()
    assert line(hosts, lst, "ended", timeout=10)["ended"] == "BrokenResourceError"


@pytest.mark.parametrize("how", ["loss", "link-down"])
def test_a_partition_is_reported_within_the_heartbeat_bound(hosts: Hosts, how: str) -> None:
    lst, cli = _exchange(hosts)
    time.sleep(2 * HEARTBEAT)  # heartbeats flow: the connection stays up while the link does
    assert lst.poll() is None and cli.poll() is None
    t_cut = time.monotonic()
    partition(hosts, how)
    # both sides still run; each must notice the silence on its own
    for proc in (lst, cli):
        end = line(hosts, proc, "ended", timeout=10 + 4 * HEARTBEAT)
        assert end["ended"] == "BrokenResourceError", end
        # ZMQ_HEARTBEAT_TIMEOUT is the heartbeat; the last ping may be up to a quarter
        # of it old, and the monitor event takes a poll to be seen
        assert end["at"] - t_cut < 3 * HEARTBEAT + 0.5, (how, end, end["at"] - t_cut)
