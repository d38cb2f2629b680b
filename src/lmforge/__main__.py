"""``python -m lmforge`` is the same as the ``lmforge`` console script."""

from lmforge.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
