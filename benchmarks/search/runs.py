"""The MLflow side of the search's trials: one nested run per trial, never fatal to the trial.

Each trial's run is a child of the study's parent run, tagged ``trial=<number>``, so any process
can find it by its tags, whether or not the worker that created it lived long enough to link it
(the ``mlflow_run_id`` user attribute): the worker that reaps a stale trial terminates its runs
that way (:meth:`TrialRuns.terminate`).

The measurement lives in Optuna (user attributes) and in ``<out>/trials/trial-<n>.json``; MLflow
gets a copy. When the tracking server cannot be reached, the trial goes on, is marked
``mlflow_pending`` and is logged later by :meth:`TrialRuns.relog_pending` (each worker before each
trial, and the report step) once the server answers again: its run (found by tags, or a new one)
gets the metrics from the trial's user attributes and ends FINISHED with a ``relogged`` tag.

The study names its parent run in the user attribute ``mlflow_parent_run_id`` (``PARENT_ATTR``);
:func:`study_runs` gives any process the study's :class:`TrialRuns`. A study that ran untracked
(``--no-tracking``) reaches MLflow when its report is written with tracking on (:func:`imported_runs`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import socket
import time
from pathlib import Path

from benchmarks.tracking import Tracker, check_store, describe_error
from sipit.atomic import write_text_atomic

PARENT_ATTR = "mlflow_parent_run_id"
PENDING_ATTR = "mlflow_pending"
RUN_ATTR = "mlflow_run_id"
METRIC_KEYS = ("utility_loss", "ppl_rel_increase", "top1_agreement", "state_rel_l2", "recovery", "recovery_upper95",
               "recovery_excess_upper95", "n_tokens", "seconds")
TERMINAL = ("FINISHED", "FAILED", "KILLED")


def with_retries(fn, attempts: int = 3):
    """An sqlite tracking store can be locked for a moment by another worker: retry a few times."""
    for i in range(attempts):
        try:
            return fn()
        except Exception:  # noqa: BLE001
            if i == attempts - 1:
                raise
            time.sleep(0.5 * (i + 1))


def trial_metrics(user_attrs: dict) -> dict:
    """The MLflow metrics of a measured trial, from its Optuna user attributes (so a re-log matches)."""
    metrics = {k: user_attrs[k] for k in METRIC_KEYS if user_attrs.get(k) is not None}
    metrics.update({f"{a}.token_accuracy": v["token_accuracy"] for a, v in user_attrs.get("attacks", {}).items()})
    # each use's loss (a use the setting cannot serve costs +inf: no metric, as for the study's own use)
    metrics.update({f"utility.{use}.loss": loss for use, loss in user_attrs.get("utility_losses", {}).items()
                    if math.isfinite(loss)})
    if "constraint.recovery" in user_attrs:
        metrics["constraint.recovery"] = user_attrs["constraint.recovery"]
        metrics["feasible"] = float(user_attrs["constraint.recovery"] <= 0)
    return metrics


def write_trial_file(out_dir: Path, number: int, params: dict, user_attrs: dict) -> Path:
    """``<out>/trials/trial-<n>.json``: the trial's parameters and measurement, beside Optuna's copy."""
    path = Path(out_dir) / "trials" / f"trial-{number:04d}.json"
    write_text_atomic(path, json.dumps({"trial": number, "params": params, "user_attrs": user_attrs}, indent=2,
                                       default=str))
    return path


class TrialRuns:
    """Nested MLflow runs of one study's trials, written through ``tracker`` (a benchmarks.tracking.Tracker)."""

    def __init__(self, tracker, study_name: str, who: str, log=print):
        self.tracker, self.study_name, self.who, self.log = tracker, study_name, who, log
        self.parent_id = tracker.parent_id
        # sqlite stores are briefly locked by other workers; a server retries on its own (bounded in tracking.py)
        self.attempts = 3 if tracker.uri.startswith("sqlite:") else 1
        self._relogged: set[int] = set()  # trials this process has seen FINISHED in MLflow

    # ------------------------------------------------------------------ one trial, as it runs
    def start(self, trial, family: str) -> bool:
        """Create the trial's run (tags first, link second); False (and ``mlflow_pending``) if MLflow failed."""
        try:
            run_id = with_retries(lambda: self._create(trial.number, family), self.attempts)
            trial.set_user_attr(RUN_ATTR, run_id)
            with_retries(lambda: self.tracker.log_params(run_id, {"trial": trial.number, **trial.params}), self.attempts)
            return True
        except Exception as err:  # noqa: BLE001 - MLflow down: the trial goes on
            self._defer(trial, err)
            return False

    def finish(self, trial) -> bool:
        """Log the trial's metrics (from its user attributes) and mark its run FINISHED."""
        try:
            run_id = trial.user_attrs[RUN_ATTR]
            with_retries(lambda: self.tracker.log_metrics(run_id, trial_metrics(trial.user_attrs)), self.attempts)
            with_retries(lambda: self.tracker.client.set_terminated(run_id, status="FINISHED"), self.attempts)
            return True
        except Exception as err:  # noqa: BLE001
            self._defer(trial, err)
            return False

    def _create(self, number: int, family: str) -> str:
        tags = {"mlflow.parentRunId": self.parent_id, "trial": str(number), "study": self.study_name,
                "family": family, "worker": self.who}
        return self.tracker.client.create_run(self.tracker.experiment_id, run_name=f"trial-{number}",
                                              tags=tags).info.run_id

    def _defer(self, trial, err: Exception) -> None:
        trial.set_user_attr(PENDING_ATTR, True)
        self.log(f"[search] MLflow failed during trial {trial.number} ({describe_error(err)}): the result stays in "
                 "Optuna and the results folder and is logged to MLflow when the server answers again")

    # ------------------------------------------------------------------ by tags, from any process
    def runs_of(self, number: int) -> list:
        """The runs of trial ``number`` under this study's parent run, whoever created them."""
        return self.tracker.client.search_runs(
            [self.tracker.experiment_id],
            f"tags.mlflow.parentRunId = '{self.parent_id}' and tags.trial = '{number}'")

    def terminate(self, number: int, status: str, reason: str) -> None:
        """Mark every run of trial ``number`` ``status`` (FAILED/KILLED), linked or not. Best effort."""
        try:
            for run in self.runs_of(number):
                if run.info.status != status:
                    self.tracker.set_tag(run.info.run_id, "failure", reason)
                    self.tracker.client.set_terminated(run.info.run_id, status=status)
        except Exception as err:  # noqa: BLE001 - tracking down: the trial's state is in Optuna
            self.log(f"[search] could not mark the MLflow run of trial {number} {status}: {describe_error(err)}")

    def relog_pending(self, study) -> int:
        """Log every COMPLETE trial marked ``mlflow_pending`` whose run is not FINISHED yet; returns how many.

        Whether a trial is still pending is read from MLflow (its run's status), since Optuna forbids
        changing a finished trial's attributes.
        """
        from optuna.trial import TrialState

        pending = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                   if t.user_attrs.get(PENDING_ATTR) and t.number not in self._relogged]
        if not pending:
            return 0
        try:
            check_store(self.tracker.uri, timeout=2.0)
        except Exception:  # noqa: BLE001 - still down: try again later
            return 0
        done = 0
        for t in pending:
            try:
                logged = self.relog(t)
            except Exception as err:  # noqa: BLE001
                self.log(f"[search] re-logging trial {t.number} to MLflow failed: {describe_error(err)}")
                break
            self._relogged.add(t.number)
            done += logged
        return done

    def relog(self, trial, why: str = "logged after MLflow was unreachable during the trial") -> bool:
        """The trial's run (its existing one, else a new one) with params and metrics, FINISHED, tagged
        ``relogged`` = ``why``.

        Returns False when a FINISHED run was already there (another process re-logged it).
        """
        runs = self.runs_of(trial.number)
        if any(r.info.status == "FINISHED" for r in runs):
            return False
        run_id = runs[0].info.run_id if runs else self._create(trial.number, trial.user_attrs.get("family", ""))
        if not runs:
            self.tracker.log_params(run_id, {"trial": trial.number, **trial.params})
        self.tracker.log_metrics(run_id, trial_metrics(trial.user_attrs))
        self.tracker.set_tag(run_id, "relogged", why)
        self.tracker.client.set_terminated(run_id, status="FINISHED")
        return True


def process_name() -> str:
    """``host:pid`` of this process: the worker that creates a run or attaches to a study."""
    return f"{socket.gethostname()}:{os.getpid()}"


_RUNS: dict = {}


def study_runs(study, *, tracking_uri=None, track: bool = True, log=print) -> TrialRuns | None:
    """The study's :class:`TrialRuns` in this process (one per tracking URI and parent run), or None untracked."""
    parent = study.user_attrs.get(PARENT_ATTR)
    if not track or not parent:
        return None
    uri = tracking_uri or study.user_attrs.get("tracking_uri")
    if (uri, parent) not in _RUNS:
        tracker = Tracker(uri, study.user_attrs["config"]["experiment"])
        tracker.parent_id = parent
        _RUNS[uri, parent] = TrialRuns(tracker, study.study_name, process_name(), log)
    return _RUNS[uri, parent]


def config_sha(config: dict) -> str:
    """The first 12 hex digits of sha256 over the configuration as sorted JSON: the study's identity in MLflow."""
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:12]


#: the ``kind`` tag of a study's parent run
STUDY_KIND = "optuna-search"


def start_study_run(tracker: Tracker, study_name: str, config: dict, *, params: dict | None = None,
                    tags: dict | None = None) -> str:
    """The study's MLflow parent run ``search-<study>``: the configuration (and ``params``) as parameters,
    tagged with the study's name, :func:`config_sha` and ``kind`` (and ``tags``), so :func:`find_study_run`
    finds it again."""
    return tracker.start_parent(f"search-{study_name}", {"config": config, **(params or {})},
                                {"study": study_name, "config_sha": config_sha(config), "kind": STUDY_KIND,
                                 **(tags or {})})


def discard_study_run(tracker: Tracker, run_id: str, kept: str) -> None:
    """Mark a parent run that lost the race to be the study's FAILED (saying which run is) and delete it."""
    tracker.set_tag(run_id, "failure", f"another command created the study's parent run first: {kept}")
    tracker.client.set_terminated(run_id, status="FAILED")
    tracker.client.delete_run(run_id)


def find_study_run(tracker: Tracker, study_name: str, config: dict) -> str | None:
    """The id of the parent run :func:`start_study_run` made for this study and configuration, or None.

    The filter names only the hash (a study name may hold quotes); the name is compared here."""
    found = tracker.client.search_runs([tracker.experiment_id],
                                       f"tags.config_sha = '{config_sha(config)}' and tags.kind = '{STUDY_KIND}'")
    return next((r.info.run_id for r in found if r.data.tags.get("study") == study_name), None)


def imported_runs(study, *, tracking_uri=None, log=print) -> TrialRuns:
    """MLflow runs for a study that ran untracked (``--no-tracking``), made when its report is written.

    The parent run is tagged with the study's name and :func:`config_sha`; a later report finds it
    again (:func:`find_study_run`) instead of making a second one. Every COMPLETE trial without a
    FINISHED run gets one, with its parameters and metrics (:func:`trial_metrics`, as a tracked trial
    would have). The study's storage is not written, so a journal kept in the repository names no
    one's MLflow store.
    """
    from optuna.trial import TrialState

    config = study.user_attrs["config"]
    tracker = Tracker(tracking_uri, config["experiment"])
    tracker.parent_id = find_study_run(tracker, study.study_name, config) or start_study_run(
        tracker, study.study_name, config,
        tags={"imported": "the study ran untracked; its runs were made from its storage"})
    runs = TrialRuns(tracker, study.study_name, process_name(), log)
    done = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if "recovery" in t.user_attrs]
    made = sum(runs.relog(t, "made from the study's storage when its report was written") for t in done)
    log(f"[search] MLflow {tracker.uri}: parent run {tracker.parent_id} of study {study.study_name!r}, "
        f"{made} trial run(s) made now, {len(done) - made} there already")
    return runs


def runs_or_none(study, tracking_uri, track, log):
    """:func:`study_runs`, or None when the tracking store cannot be opened (the stale trial is still retried)."""
    try:
        return study_runs(study, tracking_uri=tracking_uri, track=track, log=log)
    except Exception:  # noqa: BLE001
        return None
