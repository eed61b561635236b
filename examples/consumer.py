"""The consumer: listen at a path, answer every record from every producer.

    python examples/consumer.py /tmp/ringwire-demo.sock        # Ctrl-C to stop
    python examples/producer.py /tmp/ringwire-demo.sock -n 5   # in another shell

Each record is ``{"seq": int, "x": numpy array}``.  An array of 64 KiB or more arrives
as a read-only view of a shared-memory slot of the producer: nothing was copied, and
when ``x`` is dropped the slot goes back to the producer.
"""

from __future__ import annotations

import argparse
import os
import signal

import anyio
import numpy as np

import ringwire


async def serve(path: str) -> None:
    async with ringwire.listen(path) as listener, anyio.create_task_group() as tg:
        tg.start_soon(stop_on_signal, tg.cancel_scope)
        print(f"consumer {os.getpid()} listening on {path}", flush=True)

        async for conn, record in listener:  # every producer's records, fairly
            seq, x = record["seq"], record["x"]
            print(f"pid {conn.peer_pid} seq {seq}: {x.dtype} {list(x.shape)}", flush=True)
            total = float(x.sum(dtype=np.float64))
            del x, record  # done with the array: its slot goes back to the producer
            await conn.send({"seq": seq, "sum": total})


async def stop_on_signal(scope: anyio.CancelScope) -> None:
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            scope.cancel()  # leaving the listener's block removes the socket file
            return


def main() -> None:
    parser = argparse.ArgumentParser(description="ringwire example consumer")
    parser.add_argument("path", help="Unix socket path to listen at")
    args = parser.parse_args()
    anyio.run(serve, args.path)
    print("consumer stopped", flush=True)


if __name__ == "__main__":
    main()
