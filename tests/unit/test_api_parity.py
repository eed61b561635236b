"""The async and the blocking API are twins: every public method of one exists on the
other, with the same keyword arguments, or is listed here as one-sided with the reason."""

from __future__ import annotations

import inspect

import pytest

import ringwire

# name -> why only one side has it
ASYNC_ONLY = {
    "aclose": "the async close; SyncChannel.close is its twin (Channel.close exists too)",
    "extra": "anyio's typed attributes (Channel is an anyio ObjectStream)",
    "extra_attributes": "anyio's typed attributes (Channel is an anyio ObjectStream)",
}
SYNC_ONLY: dict[str, str] = {}
# keyword arguments one side has and the other cannot: the blocking API takes
# timeouts, the async API is bounded by anyio cancel scopes instead
SYNC_ONLY_KWARGS = {"timeout"}


def public_methods(cls: type) -> dict[str, object]:
    return {
        name: member
        for name, member in inspect.getmembers(cls)
        if not name.startswith("_") and (callable(member) or isinstance(member, property))
    }


PAIRS = [
    (ringwire.Channel, ringwire.SyncChannel),
    (ringwire.Receipt, ringwire.SyncReceipt),
]


@pytest.mark.parametrize(("async_cls", "sync_cls"), PAIRS, ids=lambda c: c.__name__)
def test_every_public_method_has_its_twin(async_cls: type, sync_cls: type) -> None:
    a, s = public_methods(async_cls), public_methods(sync_cls)
    missing_sync = sorted(set(a) - set(s) - set(ASYNC_ONLY))
    missing_async = sorted(set(s) - set(a) - set(SYNC_ONLY))
    assert not missing_sync, f"{sync_cls.__name__} lacks {missing_sync}"
    assert not missing_async, f"{async_cls.__name__} lacks {missing_async}"


@pytest.mark.parametrize(("async_cls", "sync_cls"), PAIRS, ids=lambda c: c.__name__)
def test_twins_take_the_same_keyword_arguments(async_cls: type, sync_cls: type) -> None:
    a, s = public_methods(async_cls), public_methods(sync_cls)
    for name in sorted(set(a) & set(s)):
        if isinstance(a[name], property):
            assert isinstance(s[name], property), name
            continue
        pa = inspect.signature(a[name]).parameters  # type: ignore[arg-type]
        ps = inspect.signature(s[name]).parameters  # type: ignore[arg-type]
        kw_a = {n for n, p in pa.items() if n != "self"}
        kw_s = {n for n, p in ps.items() if n != "self"} - SYNC_ONLY_KWARGS
        assert kw_a == kw_s, f"{name}: {sorted(kw_a)} vs {sorted(kw_s)}"
        for n in kw_a:
            assert pa[n].default == ps[n].default, f"{name}({n}=...): defaults differ"


def test_one_sided_entries_are_real() -> None:
    """The exemption lists name methods that exist (a stale entry would hide a gap)."""
    for name in ASYNC_ONLY:
        assert hasattr(ringwire.Channel, name), name
    for name in SYNC_ONLY:
        assert hasattr(ringwire.SyncChannel, name), name


def test_async_methods_are_coroutines_where_they_wait() -> None:
    """The twin of a blocking call that waits is awaitable; the _nowait forms are not."""
    for name, member in public_methods(ringwire.Channel).items():
        if isinstance(member, property) or name in ASYNC_ONLY:
            continue
        waits = not name.endswith("_nowait") and name not in {
            "abort",
            "close",
            "fileno",
            "statistics",
            "poll_peer",
        }
        assert inspect.iscoroutinefunction(member) == waits, name
