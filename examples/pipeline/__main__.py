"""``python examples/pipeline --port 8000 --ranks 2``: the pipeline's HTTP server.

Prints ``listening on http://HOST:PORT`` once the workers are up and it accepts
requests; Ctrl-C (or SIGTERM) stops it, workers included.

With ``--remote-ranks K --tcp tcp://HOST:PORT`` the last K ranks run on another host:
the scheduler serves its broadcast at PORT and a results listener at PORT + 1, prints
``waiting for remote rank(s) ...`` and the server answers once they have joined.  On
the other host, ``python examples/pipeline rank tcp://HOST:PORT --rank R --ranks N``
runs rank R (see examples/README.md: keys, two machines, two network namespaces).

With ``--ray`` every rank is a Ray actor (``runtime.RayWorker``) placed by the Ray
cluster ``ray.init()`` finds: the shape of vLLM's Ray executor.  Ranks on this host read
the scheduler's broadcast through shared memory; with ``--ray-tcp`` ranks Ray places on
other hosts subscribe over TCP, with CURVE keys made for the run and handed to them
through Ray (``--insecure``: none).

Observability (see examples/README.md, pipeline.observe): with the OpenTelemetry SDK
installed every HTTP request is one trace across all processes, printed by the console
exporter, sent over OTLP when OTEL_EXPORTER_OTLP_ENDPOINT is set, or appended as JSON
lines to $RINGWIRE_EXAMPLE_TRACE_FILE; the second line printed says which.  GET /metrics
is the front's Prometheus metrics; --worker-metrics-port makes every worker serve its own.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python examples/pipeline`: make `pipeline` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

KEYS_HINT = (
    "on this command line: --key-secret SERVER.key_secret --clients DIR (make keys with "
    "python -m ringwire keygen; see examples/README.md), a 127.0.0.1 address, or --insecure"
)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python examples/pipeline",
        description=__doc__.split("\n")[0],
        epilog="python examples/pipeline rank --help: a rank on another host",
    )
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000, help="0: an ephemeral port")
    ap.add_argument("--ranks", type=int, default=2, help="tensor-parallel ranks (1-8)")
    ap.add_argument(
        "--worker-metrics-port", type=int, metavar="PORT",
        help="each worker serves its Prometheus metrics on --host at PORT + i (tokenizer "
        "0, scheduler 1, rank R 2 + R; 0: any free ports), listed by GET /health",
    )  # fmt: skip
    net = ap.add_argument_group("ranks on other hosts")
    net.add_argument(
        "--remote-ranks", type=int, default=0, metavar="K",
        help="the last K ranks are not started here: they join from another host "
        "(python examples/pipeline rank ...)",
    )  # fmt: skip
    net.add_argument(
        "--tcp", default="tcp://127.0.0.1:5600", metavar="tcp://HOST:PORT",
        help="where remote ranks join: the broadcast at PORT, the results at PORT + 1 "
        "(port 0: any free ports, printed); default %(default)s",
    )  # fmt: skip
    net.add_argument("--key-secret", metavar="FILE", help="this server's NAME.key_secret (CURVE)")
    net.add_argument(
        "--clients", metavar="DIR", help="the directory of the remote ranks' public .key files"
    )
    net.add_argument(
        "--insecure", action="store_true",
        help="a non-loopback --tcp without keys (a network you trust)",
    )  # fmt: skip
    net.add_argument(
        "--join-timeout", type=float, default=300.0, metavar="S",
        help="seconds the remote ranks have to join (default %(default)g)",
    )  # fmt: skip

    rg = ap.add_argument_group("ranks placed by Ray (pip install 'ringwire[ray]')")
    rg.add_argument(
        "--ray", action="store_true",
        help="every rank is a Ray actor (runtime.RayWorker) on the cluster ray.init() finds "
        "(RAY_ADDRESS, a local one, else a new one): ranks on this host read the steps "
        "through shared memory, ranks on other hosts over --tcp (with --ray-tcp)",
    )  # fmt: skip
    rg.add_argument("--ray-gpus", type=float, default=0.0, help="num_gpus per rank (default 0)")
    rg.add_argument(
        "--ray-resources", type=json.loads, default=None, metavar="JSON",
        help='custom Ray resources per rank, e.g. \'{"node_a": 0.1}\' to pin the ranks',
    )  # fmt: skip
    rg.add_argument(
        "--ray-tcp", action="store_true",
        help="also serve the steps at --tcp for ranks Ray places on other hosts, with "
        "CURVE keys made for the run and handed to the ranks through Ray (--insecure: none)",
    )  # fmt: skip

    sub = ap.add_subparsers(dest="command", metavar="{rank}")
    r = sub.add_parser(
        "rank",
        help="run one rank on this host, joining a server's --tcp address",
        description="Run rank R of N of a pipeline server started with --remote-ranks: it "
        "receives every step over TCP and sends its outputs back; it exits 0 when the "
        "server stops, 1 when the pipeline fails or cannot be reached.",
    )
    r.add_argument("address", metavar="tcp://HOST:PORT", help="the server's --tcp address")
    r.add_argument("--rank", type=int, required=True, help="this rank (one of the remote ones)")
    r.add_argument("--ranks", type=int, required=True, help="the server's --ranks")
    r.add_argument(
        "--results", metavar="tcp://HOST:PORT",
        help="the server's results listener (default: the same host, PORT + 1)",
    )  # fmt: skip
    r.add_argument("--key-secret", metavar="FILE", help="this rank's NAME.key_secret (CURVE)")
    r.add_argument("--server-key", metavar="FILE", help="the server's public NAME.key")
    r.add_argument(
        "--retry-for", type=float, default=30.0, metavar="S",
        help="seconds to retry while the server is not listening yet (default %(default)g)",
    )  # fmt: skip
    return ap


def _serve(ap: argparse.ArgumentParser, args: Any) -> None:
    from pipeline import observe
    from pipeline.app import RingwireBackend, make_app, serve_http
    from pipeline.workers import remote_config

    keys_dir: tempfile.TemporaryDirectory[str] | None = None  # --ray-tcp's CURVE keys
    remote, ray = None, None
    if args.ray:
        if args.remote_ranks:
            ap.error("--ray places every rank: it does not take --remote-ranks")
        ray = {"options": {"num_cpus": 0, "num_gpus": args.ray_gpus}}
        if args.ray_resources:
            ray["options"]["resources"] = args.ray_resources
        if args.ray_tcp:
            keyed: dict[str, Any] = {}
            if not args.insecure:  # CURVE keys made for this run, handed to the Ray ranks
                from pipeline.workers import ray_rank_keys

                keys_dir = tempfile.TemporaryDirectory(prefix="pipeline-ray-keys-")
                keyed, ray["keys"] = ray_rank_keys(keys_dir.name)
            try:
                remote = remote_config(
                    args.ranks, args.ranks, args.tcp, insecure=args.insecure,
                    join_timeout=args.join_timeout, **keyed,
                )  # fmt: skip
            except (ValueError, TypeError, OSError, ModuleNotFoundError) as exc:
                if keys_dir is not None:
                    keys_dir.cleanup()
                ap.error(f"{exc} (--ray-tcp: a tcp://HOST:PORT address)")
    elif args.ray_tcp or args.ray_resources or args.ray_gpus:
        ap.error("--ray-tcp, --ray-resources and --ray-gpus are for --ray")
    elif args.remote_ranks:
        try:
            remote = remote_config(
                args.remote_ranks, args.ranks, args.tcp, key_secret=args.key_secret,
                clients=args.clients, insecure=args.insecure, join_timeout=args.join_timeout,
            )  # fmt: skip
        except (ValueError, TypeError, OSError, ModuleNotFoundError) as exc:
            hint = f" ({KEYS_HINT})" if "refusing to listen" in str(exc) else ""
            ap.error(f"{exc}{hint}")
    elif (args.key_secret or args.clients or args.insecure) and not args.ray:
        ap.error("--key-secret, --clients and --insecure are for --remote-ranks")
    if args.worker_metrics_port is not None and not 0 <= args.worker_metrics_port <= 65535 - 10:
        ap.error(f"--worker-metrics-port must be from 0 to 65525, not {args.worker_metrics_port}")
    trace, tracing = observe.trace_choice()
    metrics = None
    if args.worker_metrics_port is not None:
        metrics = {"host": args.host, "port": args.worker_metrics_port}
    backend = RingwireBackend(args.ranks, remote=remote, trace=trace, metrics=metrics, ray=ray)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    host, port = sock.getsockname()[:2]

    def ready() -> None:
        print(f"listening on http://{host}:{port}", flush=True)
        print(tracing, flush=True)

    app = make_app(backend, on_ready=ready)
    stop_tracing = observe.setup_tracing(trace, "pipeline-front")
    with sock:
        try:
            serve_http(app, sock)
        except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C after its clean shutdown
            pass
        finally:
            stop_tracing()
            if keys_dir is not None:
                keys_dir.cleanup()


def _rank(ap: argparse.ArgumentParser, args: Any) -> int:
    import anyio

    import ringwire
    from pipeline import observe
    from pipeline.workers import remote_rank

    if not 0 <= args.rank < args.ranks <= 8:
        ap.error(f"--rank must be from 0 to --ranks - 1 (at most 8 ranks), not {args.rank}")
    if (args.key_secret is None) != (args.server_key is None):
        ap.error("CURVE keys need both --key-secret and --server-key")
    try:
        keys = None
        if args.key_secret is not None:
            keys = ringwire.ClientKeys(secret=args.key_secret, server=args.server_key)

        def joined() -> None:
            print(f"rank {args.rank} of {args.ranks} joined {args.address}", flush=True)

        stop_tracing = observe.setup_tracing(
            observe.trace_choice()[0], f"pipeline-rank-{args.rank}"
        )
        try:
            anyio.run(
                lambda: remote_rank(
                    args.address, rank=args.rank, ranks=args.ranks, results=args.results,
                    keys=keys, retry_for=args.retry_for, on_joined=joined,
                )
            )  # fmt: skip
        finally:
            stop_tracing()
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # one line: why this rank stopped
        print(f"pipeline rank {args.rank}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(f"rank {args.rank}: the server closed the broadcast", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if args.command == "rank":
        return _rank(ap, args)
    _serve(ap, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
