"""Candidate policies for SipIt: the order in which tokens are verified at one position.

A policy only changes speed, never correctness: every candidate is verified exactly against the
observed state, and the vocabulary is exhausted if needed (docs/theory.md, "SipIt").

- :class:`RandomPolicy` — a seeded random permutation of the vocabulary (= BruteForce).
- :class:`GradientPolicy` — the paper's gradient-guided order: relax the token at position t to
  a continuous vector e, take g = grad_e ||Phi(p_t + e)_t - h~_t||^2 and rank real tokens by the
  first-order change g . (E_v - e); after each verified batch, re-anchor e at the nearest verified
  token (projection back to a real token) and rank again. Where the model's own next-token
  distribution log P(v | p_t) is available it is interleaved with the gradient ranking (the
  model's guess costs one incremental full-model position and is right most of the time on
  natural text; random-token prompts fall through to the gradient ranking). The first batch at
  a position is the prior's top candidates alone; later batches interleave both rankings.
- :class:`LearnedPolicy` — learned proposals: position 0 from the position-0 table (the nearest
  rows of F_v = Phi^l(v)_0, sipit.vocab_table), later positions by the inverse head's log q(v|h~)
  plus the prior's log P(v|p_t) (attacks.proposals); after ``trust`` candidates it interleaves the
  gradient ranking as a fallback. It starts with single-candidate batches (``first_batch = 1``).

Policies may build per-(model, layer) resources once in ``prepare`` (before the decode loop).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from attacks.proposals import SLOTS, HeadConfig, HeadReport, InverseHead, inverse_head
from sipit.prior import NextTokenPrior
from sipit.resources import GB, peak_rss
from sipit.vocab_table import VocabTable, position_zero_table
from sipit.whitebox import PrefixCache, WhiteBox


@dataclass
class StepContext:
    """What a policy may use at one position: never the ground truth."""

    whitebox: WhiteBox
    prefix: PrefixCache
    target: torch.Tensor  # h~_t, (d,)
    prior: torch.Tensor | NextTokenPrior | None  # log P(. | p_t) (V,), or the prior that computes it
    generator: torch.Generator
    anchor: int | None = None  # nearest verified candidate so far

    @property
    def prior_logprobs(self) -> torch.Tensor | None:
        """log P(. | p_t), ``(V,)``; from a NextTokenPrior it is computed on first use (lazily)."""
        return self.prior.logprobs if isinstance(self.prior, NextTokenPrior) else self.prior


class CandidatePolicy(Protocol):
    """Orders candidates: returns up to ``n`` untried token ids, best first."""

    name: str
    first_batch: int  # candidates in the first batch verified at a position

    def prepare(self, whitebox: WhiteBox, layer: int, tokenizer) -> list[str]:
        """Build per-(model, layer) resources; return one line per one-time cost (may be empty)."""

    def observe(self, observed: torch.Tensor) -> None:
        """The whole observed sequence ``(T, d)``, before the decode loop (a policy may score every
        position at once; the per-position targets it then receives are rows of it)."""

    def start(self, ctx: StepContext) -> None: ...

    def propose(self, ctx: StepContext, tried: torch.Tensor, n: int) -> torch.Tensor: ...


def _take_untried(order: torch.Tensor, tried: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` entries of ``order`` (token ids) that are not marked in ``tried``."""
    return order[~tried[order]][:n]


class RandomPolicy:
    """BruteForce: verify tokens in a seeded random order."""

    name = "random"
    first_batch = 16

    def __init__(self) -> None:
        self._order: torch.Tensor | None = None

    def prepare(self, whitebox: WhiteBox, layer: int, tokenizer) -> list[str]:
        """Nothing to build."""
        return []

    def observe(self, observed: torch.Tensor) -> None:
        """Nothing to score ahead."""

    def start(self, ctx: StepContext) -> None:
        self._order = torch.randperm(ctx.whitebox.vocab_size, generator=ctx.generator)

    def propose(self, ctx: StepContext, tried: torch.Tensor, n: int) -> torch.Tensor:
        return _take_untried(self._order, tried, n)


class GradientPolicy:
    """Gradient-guided order (with the model's next-token prior interleaved where available)."""

    name = "gradient"
    first_batch = 16

    def __init__(self, prior_share: float = 0.5, use_prior: bool = True) -> None:
        if not 0.0 <= prior_share <= 1.0:
            raise ValueError(f"prior_share must lie in [0, 1], got {prior_share}")
        self.prior_share = prior_share
        self.use_prior = use_prior
        self._prior_order: torch.Tensor | None = None
        self._grad_order: torch.Tensor | None = None
        self._anchor_used: int | None = -1

    def prepare(self, whitebox: WhiteBox, layer: int, tokenizer) -> list[str]:
        """Nothing to build."""
        return []

    def observe(self, observed: torch.Tensor) -> None:
        """Nothing to score ahead (the gradient depends on the decoded prefix)."""

    def start(self, ctx: StepContext) -> None:
        use = self.use_prior and ctx.prior_logprobs is not None
        self._prior_order = torch.argsort(ctx.prior_logprobs, descending=True) if use else None
        self._grad_order = None
        self._anchor_used = -1

    def gradient_order(self, ctx: StepContext) -> torch.Tensor:
        """Tokens ranked by the linearised loss g . (E_v - e) around the current anchor."""
        embeddings = ctx.whitebox.token_embeddings()
        point = embeddings.mean(0) if ctx.anchor is None else embeddings[ctx.anchor]
        relaxed = point.detach().clone()[None].requires_grad_(True)
        with torch.enable_grad():
            state = ctx.whitebox.step_embeds(ctx.prefix, relaxed)[0]
            loss = (state - ctx.target).pow(2).sum()
            (grad,) = torch.autograd.grad(loss, relaxed)
        return torch.argsort(embeddings @ grad[0])

    def propose(self, ctx: StepContext, tried: torch.Tensor, n: int) -> torch.Tensor:
        if self._prior_order is not None and not bool(tried.any()):
            # First round: the model's own guesses alone (no gradient pass spent yet).
            return _take_untried(self._prior_order, tried, n)
        if self._anchor_used != ctx.anchor or self._grad_order is None:
            self._grad_order = self.gradient_order(ctx)
            self._anchor_used = ctx.anchor
        if self._prior_order is None:
            return _take_untried(self._grad_order, tried, n)
        n_prior = round(n * self.prior_share)
        from_prior = _take_untried(self._prior_order, tried, n_prior)
        seen = tried.clone()
        seen[from_prior] = True
        from_grad = _take_untried(self._grad_order, seen, n - len(from_prior))
        return torch.cat([from_prior, from_grad])


SCORE_AHEAD = 64  # rows of the observed sequence the learned policy's heads score at once (64 x V floats)


class LearnedPolicy:
    """Position-0 table, then inverse head + prior, then the gradient ranking interleaved."""

    name = "learned"
    first_batch = 1

    def __init__(self, head_config: HeadConfig | None = None, trust: int = 256, confident: float = 0.5,
                 progress: bool = False) -> None:
        if trust < 1:
            raise ValueError(f"trust must be >= 1, got {trust}")
        if not 0.0 < confident <= 1.0:
            raise ValueError(f"confident must lie in (0, 1], got {confident}")
        self.head_config = head_config or HeadConfig()
        self.trust, self.confident, self.progress = trust, confident, progress
        self._head: torch.Tensor | None = None  # head log-probs while the prior is not yet mixed in
        self.table: VocabTable | None = None
        self.heads: dict[int, tuple[InverseHead, HeadReport]] = {}  # slot -> head (attacks.proposals.SLOTS)
        self._order: torch.Tensor | None = None
        self._fallback = GradientPolicy(use_prior=False)
        self._observed: torch.Tensor | None = None  # the sequence given to observe()
        self._ahead: dict[int, torch.Tensor] = {}  # position -> log q(. | observed[position]), scored ahead

    def prepare(self, whitebox: WhiteBox, layer: int, tokenizer) -> list[str]:
        """Load or build the position-0 table and the inverse heads of (model, ``layer``)."""
        if tokenizer is None:
            raise ValueError("the learned policy trains its heads on text: pass the tokenizer to invert()")
        source = whitebox.proposals_from or whitebox  # a served copy ranks with its original's heads
        self.table = position_zero_table(whitebox, layer, progress=self.progress)
        self.heads = {slot: inverse_head(source, tokenizer, layer, self.head_config, slot=slot,
                                         progress=self.progress) for slot in SLOTS}
        lines = [f"position-0 table (layer {layer}): {'loaded from the cache' if self.table.cached else 'built'} "
                 f"in {self.table.seconds:.1f} s" + ("" if self.table.cached else f" ({self.table.needs})")]
        if source is not whitebox:
            lines.append("inverse heads: the full-precision original's (they rank the served copy's candidates; "
                         "the copy verifies them)")
        for slot, (_, report) in self.heads.items():
            how = "loaded from the cache" if report.cached else f"trained on {report.n_train} corpus tokens"
            lines.append(f"inverse head (layer {layer}, {'position 1' if slot == 1 else 'positions >= 2'}): "
                         f"{how} in {report.seconds:.1f} s; held-out recall@1 {report.top1:.3f}, "
                         f"recall@16 {report.top16:.3f}" + ("" if report.cached else f" ({report.needs})"))
        if not self.table.cached or not all(report.cached for _, report in self.heads.values()):
            lines.append(f"peak resident memory of this process so far: {peak_rss() / GB:.2f} GB")
        return lines

    def head_at(self, position: int) -> InverseHead:
        """The inverse head of ``position`` (>= 1)."""
        if not self.heads:
            raise RuntimeError("LearnedPolicy.prepare() must run before the decode loop")
        return self.heads[min(position, max(SLOTS))][0]

    def observe(self, observed: torch.Tensor) -> None:
        """Keep the observed sequence: :meth:`head_log_probs` then scores its rows ahead."""
        self._observed, self._ahead = observed.detach(), {}

    def _is_observed_row(self, position: int, target: torch.Tensor) -> bool:
        """Whether ``target`` equals row ``position`` of the sequence given to :meth:`observe`."""
        observed = self._observed
        return (observed is not None and position < len(observed) and target.shape == observed.shape[1:]
                and target.dtype == observed.dtype and target.device == observed.device
                and torch.equal(observed[position], target))

    def head_log_probs(self, position: int, target: torch.Tensor) -> torch.Tensor:
        """log q(v | h~) from the head of ``position`` (>= 1).

        When ``target`` is row ``position`` of the sequence given to :meth:`observe`, that row is
        scored together with the next ``SCORE_AHEAD - 1`` rows, one matrix product per head: the
        cosines read the (V, d_E) direction matrix once per chunk instead of once per position
        (113 MB for smollm2, the largest cost of a confident position at layer 1)."""
        if not self._is_observed_row(position, target):
            return self.head_at(position).log_probs(target)
        if position in self._ahead:
            return self._ahead.pop(position)
        observed = self._observed
        positions = range(position, min(position + SCORE_AHEAD, len(observed)))
        by_slot: dict[int, list[int]] = {}
        for p in positions:
            by_slot.setdefault(min(p, max(SLOTS)), []).append(p)
        self._ahead = {}
        for ps in by_slot.values():
            self._ahead.update(zip(ps, self.head_at(ps[0]).log_probs(observed[ps])))
        return self._ahead.pop(position)

    def typical_state(self) -> torch.Tensor:
        """A typical state after position 0, ``(d,)``: the mean of the corpus states the head of
        positions >= 2 was trained on. Not the position-1 head's mean, which lies 3.3-4.4 x ||h_1||
        from a prompt's h_1 where this one lies 0.6-0.7 x (smollm2, layer 15, 5 natural prompts;
        the coordinate-wise median of text states at position 1 is close too, so outliers, likely
        windows whose position 1 takes a massive activation, pull that mean off; not checked)."""
        return self.head_at(max(SLOTS)).mean

    def start(self, ctx: StepContext) -> None:
        """Order the vocabulary: by -||F_v - h~||^2 at position 0; later by log q(v|h~), alone for
        the first candidate when the head's top token has q >= ``confident`` (the prior is then
        not computed unless that candidate fails), else by log q(v|h~) + log P(v|p_t)."""
        if self.table is None:
            raise RuntimeError("LearnedPolicy.prepare() must run before the decode loop")
        self._fallback.start(ctx)
        self._head = None
        if ctx.prefix.length == 0:
            self._set_order(self.table.neg_sq_distances(ctx.target), ctx)
            return
        self._head = self.head_log_probs(ctx.prefix.length, ctx.target)
        if float(self._head.max().exp()) >= self.confident:
            # the guess alone: a miss re-orders everything by head + prior (propose), so no full sort here
            self._order = self._head.argmax().reshape(1).to(ctx.whitebox.device)
        else:
            self._add_prior(ctx)

    def _set_order(self, scores: torch.Tensor, ctx: StepContext) -> None:
        self._order = torch.argsort(scores, descending=True).to(ctx.whitebox.device)

    def _add_prior(self, ctx: StepContext) -> None:
        """Re-order by head + prior (the prior's log-probs are computed here, once)."""
        prior = ctx.prior_logprobs
        self._set_order(self._head + prior.cpu() if prior is not None else self._head, ctx)
        self._head = None

    def propose(self, ctx: StepContext, tried: torch.Tensor, n: int) -> torch.Tensor:
        n_tried = int(tried.sum())
        if self._head is not None and n_tried:
            self._add_prior(ctx)  # the confident head's first guess failed
        if n_tried < self.trust:
            return _take_untried(self._order, tried, n)
        from_learned = _take_untried(self._order, tried, (n + 1) // 2)
        seen = tried.clone()
        seen[from_learned] = True
        return torch.cat([from_learned, self._fallback.propose(ctx, seen, n - len(from_learned))])


POLICIES = {"random": RandomPolicy, "gradient": GradientPolicy, "learned": LearnedPolicy}


def make_policy(name: str, *, progress: bool = False) -> CandidatePolicy:
    """A policy by name (``random``, ``gradient`` or ``learned``); ``progress``: the learned policy's one-time
    builds show progress bars (the others build nothing)."""
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}: choose one of {sorted(POLICIES)}")
    return LearnedPolicy(progress=progress) if name == "learned" else POLICIES[name]()
