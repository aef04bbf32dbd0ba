"""How the search stops short: bad input, an abort that a rerun resumes, Ctrl-C."""

from __future__ import annotations


class SearchUsageError(ValueError):
    """Bad options, reported before any heavy work."""


class SearchAborted(RuntimeError):
    """The search stopped before its target (a worker died, the storage stayed down): a rerun resumes it."""


class SearchInterrupted(KeyboardInterrupt):
    """Ctrl-C: the interrupted trials were re-queued; the message says what was done."""
