"""What the demo shows: the live table (rich), the once-a-second lines, the start-up
progress and the summary -- pure functions of plain values, so that their layout can be
tested at any width without running the demo.

Everything fits an 80-column terminal: the live table drops its ``pid`` and
``restarts`` columns when the full table would not fit the console's width (the event
log under it names the pids and the restarts), and every line the demo prints itself
is at most :data:`WIDTH` columns.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

WIDTH = 80  # the demo's printed lines (banner, summary) fit this

TITLE = "ringwire demo: front -> workers over shared-memory rings and slots"
LEGEND = "slots: front slots lent + worker slots held; Ctrl-C stops"


def ms(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.2f}"


def pct(values: Sequence[float] | np.ndarray, q: float) -> float:
    """The ``q``-th percentile of latencies in seconds, in milliseconds (NaN if none)."""
    if len(values) == 0:
        return math.nan
    return float(np.percentile(np.asarray(values), q)) * 1e3


def human(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


@dataclass(frozen=True)
class Row:
    """One line of the live table, as text."""

    worker: str
    pid: str
    state: str
    restarts: str
    answered: str
    rate: str
    p50: str
    p99: str
    zero_copy: str
    slots: str


# (header, Row field, justify); the compact table keeps the columns marked True
_COLUMNS: tuple[tuple[str, str, str, bool], ...] = (
    ("worker", "worker", "left", True),
    ("pid", "pid", "right", False),
    ("state", "state", "left", True),
    ("restarts", "restarts", "right", False),
    ("answered", "answered", "right", True),
    ("rec/s", "rate", "right", True),
    ("p50 ms", "p50", "right", True),
    ("p99 ms", "p99", "right", True),
    ("zero-copy", "zero_copy", "right", True),
    ("slots", "slots", "right", True),
)
_GAP = 2  # between two columns: their (collapsed) padding and the blank divider


def _needed(columns: Sequence[tuple[str, str, str, bool]], rows: Sequence[Row]) -> int:
    widths = [max(len(h), *(len(getattr(r, f)) for r in rows)) for h, f, _, _ in columns]
    return sum(widths) + _GAP * (len(widths) - 1)


def live_table(rows: Sequence[Row], total: Row, width: int) -> Any:
    """The live table for a console ``width`` columns wide: every column, or the
    compact set (no pid, no restarts) when all of them would not fit."""
    from rich import box
    from rich.table import Table

    columns = list(_COLUMNS)
    if _needed(columns, [*rows, total]) > width:
        columns = [c for c in _COLUMNS if c[3]]
    t = Table(
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
        collapse_padding=True,
        title=TITLE if len(TITLE) <= width else "ringwire demo",
        title_justify="left",
        title_style="bold",
    )
    for header, _, justify, _ in columns:
        t.add_column(header, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for row in rows:
        t.add_row(*(getattr(row, f) for _, f, _, _ in columns))
    t.add_row(*(getattr(total, f) for _, f, _, _ in columns), style="bold")
    return t


def live_view(
    rows: Sequence[Row],
    total: Row,
    *,
    width: int,
    elapsed: float,
    duration: float,
    status: str,
    log: Sequence[str],
) -> Any:
    """The whole live view: progress, the table, the latest events."""
    from rich.console import Group
    from rich.progress_bar import ProgressBar
    from rich.table import Table
    from rich.text import Text

    head = Text(f"{min(elapsed, duration):5.1f} / {duration:g} s  {status}".rstrip())
    head.truncate(width)
    bar = Table.grid()  # a row of its own (a bare ProgressBar ends no line)
    bar.add_row(ProgressBar(total=duration, completed=min(elapsed, duration), width=min(60, width)))
    lines = [x for event in log[-6:] for x in wrap_event(event, width)]
    events = Text("\n".join(lines) or "no events yet", style="dim")
    return Group(head, bar, live_table(rows, total, width), Text(LEGEND, style="dim"), events)


def wrap_event(event: str, width: int, indent: int = 10) -> list[str]:
    """An event line (``"  4.02s  what; more; more"``) wrapped at ``width`` between its
    "; "-separated parts, continuation lines indented by ``indent``."""
    out: list[str] = []
    cur = ""
    for part in event.split("; "):
        joined = f"{cur}; {part}" if cur else part
        if cur and len(joined) > width:
            out.append(cur + ";")
            cur = " " * indent + part
        else:
            cur = joined
    out.append(cur)
    return out


def startup_view(
    workers: Sequence[tuple[str, str, str]], front: str, *, elapsed: float, imports: str, width: int
) -> Any:
    """The start-up progress: each worker's (name, pid, state) and the front's own
    preparation, under a line with the time so far."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    head = Text(
        f"starting {len(workers)} worker(s) (fresh interpreters importing {imports}) ... "
        f"{elapsed:4.1f} s"
    )
    head.truncate(width)
    grid = Table.grid(padding=(0, 2))
    for _ in range(3):
        grid.add_column(no_wrap=True)
    for name, pid, state in workers:
        grid.add_row(f"  {name}", pid, state)
    grid.add_row("  front", "", front)
    return Group(head, grid)


def status_line(
    *,
    elapsed: float,
    answered: int,
    rate: float,
    p50: float,
    p99: float,
    zero_copy: int,
    slots: tuple[int, int],
) -> str:
    """The once-a-second line of ``--no-live`` (80 columns for a default run's figures)."""
    return (
        f"{elapsed:.1f}s answered={answered} rec/s={rate:.0f} "
        f"p50/p99={ms(p50)}/{ms(p99)}ms zero-copy={human(zero_copy).replace(' ', '')} "
        f"slots={slots[0]}+{slots[1]}"
    )


def labelled(label: str, parts: Sequence[str], width: int = WIDTH, *, sep: str = "; ") -> list[str]:
    """``label`` then ``parts`` joined with ``sep``, wrapped at ``width`` between parts
    (never inside one), continuation lines indented under the first."""
    prefix = f"  {label:<12} "
    out: list[str] = []
    cur = ""
    for part in parts:
        joined = f"{cur}{sep}{part}" if cur else part
        if cur and len(prefix) + len(joined) > width:
            out.append(prefix + cur + sep.rstrip())
            prefix = " " * len(prefix)
            cur = part
        else:
            cur = joined
    out.append(prefix + cur)
    return out
