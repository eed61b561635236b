"""The producer: connect to a consumer, send N arrays, print what comes back.

    python examples/producer.py /tmp/ringwire-demo.sock -n 5 --size 1000000

A plain blocking script (``connect_sync``).  Each array is *loaned*: it lives in a
shared-memory slot of this process from the start, so filling it is the only write
and sending it copies nothing.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

import ringwire


def main() -> int:
    parser = argparse.ArgumentParser(description="ringwire example producer")
    parser.add_argument("path", help="the consumer's Unix socket path")
    parser.add_argument("-n", type=int, default=5, help="records to send (default 5)")
    parser.add_argument("--size", type=int, default=1 << 18, help="float32s per array")
    args = parser.parse_args()

    try:
        chan = ringwire.connect_sync(args.path)
    except (OSError, ringwire.HandshakeError) as exc:  # no listener there, or it refused
        print(f"producer: {exc}", file=sys.stderr)
        return 2
    with chan:
        for seq in range(args.n):
            x = chan.loan((args.size,), np.float32)  # writable, inside a slot
            x[:] = np.arange(args.size, dtype=np.float32) % 7 + seq
            expected = float(x.sum(dtype=np.float64))
            chan.send({"seq": seq, "x": x}, timeout=10)
            del x  # a loan is sent once and not touched after

            reply = chan.receive(timeout=10)
            ok = reply["seq"] == seq and reply["sum"] == expected
            print(f"seq {seq}: sum {reply['sum']:.1f} {'ok' if ok else 'WRONG'}", flush=True)
            if not ok:
                return 1
        stats = chan.statistics()
        print(f"sent {stats.records_sent} records, {stats.slots_in_use} slots still in use")
    return 0


if __name__ == "__main__":
    sys.exit(main())
