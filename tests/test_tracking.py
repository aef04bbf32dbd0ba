"""MLflow logging: the Tracker on its own, and a real `mlflow server` on 127.0.0.1 serving a run."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from mlflow import MlflowClient
from benchmarks.tools.services import MlflowServer, free_port

from benchmarks.run import run_benchmark
from benchmarks.tracking import Tracker, TrackingError, default_tracking_uri, finite_metrics, flatten, redact

REPO = Path(__file__).resolve().parent.parent


def test_flatten_and_metrics_filtering():
    flat = flatten({"a": {"b": 1, "c": [1, 2]}, "d": "x" * 7000})
    assert flat["a.b"] == "1" and flat["a.c"] == "[1, 2]" and len(flat["d"]) == 6000
    assert finite_metrics({"x": 1, "y": float("nan"), "z": "s", "w": True, "v": 2.5}) == {"x": 1.0, "v": 2.5}
    assert default_tracking_uri().startswith("sqlite:///") and default_tracking_uri().endswith("mlflow/mlflow.db")


def test_tracker_fail_marks_open_runs_failed(tmp_path):
    uri = f"sqlite:///{tmp_path / 'db' / 'mlflow.db'}"
    tracker = Tracker(uri, "unit")
    parent = tracker.start_parent("p", {"config": {"k": 1}}, {"config_hash": "abc"})
    child = tracker.start_child("c", {"attack": "c"})
    tracker.log_metrics(child, {"m": 0.5, "bad": float("nan")})
    tracker.fail("boom")
    client = MlflowClient(tracking_uri=uri)
    assert client.get_run(parent).info.status == "FAILED" and client.get_run(child).info.status == "FAILED"
    assert client.get_run(child).data.metrics == {"m": 0.5}
    assert client.get_run(parent).data.tags["failure"] == "boom"
    # the experiment's artifacts live next to the database, not in the working directory
    assert client.get_run(parent).info.artifact_uri.startswith((tmp_path / "db" / "artifacts").as_uri())


def test_unwritable_store_raises_tracking_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(TrackingError, match="cannot use MLflow tracking store"):
        Tracker(f"sqlite:///{blocker / 'mlflow.db'}", "x")


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def test_mlflow_server_serves_the_benchmark_run(tmp_path):
    store = tmp_path / "store"
    uri = f"sqlite:///{store / 'mlflow.db'}"
    results = run_benchmark(model="tiny-gpt2", defense="noise", sigma_rel=0.05, robust="radius", n_prompts=1, length=6,
                            attacks="sipit,softmax-head", head_tokens=512, head_epochs=5, margin_positions=0,
                            utility_tokens=0,
                            tracking_uri=uri, experiment="served", out=tmp_path / "out", progress=False,
                            log=lambda *a, **k: None)
    run_id = results["tracking"]["run_id"]
    # The command documented in mlflow/README.md (localhost only, one worker, no job runner).
    server = MlflowServer(uri, store / "artifacts", tmp_path / "server.log")
    server.start(timeout=60)
    base = server.uri
    try:
        run = _get(f"{base}/api/2.0/mlflow/runs/get?run_id={run_id}")["run"]
        assert run["info"]["status"] == "FINISHED"
        tags = {t["key"]: t["value"] for t in run["data"]["tags"]}
        assert tags["config_hash"] == results["config_hash"]
        metrics = {m["key"]: m["value"] for m in run["data"]["metrics"]}
        assert metrics["softmax-head.token_accuracy"] == pytest.approx(results["attacks"]["softmax-head"]["token_accuracy"])
        query = urllib.parse.urlencode({"run_id": run_id})
        files = {f["path"] for f in _get(f"{base}/api/2.0/mlflow/artifacts/list?{query}")["files"]}
        assert {"results.json", "per_position.csv", "recovery_vs_ratio.png"} <= files
        request = urllib.request.Request(
            f"{base}/api/2.0/mlflow/runs/search", method="POST", headers={"Content-Type": "application/json"},
            data=json.dumps({"experiment_ids": [run["info"]["experiment_id"]],
                             "filter": f"tags.mlflow.parentRunId = '{run_id}'"}).encode())
        with urllib.request.urlopen(request, timeout=10) as response:
            children = json.loads(response.read())["runs"]
        names = sorted({t["key"]: t["value"] for t in c["data"]["tags"]}["mlflow.runName"] for c in children)
        assert names == ["sipit", "softmax-head", "softmax-head-adaptive"]
        with urllib.request.urlopen(f"{base}/get-artifact?path=results.json&run_uuid={run_id}", timeout=10) as response:
            assert json.loads(response.read())["config_hash"] == results["config_hash"]
    finally:
        server.stop()


def test_redact_hides_passwords_in_any_url():
    text = "postgresql+psycopg://ann:p%40ss:w@db:5432/optuna failed; see http://bob:pw@mlflow:5000/ and sqlite:///x.db"
    assert redact(text) == ("postgresql+psycopg://ann:***@db:5432/optuna failed; see http://bob:***@mlflow:5000/ "
                            "and sqlite:///x.db")
    assert redact("postgresql://ann@db/optuna") == "postgresql://ann@db/optuna"  # no password: nothing to hide


@pytest.mark.parametrize("make_uri, message", [
    (lambda tmp: f"sqlite:///{tmp}", "is not a file"),
    (lambda tmp: f"http://127.0.0.1:{free_port()}", "no MLflow server answers within 5s"),
    (lambda tmp: f"postgresql+psycopg://ann:secret@127.0.0.1:{free_port()}/db", "Connection refused"),
])
def test_unusable_store_is_reported_within_seconds(tmp_path, make_uri, message):
    started = time.monotonic()
    with pytest.raises(TrackingError, match=message) as err:
        Tracker(make_uri(tmp_path), "x")
    assert time.monotonic() - started < 15  # an unreachable server took 264 s, an unusable sqlite path 119 s
    assert "secret" not in str(err.value) and "\n" not in str(err.value)


def test_interrupted_store_creation_leaves_no_half_migrated_database(tmp_path):
    """Ctrl-C while MLflow migrates a new sqlite store: the store is absent (or whole), and opens afterwards.

    Python drops a KeyboardInterrupt that lands in a garbage-collection callback (docs/search.md, "Load");
    then the creation finishes and the store must be whole. Up to three tries, until one is interrupted."""
    db = tmp_path / "store" / "mlflow.db"
    interrupted = False
    for _ in range(3):
        # SIGINT back to its default in the child: a test run started in the background (``cmd &``) inherits
        # it ignored, and Python then never raises KeyboardInterrupt
        proc = subprocess.Popen([sys.executable, "-c", f"from benchmarks.tracking import Tracker; Tracker('sqlite:///{db}', 'x')"],
                                cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            deadline = time.monotonic() + 60
            while not list(db.parent.glob(".mlflow.db.creating-*")):  # migrating now
                assert proc.poll() is None and time.monotonic() < deadline, "the store was never being created"
                time.sleep(0.002)
            proc.send_signal(signal.SIGINT)
            code = proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
        leftovers = list(db.parent.glob(".mlflow.db.*"))
        if code != 0:
            assert "KeyboardInterrupt" in proc.stderr.read()
            assert not db.exists() and not leftovers
            interrupted = True
            break
        # the signal was dropped: the creation went on, and the store it left is whole
        assert not leftovers and MlflowClient(tracking_uri=f"sqlite:///{db}").get_experiment_by_name("x") is not None
        db.unlink()
    assert interrupted, "three Ctrl-Cs were all dropped"
    tracker = Tracker(f"sqlite:///{db}", "x")  # it used to fail forever: "index index_params_run_uuid already exists"
    run_id = tracker.start_parent("p", {"a": 1}, {})
    tracker.finish(run_id)
    assert MlflowClient(tracking_uri=f"sqlite:///{db}").get_run(run_id).info.status == "FINISHED"


def test_the_commit_is_read_once_per_process(monkeypatch):
    """A sweep records the commit its code was loaded from, even if HEAD moves while it runs."""
    from benchmarks import tracking

    tracking.git_commit.cache_clear()
    first = tracking.git_commit()
    assert first != "unknown" and len(first.split("+")[0]) == 40
    calls = []
    monkeypatch.setattr(tracking.subprocess, "run", lambda *a, **k: calls.append(a) or pytest.fail("git ran again"))
    assert tracking.git_commit() == first and calls == []
    tracking.git_commit.cache_clear()
