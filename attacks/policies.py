"""Candidate policies for SipIt: the order in which tokens are verified at one position.

A policy only changes speed, never correctness: every candidate is verified exactly against the
observed state, and the vocabulary is exhausted if needed (PAPER.md, "SipIt").

- :class:`RandomPolicy` — a seeded random permutation of the vocabulary (= BruteForce).
- :class:`GradientPolicy` — the paper's gradient-guided order: relax the token at position t to
  a continuous vector e, take g = grad_e ||Phi(p_t + e)_t - h~_t||^2 and rank real tokens by the
  first-order change g . (E_v - e); after each verified batch, re-anchor e at the nearest verified
  token (projection back to a real token) and rank again. Where the model's own next-token
  distribution log P(v | p_t) is available it is interleaved with the gradient ranking (the
  model's guess costs one incremental full-model position and is right most of the time on
  natural text; random-token prompts fall through to the gradient ranking). The first batch at
  a position is the prior's top candidates alone; later batches interleave both rankings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from sipit.whitebox import PrefixCache, WhiteBox


@dataclass
class StepContext:
    """What a policy may use at one position: never the ground truth."""

    whitebox: WhiteBox
    prefix: PrefixCache
    target: torch.Tensor  # h~_t, (d,)
    prior_logprobs: torch.Tensor | None  # log P(. | p_t), (V,), or None
    generator: torch.Generator
    anchor: int | None = None  # nearest verified candidate so far


class CandidatePolicy(Protocol):
    """Orders candidates: returns up to ``n`` untried token ids, best first."""

    name: str

    def start(self, ctx: StepContext) -> None: ...

    def propose(self, ctx: StepContext, tried: torch.Tensor, n: int) -> torch.Tensor: ...


def _take_untried(order: torch.Tensor, tried: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` entries of ``order`` (token ids) that are not marked in ``tried``."""
    return order[~tried[order]][:n]


class RandomPolicy:
    """BruteForce: verify tokens in a seeded random order."""

    name = "random"

    def __init__(self) -> None:
        self._order: torch.Tensor | None = None

    def start(self, ctx: StepContext) -> None:
        self._order = torch.randperm(ctx.whitebox.vocab_size, generator=ctx.generator)

    def propose(self, ctx: StepContext, tried: torch.Tensor, n: int) -> torch.Tensor:
        return _take_untried(self._order, tried, n)


class GradientPolicy:
    """Gradient-guided order (with the model's next-token prior interleaved where available)."""

    name = "gradient"

    def __init__(self, prior_share: float = 0.5) -> None:
        if not 0.0 <= prior_share <= 1.0:
            raise ValueError(f"prior_share must lie in [0, 1], got {prior_share}")
        self.prior_share = prior_share
        self._prior_order: torch.Tensor | None = None
        self._grad_order: torch.Tensor | None = None
        self._anchor_used: int | None = -1

    def start(self, ctx: StepContext) -> None:
        self._prior_order = (
            torch.argsort(ctx.prior_logprobs, descending=True) if ctx.prior_logprobs is not None else None
        )
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


POLICIES = {"random": RandomPolicy, "gradient": GradientPolicy}


def make_policy(name: str) -> CandidatePolicy:
    """A policy by name (``random`` or ``gradient``)."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r}: choose one of {sorted(POLICIES)}") from None
