"""benchmarks.sweep (the main job over several settings) through its CLI: one parent run, nested runs, resume."""

from __future__ import annotations

import json

from mlflow import MlflowClient

from benchmarks import run as bench

# --robust radius: the cheap decoder under noise (MAP trains noise-adapted heads per sigma); these tests
# are about sweeps, not about which decoder is strongest
SMALL = ["--model", "tiny-gpt2", "--layer", "-1", "--n-prompts", "2", "--length", "6", "--attacks", "sipit",
         "--utility-tokens", "64", "--margin-positions", "2", "--no-progress", "--robust", "radius"]


def test_sigma_sweep_one_parent_run_a_row_per_setting_and_a_rerun_skips_finished(tmp_path, capsys):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    out = tmp_path / "sweep"
    argv = SMALL + ["--defense", "noise", "--sigma-rel", "0.01,30", "--tracking-uri", uri, "--experiment", "sw",
                    "--out", str(out)]
    assert bench.main(argv) == 0
    printed = capsys.readouterr()
    assert "| noise.sigma=0.01 | sipit |" in printed.out and "| noise.sigma=30.0 | sipit |" in printed.out
    summary = json.loads((out / "sweep.json").read_text())
    assert summary["status"] == "finished" and len(summary["settings"]) == 2
    low, high = summary["rows"]
    assert low["token_accuracy"] == 1.0 and high["token_accuracy"] < low["token_accuracy"]  # noise 30 x RMS breaks it
    assert (out / "sweep.png").stat().st_size > 0
    for setting in summary["settings"]:
        assert json.loads((tmp_path / "sweep" / setting["config_hash"] / "results.json").read_text())["status"] == "finished"

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("sw").experiment_id
    parent = client.get_run(summary["run_id"])
    assert parent.info.status == "FINISHED" and {"sweep.md", "sweep.png"} <= {a.path for a in client.list_artifacts(parent.info.run_id)}
    settings = client.search_runs([experiment], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert len(settings) == 2 and all(r.info.status == "FINISHED" for r in settings)
    for run in settings:  # the attack runs nest under each setting's run
        attacks = client.search_runs([experiment], f"tags.mlflow.parentRunId = '{run.info.run_id}'")
        assert [a.data.tags["attack"] for a in attacks] == ["sipit"]

    # a rerun with the same options keeps both finished settings and starts no new setting run
    assert bench.main(argv) == 0
    assert printed.err.count("finished earlier") == 0 and capsys.readouterr().err.count("finished earlier, kept") == 2
    assert len(client.search_runs([experiment], "tags.config_hash != ''")) == 2


def test_a_bad_value_anywhere_in_a_sweep_is_refused_before_any_setting_runs(tmp_path, capsys):
    out = tmp_path / "sweep"
    code = None
    try:
        code = bench.main(SMALL + ["--defense", "noise", "--placement", "model,nowhere", "--no-tracking",
                                   "--out", str(out)])
    except SystemExit as exit_info:
        code = exit_info.code
    assert code == 2 and "placement" in capsys.readouterr().err
    assert not out.exists()


def test_ctrl_c_in_the_second_setting_keeps_the_first_and_fails_the_open_runs(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    out = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "benchmarks.run", "--model", "tiny-gpt2", "--attacks", "bruteforce", "--n-prompts", "10",
           "--length", "4", "--utility-tokens", "0", "--margin-positions", "0", "--no-progress", "--defense", "noise",
           "--sigma-rel", "0.001,0.002", "--tracking-uri", uri, "--experiment", "sw-int", "--out", str(out)]
    proc = subprocess.Popen(cmd, cwd=Path(__file__).resolve().parent.parent, stderr=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline, second = time.time() + 240, False
    for line in proc.stderr:
        second = second or "[sweep] 2/2" in line
        if (second and "bruteforce prompt 2/10 done" in line) or time.time() > deadline:
            break
    assert proc.poll() is None and second, "the sweep ended before its second setting could be interrupted"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-2000:]
    summary = json.loads((out / "sweep.json").read_text())
    assert summary["status"] == "interrupted" and len(summary["settings"]) == 1
    first = summary["settings"][0]["config_hash"]
    assert json.loads((out / first / "results.json").read_text())["status"] == "finished"
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("sw-int").experiment_id])
    status = {r.data.tags.get("config_hash") or r.data.tags.get("kind") or r.data.tags.get("attack"): r.info.status
              for r in runs if "attack" not in r.data.tags}
    assert status.pop("sweep") == "FAILED" and status.pop(first) == "FINISHED"
    assert list(status.values()) == ["FAILED"]  # the interrupted setting


def test_a_sweep_without_utility_plots_without_an_empty_legend(tmp_path):
    """--utility-tokens 0: the utility panel has no curve: no empty legend (matplotlib warned), a note instead."""
    import warnings

    from benchmarks.sweep import sweep_plot

    settings = [{"values": {"pooling.k": k}, "results": {}, "config_hash": f"h{k}"} for k in (2, 4)]
    rows = [{"attack": "sipit", "config_hash": f"h{k}", "token_accuracy": acc, "token_accuracy_se": 0.1}
            for k, acc in ((2, 0.6), (4, 0.1))]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        path = sweep_plot(settings, rows, tmp_path / "sweep.png", "tiny")
    assert path.stat().st_size > 1000
