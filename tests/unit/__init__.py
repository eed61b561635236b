"""Fast tests with no child process: each runs in this interpreter (threads, segments,
socketpairs and pair() between tasks or threads are fine).  ``pytest tests/unit``."""
