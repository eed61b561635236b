"""Chaos: kill -9, SIGSTOP and a full /dev/shm against real processes (harness.py,
workers.py; the tests in test_chaos.py).  ``pytest tests/chaos``."""
