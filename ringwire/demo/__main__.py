"""``python -m ringwire.demo`` (see :mod:`ringwire.demo`)."""

import sys

from ringwire.demo import run

if __name__ == "__main__":
    sys.exit(run())
