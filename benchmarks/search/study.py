"""The search's study: its validated configuration, its creation, its samplers and its trial counts.

The configuration (everything that must agree between workers) and the MLflow parent run id are
study user attributes, written once when the study is created; every worker reads them, and a
worker whose options differ is refused (:func:`check_same_config`). Every reader of a stored
configuration goes through :func:`stored_config`, which fills what a study stored before an option
existed did in its place (:data:`LEGACY`).
"""

from __future__ import annotations

import json
import math

from benchmarks.search.errors import SearchUsageError
from benchmarks.search.runs import PARENT_ATTR, discard_study_run, start_study_run
from benchmarks.search.space import FAMILIES, SEARCH_ATTACKS, SEARCH_ROBUST, UTILITY_USES, AttackBudget

MODES = ("constrained", "pareto")
CONFIG_KEYS = ("model", "layer", "families", "mode", "threshold", "seed", "prompts", "n_prompts", "length",
               "utility_tokens", "utility_use", "attacks", "budget", "sigma_low", "sigma_high", "tying_method",
               "experiment", "bound", "policy", "startup_trials", "robust", "max_prompts", "dtype", "split")
#: what the threshold constrains: the one-sided 95% upper bound of the strongest attack's token accuracy above
#: its chance level (benchmarks.metrics.excess_bounds), its Clopper-Pearson upper bound (a claim that chance
#: hits alone can defeat), or its point estimate (studies made before either)
BOUNDS = ("excess95", "upper95", "point")
#: the trial measurement each bound constrains (benchmarks.search.space.evaluate)
CONSTRAINED = {"excess95": "recovery_excess_upper95", "upper95": "recovery_upper95", "point": "recovery"}


#: budget keys whose 0 means "no cap" (the others are >= 1)
MAY_BE_ZERO = {"radius_cap": 0}
#: what a study stored before an option existed did in its place: it priced the served model, constrained the
#: point estimate, ordered candidates by the gradient, drew 8 random startup trials and decoded noise with the
#: radius stop; a budget stored before the radius decoder's cap had none (radius_cap 0: the vocabulary)
#: radius stop; it attacked its n_prompts and no more (max_prompts = n_prompts, filled by stored_config); it served
#: fp32 and read every line of the prompt file (split None: before the dev/test split, benchmarks.prompts)
LEGACY = {"utility_use": "served", "bound": "point", "policy": "gradient", "startup_trials": 8, "robust": "radius",
          "dtype": "fp32", "split": None}
LEGACY_BUDGET = {"radius_cap": 0}


def check_budget(budget) -> dict:
    """The attack budget as a full dict; unknown keys and non-positive values are a usage error."""
    defaults = AttackBudget().to_dict()
    if budget is None:
        return defaults
    if isinstance(budget, AttackBudget):
        return budget.to_dict()
    if not isinstance(budget, dict):
        raise SearchUsageError(f"--budget is a JSON object such as {json.dumps(defaults)}, got {budget!r}")
    unknown = sorted(set(budget) - set(defaults))
    if unknown:
        raise SearchUsageError(f"--budget: unknown key(s) {unknown}: choose from {', '.join(defaults)}")
    bad = {k: v for k, v in budget.items() if isinstance(v, bool) or not isinstance(v, int) or v < MAY_BE_ZERO.get(k, 1)}
    if bad:
        raise SearchUsageError(f"--budget values are integers >= 1 (radius_cap >= 0: the vocabulary), got {bad}")
    return {**defaults, **budget}


def make_config(*, model, layer, families, mode, threshold, seed, prompts, n_prompts, length, utility_tokens,
                attacks, budget, sigma_low, sigma_high, tying_method, experiment, utility_use="continued",
                bound="excess95", policy="learned", startup_trials=8, robust=SEARCH_ROBUST, max_prompts=None,
                dtype="fp32", split="dev") -> dict:
    """Validated search configuration (everything that must agree between workers).

    ``max_prompts`` (default :func:`prompts_for_claim`) is how many prompts a trial attacks when its first
    ``n_prompts`` show no leak (benchmarks.search.space.evaluate)."""
    if isinstance(families, str):
        families = [f.strip() for f in families.split(",") if f.strip()]
    families = list(families or [])
    if not families:
        raise SearchUsageError(f"no defence family given: choose from {', '.join(FAMILIES)}")
    bad = [f for f in families if f not in FAMILIES]
    if bad:
        raise SearchUsageError(f"unknown defence family {bad}: choose from {', '.join(FAMILIES)}")
    if mode not in MODES:
        raise SearchUsageError(f"unknown mode {mode!r}: choose from {', '.join(MODES)}")
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0.0 <= threshold < 1.0 \
            or not math.isfinite(threshold):
        raise SearchUsageError(f"--threshold is a token accuracy in [0, 1), got {threshold!r}")
    if isinstance(attacks, str):
        attacks = [a.strip() for a in attacks.split(",") if a.strip()]
    bad = [a for a in attacks if a not in SEARCH_ATTACKS]
    if not attacks or bad:
        raise SearchUsageError(f"unknown or no attack {bad or attacks}: choose from {', '.join(SEARCH_ATTACKS)}")
    if not 0 < sigma_low < sigma_high or not math.isfinite(sigma_high):
        raise SearchUsageError(f"need 0 < --sigma-low < --sigma-high, got {sigma_low}, {sigma_high}")
    for value, flag, low in ((n_prompts, "--n-prompts", 1), (length, "--length", 2), (utility_tokens, "--utility-tokens", 16),
                             (startup_trials, "--startup-trials", 1)):
        if value < low:
            raise SearchUsageError(f"{flag} must be >= {low}, got {value}")
    if tying_method not in ("rare", "kmeans"):
        raise SearchUsageError(f"--tying-method must be rare or kmeans, got {tying_method!r}")
    if utility_use not in UTILITY_USES:
        raise SearchUsageError(f"--utility-use must be one of {', '.join(UTILITY_USES)}, got {utility_use!r}")
    from attacks.policies import POLICIES

    if policy not in POLICIES:
        raise SearchUsageError(f"--policy must be one of {', '.join(sorted(POLICIES))}, got {policy!r}")
    from attacks.registry import ROBUST

    if robust not in ROBUST:
        raise SearchUsageError(f"--robust must be one of {', '.join(ROBUST)}, got {robust!r}")
    from sipit.models import DTYPES

    if dtype not in DTYPES:
        raise SearchUsageError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    from benchmarks.prompts import SplitRefused, check_split

    if split is not None:  # None: every line of the prompt file, as studies stored before splits read it
        try:
            check_split(split, tunes=True, command="the search")
        except (SplitRefused, ValueError) as err:
            raise SearchUsageError(str(err)) from None
    if bound not in BOUNDS:
        raise SearchUsageError(f"--bound must be one of {', '.join(BOUNDS)}, got {bound!r}")
    if max_prompts is None:
        max_prompts = n_prompts if bound == "point" else prompts_for_claim(threshold, n_prompts, length)
    if isinstance(max_prompts, bool) or not isinstance(max_prompts, int) or max_prompts < n_prompts:
        raise SearchUsageError(f"--max-prompts must be an integer >= --n-prompts ({n_prompts}), got {max_prompts!r}")
    return dict(model=model, layer=int(layer), families=families, mode=mode, threshold=float(threshold), seed=int(seed),
                prompts=prompts, n_prompts=int(n_prompts), length=int(length), utility_tokens=int(utility_tokens),
                attacks=list(attacks), budget=check_budget(budget), sigma_low=float(sigma_low),
                sigma_high=float(sigma_high), tying_method=tying_method, experiment=experiment, utility_use=utility_use,
                bound=bound, policy=policy, startup_trials=int(startup_trials), robust=robust, max_prompts=max_prompts,
                dtype=dtype, split=split)


def make_sampler(config: dict, worker: int, attach_count: int = 0):
    """The worker's sampler, seeded by (seed, worker index, trials in the study when it attached).

    A fresh 1-worker study is reproducible; a rerun draws a new stream instead of replaying the first
    run's draws (which repeated earlier settings, re-used at 0.0 s, so fewer distinct settings counted).
    """
    import numpy as np
    import optuna

    seed = int(np.random.SeedSequence([config["seed"], worker, attach_count]).generate_state(1)[0])
    if config["mode"] == "pareto":
        return optuna.samplers.NSGAIISampler(seed=seed, population_size=8)
    # the first ``startup_trials`` trials of the study are drawn at random: an unbiased sample that prices every
    # use (the per-use fronts of search.report.per_use), before TPE refines the study's own use
    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=config["startup_trials"])


def create_study(storage, study_name: str, config: dict, *, tracking_uri=None, track: bool = True):
    """Create the study (or load it, checking the config agrees) and its MLflow parent run.

    ``storage`` comes from ``search.storage.open_storage``: the configuration and the parent run id are
    set first-writer-wins (its ``set_study_user_attr_once``), so commands that create the same study at
    once agree on both; a parent run made by a command that lost the race is marked FAILED and deleted."""
    import optuna

    directions = ["minimize", "minimize"] if config["mode"] == "pareto" else ["minimize"]
    study = optuna.create_study(study_name=study_name, storage=storage, directions=directions, load_if_exists=True,
                                sampler=make_sampler(config, 0))
    check_same_config(storage.set_study_user_attr_once(study._study_id, "config", lambda: config), config)
    if track:
        from benchmarks.tracking import Tracker, git_commit, package_versions

        made: list[tuple[Tracker, str]] = []

        def new_parent() -> str:
            tracker = Tracker(tracking_uri, config["experiment"])
            made.append((tracker, start_study_run(tracker, study_name, config, params={"packages": package_versions()},
                                                  tags={"git_commit": git_commit()})))
            study.set_user_attr("tracking_uri", tracker.uri)  # before the parent run id: whoever reads one has both
            return made[-1][1]

        parent = storage.set_study_user_attr_once(study._study_id, PARENT_ATTR, new_parent)
        for tracker, run_id in made:
            if run_id != parent:
                discard_study_run(tracker, run_id, parent)
    return study


def stored_config(config: dict) -> dict:
    """A study's stored configuration as its workers run it: every key it was stored without set to
    what the study did then (:data:`LEGACY`, :data:`LEGACY_BUDGET`), the budget filled (:func:`check_budget`;
    a study stored without a budget ran the defaults). Idempotent: a full configuration comes back equal."""
    budget = {**LEGACY_BUDGET, **config["budget"]} if config.get("budget") else None
    return {**LEGACY, "max_prompts": config["n_prompts"], **config, "budget": check_budget(budget)}


def check_same_config(stored: dict, given: dict) -> None:
    """SearchUsageError naming every key on which the stored (:func:`stored_config`) and the given
    configuration differ."""
    stored = stored_config(stored)
    diff = {k: (stored.get(k), given.get(k)) for k in CONFIG_KEYS if stored.get(k) != given.get(k)}
    if diff:
        raise SearchUsageError("the study exists with a different configuration (stored vs given): "
                               + "; ".join(f"{k}: {a!r} vs {b!r}" for k, a, b in ((k, *v) for k, v in diff.items()))
                               + " — use the same options, or a new --study name")


def trial_counts(study) -> dict:
    """How many of the study's trials are COMPLETE, RUNNING, WAITING and FAIL."""
    out = {s: 0 for s in ("COMPLETE", "RUNNING", "WAITING", "FAIL")}
    for t in study.get_trials(deepcopy=False):
        if t.state.name in out:
            out[t.state.name] += 1
    return out


def tokens_needed(threshold: float, level: float = 0.95) -> int:
    """The fewest tokens n for which zero recovered tokens bound the recovery at or below ``threshold``:
    the smallest n with 1 - (1 - level)^(1/n) <= threshold, i.e. n >= log(1 - level) / log(1 - threshold)."""
    if threshold <= 0:
        return math.inf
    return math.ceil(math.log(1 - level) / math.log1p(-threshold) - 1e-9)


#: the power a study's second stage is sized for, at a true recovery of a third of the threshold
CLAIM_POWER, CLAIM_RATE = 0.8, 1 / 3


def claim_power(n: int, threshold: float, rate: float, level: float = 0.95, *, k_from: int = -1) -> tuple[float, int]:
    """``(P(K <= k), k)`` for K ~ Binomial(n, rate) and k the most recovered tokens whose Clopper-Pearson upper
    bound U(k, n) (benchmarks.metrics) is still <= ``threshold``: how often n attacked tokens prove a recovery
    of ``rate`` under ``threshold``. k grows with n, so a caller stepping n up may start at ``k_from``."""
    from scipy.stats import binom

    from benchmarks.metrics import clopper_pearson_upper

    k = k_from
    while k + 1 < n and clopper_pearson_upper(k + 1, n, level) <= threshold:
        k += 1
    return (float(binom.cdf(k, n, rate)) if k >= 0 else 0.0), k


def tokens_for_claim(threshold: float, *, rate: float | None = None, power: float = CLAIM_POWER,
                     step: int = 1, limit: int = 200_000) -> int:
    """The fewest tokens (a multiple of ``step``) that prove a recovery of ``rate`` (default threshold / 3)
    under ``threshold`` with probability ``power`` (:func:`claim_power`).

    Zero recovered tokens need only :func:`tokens_needed`, but an attacker who reads nothing from the
    states still hits a frequent token now and then: at smollm2's last layer under 6-9 x RMS exposure
    noise the adaptive head recovered 1 token in 100 in each of six trials, which bounds the recovery at
    0.047. At a threshold of 0.03, 350 tokens prove a rate of 0.01 in 86% of trials (100 tokens: 37%)."""
    if not 0 < threshold < 1:
        raise ValueError(f"a claim needs a threshold in (0, 1), got {threshold}")
    rate = threshold * CLAIM_RATE if rate is None else rate
    n = math.ceil(tokens_needed(threshold) / step) * step
    p, k = claim_power(n, threshold, rate)
    while p < power:
        n += step
        if n > limit:
            raise ValueError(f"no claim of recovery <= {threshold} within {limit} tokens")
        p, k = claim_power(n, threshold, rate, k_from=k)
    return n


def prompts_for_claim(threshold: float, n_prompts: int, length: int) -> int:
    """The prompts a trial attacks at most: enough for :func:`tokens_for_claim`, never fewer than ``n_prompts``
    (threshold 0 can be claimed by no finite sample: ``n_prompts``)."""
    if threshold <= 0:
        return n_prompts
    return max(n_prompts, tokens_for_claim(threshold, step=length) // length)
