"""Publish one ``python -m perf`` run as the figures of the documentation's benchmarks page.

    python -m perf --quick --out /tmp/perfrun     # or --full; one run, on one machine
    python docs/benchmarks/publish.py /tmp/perfrun
    mkdocs build --strict                         # the page is rendered from them

Copies into ``docs/benchmarks/``: ``results.json`` (with the run's folder written as
``DIR`` in its commands and each benchmark's log path made relative), the benchmarks'
logs (``logs/``: the report reads the tables of the benchmarks whose JSON has none from
them) and the plots the run's ``report.md`` shows.  What was there from an earlier run
is removed first, so the page shows one run, never a mixture.  Nothing is edited by hand:
``docs/hooks.py`` renders the page with ``perf/_report.py`` at build time.

Raises ``SystemExit`` naming the folder when it holds no ``results.json``.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def publish(run: Path) -> None:
    """Copy the run in folder ``run`` into this folder (see the module docstring)."""
    src = run / "results.json"
    if not src.is_file():
        raise SystemExit(f"publish: no results.json in {run} (run `python -m perf --out {run}` first)")
    results = json.loads(src.read_text())
    for old in [*HERE.glob("*.png"), HERE / "results.json"]:
        old.unlink(missing_ok=True)
    shutil.rmtree(HERE / "logs", ignore_errors=True)
    (HERE / "logs").mkdir()
    prefix = str(run.resolve())
    for bench in results["benchmarks"].values():
        bench["command"] = [a.replace(prefix, "DIR") for a in bench.get("command", [])]
        if bench.get("json"):
            bench["json"] = bench["json"].replace(prefix, "DIR")
        log = Path(bench["log"]) if bench.get("log") else None
        if log and log.is_file():
            shutil.copy(log, HERE / "logs" / log.name)
            bench["log"] = f"logs/{log.name}"
        else:
            bench["log"] = None
    (HERE / "results.json").write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    report = run / "report.md"
    shown = re.findall(r"!\[[^\]]*\]\(([^)/]+\.png)\)", report.read_text()) if report.is_file() else []
    for png in shown:
        if (run / png).is_file():
            shutil.copy(run / png, HERE / png)
    print(f"published {src} and {len(shown)} plots into {HERE}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python docs/benchmarks/publish.py RUN_DIR")
    publish(Path(sys.argv[1]))
