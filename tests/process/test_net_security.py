"""CURVE across processes: ``python -m ringwire keygen`` as a command, a keyed client in
another process admitted or refused, and a keyed listener on a real (non-loopback)
address in a network namespace, refusing a client of another one and naming its
address in the log."""

from __future__ import annotations

import json
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import anyio
import numpy as np
import pytest

import ringwire

zmq = pytest.importorskip("zmq")
pytest.importorskip("zmq.auth")  # (zmq.auth as an attribute)

# the two-namespace fixture (root and ip needed: skipped otherwise, with the reason)
from support.netns_hosts import ADDR_A, ADDR_B, Hosts, hosts_fixture  # noqa: E402, F401

pytestmark = [pytest.mark.multiprocess, pytest.mark.anyio]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _keygen(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ringwire", "keygen", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_keygen_command_line(tmp_path: Path) -> None:
    d = tmp_path / "keys"
    r = _keygen(str(d), "--name", "server")
    assert r.returncode == 0, r.stderr
    public, secret = d / "server.key", d / "server.key_secret"
    assert str(public) in r.stdout and str(secret) in r.stdout
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert zmq.auth.load_certificate(public)[0].decode() in r.stdout
    first = secret.read_bytes()
    r = _keygen(str(d), "--name", "server")
    assert r.returncode == 1 and "exists" in r.stderr and "--force" in r.stderr
    assert secret.read_bytes() == first
    r = _keygen(str(d), "--name", "server", "--force")
    assert r.returncode == 0 and secret.read_bytes() != first
    r = _keygen(str(public), "--name", "x")
    assert r.returncode == 1 and "not a directory" in r.stderr
    r = _keygen()
    assert r.returncode == 2 and "DIR" in r.stderr
    help_ = subprocess.run(
        [sys.executable, "-m", "ringwire", "--help"], capture_output=True, text=True, timeout=60
    )
    assert "keygen" in help_.stdout


_CLIENT = """
import json, sys, time
import numpy as np
import ringwire

url, secret, server = sys.argv[1:4]
keys = ringwire.ClientKeys(secret=secret, server=server)
t0 = time.monotonic()
try:
    ch = ringwire.connect_sync(url, keys=keys, handshake_timeout=30)
except ringwire.PeerCredentialsError as exc:
    print(json.dumps({"refused": str(exc), "after": time.monotonic() - t0}), flush=True)
    raise SystemExit(0)
ch.send({"x": np.arange(1 << 16, dtype=np.int64)})
print(json.dumps({"reply": ch.receive(timeout=30)}), flush=True)
ch.close()
"""


def _keys(root: Path) -> dict[str, Path]:
    from ringwire._net.keys import keygen

    out: dict[str, Path] = {}
    for name in ("server", "client", "other"):
        out[f"{name}.key"], out[f"{name}.key_secret"] = keygen(root / name, name)
    (root / "clients").mkdir()
    shutil.copy(out["client.key"], root / "clients")
    out["clients"] = root / "clients"
    return out


async def test_a_keyed_client_in_another_process(tmp_path: Path) -> None:
    k = _keys(tmp_path)
    server = ringwire.ServerKeys(secret=k["server.key_secret"], clients=k["clients"])
    async with ringwire.listen("tcp://127.0.0.1:0", keys=server) as lst:

        async def run(secret: Path) -> dict[str, object]:
            args = [sys.executable, "-c", _CLIENT, lst.path, str(secret), str(k["server.key"])]
            proc = await anyio.open_process(args)
            try:
                assert proc.stdout is not None
                with anyio.fail_after(60):
                    line = await proc.stdout.receive()
                return dict(json.loads(line))
            finally:
                with anyio.fail_after(30):
                    await proc.wait()
                await proc.aclose()

        async with anyio.create_task_group() as tg:
            got: dict[str, dict[str, object]] = {}

            async def good() -> None:
                got["good"] = await run(k["client.key_secret"])

            tg.start_soon(good)
            with anyio.fail_after(60):
                conn, rec = await lst.receive()
            np.testing.assert_array_equal(rec["x"], np.arange(1 << 16, dtype=np.int64))
            del rec
            await conn.send("welcome")
        assert got["good"] == {"reply": "welcome"}
        bad = await run(k["other.key_secret"])
        assert "refused this client's CURVE key" in str(bad["refused"])
        assert float(str(bad["after"])) < 2.0
        assert lst.statistics().refused == 1


# The keyed listener in namespace a, on its veth address (not loopback, no insecure=True):
# it logs as JSON lines, answers one client, and keeps accepting until told to stop.
_NS_LISTENER = """
import json, logging, sys
import ringwire

def say(**kw):
    print(json.dumps(kw), flush=True)

class Say(logging.Handler):
    def emit(self, record):
        say(log=record.getMessage())

logging.getLogger("ringwire").addHandler(Say())
keys = ringwire.ServerKeys(secret=sys.argv[2], clients=sys.argv[3])
with ringwire.SyncListener(f"tcp://{sys.argv[1]}:0", keys=keys) as lst:
    say(url=lst.path)
    ch = lst.accept(timeout=60)
    rec = ch.receive(timeout=30)
    ch.send({"sum": int(rec["x"].sum())})
    del rec
    try:
        lst.accept(timeout=5)  # the refused client's refusal is logged meanwhile
    except TimeoutError:
        pass
    say(refused=lst.statistics().refused)
    ch.close()
"""


def _json_line(h: Hosts, proc: subprocess.Popen[str], key: str) -> dict[str, object]:
    lines = h.lines[proc.pid]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        if line is None:
            break
        if not line.startswith("{"):
            continue  # (a library's own log line: UCX writes to stdout)
        d = json.loads(line)
        if key in d:
            return dict(d)
    proc.kill()
    proc.wait(10)
    assert proc.stderr is not None
    pytest.fail(f"no {key!r} line (rc {proc.returncode}): {proc.stderr.read()[-3000:]}")


def test_a_keyed_listener_on_a_real_address_across_namespaces(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    h: Hosts = request.getfixturevalue("hosts")
    k = _keys(tmp_path)
    lst = h.start(h.a, _NS_LISTENER, ADDR_A, str(k["server.key_secret"]), str(k["clients"]))
    url = str(_json_line(h, lst, "url")["url"])
    assert url.startswith(f"tcp://{ADDR_A}:")
    good = h.start(h.b, _CLIENT, url, str(k["client.key_secret"]), str(k["server.key"]))
    assert _json_line(h, good, "reply")["reply"] == {"sum": sum(range(1 << 16))}
    bad = h.start(h.b, _CLIENT, url, str(k["other.key_secret"]), str(k["server.key"]))
    refused = _json_line(h, bad, "refused")
    assert "refused this client's CURVE key" in str(refused["refused"])
    log = ""
    while "CURVE" not in log:  # (the refusal's line; NIXL may log a fallback before it)
        log = str(_json_line(h, lst, "log")["log"])
    assert f"the client at {ADDR_B}" in log and "not among this listener's clients" in log
    assert _json_line(h, lst, "refused")["refused"] == 1
