"""The search's Optuna storage: heartbeats, stale-trial retry, and waiting out an outage.

A path (``*.journal``/``*.log`` or ``journal:PATH``) is an Optuna JournalStorage file (one
machine); a URL (``postgresql://...``, ``sqlite:///...``) is an RDBStorage (many machines).
RDBStorage has heartbeats built in (``ResilientRDBStorage`` keeps them beating through a database
outage); Optuna 5.1's JournalStorage does not, so ``HeartbeatJournalStorage`` adds them. A trial
whose heartbeat is older than the grace period is failed by any worker, its MLflow runs are marked
FAILED and its parameters re-queued (:func:`requeue`).

A journal file is checked before it is opened (:func:`check_journal`): a torn last record (a crash or a
full disk during an append) is moved aside, other damage refused, so no append lands on a partial line.
Both storages set a study user attribute first-writer-wins (``set_study_user_attr_once``), so commands
that create the same study at once agree on one configuration and one MLflow parent run.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time
import warnings
from pathlib import Path

from benchmarks.search.errors import SearchAborted, SearchUsageError
from benchmarks.tracking import describe_error, redact

STORAGE_ENV = "SIPIT_SEARCH_STORAGE"
MAX_RETRY = 3


def storage_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean "the storage is unreachable" (database down, connection dropped, file gone)."""
    import optuna
    import sqlalchemy.exc

    return (optuna.exceptions.StorageInternalError, sqlalchemy.exc.DBAPIError, sqlalchemy.exc.InterfaceError,
            sqlalchemy.exc.TimeoutError, OSError)


def _heartbeat_journal_class():
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages._heartbeat import BaseHeartbeat
    from optuna.trial import TrialState

    class HeartbeatJournalStorage(JournalStorage, BaseHeartbeat):
        """JournalStorage plus heartbeats: a running trial's ``heartbeat`` system attribute (unix time).

        A RUNNING trial is stale when max(heartbeat, start time) is older than ``grace_period``.
        """

        def __init__(self, backend, *, heartbeat_interval: int, grace_period: int, callback=None):
            super().__init__(backend)
            self._hb_interval, self._grace, self._callback = heartbeat_interval, grace_period, callback

        def record_heartbeat(self, trial_id: int) -> None:
            try:
                self.set_trial_system_attr(trial_id, "heartbeat", time.time())
            except optuna.exceptions.UpdateFinishedTrialError:
                pass

        def _get_stale_trial_ids(self, study_id: int) -> list[int]:
            now = time.time()
            stale = []
            for t in self.get_all_trials(study_id, deepcopy=False, states=(TrialState.RUNNING,)):
                started = t.datetime_start.timestamp() if t.datetime_start else now
                last = max(float(t.system_attrs.get("heartbeat", 0.0)), started)
                if now - last > self._grace:
                    stale.append(t._trial_id)
            return stale

        def get_heartbeat_interval(self) -> int | None:
            return self._hb_interval

        def get_heartbeat_stale_trial_callback(self):
            return self._callback

        def set_study_user_attr_once(self, study_id: int, key: str, make):
            """The study's user attribute ``key``, set to ``make()`` first if it is absent: a compare-and-set
            under an exclusive ``flock`` of the journal file (released when the process ends, however it
            ends; Optuna's appends take their own lock, so setting the attribute here does not wait for it)."""
            import fcntl

            with open(self._backend._file_path, "rb") as handle:
                fcntl.flock(handle, fcntl.LOCK_EX)
                if key not in self.get_study_user_attrs(study_id):
                    self.set_study_user_attr(study_id, key, make())
                return self.get_study_user_attrs(study_id)[key]

    return HeartbeatJournalStorage


def _resilient_rdb_class():
    from optuna.storages import RDBStorage

    class ResilientRDBStorage(RDBStorage):
        """RDBStorage whose heartbeat thread outlives a database outage, and whose orphans go stale.

        Optuna's heartbeat thread dies at the first failed write, and the trial then goes stale while
        its worker is still computing; here a failed beat is skipped and the next one tries again.
        A worker that loses the database between creating a trial and its first beat leaves a RUNNING
        trial with no heartbeat row, which Optuna never fails, so every worker then waits for it
        forever; such a trial is stale once it started more than two grace periods ago (by the
        workers' clocks, as the journal storage's heartbeats are).
        """

        def record_heartbeat(self, trial_id: int) -> None:
            try:
                super().record_heartbeat(trial_id)
            except storage_errors():
                pass

        def _get_stale_trial_ids(self, study_id: int) -> list[int]:
            from datetime import datetime, timedelta, timezone

            from optuna.storages._rdb import models
            from optuna.storages._rdb.storage import _create_scoped_session
            from optuna.trial import TrialState

            stale = super()._get_stale_trial_ids(study_id)
            # Optuna 5 stores trial datetimes as naive UTC (the column behind TrialModel.datetime_start)
            cutoff = datetime.now(timezone.utc).replace(tzinfo=None) - timedelta(seconds=2 * self.grace_period)
            with _create_scoped_session(self.scoped_session) as session:
                orphans = (session.query(models.TrialModel.trial_id)
                           .outerjoin(models.TrialHeartbeatModel,
                                      models.TrialHeartbeatModel.trial_id == models.TrialModel.trial_id)
                           .filter(models.TrialModel.study_id == study_id,
                                   models.TrialModel.state == TrialState.RUNNING,
                                   models.TrialHeartbeatModel.trial_heartbeat_id.is_(None),
                                   models.TrialModel._datetime_start_utc < cutoff)
                           .all())
            return stale + [trial_id for (trial_id,) in orphans if trial_id not in stale]

        def set_study_user_attr_once(self, study_id: int, key: str, make):
            """The study's user attribute ``key``, set to ``make()`` first if it is absent. The insert is the
            compare-and-set: the table's unique (study, key) constraint fails a second one (ignored here), so
            two processes that both found the attribute absent, and both made a value, return the first one
            stored; a caller whose value lost undoes what ``make`` did."""
            from optuna.storages._rdb import models
            from optuna.storages._rdb.storage import _create_scoped_session

            if key not in self.get_study_user_attrs(study_id):
                value = json.dumps(make())
                with _create_scoped_session(self.scoped_session, ignore_integrity_error=True) as session:
                    session.add(models.StudyUserAttributeModel(study_id=study_id, key=key, value_json=value))
            return self.get_study_user_attrs(study_id)[key]

    return ResilientRDBStorage


def requeue(study, trial, max_retry: int = MAX_RETRY) -> bool:
    """Queue a WAITING trial with the failed ``trial``'s parameters, so a worker (or a rerun) redoes it.

    Unlike Optuna's RetryHeartbeatStaleTrialCallback, the copy inherits no user attributes (they
    name the dead trial's MLflow run and measurement), nothing is queued for a trial that had drawn
    no parameters yet (a fresh trial is the same thing), and a trial is queued at most once.
    Returns whether a trial was queued.
    """
    import optuna
    from optuna.trial import TrialState

    history = [*trial.system_attrs.get("retry_history", []), trial.number]
    if not trial.params or len(history) > max_retry:
        return False
    if is_requeued(study, trial.number):
        return False
    study.add_trial(optuna.trial.create_trial(state=TrialState.WAITING, params=trial.params,
                                              distributions=trial.distributions,
                                              system_attrs={"failed_trial": history[0], "retry_history": history}))
    return True


def is_requeued(study, number: int) -> bool:
    """Has trial ``number`` been re-queued already (a trial whose retry history ends with it)?"""
    return any((t.system_attrs.get("retry_history") or [None])[-1] == number for t in study.get_trials(deepcopy=False))


def _stale_callback(runs_for):
    """Fail the stale trial's MLflow runs (found by tag: linked or not), then re-queue its parameters."""

    def callback(study, trial):
        runs = runs_for(study)
        if runs is not None:
            runs.terminate(trial.number, "FAILED", f"worker {trial.user_attrs.get('worker', '?')} stopped "
                                                   "(stale heartbeat)")
        requeue(study, trial)

    return callback


def open_storage(storage: str, *, heartbeat_interval: int = 5, grace_period: int = 30, runs_for=lambda study: None,
                 must_exist: bool = False, log=print):
    """An Optuna storage with heartbeats and stale-trial retry, from a path or URL.

    ``runs_for(study)`` gives the study's :class:`TrialRuns` (or None) for the stale-trial callback.
    ``must_exist``: a journal file that is not there is a usage error (attaching to a study or
    reporting on one), not a new empty journal. A journal file is checked first (:func:`check_journal`,
    whose warning goes to ``log``).
    """
    import optuna

    if not storage:
        raise SearchUsageError(f"--storage is required (a journal file path or a database URL; or set ${STORAGE_ENV})")
    if heartbeat_interval < 1 or grace_period <= heartbeat_interval:
        raise SearchUsageError(f"need 1 <= --heartbeat-interval < --grace-period, got {heartbeat_interval}, {grace_period}")
    callback = _stale_callback(runs_for)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        if "://" in storage:
            try:
                return _resilient_rdb_class()(storage, heartbeat_interval=heartbeat_interval,
                                              grace_period=grace_period, heartbeat_stale_trial_callback=callback,
                                              engine_kwargs={"pool_pre_ping": True})
            except Exception as err:  # noqa: BLE001 - driver missing, host unreachable, bad URL
                raise SearchUsageError(f"--storage {redact(storage)!r}: cannot open database: "
                                       f"{describe_error(err)}") from None
        path = Path(storage[len("journal:"):] if storage.startswith("journal:") else storage)
        if not path.parent.exists():
            raise SearchUsageError(f"--storage {storage!r}: folder {path.parent} does not exist")
        if must_exist and not path.exists():
            raise SearchUsageError(f"--storage {storage!r}: no journal file there, so no study to attach to or "
                                   "report on: create the study first (without --attach or --report-only)")
        if path.exists():
            check_journal(path, log)
        from optuna.storages.journal import JournalFileBackend

        return _heartbeat_journal_class()(JournalFileBackend(str(path)), heartbeat_interval=heartbeat_interval,
                                          grace_period=grace_period, callback=callback)


def check_journal(path: Path, log=print) -> None:
    """Leave the journal file at ``path`` safe to open and append to; SearchUsageError if it cannot be.

    Optuna's reader skips a last line that is torn (no newline, or not a JSON record: what a crash or a
    full disk during an append leaves), and its next append goes straight onto it, after which nothing
    can read the journal. A torn last line is moved to ``<path>.torn-<time>``, the complete records
    before it are kept and ``log`` gets one warning line. An invalid line with records after it is no
    torn append: SearchUsageError naming the file and the line, the file left as it is. The repair
    holds the journal's own lock (Optuna's JournalFileSymlinkLock, which every append takes), so it
    never races a live writer; a lock left by a dead writer is broken after Optuna's grace period, as
    that writer's next append would break it.
    """
    from optuna.storages.journal import JournalFileSymlinkLock

    if _journal_damage(path) is None:  # the usual case, without waiting for the lock
        return
    lock = JournalFileSymlinkLock(str(path))
    lock.acquire()
    try:
        damage = _journal_damage(path)  # again, now that no append can be under way
        if damage is not None:
            _move_torn_tail(path, *damage, log)
    finally:
        lock.release()


def _journal_damage(path: Path) -> tuple[bytes, int, int] | None:
    """``(content, number, offset)`` of the journal's first line (1-based, byte offset) that is not a JSON
    record ending in a newline, or None when every line is one."""
    data = path.read_bytes()
    offset = 0
    for number, line in enumerate(data.split(b"\n"), start=1):
        complete = offset + len(line) < len(data)  # a newline follows
        if (line or complete) and not (complete and _is_record(line)):
            return data, number, offset
        offset += len(line) + 1
    return None


def _is_record(line: bytes) -> bool:
    """Is ``line`` one of Optuna's journal records (a JSON object with an ``op_code``)?"""
    try:
        record = json.loads(line)
    except ValueError:
        return False
    return isinstance(record, dict) and "op_code" in record


def _move_torn_tail(path: Path, data: bytes, number: int, offset: int, log) -> None:
    """Cut the journal at ``offset``, the start of its bad line ``number``, once the bytes from there are
    safe in a new ``<path>.torn-<time>`` file; SearchUsageError, and nothing changed, if line ``number``
    is not the last one."""
    if data.find(b"\n", offset) not in (-1, len(data) - 1):
        raise SearchUsageError(f"journal file {path} is damaged at line {number} (not a JSON journal record, and "
                               "records follow it): nothing was written to it; restore it from a backup, or keep "
                               f"its first {number - 1} lines in a new file and give that to --storage")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in itertools.count():
        backup = Path(f"{path}.torn-{stamp}{f'-{n}' if n else ''}")
        try:
            with open(backup, "xb") as handle:
                handle.write(data[offset:])
                handle.flush()
                os.fsync(handle.fileno())
            break
        except FileExistsError:
            continue
    with open(path, "r+b") as handle:
        handle.truncate(offset)
        os.fsync(handle.fileno())
    log(f"[search] warning: journal file {path} ended in a torn record (a crash or a full disk during a write): "
        f"its last {len(data) - offset} bytes were moved to {backup}; the {number - 1} complete records before "
        "them are kept", file=sys.stderr)


def storage_down(study) -> bool:
    """Does the storage fail a cheap read right now?"""
    try:
        study._storage.get_study_id_from_name(study.study_name)
        return False
    except storage_errors():
        return True


def wait_for_storage(study, max_wait: float, log) -> None:
    """Retry a cheap read with backoff (1, 2, 4 ... 15 s) until the storage answers; SearchAborted after ``max_wait`` s."""
    deadline, delay = time.monotonic() + max_wait, 1.0
    while True:
        try:
            study._storage.get_study_id_from_name(study.study_name)
            return
        except storage_errors() as err:
            if time.monotonic() + delay > deadline:
                raise SearchAborted(f"the storage did not answer for {max_wait:.0f}s ({describe_error(err)}): "
                                    "stopping; completed trials are kept, rerun the same command to resume") from None
            log(f"[search] storage unreachable ({describe_error(err)}); retrying in {delay:.0f}s")
            time.sleep(delay)
            delay = min(2 * delay, 15.0)

