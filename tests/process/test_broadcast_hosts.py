"""A broadcast with readers on two "hosts": two network namespaces joined by a veth pair
(:mod:`support.netns_hosts`).

The writer runs in namespace a with its local readers (subscribed at the Unix path)
and binds ``tcp=`` on a's veth address (10.77.0.1) with CURVE keys; the remote reader
runs in namespace b under a host name of its own (:data:`REMOTE_HOST`), so that what
names "the host" can be checked.  The processes are :mod:`support.broadcast_hosts`.
Steps are small records and 4 MiB arrays derived from the step number; every reader
reports the checksum of every step it received, compared here with what was sent.

Needs root, ``ip`` and ``unshare`` (skipped otherwise, with the reason); loss and
partitions as in test_net_hosts.py (``tc netem``, or the eBPF drop filter where the
kernel has no netem; or the link taken down).  Every namespace and process goes with
the fixture; the broadcast's socket file and ``/dev/shm`` names are checked by
tests/conftest.py.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("zmq")
pytest.importorskip("zmq.auth")

from support.broadcast import bpath_fixture  # noqa: E402, F401 - the fixture "bpath"
from support.broadcast_hosts import RUN, expected  # noqa: E402
from support.netns_hosts import (  # noqa: E402
    ADDR_A,
    NEEDS,
    Hosts,
    hosts_fixture,  # noqa: F401 - the fixture "hosts"
    impair,
    line,
    partition,
)

pytestmark = [
    pytest.mark.multiprocess,
    *NEEDS,
    pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare (util-linux)"),
]

TESTS = str(Path(__file__).resolve().parents[1])
REMOTE_HOST = "rw-remote-b"  # the remote reader's host name (its own UTS namespace)
REMOTE_RANK = 2  # the local readers take 0 and 1


def _keys(root: Path) -> dict[str, str]:
    from ringwire._net.keys import keygen

    out: dict[str, str] = {}
    for name in ("server", "client", "other"):
        public, secret = keygen(root / name, name)
        out[f"{name}.key"], out[f"{name}.key_secret"] = str(public), str(secret)
    (root / "clients").mkdir()
    shutil.copy(out["client.key"], root / "clients")
    out["clients"] = str(root / "clients")
    return out


class Run:
    """One broadcast across the two namespaces: the writer (and its local readers) in
    a, remote readers in b."""

    def __init__(self, h: Hosts, bpath: str, keys: dict[str, str], **writer: Any) -> None:
        self.h = h
        self.keys = keys
        self.array_every = writer.setdefault("array_every", 3)
        cfg = {
            "path": bpath,
            "tcp": f"tcp://{ADDR_A}:0",
            "keys": [keys["server.key_secret"], keys["clients"]],
            "policy": "drop",
            "heartbeat": 3.0,
            "wait": 3,
            "steps": 30,
            **writer,
        }
        self.path = bpath
        self.writer = h.start(h.a, RUN, TESTS, "writer", json.dumps(cfg))
        self.url = str(line(h, self.writer, "url")["url"])
        assert self.url.startswith(f"tcp://{ADDR_A}:"), self.url

    def local(self, rank: int, **cfg: Any) -> subprocess.Popen[str]:
        cfg = {"url": self.path, "rank": rank, **cfg}
        proc = self.h.start(self.h.a, RUN, TESTS, "reader", json.dumps(cfg))
        assert line(self.h, proc, "joined")["joined"] == rank
        return proc

    def remote(self, key: str = "client", join: bool = True, **cfg: Any) -> subprocess.Popen[str]:
        keys = [self.keys[f"{key}.key_secret"], self.keys["server.key"]] if key else None
        cfg = {"url": self.url, "rank": REMOTE_RANK, "keys": keys, **cfg}
        proc = self.h.start(self.h.b, RUN, TESTS, "reader", json.dumps(cfg), hostname=REMOTE_HOST)
        if join:
            assert line(self.h, proc, "joined")["joined"] == REMOTE_RANK
        return proc

    def ready(self) -> dict[str, Any]:
        """The writer's ``ready`` line: every reader in one rank space, the remote one
        named by its host."""
        ready = line(self.h, self.writer, "ready")
        assert ready["ready"] == [[0, ""], [1, ""], [REMOTE_RANK, REMOTE_HOST]], ready
        assert ready["readers"] == 3 and ready["remote"] == 1, ready
        return ready

    def end(self, proc: subprocess.Popen[str], timeout: float = 30.0) -> dict[str, Any]:
        end = line(self.h, proc, "end", timeout=timeout)
        assert proc.wait(10) == 0
        return end

    def all_steps(self, end: dict[str, Any], n: int) -> None:
        """``end`` is a reader that received every step ``0 .. n - 1``, intact, in order."""
        assert end["end"] == "eos", end.get("reason")
        got = end["digests"]
        assert [d[0] for d in got] == list(range(n)), [d[0] for d in got]
        assert got == expected(n, self.array_every)


def _run(request: pytest.FixtureRequest, tmp_path: Path, **writer: Any) -> Run:
    h: Hosts = request.getfixturevalue("hosts")
    bpath: str = request.getfixturevalue("bpath")
    return Run(h, bpath, _keys(tmp_path), **writer)


# -- every step, to local and remote readers alike ---------------------------------------------


def test_local_and_remote_readers_get_every_step_identical_in_order(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Two local readers and one across the veth link (CURVE): 60 steps, 20 of them
    4 MiB arrays, every reader gets every step, intact, in order; the writer's slots
    all come back."""
    r = _run(request, tmp_path, steps=60, policy="fail")
    readers = [r.local(0), r.local(1), r.remote()]
    r.ready()
    done = line(r.h, r.writer, "sent_all")
    assert done["sent_all"] == 60 and done["lost"] == 0 and done["slots_in_use"] == 0, done
    for proc in readers:
        r.all_steps(r.end(proc), 60)
    assert r.writer.wait(10) == 0


# -- kill -9 of the remote reader -----------------------------------------------------------------


@pytest.mark.parametrize("policy", ["fail", "drop"])
def test_kill_9_of_the_remote_reader(
    request: pytest.FixtureRequest, tmp_path: Path, policy: str
) -> None:
    """Policy "fail": the writer's send and the local readers fail naming the rank and
    the host; "drop": the writer goes on and the local readers get every step.  Either way
    the kill is seen at once (the remote kernel resets the connection), not after a
    heartbeat."""
    r = _run(
        request, tmp_path, policy=policy, until_lost=True, after_loss=30, pace=0.01,
        array_every=4, limit=20.0,
    )  # fmt: skip
    locals_ = [r.local(0), r.local(1)]
    remote = r.remote(report_at=12)
    r.ready()
    line(r.h, remote, "got")
    t_kill = time.monotonic()
    remote.kill()
    remote.wait(10)
    if policy == "fail":  # the writer's next send fails
        broken = line(r.h, r.writer, "broken", timeout=10)
        assert broken["at"] - t_kill < 1.0, broken["at"] - t_kill  # heartbeat 3 s
        ends = [r.end(p) for p in locals_]
        assert all(end["end"] == "broken" for end in ends), ends
        for text in [broken["broken"]] + [end["reason"] for end in ends]:
            assert f"rank {REMOTE_RANK}" in text and REMOTE_HOST in text, text
        # the local readers got every step the writer published before it failed
        for end in ends:
            n = len(end["digests"])
            assert n >= 12 and end["digests"] == expected(n, r.array_every)
        assert r.writer.wait(10) == 0
        return
    lost = line(r.h, r.writer, "lost", timeout=10)
    assert lost["at"] - t_kill < 1.0, lost["at"] - t_kill  # heartbeat 3 s
    assert lost["readers"] == 2 and lost["remote"] == 0, lost
    done = line(r.h, r.writer, "sent_all")
    n = done["sent_all"]
    assert n >= lost["sent"] + 30 and done["slots_in_use"] == 0, done
    for proc in locals_:
        r.all_steps(r.end(proc), n)
    assert r.writer.wait(10) == 0


# -- a partition ------------------------------------------------------------------------------------

HEARTBEAT = 1.0


@pytest.mark.parametrize(
    "every",
    [0, 4],
    ids=["records", "arrays"],
)
@pytest.mark.parametrize("how", ["link-down", "loss"])
def test_a_partition_is_a_loss_within_the_heartbeat(
    request: pytest.FixtureRequest, tmp_path: Path, how: str, every: int
) -> None:
    """The link goes down (or loses everything) while the writer streams small
    records (or every fourth step a 4 MiB array) to two local readers and the remote
    one: both ends notice within a few heartbeats; with "drop" the local readers get
    every step, as if nothing happened."""
    r = _run(
        request, tmp_path, heartbeat=HEARTBEAT, until_lost=True, after_loss=20, pace=0.01,
        array_every=every, limit=20.0,
    )  # fmt: skip
    locals_ = [r.local(0), r.local(1)]
    remote = r.remote(report_at=12, heartbeat=HEARTBEAT)
    r.ready()
    line(r.h, remote, "got")
    t_cut = time.monotonic()
    partition(r.h, how)
    lost = line(r.h, r.writer, "lost", timeout=3 * HEARTBEAT + 2.0)
    # ZMQ_HEARTBEAT_TIMEOUT is the heartbeat; the last ping may be up to a quarter of it
    # old, a send may have been waiting for the remote reader's credit or slots
    assert lost["at"] - t_cut < 3 * HEARTBEAT + 0.5, (how, lost["at"] - t_cut)
    assert lost["readers"] == 2 and lost["remote"] == 0, lost
    gone = r.end(remote, timeout=10 + 4 * HEARTBEAT)  # the remote reader's side too
    assert gone["end"] == "broken" and gone["at"] - t_cut < 3 * HEARTBEAT + 0.5, gone
    done = line(r.h, r.writer, "sent_all")
    n = done["sent_all"]
    assert done["slots_in_use"] == 0 and done["lost"] == 1, done
    if not every:  # records only: no send ever waited for the cut-off reader
        assert done["slowest"] < HEARTBEAT / 2, done
    for proc in locals_:
        r.all_steps(r.end(proc), n)
    # what the remote reader got before the cut: a prefix of the steps, intact
    assert gone["digests"] == expected(len(gone["digests"]), r.array_every)
    assert r.writer.wait(10) == 0


# -- a lossy link ------------------------------------------------------------------------------------


def test_every_step_intact_across_a_lossy_link(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """5 % of the packets lost both ways: every step still intact and in order for
    every reader, nobody lost (only slower: the writer's TCP retransmitted)."""
    r = _run(request, tmp_path, steps=30, policy="fail")
    how = impair(r.h, 5)
    readers = [r.local(0), r.local(1), r.remote()]
    r.ready()
    done = line(r.h, r.writer, "sent_all", timeout=60)
    assert done["sent_all"] == 30 and done["lost"] == 0, done
    for proc in readers:
        r.all_steps(r.end(proc), 30)
    assert r.writer.wait(10) == 0
    assert _retransmitted(r.h, r.h.a) > 0, how  # the loss was real


def _retransmitted(h: Hosts, ns: str) -> int:
    """TCP segments retransmitted in namespace ``ns`` so far (its /proc/net/snmp)."""
    snmp = h.run(ns, "cat", "/proc/net/snmp").stdout.splitlines()
    names, values = (row.split() for row in snmp if row.startswith("Tcp:"))
    return int(values[names.index("RetransSegs")])


# -- CURVE off loopback ----------------------------------------------------------------------------------


def test_curve_keys_are_required_off_loopback(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Binding a's veth address without keys is refused (insecure=True binds); a remote
    reader with another key or none is refused, and the writer goes on with its
    local reader and a remote reader with the right key."""
    h: Hosts = request.getfixturevalue("hosts")
    bpath: str = request.getfixturevalue("bpath")
    probe = h.start(
        h.a, RUN, TESTS, "bind", json.dumps({"path": bpath, "tcp": f"tcp://{ADDR_A}:0"})
    )
    bound = line(h, probe, "bind")["bind"]
    assert bound["False"][0] == "ValueError" and "keys" in bound["False"][1], bound
    assert bound["True"][0] == "bound" and bound["True"][1].startswith(f"tcp://{ADDR_A}:"), bound
    assert probe.wait(10) == 0

    r = Run(h, bpath, _keys(tmp_path), steps=30, wait=2, policy="fail")
    local = r.local(0)
    for key in ("other", ""):
        bad = r.remote(key, join=False, handshake_timeout=5.0)
        refused = line(h, bad, "refused")
        # another key: CURVE refuses it (ZAP); no key: no CURVE handshake at all
        if key:
            assert refused["refused"] == "PeerCredentialsError", refused
            assert "refused this client's CURVE key" in refused["reason"], refused
        else:  # (told "requires CURVE keys", or -- a race -- only that the handshake failed)
            assert refused["refused"] in ("PeerCredentialsError", "HandshakeError"), refused
            if refused["refused"] == "PeerCredentialsError":
                assert "requires CURVE keys" in refused["reason"], refused
        assert refused["after"] < 5.0, refused  # refused, not timed out
        assert bad.wait(10) == 0
    remote = r.remote()
    ready = line(h, r.writer, "ready")
    assert ready["ready"] == [[0, ""], [REMOTE_RANK, REMOTE_HOST]], ready
    # both refusals counted (a keyless client is sometimes counted more than once: the
    # acceptor reports its missing keys and then its failed handshake)
    assert ready["refused"] >= 2 and ready["remote"] == 1, ready
    done = line(h, r.writer, "sent_all")
    assert done["sent_all"] == 30 and done["lost"] == 0, done
    for proc in (local, remote):
        r.all_steps(r.end(proc), 30)
    assert r.writer.wait(10) == 0
