"""``python -m ringwire.demo``'s rendering, in this process (issue 14 item 7: on an 80x24
terminal the live table's headers were cut -- "work… │ rest… │ answ…" -- and "5.51 GB"
wrapped).  The live view, the start-up progress, the once-a-second line and the summary
are rendered at 80 and 120 columns and read back as text.  The demo itself, in
subprocesses, is tested in tests/process/test_demo.py."""

from __future__ import annotations

import io
import re
from pathlib import Path
from typing import Any

import pytest

from ringwire import runtime
from ringwire.demo import _app, _main
from ringwire.demo import _view as view

pytest.importorskip("rich")

# the widest values a run shows: a 7-digit pid, the longest state, millions answered
WORST = [
    view.Row("worker-0", "4194303", "restarting", "3", "9,999,999", "12,345", "123.45", "999.99",
             "999.99 GB", "12+12"),
    view.Row("worker-1", "4194304", "ready", "0", "1,234", "1,234", "1.23", "12.34", "5.51 GB",
             "0+0"),
]  # fmt: skip
TOTAL = view.Row("total", "", "", "3", "9,999,999", "13,579", "1.23", "999.99", "999.99 GB", "")
KILL_EVENT = (
    "  4.02s  worker 'worker-0' (pid 8871) died: killed by SIGKILL; 3 slot(s) reclaimed; "
    "detected 15.8 ms after the kill; slots in use on its connection now: 0"
)


def render(renderable: Any, width: int) -> list[str]:
    from rich.console import Console

    console = Console(width=width, record=True, file=io.StringIO(), color_system=None)
    console.print(renderable)
    return console.export_text().splitlines()


def cells(line: str) -> list[str]:
    return [c for c in re.split(r"\s{2,}", line.strip()) if c]


@pytest.mark.parametrize("width", [80, 120])
def test_the_live_view_fits_the_terminal(width: int) -> None:
    lines = render(
        view.live_view(
            WORST, TOTAL, width=width, elapsed=4.2, duration=10, status="running", log=[KILL_EVENT]
        ),
        width,
    )
    assert all(len(line) <= width for line in lines), "\n".join(lines)
    text = "\n".join(lines)
    assert "…" not in text  # nothing cut
    [header] = [line for line in lines if line.startswith("worker ")]
    wanted = ["worker", "state", "answered", "rec/s", "p50 ms", "p99 ms", "zero-copy", "slots"]
    if width >= 100:  # room for every column
        wanted[1:1] = ["pid"]
        wanted[3:3] = ["restarts"]
    assert cells(header) == wanted, header
    [row0] = [line for line in lines if line.startswith("worker-0")]
    [row1] = [line for line in lines if line.startswith("worker-1")]
    assert "999.99 GB" in row0 and "9,999,999" in row0 and "12+12" in row0  # on one line
    assert "5.51 GB" in row1
    assert len(cells(row0)) == len(wanted)
    assert view.TITLE in text and view.LEGEND in text
    # the bar has a line of its own (it used to run into the table's title)
    [bar] = [line for line in lines if "━" in line]
    assert set(bar.strip()) <= set("━╺╸")
    # a long event wraps between its parts, never inside one
    events = lines[lines.index(view.LEGEND) + 1 :]
    assert " ".join(x.strip() for x in events) == KILL_EVENT.strip()
    assert len(events) == {80: 3, 120: 2}[width], events


@pytest.mark.parametrize("width", [80, 120])
def test_the_start_up_progress_fits(width: int) -> None:
    workers = [("worker-0", "pid 4194303", "starting ..."), ("worker-1", "", "ready in 12.34 s")]
    lines = render(
        view.startup_view(
            workers, "importing torch, making tensors ...", elapsed=5.7,
            imports="numpy and torch", width=width,
        ),
        width,
    )  # fmt: skip
    assert all(len(line) <= width for line in lines), "\n".join(lines)
    assert lines[0].startswith("starting 2 worker(s)") and lines[0].endswith("5.7 s")
    assert "worker-0  pid 4194303  starting ..." in "\n".join(lines)


def test_the_once_a_second_line_and_the_wrapping_helpers_fit_80_columns() -> None:
    # the figures of a default 10 s run, generously
    line = view.status_line(
        elapsed=10.0, answered=99_999, rate=9_999, p50=9.99, p99=99.99,
        zero_copy=99_990_000_000, slots=(4, 4),
    )  # fmt: skip
    assert len(line) <= 80 and "answered=99999 " in line and "99.99GB" in line, line
    assert view.status_line(elapsed=0, answered=0, rate=0, p50=float("nan"), p99=float("nan"),
                     zero_copy=0, slots=(0, 0)).count("-/-ms") == 1  # fmt: skip
    wrapped = view.wrap_event(KILL_EVENT, 80, indent=12)
    assert all(len(x) <= 80 for x in wrapped) and len(wrapped) > 1
    assert " ".join(x.strip() for x in wrapped) == KILL_EVENT.strip()
    parts = ["a" * 30, "failed 0; wrong answers 0", "b" * 40]
    out = view.labelled("requests", parts)
    assert out[0] == "  requests     " + "a" * 30 + "; failed 0; wrong answers 0;"
    assert out[1] == " " * 15 + "b" * 40


class _FakeTopology:
    stop_reason = "main() returned"

    def status(self) -> dict[str, runtime.WorkerStatus]:
        return {
            "worker-0": runtime.WorkerStatus("worker-0", "ready", 4194303, 1, 1),
            "worker-1": runtime.WorkerStatus("worker-1", "ready", 4194304, 0, 0),
        }


def test_the_summary_fits_80_columns_and_says_what_happened() -> None:
    """Every line the summary prints is at most 80 columns; a run without --kill has no
    --kill line, and a run with no answers says "-" where a percentile would be (it
    printed "p50 nan ms" and a "--kill" row when the workers did not start)."""
    opts = _app.Options(duration=10, workers=2, kill=True, live=False, torch=False)
    demo = _app.Demo(opts)
    st = demo.stats["worker-0"]
    st.answered, st.lost, st.loaned_bytes = 9_999_999, 4, 999_990_000_000
    st.latencies = [0.003, 0.004, 0.120]
    demo.loading, demo.extending, demo.elapsed, demo.startup_s = True, True, 16.5, 5.7
    demo.killed = ("worker-0", 8871, 0.0)
    demo.kill_lines = [
        ["kill -9 worker-0 (pid 8871) at t=4.00 s"],
        KILL_EVENT.split("  ", 2)[-1].split("; "),
    ]
    demo.restart = _app._Restart("worker-0", 4194303, 6.5, 0.0, 100)
    lines = _main._summary(demo, _FakeTopology(), stop_s=0.4)  # type: ignore[arg-type]
    assert all(len(line) <= 80 for line in lines), "\n".join(lines)
    text = "\n".join(lines)
    assert "failed 0; wrong answers 0" in text
    assert "4 in flight on the killed worker, lost with it" in text
    assert "answered 9,999,899 requests since its restart" in text
    assert "6.5 s past --duration, for the restart" in text
    assert "loaned arrays (no copy)" in text  # numpy only: no tensors claimed

    quiet = _app.Demo(_app.Options(duration=10, live=False, torch=False))
    quiet.loading = True  # a run in which nothing was answered
    text = "\n".join(_main._summary(quiet, _FakeTopology()))  # type: ignore[arg-type]
    assert "nan" not in text and "p50 - ms" in text
    assert "--kill" not in text

    quiet.loading = False  # stopped (Ctrl-C) or failed before the load began
    text = "\n".join(_main._summary(quiet, _FakeTopology()))  # type: ignore[arg-type]
    assert "none: the run stopped during start-up" in text and "round trip" not in text


def test_torch_is_no_dependency() -> None:
    """torch stays optional (issue 14 item 1): no dependency of the package names it;
    only the ``torch`` extra does."""
    tomllib = pytest.importorskip("tomllib")
    root = Path(__file__).resolve().parents[2]
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    names = [re.split(r"[\s<>=!~;\[]", d, maxsplit=1)[0].lower() for d in project["dependencies"]]
    assert "torch" not in names, names
    assert any(d.startswith("torch") for d in project["optional-dependencies"]["torch"])
