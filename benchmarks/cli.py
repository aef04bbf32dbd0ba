"""One validation layer for every command line of sipit-bench (and the library calls behind them).

- :class:`UsageError`: a bad option or argument (a :class:`sipit.whitebox.SipitInputError`).
- Checkers (:func:`check_int`, :func:`check_float`, :func:`check_floats`, :func:`check_names`)
  validate a value for the library API and raise :class:`UsageError`; :func:`arg` turns any of
  them into an argparse ``type=`` function, so a flag and the keyword it feeds share one rule.
- :func:`run_main`: parse, run the command, and turn a bad-input error (ValueError, OSError,
  ImportError) into one line ``<prog>: error: ...`` on stderr with exit code 2 instead of a
  traceback (``SIPIT_TRACEBACK=1`` shows the traceback); Ctrl-C a command does not handle itself
  exits 130 with one line (and while a command starts: benchmarks.startup).
- :func:`default_out_dir`: where every command writes without ``--out``.
- :func:`interrupt_once`: the first SIGINT/SIGTERM interrupts, later ones are ignored while the
  interrupted command cleans up.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Sequence, TypeVar

from benchmarks.startup import end_startup
from sipit.cache import cache_dir
from sipit.whitebox import SipitInputError

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_ENV = "SIPIT_RESULTS_DIR"
MAX_MESSAGE_CHARS = 600

T = TypeVar("T")


class UsageError(SipitInputError):
    """A bad option or argument, reported as one line before any heavy work."""


def default_out_dir(command_name: str) -> Path:
    """``<results>/<command_name>``: the folder a command writes to when ``--out`` is not given.

    ``<results>`` is ``$SIPIT_RESULTS_DIR`` if set, else the repository's ``results/`` (git-ignored),
    whatever the current directory is.
    """
    root = os.environ.get(RESULTS_ENV)
    return (Path(root).expanduser() if root else REPO_ROOT / "results") / command_name


# --------------------------------------------------------------------------- checkers
def usage_error(name: str, problem: str) -> UsageError:
    """The error for option ``name`` (may be empty: argparse names the flag itself) and ``problem``."""
    return UsageError(f"{name} {problem}" if name else problem)


def check_int(value, *, low: int, name: str = "") -> int:
    """``value`` as an int >= ``low`` (a numeric string is accepted); else :class:`UsageError`."""
    try:
        number = int(str(value).strip()) if not isinstance(value, bool) else None
    except ValueError:
        number = None
    if number is None:
        raise usage_error(name, f"must be an integer, got {value!r}")
    if number < low:
        raise usage_error(name, f"must be an integer >= {low}, got {number}")
    return number


def check_float(value, *, low: float = 0.0, below: float = math.inf, name: str = "") -> float:
    """``value`` as a finite float with ``low <= value < below`` (a numeric string is accepted); else
    :class:`UsageError`."""
    try:
        number = float(str(value).strip()) if not isinstance(value, bool) else math.nan
    except ValueError:
        number = math.nan
    if not math.isfinite(number) or number < low or number >= below:
        bound = f">= {low:g}" + (f" and < {below:g}" if math.isfinite(below) else "")
        raise usage_error(name, f"must be a finite number {bound}, got {value!r}")
    return number


def split_list(value: str | Sequence[str]) -> list[str]:
    """``'a,b'`` or ``['a', 'b,c']`` -> the stripped, non-empty items."""
    items = [value] if isinstance(value, str) else list(value)
    return [part.strip() for item in items for part in str(item).split(",") if part.strip()]


def check_floats(value: str | Sequence, *, low: float = 0.0, name: str = "") -> list[float]:
    """A non-empty comma list of finite floats >= ``low``."""
    items = split_list(value) if isinstance(value, str) else list(value)
    if not items:
        raise usage_error(name, "needs at least one number")
    return [check_float(item, low=low, name=name) for item in items]


def check_names(value: str | Sequence[str], choices: Sequence[str], *, name: str = "") -> list[str]:
    """A non-empty comma list of names, each one of ``choices``."""
    names = split_list(value)
    bad = [n for n in names if n not in choices]
    if bad or not names:
        problem = f"unknown {bad}" if bad else "is empty"
        raise usage_error(name, f"{problem}: choose from {', '.join(choices)}")
    return names


def arg(check: Callable[..., T], **options) -> Callable[[str], T]:
    """An argparse ``type=`` function running ``check(text, **options)``: the flag and the library
    keyword share one rule, and argparse reports a failure as ``argument --flag: <problem>``."""

    def parse(text: str) -> T:
        try:
            return check(text, **options)
        except UsageError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    parse.__name__ = check.__name__.removeprefix("check_")
    return parse


# --------------------------------------------------------------------------- running a command
USER_ERRORS = (ValueError, OSError, ImportError)  # SipitInputError, DefenseParamError, bad files, missing packages


def one_line(err: BaseException) -> str:
    """The error's message on one line (whitespace collapsed), at most MAX_MESSAGE_CHARS long."""
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= MAX_MESSAGE_CHARS else text[: MAX_MESSAGE_CHARS - 3] + "..."


def run_main(parser: argparse.ArgumentParser, command: Callable[[argparse.Namespace], int],
             argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run ``command(args)``; bad input -> ``<prog>: error: ...`` and exit code 2.

    Bad input is what :data:`USER_ERRORS` covers (the library raises SipitInputError, a ValueError,
    for every bad value it refuses). ``SIPIT_TRACEBACK=1`` re-raises to show the traceback.
    """
    args = parser.parse_args(argv)
    end_startup()
    try:
        cache_dir()  # a bad $SIPIT_CACHE_DIR is one line now, not an error in the middle of the work
        return command(args)
    except USER_ERRORS as err:
        if os.environ.get("SIPIT_TRACEBACK"):
            raise
        parser.exit(2, f"{parser.prog}: error: {one_line(err)}\n")
    except KeyboardInterrupt:  # a command without cleanup of its own to report
        if os.environ.get("SIPIT_TRACEBACK"):
            raise
        print(f"\n{parser.prog}: interrupted", file=sys.stderr)
        return 130


# --------------------------------------------------------------------------- interruptions
INTERRUPT_SIGNALS = (signal.SIGINT, signal.SIGTERM)
REDELIVER_S = 0.01  # a signal that lands in a finaliser is sent again this much later


def _in_finaliser(frame) -> bool:
    """Whether ``frame`` runs inside a ``__del__`` (the garbage collector can run one between any two
    bytecodes). An exception raised there never reaches the interrupted code: Python prints it as
    "Exception ignored in ..." and goes on."""
    while frame is not None:
        if frame.f_code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


@contextmanager
def interrupt_once() -> Iterator[None]:
    """Inside the block the first SIGINT or SIGTERM raises KeyboardInterrupt and every later one is
    ignored until the block ends, so the cleanup that handles the interruption (written inside the
    block, in an ``except KeyboardInterrupt``) cannot itself be cut short by a second Ctrl-C. A signal
    that lands while a finaliser runs is sent again just after it, so it is neither lost nor printed. After
    an interruption they stay ignored (the command is ending); otherwise the old handlers return.
    Outside the main thread (where signals cannot be handled) it changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    fired = []

    def first(signum, frame):
        if _in_finaliser(frame):  # raised here it would be printed as "Exception ignored" and lost
            redeliver = threading.Timer(REDELIVER_S, os.kill, (os.getpid(), signum))
            redeliver.daemon = True
            redeliver.start()
            return
        for sig in INTERRUPT_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        fired.append(signum)
        raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, first) for sig in INTERRUPT_SIGNALS}
    try:
        yield
    finally:
        if not fired:  # once interrupted the command is ending: a late signal (a search worker gets the
            # terminal's SIGINT and its parent's) must not raise KeyboardInterrupt in the exit's finalizers
            for sig, handler in previous.items():
                signal.signal(sig, handler)
