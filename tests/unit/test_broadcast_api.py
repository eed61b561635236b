"""The broadcast's async and blocking APIs are twins (the rule of test_api_parity.py),
and every public broadcast name is exported."""

from __future__ import annotations

import inspect

import pytest

import ringwire

PAIRS = [
    (ringwire.Broadcaster, ringwire.SyncBroadcaster),
    (ringwire.Subscriber, ringwire.SyncSubscriber),
    (ringwire.BroadcastReceipt, ringwire.SyncBroadcastReceipt),
]
# name -> why only one side has it
ONE_SIDED = {
    "aclose": "the async close; close() is on both",
}
SYNC_ONLY_KWARGS = {"timeout"}  # async waits are bounded by anyio cancel scopes
NOT_AWAITED = {
    "close",
    "fileno",
    "statistics",
    "poll_readers",
    "poll_writer",
    "readers",
    "drop_reader",
    "abort",
}


def public(cls: type) -> dict[str, object]:
    return {
        n: m
        for n, m in inspect.getmembers(cls)
        if not n.startswith("_") and (callable(m) or isinstance(m, property))
    }


@pytest.mark.parametrize(("a", "s"), PAIRS, ids=lambda c: c.__name__)
def test_twins(a: type, s: type) -> None:
    pa, ps = public(a), public(s)
    assert sorted(set(pa) - set(ps) - set(ONE_SIDED)) == []
    assert sorted(set(ps) - set(pa)) == []
    for name in sorted(set(pa) & set(ps)):
        if isinstance(pa[name], property):
            assert isinstance(ps[name], property), name
            continue
        ka = set(inspect.signature(pa[name]).parameters) - {"self"}  # type: ignore[arg-type]
        ks = set(inspect.signature(ps[name]).parameters) - {"self"} - SYNC_ONLY_KWARGS  # type: ignore[arg-type]
        assert ka == ks, name


@pytest.mark.parametrize("cls", [ringwire.Broadcaster, ringwire.Subscriber])
def test_async_methods_are_coroutines_where_they_wait(cls: type) -> None:
    for name, member in public(cls).items():
        if isinstance(member, property) or name in ONE_SIDED:
            continue
        waits = not name.endswith("_nowait") and name not in NOT_AWAITED
        assert inspect.iscoroutinefunction(member) == waits, name


def test_exports() -> None:
    for name in (
        "broadcast",
        "broadcast_sync",
        "subscribe",
        "subscribe_sync",
        "Broadcaster",
        "SyncBroadcaster",
        "Subscriber",
        "SyncSubscriber",
        "BroadcastReceipt",
        "SyncBroadcastReceipt",
        "BroadcastStatistics",
        "ReaderInfo",
        "ReaderStalled",
    ):
        assert name in ringwire.__all__ and hasattr(ringwire, name), name
    assert issubclass(ringwire.ReaderStalled, TimeoutError)
    assert issubclass(ringwire.ReaderStalled, ringwire.RingwireError)
    assert inspect.iscoroutinefunction(ringwire.subscribe)
    assert not inspect.iscoroutinefunction(ringwire.broadcast)  # binds at once
