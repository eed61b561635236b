"""The async and the blocking API are twins: every async object and entry point has a
blocking twin with the same methods and the same keyword arguments (a blocking call
may add ``timeout=``), or is listed here as one-sided with the reason."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

import ringwire

# -- the pairs ------------------------------------------------------------------------

CLASS_PAIRS = [
    (ringwire.Channel, ringwire.SyncChannel),
    (ringwire.Receipt, ringwire.SyncReceipt),
    (ringwire.Listener, ringwire.SyncListener),
    (ringwire.Broadcaster, ringwire.SyncBroadcaster),
    (ringwire.BroadcastReceipt, ringwire.SyncBroadcastReceipt),
    (ringwire.Subscriber, ringwire.SyncSubscriber),
    (ringwire.Client, ringwire.SyncClient),
]

FUNCTION_PAIRS = [
    (ringwire.connect, ringwire.connect_sync),
    (ringwire.listen, ringwire.listen_sync),
    (ringwire.broadcast, ringwire.broadcast_sync),
    (ringwire.subscribe, ringwire.subscribe_sync),
    (ringwire.PairEnd.connect, ringwire.PairEnd.connect_sync),
    (ringwire.Listener.__init__, ringwire.SyncListener.__init__),
    (ringwire.serve, ringwire.serve_sync),
]

# keywords only an async entry point takes: name -> why
ASYNC_ONLY_KWARGS = {
    "task_status": "anyio's TaskGroup.start protocol (serve reports being ready)",
    "blocking": "serve may run a plain handler on a worker thread; serve_sync's handlers "
    "are always plain functions on its own threads",
}

# -- what is one-sided, and why -----------------------------------------------------------

# public entry points (functions of ringwire.__all__) with no blocking twin
ONE_SIDED_FUNCTIONS: dict[str, str] = {}
# functions that do no I/O and never wait: one form serves both drivers
NO_WAITING = {
    "borrow",
    "call_cancelled",
    "continue_trace",
    "copy_out",
    "decode",
    "encode",
    "pair",
    "received_trace",
    "release",
    "sweep_segments",
    "trace_records",
}
# classes with async methods that serve both drivers themselves
ONE_CLASS_FOR_BOTH = {
    "PairEnd": "one unconnected end: connect() makes a Channel, connect_sync() a SyncChannel",
}

# methods only the async side has: name -> why
ASYNC_ONLY = {
    "aclose": "the async close; every async object has close() too, the twin of the "
    "blocking object's close()",
    "extra": "anyio's typed attributes (Channel is an anyio ObjectStream)",
    "extra_attributes": "anyio's typed attributes (Channel is an anyio ObjectStream)",
}
SYNC_ONLY: dict[str, str] = {}
# keyword arguments one side has and the other cannot: the blocking API takes
# timeouts, the async API is bounded by anyio cancel scopes instead
SYNC_ONLY_KWARGS = {"timeout"}
# methods of async objects that never wait (plain functions on both sides)
NEVER_WAIT = {
    "abort",
    "close",
    "drop_reader",
    "fileno",
    "poll_peer",
    "poll_readers",
    "poll_writer",
    "readers",
    "statistics",
}


def public_methods(cls: type) -> dict[str, object]:
    return {
        name: member
        for name, member in inspect.getmembers(cls)
        if not name.startswith("_") and (callable(member) or isinstance(member, property))
    }


def _keywords(fn: Any) -> dict[str, inspect.Parameter]:
    sig = fn if isinstance(fn, inspect.Signature) else inspect.signature(fn)
    return {n: p for n, p in sig.parameters.items() if n != "self"}


def _without(fn: Any, names: dict[str, str]) -> Any:
    """``fn``'s signature less the keywords ``names`` (for :func:`_same_keywords`)."""
    sig = inspect.signature(fn)
    return sig.replace(parameters=[p for p in sig.parameters.values() if p.name not in names])


def _same_keywords(a: Any, s: Any, what: str, sync_may_add: set[str] = SYNC_ONLY_KWARGS) -> None:
    pa, ps = _keywords(a), _keywords(s)
    kw_a, kw_s = set(pa), set(ps) - (sync_may_add - set(pa))
    assert kw_a == kw_s, f"{what}: {sorted(kw_a - kw_s)} async only, {sorted(kw_s - kw_a)} sync"
    for n in kw_a:
        assert pa[n].default == ps[n].default, f"{what}({n}=...): defaults differ"
        assert pa[n].kind == ps[n].kind, f"{what}({n}): positional in one, keyword in the other"


# -- classes ----------------------------------------------------------------------------


@pytest.mark.parametrize(("async_cls", "sync_cls"), CLASS_PAIRS, ids=lambda c: c.__name__)
def test_every_public_method_has_its_twin(async_cls: type, sync_cls: type) -> None:
    a, s = public_methods(async_cls), public_methods(sync_cls)
    missing_sync = sorted(set(a) - set(s) - set(ASYNC_ONLY))
    missing_async = sorted(set(s) - set(a) - set(SYNC_ONLY))
    assert not missing_sync, f"{sync_cls.__name__} lacks {missing_sync}"
    assert not missing_async, f"{async_cls.__name__} lacks {missing_async}"
    if "aclose" in a:
        assert "close" in a, f"{async_cls.__name__} has aclose() but no close()"


@pytest.mark.parametrize(("async_cls", "sync_cls"), CLASS_PAIRS, ids=lambda c: c.__name__)
def test_twins_take_the_same_keyword_arguments(async_cls: type, sync_cls: type) -> None:
    a, s = public_methods(async_cls), public_methods(sync_cls)
    for name in sorted(set(a) & set(s)):
        if isinstance(a[name], property):
            assert isinstance(s[name], property), name
            continue
        _same_keywords(a[name], s[name], f"{async_cls.__name__}.{name}")


@pytest.mark.parametrize(("async_cls", "sync_cls"), CLASS_PAIRS, ids=lambda c: c.__name__)
def test_async_methods_are_coroutines_where_they_wait(async_cls: type, sync_cls: type) -> None:
    """The twin of a blocking call that waits is awaitable; the _nowait forms, and
    what never waits, are not (on either side)."""
    for name, member in public_methods(async_cls).items():
        if isinstance(member, property) or name in ASYNC_ONLY:
            continue
        waits = not name.endswith("_nowait") and name not in NEVER_WAIT
        assert inspect.iscoroutinefunction(member) == waits, f"{async_cls.__name__}.{name}"
    for name, member in public_methods(sync_cls).items():
        if not isinstance(member, property):
            assert not inspect.iscoroutinefunction(member), f"{sync_cls.__name__}.{name}"


def test_every_async_class_has_a_blocking_twin_or_a_reason() -> None:
    paired = {a.__name__ for a, _ in CLASS_PAIRS}
    for name in ringwire.__all__:
        obj = getattr(ringwire, name)
        if not isinstance(obj, type) or name.startswith("Sync"):
            continue
        has_async = any(
            inspect.iscoroutinefunction(m) for m in public_methods(obj).values() if callable(m)
        )
        if has_async:
            assert name in paired or name in ONE_CLASS_FOR_BOTH, (
                f"{name} has async methods but no blocking twin in CLASS_PAIRS"
            )
        if "Sync" + name in ringwire.__all__:
            assert name in paired, f"{name} / Sync{name} are not in CLASS_PAIRS"


# -- entry points ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("async_fn", "sync_fn"), FUNCTION_PAIRS, ids=lambda f: f.__qualname__.replace(".", "_")
)
def test_entry_points_and_their_twins_take_the_same_keywords(async_fn: Any, sync_fn: Any) -> None:
    """Exactly the same (an entry point's wait is its ``handshake_timeout``)."""
    _same_keywords(
        _without(async_fn, ASYNC_ONLY_KWARGS), sync_fn, async_fn.__qualname__, sync_may_add=set()
    )
    assert not inspect.iscoroutinefunction(sync_fn), sync_fn.__qualname__


@pytest.mark.parametrize(
    "fn",
    [
        ringwire.connect,
        ringwire.connect_sync,
        ringwire.listen,
        ringwire.listen_sync,
        ringwire.broadcast,
        ringwire.broadcast_sync,
        ringwire.PairEnd.connect,
        ringwire.PairEnd.connect_sync,
        ringwire.subscribe,
        ringwire.subscribe_sync,
    ],
    ids=lambda f: f.__qualname__.replace(".", "_"),
)
def test_every_connection_maker_says_handshake_timeout(fn: Any) -> None:
    """The package docstring's names: ``handshake_timeout=`` bounds the making of a
    connection (``timeout=`` is for one operation's wait); ``type=`` decodes what
    arrives; whoever receives takes ``copy_out=``."""
    kw = _keywords(fn)
    assert "handshake_timeout" in kw and "timeout" not in kw, sorted(kw)
    if fn not in (ringwire.broadcast, ringwire.broadcast_sync):  # (a writer only)
        assert "copy_out" in kw and "type" in kw, sorted(kw)


def test_every_entry_point_has_a_blocking_twin_or_a_reason() -> None:
    for name in ringwire.__all__:
        obj = getattr(ringwire, name)
        if not inspect.isfunction(obj) or name in NO_WAITING:
            continue
        twin = name[: -len("_sync")] if name.endswith("_sync") else name + "_sync"
        if name in ONE_SIDED_FUNCTIONS:
            assert twin not in ringwire.__all__, (
                f"{name} is listed one-sided, but {twin} exists: move it into FUNCTION_PAIRS"
            )
            continue
        assert twin in ringwire.__all__, f"{name} has no twin {twin} and no stated reason"
        pair = (getattr(ringwire, twin), obj) if name.endswith("_sync") else (obj, None)
        if pair[1] is None:
            assert (obj, getattr(ringwire, twin)) in FUNCTION_PAIRS, f"{name} / {twin}"


def test_one_sided_entries_are_real() -> None:
    """The exemption lists name things that exist (a stale entry would hide a gap)."""
    for name in ASYNC_ONLY:
        assert any(hasattr(a, name) for a, _ in CLASS_PAIRS), name
    for name in SYNC_ONLY:
        assert any(hasattr(s, name) for _, s in CLASS_PAIRS), name
    for name in NEVER_WAIT:
        assert any(hasattr(a, name) for a, _ in CLASS_PAIRS), name
    for name in (*ONE_SIDED_FUNCTIONS, *NO_WAITING, *ONE_CLASS_FOR_BOTH):
        assert name in ringwire.__all__, name
