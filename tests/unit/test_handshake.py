"""ringwire._shm.handshake, the client's side driven by hand, step by step (no peer)."""

from __future__ import annotations

import os

from chaos.workers import CHAOS_SLOTS


def test_client_unlinks_the_servers_pool_name_once_attached(monkeypatch) -> None:
    """A server killed after its Welcome but before it read Ready cannot unlink its pool
    name: the client removes it as soon as it has attached the pool (named segments;
    a memory file has no name to leave)."""
    monkeypatch.setenv("RINGWIRE_SEGMENTS", "named")
    from ringwire._pool.slotconfig import create_pool
    from ringwire._shm.handshake import client_handshake
    from ringwire._wire.control import PROTOCOL_VERSION, SegmentSpec, Welcome, encode_message

    pseg, _ = create_pool(CHAOS_SLOTS)  # "the server's" pool
    try:
        gen = client_handshake(4096, None)
        assert next(gen)[0] == "send"  # Hello
        assert gen.send(None)[0] == "recv"
        welcome = Welcome(
            version=PROTOCOL_VERSION,
            pid=os.getpid(),
            segments=[SegmentSpec(pseg.name, pseg.size, "slots")],
        )
        step = gen.send((encode_message(welcome), []))
        assert step[0] == "send"  # Ready is about to go out...
        assert not os.path.exists("/dev/shm" + pseg.name)  # ...and the name is gone
        gen.close()  # the server never reads it
    finally:
        pseg.unlink()
        pseg.close()
