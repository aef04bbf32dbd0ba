"""``python -m benchmarks.search``: the command line of :mod:`benchmarks.search.cli`."""

if __name__ == "__main__":  # before the imports: Ctrl-C while they load is one line (benchmarks.startup)
    from benchmarks.startup import guard_startup

    guard_startup()

import sys

from benchmarks.search.cli import main

if __name__ == "__main__":
    sys.exit(main())
