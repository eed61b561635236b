"""A topology with a worker on another machine: the front listens, the worker joins by name.

On the front's host::

    python examples/remote_worker.py tcp://127.0.0.1:7100 -n 5
    # (a non-loopback address, e.g. tcp://0.0.0.0:7100, needs --insecure: nothing
    #  authenticates TCP peers yet)

On the worker's host (any machine that reaches the front; cwd examples/ here, or put
this file on the worker's PYTHONPATH)::

    cd examples && python -m ringwire.runtime join tcp://127.0.0.1:7100 \\
        --name tokenizer --entry remote_worker:tokenize --retry-for 30

The front waits (``ready_timeout``) for the tokenizer to join, then sends it ``-n``
prompts and prints the answers.  Kill the worker meanwhile (``kill -9``) and start it
again within 30 s: the front notices the loss at once, waits for the rejoin
(``Rejoin(within=30)``), re-sends the prompt that was in flight on the new channel
and carries on.  When the front is done, the topology stops: the worker's request
stream ends and it exits with status 0.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

import ringwire
from ringwire import runtime


async def tokenize(ctx: runtime.WorkerContext) -> None:
    """The remote worker: split each prompt into "tokens" (its bytes, as an array)."""
    async for request in ctx.channel:
        text = request["prompt"]
        ids = list(text.encode())
        await ctx.channel.send(
            {
                "id": request["id"],
                "tokens": ids,
                "worker": f"pid {os.getpid()} on {socket.gethostname()}",
                "incarnation": ctx.incarnation,
            }
        )


async def front(topo: runtime.Topology, n: int) -> None:
    chan = topo.channel("tokenizer")
    for i in range(n):
        request = {"id": i, "prompt": f"prompt number {i}"}
        while True:
            try:
                await chan.send(request)
                reply = await chan.receive()
                break
            except (ringwire.BrokenResourceError, ringwire.ClosedResourceError):
                print("the tokenizer was lost; waiting for it to rejoin", flush=True)
                chan = await topo.wait_channel("tokenizer", replacing=chan)
        print(
            f"request {reply['id']}: {len(reply['tokens'])} tokens from {reply['worker']} "
            f"(incarnation {reply['incarnation']})",
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("listen", help="where the worker joins: tcp://host:port")
    parser.add_argument("-n", type=int, default=5, help="how many prompts to send")
    parser.add_argument("--insecure", action="store_true", help="allow a non-loopback address")
    parser.add_argument("--ready-timeout", type=float, default=60.0)
    args = parser.parse_args(argv)
    topo = runtime.Topology(
        [runtime.RemoteWorker("tokenizer", policy=runtime.Rejoin(within=30.0))],
        listen=args.listen,
        insecure=args.insecure,
        ready_timeout=args.ready_timeout,
        on_event=lambda ev: print(ev.describe(), flush=True),
    )
    print(f"waiting for the tokenizer to join at {args.listen}", flush=True)
    try:
        topo.run(lambda t: front(t, args.n))
    except runtime.WorkerStartError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0 if topo.stop_reason == "main() returned" else 1


if __name__ == "__main__":
    sys.exit(main())
