"""Every keyword of connect / listen / pair is checked before anything is created."""

from __future__ import annotations

import inspect
import pathlib

import pytest

import ringwire


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"capacity": 1000}, "power of two"),
        ({"spin_us": -1}, "spin_us"),
        ({"handshake_timeout": 0}, "handshake_timeout"),
        ({"copy_out": "yes"}, "copy_out"),
        ({"slots": "many"}, "SlotConfig"),
    ],
)
def test_connect_refuses_bad_keywords_before_connecting(
    tmp_path: pathlib.Path, kw: dict[str, object], match: str
) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        ringwire.connect_sync(tmp_path / "nobody.sock", **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"spin_us": "fast"}, "spin_us"),
        ({"handshake_timeout": -1}, "handshake_timeout"),
        ({"backlog": 0}, "backlog"),
        ({"max_capacity": 3}, "power of two"),
        ({"colour": "red"}, "colour"),
    ],
)
def test_listeners_refuse_bad_keywords_and_make_no_socket(
    tmp_path: pathlib.Path, kw: dict[str, object], match: str
) -> None:
    path = tmp_path / "l.sock"
    with pytest.raises((ValueError, TypeError), match=match):
        ringwire.SyncListener(path, **kw)  # type: ignore[arg-type]
    with pytest.raises((ValueError, TypeError), match=match):
        ringwire.listen(path, **kw)  # type: ignore[arg-type]
    assert not path.exists()


def test_pair_ends_refuse_bad_keywords_and_stay_usable() -> None:
    a, b = ringwire.pair()
    try:
        with pytest.raises(ValueError, match="spin_us"):
            a.connect_sync(spin_us=-5)
        assert "open" in repr(a)  # nothing was taken: the end can still connect
    finally:
        a.close()
        b.close()


def test_every_keyword_is_typed() -> None:
    for fn in (
        ringwire.connect,
        ringwire.connect_sync,
        ringwire.listen,
        ringwire.Listener.__init__,
        ringwire.SyncListener.__init__,
        ringwire.pair,
        ringwire.PairEnd.connect,
        ringwire.PairEnd.connect_sync,
    ):
        for name, p in inspect.signature(fn).parameters.items():
            assert p.kind is not p.VAR_KEYWORD, f"{fn.__qualname__} takes **{name}"
            if name not in ("self", "path"):
                assert p.annotation is not p.empty, f"{fn.__qualname__}({name})"
