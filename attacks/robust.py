"""Noise-robust SipIt decoders: nearest neighbour, MAP with the model's prior, beam search.

Noise model (known to the attacker): h~_t = h_t + n_t, n_t ~ N(0, sigma^2 I_d), sigma absolute
per coordinate. For the true token ||h~_t - mu_{p_t,s_t}||^2 / sigma^2 ~ chi^2_d, so the noise
radius used for ``PositionRecord.radius`` is ``sigma * sqrt(chi2.ppf(1 - alpha, d))`` and
``verified`` means the chosen token's distance lies inside it. ``sigma = 0`` is read as
"floating-point noise only": the effective sigma is never below
``acceptance_radius(h~_t) / sqrt(d)`` (sipit.tolerance), so every decoder degrades to exact
SipIt acceptance at sigma = 0.

One search, :class:`MapBeamSearch`, over prefixes scored by the summed log-likelihood
sum_t [-||mu - h~_t||^2 / (2 sigma^2) + log P(s_t | p_t)] (the prior term optional), with
backtracking: when the best squared distance at step t is implausible (chi2 tail
P(chi^2_d >= d2 / sigma^2) < alpha), the next-best pruned hypotheses for position t-1 are revived
(``width`` per round, at most ``max_backtracks`` rounds per call) and expanded at t alongside the
beam; the summed score picks the survivors, so a wrong commit at t-1 is undone while an outlier at
t itself (every prefix equally bad) leaves the best prefix in place. Backtracking reaches one
position back. With ``refine_k`` the returned path is then refined (:meth:`MapBeamSearch.refine`):
single-token substitutions, each scored on the whole path, kept while they lower its energy; they read the
states after the substituted position, which the beam could not read when it pruned. The greedy decoders
are this search of width 1 without backtracking (all expose ``name`` and
``invert(observed, whitebox, layer, tokenizer, length=None) -> Inversion``):

- :class:`NearestNeighbour` — argmin_v ||mu_{p_t,v} - h~_t|| (the prior scores nothing). Candidates:
  ``exact``: the whole vocabulary (chunked, :func:`sipit.sweep.sweep_distances`); provably the
  nearest neighbour (no bound cheaper than a full scan is known to us).
  ``heuristic`` (:class:`RadiusScorer`): SipIt's own loop (attacks.sipit.verify: the policy's
  order, growing batches) until the best so far lies inside the noise radius (or after
  ``max_candidates``). It can stop on a wrong token that happens to lie inside the radius;
  benchmarks.experiments.noise measures how often.
  ``shortlist``: the shared shortlist (below), for a like-for-like comparison with MAP and beam.
- :class:`MapDecoder` — argmin_v ||mu_v - h~_t||^2 / (2 sigma^2) - log P(v | p_t), prior =
  the model's own next-token distribution (sipit.prior.NextTokenPrior).

Candidate restriction (HEURISTIC unless ``exact=True``): MAP, beam and NN-``shortlist`` score a
shortlist per position (:class:`CandidateScorer`): the prior's top ``k_prior`` tokens, the
tokens a linear surrogate of Phi^l is fitted on, and the surrogate's nearest predictions
(attacks.surrogate; re-fitted once around the target), widened while the nearest so far is
implausible under the chi2 noise model. The true token can still fall outside it;
benchmarks.experiments.noise measures how often. The first ``exact_positions`` (2) positions are scored over
the whole vocabulary from memoised tables (position 0's is prefix-free: paid once per layer).
``exact=True``
scores the full vocabulary (T x V steps: cheap on tiny models only).
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, field, replace

import torch
from scipy.stats import chi2

from attacks.policies import CandidatePolicy, GradientPolicy, LearnedPolicy, StepContext
from attacks.proposals import HeadConfig, head_noise
from attacks.result import Inversion, PositionRecord
from attacks.sipit import verify
from attacks.surrogate import LinearSurrogate, SurrogateFit
from sipit.sweep import sweep_distances
from sipit.vocab_table import vocabulary_states
from sipit.prior import NextTokenPrior, paths_logprobs
from sipit.tolerance import DEFAULT_REL_TOL, acceptance_radius, check_rel_tol
from sipit.whitebox import PrefixCache, SipitInputError, WhiteBox

STOP_RULES = ("exact", "heuristic", "shortlist")
RANKINGS = ("surrogate", "gradient", "learned", "learned+surrogate")
# The cheap shortlist for near-exact states (quantised exposure, budgeted search trials): position 0
# over the full vocabulary, then the prior's top k_prior and k_grad gradient-ranked tokens per round.
GRADIENT_SHORTLIST = {"ranking": "gradient", "exact_positions": 1}
PATHS_PER_PASS = 16  # whole paths per forward pass of MapBeamSearch.path_energies (B x T x V log-probs held)
REFINE_SWEEPS = 4  # MapBeamSearch.refine: passes over the positions at most


def chi2_radius(sigma: float, d: int, alpha: float) -> float:
    """sigma * sqrt(chi2_d quantile at 1 - alpha): the true token lies inside w.p. 1 - alpha."""
    return float(sigma * math.sqrt(chi2.ppf(1.0 - alpha, d)))


def implausible(squared_distance: float, sigma: float, d: int, alpha: float) -> bool:
    """True when P(chi^2_d >= squared_distance / sigma^2) < alpha."""
    return float(chi2.sf(squared_distance / sigma**2, d)) < alpha


def effective_sigmas(observed: torch.Tensor, sigma: float, rel_tol: float) -> list[float]:
    """Per-position sigma, floored at the floating-point scale acceptance_radius / sqrt(d)."""
    floor = acceptance_radius(observed, rel_tol) / math.sqrt(observed.shape[1])
    return [max(float(sigma), float(f)) for f in floor]


def _check(sigma: float, alpha: float, rel_tol: float) -> None:
    if not sigma >= 0 or not math.isfinite(sigma):
        raise ValueError(f"sigma must be a finite number >= 0, got {sigma}")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must lie in (0, 1), got {alpha}")
    check_rel_tol(rel_tol)


def _record(position: int, token: int, distance: float, radius: float, tried: int, seconds: float) -> PositionRecord:
    """The record of a decoded position; verified only for a finite distance inside the radius.

    A decoder that found no candidate at a finite distance has no answer: it raises instead of
    returning a placeholder token."""
    if token < 0 or not math.isfinite(distance):
        raise SipitInputError(
            f"position {position}: no candidate lies at a finite distance from the observed state "
            f"(distance {distance}); the states are outside what this model produces")
    return PositionRecord(position, token, distance, radius, tried, seconds, distance <= radius)


@dataclass
class Scored:
    """Candidates scored at one position: token ids and their distances to h~_t."""

    candidates: torch.Tensor  # (n,) long
    distances: torch.Tensor  # (n,) float


class CandidateScorer:
    """Scores candidates at one position: the full vocabulary (exact) or a shortlist.

    Shortlist (``ranking="surrogate"``, the default): the prior's top ``k_prior`` tokens, the
    ``n_fit`` tokens the linear surrogate is fitted on (attacks.surrogate; memoised per prefix),
    the surrogate's top ``k_proxy``, then, after re-fitting on the verified tokens nearest to h~
    and re-ranking the first ranking's best ``n_rerank``, the next ``k_proxy``; then up to
    ``extra_rounds`` more rounds (doubling) while the nearest so far is implausible under the chi2
    noise model. The first ``exact_positions`` positions are scored over the whole vocabulary.
    ``ranking="gradient"``:
    prior top ``k_prior`` then ``rounds`` rounds of ``k_grad`` from the gradient ranking (the
    earlier shortlist; measured far weaker under noise, docs/noise.md "Decoders").
    ``ranking="learned"``: prior top ``k_prior``, then the top ``k_proxy`` of
    log q(v | h~_t) + log P(v | p_t) (the inverse head of the position, attacks.proposals, applied
    to the noisy state, plus the model's prior), doubling while implausible; only position 0 is
    scored over the whole vocabulary (its table), since position 1 has a head of its own.
    ``ranking="learned+surrogate"``: the learned rounds, then the surrogate's (its fit, its top
    ``k_proxy``, the re-ranked pool, doubling only while the nearest so far is still implausible):
    the union of the two shortlists, for noise at which either alone misses the true token often
    (layer 15, sigma 19.3: the learned shortlist at a third of the positions, the surrogate's at 3%).
    ``k_wide`` (learned rankings): the best hypothesis of a beam (the one that widens) also takes,
    at once, the top ``k_wide`` of log q + log P and the top ``k_wide`` of the head alone, log q
    (the prior ranks the tokens of unnatural text, names and numbers far down). At the noise where
    greedy nearest neighbour is at 50% a wrong token lies inside the chi2 radius, so the doubling
    rounds stop after the first ``k_proxy``; at smollm2's last layer the true token the shortlist
    missed ranked 75-8,058 under head + prior (a random-token prompt's: 8,058, and 836 under the head alone).
    At layer 15 ``k_wide=2048`` gained nothing (docs/noise.md). Default 0: no such take.
    :meth:`prepare` loads or trains the heads once per (model, layer).
    """

    def __init__(self, *, exact: bool = False, k_prior: int = 32, k_grad: int = 32, rounds: int = 1,
                 chunk: int = 1024, extra_rounds: int = 3, alpha: float = 1e-3, exact_positions: int | None = None,
                 ranking: str = "surrogate", n_fit: int = 1536, k_proxy: int = 128, n_rerank: int = 4096,
                 k_wide: int = 0, head_config: HeadConfig | None = None):
        if exact_positions is None:
            exact_positions = 1 if "learned" in ranking.split("+") else 2
        if min(k_prior, rounds, extra_rounds, exact_positions, k_wide) < 0 or min(k_grad, k_proxy, n_rerank) < 1:
            raise ValueError("need k_prior, rounds, extra_rounds, exact_positions, k_wide >= 0 and k_grad, k_proxy, "
                             "n_rerank >= 1")
        if ranking not in RANKINGS:
            raise ValueError(f"ranking must be one of {RANKINGS}, got {ranking!r}")
        self.exact, self.k_prior, self.k_grad, self.rounds, self.chunk = exact, k_prior, k_grad, rounds, chunk
        self.extra_rounds, self.alpha, self.exact_positions, self.ranking = extra_rounds, alpha, exact_positions, ranking
        self.k_proxy, self.n_rerank, self.k_wide = k_proxy, n_rerank, k_wide
        self.surrogate = LinearSurrogate(n_fit=n_fit, chunk=chunk)
        self._gradient = GradientPolicy()
        self._last_fit: SurrogateFit | None = None  # the latest own fit, lent to beam siblings
        self.head_config = head_config or HeadConfig()  # the learned ranking's heads (noise set by prepare)
        self._learned: LearnedPolicy | None = None

    @property
    def rankings(self) -> tuple[str, ...]:
        """The rankings whose rounds build the shortlist, in order (``learned+surrogate``: both)."""
        return tuple(self.ranking.split("+"))

    def prepare(self, whitebox: WhiteBox, layer: int, tokenizer, sigma: float = 0.0, progress: bool = False) -> list[str]:
        """The inverse heads of ``ranking="learned"``, adapted to noise ``sigma`` rounded to the heads'
        grid (attacks.proposals.head_noise; one-time per model, layer and grid sigma); nothing for the
        other rankings."""
        if "learned" not in self.rankings:
            return []
        self._learned = LearnedPolicy(replace(self.head_config, noise=head_noise(float(sigma))), progress=progress)
        return self._learned.prepare(whitebox, layer, tokenizer)

    def score(self, whitebox: WhiteBox, prefix: PrefixCache, target: torch.Tensor,
              prior_logprobs: torch.Tensor | None, sigma: float | None = None, borrow: bool = False) -> Scored:
        """Exact distances of the shortlist (or of every token) to ``target``.

        ``sigma`` enables the extra rounds; ``borrow`` lets a prefix with no memoised surrogate
        fit rank with the latest fit of the same length (beam siblings differ in a token or two).
        """
        if self.exact:
            dist = sweep_distances(whitebox, prefix, target, chunk=self.chunk)
            return Scored(torch.arange(whitebox.vocab_size), dist.cpu())
        if prefix.length < self.exact_positions and (prefix.length == 0 or not borrow):
            # The first positions are scored over the whole vocabulary from memoised tables: the
            # prior knows little there, and the surrogate fits position 1 badly (docs/noise.md).
            # Position 0's table is prefix-free (paid once per layer); beam siblings (borrow) at
            # later exact positions take the shortlist instead of paying V steps each.
            dist = (vocabulary_states(whitebox, prefix, self.chunk) - target).norm(dim=-1).float()
            return Scored(torch.arange(whitebox.vocab_size), dist.cpu())
        shortlist = _Shortlist(whitebox, prefix, target)
        if prior_logprobs is not None and self.k_prior > 0:
            shortlist.run(torch.topk(prior_logprobs, min(self.k_prior, whitebox.vocab_size)).indices.cpu())
        for ranking in self.rankings:
            if ranking == "gradient":
                self._gradient_rounds(shortlist, prior_logprobs, sigma)
            elif ranking == "learned":
                self._learned_rounds(shortlist, prior_logprobs, sigma)
            else:
                self._surrogate_rounds(shortlist, sigma, borrow)
        return shortlist.scored()

    def _implausible(self, shortlist: "_Shortlist", sigma: float | None) -> bool:
        return sigma is not None and implausible(shortlist.best_distance() ** 2, sigma, shortlist.whitebox.d, self.alpha)

    def _surrogate_rounds(self, shortlist: "_Shortlist", sigma: float | None, borrow: bool) -> None:
        wb, prefix = shortlist.whitebox, shortlist.prefix
        lent = self._last_fit
        if borrow and lent is not None and lent.length == prefix.length and not self.surrogate.has_fit(wb, prefix):
            fit = lent  # ranks only: its sample states belong to another prefix and are not scored here
        else:
            fit = self._last_fit = self.surrogate.fit(wb, prefix)
            shortlist.add(fit.sample.cpu(), fit.sample_states)
        order = torch.argsort(self.surrogate.predicted_sq_distances(wb, fit, shortlist.target)).cpu()
        shortlist.run(shortlist.untried(order, self.k_proxy))
        # Re-rank the best n_rerank of the first ranking with a map re-fitted around the target.
        pool = shortlist.untried(order, self.n_rerank)
        coef = self.surrogate.refine(wb, fit, *shortlist.nearest(self.k_proxy))
        pool = pool[torch.argsort(self.surrogate.subset_sq_distances(wb, fit.layer, coef, pool, shortlist.target).cpu())]
        in_pool = torch.zeros(wb.vocab_size, dtype=torch.bool)
        in_pool[pool] = True
        order = torch.cat([pool, order[~in_pool[order]]])  # the rest keeps the first ranking
        self._take(shortlist, order, sigma)

    def _take(self, shortlist: "_Shortlist", order: torch.Tensor, sigma: float | None) -> None:
        """The first ``k_proxy`` untried tokens of ``order``, then up to ``extra_rounds`` doublings while
        the nearest so far is implausible under the noise model."""
        size = self.k_proxy
        shortlist.run(shortlist.untried(order, size))
        for _ in range(self.extra_rounds):
            if not self._implausible(shortlist, sigma):
                break
            size *= 2
            shortlist.run(shortlist.untried(order, size))

    def _learned_rounds(self, shortlist: "_Shortlist", prior_logprobs: torch.Tensor | None, sigma: float | None) -> None:
        if self._learned is None or not self._learned.heads:
            raise RuntimeError("CandidateScorer.prepare() must run before a learned ranking scores")
        head = self._learned.head_log_probs(shortlist.prefix.length, shortlist.target)
        scores = head + prior_logprobs.cpu() if prior_logprobs is not None else head
        order = torch.argsort(scores, descending=True)
        if sigma is not None and self.k_wide:  # the widening hypothesis: both orders' fixed take
            by_head = torch.topk(head, min(self.k_wide, head.numel())).indices
            shortlist.run(torch.unique(torch.cat([order[: self.k_wide], by_head])))
        self._take(shortlist, order, sigma)

    def _gradient_rounds(self, shortlist: "_Shortlist", prior_logprobs: torch.Tensor | None, sigma: float | None) -> None:
        ctx = StepContext(shortlist.whitebox, shortlist.prefix, shortlist.target, prior_logprobs, torch.Generator())
        if not shortlist.ids:
            shortlist.run(self._gradient.gradient_order(ctx)[: self.k_grad].cpu())
        size = self.k_grad
        for r in range(self.rounds + self.extra_rounds):
            if r >= self.rounds:
                # Extra rounds only while the nearest so far is implausible under the noise model
                # (the true token is then probably not in the shortlist yet); batches double.
                if not self._implausible(shortlist, sigma):
                    break
                size *= 2
            ctx.anchor = shortlist.best_token()
            shortlist.run(shortlist.untried(self._gradient.gradient_order(ctx).cpu(), size))


class _Shortlist:
    """The candidates verified so far at one position, with their exact states and distances."""

    def __init__(self, whitebox: WhiteBox, prefix: PrefixCache, target: torch.Tensor):
        self.whitebox, self.prefix, self.target = whitebox, prefix, target
        self.tried = torch.zeros(whitebox.vocab_size, dtype=torch.bool)
        self.ids: list[torch.Tensor] = []
        self.states: list[torch.Tensor] = []

    def untried(self, order: torch.Tensor, n: int) -> torch.Tensor:
        return order[~self.tried[order]][:n]

    def add(self, ids: torch.Tensor, states: torch.Tensor) -> None:
        """Record exactly computed states (those already recorded are skipped)."""
        new = ~self.tried[ids]
        if bool(new.any()):
            self.tried[ids[new]] = True
            self.ids.append(ids[new])
            self.states.append(states[new.to(states.device)])

    def run(self, ids: torch.Tensor) -> None:
        """Compute the states of ``ids`` on the prefix (one batched step) and record them."""
        ids = ids[~self.tried[ids]]
        if ids.numel():
            self.add(ids, self.whitebox.step(self.prefix, ids).states)

    def distances(self) -> torch.Tensor:
        return (torch.cat(self.states) - self.target).norm(dim=-1).float().cpu()

    def best_distance(self) -> float:
        return float(self.distances().min())

    def best_token(self) -> int:
        return int(torch.cat(self.ids)[self.distances().argmin()])

    def nearest(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``k`` recorded tokens nearest to the target, with their states."""
        pick = torch.argsort(self.distances())[:k]
        return torch.cat(self.ids)[pick], torch.cat(self.states)[pick.to(self.states[0].device)]

    def scored(self) -> Scored:
        return Scored(torch.cat(self.ids), self.distances())


def _inversion(records: list[PositionRecord], started: float, whitebox: WhiteBox, tokenizer,
               setup: list[str]) -> Inversion:
    ids = [r.token for r in records]
    return Inversion(ids=ids, text=tokenizer.decode(ids) if tokenizer is not None else "",
                     positions=records, seconds=time.perf_counter() - started, vocab_size=whitebox.vocab_size,
                     setup=setup)


class RadiusScorer:
    """The candidates SipIt's own loop verifies (attacks.sipit.verify: the policy's order, batches
    doubling from ``batch_size``) until the nearest lies inside the chi-square noise radius
    sigma * sqrt(chi2_d(1 - alpha)), or ``max_candidates`` (default: the vocabulary) are tried.
    HEURISTIC: it can stop on a wrong token that happens to lie inside the radius."""

    exact = False

    def __init__(self, policy: CandidatePolicy | None = None, *, alpha: float = 1e-3, batch_size: int | None = None,
                 max_candidates: int | None = None):
        self.policy = policy if policy is not None else GradientPolicy()
        self.batch_size = self.policy.first_batch if batch_size is None else batch_size
        self.alpha, self.max_candidates = alpha, max_candidates

    def prepare(self, whitebox: WhiteBox, layer: int, tokenizer, sigma: float = 0.0, progress: bool = False) -> list[str]:
        """The policy's one-time resources for (model, ``layer``) (attacks.policies; its heads are the
        clean ones whatever ``sigma``: the radius stop accepts what the noise radius admits)."""
        return self.policy.prepare(whitebox, layer, tokenizer)

    def score(self, whitebox: WhiteBox, prefix: PrefixCache, target: torch.Tensor,
              prior_logprobs: torch.Tensor | None, sigma: float | None = None, borrow: bool = False) -> Scored:
        radius = chi2_radius(sigma, whitebox.d, self.alpha)
        ctx = StepContext(whitebox, prefix, target, prior_logprobs, torch.Generator().manual_seed(prefix.length))
        self.policy.start(ctx)
        cap = whitebox.vocab_size if self.max_candidates is None else self.max_candidates
        found = verify(whitebox, prefix, target, radius, self.policy, ctx, first_batch=self.batch_size, max_batch=cap,
                       cap=cap)
        return Scored(torch.cat(found.ids).cpu(), torch.cat(found.distances).float().cpu())


def step_energy(squared: torch.Tensor, sigma: float, log_prior: torch.Tensor | None = None) -> torch.Tensor:
    """Negative log posterior of a token at one position, up to a constant:
    e = ||h(x) - h~||^2 / (2 sigma^2) - log P(x | prefix), the prior term only when ``log_prior`` is given."""
    energy = squared.double() / (2 * sigma**2)
    return energy if log_prior is None else energy - log_prior.double()


def mixed_log_prior(log_prior: torch.Tensor, mix: float) -> torch.Tensor:
    """log((1 - mix) P(v | prefix) + mix / V): the model's prior with ``mix`` of its mass spread evenly over
    the V tokens. A prompt is not always text the model would write (names, numbers, identifiers, random
    tokens); under the plain prior such a token costs 20-40 nats, under the mixture at most log(V / mix)."""
    if mix == 0.0:
        return log_prior
    uniform = torch.full_like(log_prior, math.log(mix / log_prior.shape[-1]))
    return torch.logaddexp(log_prior + math.log1p(-mix), uniform)


def map_scores(scored: Scored, prior: torch.Tensor | None, sigma: float) -> torch.Tensor:
    """:func:`step_energy` of each scored candidate."""
    log_prior = prior.cpu()[scored.candidates] if prior is not None else None
    return step_energy(scored.distances.double().pow(2), sigma, log_prior)


@dataclass(order=True)
class _Pending:
    """A scored, not yet materialised child hypothesis (ordered by -score for heapq)."""

    neg_score: float
    token: int = field(compare=False)
    distance: float = field(compare=False)
    candidates: torch.Tensor = field(compare=False)  # every candidate scored at this position
    energies: torch.Tensor = field(compare=False)  # their step energies (attacks.robust.step_energy)
    parent: "_Hyp" = field(compare=False)


@dataclass
class _Hyp:
    tokens: list[int]
    records: list[PositionRecord]
    score: float
    prefix: PrefixCache | None  # cache of tokens[:-1] + tokens[-1] once materialised
    prior: NextTokenPrior | None
    candidates: list[torch.Tensor]  # the candidates scored at each position of the path
    energies: list[torch.Tensor]  # their step energies


class MapBeamSearch:
    """Beam search over prefixes scored by the summed Gaussian log-likelihood plus log prior, with
    chi-square backtracking (module docstring). Greedy decoding is this search of width 1 without
    backtracking: :class:`MapDecoder` (MAP), :class:`NearestNeighbour` (distance only)."""

    name = "beam"

    def __init__(self, sigma: float, width: int = 4, prior: bool = True, backtrack: bool = True, alpha: float = 1e-3,
                 *, rel_tol: float = DEFAULT_REL_TOL, exact: bool = False, max_backtracks: int = 8,
                 early_width: int | None = None, early_positions: int = 2, prior_mix: float = 0.0,
                 refine_k: int = 0, progress: bool = False, scorer: CandidateScorer | RadiusScorer | None = None,
                 **shortlist):
        """``scorer``: the candidates scored per position (default: a :class:`CandidateScorer` with
        ``exact`` and the ``shortlist`` options k_prior, ranking, n_fit, k_proxy, chunk, ...).
        ``early_width`` (default ``width``): the hypotheses kept after each of the first ``early_positions``
        positions, where the prior knows least and a pruned true token is lost before the later states,
        which also depend on it, are read (benchmarks.experiments.noise: the search errors at layer 15).
        ``prior_mix``: the prior term scores :func:`mixed_log_prior` (0: the model's own prior).
        ``refine_k`` > 0: the returned path goes through :meth:`refine` with that many substitutes per position."""
        _check(sigma, alpha, rel_tol)
        early_width = width if early_width is None else early_width
        if not 0.0 <= prior_mix < 1.0:
            raise ValueError(f"prior_mix must lie in [0, 1), got {prior_mix}")
        if min(width, early_width) < 1 or min(early_positions, refine_k) < 0:
            raise ValueError(f"width and early_width must be >= 1 and early_positions, refine_k >= 0, got {width}, "
                             f"{early_width}, {early_positions}, {refine_k}")
        self.sigma, self.width, self.use_prior, self.backtrack, self.alpha = sigma, width, prior, backtrack, alpha
        self.early_width, self.early_positions, self.prior_mix = early_width, early_positions, prior_mix
        self.refine_k, self.substitutions = refine_k, 0  # substitutions: kept by refine() in the last call
        self.searched: list[int] = []  # the search's own path of the last call, before refine()
        self.rel_tol, self.max_backtracks, self.progress = rel_tol, max_backtracks, progress
        self.scorer = scorer if scorer is not None else CandidateScorer(exact=exact, alpha=alpha, **shortlist)
        self.backtracks = 0  # of the last call
        self.last_candidates: list[torch.Tensor] = []  # candidates scored per position on the returned path

    def width_at(self, t: int) -> int:
        """The hypotheses kept after position t: ``early_width`` for the first ``early_positions``, then ``width``."""
        return self.early_width if t < self.early_positions else self.width

    def _expand(self, hyp: _Hyp, whitebox, target, sigma, radius, widen: bool = True) -> list[_Pending]:
        """Score hyp's children. Only the best hypothesis (``widen``) gets extra rounds and its own
        surrogate fit; the others rank with the fit it lent (attacks.surrogate)."""
        prior = hyp.prior.logprobs if hyp.prior is not None else None
        scored = self.scorer.score(whitebox, hyp.prefix, target, prior, sigma if widen else None, borrow=not widen)
        scoring_prior = mixed_log_prior(prior, self.prior_mix) if self.use_prior and prior is not None else None
        loglik = -map_scores(scored, scoring_prior, sigma)
        k = min(self.width_at(len(hyp.tokens)), loglik.numel())
        top = torch.topk(loglik, k).indices
        return [_Pending(-(hyp.score + float(loglik[j])), int(scored.candidates[j]), float(scored.distances[j]),
                         scored.candidates, -loglik, hyp) for j in top.tolist()]

    def _materialise(self, p: _Pending, whitebox, radius: float, seconds: float, last: bool) -> _Hyp:
        parent = p.parent
        t = len(parent.tokens)
        record = _record(t, p.token, p.distance, radius, int(p.candidates.numel()), seconds)
        prefix, prior = None, None
        if not last:
            prefix = whitebox.extend(parent.prefix, p.token)
            if parent.prior is not None:
                prior = parent.prior.fork()
                prior.push(p.token)
        return _Hyp(parent.tokens + [p.token], parent.records + [record], -p.neg_score, prefix, prior,
                    parent.candidates + [p.candidates], parent.energies + [p.energies])

    def path_energy(self, observed: torch.Tensor, whitebox: WhiteBox, layer: int, ids: list[int]) -> float:
        """The energy this search minimises, of one whole path ``ids`` (minus the score it maximises):
        E(x) = sum_t :func:`step_energy` = sum_t ||h_t(x) - h~_t||^2 / (2 sigma_t^2) - log P(x_t | x_<t), the
        prior term (:func:`mixed_log_prior` with ``prior_mix``) only when the search uses the prior, sigma_t
        from :func:`effective_sigmas`. A decoded path with E no higher than the true path's is an error of the
        posterior, which no search over this score fixes; one with a higher E is an error of the search."""
        layer = whitebox.resolve_layer(layer)
        observed = whitebox.check_states(observed, len(ids))
        sigmas = effective_sigmas(observed, self.sigma, self.rel_tol)
        return float(self.path_energies(observed, whitebox, layer, torch.tensor([list(ids)]), sigmas)[0])

    @torch.no_grad()
    def path_energies(self, observed: torch.Tensor, whitebox: WhiteBox, layer: int, paths: torch.Tensor,
                      sigmas: list[float]) -> torch.Tensor:
        """:meth:`path_energy` of each row of the ``(B, T)`` id batch ``paths`` (``layer`` resolved, ``sigmas`` the
        :func:`effective_sigmas` of ``observed``): one forward pass to ``layer`` and one through the whole
        model (the prior) per :data:`PATHS_PER_PASS` paths, ``(B,)`` float64."""
        sig = torch.tensor(sigmas, dtype=torch.float64)
        out = []
        for chunk in paths.split(PATHS_PER_PASS):
            squared = (whitebox.states_batch(chunk, layer).double().cpu() - observed.double().cpu()).pow(2).sum(-1)
            taken = None
            if self.use_prior:  # a NaN row (no start token: no prior at position 0) scores nothing
                log_prior = mixed_log_prior(paths_logprobs(whitebox.model, chunk), self.prior_mix)
                taken = log_prior.gather(-1, chunk[..., None].to(log_prior.device))[..., 0].cpu().nan_to_num(0.0)
            out.append(step_energy(squared, sig, taken).sum(-1))
        return torch.cat(out)

    def refine(self, path: list[int], energies: list[torch.Tensor], candidates: list[torch.Tensor],
               observed: torch.Tensor, whitebox: WhiteBox, layer: int, sigmas: list[float]) -> list[int]:
        """Single-token substitutions of a decoded ``path`` that lower its whole energy E (:meth:`path_energy`).

        Position by position, the ``refine_k`` candidates of least step energy among those the search scored
        there (``candidates[t]``, ``energies[t]``) replace x_t in turn, every later state and prior term
        recomputed; the best is kept when it lowers E. Sweeps repeat until one changes nothing (at most
        :data:`REFINE_SWEEPS`). The beam ranks a token by the states up to its own position; the states after
        it also depend on it, and this pass reads them (a wrong token the beam kept for want of that evidence).
        E never rises, so an error of the posterior stays one. ``self.substitutions`` counts the kept changes."""
        best = float(self.path_energies(observed, whitebox, layer, torch.tensor([path]), sigmas)[0])
        self.substitutions = 0
        for _ in range(REFINE_SWEEPS):
            changed = False
            for t in range(len(path)):
                alternatives = candidates[t][torch.argsort(energies[t])[: self.refine_k]]
                alternatives = alternatives[alternatives != path[t]]
                if not alternatives.numel():
                    continue
                trials = torch.tensor([path]).repeat(alternatives.numel(), 1)
                trials[:, t] = alternatives
                energy = self.path_energies(observed, whitebox, layer, trials, sigmas)
                j = int(energy.argmin())
                if float(energy[j]) < best:
                    path, best, changed = trials[j].tolist(), float(energy[j]), True
                    self.substitutions += 1
            if not changed:
                break
        return path

    def invert(self, observed: torch.Tensor, whitebox: WhiteBox, layer: int, tokenizer=None,
               length: int | None = None) -> Inversion:
        layer = whitebox.resolve_layer(layer)
        observed = whitebox.check_states(observed, length)
        T = observed.shape[0]
        sigmas = effective_sigmas(observed, self.sigma, self.rel_tol)
        radii = [chi2_radius(s, whitebox.d, self.alpha) for s in sigmas]
        # The prior also orders the shortlist, so it is streamed even when it does not score.
        root_prior = NextTokenPrior(whitebox.model) if (self.use_prior or not self.scorer.exact) else None
        root = _Hyp([], [], 0.0, whitebox.prefix_cache([], layer), root_prior, [], [])
        prepare = getattr(self.scorer, "prepare", None)  # one-time per (model, layer): not timed below
        setup = prepare(whitebox, layer, tokenizer, sigma=self.sigma, progress=self.progress) if prepare is not None else []
        started = time.perf_counter()
        beams: list[list[_Hyp]] = [[root]]  # beams[t] = hypotheses holding t tokens
        reserve: list[list[_Pending]] = [[]]  # reserve[t] = pruned children of beams[t-1], as a heap
        self.backtracks = 0
        while len(beams) <= T:
            t = len(beams) - 1  # decode position t from beams[t]
            t0 = time.perf_counter()
            # Only the best hypothesis widens its shortlist (extra rounds); the others keep the base one.
            pending = [c for i, h in enumerate(beams[t])
                       for c in self._expand(h, whitebox, observed[t], sigmas[t], radii[t], widen=i == 0)]
            heapq.heapify(pending)
            # Backtracking: while the best squared distance at t is implausible, revive the next
            # pruned alternatives for position t-1 (reserve[t]) into the competition; the summed
            # log-likelihood then decides (an outlier at t itself penalises every prefix alike).
            while (self.backtrack and t > 0 and reserve[t] and self.backtracks < self.max_backtracks
                   and implausible(min(p.distance for p in pending) ** 2, sigmas[t], whitebox.d, self.alpha)):
                self.backtracks += 1
                heap = reserve[t]
                took = [heapq.heappop(heap) for _ in range(min(self.width, len(heap)))]
                revived = [self._materialise(p, whitebox, radii[t - 1], 0.0, False) for p in took]
                beams[t].extend(revived)
                for h in revived:
                    for c in self._expand(h, whitebox, observed[t], sigmas[t], radii[t], widen=False):
                        heapq.heappush(pending, c)
            took = [heapq.heappop(pending) for _ in range(min(self.width_at(t), len(pending)))]
            secs = (time.perf_counter() - t0) / max(len(beams[t]), 1)
            beams.append([self._materialise(p, whitebox, radii[t], secs, t + 1 == T) for p in took])
            reserve.append(pending)
        best = max(beams[T], key=lambda h: h.score)
        self.last_candidates, self.searched = best.candidates, best.tokens
        records = best.records
        if self.refine_k:
            path = self.refine(best.tokens, best.energies, best.candidates, observed, whitebox, layer, sigmas)
            if path != best.tokens:
                distances = (whitebox.states(path, layer) - observed).norm(dim=-1).tolist()
                records = [_record(t, token, distance, r.radius, r.candidates_tried, r.seconds)
                           for t, (token, distance, r) in enumerate(zip(path, distances, records))]
        return _inversion(records, started, whitebox, tokenizer, setup)


class MapDecoder(MapBeamSearch):
    """argmin_v ||mu_v - h~_t||^2 / (2 sigma^2) - log P(v | p_t), greedy left to right (width 1)."""

    name = "map"

    def __init__(self, sigma: float, *, alpha: float = 1e-3, rel_tol: float = DEFAULT_REL_TOL, exact: bool = False,
                 prior_mix: float = 0.0, progress: bool = False, **shortlist):
        """``shortlist``: CandidateScorer options (k_prior, ranking, n_fit, k_proxy, chunk, ...)."""
        super().__init__(sigma, width=1, prior=True, backtrack=False, alpha=alpha, rel_tol=rel_tol, exact=exact,
                         prior_mix=prior_mix, progress=progress, **shortlist)


class NearestNeighbour(MapBeamSearch):
    """argmin_v ||mu_{p_t,v} - h~_t||, greedy left to right (width 1, the prior scores nothing), over
    the whole vocabulary (``stop="exact"``), the shared shortlist (``"shortlist"``) or the
    candidates SipIt's loop verifies until one lies inside the noise radius (``"heuristic"``,
    :class:`RadiusScorer`)."""

    def __init__(self, policy: CandidatePolicy | None = None, stop: str = "exact", *, sigma: float = 0.0,
                 alpha: float = 1e-3, rel_tol: float = DEFAULT_REL_TOL, batch_size: int | None = None,
                 max_candidates: int | None = None, progress: bool = False, **shortlist):
        """``shortlist``: CandidateScorer options (k_prior, ranking, n_fit, k_proxy, chunk, ...)."""
        if stop not in STOP_RULES:
            raise ValueError(f"stop must be one of {STOP_RULES}, got {stop!r}")
        scorer = (RadiusScorer(policy, alpha=alpha, batch_size=batch_size, max_candidates=max_candidates)
                  if stop == "heuristic" else CandidateScorer(exact=stop == "exact", alpha=alpha, **shortlist))
        super().__init__(sigma, width=1, prior=False, backtrack=False, alpha=alpha, rel_tol=rel_tol, progress=progress,
                         scorer=scorer)
        self.stop = stop
        self.name = "nn" if stop == "exact" else f"nn-{stop}"
