"""Every attack, registered once by name: how each is built, and which one knows a given exposure.

An attack is built from two things:

- :class:`Exposure`: what the attacker knows about the states it inverts: the absolute noise
  sigma per coordinate (0: none), whether the states are exactly the model's (``exact``: no noise,
  no quantised activations), the pooling defence when the exposure is pooled (no
  per-position states), the tying groups, the keyed scheme (and any known (prompt, exposure) pairs
  under its key) and the DP mechanism. Each defence declares its part (defenses.base.Defense.knowledge).
- :class:`AttackOptions`: the caller's choices: the noise-robust decoder (``robust``), beam
  width, seed, and the budget that bounds the shortlist decoders (``shortlist``: CandidateScorer
  overrides; ``max_candidates`` for the radius stop; the pooled beam's ``pooled_beam`` and
  ``pooled_topk``).

``build(name, exposure, options)`` is the only way ``benchmarks.run``, ``benchmarks.search`` and
``benchmarks.experiments.noise`` make an attack. ``"sipit"`` is the strongest SipIt form that knows
the exposure (:func:`strongest`):

    pooled exposure              -> "pooled-beam"   (attacks.pooled.PooledBeamAttack)
    keyed exposure               -> "key-recovery"  (attacks.key_recovery.KeyedAttack: the key's invariants,
                                                     else the key from ``options.known_pairs`` known pairs)
    exact states of a tied model -> "sipit-member"  (attacks.tied.MemberByPrior: SipIt for the group,
                                                     the served model's prior for the member)
    sigma > 0                    -> ROBUST[options.robust]: "map" (the default: greedy MAP over the
                                    shortlist), "beam", "nn-shortlist" or "nn-heuristic" (radius: SipIt's
                                    loop in ``options.policy`` order, stopping inside the noise radius)
    inexact states, sigma 0      -> "nn-gradient": nearest neighbour on the cheap gradient shortlist
                                    (prior top-k + one gradient round): the naive attacker of stored
                                    activations, who does not know their format's error
    exact states                 -> "sipit-exact"   (SipIt, ``options.policy`` order: the learned proposals
                                                     by default, or gradient + prior)

With ``options.policy == "learned"`` the shortlist decoders (map, beam, nn-shortlist) rank their
shortlist with the inverse heads adapted to the exposure's sigma plus the model's prior.

Why MAP and not the radius stop by default: the radius r = sigma sqrt(chi2_d(1 - alpha)) holds the
true token with probability 1 - alpha, but it also admits a wrong token w whose state lies within
about sigma (3 + sqrt(9 + chi2_d(1 - alpha) - d)) (13.9 sigma for d = 576, alpha = 1e-3) of the true
one s (||mu_w - h~||^2 = Delta_w^2 + ||n||^2 - 2 <mu_w - mu_s, n> with ||n||^2 ~ sigma^2 d and the
cross term within 3 sigma Delta_w), and the radius stop takes the first such token in candidate order.
Where the noise is that large against the margins Delta, MAP, which compares the candidates, is the
stronger attacker: smollm2, 20 x 20 tokens, layer 15, sigma 10: radius 0.605, MAP 0.963; layer 30,
sigma 10: 0.970 vs 0.988 (docs/defenses.md). The radius stop remains the cheap choice where 13.9 sigma
is below the margins.

``"blind"`` is the noise decoder ``options.robust`` names, not told sigma: it estimates it from the exposure
(attacks.blind.BlindAttack); a run asks for it beside ``"sipit"`` to set the informed attacker's leakage beside
the blind one's.

The trained baseline (``softmax-head``, attacks.head) is named here too but is trained per run, not
built: :data:`TRAINED` lists it for the callers that train it (benchmarks.pipeline).
``inverse-head`` is the classification baseline made of the learned inverse heads (attacks.head.
InverseHeadAttack; trained once per model and layer and cached, attacks.proposals).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch

from attacks.blind import BlindAttack
from attacks.head import InverseHeadAttack
from attacks.key_recovery import KeyedAttack
from attacks.policies import LearnedPolicy, RandomPolicy, make_policy
from attacks.pooled import PooledBeamAttack
from attacks.robust import GRADIENT_SHORTLIST, MapBeamSearch, MapDecoder, NearestNeighbour
from attacks.sipit import SipIt
from attacks.tied import MemberByPrior


@dataclass(frozen=True)
class Exposure:
    """What the attacker knows about one exposed prompt's states."""

    sigma: float = 0.0  # absolute noise sigma per coordinate (0: no noise)
    exact: bool = True  # the states equal the attacker model's own (bit for bit)
    pooling: object | None = None  # the defences.pooling.Pooling member when the exposure is pooled
    groups: torch.Tensor | None = None  # token -> tied group (defenses.tying) when the attacker holds the tied model
    keyed: dict | None = None  # the keyed mixing's scheme, scope, rank (defenses.keyed), never the key
    known: tuple = ()  # (token ids, exposed states) pairs under the keyed exposure's key that the attacker knows
    dp: dict | None = None  # the DP mechanism, its parameters and noise scale (defenses.dp)


@dataclass(frozen=True)
class AttackOptions:
    """The caller's choices and budget (``None``: the attack's own default)."""

    robust: str = "map"
    beam_width: int = 4
    beam_early_width: int | None = None  # the beam's width at its first positions (MapBeamSearch.early_width)
    beam_early_positions: int | None = None  # how many positions that is (MapBeamSearch.early_positions)
    beam_refine_k: int | None = None  # substitutes per position tried on the beam's path (MapBeamSearch.refine)
    prior_mix: float = 0.0  # MAP's and the beam's prior: (1 - mix) P + mix / V (attacks.robust.mixed_log_prior)
    seed: int = 0
    policy: str = "learned"  # exact SipIt's candidate order (attacks.policies.POLICIES), as the CLI's default
    shortlist: dict | None = None  # CandidateScorer options of the shortlist decoders (nn-*, map, beam)
    max_candidates: int | None = None  # the radius stop's cap (nn-heuristic)
    pooled_beam: int | None = None
    pooled_topk: int | None = None
    progress: bool = False  # progress bars (with ETA) of the one-time builds: position-0 table, inverse heads
    known_pairs: int = 0  # known (prompt, exposure) pairs the key-recovery attacker gets (benchmarks.pipeline)


def _given(**kwargs) -> dict:
    return {k: v for k, v in kwargs.items() if v is not None}


def _shortlist(o: AttackOptions) -> dict:
    """CandidateScorer options of the shortlist decoders: ``options.shortlist`` over the ranking the
    policy implies (``learned``: the noise-adapted inverse heads + prior, attacks.robust)."""
    return {**({"ranking": "learned"} if o.policy == "learned" else {}), **(o.shortlist or {})}


def _pooled(e: Exposure, o: AttackOptions):
    """The pooled beam; with the learned policy its candidates add the learned proposals (attacks.pooled)."""
    proposals = LearnedPolicy(progress=o.progress) if o.policy == "learned" else None
    return PooledBeamAttack(e.pooling, proposals=proposals, **_given(beam=o.pooled_beam, topk=o.pooled_topk))


def _keyed(e: Exposure, o: AttackOptions):
    """Key recovery for the keyed scheme, with the known pairs of the exposure (at most ``options.known_pairs``)."""
    if e.keyed is None:
        raise ValueError("key-recovery attacks a keyed exposure (defenses.keyed: permute, rotate); this one is not")
    return KeyedAttack(e.keyed["scheme"], known=list(e.known[: o.known_pairs]), progress=o.progress, fallback=True,
                       policy=make_policy(o.policy, progress=o.progress), seed=o.seed)


def _blind(e: Exposure, o: AttackOptions):
    """The ``options.robust`` noise decoder, built for the sigma it estimates from the exposure."""
    if o.robust not in ROBUST:
        raise ValueError(f"robust must be one of {tuple(ROBUST)}, got {o.robust!r}")
    return BlindAttack(lambda sigma: BUILDERS[ROBUST[o.robust]](replace(e, sigma=sigma), o), progress=o.progress)


#: name -> builder(exposure, options). Adding an attack is one entry here.
BUILDERS: dict[str, Callable[[Exposure, AttackOptions], object]] = {
    "sipit-exact": lambda e, o: SipIt(make_policy(o.policy, progress=o.progress), seed=o.seed),
    "sipit-member": lambda e, o: MemberByPrior(SipIt(make_policy(o.policy, progress=o.progress), seed=o.seed), e.groups),
    "bruteforce": lambda e, o: SipIt(RandomPolicy(), use_prior=False, seed=o.seed),
    "nn-heuristic": lambda e, o: NearestNeighbour(make_policy(o.policy, progress=o.progress), stop="heuristic", sigma=e.sigma,
                                                  **_given(max_candidates=o.max_candidates)),
    "nn-shortlist": lambda e, o: NearestNeighbour(stop="shortlist", sigma=e.sigma, progress=o.progress,
                                                  **_shortlist(o)),
    "nn-gradient": lambda e, o: NearestNeighbour(stop="shortlist", sigma=e.sigma,
                                                 **{**GRADIENT_SHORTLIST, **(o.shortlist or {})}),
    "map": lambda e, o: MapDecoder(e.sigma, prior_mix=o.prior_mix, progress=o.progress, **_shortlist(o)),
    "beam": lambda e, o: MapBeamSearch(e.sigma, width=o.beam_width, early_width=o.beam_early_width,
                                       prior_mix=o.prior_mix, progress=o.progress, **_given(early_positions=o.beam_early_positions,
                                                                       refine_k=o.beam_refine_k), **_shortlist(o)),
    "pooled-beam": _pooled,
    "inverse-head": lambda e, o: InverseHeadAttack(progress=o.progress),
    "key-recovery": _keyed,
    "blind": _blind,
}
#: --robust choice -> the decoder used under Gaussian noise
ROBUST = {"map": "map", "beam": "beam", "shortlist": "nn-shortlist", "radius": "nn-heuristic"}
#: attacks that are trained on a corpus rather than built (benchmarks.pipeline trains them)
TRAINED = ("softmax-head",)
#: the names a benchmark run accepts in --attacks
RUN_ATTACKS = ("sipit", "softmax-head", "inverse-head", "bruteforce", "blind")
#: attacks whose ``verified`` flags mean "exact acceptance" on exact exposure (attacks.result.layer_hint)
EXACT_ATTACKS = ("sipit", "bruteforce")


def strongest(exposure: Exposure, options: AttackOptions) -> str:
    """The registry name of the strongest SipIt form that knows ``exposure`` (module docstring)."""
    if options.robust not in ROBUST:
        raise ValueError(f"robust must be one of {tuple(ROBUST)}, got {options.robust!r}")
    if exposure.pooling is not None:
        return "pooled-beam"
    if exposure.keyed is not None:
        return "key-recovery"
    if exposure.sigma > 0:
        return ROBUST[options.robust]
    if not exposure.exact:
        return "nn-gradient"
    return "sipit-member" if exposure.groups is not None else "sipit-exact"


def build(name: str, exposure: Exposure = Exposure(), options: AttackOptions = AttackOptions()):
    """The attack registered as ``name`` (``"sipit"``: :func:`strongest`) for ``exposure``."""
    if name == "sipit":
        name = strongest(exposure, options)
    if name not in BUILDERS:
        raise ValueError(f"unknown attack {name!r}: choose from {', '.join(['sipit', *BUILDERS])}")
    return BUILDERS[name](exposure, options)


def describe(attack) -> str:
    """``Class(name)``: the decoder that ran, as results and MLflow record it."""
    return f"{type(attack).__name__}({getattr(attack, 'name', '')})"
