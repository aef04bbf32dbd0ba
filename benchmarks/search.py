"""Optuna search for the cheapest defence that makes the model non-invertible, over many workers.

    python -m benchmarks.search --storage search.journal --study demo --n-trials 30 --workers 2
    SIPIT_SEARCH_STORAGE=postgresql+psycopg://user@host/db python -m benchmarks.search --study s1 --create-only
    SIPIT_SEARCH_STORAGE=postgresql+psycopg://user@host/db python -m benchmarks.search --study s1 --attach --workers 4
    SIPIT_SEARCH_STORAGE=postgresql+psycopg://user@host/db python -m benchmarks.search --study s1 --report-only

Steps of the plain command (each also a flag on its own):

1. create: the storage and the study are created ONCE, here, before any worker starts (two workers
   racing to create a new sqlite study crash one of them). The study records its whole search
   configuration and the MLflow parent run id as study user attributes; workers read both.
2. workers: ``--workers N`` spawns N subprocesses (``--attach``) that run trials against the shared
   storage until the study holds ``--n-trials`` COMPLETE trials (``--workers 1`` runs in-process).
   Each trial is a nested MLflow run under the study's parent run, whichever process runs it.
3. report: per defence family, the cheapest setting whose recovery stays <= ``--threshold``, its
   utility cost and the recovery of every attack at it; JSON + markdown + PNG in ``--out`` and on
   the parent MLflow run.

Storage: a path (``*.journal``/``*.log`` or ``journal:PATH``) is an Optuna JournalStorage file
(one machine); a URL (``postgresql://...``, ``sqlite:///...``) is an RDBStorage (many machines).

Crash safety: trials are written to the storage when they finish, so a killed worker loses no
completed trial. A running trial carries a heartbeat; when it is older than ``--grace-period``
seconds any worker marks the trial FAILED, marks its MLflow runs FAILED (found by tag, linked or
not) and re-queues its parameters (:func:`requeue`), so rerunning the command resumes the study to
its target. RDBStorage has heartbeats built in (:class:`ResilientRDBStorage` keeps them beating
through a database outage); Optuna 5.1's JournalStorage does not, so ``HeartbeatJournalStorage``
adds them. A storage outage is waited out (``--storage-wait``), an MLflow outage deferred
(``benchmarks.search_runs``), Ctrl-C re-queues the running trials (exit 130), a dead worker
process is named (exit 1). Secrets: the storage URL reaches worker processes through their
environment (``$SIPIT_SEARCH_STORAGE``), and every message redacts passwords.

Modes: ``constrained`` (TPE, minimise utility loss subject to recovery <= threshold, set with
``trial.set_constraint``; the value is copied to the user attribute ``constraint.recovery``) and
``pareto`` (NSGA-II, minimise (utility loss, recovery)). Utility loss = relative perplexity
increase of the served model on held-out text (defenses.utility). Samplers are seeded
(``seed + worker index``): a 1-worker study is reproducible; with N workers the trial set depends
on scheduling.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

from benchmarks.cli import default_out_dir, interrupt_once, run_main
from benchmarks.search_errors import SearchAborted, SearchInterrupted, SearchUsageError
from benchmarks.search_runs import PARENT_ATTR, runs_or_none, study_runs
from benchmarks.search_space import FAMILIES, SEARCH_ATTACKS, AttackBudget
from benchmarks.search_storage import STORAGE_ENV, open_storage, requeue
from benchmarks.search_study import MODES, check_same_config, create_study, make_config, trial_counts
from benchmarks.search_worker import run_worker
from benchmarks.tracking import describe_error, redact

__all__ = ["PARENT_ATTR", "STORAGE_ENV", "SearchAborted", "SearchInterrupted", "SearchUsageError", "build_parser",
           "main", "make_config", "open_storage", "requeue", "run_search", "worker_process"]


# --------------------------------------------------------------------------- report
def _pareto(points: list[tuple[float, float, int]]) -> list[int]:
    front, best = [], math.inf
    for u, r, n in sorted(points):
        if r < best:
            front.append(n)
            best = r
    return front


def build_report(study, *, threshold: float | None = None, ppl_limit: float = 0.10) -> dict:
    """Per group: the cheapest COMPLETE trial with recovery <= threshold; plus the Pareto front."""
    from optuna.trial import TrialState

    config = study.user_attrs["config"]
    threshold = config["threshold"] if threshold is None else threshold
    trials = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if "recovery" in t.user_attrs]
    rows = []
    for t in trials:
        u = t.user_attrs
        rows.append({"trial": t.number, "group": u["group"], "family": u["family"], "params": t.params,
                     "utility_loss": u["utility_loss"], "ppl_rel_increase": u["ppl_rel_increase"],
                     "top1_agreement": u.get("top1_agreement"), "state_rel_l2": u.get("state_rel_l2"),
                     "recovery": u["recovery"], "attacks": {k: v["token_accuracy"] for k, v in u["attacks"].items()},
                     "feasible": u["recovery"] <= threshold, "retry_of": t.system_attrs.get("failed_trial"),
                     "reused_from": u.get("reused_from")})
    groups: dict[str, dict] = {}
    for group in sorted({r["group"] for r in rows}):
        mine = [r for r in rows if r["group"] == group]
        ok = sorted((r for r in mine if r["feasible"]), key=lambda r: (r["utility_loss"], r["recovery"], r["trial"]))
        groups[group] = {"n_trials": len(mine), "n_feasible": len(ok), "best": ok[0] if ok else None,
                         "lowest_recovery": min(mine, key=lambda r: (r["recovery"], r["utility_loss"]))}
    feasible = sorted((r for r in rows if r["feasible"]), key=lambda r: (r["utility_loss"], r["recovery"], r["trial"]))
    front = set(_pareto([(r["utility_loss"], r["recovery"], r["trial"]) for r in rows]))
    answer = [r for r in feasible if r["ppl_rel_increase"] <= ppl_limit]
    counts = trial_counts(study)
    return {
        "study": study.study_name, "config": config, "threshold": threshold, "counts": counts,
        "best": feasible[0] if feasible else None, "groups": groups,
        "pareto_front": sorted((r for r in rows if r["trial"] in front), key=lambda r: r["utility_loss"]),
        "question": {"ppl_limit": ppl_limit, "reached": bool(answer), "cheapest": answer[0] if answer else None},
        "trials": sorted(rows, key=lambda r: r["trial"]),
        "mlflow_parent_run_id": study.user_attrs.get(PARENT_ATTR),
    }


def _fmt_params(params: dict) -> str:
    return ", ".join(f"{k.split('.', 1)[-1]}={v:.4g}" if isinstance(v, float) else f"{k.split('.', 1)[-1]}={v}"
                     for k, v in params.items() if k != "family")


def format_report(report: dict) -> str:
    c = report["config"]
    lines = [f"# Search {report['study']}: {c['model']} layer {c['layer']}, mode {c['mode']}, "
             f"threshold recovery <= {report['threshold']:.3g} (token accuracy)",
             f"trials: {report['counts']['COMPLETE']} complete, {report['counts']['FAIL']} failed (retried when stale), "
             f"{report['counts']['RUNNING']} running; prompts {c['prompts']} {c['n_prompts']} x {c['length']} tokens; "
             f"utility on {c['utility_tokens']} tokens; attacks {', '.join(c['attacks'])}", "",
             "| family | trials (feasible) | cheapest setting with recovery <= threshold | trial | ppl increase | "
             "top-1 agr. | recovery per attack |", "|---|---|---|---|---|---|---|"]
    for group, g in report["groups"].items():
        b = g["best"]
        if b is None:
            lo = g["lowest_recovery"]
            lines.append(f"| {group} | {g['n_trials']} (0) | none found (lowest recovery {lo['recovery']:.3f} at "
                         f"{_fmt_params(lo['params'])}, ppl {100 * lo['ppl_rel_increase']:+.2f}%) | {lo['trial']} | | | |")
            continue
        attacks = ", ".join(f"{k} {v:.3f}" for k, v in b["attacks"].items())
        lines.append(f"| {group} | {g['n_trials']} ({g['n_feasible']}) | {_fmt_params(b['params'])} | {b['trial']} | "
                     f"{100 * b['ppl_rel_increase']:+.2f}% | {b['top1_agreement']:.3f} | {attacks} |")
    q = report["question"]
    lines.append("")
    if q["reached"]:
        b = q["cheapest"]
        lines.append(f"A setting reaches recovery <= {report['threshold']:.3g} with perplexity increase <= "
                     f"{100 * q['ppl_limit']:.0f}%: trial {b['trial']} {b['group']} ({_fmt_params(b['params'])}), "
                     f"ppl {100 * b['ppl_rel_increase']:+.2f}%, recovery {b['recovery']:.3f}.")
    else:
        lines.append(f"No setting found reaches recovery <= {report['threshold']:.3g} with perplexity increase <= "
                     f"{100 * q['ppl_limit']:.0f}%.")
    lines.append("")
    lines.append("Pareto front (utility loss vs recovery): " + "; ".join(
        f"#{r['trial']} {r['group']} ppl {100 * r['ppl_rel_increase']:+.2f}% rec {r['recovery']:.3f}"
        for r in report["pareto_front"]))
    return "\n".join(lines)


def plot_report(report: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for group in sorted({r["group"] for r in report["trials"]}):
        mine = [r for r in report["trials"] if r["group"] == group]
        ax.scatter([100 * r["ppl_rel_increase"] for r in mine], [r["recovery"] for r in mine], label=group, s=22)
    front = report["pareto_front"]
    ax.plot([100 * r["ppl_rel_increase"] for r in front], [r["recovery"] for r in front], "k--", lw=1, label="Pareto front")
    ax.axhline(report["threshold"], color="red", lw=0.8, label=f"threshold {report['threshold']:.3g}")
    ax.set_xlabel("perplexity increase (%)")
    ax.set_ylabel("recovery (token accuracy, strongest attack)")
    ax.set_xscale("symlog", linthresh=1.0)
    ax.set_title(f"{report['config']['model']} layer {report['config']['layer']}: {report['study']}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_report(study, out: Path, *, tracking_uri=None, track: bool = True, log=print) -> dict:
    report = build_report(study)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str))
    text = format_report(report)
    (out / "report.md").write_text(text + "\n")
    fields = ["trial", "group", "params", "utility_loss", "ppl_rel_increase", "top1_agreement", "state_rel_l2",
              "recovery", "attacks", "feasible", "retry_of", "reused_from"]
    with (out / "trials.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows({k: (json.dumps(v) if isinstance(v, dict) else v) for k, v in r.items()} for r in report["trials"])
    paths = [out / "report.json", out / "report.md", out / "trials.csv"]
    if report["trials"]:
        paths.append(plot_report(report, out / "pareto.png"))
    runs = study_runs(study, tracking_uri=tracking_uri, track=track, log=log)
    if runs is not None:
        runs.relog_pending(study)  # trials whose MLflow logging failed while the server was down
        tracker, parent = runs.tracker, runs.parent_id
        tracker.log_artifacts(parent, paths)
        table = {"trial": [], "group": [], "params": [], "ppl_rel_increase": [], "recovery": [], "best_in_group": []}
        best_ids = {g["best"]["trial"] for g in report["groups"].values() if g["best"]}
        for r in report["pareto_front"] + [g["best"] for g in report["groups"].values() if g["best"]]:
            table["trial"].append(r["trial"])
            table["group"].append(r["group"])
            table["params"].append(json.dumps(r["params"]))
            table["ppl_rel_increase"].append(r["ppl_rel_increase"])
            table["recovery"].append(r["recovery"])
            table["best_in_group"].append(r["trial"] in best_ids)
        tracker.client.log_table(parent, table, "search_best_and_pareto.json")
        metrics = {"trials_complete": report["counts"]["COMPLETE"], "trials_failed": report["counts"]["FAIL"],
                   "question_reached": float(report["question"]["reached"])}
        if report["best"]:
            metrics.update(best_utility_loss=report["best"]["utility_loss"], best_recovery=report["best"]["recovery"],
                           best_trial=report["best"]["trial"])
        tracker.log_metrics(parent, metrics)
        tracker.finish(parent)
    report["text"] = text
    report["out"] = str(out)
    return report


# --------------------------------------------------------------------------- the command
def run_search(
    storage: str | None,
    study: str = "sipit-search",
    n_trials: int = 30,
    *,
    model: str = "smollm2-135m",
    layer: int = -1,
    families: list[str] | str = FAMILIES,
    mode: str = "constrained",
    threshold: float = 0.01,
    seed: int = 0,
    prompts: str = "mixed",
    n_prompts: int = 2,
    length: int = 8,
    utility_tokens: int = 128,
    attacks: list[str] | str = "sipit",
    budget: AttackBudget | dict | None = None,
    sigma_low: float = 0.01,
    sigma_high: float = 10.0,
    tying_method: str = "rare",
    workers: int = 1,
    create_only: bool = False,
    attach: bool = False,
    report_only: bool = False,
    worker_index: int = 0,
    tracking_uri: str | None = None,
    experiment: str = "sipit-search",
    track: bool = True,
    heartbeat_interval: int = 5,
    grace_period: int = 30,
    storage_wait: float = 120.0,
    out: str | Path | None = None,
    log=print,
) -> dict:
    """Create the study (unless ``attach``), run ``workers`` workers, write the report (unless attach).

    Everything is validated (options, budget, the tracking store) before the study is created.
    Returns ``{"study", "counts", "report" (or None), "ran" (trials run in-process)}``. Raises
    :class:`SearchUsageError` (bad input), :class:`SearchAborted` (a worker died, the storage stayed
    down: rerun to resume) or :class:`SearchInterrupted` (Ctrl-C: running trials re-queued).
    """
    import optuna

    if isinstance(n_trials, bool) or not isinstance(n_trials, int) or n_trials < 1:
        raise SearchUsageError(f"--n-trials must be an int >= 1, got {n_trials!r}")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise SearchUsageError(f"--workers must be an int >= 1 (worker processes on this machine), got {workers!r}")
    if sum((create_only, attach, report_only)) > 1:
        raise SearchUsageError("give at most one of --create-only, --attach, --report-only")
    if not storage_wait >= 0:
        raise SearchUsageError(f"--storage-wait must be >= 0 seconds, got {storage_wait!r}")
    config = make_config(model=model, layer=layer, families=families, mode=mode, threshold=threshold, seed=seed,
                         prompts=prompts, n_prompts=n_prompts, length=length, utility_tokens=utility_tokens,
                         attacks=attacks, budget=budget, sigma_low=sigma_low, sigma_high=sigma_high,
                         tying_method=tying_method, experiment=experiment)
    _check_tracking(tracking_uri, track, creating=not (attach or report_only))
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    store = open_storage(storage, heartbeat_interval=heartbeat_interval, grace_period=grace_period,
                         runs_for=lambda s: runs_or_none(s, tracking_uri, track, log))
    if attach or report_only:
        try:
            st = optuna.load_study(study_name=study, storage=store)
        except KeyError:
            raise SearchUsageError(f"study {study!r} does not exist in {redact(storage)}: create it first "
                                   "(--create-only)") from None
        check_same_config(st.user_attrs["config"], config)
    else:
        st = create_study(store, study, config, tracking_uri=tracking_uri, track=track)
        log(f"[search] study {study!r} ready in {redact(storage)} ({trial_counts(st)['COMPLETE']} complete trials)",
            file=sys.stderr)
    out_dir = Path(out) if out is not None else default_out_dir(f"search-{study}")
    result = {"study": study, "report": None, "ran": 0}
    if not create_only and not report_only:
        with interrupt_once():  # a second Ctrl-C (or SIGTERM) cannot cut the clean-up short
            try:
                if workers == 1:
                    result["ran"] = run_worker(store, study, n_trials, worker=worker_index, tracking_uri=tracking_uri,
                                               track=track, heartbeat_interval=heartbeat_interval,
                                               grace_period=grace_period, storage_wait=storage_wait, out=out_dir, log=log)
                else:
                    run_worker_processes(storage, study, n_trials, config, workers=workers, first_index=worker_index,
                                         tracking_uri=tracking_uri, track=track, heartbeat_interval=heartbeat_interval,
                                         grace_period=grace_period, storage_wait=storage_wait, out=out_dir)
            except KeyboardInterrupt as err:
                message = str(err) if isinstance(err, SearchInterrupted) else f"interrupted ({err or 'SIGINT'})"
                raise SearchInterrupted(message + _close_parent(st, attach, tracking_uri, track, "KILLED", message)) \
                    from None
            except SearchAborted as err:
                c = trial_counts(st)
                message = (f"{err}; the study holds {c['COMPLETE']}/{n_trials} complete trials: rerun the same "
                           "command to finish it and write the report")
                raise SearchAborted(message + _close_parent(st, attach, tracking_uri, track, "FAILED", message)) \
                    from None
    result["counts"] = trial_counts(st)
    if not attach and not create_only:
        result["report"] = write_report(st, out_dir, tracking_uri=tracking_uri, track=track, log=log)
    return result


def _check_tracking(tracking_uri: str | None, track: bool, *, creating: bool) -> None:
    """Probe the tracking store within seconds (a worker that attaches uses the study's URI unless given one)."""
    from benchmarks.tracking import TrackingError, check_store, default_tracking_uri

    if not track or (tracking_uri is None and not creating):
        return
    try:
        check_store(tracking_uri or default_tracking_uri())
    except TrackingError as err:
        raise SearchUsageError(str(err)) from None


def _close_parent(study, attach: bool, tracking_uri, track: bool, status: str, reason: str) -> str:
    """Mark the study's MLflow parent run ``status`` (only the command that owns it: not ``--attach``).

    Returns what to add to the message: what was done, never more.
    """
    parent = study.user_attrs.get(PARENT_ATTR) if track and not attach else None
    if parent is None:
        return ""
    try:
        runs = study_runs(study, tracking_uri=tracking_uri, track=track)
        runs.tracker.set_tag(parent, "failure", reason[:5000])
        runs.tracker.client.set_terminated(parent, status=status)
    except Exception as err:  # noqa: BLE001
        return f" (the MLflow parent run could not be marked {status}: {describe_error(err)})"
    return f" (MLflow parent run marked {status})"


def describe_exit(code: int) -> str:
    """A worker process's exit status in words."""
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return "was interrupted (exit 130)" if code == 130 else f"exited with code {code}"


def run_worker_processes(storage: str, study: str, n_trials: int, config: dict, *, workers: int, first_index: int,
                         tracking_uri, track: bool, heartbeat_interval: int, grace_period: int, storage_wait: float,
                         out: Path) -> None:
    """``workers`` worker subprocesses (``--attach``) until they stop; SearchAborted names any that died.

    Ctrl-C: every worker gets SIGINT (a terminal sends it to all; a signal to this process alone is
    passed on), re-queues its running trial and exits; then :class:`SearchInterrupted`.
    """
    procs = []
    for i in range(workers):
        cmd, env = worker_process(study, n_trials, config, worker_index=first_index + i, storage=storage,
                                  tracking_uri=tracking_uri, track=track, heartbeat_interval=heartbeat_interval,
                                  grace_period=grace_period, storage_wait=storage_wait, out=out)
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
                   grace_period, storage_wait, out) -> tuple[list[str], dict]:
    """The ``--attach`` command line of one worker subprocess (same configuration) and its environment.

    The storage URL and tracking URI travel in the environment (``$SIPIT_SEARCH_STORAGE``,
    ``$MLFLOW_TRACKING_URI``), not on the command line, where ``ps`` would show their passwords.
    """
    cmd = [sys.executable, "-m", "benchmarks.search", "--study", study, "--n-trials", str(n_trials),
           "--attach", "--workers", "1", "--worker-index", str(worker_index), "--model", config["model"],
           "--layer", str(config["layer"]), "--families", ",".join(config["families"]), "--mode", config["mode"],
           "--threshold", repr(config["threshold"]), "--seed", str(config["seed"]), "--prompts", config["prompts"],
           "--n-prompts", str(config["n_prompts"]), "--length", str(config["length"]),
           "--utility-tokens", str(config["utility_tokens"]), "--attacks", ",".join(config["attacks"]),
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


def _json_object(text: str) -> dict:
    """argparse type of ``--budget``: a JSON object (its keys and values are checked by :func:`check_budget`)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not JSON ({err.msg}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object is needed, e.g. {json.dumps(AttackBudget().to_dict())}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.search", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--storage", default=os.environ.get(STORAGE_ENV),
                   help=f"journal file path (one machine) or RDB URL, e.g. postgresql+psycopg://user@host/db; default "
                        f"${STORAGE_ENV} (keeps a password out of `ps`; or put it in ~/.pgpass)")
    p.add_argument("--study", default="sipit-search")
    p.add_argument("--n-trials", type=int, default=30, help="target number of COMPLETE trials in the study")
    p.add_argument("--workers", type=int, default=1, help="worker processes on this machine (>= 1)")
    steps = p.add_mutually_exclusive_group()
    steps.add_argument("--create-only", action="store_true", help="create storage, study and MLflow parent run, then stop")
    steps.add_argument("--attach", action="store_true", help="only run workers against an existing study (no report)")
    steps.add_argument("--report-only", action="store_true", help="only write the report of an existing study")
    p.add_argument("--worker-index", type=int, default=0, help=argparse.SUPPRESS)
    s = p.add_argument_group("search")
    s.add_argument("--model", default="smollm2-135m")
    s.add_argument("--layer", type=int, default=-1)
    s.add_argument("--families", default=",".join(FAMILIES), help=f"comma list from {', '.join(FAMILIES)}")
    s.add_argument("--mode", default="constrained", choices=MODES)
    s.add_argument("--threshold", type=float, default=0.01, help="max recovery (token accuracy) of a feasible setting")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--prompts", default="mixed")
    s.add_argument("--n-prompts", type=int, default=2)
    s.add_argument("--length", type=int, default=8)
    s.add_argument("--utility-tokens", type=int, default=128)
    s.add_argument("--attacks", default="sipit", help=f"comma list from {', '.join(SEARCH_ATTACKS)}")
    s.add_argument("--budget", type=_json_object, default=None,
                   help=f"attack budget JSON, default {AttackBudget().to_dict()}")
    s.add_argument("--sigma-low", type=float, default=0.01, help="noise sigma range (x state RMS), log-uniform")
    s.add_argument("--sigma-high", type=float, default=10.0)
    s.add_argument("--tying-method", default="rare", choices=("rare", "kmeans"))
    t = p.add_argument_group("tracking, faults and output")
    t.add_argument("--tracking-uri", default=os.environ.get("MLFLOW_TRACKING_URI"),
                   help="MLflow tracking URI, e.g. http://127.0.0.1:5000 (default $MLFLOW_TRACKING_URI, else the "
                        "repository's sqlite store)")
    t.add_argument("--experiment", default="sipit-search")
    t.add_argument("--no-tracking", dest="track", action="store_false")
    t.add_argument("--heartbeat-interval", type=int, default=5)
    t.add_argument("--grace-period", type=int, default=30, help="seconds without heartbeat before a trial is retried")
    t.add_argument("--storage-wait", type=float, default=120.0,
                   help="seconds a worker retries an unreachable storage (backoff) before it stops")
    t.add_argument("--out", default=None, help="report and per-trial results folder (default "
                                               f"{default_out_dir('search-<study>')})")
    return p


def main(argv: list[str] | None = None) -> int:
    """The command line: exit 0 done, 2 bad input (one line, ``benchmarks.cli.run_main``), 1 aborted, 130 Ctrl-C."""
    return run_main(build_parser(), _command, argv)


def _command(args: argparse.Namespace) -> int:
    from benchmarks.tracking import TrackingError

    prog = "python -m benchmarks.search"

    def log(*items, **kwargs):
        print(*items, **kwargs, flush=True)

    try:
        result = run_search(**vars(args), log=log)
    except TrackingError as err:  # e.g. the stored tracking URI of a study this worker attaches to
        raise SearchUsageError(str(err)) from None
    except SearchAborted as err:
        print(f"{prog}: error: {redact(err)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as err:
        print(f"{prog}: {redact(err) or 'interrupted'}", file=sys.stderr)
        return 130
    if result["report"] is not None:
        print(result["report"]["text"])
        print(f"report: {result['report']['out']}/report.md")
    else:
        print(f"study {result['study']}: {result['counts']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
