"""The search's worker processes on one machine: ``python -m benchmarks.search --attach`` each.

The storage URL and the tracking URI reach a worker through its environment, not its command line
(where ``ps`` would show their passwords). Ctrl-C is passed on to every worker, each re-queues its
running trial; a worker that dies is named in the error.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from benchmarks.search.errors import SearchAborted, SearchInterrupted
from benchmarks.search.storage import STORAGE_ENV


def describe_exit(code: int) -> str:
    """A worker process's exit status in words."""
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return "was interrupted (exit 130)" if code == 130 else f"exited with code {code}"


def run_worker_processes(storage: str, study: str, n_trials: int, config: dict, *, workers: int, first_index: int,
                         tracking_uri, track: bool, heartbeat_interval: int, grace_period: int, storage_wait: float,
                         out: Path, device: str = "auto") -> None:
    """``workers`` worker subprocesses (``--attach``) until they stop; SearchAborted names any that died.

    Ctrl-C: every worker gets SIGINT (a terminal sends it to all; a signal to this process alone is
    passed on), re-queues its running trial and exits; then :class:`SearchInterrupted`.
    """
    procs = []
    for i in range(workers):
        cmd, env = worker_process(study, n_trials, config, worker_index=first_index + i, storage=storage,
                                  tracking_uri=tracking_uri, track=track, heartbeat_interval=heartbeat_interval,
                                  grace_period=grace_period, storage_wait=storage_wait, out=out, device=device)
        procs.append(subprocess.Popen(cmd, env=env))
    try:
        codes = [p.wait() for p in procs]
    except KeyboardInterrupt:  # signals are held off here (run_search's interrupt_once)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        codes = [_wait_or_kill(p, timeout=60) for p in procs]
        stopped = sum(code == 130 for code in codes)
        raise SearchInterrupted(f"interrupted: {stopped} of {workers} workers stopped cleanly (each re-queued its "
                                "running trial); rerun the same command to resume") from None
    dead = [f"worker {first_index + i} (pid {p.pid}) {describe_exit(code)}"
            for i, (p, code) in enumerate(zip(procs, codes)) if code != 0]
    if dead:
        raise SearchAborted("; ".join(dead))


def _wait_or_kill(proc: subprocess.Popen, timeout: float) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def worker_process(study, n_trials, config, *, worker_index, storage, tracking_uri, track, heartbeat_interval,
                   grace_period, storage_wait, out, device: str = "auto") -> tuple[list[str], dict]:
    """The ``--attach`` command line of one worker subprocess (same configuration) and its environment.

    The storage URL and tracking URI travel in the environment (``$SIPIT_SEARCH_STORAGE``,
    ``$MLFLOW_TRACKING_URI``), not on the command line, where ``ps`` would show their passwords.
    """
    cmd = [sys.executable, "-m", "benchmarks.search", "--study", study, "--n-trials", str(n_trials),
           "--attach", "--workers", "1", "--worker-index", str(worker_index), "--model", config["model"],
           "--dtype", config["dtype"], "--device", device,
           "--layer", str(config["layer"]), "--families", ",".join(config["families"]), "--mode", config["mode"],
           "--threshold", repr(config["threshold"]), "--seed", str(config["seed"]), "--prompts", config["prompts"],
           "--n-prompts", str(config["n_prompts"]), "--max-prompts", str(config["max_prompts"]),
           "--length", str(config["length"]),
           "--utility-tokens", str(config["utility_tokens"]), "--utility-use", config["utility_use"],
           "--bound", config["bound"], "--policy", config["policy"],
           "--startup-trials", str(config["startup_trials"]), "--robust", config["robust"],
           "--attacks", ",".join(config["attacks"]),
           "--sigma-low", repr(config["sigma_low"]), "--sigma-high", repr(config["sigma_high"]),
           "--tying-method", config["tying_method"], "--experiment", config["experiment"],
           "--heartbeat-interval", str(heartbeat_interval), "--grace-period", str(grace_period),
           "--storage-wait", repr(float(storage_wait)), "--budget", json.dumps(config["budget"]), "--out", str(out)]
    env = {**os.environ, STORAGE_ENV: storage}
    if tracking_uri:
        env["MLFLOW_TRACKING_URI"] = tracking_uri
    if not track:
        cmd.append("--no-tracking")
    return cmd, env
