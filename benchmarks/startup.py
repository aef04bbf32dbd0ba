"""Ctrl-C while a command starts (its imports take seconds) ends it with one line, not a traceback.

Every command module starts with, before its own imports::

    if __name__ == "__main__":
        from benchmarks.startup import guard_startup
        guard_startup()

:func:`guard_startup` (standard library only, so it is in place within milliseconds) makes SIGINT and
SIGTERM print ``interrupted while starting: nothing was written`` and exit 130 at once; once the
command's imports are done and its options parsed, :func:`benchmarks.cli.run_main` hands the signals
back to Python (:func:`end_startup`), so the command's own cleanup sees KeyboardInterrupt as before.
"""

from __future__ import annotations

import os
import signal
import sys

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _interrupted(signum, frame) -> None:
    sys.stderr.write(f"\ninterrupted while starting ({signal.Signals(signum).name}): nothing was written\n")
    sys.stderr.flush()
    os._exit(130)


def guard_startup() -> None:
    """Until :func:`end_startup`: SIGINT/SIGTERM exit 130 with one line (module docstring)."""
    for sig in SIGNALS:
        signal.signal(sig, _interrupted)


def end_startup() -> None:
    """Python's own handlers again (SIGINT raises KeyboardInterrupt, SIGTERM terminates), if the guard is on."""
    if signal.getsignal(signal.SIGINT) is _interrupted:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if signal.getsignal(signal.SIGTERM) is _interrupted:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
