"""A worker module that takes ``RINGWIRE_TEST_IMPORT_DELAY`` seconds to import (a
worker loading a model at import time, say): the supervisor can die while the worker
is still importing, before its channel's handshake."""

from __future__ import annotations

import os
import time

from support.runtime_workers import echo

time.sleep(float(os.environ.get("RINGWIRE_TEST_IMPORT_DELAY", "0")))

__all__ = ["echo"]
