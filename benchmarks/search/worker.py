"""One search worker: run trials against the shared study until it holds its target of COMPLETE trials.

Each round of the loop reaps stale trials (failed and re-queued, ``benchmarks.search.storage``),
re-logs MLflow runs deferred by an outage, then runs one trial (``benchmarks.search.trial``).
A storage outage is waited out and the trial it interrupted re-queued; a trial another worker
failed as stale while it ran here is left to its retry; Ctrl-C re-queues the running trial.
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path

from benchmarks.cli import default_out_dir
from benchmarks.search.errors import SearchAborted, SearchInterrupted, SearchUsageError
from benchmarks.search.runs import process_name, runs_or_none, study_runs
from benchmarks.search.storage import (MAX_RETRY, is_requeued, open_storage, requeue, storage_down, storage_errors,
                                       wait_for_storage)
from benchmarks.search.study import make_sampler, stored_config, trial_counts
from benchmarks.search.trial import make_objective, trial_context
from benchmarks.tracking import describe_error


class StorageLost(BaseException):
    """Raised inside a trial when the storage fails, so Optuna neither records nor swallows the trial.

    A BaseException (not an Exception): ``study.optimize(catch=(Exception,))`` would otherwise turn it
    into an ordinary FAIL trial; the worker loop waits for the storage and re-queues the trial.
    """


def run_worker(storage, study_name: str, n_trials: int, *, worker: int = 0, tracking_uri=None, track: bool = True,
               heartbeat_interval: int = 5, grace_period: int = 30, poll: float = 1.0, storage_wait: float = 120.0,
               out: str | Path | None = None, ctx=None, device: str = "auto", log=print) -> int:
    """Run trials until the study holds ``n_trials`` COMPLETE ones; returns how many this worker ran.

    ``ctx``: the trial context of the study's configuration if the caller built it already (run_search does,
    to check the configuration), else built here (``search.trial.trial_context``).

    A storage outage: the worker retries with backoff for up to ``storage_wait`` s (then SearchAborted)
    and re-queues the trial it was running. Ctrl-C: the running trial FAILs, is re-queued and its
    MLflow run KILLED, then :class:`SearchInterrupted`.
    """
    import optuna

    optuna.logging.set_verbosity(optuna.logging.ERROR)  # failed trials are reported below, one line each
    if isinstance(storage, str):
        storage = open_storage(storage, heartbeat_interval=heartbeat_interval, grace_period=grace_period,
                               runs_for=lambda s: runs_or_none(s, tracking_uri, track, log), log=log)
    try:
        study = optuna.load_study(study_name=study_name, storage=storage)
    except KeyError:
        raise SearchUsageError(f"study {study_name!r} does not exist in the storage: create it first "
                               "(run without --attach, or with --create-only)") from None
    config = stored_config(study.user_attrs["config"])
    study.sampler = make_sampler(config, worker, len(study.get_trials(deepcopy=False)))
    runs = study_runs(study, tracking_uri=tracking_uri, track=track, log=log)
    out_dir = Path(out) if out is not None else default_out_dir(f"search-{study_name}")
    ctx = trial_context(config, device) if ctx is None else ctx
    who = process_name()
    study.set_user_attr(f"worker:{who}", time.time())  # who attached to the study, and when
    objective = make_objective(study, config, ctx, runs, n_trials=n_trials, worker=worker, who=who, out_dir=out_dir,
                               log=log)
    current: dict = {}

    def guarded(trial):
        current["trial"] = trial
        try:
            return objective(trial)
        except storage_errors() as err:
            if storage_down(study):
                raise StorageLost(describe_error(err)) from None
            raise

    return _run_trials(study, guarded, current, runs, n_trials, worker=worker, poll=poll, storage_wait=storage_wait,
                       log=log)


def _run_trials(study, objective, current: dict, runs, n_trials: int, *, worker: int, poll: float,
                storage_wait: float, log) -> int:
    """The worker loop: a step at a time until the target, outliving storage outages and stale verdicts.

    ``current["trial"]`` is the trial the objective is running. Returns how many trials this worker ran.
    """
    import optuna

    ran, failures, max_failures = 0, 0, 5
    while True:
        current.clear()
        try:
            if _worker_step(study, objective, n_trials, runs, poll):
                return ran
            ran += 1
            failures = failures + 1 if _last_failed(study, current) else 0
        except KeyboardInterrupt:
            raise _interrupted(study, current, runs, worker, log) from None
        except (StorageLost, Exception) as err:
            if _is_storage_failure(err, study):
                log(f"[search w{worker}] storage failed ({describe_error(err)}): waiting for it", file=sys.stderr)
                wait_for_storage(study, storage_wait, lambda *a: log(*a, file=sys.stderr))
                _abandon(study, current, runs, "FAILED", "the storage failed during the trial")
            elif current.get("trial") and _in_chain(err, (optuna.exceptions.UpdateFinishedTrialError,)):
                log(f"[search w{worker}] another worker failed trial {current['trial'].number} as stale (no heartbeat "
                    "within --grace-period) while it ran here; its retry redoes it", file=sys.stderr)
                _abandon(study, current, runs, "FAILED", "failed as stale while its worker was still running it")
                failures += 1
            else:
                raise
            continue
        if failures >= max_failures:
            raise SearchAborted(f"{failures} trials in a row failed in this worker; see the trials' 'error' attribute")


def _worker_step(study, objective, n_trials: int, runs, poll: float) -> bool:
    """One round of the worker loop: reap stale trials, re-log deferred MLflow runs, run one trial.

    Returns True when the study holds ``n_trials`` COMPLETE trials.
    """
    import optuna

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)
    if runs is not None:
        runs.relog_pending(study)
    c = trial_counts(study)
    if c["COMPLETE"] >= n_trials:
        return True
    if c["COMPLETE"] + c["RUNNING"] >= n_trials and not c["WAITING"]:
        time.sleep(poll)  # the others will finish the study (or go stale and be retried)
        return False
    # A setting that raises (e.g. a defence/attack combination a model does not support) is recorded
    # as a FAIL trial with its error and the worker goes on; many failures in a row stop the worker.
    study.optimize(objective, n_trials=1, catch=(Exception,), gc_after_trial=False)
    return False


def _last_failed(study, current: dict) -> bool:
    """Did the trial this step ran end FAIL?"""
    trial = current.get("trial")
    return trial is not None and study._storage.get_trial(trial._trial_id).state.name == "FAIL"


def _in_chain(err: BaseException, types: tuple) -> bool:
    """Is ``err``, or anything in its cause/context chain, one of ``types``?"""
    seen = err
    while seen is not None:
        if isinstance(seen, types):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _is_storage_failure(err: BaseException, study) -> bool:
    """Did ``err`` come from the storage (itself or anything in its chain), or is the storage down now?"""
    return _in_chain(err, (StorageLost, *storage_errors())) or storage_down(study)


def _abandon(study, current: dict, runs, status: str, reason: str, *, failed_here: bool = False) -> bool:
    """FAIL this worker's current trial if it is still RUNNING, re-queue it, mark its MLflow runs ``status``.

    ``failed_here``: a FAIL state found was set in this process (Optuna on Ctrl-C); otherwise it was another
    worker's reaper, which re-queues the trial itself. Returns whether it was re-queued here.
    """
    import optuna
    from optuna.trial import TrialState

    trial = current.get("trial")
    if trial is None:
        return False
    frozen = study._storage.get_trial(trial._trial_id)
    if frozen.state == TrialState.RUNNING:
        try:
            failed_here = bool(study._storage.set_trial_state_values(trial._trial_id, state=TrialState.FAIL))
        except optuna.exceptions.UpdateFinishedTrialError:
            failed_here = False  # another worker finished it first
        frozen = study._storage.get_trial(trial._trial_id)
    if frozen.state != TrialState.FAIL:
        return False  # it completed (or stood down) before the failure: nothing to redo
    if runs is not None:
        runs.terminate(frozen.number, status, reason)
    # A trial found FAIL was failed by another worker's reaper as stale (unless ``failed_here``: Optuna in
    # this process failed it, on Ctrl-C), and that reaper re-queues it (search.storage._stale_callback);
    # re-queuing it here as well raced with it (two retries of one trial).
    return requeue(study, frozen) if failed_here else False


def _interrupted(study, current: dict, runs, worker: int, log) -> SearchInterrupted:
    """Ctrl-C in a worker: re-queue the running trial; the message says what happened (and nothing more)."""
    trial = current.get("trial")
    try:
        queued = _abandon(study, current, runs, "KILLED", "interrupted (Ctrl-C)", failed_here=True)
    except Exception as err:  # noqa: BLE001 - the storage may be what we are interrupting
        return SearchInterrupted(f"worker {worker} interrupted; trial {trial.number if trial else '-'} could not "
                                 f"be re-queued ({describe_error(err)}): it goes stale and is retried after "
                                 "--grace-period")
    if trial is None:
        return SearchInterrupted(f"worker {worker} interrupted between trials")
    frozen = study._storage.get_trial(trial._trial_id)
    if frozen.state.name != "FAIL":
        return SearchInterrupted(f"worker {worker} interrupted after trial {trial.number} ended ({frozen.state.name})")
    if queued or is_requeued(study, trial.number):
        what = "re-queued for a rerun"
    elif not frozen.params:
        what = "not re-queued (it had drawn no parameters: nothing to redo)"
    else:
        what = f"not re-queued (its setting was already retried {MAX_RETRY} times)"
    return SearchInterrupted(f"worker {worker} interrupted: trial {trial.number} marked FAIL and {what}")
