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
its target. RDBStorage has heartbeats built in (``ResilientRDBStorage`` keeps them beating
through a database outage); Optuna 5.1's JournalStorage does not, so ``HeartbeatJournalStorage``
adds them. A storage outage is waited out (``--storage-wait``), an MLflow outage deferred
(``benchmarks.search.runs``), Ctrl-C re-queues the running trials (exit 130), a dead worker
process is named (exit 1). Secrets: the storage URL reaches worker processes through their
environment (``$SIPIT_SEARCH_STORAGE``), and every message redacts passwords.

Modes: ``constrained`` (TPE, minimise utility loss subject to recovery <= threshold, set with
``trial.set_constraint``; the value is copied to the user attribute ``constraint.recovery``) and
``pareto`` (NSGA-II, minimise (utility loss, recovery)). Utility loss = the cost to the use named by
``--utility-use`` (search.space.utility_loss: perplexity increase of the served model or of inference
continued from the exposed states, recall@1 lost by an embedding store, accuracy lost by a probe). Samplers are seeded by
(``seed``, worker index, trials in the study when the worker attached): a fresh 1-worker study is
reproducible, a rerun draws new settings; with N workers the trial set depends on scheduling.

This module is the command line and :func:`run_search`, which puts the steps together; each job
has its module: ``search.study`` (configuration, study creation), ``search.storage`` (storage,
heartbeats, stale-trial retry, outages), ``search.worker`` (the worker loop), ``search.trial``
(one trial), ``search.processes`` (worker subprocesses), ``search.runs`` (MLflow runs),
``search.report`` (the report), ``search.errors`` (how a search stops short).
"""

from __future__ import annotations

if __name__ == "__main__":  # before the imports: Ctrl-C while they load is one line (benchmarks.startup)
    from benchmarks.startup import guard_startup

    guard_startup()

import argparse
import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path

from benchmarks.cli import UsageError, default_out_dir, interrupt_once, run_main
from benchmarks.out_dir import check_provenance
from benchmarks.search.errors import SearchAborted, SearchInterrupted, SearchUsageError
from benchmarks.search.processes import run_worker_processes, worker_process
from benchmarks.search.report import write_report
from benchmarks.search.runs import PARENT_ATTR, runs_or_none, study_runs
from attacks.policies import POLICIES
from attacks.registry import ROBUST
from benchmarks.search.space import FAMILIES, SEARCH_ATTACKS, SEARCH_ROBUST, AttackBudget, check_given_setting
from benchmarks.search.storage import STORAGE_ENV, open_storage, requeue
from benchmarks.search.study import BOUNDS, MODES, UTILITY_USES, check_same_config, create_study, make_config, trial_counts
from benchmarks.search.trial import trial_context
from benchmarks.search.worker import run_worker
from benchmarks.tracking import describe_error, redact

__all__ = ["PARENT_ATTR", "STORAGE_ENV", "SearchAborted", "SearchInterrupted", "SearchUsageError", "build_parser",
           "main", "make_config", "open_storage", "requeue", "run_search", "worker_process"]


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
    n_prompts: int = 15,
    max_prompts: int | None = None,
    length: int = 20,
    utility_tokens: int = 128,
    utility_use: str = "continued",
    bound: str = "excess95",
    policy: str = "learned",
    robust: str = SEARCH_ROBUST,
    startup_trials: int = 8,
    attacks: list[str] | str = "sipit",
    budget: AttackBudget | dict | None = None,
    sigma_low: float = 0.01,
    sigma_high: float = 10.0,
    tying_method: str = "rare",
    enqueue: list[dict] | None = None,
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
    dtype: str = "fp32",
    device: str = "auto",
    log=print,
) -> dict:
    """Create the study (unless ``attach``), run ``workers`` workers, write the report (unless attach).

    ``enqueue``: settings to measure before any the sampler draws (Optuna parameter names, e.g.
    ``{"family": "noise", "noise.sigma": 4.7, "noise.placement": "exposure"}``), each checked against the search
    space and queued once (one already queued or measured is not queued again); they count toward ``n_trials``.

    Everything is validated (options, budget, the tracking store, the model and every value it must run:
    ``search.trial.trial_context``, ``enqueue``) before the storage, the study or its MLflow parent run is created.
    Returns ``{"study", "counts", "report" (or None), "ran" (trials run in-process)}``. Raises
    :class:`SearchUsageError` (bad input), :class:`SearchAborted` (a worker died, the storage stayed
    down: rerun to resume) or :class:`SearchInterrupted` (Ctrl-C: running trials re-queued).
    """
    import optuna

    _check_options(n_trials, workers, storage_wait, steps=(create_only, attach, report_only))
    if out is not None and not create_only:
        try:
            check_provenance(out)
        except UsageError as err:
            raise SearchUsageError(str(err)) from None
    config = make_config(model=model, layer=layer, families=families, mode=mode, threshold=threshold, seed=seed,
                         prompts=prompts, n_prompts=n_prompts, length=length, utility_tokens=utility_tokens,
                         utility_use=utility_use, attacks=attacks, budget=budget, sigma_low=sigma_low, sigma_high=sigma_high,
                         tying_method=tying_method, experiment=experiment, bound=bound,
                         policy=policy, startup_trials=startup_trials, robust=robust, max_prompts=max_prompts,
                         dtype=dtype)
    _check_tracking(tracking_uri, track, creating=not attach)
    _check_device(device)
    ctx = None if attach or report_only else trial_context(config, device)  # the model loads here, once
    enqueue = _check_enqueue(enqueue or [], config, ctx, steps=(attach, report_only))
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    store = open_storage(storage, heartbeat_interval=heartbeat_interval, grace_period=grace_period,
                         runs_for=lambda s: runs_or_none(s, tracking_uri, track, log), must_exist=attach or report_only,
                         log=log)
    st = _open_study(store, storage, study, config, existing=attach or report_only, tracking_uri=tracking_uri,
                     track=track, log=log)
    for params in enqueue:
        st.enqueue_trial(params, skip_if_exists=True)
    if enqueue and trial_counts(st)["COMPLETE"] >= n_trials and not create_only:
        log(f"[search] the study already holds {n_trials} complete trials: queued settings wait for a larger "
            "--n-trials", file=sys.stderr)
    out_dir = Path(out) if out is not None else default_out_dir(f"search-{study}")
    result = {"study": study, "report": None, "ran": 0}
    if not create_only and not report_only:
        with _stopping_cleanly(st, n_trials, attach=attach, tracking_uri=tracking_uri, track=track):
            if workers == 1:
                result["ran"] = run_worker(store, study, n_trials, worker=worker_index, tracking_uri=tracking_uri,
                                           track=track, heartbeat_interval=heartbeat_interval,
                                           grace_period=grace_period, storage_wait=storage_wait, out=out_dir, ctx=ctx,
                                           device=device, log=log)
            else:
                ctx = None  # each worker process loads its own model
                run_worker_processes(storage, study, n_trials, config, workers=workers, first_index=worker_index,
                                     tracking_uri=tracking_uri, track=track, heartbeat_interval=heartbeat_interval,
                                     grace_period=grace_period, storage_wait=storage_wait, out=out_dir,
                                     device=device)
    result["counts"] = trial_counts(st)
    if not attach and not create_only:
        result["report"] = write_report(st, out_dir, tracking_uri=tracking_uri, track=track, log=log)
    return result


def _check_options(n_trials, workers, storage_wait, *, steps: tuple[bool, bool, bool]) -> None:
    """The options :func:`make_config` does not hold: trial target, workers, steps, storage wait."""
    if isinstance(n_trials, bool) or not isinstance(n_trials, int) or n_trials < 1:
        raise SearchUsageError(f"--n-trials must be an int >= 1, got {n_trials!r}")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise SearchUsageError(f"--workers must be an int >= 1 (worker processes on this machine), got {workers!r}")
    if sum(steps) > 1:
        raise SearchUsageError("give at most one of --create-only, --attach, --report-only")
    if not storage_wait >= 0:
        raise SearchUsageError(f"--storage-wait must be >= 0 seconds, got {storage_wait!r}")


def _check_device(device: str) -> None:
    """The device this machine's workers compute on (not stored with the study: machines differ)."""
    from sipit.models import ModelLoadError, resolve_device

    try:
        resolve_device(device)
    except ModelLoadError as err:
        raise SearchUsageError(f"--device: {err}") from None


def _check_tracking(tracking_uri: str | None, track: bool, *, creating: bool) -> None:
    """Probe the tracking store within seconds (a worker that attaches uses the study's URI unless given one)."""
    from benchmarks.tracking import TrackingError, check_store, default_tracking_uri

    if not track or (tracking_uri is None and not creating):
        return
    try:
        check_store(tracking_uri or default_tracking_uri())
    except TrackingError as err:
        raise SearchUsageError(str(err)) from None


def _check_enqueue(enqueue: list[dict], config: dict, ctx, *, steps: tuple[bool, bool]) -> list[dict]:
    """The ``enqueue`` settings, each one the search space could draw (search.space.check_given_setting)
    for the model of ``ctx`` (the search's trial context; None when a step neither runs nor creates the study)."""
    if enqueue and any(steps):
        raise SearchUsageError("--enqueue needs the command that runs or creates the study, not --attach or --report-only")
    checked = []
    for params in enqueue:
        try:
            checked.append(check_given_setting(params, config["families"], vocab_size=ctx.clean_wb.vocab_size,
                                               length=config["length"], sigma_low=config["sigma_low"],
                                               sigma_high=config["sigma_high"], tying_method=config["tying_method"]))
        except ValueError as err:
            raise SearchUsageError(f"--enqueue {json.dumps(params)}: {err}") from None
    return checked


def _open_study(store, storage: str, study: str, config: dict, *, existing: bool, tracking_uri, track: bool, log):
    """The ``existing`` study (its configuration must agree), or the study created now."""
    import optuna

    if existing:
        try:
            st = optuna.load_study(study_name=study, storage=store)
        except KeyError:
            raise SearchUsageError(f"study {study!r} does not exist in {redact(storage)}: create it first "
                                   "(--create-only)") from None
        check_same_config(st.user_attrs["config"], config)
        return st
    st = create_study(store, study, config, tracking_uri=tracking_uri, track=track)
    log(f"[search] study {study!r} ready in {redact(storage)} ({trial_counts(st)['COMPLETE']} complete trials)",
        file=sys.stderr)
    return st


@contextmanager
def _stopping_cleanly(st, n_trials: int, *, attach: bool, tracking_uri, track: bool):
    """Around the workers: Ctrl-C or an abort ends in one message that says what was done (parent run marked)."""
    with interrupt_once():  # a second Ctrl-C (or SIGTERM) cannot cut the clean-up short
        try:
            yield
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


def _json_object(text: str) -> dict:
    """argparse type of ``--budget`` and ``--enqueue``: a JSON object (``search.study.check_budget`` and
    ``search.space.check_given_setting`` check its keys and values)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not JSON ({err.msg}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object is needed, got {text!r}")
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
    s.add_argument("--dtype", default="fp32", help="the precision the provider serves in (fp32, bf16, fp16); the "
                                                   "attacker recomputes in it (stored with the study)")
    s.add_argument("--device", default="auto", help="where this machine's workers compute: auto (CUDA, else MPS, "
                                                    "else CPU), cpu, cuda, cuda:N, mps (not stored with the study)")
    s.add_argument("--families", default=",".join(FAMILIES), help=f"comma list from {', '.join(FAMILIES)}")
    s.add_argument("--mode", default="constrained", choices=MODES)
    s.add_argument("--threshold", type=float, default=0.01, help="max recovery (token accuracy) of a feasible setting")
    s.add_argument("--bound", default="excess95", choices=BOUNDS,
                   help="what the threshold constrains: excess95 = the one-sided 95%% upper bound of the strongest "
                        "attack's token accuracy above its chance level (its hits on the other prompts' tokens, "
                        "benchmarks.metrics.excess_bounds), upper95 = the one-sided 95%% Clopper-Pearson upper bound of "
                        "the strongest attack's token accuracy (zero recovered tokens prove <= 1%% only from 299 "
                        "tokens: --n-prompts x --length), point = the measured accuracy")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--prompts", default="mixed")
    s.add_argument("--n-prompts", type=int, default=15,
                   help="prompts attacked per trial (x --length: 300 tokens let zero recovered bound the recovery "
                        "under 1%%)")
    s.add_argument("--max-prompts", type=int, default=None,
                   help="prompts a trial attacks unless its first --n-prompts already show a leak (the strongest "
                        "attack's 95%% lower bound over the threshold); default: enough tokens to prove a recovery "
                        "of a third of the threshold under it 4 times in 5 (benchmarks.search.study.tokens_for_claim; "
                        "threshold 0.03, 10 tokens per prompt: 35)")
    s.add_argument("--length", type=int, default=20)
    s.add_argument("--utility-tokens", type=int, default=128)
    s.add_argument("--utility-use", default="continued", choices=UTILITY_USES,
                   help="what the utility loss prices: continued = inference continued from the exposed states "
                        "(exposure-only defences cost too; pooled exposures cannot serve it: +inf), served = the "
                        "served model's perplexity (exposure-only defences cost nothing), embedding_store = recall@1 "
                        "lost by defended sentence vectors against a clean store, probing = accuracy lost by linear "
                        "probes trained on clean states (defenses.uses; a use a defence cannot serve: +inf)")
    s.add_argument("--startup-trials", type=int, default=8,
                   help="constrained mode: trials drawn at random before TPE (an unbiased sample for the per-use "
                        "Pareto fronts; TPE then refines --utility-use)")
    s.add_argument("--attacks", default="sipit", help=f"comma list from {', '.join(SEARCH_ATTACKS)}")
    s.add_argument("--policy", default="learned", choices=sorted(POLICIES),
                   help="candidate order of exact SipIt and of the radius decoder, and the ranking of MAP's "
                        "shortlist (attacks.policies; learned = the inverse heads with the prior, trained once per "
                        "model and layer, and per noise level for MAP)")
    s.add_argument("--robust", default=SEARCH_ROBUST, choices=tuple(ROBUST),
                   help="the decoder under noise (attacks.registry.ROBUST), the main job's by default; studies "
                        "made before the option used radius and resume only with it (docs/search.md)")
    s.add_argument("--budget", type=_json_object, default=None,
                   help=f"attack budget JSON, default {AttackBudget().to_dict()}")
    s.add_argument("--sigma-low", type=float, default=0.01, help="noise sigma range (x state RMS), log-uniform")
    s.add_argument("--sigma-high", type=float, default=10.0)
    s.add_argument("--tying-method", default="rare", choices=("rare", "kmeans"))
    s.add_argument("--enqueue", type=_json_object, action="append", default=None, metavar="JSON",
                   help='a setting to measure first, in Optuna names, e.g. \'{"family": "noise", "noise.sigma": 4.7, '
                        '"noise.placement": "exposure"}\' (repeatable; counts toward --n-trials: raise it to add '
                        'trials to a finished study)')
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
