"""Load: many producer processes into one consumer (the producers are
tests/chaos/workers.py).  ``pytest tests/load``."""
