"""One front end of ``perf/pipeline.py``: ``python -m perf._pipeline_front --variant V
--ranks N`` serves the pipeline over V (``ringwire``, ``zmq-msgpack``, ``zmq-pickle``)
on 127.0.0.1 at an ephemeral port, printing ``listening on http://HOST:PORT`` once its
workers are up; SIGINT / SIGTERM stop it and its workers."""

from __future__ import annotations

import argparse
import ctypes
import signal
import socket
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))  # the example's package `pipeline` (spawn passes it on)

VARIANTS = ("ringwire", "zmq-msgpack", "zmq-pickle")


def _die_with_parent() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", choices=VARIANTS, required=True)
    ap.add_argument("--ranks", type=int, default=2)
    args = ap.parse_args(argv)
    _die_with_parent()

    from pipeline.app import RingwireBackend, make_app, serve_http

    if args.variant == "ringwire":
        backend = RingwireBackend(args.ranks)
    else:
        from perf._pipeline_zmq import ZmqBackend

        backend = ZmqBackend(args.variant.split("-", 1)[1], args.ranks)  # type: ignore[assignment]
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    host, port = sock.getsockname()[:2]
    app = make_app(
        backend, on_ready=lambda: print(f"listening on http://{host}:{port}", flush=True)
    )
    with sock:
        try:
            serve_http(app, sock)
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
