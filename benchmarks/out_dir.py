"""A command's results folder, claimed before any work: writable, and written by one run at a time.

:func:`claim` is the first thing a command does with ``--out``. It refuses an empty path, creates the
folder, proves it writable (a file created and removed), and takes an exclusive lock on
``<out>/.sipit-lock`` (``fcntl.flock``) that the command holds until it ends. A second command
started on the same folder while the first runs is refused at once with who holds it, instead of
overwriting its results; the operating system drops the lock when its holder dies (even by
SIGKILL), so a folder is never locked by a dead process.

The lock file also keeps a small record of its holder (pid, host, command, start time, and the
MLflow run it opened). The next command that claims the folder reads the previous holder's record
(:attr:`OutDir.previous`): a run killed outright left its MLflow run RUNNING, and the next run in the
same folder closes it (benchmarks.tracking.Tracker.close_orphan).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.cli import UsageError

LOCK_NAME = ".sipit-lock"


@dataclass
class OutDir:
    """A claimed results folder (:func:`claim`): its path, the lock it holds, the previous holder's record."""

    path: Path
    handle: object = field(repr=False)
    previous: dict = field(default_factory=dict)
    record: dict = field(default_factory=dict)

    def note(self, **fields) -> None:
        """Add ``fields`` to this holder's record in the lock file (e.g. the MLflow run it opened)."""
        self.record.update(fields)
        self.handle.seek(0)
        self.handle.truncate()
        self.handle.write(json.dumps(self.record))
        self.handle.flush()

    def release(self) -> None:
        """Drop the lock (the record stays for the next holder)."""
        if not self.handle.closed:
            fcntl.flock(self.handle, fcntl.LOCK_UN)
            self.handle.close()

    def __enter__(self) -> "OutDir":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def check_provenance(path: str | Path, flag: str = "--out") -> None:
    """Results written under the repository's ``docs/`` are the ones the docs cite: they must come from a
    clean commit (benchmarks.tracking.git_commit without ``+dirty``), or :class:`UsageError`."""
    from benchmarks.tracking import REPO_ROOT, git_commit

    docs = (REPO_ROOT / "docs").resolve()
    target = Path(path).expanduser().resolve()
    if target == docs or docs in target.parents:
        commit = git_commit()
        if commit.endswith("+dirty") or commit == "unknown":
            raise UsageError(f"{flag} {str(path)!r} is under docs/, whose results the docs cite, and the code is "
                             f"{commit}: commit first (results there come from a clean commit), or write elsewhere")


def claim(path: str | Path, flag: str = "--out") -> OutDir:
    """Claim ``path`` as this command's results folder (module docstring); :class:`UsageError` names
    ``flag`` when it is empty, under ``docs/`` while the tree is dirty (:func:`check_provenance`), cannot
    be created or written, or another running command holds it."""
    if not str(path).strip():
        raise UsageError(f"{flag} is empty: name a folder for the results")
    check_provenance(path, flag)
    path = Path(path).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".sipit-write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
        handle = open(path / LOCK_NAME, "a+")
    except OSError as err:
        raise UsageError(f"{flag} {str(path)!r} cannot be written: {err.strerror or err}") from None
    handle.seek(0)
    try:
        previous = json.loads(handle.read() or "{}")
    except ValueError:
        previous = {}
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        who = (f"pid {previous.get('pid')} on {previous.get('host')}, started "
               f"{previous.get('started', '?')}: {previous.get('command', '?')}") if previous else "another process"
        raise UsageError(f"{flag} {str(path)!r} is in use by another run ({who}); wait for it to end or give "
                         f"another {flag}") from None
    out = OutDir(path, handle, previous if isinstance(previous, dict) else {})
    out.note(pid=os.getpid(), host=socket.gethostname(), started=time.strftime("%Y-%m-%d %H:%M:%S"),
             command=" ".join(sys.argv)[:300])
    return out
