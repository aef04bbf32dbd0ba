"""The benchmark CLI end to end on tiny-gpt2 (noise defence), bad inputs, and Ctrl-C handling."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from benchmarks import run as bench

REPO = Path(__file__).resolve().parent.parent
SMALL = ["--model", "tiny-gpt2", "--n-prompts", "3", "--length", "8", "--head-tokens", "1024", "--head-epochs", "20",
         "--utility-tokens", "128", "--no-progress"]


def test_cli_end_to_end_noise_then_mlflow_reads_back(tmp_path, capsys):
    uri = f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}"
    out = tmp_path / "out"
    code = bench.main(SMALL + ["--defense", "noise", "--sigma-rel", "0.05", "--margin-positions", "-1",
                               "--tracking-uri", uri, "--experiment", "e2e", "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0
    assert "sipit" in printed and "softmax-head-adaptive" in printed and "median Delta/2" in printed
    results = json.loads((out / "results.json").read_text())
    assert results["status"] == "finished"
    sipit, head = results["attacks"]["sipit"], results["attacks"]["softmax-head"]
    assert sipit["decoder"] == "MapDecoder(map)" and sipit["n_tokens"] == 24  # the default decoder under noise
    # Noise well inside Delta/2 (theorem regime): SipIt recovers, the fixed head does not.
    assert results["margins"]["median_noise_norm"] < results["margins"]["median_half_delta"]
    assert sipit["token_accuracy"] >= 0.95 and sipit["token_accuracy"] > head["token_accuracy"]
    assert head["candidates_per_position"] == 0 and sipit["candidates_per_position"] >= 1  # it runs the model
    rows = list(csv.DictReader((out / "per_position.csv").open()))
    assert len(rows) == 4 * 24 and all(r["delta"] != "" for r in rows)  # 4 attacks by default

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("e2e")
    parent = client.get_run(results["tracking"]["run_id"])
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["config_hash"] == results["config_hash"]
    assert parent.data.params["config.model"] == "tiny-gpt2" and "packages.torch" in parent.data.params
    assert parent.data.params["seeds.noise"] == "1" and "git_commit" in parent.data.params
    assert parent.data.metrics["sipit.token_accuracy"] == pytest.approx(sipit["token_accuracy"])
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"results.json", "per_position.csv", "per_prompt.csv", "recovery_vs_ratio.png",
            "delta_distribution.png"} <= artifacts
    children = client.search_runs([exp.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert sorted(c.data.tags["mlflow.runName"] for c in children) == ["inverse-head", "sipit", "softmax-head",
                                                                               "softmax-head-adaptive"]
    for child in children:
        assert child.info.status == "FINISHED"
        assert "token_accuracy" in child.data.metrics and "exact_match" in child.data.metrics


@pytest.mark.parametrize("argv, message", [
    (["--defense", "bogus"], "choose from none, noise, quant, tying, pooling"),
    (["--attacks", "sipit,magic"], "choose from sipit, softmax-head, inverse-head, bruteforce"),
    (["--defense", "noise", "--sigma", "-0.1"], "argument --sigma: must be a finite number >= 0"),
    (["--layer", "9"], "layer 9 out of range"),
])
def test_bad_inputs_are_usage_errors(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(SMALL + argv + ["--no-tracking", "--out", str(tmp_path / "o")])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o" / "results.json").exists()


def test_empty_prompt_file_fails_before_loading_the_model(tmp_path, capsys, monkeypatch):
    empty = tmp_path / "empty.txt"
    empty.write_text("# only a comment\n\n")
    monkeypatch.setattr("sipit.models.load_model", lambda *a, **k: pytest.fail("model loaded"))
    with pytest.raises(SystemExit):
        bench.main(SMALL + ["--prompts", str(empty), "--no-tracking", "--out", str(tmp_path / "o")])
    assert "holds no prompts" in capsys.readouterr().err


def test_unwritable_tracking_store_still_writes_results(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    out = tmp_path / "out"
    code = bench.main(SMALL + ["--n-prompts", "1", "--attacks", "softmax-head", "--utility-tokens", "0",
                               "--tracking-uri", f"sqlite:///{blocker / 'mlflow.db'}", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 3
    assert "cannot use MLflow tracking store" in err and str(out) in err
    results = json.loads((out / "results.json").read_text())
    assert results["status"] == "finished" and results["tracking"]["error"]
    assert results["attacks"]["softmax-head"]["n_prompts"] == 1


def _bruteforce_run_interrupted(tmp_path, experiment: str, after_prompt: int, signals: int = 1):
    """A tiny-gpt2 bruteforce run of 40 prompts, sent ``signals`` SIGINTs (0.3 s apart) once prompt
    ``after_prompt`` is done; returns (tracking uri, out folder, stderr) after checking exit code 130."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "benchmarks.run", "--model", "tiny-gpt2", "--attacks", "bruteforce",
           "--n-prompts", "40", "--length", "8", "--utility-tokens", "0", "--margin-positions", "0", "--no-progress",
           "--tracking-uri", uri, "--experiment", experiment, "--out", str(out)]
    proc = subprocess.Popen(cmd, cwd=REPO, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.time() + 120
    for line in proc.stderr:
        if f"[run] bruteforce prompt {after_prompt}/40 done" in line or time.time() > deadline:
            break
    assert proc.poll() is None, "the run ended before it could be interrupted"
    for i in range(signals):
        if i:
            time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-2000:]
    return uri, out, err


def test_ctrl_c_saves_partial_results_and_fails_the_mlflow_run(tmp_path):
    uri, out, _ = _bruteforce_run_interrupted(tmp_path, "sigint", after_prompt=2)
    results = json.loads((out / "results.json").read_text())
    assert results["status"] == "interrupted"
    done = results["attacks"]["bruteforce"].get("n_prompts", 0)
    assert 2 <= done < 40  # partial: some prompts inverted, not all
    assert len(list(csv.DictReader((out / "per_position.csv").open()))) == 8 * done
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("sigint").experiment_id])
    assert runs and all(r.info.status == "FAILED" for r in runs)
    assert {r.data.tags.get("mlflow.runName") for r in runs} >= {"bruteforce"}


def test_two_ctrl_c_still_write_partial_results_and_fail_every_run(tmp_path):
    """A second Ctrl-C 0.3 s after the first is ignored while the run cleans up; the message says
    only what happened (before issue 17: empty out folder, parent RUNNING, message claiming both)."""
    uri, out, err = _bruteforce_run_interrupted(tmp_path, "sigint2", after_prompt=1, signals=2)
    assert "Traceback" not in err
    last = err.rstrip().splitlines()[-1]
    assert last.startswith("interrupted: partial results written to") and "MLflow runs marked FAILED (2)" in last
    results = json.loads((out / "results.json").read_text())
    assert results["status"] == "interrupted" and results["attacks"]["bruteforce"]["n_prompts"] >= 1
    assert (out / "per_position.csv").is_file()
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("sigint2").experiment_id])
    assert len(runs) == 2 and all(r.info.status == "FAILED" for r in runs)


def test_interrupt_before_the_run_starts_claims_nothing(monkeypatch, tmp_path, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("sipit.models.load_model", interrupted)
    code = bench.main(SMALL + ["--no-tracking", "--out", str(tmp_path / "o")])
    assert code == 130
    assert capsys.readouterr().err.strip() == "interrupted before the run started: nothing written, no MLflow run opened"
    assert not (tmp_path / "o").exists()


def test_tying_reports_group_recovery_and_how_often_the_member_is_right(tmp_path):
    """Tied rows give identical states, so SipIt on the tied model lands in the true group at every
    position; the served model's prior picks the member (group_member_accuracy)."""
    results = bench.run_benchmark(model="tiny-llama", defense="tying", tie_rare=400, attacks="sipit", n_prompts=3,
                                  length=8, utility_tokens=0, margin_positions=0, track=False, progress=False,
                                  out=tmp_path / "out", log=lambda *a, **k: None)
    sipit = results["attacks"]["sipit"]
    assert sipit["group_accuracy"] == 1.0
    assert sipit["token_accuracy"] == pytest.approx(sipit["group_accuracy"] * sipit["group_member_accuracy"])
    assert sipit["token_accuracy"] < 1.0  # some positions hold a tied rare token the prior does not pick
    assert 0 < sipit["tied_positions"] <= 24 and 0 <= sipit["tied_member_accuracy"] < 1.0
    assert sipit["decoder"].startswith("MemberByPrior")
    assert "group_accuracy" not in bench.run_benchmark(
        model="tiny-llama", defense="none", attacks="sipit", n_prompts=1, length=4, utility_tokens=0,
        margin_positions=0, track=False, progress=False, out=tmp_path / "clean", log=lambda *a, **k: None)["attacks"]["sipit"]


def test_the_naive_attacker_knows_neither_sigma_nor_the_defended_head(tmp_path):
    """--no-knows-defense: SipIt does not know the noise (nearest neighbour on the gradient shortlist,
    not MAP with the noise sigma) and no softmax head is trained on defended states."""
    runs = {}
    for flag in ([], ["--no-knows-defense"]):
        out = tmp_path / ("naive" if flag else "adaptive")
        assert bench.main(SMALL + flag + ["--defense", "noise", "--sigma-rel", "0.05", "--attacks", "sipit,softmax-head",
                                          "--margin-positions", "0", "--no-tracking", "--out", str(out)]) == 0
        runs[bool(flag)] = json.loads((out / "results.json").read_text())
    adaptive, naive = runs[False], runs[True]
    assert "softmax-head-adaptive" in adaptive["attacks"] and "softmax-head-adaptive" not in naive["attacks"]
    assert naive["defense"]["sigma_abs_median"] == adaptive["defense"]["sigma_abs_median"] > 0  # the same exposure
    assert adaptive["attacks"]["sipit"]["decoder"] == "MapDecoder(map)"  # the default decoder under noise
    assert naive["attacks"]["sipit"]["decoder"] == "NearestNeighbour(nn-shortlist)"  # the gradient shortlist
