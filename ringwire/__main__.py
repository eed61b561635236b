"""``python -m ringwire``: see :mod:`ringwire._cli`."""

from ringwire._cli import main

if __name__ == "__main__":
    raise SystemExit(main())
