"""``python examples/pipeline --port 8000 --ranks 2``: the pipeline's HTTP server.

Prints ``listening on http://HOST:PORT`` once the workers are up and it accepts
requests; Ctrl-C (or SIGTERM) stops it, workers included.
"""

from __future__ import annotations

import argparse
import socket
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python examples/pipeline`: make `pipeline` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python examples/pipeline", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000, help="0: an ephemeral port")
    ap.add_argument("--ranks", type=int, default=2, help="tensor-parallel ranks (1-8)")
    args = ap.parse_args(argv)

    from pipeline.app import RingwireBackend, make_app, serve_http

    backend = RingwireBackend(args.ranks)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    host, port = sock.getsockname()[:2]
    app = make_app(
        backend, on_ready=lambda: print(f"listening on http://{host}:{port}", flush=True)
    )
    with sock:
        try:
            serve_http(app, sock)
        except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C after its clean shutdown
            pass


if __name__ == "__main__":
    main()
