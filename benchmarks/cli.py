"""One validation layer for every command line of sipit-bench (and the library calls behind them).

- :class:`UsageError`: a bad option or argument (a :class:`sipit.whitebox.SipitInputError`).
- Checkers (:func:`check_int`, :func:`check_float`, :func:`check_floats`, :func:`check_names`)
  validate a value for the library API and raise :class:`UsageError`; :func:`arg` turns any of
  them into an argparse ``type=`` function, so a flag and the keyword it feeds share one rule.
- :func:`run_main`: parse, run the command, and turn a bad-input error (ValueError, OSError,
  ImportError) into one line ``<prog>: error: ...`` on stderr with exit code 2 instead of a
  traceback (``SIPIT_TRACEBACK=1`` shows the traceback).
- :func:`default_out_dir`: where every command writes without ``--out``.
- :func:`shielded`: SIGINT/SIGTERM held off while an interrupted command cleans up.
"""

from __future__ import annotations

import os
from pathlib import Path

from sipit.whitebox import SipitInputError

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_ENV = "SIPIT_RESULTS_DIR"


class UsageError(SipitInputError):
    """A bad option or argument, reported as one line before any heavy work."""


def default_out_dir(command_name: str) -> Path:
    """``<results>/<command_name>``: the folder a command writes to when ``--out`` is not given.

    ``<results>`` is ``$SIPIT_RESULTS_DIR`` if set, else the repository's ``results/`` (git-ignored),
    whatever the current directory is.
    """
    root = os.environ.get(RESULTS_ENV)
    return (Path(root).expanduser() if root else REPO_ROOT / "results") / command_name
