"""The codec ceiling: encode and decode with no transport at all."""

from __future__ import annotations

from perf.peers.base import BATCH, DEC, ENC, Peer, clock, make_record


class CodecCeiling(Peer):
    """No transport: encode n records, decode n records, in this process.  Producer and
    consumer run in parallel in the real peers, so max(encode, decode) time bounds what
    any transport can reach with this record and codec."""

    name = "codec ceiling (no transport; max of encode, decode time)"
    kind = "tp"

    def setup(self) -> None:
        pass

    def tp_round(self, n: int, timeout: float) -> int:
        recs = [make_record(i) for i in range(BATCH)]
        enc, dec = ENC.encode, DEC.decode
        t0 = clock()
        bufs = [enc(recs[i % BATCH]) for i in range(n)]
        t1 = clock()
        for b in bufs:
            dec(b)
        t2 = clock()
        self.last_info = {"cpu_ns": 0, "info": {"encode_ns": t1 - t0, "decode_ns": t2 - t1}}
        return max(t1 - t0, t2 - t1)
