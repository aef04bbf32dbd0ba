"""benchmarks.search: distributed Optuna study on a tiny model, crash + resume, constraint, bad inputs."""

from __future__ import annotations

import csv
import json
import math
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

from benchmarks import search
from benchmarks.search import SearchUsageError, run_search

REPO = Path(__file__).resolve().parent.parent
# tiny-llama: bnb 4-bit linears with a bias (GPT-2) break the gradient ranking (in-place bias add), see docs/search.md
FAST = dict(model="tiny-llama", layer=-1, families="noise,quant", n_prompts=1, length=4, utility_tokens=32,
            attacks="sipit", sigma_low=0.05, sigma_high=20.0, threshold=0.3, bound="point",
            budget={"k_prior": 8, "k_grad": 8, "pooled_beam": 2, "pooled_topk": 16, "head_tokens": 256, "head_epochs": 2},
            robust="radius")  # plumbing tests: MAP's noise-adapted heads cost ~1 min per noise level on tiny models


def _trials(storage: str, study: str):
    return optuna.load_study(study_name=study, storage=search.open_storage(storage)).get_trials(deepcopy=False)


@pytest.fixture(scope="module")
def two_worker_study(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("search2w")
    storage, uri = str(tmp / "study.journal"), f"sqlite:///{tmp / 'mlflow.db'}"
    result = run_search(storage, "two", 6, workers=2, tracking_uri=uri, out=tmp / "out", log=lambda *a, **k: None, **FAST)
    return result, storage, uri, tmp


def test_two_workers_record_every_trial_once_with_nested_mlflow_runs(two_worker_study):
    result, storage, uri, _ = two_worker_study
    trials = _trials(storage, "two")
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    assert len(complete) == 6  # the target, no overshoot (a late duplicate stands down as PRUNED)
    assert all(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in trials)
    assert len({t.number for t in trials}) == len(trials)
    study = optuna.load_study(study_name="two", storage=search.open_storage(storage))
    attached = {k.removeprefix("worker:") for k in study.user_attrs if k.startswith("worker:")}
    assert len(attached) == 2  # two worker processes worked on the one journal file
    assert {t.user_attrs["worker"] for t in complete} <= attached
    parent_id = study.user_attrs[search.PARENT_ATTR]
    client = MlflowClient(tracking_uri=uri)
    parent = client.get_run(parent_id)
    assert parent.info.status == "FINISHED"
    children = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent_id}'")
    by_trial = {int(r.data.tags["trial"]): r for r in children}
    assert set(by_trial) == {t.number for t in complete}  # one nested run per completed trial, none missing
    for t in complete:
        run = by_trial[t.number]
        assert run.info.run_id == t.user_attrs["mlflow_run_id"]
        assert run.info.status == "FINISHED"
        assert math.isclose(run.data.metrics["recovery"], t.user_attrs["recovery"])
        assert math.isclose(run.data.metrics["constraint.recovery"], t.user_attrs["constraint.recovery"])
        for use, loss in t.user_attrs["utility_losses"].items():  # every use priced, finite ones logged
            assert math.isclose(run.data.metrics[f"utility.{use}.loss"], loss) if math.isfinite(loss) else \
                f"utility.{use}.loss" not in run.data.metrics
    artifacts = {a.path for a in client.list_artifacts(parent_id)}
    assert {"report.json", "report.md", "pareto.png", "pareto_uses.png", "search_best_and_pareto.json"} <= artifacts


def test_constraint_respected_by_reported_best(two_worker_study):
    result, storage, _, tmp = two_worker_study
    report = result["report"]
    trials = [t for t in _trials(storage, "two") if t.state == TrialState.COMPLETE]
    for t in trials:  # the constraint reached Optuna (system attr) and the user attrs (MLflow)
        excess = t.user_attrs["recovery"] - FAST["threshold"]
        assert math.isclose(t.constraints["recovery"], excess)
        assert math.isclose(t.user_attrs["constraint.recovery"], excess)
    feasible = [t for t in trials if t.user_attrs["recovery"] <= FAST["threshold"]]
    assert feasible, "sigma up to 20 x RMS should push recovery under 0.3 on tiny-gpt2"
    best = report["best"]
    assert best["recovery"] <= FAST["threshold"]
    assert math.isclose(best["utility_loss"], min(t.user_attrs["utility_loss"] for t in feasible))
    for group in report["groups"].values():
        assert group["best"] is None or group["best"]["recovery"] <= FAST["threshold"]
    assert (tmp / "out" / "report.md").read_text().startswith("# Search two")


def test_killed_worker_loses_nothing_and_study_resumes(tmp_path):
    storage, uri = str(tmp_path / "study.journal"), f"sqlite:///{tmp_path / 'mlflow.db'}"
    quiet = lambda *a, **k: None  # noqa: E731
    timing = dict(heartbeat_interval=1, grace_period=3)
    n = 8  # tiny trials take ~0.1 s: enough of them that one is caught running after another completed
    run_search(storage, "kill", n, create_only=True, tracking_uri=uri, log=quiet, **timing, **FAST)
    config = search.make_config(**{k: v for k, v in FAST.items()}, mode="constrained", seed=0, prompts="mixed",
                                tying_method="rare", experiment="sipit-search")
    cmd, env = search.worker_process("kill", n, config, worker_index=0, storage=storage, tracking_uri=uri, track=True,
                                     storage_wait=30, out=tmp_path / "out", **timing)
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            trials = _trials(storage, "kill")
            assert sum(t.state == TrialState.COMPLETE for t in trials) < n, "every trial finished before the kill"
            # kill only once the running trial has linked its MLflow run (set a moment after it starts); trials
            # are shorter than a poll can be trusted to see, so freeze the worker first and look again
            running = [t for t in trials if t.state == TrialState.RUNNING and "mlflow_run_id" in t.user_attrs]
            if any(t.state == TrialState.COMPLETE for t in trials) and running:
                os.kill(proc.pid, signal.SIGSTOP)
                if _trials(storage, "kill")[running[0].number].state == TrialState.RUNNING:
                    break
                os.kill(proc.pid, signal.SIGCONT)
            time.sleep(0.02)
        else:
            pytest.fail("worker never completed a trial and started the next one")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    before = _trials(storage, "kill")
    done_before = {t.number: t.user_attrs["recovery"] for t in before if t.state == TrialState.COMPLETE}
    killed = [t for t in before if t.state == TrialState.RUNNING]
    assert len(killed) == 1 and done_before
    result = run_search(storage, "kill", n, workers=1, tracking_uri=uri, out=tmp_path / "out", log=quiet, **timing, **FAST)
    after = _trials(storage, "kill")
    complete = [t for t in after if t.state == TrialState.COMPLETE]
    assert len(complete) == n and result["report"]["counts"]["COMPLETE"] == n
    for number, recovery in done_before.items():  # completed trials survived untouched
        assert after[number].state == TrialState.COMPLETE and after[number].user_attrs["recovery"] == recovery
    dead = after[killed[0].number]
    assert dead.state == TrialState.FAIL
    retried = [t for t in complete if t.system_attrs.get("failed_trial") == dead.number]
    assert len(retried) == 1 and retried[0].params == dead.params
    client = MlflowClient(tracking_uri=uri)
    assert client.get_run(dead.user_attrs["mlflow_run_id"]).info.status == "FAILED"


def test_pareto_mode_front_is_non_dominated(tmp_path):
    result = run_search(str(tmp_path / "p.journal"), "pareto", 4, mode="pareto", track=False, out=tmp_path / "out",
                        log=lambda *a, **k: None, **FAST)
    report = result["report"]
    front = report["pareto_front"]
    assert front
    for r in front:
        assert not any(o["utility_loss"] <= r["utility_loss"] and o["recovery"] <= r["recovery"]
                       and (o["utility_loss"], o["recovery"]) != (r["utility_loss"], r["recovery"])
                       for o in report["trials"])
    # one front per use from the same trials: each non-dominated under that use's loss, the study's own
    # use giving the study's front
    assert set(report["uses"]) == {"continued", "served", "embedding_store", "probing"}
    for use, u in report["uses"].items():
        points = [(t["utility_losses"][use], t["constrained"]) for t in report["trials"]
                  if math.isfinite(t["utility_losses"][use])]
        assert u["n_trials"] == len(points) and u["pareto_front"]
        for r in u["pareto_front"]:
            assert r["utility_loss"] == r["utility_losses"][use]
            assert not any(x <= r["utility_loss"] and y <= r["constrained"] and (x, y) != (r["utility_loss"], r["constrained"])
                           for x, y in points)
    assert [r["trial"] for r in report["uses"]["continued"]["pareto_front"]] == [r["trial"] for r in front]
    text = (tmp_path / "out" / "report.md").read_text()
    assert "## Per use of the states" in text and all(f"| {use} |" in text for use in report["uses"])
    assert (tmp_path / "out" / "pareto_uses.png").stat().st_size > 10_000


def test_a_study_that_ran_untracked_reaches_mlflow_when_its_report_is_written(tmp_path):
    """--no-tracking studies (the committed smollm2 journals) are reviewed in MLflow like tracked ones:
    the report step makes the parent run and one FINISHED run per trial, once, and leaves the journal alone
    (a quote in the study's name is no trouble: MLflow's filter names only the configuration's hash)."""
    storage, uri, name = str(tmp_path / "u.journal"), f"sqlite:///{tmp_path / 'mlflow.db'}", "it's untracked"
    quiet = lambda *a, **k: None  # noqa: E731
    run_search(storage, name, 3, track=False, log=quiet, out=tmp_path / "o", **FAST)
    for _ in range(2):  # the second report finds the parent run the first one made
        run_search(storage, name, 3, report_only=True, tracking_uri=uri, log=quiet, out=tmp_path / "r", **FAST)
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("sipit-search").experiment_id
    parents = [r for r in client.search_runs([experiment], "tags.kind = 'optuna-search'") if r.data.tags["study"] == name]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    complete = [t for t in _trials(storage, name) if t.state == TrialState.COMPLETE]
    children = client.search_runs([experiment], f"tags.mlflow.parentRunId = '{parents[0].info.run_id}'")
    by_trial = {int(r.data.tags["trial"]): r for r in children}
    assert len(children) == len(by_trial) == len(complete) == 3  # one run per trial, none made twice
    for t in complete:
        run = by_trial[t.number]
        assert run.info.status == "FINISHED" and math.isclose(run.data.metrics["recovery"], t.user_attrs["recovery"])
        assert run.data.params["trial"] == str(t.number)
    artifacts = {a.path for a in client.list_artifacts(parents[0].info.run_id)}
    assert {"report.json", "report.md", "pareto_uses.png"} <= artifacts
    study = optuna.load_study(study_name=name, storage=search.open_storage(storage))
    assert search.PARENT_ATTR not in study.user_attrs


@pytest.mark.parametrize("change, message", [
    (dict(families="noise,dropout"), "unknown defence family"),
    (dict(threshold=1.5), "--threshold"),
    (dict(threshold=-0.01), "--threshold"),
    (dict(threshold=float("nan")), "--threshold"),
    (dict(mode="grid"), "unknown mode"),
    (dict(attacks="oracle"), "unknown or no attack"),
    (dict(sigma_low=1.0, sigma_high=0.5), "--sigma-low"),
    (dict(budget={"bogus": 1}), "--budget: unknown key"),
    (dict(budget={"k_prior": 0}), "--budget values are integers >= 1"),
    (dict(budget={"radius_cap": -1}), "radius_cap >= 0"),
    (dict(policy="oracle"), "--policy must be one of"),
    (dict(startup_trials=0), "--startup-trials must be >= 1"),
    (dict(workers=0), "--workers must be an int >= 1"),
])
def test_bad_inputs_give_clear_errors(tmp_path, change, message):
    with pytest.raises(SearchUsageError, match=message):
        run_search(str(tmp_path / "s.journal"), "bad", 2, track=False, **{**FAST, **change})
    assert not (tmp_path / "s.journal").exists()  # nothing created before validation


def test_attach_needs_existing_study_and_same_config(tmp_path):
    storage = str(tmp_path / "s.journal")
    for step in ("attach", "report_only"):  # a mistyped journal path is refused, not created empty
        with pytest.raises(SearchUsageError, match="no journal file"):
            run_search(storage, "missing", 2, track=False, **{step: True}, **FAST)
        assert not (tmp_path / "s.journal").exists()
    run_search(storage, "other", 2, create_only=True, track=False, **FAST)
    with pytest.raises(SearchUsageError, match="does not exist"):
        run_search(storage, "missing", 2, attach=True, track=False, **FAST)
    run_search(storage, "made", 2, create_only=True, track=False, **FAST)
    with pytest.raises(SearchUsageError, match="different configuration.*threshold"):
        run_search(storage, "made", 2, attach=True, track=False, **{**FAST, "threshold": 0.05})


def test_cli_reports_bad_family_as_usage_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.search", "--storage", str(tmp_path / "s.journal"),
                           "--families", "noise,bogus", "--no-tracking"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert "unknown defence family ['bogus']" in proc.stderr


def _cli(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks.search", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def test_bad_budget_is_refused_before_the_study_exists_so_the_name_stays_usable(tmp_path):
    storage = str(tmp_path / "s.journal")
    bad = _cli("--storage", storage, "--study", "typo", "--budget", '{"bogus":1}', "--create-only", "--no-tracking")
    assert bad.returncode == 2 and "--budget: unknown key(s) ['bogus']" in bad.stderr and "Traceback" not in bad.stderr
    assert not Path(storage).exists()
    run_search(storage, "typo", 2, create_only=True, track=False, log=lambda *a, **k: None, **FAST)  # not refused


def test_unreachable_tracking_server_is_one_error_within_seconds(tmp_path):
    from benchmarks.tools.services import free_port

    started = time.monotonic()
    proc = _cli("--storage", str(tmp_path / "s.journal"), "--tracking-uri", f"http://127.0.0.1:{free_port()}",
                "--model", "tiny-llama")
    assert time.monotonic() - started < 30  # it took 264 s of silent HTTP retries
    assert proc.returncode == 2 and "no MLflow server answers" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "s.journal").exists()  # checked before the study was created


def test_worker_gets_the_storage_through_its_environment_not_its_command_line():
    url = "postgresql+psycopg://user:hunter2@db.example/optuna"
    config = search.make_config(**FAST, mode="constrained", seed=0, prompts="mixed", tying_method="rare",
                                experiment="e")
    cmd, env = search.worker_process("s", 3, config, worker_index=1, storage=url, tracking_uri="http://u:pw@h:5000",
                                     track=True, heartbeat_interval=1, grace_period=3, storage_wait=5, out=Path("o"))
    assert "hunter2" not in " ".join(cmd) and "pw@" not in " ".join(cmd)  # `ps` shows the command line
    assert env[search.STORAGE_ENV] == url and env["MLFLOW_TRACKING_URI"] == "http://u:pw@h:5000"
    assert search.build_parser().parse_args(cmd[3:]).workers == 1


def test_a_worker_process_is_given_the_study_configuration_it_will_be_checked_against():
    """Every option stored in the study's configuration travels on the worker's command line: an
    attached worker with a default in its place is refused (--startup-trials 30 with --workers 2 was)."""
    import inspect

    config = search.make_config(**{**FAST, "robust": "beam"}, mode="pareto", seed=3, prompts="mixed",
                                tying_method="kmeans", experiment="e", utility_use="probing", policy="gradient",
                                startup_trials=30)
    cmd, _ = search.worker_process("s", 3, config, worker_index=1, storage="x.journal", tracking_uri=None,
                                   track=False, heartbeat_interval=1, grace_period=3, storage_wait=5, out=Path("o"))
    args = vars(search.build_parser().parse_args(cmd[3:]))
    parameters = inspect.signature(search.make_config).parameters
    assert set(parameters) - set(args) == {"split"}  # the search always reads the dev split: no flag to carry
    given = search.make_config(**{k: args[k] for k in parameters if k in args})
    search.check_same_config(config, given)  # raises SearchUsageError naming each differing key
    assert given == config


def test_a_study_stored_before_an_option_existed_is_checked_and_run_as_it_was_made():
    """What a study was stored without is filled once (stored_config) with what it did then, and the check
    and the worker read the same values: a budget stored without radius_cap searched the whole vocabulary
    (the worker used to read the stored dict as it was and cap the radius decoder at 256)."""
    from benchmarks.search.study import LEGACY, stored_config
    from benchmarks.search.trial import trial_context

    config = search.make_config(**{**FAST, "robust": "map", "bound": "upper95"}, mode="constrained", seed=0,
                                prompts="mixed", tying_method="rare", experiment="e", startup_trials=30)
    legacy = {k: v for k, v in config.items() if k not in LEGACY}
    legacy["budget"] = {k: v for k, v in config["budget"].items() if k != "radius_cap"}
    filled = stored_config(legacy)
    assert stored_config(filled) == filled and stored_config(config) == config
    assert {k: filled[k] for k in LEGACY} == LEGACY and filled["budget"]["radius_cap"] == 0
    search.check_same_config(legacy, {**config, **LEGACY, "budget": {**config["budget"], "radius_cap": 0}})
    with pytest.raises(SearchUsageError) as refused:
        search.check_same_config(legacy, config)
    changed = [k for k in LEGACY if LEGACY[k] != config[k]]  # dtype: studies before it served fp32, still the default
    assert "dtype" not in changed and len(changed) == len(LEGACY) - 1 and config["split"] == "dev"
    assert all(f"{k}: " in str(refused.value) for k in [*changed, "budget"])
    ctx = trial_context(filled)
    assert (ctx.robust, ctx.policy, ctx.utility_use, ctx.budget.radius_cap) == ("radius", "gradient", "served", 0)


def test_requeue_copies_parameters_once_and_nothing_else(tmp_path):
    study = optuna.create_study(storage=search.open_storage(str(tmp_path / "q.journal")), study_name="q")
    drawn = study.ask()
    drawn.suggest_float("noise.sigma", 0.1, 1.0)
    drawn.set_user_attr("mlflow_run_id", "run-of-the-dead-trial")
    empty = study.ask()  # killed before it drew anything
    for trial in (drawn, empty):
        study.tell(trial, state=TrialState.FAIL)
    frozen = study.get_trials(deepcopy=False)
    assert search.requeue(study, frozen[0]) and not search.requeue(study, frozen[0])  # once
    assert not search.requeue(study, frozen[1])  # nothing to redo: a fresh trial is the same
    waiting = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.WAITING]
    assert len(waiting) == 1 and waiting[0].params == frozen[0].params and waiting[0].user_attrs == {}
    assert waiting[0].system_attrs["retry_history"] == [0]


def test_a_running_trial_that_never_beat_goes_stale_on_a_database(tmp_path):
    """A worker that lost the database between creating a trial and its first heartbeat left it RUNNING
    with no heartbeat row; Optuna never failed it and both workers of a study waited for it forever
    (CI, 2026-12-06). Such a trial is stale after two grace periods; a fresh one and a beating one are not."""
    import datetime

    storage = search.open_storage(f"sqlite:///{tmp_path / 'orphans.db'}", heartbeat_interval=1, grace_period=2)
    study = optuna.create_study(storage=storage, study_name="orphans")

    def running(seconds_ago: float) -> int:
        trial = optuna.trial.create_trial(state=TrialState.RUNNING, params={"noise.sigma": 0.5},
                                          distributions={"noise.sigma": optuna.distributions.FloatDistribution(0.1, 1)})
        trial.datetime_start = datetime.datetime.now() - datetime.timedelta(seconds=seconds_ago)
        return storage.create_new_trial(study._study_id, template_trial=trial)

    orphan, fresh, beating = running(10), running(1), running(10)
    storage.record_heartbeat(beating)
    optuna.storages.fail_stale_trials(study)
    states = {t._trial_id: t.state for t in study.get_trials(deepcopy=False)}
    assert states[orphan] == TrialState.FAIL and states[fresh] == states[beating] == TrialState.RUNNING
    waiting = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.WAITING]
    assert len(waiting) == 1 and waiting[0].params == {"noise.sigma": 0.5}  # re-queued like any stale trial


def test_rerun_draws_new_settings_instead_of_replaying_the_first_run(tmp_path):
    """The rerun's sampler used the first run's seed, so it drew trial 0's setting again (re-used at 0.0 s)."""
    storage = str(tmp_path / "r.journal")
    run_search(storage, "rerun", 2, track=False, out=tmp_path / "o", log=lambda *a, **k: None, **FAST)
    run_search(storage, "rerun", 4, track=False, out=tmp_path / "o", log=lambda *a, **k: None, **FAST)
    complete = [t for t in _trials(storage, "rerun") if t.state == TrialState.COMPLETE]
    assert len(complete) == 4
    assert len({json.dumps(t.params, sort_keys=True) for t in complete}) == 4
    assert not any("reused_from" in t.user_attrs for t in complete)


def test_ctrl_c_stops_cleanly_requeues_the_running_trials_and_a_rerun_finishes(tmp_path):
    storage, uri = str(tmp_path / "c.journal"), f"sqlite:///{tmp_path / 'mlflow.db'}"
    slow = {**FAST, "n_prompts": 2, "length": 8, "utility_tokens": 128}  # trials of a few seconds
    flags = ["--storage", storage, "--study", "ctrlc", "--n-trials", "4", "--workers", "2", "--tracking-uri", uri,
             "--heartbeat-interval", "1", "--grace-period", "3", "--out", str(tmp_path / "out")]
    for key, value in slow.items():
        flags += [f"--{key.replace('_', '-')}", json.dumps(value) if isinstance(value, dict) else str(value)]
    log = tmp_path / "search.log"
    with log.open("w") as handle:  # its own session: the test plays the terminal that sends SIGINT to the group
        proc = subprocess.Popen([sys.executable, "-m", "benchmarks.search", *flags], cwd=REPO, stdout=handle,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 150
        while time.time() < deadline:
            try:  # the journal file exists a moment before the study is written into it (KeyError until then)
                trials = _trials(storage, "ctrlc") if Path(storage).exists() else []
            except KeyError:
                trials = []
            running = [t for t in trials if t.state == TrialState.RUNNING and "family" in t.user_attrs]
            if len({t.user_attrs["worker"] for t in running}) == 2:
                break
            time.sleep(0.1)
        else:
            pytest.fail("the two workers never ran a trial at the same time")
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C
        assert proc.wait(timeout=90) == 130
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert "Traceback" not in text and "interrupted" in text
    trials = _trials(storage, "ctrlc")
    interrupted = [t for t in trials if t.state == TrialState.FAIL]
    assert interrupted and all(t.user_attrs.get("error", "KeyboardInterrupt").startswith("KeyboardInterrupt")
                               for t in interrupted)
    queued = {t.system_attrs["retry_history"][-1]: t for t in trials if t.state == TrialState.WAITING}
    assert {t.number for t in interrupted} == set(queued)
    assert all(queued[t.number].params == t.params for t in interrupted)
    study = optuna.load_study(study_name="ctrlc", storage=search.open_storage(storage))
    client = MlflowClient(tracking_uri=uri)
    assert client.get_run(study.user_attrs[search.PARENT_ATTR]).info.status == "KILLED"
    parent = client.get_run(study.user_attrs[search.PARENT_ATTR])
    children = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert all(r.info.status == "KILLED" for r in children if int(r.data.tags["trial"]) in queued)
    assert all(r.info.status in ("FINISHED", "KILLED") for r in children)
    rerun = run_search(storage, "ctrlc", 4, workers=1, tracking_uri=uri, out=tmp_path / "out", heartbeat_interval=1,
                       grace_period=3, log=lambda *a, **k: None, **slow)
    assert rerun["report"]["counts"]["COMPLETE"] == 4
    redone = [t for t in _trials(storage, "ctrlc") if t.state == TrialState.COMPLETE and t.system_attrs.get("retry_history")]
    assert {t.system_attrs["retry_history"][-1] for t in redone} == set(queued)
    assert client.get_run(study.user_attrs[search.PARENT_ATTR]).info.status == "FINISHED"


@pytest.mark.parametrize("text, message", [
    ("[1]", "a JSON object is needed"),
    ("x", "not JSON"),
])
def test_budget_option_must_be_a_json_object(capsys, text, message):
    with pytest.raises(SystemExit) as exit_info:
        search.build_parser().parse_args(["--storage", "s.journal", "--budget", text])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_an_enqueued_setting_is_measured_first_and_queued_once(tmp_path):
    storage, quiet = str(tmp_path / "q.journal"), dict(track=False, out=tmp_path / "o", log=lambda *a, **k: None)
    given = {"family": "noise", "noise.sigma": 3, "noise.placement": "exposure"}  # an int sigma is a float sigma
    run_search(storage, "given", 1, enqueue=[given], **quiet, **FAST)
    run_search(storage, "given", 2, enqueue=[given], **quiet, **FAST)  # the rerun does not queue it again
    trials = _trials(storage, "given")
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 2
    assert trials[0].params == {"family": "noise", "noise.sigma": 3.0, "noise.placement": "exposure"}
    assert trials[1].params != trials[0].params  # the sampler's own draw
    assert trials[0].user_attrs["defense_params"]["sigma"] == 3.0
    said: list[str] = []
    later = {"family": "noise", "noise.sigma": 5.0, "noise.placement": "model"}
    run_search(storage, "given", 2, enqueue=[later], **{**quiet, "log": lambda *a, **k: said.append(" ".join(a))}, **FAST)
    assert any("queued settings wait for a larger --n-trials" in line for line in said)
    assert [t.state for t in _trials(storage, "given")][2:] == [TrialState.WAITING]
    with pytest.raises(SearchUsageError, match="--enqueue needs the command that runs or creates the study"):
        run_search(storage, "given", 2, enqueue=[given], report_only=True, **quiet, **FAST)


@pytest.mark.parametrize("given, message", [
    ({"family": "noise", "noise.sigma": 30.0, "noise.placement": "exposure"}, r"noise.sigma must be a number in \[0.05, 20\]"),
    ({"family": "noise", "noise.sigma": 3.0}, "'noise.placement' is missing"),
    ({"family": "noise", "noise.sigma": 3.0, "noise.placement": "exposure", "quant.mode": "int8"},
     r"\['quant.mode'\] are not drawn by family 'noise'"),
    ({"family": "pooling", "pooling.mode": "mean", "pooling.over": "all"}, "family must be one of"),
    ({"family": "tying", "tying.groups": 1}, r"tying.groups must be an integer in \[8, 511\], got 1"),
    ({"family": "quant", "quant.mode": "int3"}, "quant.mode must be one of"),
])
def test_a_bad_enqueued_setting_is_refused_before_the_study_exists(tmp_path, given, message):
    with pytest.raises(SearchUsageError, match=message):
        run_search(str(tmp_path / "s.journal"), "bad", 2, track=False, enqueue=[given],
                   **{**FAST, "families": "noise,quant,tying"})
    assert not (tmp_path / "s.journal").exists()


def test_default_out_dir_is_used_without_out(tmp_path, monkeypatch):
    monkeypatch.setenv("SIPIT_RESULTS_DIR", str(tmp_path / "results"))
    result = run_search(str(tmp_path / "d.journal"), "dflt", 1, track=False, log=lambda *a, **k: None, **FAST)
    out = tmp_path / "results" / "search-dflt"
    assert result["report"]["out"] == str(out) and (out / "report.md").is_file()
    assert (out / "trials" / "trial-0000.json").is_file()  # each trial's result, beside Optuna's copy


def test_the_utility_use_prices_exposure_only_defences():
    """Under the use "continued" (the default) exposure noise costs perplexity and pooling cannot serve
    the use (+inf); under "served" both are free, which is what made the old search answer degenerate."""
    import math

    from benchmarks.search.space import AttackBudget, TrialContext, evaluate
    from sipit.models import load_model

    loaded = load_model("tiny-llama")
    ids = [[5, 17, 42, 99]]
    losses, priced = {}, {}
    for use in ("continued", "served"):
        ctx = TrialContext(loaded, 4, ids, seed=0, utility_tokens=64, attacks=["sipit"],
                           budget=AttackBudget(k_prior=4, k_grad=4), utility_use=use)
        noise = evaluate(ctx, ["noise"], dict(sigma=2.0, relative_to="rms", placement="exposure"))
        assert noise["attacks"]["sipit"]["decoder"] == "MapDecoder(map)"  # the search's default under noise
        pooled = evaluate(ctx, ["pooling"], dict(mode="mean", over="all"))
        losses[use] = (noise["utility_loss"], pooled["utility_loss"], noise["top1_agreement"])
        priced[use] = (noise["utility_losses"], pooled["utility_losses"])
    assert losses["served"][:2] == (0.0, 0.0) and losses["served"][2] == 1.0
    assert losses["continued"][0] != 0.0 and losses["continued"][2] < 1.0 and math.isinf(losses["continued"][1])
    # every trial prices every use, whichever the study minimises
    assert priced["served"] == priced["continued"]
    noise_losses, pooled_losses = priced["served"]
    assert noise_losses["served"] == 0.0 and noise_losses["continued"] == losses["continued"][0]
    assert pooled_losses["embedding_store"] == 0.0 and math.isinf(pooled_losses["probing"])


def test_the_threshold_applies_to_the_upper_bound_and_the_report_says_when_a_budget_cannot_prove_it(tmp_path):
    """bound="upper95" (the default): a trial is feasible only when the Clopper-Pearson upper bound of
    the strongest attack's accuracy is under the threshold; 4 tokens per trial can never prove 0.3."""
    from benchmarks.metrics import clopper_pearson_upper
    from benchmarks.search.study import tokens_needed

    assert tokens_needed(0.01) == 299 and clopper_pearson_upper(0, 299) <= 0.01 < clopper_pearson_upper(0, 298)
    quiet = dict(track=False, log=lambda *a, **k: None)
    upper = {**FAST, "bound": "upper95", "families": "noise"}
    small = run_search(str(tmp_path / "u4.journal"), "u4", 3, out=tmp_path / "o4", **quiet,
                       **{**upper, "max_prompts": 1})["report"]
    assert small["best"] is None and not any(r["feasible"] for r in small["trials"])
    assert f"the claim needs at least {tokens_needed(0.3)} tokens per trial" in small["claim_note"]
    assert "No trial can be feasible: 4 attacked tokens" in (tmp_path / "o4" / "report.md").read_text()
    enough = run_search(str(tmp_path / "u12.journal"), "u12", 4, out=tmp_path / "o12", **quiet,
                        **{**upper, "n_prompts": 3, "max_prompts": 3})["report"]
    assert enough["claim_note"] is None  # 12 tokens: zero recovered bounds the accuracy at 0.22 < 0.3
    trials = {t.number: t for t in _trials(str(tmp_path / "u12.journal"), "u12") if t.state == TrialState.COMPLETE}
    for row in enough["trials"]:
        u = trials[row["trial"]].user_attrs
        assert u["n_tokens"] == 12 and u["recovery_upper95"] >= u["recovery"]
        assert math.isclose(trials[row["trial"]].constraints["recovery"], u["recovery_upper95"] - 0.3)
        assert row["feasible"] == (u["recovery_upper95"] <= 0.3)


def test_the_default_bound_constrains_the_recovery_above_the_attacks_chance_level(tmp_path):
    """bound="excess95" (the default): the constraint is the strongest attack's 95% upper bound of its accuracy
    above its chance level (its hits on the other prompts' tokens), which each trial records per attack."""
    from benchmarks.metrics import excess_bounds

    quiet = dict(track=False, log=lambda *a, **k: None)
    result = run_search(str(tmp_path / "x.journal"), "x", 2, out=tmp_path / "o", **quiet,
                        **{**FAST, "bound": "excess95", "families": "noise", "n_prompts": 3, "max_prompts": 3})
    trials = [t for t in _trials(str(tmp_path / "x.journal"), "x") if t.state == TrialState.COMPLETE]
    assert len(trials) == 2
    for t in trials:
        u = t.user_attrs
        sipit = u["attacks"]["sipit"]
        k = round(sipit["token_accuracy"] * 12)
        assert 0.0 <= sipit["chance"] <= 1.0 and u["n_tokens"] == 12
        assert sipit["excess_upper95"] == u["recovery_excess_upper95"] == pytest.approx(
            excess_bounds(k, 12, round(sipit["chance"] * 24), 24)[1])  # 6 ordered pairs of prompts x 4 positions
        assert math.isclose(t.constraints["recovery"], u["recovery_excess_upper95"] - FAST["threshold"])
    assert "above the attack's chance level" in (tmp_path / "o" / "report.md").read_text()
    assert all(r["constrained"] == r["recovery_excess_upper95"] for r in result["report"]["trials"])
    with open(tmp_path / "o" / "trials.csv", newline="") as handle:
        rows = {int(r["trial"]): r for r in csv.DictReader(handle)}
    assert {n: json.loads(rows[t.number]["chance"])["sipit"] for n, t in enumerate(trials)} == {
        n: t.user_attrs["attacks"]["sipit"]["chance"] for n, t in enumerate(trials)}


def test_a_trial_attacks_more_prompts_unless_its_first_ones_show_a_leak():
    """Two stages: a setting that plainly leaks stops after the first prompts ("leaks": the lower bound is
    over the threshold); one whose first prompts show no leak attacks all max_prompts and is judged on
    them (a "holds" is claimed on the full sample only, even where the first 8 tokens could already bound the
    recovery under the threshold, 0.31 < 0.35); the first stage's prompts are the same either way."""
    from benchmarks.search.space import evaluate
    from benchmarks.search.trial import trial_context

    config = search.make_config(**{**FAST, "bound": "upper95", "n_prompts": 2, "max_prompts": 6, "length": 4,
                                   "threshold": 0.35}, mode="constrained", seed=0, prompts="natural",
                                tying_method="rare", experiment="e")
    ctx = trial_context(config)
    assert ctx.first_stage == 2 and len(ctx.prompt_ids) == 6 and len({tuple(p) for p in ctx.prompt_ids}) == 6
    first = trial_context({**config, "max_prompts": 2}).prompt_ids
    assert ctx.prompt_ids[:2] == first
    clear = evaluate(ctx, ["noise"], {"sigma": 1e-4, "relative_to": "rms", "placement": "exposure"})
    assert clear["claim"] == "leaks" and (clear["n_prompts"], clear["n_tokens"]) == (2, 8) and clear["recovery"] > 0.8
    drowned = evaluate(ctx, ["noise"], {"sigma": 50.0, "relative_to": "rms", "placement": "exposure"})
    assert (drowned["n_prompts"], drowned["n_tokens"]) == (6, 24)
    sipit = drowned["attacks"]["sipit"]["rates"]["token_accuracy"]
    assert sipit["n"] == 24 and drowned["claim"] == ("holds" if drowned["recovery_upper95"] <= 0.35 else "open")


def test_a_second_stage_is_sized_to_prove_a_third_of_the_threshold_four_times_in_five():
    """tokens_for_claim: the fewest tokens whose Clopper-Pearson bound proves a true recovery of threshold / 3
    in 80% of samples (one recovered token in 100 bounds 0.047 > 0.03; 303 tokens prove 0.01 < 0.03)."""
    from benchmarks.search.study import claim_power, prompts_for_claim, tokens_for_claim

    n = tokens_for_claim(0.03)
    assert claim_power(n, 0.03, 0.01)[0] >= 0.8 > max(claim_power(m, 0.03, 0.01)[0] for m in range(100, n))
    assert claim_power(100, 0.03, 0.01) == pytest.approx((0.366, 0), abs=1e-3)  # only k = 0 proves it at 100 tokens
    assert prompts_for_claim(0.03, 10, 10) * 10 >= n and prompts_for_claim(0.5, 10, 10) == 10
    assert search.make_config(**{**FAST, "bound": "upper95", "threshold": 0.03, "length": 10}, mode="constrained",
                              seed=0, prompts="mixed", tying_method="rare", experiment="e")["max_prompts"] == 35
    with pytest.raises(SearchUsageError, match="--max-prompts"):
        search.make_config(**{**FAST, "n_prompts": 3, "max_prompts": 2}, mode="constrained", seed=0, prompts="mixed",
                           tying_method="rare", experiment="e")


def test_a_setting_that_cannot_serve_the_use_is_no_answer_for_it(tmp_path):
    """Pooled exposures cannot feed continued inference (+inf): infeasible for TPE (constraint "use")
    and never the study's answer, while the embedding store's front, from the same trials, takes them."""
    result = run_search(str(tmp_path / "pool.journal"), "pool", 2, out=tmp_path / "out", track=False,
                        log=lambda *a, **k: None, **{**FAST, "families": "pooling", "threshold": 0.99})
    from benchmarks.search.report import build_report

    trials = [t for t in _trials(str(tmp_path / "pool.journal"), "pool") if t.state == TrialState.COMPLETE]
    assert trials and all(t.constraints["use"] == 1.0 and math.isinf(t.user_attrs["utility_loss"]) for t in trials)
    study = optuna.load_study(study_name="pool", storage=search.open_storage(str(tmp_path / "pool.journal")))
    report = build_report(study, threshold=1.0)  # every trial's leakage is then under the threshold
    assert all(r["feasible"] for r in report["trials"]) and result["report"]["best"] is None
    assert report["best"] is None and report["groups"]["pooling"]["best"] is None
    assert report["uses"]["embedding_store"]["best"]["feasible"]
    assert report["uses"]["continued"]["best"] is None and report["uses"]["continued"]["n_trials"] == 0


def test_the_search_budget_sizes_each_decoders_shortlist_and_keeps_its_ranking():
    """Under noise the budget's MAP ranks by the inverse heads + prior (policy learned) with k_prior + k_proxy;
    inexact noise-free states keep the gradient shortlist (k_prior + k_grad); the radius stop its cap."""
    from attacks.registry import Exposure, build
    from benchmarks.search.space import AttackBudget

    budget = AttackBudget(k_prior=5, k_grad=7, k_proxy=11, radius_cap=13)
    noisy_map = build("sipit", Exposure(sigma=1.0), budget.options(robust="map", seed=0, policy="learned"))
    s = noisy_map.scorer
    assert type(noisy_map).__name__ == "MapDecoder" and (s.ranking, s.k_prior, s.k_proxy, s.exact_positions) == \
        ("learned", 5, 11, 1)
    inexact = build("sipit", Exposure(exact=False), budget.options(robust="map", seed=0, policy="learned")).scorer
    assert (inexact.ranking, inexact.k_prior, inexact.k_grad, inexact.exact_positions) == ("gradient", 5, 7, 1)
    radius = build("sipit", Exposure(sigma=1.0), budget.options(robust="radius", seed=0, policy="learned"))
    assert radius.name == "nn-heuristic" and radius.scorer.max_candidates == 13


def _flags(options: dict) -> list[str]:
    """``run_search`` keyword options as command-line flags."""
    return [item for key, value in options.items()
            for item in (f"--{key.replace('_', '-')}", json.dumps(value) if isinstance(value, dict) else str(value))]


def _complete(trials) -> dict[int, float]:
    return {t.number: t.user_attrs["recovery"] for t in trials if t.state == TrialState.COMPLETE}


@pytest.mark.parametrize("cut", [1, 100])
def test_a_torn_journal_keeps_its_complete_trials_and_the_search_goes_on(tmp_path, cut):
    """A crash or a full disk during an append leaves a torn last line; the next search appended onto it and
    from then on nothing could read the journal. It is moved aside, with a warning, before the journal opens."""
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    path, quiet = tmp_path / "t.journal", dict(track=False, out=tmp_path / "out", heartbeat_interval=1, grace_period=2)
    run_search(str(path), "torn", 3, log=lambda *a, **k: None, **quiet, **FAST)
    whole = path.read_bytes()
    path.write_bytes(whole[:-cut])
    readable = optuna.load_study(study_name="torn", storage=JournalStorage(JournalFileBackend(str(path))))
    kept = _complete(readable.get_trials(deepcopy=False))  # what Optuna still reads: the torn line is not a record
    torn = len(whole) - cut - (whole[:-cut].rindex(b"\n") + 1)
    said: list[str] = []
    result = run_search(str(path), "torn", 3, log=lambda *a, **k: said.append(" ".join(map(str, a))), **quiet, **FAST)
    warning = [line for line in said if "torn record" in line]
    backups = list(tmp_path.glob("t.journal.torn-*"))
    assert len(warning) == 1 and str(path) in warning[0] and f"last {torn} bytes" in warning[0]
    assert len(backups) == 1 and str(backups[0]) in warning[0]
    assert backups[0].read_bytes() == whole[len(whole) - cut - torn:-cut]  # the torn line, kept aside
    after = _trials(str(path), "torn")
    assert {n: r for n, r in _complete(after).items() if n in kept} == kept  # no completed trial lost
    assert result["counts"]["COMPLETE"] == 3
    report = run_search(str(path), "torn", 3, report_only=True, log=lambda *a, **k: None, **quiet, **FAST)["report"]
    assert report["counts"]["COMPLETE"] == 3
    assert path.read_bytes().endswith(b"\n") and not list(tmp_path.glob("t.journal.torn-*"))[1:]


def test_a_journal_damaged_before_its_last_line_is_refused_and_left_as_it_is(tmp_path):
    path = tmp_path / "g.journal"
    run_search(str(path), "g", 2, create_only=True, track=False, log=lambda *a, **k: None, **FAST)
    lines = path.read_bytes().splitlines(keepends=True)
    damaged = b"".join([lines[0], b'{"op_code": 5, "worker_id": "x", "stud\n', *lines[1:]])
    path.write_bytes(damaged)
    with pytest.raises(SearchUsageError, match=f"journal file {path} is damaged at line 2 "):
        run_search(str(path), "g", 2, track=False, log=lambda *a, **k: None, out=tmp_path / "out", **FAST)
    proc = _cli("--storage", str(path), "--study", "g", "--report-only", "--no-tracking", *_flags(FAST))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert f"journal file {path} is damaged at line 2" in proc.stderr
    assert path.read_bytes() == damaged and not list(tmp_path.glob("g.journal.torn-*"))


def _mlflow_runs(uri: str) -> list:
    """Every run in the MLflow store at ``uri``, deleted ones included."""
    from mlflow.entities import ViewType

    client = MlflowClient(tracking_uri=uri)
    experiments = [e.experiment_id for e in client.search_experiments(view_type=ViewType.ALL)]
    return client.search_runs(experiments, run_view_type=ViewType.ALL) if experiments else []


@pytest.mark.parametrize("change, flag", [
    (dict(layer=99), "--layer: layer 99 out of range"),
    (dict(model="no-such-model"), "--model 'no-such-model': unknown model"),
    (dict(model="MISSING/model-dir"), "--model 'MISSING/model-dir'"),
    (dict(prompts="MISSING/prompts.txt"), "--prompts MISSING/prompts.txt"),
    (dict(length=100000), "--length: 100000 positions, more than the model's context length"),
])
def test_a_configuration_the_model_cannot_run_is_refused_before_anything_is_stored(tmp_path, change, flag):
    """--layer 99 (or a missing model, a missing prompts file, a length past the context) passed the checks:
    the study and its MLflow parent run (RUNNING for ever) were stored, and the corrected command was refused."""
    storage, uri = tmp_path / "s.journal", f"sqlite:///{tmp_path / 'mlflow.db'}"
    missing = str(tmp_path / "missing")
    change = {k: v.replace("MISSING", missing) if isinstance(v, str) else v for k, v in change.items()}
    flag = flag.replace("MISSING", missing)
    proc = _cli("--storage", str(storage), "--study", "s", "--n-trials", "1", "--tracking-uri", uri,
                *_flags({**FAST, **change}))
    assert not storage.exists() and not _mlflow_runs(uri)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert flag in proc.stderr
    run_search(str(storage), "s", 1, create_only=True, tracking_uri=uri, log=lambda *a, **k: None, **FAST)
    assert [r.info.run_name for r in _mlflow_runs(uri)] == ["search-s"]


RACE = """
import json, os, sys, time
from pathlib import Path
from benchmarks.search import study as search_study
from benchmarks.search import run_search

gates, make_parent = Path(sys.argv[1]), search_study.start_study_run


def gate(name, timeout):  # wait for the other command here (at most timeout s)
    (gates / name).mkdir(exist_ok=True)
    (gates / name / str(os.getpid())).touch()
    deadline = time.time() + timeout
    while len(list((gates / name).iterdir())) < 2 and time.time() < deadline:
        time.sleep(0.02)


def slow_parent(*args, **kwargs):  # both commands make the parent run together, as with a slow tracking server
    gate("parent", 5)
    return make_parent(*args, **kwargs)


search_study.start_study_run = slow_parent
options = json.loads(sys.argv[2])
gate("start", 120)
run_search(**{**options, "out": options["out"] + str(os.getpid())}, log=lambda *a, **k: None)
"""


@pytest.mark.parametrize("kind", ["journal", "sqlite"])
def test_two_searches_started_at_once_make_one_parent_run(tmp_path, kind):
    """Two identical plain searches started together each made a parent run: one stayed RUNNING for ever
    and the trials were split between them."""
    from mlflow.entities import ViewType

    storage = str(tmp_path / "r.journal") if kind == "journal" else f"sqlite:///{tmp_path / 'optuna.db'}"
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_search(storage, "warm", 1, create_only=True, tracking_uri=uri, log=lambda *a, **k: None, **FAST)  # the stores
    options = json.dumps(dict(storage=storage, study="race", n_trials=2, tracking_uri=uri, out=str(tmp_path / "out"),
                              **FAST))
    procs = [subprocess.Popen([sys.executable, "-c", RACE, str(tmp_path), options], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    study = optuna.load_study(study_name="race", storage=search.open_storage(storage))
    parent = study.user_attrs[search.PARENT_ATTR]
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("sipit-search").experiment_id
    parents = [r for r in client.search_runs([experiment], "tags.kind = 'optuna-search'", run_view_type=ViewType.ALL)
               if r.data.tags["study"] == "race"]
    alive = [r for r in parents if r.info.lifecycle_stage == "active"]
    assert [r.info.run_id for r in alive] == [parent] and alive[0].info.status == "FINISHED"
    assert all(r.info.status == "FAILED" for r in parents if r not in alive)  # a race lost: marked and deleted
    complete = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE]
    assert len(complete) == 2
    for t in complete:
        assert client.get_run(t.user_attrs["mlflow_run_id"]).data.tags["mlflow.parentRunId"] == parent
    for other in (r.info.run_id for r in parents if r.info.run_id != parent):  # nothing nested under a lost one
        assert not client.search_runs([experiment], f"tags.mlflow.parentRunId = '{other}'", run_view_type=ViewType.ALL)
