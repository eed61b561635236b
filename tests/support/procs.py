"""This machine's processes as /proc shows them, for the leak checks of the tests."""

from __future__ import annotations

import os


def children(pid: int | None = None, *, zombies: bool = False) -> set[int]:
    """The live children of ``pid`` (default: this process); ``zombies=True``: those
    that died and were not reaped instead."""
    pid = os.getpid() if pid is None else pid
    kids = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                data = f.read()
        except OSError:
            continue
        # the command name may contain spaces and parentheses: split after the last ')'
        fields = data[data.rfind(b")") + 2 :].split()
        if int(fields[1]) == pid and (fields[0] == b"Z") == zombies:
            kids.add(int(name))
    return kids
