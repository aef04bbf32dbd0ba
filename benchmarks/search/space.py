"""The defence search space: families, their conditional parameters, and one trial's evaluation.

Families (``FAMILIES``) and the Optuna parameters each one draws (names are shared, so a chain
reuses its members' distributions):

- ``noise``: ``noise.sigma`` log-uniform in [sigma_low, sigma_high], a multiple of the state RMS
  (``relative_to='rms'``); ``noise.placement`` in (model, exposure). ``model`` injects the noise
  inside the served network, ``exposure`` only noises the exported copy: free for the served
  model, not for inference continued from the exposed states (the ``utility_use`` below).
- ``quant``: ``quant.mode`` in QUANT_MODES: bnb weights (int8/nf4/fp4), stored activations
  (act-int8/act-nf4/act-fp4) or both (nf4+act-nf4).
- ``tying``: ``tying.groups`` log-uniform integer G in [V/64, V-1]: the number of distinct
  input-embedding rows left. Built with ``rare = V - G`` (the V - G rarest tokens take their nearest
  frequent token's row), because k-means of a 49k x 576 embedding into thousands of groups does not
  fit a 2-core budget; ``tying_method='kmeans'`` uses ``groups=G`` k-means instead (tiny models).
- ``pooling``: ``pooling.mode`` in (mean, max), ``pooling.over`` in (all, window) and, for window,
  ``pooling.k`` in [2, prompt length].
- ``quant+noise``: a chain, quant first (``quant.mode``, ``noise.sigma``, ``noise.placement``).
- ``permute``: a keyed permutation of the exposed dimensions, ``permute.scope`` in (deployment, prompt);
  ``rotate``: a keyed orthogonal mixing, ``rotate.scope`` likewise and ``rotate.rank`` in ROTATE_RANKS
  (0: a full random rotation; r: identity plus a rank-r mixing). The provider undoes both (continued
  inference costs nothing); the attacker recovers the key from the exposure alone (no known pairs).
- ``dp``: ``dp.mechanism`` in defenses.dp.MECHANISMS and ``dp.epsilon`` log-uniform in DP_EPSILONS, clip at
  the defence's default: each exposed state clipped, then noised to the claimed per-state epsilon.

A trial's utility loss (:func:`utility_loss`) prices one use of the states (``utility_use``, the one the
study minimises; every trial records the loss of each of ``UTILITY_USES`` in ``utility_losses``, so
the report draws a Pareto front per use from one study, the leakage being the same whatever the use):
``continued`` (the default), the perplexity increase of inference continued from the exposed
states (defenses.utility), under which exposure-only defences cost what their in-model twins cost
and a pooled exposure, which cannot be continued, costs +inf; or ``served``, the served model's
perplexity increase, under which every exposure-only defence is free (the search then answers
"noise the exposed copy", whatever the noise does to anyone who uses it); ``embedding_store``, the
recall@1 lost by defended sentence vectors against a clean store, or ``probing``, the accuracy lost
by linear probes trained on clean states (defenses.uses: their ``loss``; pooled exposures serve the
store, a probe only with per-position rows; a use a setting cannot serve costs +inf).

Each trial (:func:`evaluate`) builds the defence with :func:`defenses.registry.make_chain`, measures
its utility cost with :func:`defenses.utility.utility_cost` and its recovery (token accuracy) by the
strongest adaptive attacks on a fixed prompt subset, through the same pipeline as benchmarks.run
(benchmarks.pipeline): the attack for each exposure is attacks.registry's ``"sipit"`` (the
strongest form that knows the defence) within the search's smaller shortlist / pooled beam
(``AttackBudget.options``) so a trial fits a CPU budget; the adaptive softmax head is trained on
corpus states passed through the defence's exposure (benchmarks.pipeline.train_softmax_head).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

from attacks.registry import describe

FAMILIES = ("noise", "quant", "tying", "pooling", "quant+noise", "permute", "rotate", "dp")
#: ``rotate.rank`` choices: 0 = a full random rotation, r = identity plus a rank-r mixing
ROTATE_RANKS = (0, 1, 8, 32)
#: ``dp.epsilon`` range (per exposed state), drawn log-uniform
DP_EPSILONS = (0.1, 1e4)
QUANT_MODES = ("int8", "nf4", "fp4", "act-int8", "act-nf4", "act-fp4", "nf4+act-nf4")
SEARCH_ATTACKS = ("sipit", "softmax-head")
#: the search's decoder under noise (attacks.registry.ROBUST): the main job's, see TrialContext
SEARCH_ROBUST = "map"
#: the uses a trial prices (every trial prices all of them; a study minimises one, ``utility_use``)
UTILITY_USES = ("continued", "served", "embedding_store", "probing")


@dataclass
class AttackBudget:
    """How much each attack may spend per position (smaller = faster, weaker)."""

    k_prior: int = 16  # MAP / NN shortlist: the prior's top tokens
    k_grad: int = 16  # ... plus this many gradient-ranked tokens (gradient ranking: nn-gradient)
    k_proxy: int = 128  # ... or this many of the inverse heads + prior (learned ranking: MAP with --policy learned)
    pooled_beam: int = 4
    pooled_topk: int = 64
    radius_cap: int = 256  # the radius decoder's candidates per position at most (0: the vocabulary)
    head_tokens: int = 1024
    head_epochs: int = 8

    def shortlist(self) -> dict:
        """CandidateScorer sizes: k_prior + k_grad (gradient ranking) or k_prior + k_proxy (learned ranking)
        candidates per position before any widening, position 0 over the vocabulary; the ranking is the
        registry's (attacks.registry: nn-gradient ranks by gradient, MAP and beam as the policy implies)."""
        return {"k_prior": self.k_prior, "k_grad": self.k_grad, "k_proxy": self.k_proxy, "exact_positions": 1}

    def options(self, *, robust: str, seed: int, policy: str = "learned"):
        """attacks.registry.AttackOptions within this budget (the shortlist decoders, the radius stop's cap
        and the pooled beam); ``policy`` orders exact SipIt's and the radius decoder's candidates."""
        from attacks.registry import AttackOptions

        return AttackOptions(robust=robust, seed=seed, policy=policy, shortlist=self.shortlist(),
                             max_candidates=self.radius_cap or None, pooled_beam=self.pooled_beam,
                             pooled_topk=self.pooled_topk)

    def to_dict(self) -> dict:
        return asdict(self)


def quant_params(mode: str) -> dict:
    if mode not in QUANT_MODES:
        raise ValueError(f"quant mode must be one of {QUANT_MODES}, got {mode!r}")
    weights, _, act = mode.partition("+")
    if weights.startswith("act-"):
        return {"weights": "none", "activations": weights[4:]}
    return {"weights": weights, "activations": act[4:] if act else "none"}


def suggest_setting(trial, families, *, vocab_size: int, length: int, sigma_low: float, sigma_high: float,
                    tying_method: str = "rare") -> tuple[str, list[str], dict]:
    """Draw (family, registry names in chain order, defence params) from the conditional space."""
    family = trial.suggest_categorical("family", list(families))
    names = family.split("+")
    params: dict = {}
    if "quant" in names:
        params.update(quant_params(trial.suggest_categorical("quant.mode", list(QUANT_MODES))))
    if "noise" in names:
        params.update(sigma=trial.suggest_float("noise.sigma", sigma_low, sigma_high, log=True), relative_to="rms",
                      placement=trial.suggest_categorical("noise.placement", ["model", "exposure"]))
    if "tying" in names:
        low = max(2, vocab_size // 64)
        groups = trial.suggest_int("tying.groups", low, vocab_size - 1, log=True)
        params.update({"groups": groups} if tying_method == "kmeans" else {"rare": vocab_size - groups})
    if "pooling" in names:
        params["mode"] = trial.suggest_categorical("pooling.mode", ["mean", "max"])
        over = trial.suggest_categorical("pooling.over", ["all", "window"])
        params["over"] = over
        if over == "window":
            params["k"] = trial.suggest_int("pooling.k", 2, max(2, length))
    for keyed in ("permute", "rotate"):
        if keyed in names:
            params["scope"] = trial.suggest_categorical(f"{keyed}.scope", ["deployment", "prompt"])
    if "rotate" in names:
        params["rank"] = trial.suggest_categorical("rotate.rank", list(ROTATE_RANKS))
    if "dp" in names:
        from defenses.dp import MECHANISMS

        params.update(mechanism=trial.suggest_categorical("dp.mechanism", list(MECHANISMS)),
                      epsilon=trial.suggest_float("dp.epsilon", *DP_EPSILONS, log=True))
    return family, names, params


class _GivenSetting:
    """An Optuna-trial stand-in that answers :func:`suggest_setting` from given parameters and checks each
    against the distribution it is drawn from (what ``study.enqueue_trial`` would only warn about)."""

    def __init__(self, params: dict):
        self.params, self.drawn = params, {}  # drawn: the values as the search space types them

    def _value(self, name: str):
        if name not in self.params:
            raise ValueError(f"parameter {name!r} is missing")
        self.drawn[name] = self.params[name]
        return self.params[name]

    def suggest_categorical(self, name: str, choices: list):
        value = self._value(name)
        if value not in choices:
            raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")
        return value

    def suggest_float(self, name: str, low: float, high: float, log: bool = False) -> float:
        value = self._value(name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
            raise ValueError(f"{name} must be a number in [{low:g}, {high:g}], got {value!r}")
        self.drawn[name] = float(value)
        return float(value)

    def suggest_int(self, name: str, low: int, high: int, log: bool = False) -> int:
        value = self._value(name)
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ValueError(f"{name} must be an integer in [{low}, {high}], got {value!r}")
        return value


class _Corner:
    """An Optuna-trial stand-in that draws the low (``end=0``) or the high (``end=-1``) end of every range, and the
    first or the last choice."""

    def __init__(self, end: int):
        self.end = end

    def suggest_categorical(self, name: str, choices: list):
        return choices[self.end]

    def suggest_float(self, name: str, low, high, log: bool = False):
        return (low, high)[self.end]

    suggest_int = suggest_float


def corner_settings(family: str, *, vocab_size: int, length: int, sigma_low: float, sigma_high: float,
                    tying_method: str = "rare") -> list[tuple[list[str], dict]]:
    """(registry names, defence params) of ``family`` at both ends of its space (:func:`suggest_setting`): what a
    search checks against its model before it stores a study."""
    return [suggest_setting(_Corner(end), [family], vocab_size=vocab_size, length=length, sigma_low=sigma_low,
                            sigma_high=sigma_high, tying_method=tying_method)[1:] for end in (0, -1)]


def check_given_setting(params: dict, families, *, vocab_size: int, length: int, sigma_low: float,
                        sigma_high: float, tying_method: str = "rare") -> dict:
    """``params`` (Optuna names, e.g. ``{"family": "noise", "noise.sigma": 4.7, "noise.placement": "exposure"}``),
    typed as :func:`suggest_setting` draws them, if it could draw exactly them; else ValueError saying what is wrong."""
    given = _GivenSetting(params)
    suggest_setting(given, families, vocab_size=vocab_size, length=length, sigma_low=sigma_low, sigma_high=sigma_high,
                    tying_method=tying_method)
    unknown = sorted(set(params) - set(given.drawn))
    if unknown:
        raise ValueError(f"parameters {unknown} are not drawn by family {params['family']!r}")
    return given.drawn


def report_group(family: str, params: dict) -> str:
    """The report's row key: the family, with noise split by placement (they cost differently)."""
    if "noise" in family.split("+"):
        return f"{family}[{params.get('noise.placement', params.get('placement', '?'))}]"
    return family


# --------------------------------------------------------------------------- evaluation
class TrialContext:
    """What every trial of one worker shares: model, layer, prompts, seeds, budgets.

    ``robust`` is the decoder under noise, by default greedy MAP as in the main job. With the learned
    policy its shortlist is the prior's top ``k_prior`` plus the top ``k_proxy`` of the inverse heads
    trained with the trial's noise (attacks.proposals.head_noise levels: the first trial at a level
    fits them, ~8 minutes at smollm2's last layer, later ones load them). Layer 30, 10 x 10 tokens,
    exposure noise 0.4 x RMS: MAP 0.73, the radius stop 0.49, MAP on the gradient shortlist 0.27
    (docs/search.md).

    A trial attacks the first ``first_stage`` prompts, and the rest of ``prompt_ids`` unless those already
    show a leak above ``threshold`` (:func:`claim_after`, whose bounds ``bound`` names:
    benchmarks.search.study.BOUNDS)."""

    def __init__(self, loaded, layer: int, prompt_ids: list[list[int]], *, seed: int, utility_tokens: int,
                 attacks: list[str], budget: AttackBudget, robust: str = SEARCH_ROBUST, utility_use: str = "served",
                 policy: str = "learned", first_stage: int | None = None, threshold: float = 0.0,
                 bound: str = "upper95"):
        from sipit.whitebox import WhiteBox

        self.loaded, self.layer, self.prompt_ids = loaded, layer, prompt_ids
        self.first_stage = len(prompt_ids) if first_stage is None else first_stage
        self.threshold, self.bound = threshold, bound
        self.clean_wb = WhiteBox(loaded.model)
        self.seed, self.utility_tokens, self.attacks, self.budget, self.robust = seed, utility_tokens, attacks, budget, robust
        self.utility_use, self.policy = utility_use, policy

    def chain(self, names: list[str], params: dict):
        """The defence (its quantised / tied served copy is held by ``loaded`` and shared between trials
        of the same setting: defenses.base.Defense.served_copy)."""
        from defenses.registry import make_chain

        if "noise" in names:
            params = dict(params, seed=self.seed + 1)
        return make_chain(names, **params)


def utility_loss(util, use: str) -> float:
    """The trial's utility loss for ``use``: the served model's relative perplexity increase, or that of
    inference continued from the exposed states (a pooled exposure cannot be continued: +inf), or the
    ``loss`` of a use of defenses.uses (``util.uses[use]``; not applicable: +inf)."""
    if use == "served":
        return float(util.ppl_rel_increase)
    if use == "continued":
        return math.inf if util.continued_ppl_rel_increase is None else float(util.continued_ppl_rel_increase)
    loss = util.uses[use]["loss"]
    return math.inf if loss is None else float(loss)


def claim_after(attacks: dict[str, dict], threshold: float, bound: str = "upper95") -> str:
    """``leaks`` when the strongest attack's one-sided 95% lower bound of its token accuracy is above
    ``threshold``, ``holds`` when every attack's upper bound is at or under it, else ``open``. The bounds are
    Clopper-Pearson's of the accuracy, or, for ``bound="excess95"``, those of the accuracy above the attack's
    chance level (benchmarks.metrics.excess_bounds).

    :func:`evaluate` stops after the first stage only on ``leaks``; ``holds`` is only ever claimed on all
    of a trial's prompts. So early stopping removes chances to claim ``holds`` and adds none: a wrong
    ``holds`` is at most as likely as with the full fixed sample, 5%."""
    from benchmarks.metrics import clopper_pearson_lower, excess_bounds

    def bounds(r: dict) -> tuple[float, float]:
        k = round(r["value"] * r["n"])
        if bound == "excess95":
            return excess_bounds(k, r["n"], r["chance_hits"], r["chance_comparisons"])
        return clopper_pearson_lower(k, r["n"]), r["upper95"]

    limits = [bounds(a["rates"]["token_accuracy"]) for a in attacks.values()]
    if any(lower > threshold for lower, _ in limits):
        return "leaks"
    return "holds" if all(upper <= threshold for _, upper in limits) else "open"


def evaluate(ctx: TrialContext, names: list[str], params: dict) -> dict:
    """Utility cost and per-attack recovery of one defence setting (the trial's measurement).

    Every attack inverts the first-stage prompts; unless :func:`claim_after` finds a leak, it inverts
    the remaining prompts of ``ctx.prompt_ids`` as well (their states were exposed with the
    first ones, in order, so the first stage's noise does not depend on the second)."""
    from benchmarks.metrics import summarise
    from benchmarks.pipeline import attack_for, expose, invert_all, train_softmax_head
    from defenses.utility import utility_cost

    started = time.perf_counter()
    chain = ctx.chain(names, params)
    loaded, layer = ctx.loaded, ctx.layer
    util = utility_cost(loaded, chain, layer, n_tokens=ctx.utility_tokens, seed=ctx.seed)  # every use of defenses.uses
    exposed = expose(chain, loaded, ctx.clean_wb, layer, ctx.prompt_ids, seed=ctx.seed + 1)
    makers: dict[str, tuple[str, object]] = {}  # attack name -> (decoder description, prompt index -> attack)
    if "sipit" in ctx.attacks:
        options = ctx.budget.options(robust=ctx.robust, seed=ctx.seed, policy=ctx.policy)
        makers["sipit"] = (describe(attack_for(exposed, ctx.first_stage - 1, "sipit", options)),
                           lambda i: attack_for(exposed, i, "sipit", options))
    if "softmax-head" in ctx.attacks and chain.per_position:
        head, _, _ = train_softmax_head(exposed, "adaptive", n_tokens=ctx.budget.head_tokens,
                                        epochs=ctx.budget.head_epochs, seed=ctx.seed + 2)
        makers["softmax-head-adaptive"] = ("SoftmaxHead(adaptive)", lambda i: head)
    inversions: dict[str, list] = {name: [] for name in makers}
    stages = [range(ctx.first_stage), range(ctx.first_stage, len(ctx.prompt_ids))]
    for stage in (s for s in stages if len(s)):
        for name, (_, make) in makers.items():
            inversions[name] += invert_all(exposed, make, loaded.tokenizer, indices=stage)
        done = ctx.prompt_ids[:stage.stop]
        attacks = {name: {"decoder": decoder, **summarise(name, done, inversions[name]).to_dict()}
                   for name, (decoder, _) in makers.items()}
        claim = claim_after(attacks, ctx.threshold, ctx.bound)
        if claim == "leaks":
            break
    recovery = max(a["token_accuracy"] for a in attacks.values())
    recovery_upper95 = max(a["token_accuracy_upper95"] for a in attacks.values())
    excess_upper95 = max(a["token_accuracy_excess_upper95"] for a in attacks.values())
    sigmas = exposed.sigmas
    return {
        "utility_loss": utility_loss(util, ctx.utility_use), "utility_use": ctx.utility_use,
        "continued_ppl_rel_increase": util.continued_ppl_rel_increase,
        "ppl_rel_increase": float(util.ppl_rel_increase), "ppl_clean": util.ppl_clean, "ppl_served": util.ppl_served,
        "top1_agreement": {"served": util.top1_agreement, "continued": util.continued_top1_agreement}.get(ctx.utility_use),
        "use_metrics": util.uses[ctx.utility_use]["metrics"],
        "utility_losses": {use: utility_loss(util, use) for use in UTILITY_USES},
        "state_rel_l2": util.state_rel_l2,
        "recovery": float(recovery), "recovery_upper95": float(recovery_upper95),
        "recovery_excess_upper95": float(excess_upper95),
        "n_tokens": sum(len(ids) for ids in done), "n_prompts": len(done), "claim": claim,
        "strongest_attack": max(attacks, key=lambda k: attacks[k]["token_accuracy"]),
        "attacks": attacks, "defense_params": chain.params(), "sigma_abs_median": float(sorted(sigmas)[len(sigmas) // 2]),
        "seconds": time.perf_counter() - started,
    }
