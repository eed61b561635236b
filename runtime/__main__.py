"""``python -m ringwire.runtime``: run a worker of a topology from the command line.

::

    python -m ringwire.runtime join tcp://front:7100 --name tokenizer \\
        --entry myapp.workers:tokenize [--retry-for 30] [--heartbeat 3] [--timeout 30] \\
        [--key-secret keys/worker.key_secret --server-key keys/front.key]

``join`` runs the entry as the remote worker ``--name`` of the topology listening at
the address (``Topology(..., listen=...)`` with a ``RemoteWorker`` of that name) until
the topology stops it or the entry returns; see :func:`ringwire.runtime.join`.  A
topology with keys (``Topology(..., keys=ringwire.ServerKeys(...))``) admits the
worker with ``--key-secret`` (this worker's ``NAME.key_secret``, from ``python -m
ringwire keygen``; its ``NAME.key`` in the front's clients directory) and
``--server-key`` (the front's public ``NAME.key``).  Exit
status: the worker's (0 ok, 1 the entry failed, 3 the front went away); 2 bad usage
or a join that failed (the reason on stderr).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

import ringwire

from ._join import join
from ._remote import DEFAULT_HEARTBEAT
from ._topology import JoinRefused

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m ringwire.runtime",
        description="Run a worker of a ringwire topology on this machine.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    j = sub.add_parser(
        "join",
        help="join a running topology over TCP as one of its remote workers",
        description=(
            "Join the topology listening at ADDRESS (tcp://host:port) as its remote "
            "worker NAME, and run ENTRY (an async def entry(ctx), as for a local worker) "
            "until the topology stops it."
        ),
    )
    j.add_argument("address", help="the topology's tcp://host:port")
    j.add_argument("--name", required=True, help="the worker's name in the topology")
    j.add_argument("--entry", required=True, help="package.module:function")
    j.add_argument(
        "--ready", choices=("auto", "explicit"), default="auto",
        help="auto: ready once joined; explicit: when the entry calls ctx.ready()",
    )  # fmt: skip
    j.add_argument(
        "--retry-for", type=float, default=0.0, metavar="S",
        help="keep trying this many seconds while no topology listens yet (default 0)",
    )  # fmt: skip
    j.add_argument(
        "--heartbeat", type=float, default=DEFAULT_HEARTBEAT, metavar="S",
        help=f"a silent front is noticed after this many seconds (default {DEFAULT_HEARTBEAT:g})",
    )  # fmt: skip
    j.add_argument(
        "--timeout", type=float, default=30.0, metavar="S",
        help="the longest each step of the join may take (default 30)",
    )  # fmt: skip
    j.add_argument(
        "--key-secret", metavar="FILE",
        help="CURVE: this worker's secret certificate (NAME.key_secret; with --server-key)",
    )  # fmt: skip
    j.add_argument(
        "--server-key", metavar="FILE",
        help="CURVE: the front's public certificate (NAME.key; with --key-secret)",
    )  # fmt: skip
    j.add_argument("--backend", default="asyncio", choices=("asyncio", "trio"))
    j.add_argument("--uvloop", action="store_true", help="asyncio on uvloop")
    j.add_argument("-v", "--verbose", action="store_true", help="log the runtime's events")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if (args.key_secret is None) != (args.server_key is None):
        parser.error("--key-secret and --server-key go together (CURVE needs both)")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    sys.path.insert(0, "")  # as `python -m`: entries from the current directory import
    try:
        keys = None
        if args.key_secret is not None:
            keys = ringwire.ClientKeys(secret=args.key_secret, server=args.server_key)
        return join(
            args.address,
            args.name,
            args.entry,
            ready=args.ready,
            retry_for=args.retry_for,
            heartbeat=args.heartbeat,
            timeout=args.timeout,
            backend=args.backend,
            backend_options={"use_uvloop": True} if args.uvloop else None,
            keys=keys,
        )
    except (JoinRefused, OSError, ValueError, TypeError, ImportError, AttributeError) as exc:
        print(f"ringwire.runtime join: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
