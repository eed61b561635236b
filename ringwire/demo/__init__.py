"""``python -m ringwire.demo``: a multi-process demo of ringwire and its runtime.

A front process (the supervisor) sends requests -- text records with tiny inline
arrays, numpy images copied once into shared-memory slots, torch tensors loaned from
a slot and filled in place -- to worker processes that answer; a live view shows
records/s, round-trip p50/p99, bytes moved zero-copy and slots in use; the run ends
with a summary and a leak check.  ``--kill`` kills a worker mid-run to show detection,
reclaim and restart.  See ``python -m ringwire.demo --help``.
"""

from ._main import run

__all__ = ["run"]
