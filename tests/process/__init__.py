"""Tests that start processes (spawned children, subprocesses, forks): marked
``multiprocess``.  ``pytest tests/process``."""
