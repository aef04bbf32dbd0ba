"""The defence search space: families, their conditional parameters, and one trial's evaluation.

Families (``FAMILIES``) and the Optuna parameters each one draws (names are shared, so a chain
reuses its members' distributions):

- ``noise``: ``noise.sigma`` log-uniform in [sigma_low, sigma_high], a multiple of the state RMS
  (``relative_to='rms'``); ``noise.placement`` in (model, exposure). ``model`` injects the noise
  inside the served network (costs perplexity), ``exposure`` only noises the exported copy (no
  perplexity cost by construction; its cost is the exposure's fidelity, reported as
  ``state_rel_l2``).
- ``quant``: ``quant.mode`` in QUANT_MODES: bnb weights (int8/nf4/fp4), stored activations
  (act-int8/act-nf4/act-fp4) or both (nf4+act-nf4).
- ``tying``: ``tying.groups`` log-uniform integer G in [V/64, V-1]: the number of distinct
  input-embedding rows left. Built with ``rare = V - G`` (the V - G rarest tokens take their nearest
  frequent token's row), because k-means of a 49k x 576 embedding into thousands of groups does not
  fit a 2-core budget; ``tying_method='kmeans'`` uses ``groups=G`` k-means instead (tiny models).
- ``pooling``: ``pooling.mode`` in (mean, max), ``pooling.over`` in (all, window) and, for window,
  ``pooling.k`` in [2, prompt length].
- ``quant+noise``: a chain, quant first (``quant.mode``, ``noise.sigma``, ``noise.placement``).

Each trial (:func:`evaluate`) builds the defence with :func:`defenses.registry.make_chain`, measures
its utility cost with :func:`defenses.utility.utility_cost` and its recovery (token accuracy) by the
strongest adaptive attacks on a fixed prompt subset. The attack for each exposure is chosen by
:func:`benchmarks.run.sipit_attack` (the benchmark run's rule), then rebuilt with the search's
smaller shortlist / beam (``AttackBudget``) so a trial fits a CPU budget; the adaptive softmax head
is trained as in benchmarks.run (exposure applied by ``benchmarks.run._exposure_fn``).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

FAMILIES = ("noise", "quant", "tying", "pooling", "quant+noise")
QUANT_MODES = ("int8", "nf4", "fp4", "act-int8", "act-nf4", "act-fp4", "nf4+act-nf4")
SEARCH_ATTACKS = ("sipit", "softmax-head")


@dataclass
class AttackBudget:
    """How much each attack may spend per position (smaller = faster, weaker)."""

    k_prior: int = 16  # MAP / NN shortlist: the prior's top tokens
    k_grad: int = 16  # ... plus this many gradient-ranked tokens
    pooled_beam: int = 4
    pooled_topk: int = 64
    head_tokens: int = 1024
    head_epochs: int = 8

    def shortlist(self) -> dict:
        """CandidateScorer options: exactly k_prior + k_grad candidates per position (position 0 aside)."""
        from attacks.robust import GRADIENT_SHORTLIST

        return {"k_prior": self.k_prior, "k_grad": self.k_grad, **GRADIENT_SHORTLIST}

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
    return family, names, params


def report_group(family: str, params: dict) -> str:
    """The report's row key: the family, with noise split by placement (they cost differently)."""
    if "noise" in family.split("+"):
        return f"{family}[{params.get('noise.placement', params.get('placement', '?'))}]"
    return family


# --------------------------------------------------------------------------- evaluation
class TrialContext:
    """What every trial of one worker shares: model, layer, prompts, seeds, budgets."""

    def __init__(self, loaded, layer: int, prompt_ids: list[list[int]], *, seed: int, utility_tokens: int,
                 attacks: list[str], budget: AttackBudget, robust: str = "radius"):
        from sipit.whitebox import WhiteBox

        self.loaded, self.layer, self.prompt_ids = loaded, layer, prompt_ids
        self.clean_wb = WhiteBox(loaded.model)
        self.seed, self.utility_tokens, self.attacks, self.budget, self.robust = seed, utility_tokens, attacks, budget, robust
        self._served_cache: dict = {}

    def chain(self, names: list[str], params: dict):
        """The defence; quantised / tied served copies are shared between trials of the same setting."""
        from defenses.registry import make_chain

        if "noise" in names:
            params = dict(params, seed=self.seed + 1)
        chain = make_chain(names, **params)
        for member in getattr(chain, "members", [chain]):
            key = (member.name, tuple(sorted((k, str(v)) for k, v in member.params().items())))
            if member.name in ("quant", "tying"):
                if key in self._served_cache:
                    member._cache = self._served_cache[key]
                else:
                    member.serve(self.loaded, self.layer)
                    self._served_cache.clear()  # keep one copy at a time (memory)
                    self._served_cache[key] = member._cache
        return chain


def _fast_attack(attack, chain, budget: AttackBudget):
    """Rebuild the attack chosen by benchmarks.run.sipit_attack with the search's budget."""
    from attacks.robust import MapDecoder, NearestNeighbour
    from defenses.pooled_attack import PooledBeamAttack

    if isinstance(attack, MapDecoder):
        return MapDecoder(attack.sigma, **budget.shortlist())
    if isinstance(attack, NearestNeighbour) and attack.stop == "shortlist":
        return NearestNeighbour(stop="shortlist", sigma=attack.sigma, **budget.shortlist())
    if isinstance(attack, PooledBeamAttack):
        return PooledBeamAttack(attack.pooling, beam=budget.pooled_beam, topk=budget.pooled_topk)
    return attack


def evaluate(ctx: TrialContext, names: list[str], params: dict) -> dict:
    """Utility cost and per-attack recovery of one defence setting (the trial's measurement)."""
    from attacks.head import train_head
    from benchmarks.corpus import corpus_states
    from benchmarks.metrics import summarise
    from benchmarks.run import _exposure_fn, sipit_attack
    from defenses.utility import utility_cost
    from sipit.whitebox import WhiteBox

    started = time.perf_counter()
    chain = ctx.chain(names, params)
    loaded, layer = ctx.loaded, ctx.layer
    util = utility_cost(loaded, chain, layer, n_tokens=ctx.utility_tokens, seed=ctx.seed)
    served = chain.serve(loaded, layer)
    attacker = chain.attacker_model(loaded, layer, True)
    served_wb = ctx.clean_wb if served.model is loaded.model else WhiteBox(served.model)
    attacker_wb = ctx.clean_wb if attacker.model is loaded.model else WhiteBox(attacker.model)
    generator = torch.Generator().manual_seed(ctx.seed + 1)
    exposures, sigmas, exact = [], [], []
    for ids in ctx.prompt_ids:
        h = served_wb.states(ids, layer)
        exposed = chain.expose(h, generator)
        exposures.append(exposed)
        sigmas.append(float(chain.noise_sigma(h)))
        exact.append(bool(chain.per_position and torch.equal(exposed, attacker_wb.states(ids, layer))))
    attacks: dict[str, dict] = {}
    if "sipit" in ctx.attacks:
        inversions, decoder = [], ""
        for i, ids in enumerate(ctx.prompt_ids):
            attack = _fast_attack(sipit_attack(chain, sigmas[i], exact[i], robust=ctx.robust, beam_width=4,
                                               seed=ctx.seed), chain, ctx.budget)
            decoder = f"{type(attack).__name__}({getattr(attack, 'name', '')})"
            if chain.per_position:
                inversions.append(attack.invert(exposures[i], attacker_wb, layer, loaded.tokenizer))
            else:
                inversions.append(attack.invert(exposures[i], attacker_wb, layer, loaded.tokenizer, length=len(ids)))
        attacks["sipit"] = {"decoder": decoder, **summarise("sipit", ctx.prompt_ids, inversions).to_dict()}
    if "softmax-head" in ctx.attacks and chain.per_position:
        corpus = corpus_states(attacker, attacker_wb, layer, n_tokens=ctx.budget.head_tokens)
        head, _ = train_head(corpus.states, corpus.ids, vocab_size=attacker_wb.vocab_size, windows=corpus.windows,
                             epochs=ctx.budget.head_epochs, seed=ctx.seed + 2, variant="adaptive",
                             augment=_exposure_fn(chain))
        inversions = [head.invert(e, attacker_wb, layer, loaded.tokenizer) for e in exposures]
        attacks["softmax-head-adaptive"] = {"decoder": "SoftmaxHead(adaptive)",
                                            **summarise("softmax-head-adaptive", ctx.prompt_ids, inversions).to_dict()}
    recovery = max(a["token_accuracy"] for a in attacks.values())
    return {
        "utility_loss": float(util.ppl_rel_increase),
        "ppl_rel_increase": float(util.ppl_rel_increase), "ppl_clean": util.ppl_clean, "ppl_served": util.ppl_served,
        "top1_agreement": util.top1_agreement, "state_rel_l2": util.state_rel_l2,
        "recovery": float(recovery), "strongest_attack": max(attacks, key=lambda k: attacks[k]["token_accuracy"]),
        "attacks": attacks, "defense_params": chain.params(), "sigma_abs_median": float(sorted(sigmas)[len(sigmas) // 2]),
        "seconds": time.perf_counter() - started,
    }
