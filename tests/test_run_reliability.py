"""The run and the sweep against a hostile user: output folders, orphaned MLflow runs, bad values caught
before any work, what the noise is, and Ctrl-C while a command starts."""

from __future__ import annotations

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
from benchmarks.config import parse_spec
from benchmarks.metrics import noise_summary
from benchmarks.out_dir import LOCK_NAME, claim
from benchmarks.cli import UsageError

REPO = Path(__file__).resolve().parent.parent
TINY = ["--model", "tiny-gpt2", "--n-prompts", "1", "--length", "4", "--attacks", "sipit", "--policy", "gradient",
        "--utility-tokens", "0", "--margin-positions", "0", "--no-progress"]


def error_of(argv, capsys) -> str:
    with pytest.raises(SystemExit) as info:
        bench.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


def test_an_unwritable_out_folder_is_refused_before_the_run(tmp_path, capsys):
    """An existing folder this user may not write (mode 0555; root writes anywhere but sysfs, so as root the
    folder is /sys/kernel): refused in one line before the model loads, nothing written."""
    out = tmp_path / "ro"
    out.mkdir()
    out.chmod(0o555)
    if os.access(out, os.W_OK):  # root
        out = Path("/sys/kernel")
    before = sorted(p.name for p in out.iterdir())
    try:
        err = error_of(TINY + ["--no-tracking", "--out", str(out)], capsys)
    finally:
        (tmp_path / "ro").chmod(0o700)
    assert f"--out {str(out)!r} cannot be written: Permission denied" in err
    assert sorted(p.name for p in out.iterdir()) == before


def test_an_out_folder_under_a_file_and_an_empty_out_are_refused(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert "cannot be written" in error_of(TINY + ["--no-tracking", "--out", str(blocker / "sub")], capsys)
    assert "--out is empty" in error_of(TINY + ["--no-tracking", "--out", ""], capsys)
    assert not list(REPO.glob("per_position.csv"))  # nothing written in the current folder


def test_a_second_command_on_a_claimed_folder_is_refused_and_a_dead_holders_lock_is_free(tmp_path):
    held = claim(tmp_path / "out")
    with pytest.raises(UsageError, match="in use by another run"):
        claim(tmp_path / "out")
    held.release()
    claim(tmp_path / "out").release()  # free again
    # a holder killed outright: the kernel drops its flock, the record stays for the next holder
    script = ("import sys, time; sys.path.insert(0, %r); from benchmarks.out_dir import claim; "
              "c = claim(%r); c.note(mlflow_run='abc'); print('held', flush=True); time.sleep(60)") % (
        str(REPO), str(tmp_path / "out"))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    with pytest.raises(UsageError, match=f"pid {proc.pid}"):
        claim(tmp_path / "out")
    proc.kill()
    proc.wait()
    again = claim(tmp_path / "out")
    assert again.previous["pid"] == proc.pid and again.previous["mlflow_run"] == "abc"
    again.release()
    assert (tmp_path / "out" / LOCK_NAME).is_file()


def test_two_runs_started_at_once_on_one_folder_never_overwrite_each_other(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "benchmarks.run", *TINY, "--no-tracking", "--out", str(out)]
    procs = [subprocess.Popen(cmd + (["--seed", str(i)]), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for i in range(2)]
    results = [p.communicate(timeout=600) + (p.returncode,) for p in procs]
    codes = sorted(r[2] for r in results)
    assert codes == [0, 2], results
    refused = next(r for r in results if r[2] == 2)
    assert "in use by another run" in refused[1]
    winner = next(i for i, r in enumerate(results) if r[2] == 0)
    assert json.loads((out / "results.json").read_text())["config"]["seed"] == winner


def test_a_run_killed_outright_has_its_mlflow_runs_closed_by_the_next_run_in_its_folder(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "benchmarks.run", "--model", "tiny-gpt2", "--attacks", "bruteforce", "--n-prompts",
           "30", "--length", "8", "--utility-tokens", "0", "--margin-positions", "0", "--no-progress",
           "--tracking-uri", uri, "--experiment", "killed", "--out", str(out)]
    proc = subprocess.Popen(cmd, cwd=REPO, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.time() + 300
    for line in proc.stderr:
        if "bruteforce prompt 1/30 done" in line or time.time() > deadline:
            break
    proc.kill()
    proc.wait()
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("killed").experiment_id
    assert {r.info.status for r in client.search_runs([experiment])} == {"RUNNING"}
    rerun = subprocess.run(cmd[:-6] + ["--n-prompts", "1", "--length", "4", "--tracking-uri", uri,
                                       "--experiment", "killed", "--out", str(out)],
                           cwd=REPO, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert "closed 2 MLflow run(s) left RUNNING by a killed run" in rerun.stderr
    runs = client.search_runs([experiment])
    assert "RUNNING" not in {r.info.status for r in runs}
    failed = [r for r in runs if r.info.status == "FAILED"]
    assert len(failed) == 2 and all("killed: closed by the next run" in r.data.tags["failure"] for r in failed)


@pytest.mark.parametrize("argv, message", [
    (["--defense", "pooling", "--pool-dims", "8,7"], "g=7 must divide the width d=64 of the residual exposure"),
    (["--defense", "noise", "--sigma", "0.1,1e300"], "sigma=1e+300 (abs) is too large"),
    (["--defense", "noise:sigma=0.1,sigma=0.2"], "parameter 'sigma' is given twice"),
    (["--defense", "permute", "--known-pairs", "100000"], "--known-pairs 100000: more than 4 x d = 256 pairs add nothing"),
    (["--utility-tokens", "100000000"], "--utility-tokens 100000000: the held-out utility text holds"),
])
def test_a_bad_value_is_refused_before_anything_runs_even_late_in_a_sweep(argv, message, tmp_path, capsys):
    err = error_of(TINY + argv + ["--no-tracking", "--out", str(tmp_path / "out")], capsys)
    assert message in err
    assert not (tmp_path / "out").exists()  # no folder, no setting run


def test_the_noise_is_said_absolute_relative_and_against_the_margin(tmp_path, capsys):
    out = tmp_path / "out"
    code = bench.main(["--model", "tiny-gpt2", "--n-prompts", "2", "--length", "5", "--attacks", "sipit",
                       "--policy", "gradient", "--utility-tokens", "0", "--margin-positions", "-1", "--no-progress",
                       "--no-tracking", "--defense", "noise", "--sigma", "1e-4", "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    noise = results["noise"]
    assert noise["sigma_abs_median"] == pytest.approx(1e-4)
    rms = results["noise"]["sigma_abs_median"] / noise["sigma_rms_multiple_median"]
    assert 0.01 < rms < 100  # the state RMS of tiny-gpt2's last layer
    assert noise["n_ratio_positions"] == 10 and noise["ratio_to_half_delta_max"] < 1
    assert "far below the margin" in noise["verdict"] and "recovery is guaranteed" in noise["verdict"]
    assert "x the state RMS" in captured.out and "far below the margin" in captured.out
    assert results["attacks"]["sipit"]["token_accuracy"] == 1.0  # as guaranteed
    assert "far below the margin" in (out / "report.html").read_text()


def test_noise_summary_verdicts():
    norms = [[1.0, 3.0]]
    assert "above the margin at all 2" in noise_summary([1.0], [2.0], norms, [[0, 0], [0, 1]], [1.0, 2.0])["verdict"]
    part = noise_summary([1.0], [2.0], norms, [[0, 0], [0, 1]], [4.0, 2.0])
    assert part["n_below_half_delta"] == 1 and "below the margin at 1 of 2" in part["verdict"]
    assert noise_summary([0.0], [2.0], [[0.0]], [[0, 0]], [4.0])["verdict"] == "no noise"
    assert noise_summary([1.0], [4.0], norms, [[0, 0]], [4.0])["sigma_rms_multiple_median"] == 0.25


def test_spec_keys_are_read_once():
    assert parse_spec("noise:sigma=0.1,placement=model") == ("noise", {"sigma": 0.1, "placement": "model"})
    with pytest.raises(UsageError, match="given twice"):
        parse_spec("noise:sigma=0.1,sigma=0.2")


@pytest.mark.parametrize("module", ["benchmarks.run", "benchmarks.search", "benchmarks.experiments.noise"])
def test_ctrl_c_while_a_command_starts_is_one_line(module):
    proc = subprocess.Popen([sys.executable, "-m", module, "--help"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    time.sleep(0.8)  # inside the imports (several seconds), after the guard (milliseconds)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, (proc.returncode, err[-2000:])
    assert err.strip() == "interrupted while starting (SIGINT): nothing was written"


def test_results_under_docs_need_a_clean_commit(tmp_path, monkeypatch, capsys):
    """A results folder under docs/ (what the docs cite) is refused while the tree is dirty, before anything is
    written; anywhere else, and under docs/ from a clean commit, it is not."""
    from benchmarks import out_dir, tracking

    target = REPO / "docs" / "results" / f"provenance-test-{os.getpid()}"
    monkeypatch.setattr(tracking, "git_commit", lambda: "0123abc+dirty")
    err = error_of(TINY + ["--no-tracking", "--out", str(target)], capsys)
    assert "is under docs/" in err and "0123abc+dirty" in err and not target.exists()
    out_dir.check_provenance(tmp_path / "elsewhere")  # not under docs/: fine even when dirty
    monkeypatch.setattr(tracking, "git_commit", lambda: "0123abc")
    out_dir.check_provenance(target)
