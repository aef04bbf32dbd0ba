"""One trial of the search: draw a defence setting, measure it (or re-use an identical trial), record it.

The measurement is recorded three times: as the trial's Optuna user attributes (and, in mode
``constrained``, its constraint), in ``<out>/trials/trial-<n>.json`` and on the trial's nested
MLflow run (``benchmarks.search.runs``).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

from benchmarks.search.errors import SearchUsageError
from benchmarks.search.runs import write_trial_file
from benchmarks.search.space import AttackBudget, report_group
from benchmarks.tracking import describe_error


def trial_context(config: dict, device: str = "auto"):
    """What every trial of a worker shares (a ``search.space.TrialContext``): model, layer, prompts of ``config``.

    The prompts are the ``n_prompts`` of the first stage, then those of the ``max_prompts`` set (same
    seed) that are not among them: a trial whose first stage shows no leak attacks them too.
    Every value the model cannot run is a SearchUsageError naming its flag: the model, the layer, the
    length (its context), the utility tokens (its held-out text), the prompts and the ends of each
    family's range; the search builds this before it stores a study (benchmarks.search.run_search)."""
    from benchmarks.prompts import named_prompt_set
    from benchmarks.search.space import TrialContext
    from defenses.utility import held_out_ids
    from sipit.models import load_model
    from sipit.whitebox import WhiteBox

    loaded = _checked(lambda: load_model(config["model"], dtype=config["dtype"], device=device),
                      f"--model {config['model']!r}")
    wb = WhiteBox(loaded.model)
    layer = _checked(lambda: wb.resolve_layer(config["layer"]), "--layer")
    _checked(lambda: wb.check_length(config["length"], "--length"))
    _checked(lambda: held_out_ids(loaded.tokenizer, config["utility_tokens"], config["seed"]), "--utility-tokens")

    def prompt_ids(n: int) -> list[list[int]]:
        prompts = _checked(lambda: named_prompt_set(config["prompts"], loaded.tokenizer, n, length=config["length"],
                                                    seed=config["seed"], split=config["split"]),
                           f"--prompts {config['prompts']}")
        return [p.ids for p in prompts if p.ids]

    first = prompt_ids(config["n_prompts"])
    if not first:
        raise SearchUsageError(f"--prompts {config['prompts']}: no prompt in it")
    more = prompt_ids(config["max_prompts"]) if config["max_prompts"] > config["n_prompts"] else []
    ctx = TrialContext(loaded, layer, first + [ids for ids in more if ids not in first], first_stage=len(first),
                       threshold=config["threshold"], bound=config["bound"], seed=config["seed"],
                       utility_tokens=config["utility_tokens"],
                       attacks=config["attacks"], budget=AttackBudget(**config["budget"]),
                       utility_use=config["utility_use"], policy=config["policy"], robust=config["robust"])
    _check_families(ctx, config)
    return ctx


def _checked(make, flag: str = ""):
    """``make()``; what it refuses (ValueError, an unreadable file, a missing package) a SearchUsageError,
    prefixed with ``flag``."""
    try:
        return make()
    except (ValueError, OSError, ImportError) as err:
        raise SearchUsageError(f"{flag}: {err}" if flag else str(err)) from None


def _check_families(ctx, config: dict) -> None:
    """Each family's defence at both ends of its range fits the model and the exposure (``Defense.check_model``,
    ``Defense.check_exposure``)."""
    from benchmarks.search.space import corner_settings

    for family in config["families"]:
        for names, params in corner_settings(family, vocab_size=ctx.clean_wb.vocab_size, length=config["length"],
                                             sigma_low=config["sigma_low"], sigma_high=config["sigma_high"],
                                             tying_method=config["tying_method"]):
            _checked(lambda: _fits(ctx, ctx.chain(names, params)), f"--families {family} ({params})")


def _fits(ctx, chain) -> None:
    chain.check_model(ctx.loaded)
    chain.check_exposure(ctx.clean_wb.exposure, ctx.clean_wb.d)


def make_objective(study, config: dict, ctx, runs, *, n_trials: int, worker: int, who: str, out_dir: Path, log):
    """The Optuna objective of worker ``worker`` (``who``): utility loss, and recovery in mode ``pareto``."""
    import optuna
    from optuna.trial import TrialState

    from benchmarks.search.space import suggest_setting

    vocab = ctx.clean_wb.vocab_size

    def objective(trial):
        # Two workers may both start the last trial: the later-numbered one stands down (PRUNED, not counted).
        others = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.RUNNING))
                  if t.number != trial.number and (t.state == TrialState.COMPLETE or t.number < trial.number)]
        if len(others) >= n_trials:
            trial.set_user_attr("stood_down", "target trial count reached by other workers")
            raise optuna.TrialPruned()
        family, names, params = suggest_setting(trial, config["families"], vocab_size=vocab, length=config["length"],
                                                sigma_low=config["sigma_low"], sigma_high=config["sigma_high"],
                                                tying_method=config["tying_method"])
        trial.set_user_attr("worker", who)
        trial.set_user_attr("family", family)
        trial.set_user_attr("group", report_group(family, trial.params))
        m = _measure(trial, ctx, config, runs, names, params, out_dir)
        log(f"[search w{worker}] trial {trial.number} {report_group(family, trial.params)} {params} -> "
            f"utility loss {m['utility_loss']:+.4f}, recovery {m['recovery']:.3f} "
            f"(95% upper {m['recovery_upper95']:.3f}, above chance {_fmt(m.get('recovery_excess_upper95'))}; "
            f"{m['n_tokens']} tokens; {m['seconds']:.1f}s)", file=sys.stderr)
        if config["mode"] == "pareto":
            return m["utility_loss"], constrained_recovery(m, config)
        return m["utility_loss"]

    return objective


def _measure(trial, ctx, config, runs, names, params, out_dir: Path) -> dict:
    """Evaluate (or re-use) one setting and record it: Optuna user attrs, the results folder, MLflow."""
    from benchmarks.search.space import evaluate

    logged = runs is not None and runs.start(trial, trial.user_attrs["family"])
    try:
        m = _reuse(trial.study, trial) or evaluate(ctx, names, params)
    except BaseException as err:
        interrupted = isinstance(err, KeyboardInterrupt)
        trial.set_user_attr("error", f"{type(err).__name__}: {err}"[:2000])
        if runs is not None:
            runs.terminate(trial.number, "KILLED" if interrupted else "FAILED", describe_error(err)[:5000])
        raise
    _record(trial, m, config)
    write_trial_file(out_dir, trial.number, trial.params, trial.user_attrs)
    if logged:
        runs.finish(trial)
    return m


#: what a trial's measurement records as user attributes, and what a re-use of an identical setting copies
MEASURED = ("utility_loss", "ppl_rel_increase", "top1_agreement", "state_rel_l2", "recovery", "recovery_upper95",
            "recovery_excess_upper95", "n_tokens", "n_prompts", "claim", "strongest_attack", "sigma_abs_median",
            "use_metrics", "utility_losses")


def _fmt(value: float | None) -> str:
    """A bound for the log line; a trial re-used from one recorded before the bound existed has none."""
    return "-" if value is None else f"{value:.3f}"


def constrained_recovery(m: dict, config: dict) -> float:
    """The recovery the threshold applies to (benchmarks.search.study.BOUNDS): the strongest attack's 95%
    upper bound above chance, its 95% upper bound, or its point estimate (studies made before the bounds)."""
    from benchmarks.search.study import CONSTRAINED

    return m[CONSTRAINED[config["bound"]]]


def _record(trial, m: dict, config: dict) -> None:
    """The measurement ``m`` as the trial's user attributes, and its recovery constraint."""
    for key in (*MEASURED, "seconds", "reused_from"):
        if m.get(key) is not None:
            trial.set_user_attr(key, m[key])
    trial.set_user_attr("attacks", {k: {"token_accuracy": v["token_accuracy"], "exact_match": v["exact_match"],
                                        "chance": v.get("token_accuracy_chance"),
                                        "excess_upper95": v.get("token_accuracy_excess_upper95"),
                                        "decoder": v.get("decoder", "")} for k, v in m["attacks"].items()})
    trial.set_user_attr("defense_params", m["defense_params"])
    over = constrained_recovery(m, config) - config["threshold"]
    if config["mode"] == "constrained":
        trial.set_constraint("recovery", over)
        # A setting that cannot serve the study's use (utility loss +inf, e.g. a pooled exposure for continued
        # inference) is no answer for it: infeasible, so TPE does not take it for the best feasible region and
        # keep drawing it (it did: 35 of 60 trials of a layer-30 study were pooling, 26 of them repeats).
        trial.set_constraint("use", 0.0 if math.isfinite(m["utility_loss"]) else 1.0)
    trial.set_user_attr("constraint.recovery", over)
    trial.set_user_attr("feasible", over <= 0)


def _reuse(study, trial) -> dict | None:
    """A COMPLETE trial with the very same parameters: copy its measurement (deterministic)."""
    from optuna.trial import TrialState

    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        if t.params == trial.params and "recovery" in t.user_attrs:
            u = t.user_attrs
            attacks = {k: dict(v, token_accuracy_chance=v.get("chance"),
                               token_accuracy_excess_upper95=v.get("excess_upper95")) for k, v in u["attacks"].items()}
            return {**{k: u.get(k) for k in MEASURED},
                    "attacks": attacks, "defense_params": u.get("defense_params"), "seconds": 0.0,
                    "reused_from": t.number}
    return None
