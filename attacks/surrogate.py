"""A linear surrogate of Phi^l that ranks candidate tokens under noise (used by attacks.robust).

Why: under noise the gradient ranking (attacks.policies.GradientPolicy) points nowhere useful.
On smollm2-135m, layer 15, the true token fell outside the gradient shortlist at 7-33% of the
positions, and outside this surrogate's at none up to sigma = 16 (docs/noise.md, "Decoders").
The surrogate predicts every token's state on the current prefix p from the token's prefix-free
state:

    mu_{p,v} ~= [z(F_v), 1] A_p,        F_v = Phi^l(v)_0  (the state of v alone, at position 0)

``z`` standardises each coordinate over the vocabulary; ``A_p`` ((d+1) x d) is a ridge
least-squares fit on ``n_fit`` tokens whose states are computed exactly on p. The sample is a
fixed seeded subset of the vocabulary, so a fit is a deterministic function of the prefix: it
is memoised by the WhiteBox per (layer, prefix tokens) and shared by every decoder (pure
memoisation: no decoder learns from another's prefix). Candidates are ranked by the predicted
squared distance

    ||mu^_v - h~||^2 = ||mu^_v||^2 - 2 [z(F_v), 1] (A_p h~) + ||h~||^2

(``||mu^_v||^2`` is computed once per fit, so a ranking is one (V, d+1) matrix-vector product).
:meth:`LinearSurrogate.refine` re-fits A_p with the verified tokens nearest to h~ up-weighted
(a local fit around the target); the refined map re-ranks the best ``n_rerank`` of the first
ranking (:meth:`LinearSurrogate.subset_sq_distances`).

The surrogate only ORDERS candidates: every decision is made on exactly computed states.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sipit.memo import is_memoised, memoised
from sipit.sweep import sweep_states
from sipit.vocab_table import position_zero_table
from sipit.whitebox import PrefixCache, WhiteBox

# Held by the WhiteBox (sipit.memo): whitebox.memo["surrogate-design"][layer] = the (V, d+1)
# design matrix, whitebox.memo["surrogate-fits"][(layer, prefix tokens, n_fit, lam, seed)] = a fit.
MEMO_SIZE = 256  # fits kept per WhiteBox (~5 MB each at d = 576)


def first_token_states(whitebox: WhiteBox, layer: int, chunk: int = 1024) -> torch.Tensor:
    """F_v = Phi^l(v)_0 for every token v, ``(V, d)``: the position-0 table (sipit.vocab_table)."""
    return position_zero_table(whitebox, layer, chunk=chunk).states


def design_matrix(whitebox: WhiteBox, layer: int, chunk: int = 1024) -> torch.Tensor:
    """``[z(F_v), 1]`` for every token, ``(V, d+1)``: standardised position-0 states and an intercept."""
    def build() -> torch.Tensor:
        f = first_token_states(whitebox, layer, chunk)
        z = (f - f.mean(0)) / (f.std(0) + 1e-6)
        return torch.cat([z, torch.ones(f.shape[0], 1, dtype=f.dtype, device=f.device)], 1)

    return memoised(whitebox, "surrogate-design", layer, build)


def ridge(x: torch.Tensor, y: torch.Tensor, weights: torch.Tensor, lam: float) -> torch.Tensor:
    """argmin_A sum_i w_i ||x_i A - y_i||^2 + lam * sum(w) * ||A without its intercept row||^2."""
    w = weights.double().sqrt()[:, None]
    xw, yw = x.double() * w, y.double() * w
    penalty = lam * float(weights.sum()) * torch.eye(x.shape[1], dtype=torch.float64, device=x.device)
    penalty[-1, -1] = 0.0  # the intercept is not shrunk
    return torch.linalg.solve(xw.T @ xw + penalty, xw.T @ yw).to(x.dtype)


@dataclass
class SurrogateFit:
    """A_p for one prefix, with the exact states of the tokens it was fitted on."""

    layer: int
    length: int  # prefix length the fit belongs to
    coef: torch.Tensor  # (d+1, d)
    row_sq_norms: torch.Tensor  # (V,) ||[z(F_v), 1] A_p||^2
    sample: torch.Tensor  # (n,) token ids whose states were computed exactly on the prefix
    sample_states: torch.Tensor  # (n, d)


class LinearSurrogate:
    """Ranks the whole vocabulary by the predicted distance of mu_{p,v} to a target (see module doc)."""

    def __init__(self, n_fit: int = 1536, lam: float = 1e-3, refine_weight: float = 8.0, seed: int = 0,
                 chunk: int = 1024):
        if n_fit < 2 or lam < 0 or refine_weight <= 0:
            raise ValueError("need n_fit >= 2, lam >= 0, refine_weight > 0")
        self.n_fit, self.lam, self.refine_weight, self.seed, self.chunk = n_fit, lam, refine_weight, seed, chunk

    def _key(self, prefix: PrefixCache) -> tuple:
        return (prefix.layer, prefix.tokens, self.n_fit, self.lam, self.seed)

    def has_fit(self, whitebox: WhiteBox, prefix: PrefixCache) -> bool:
        return is_memoised(whitebox, "surrogate-fits", self._key(prefix))

    def sample_ids(self, vocab_size: int) -> torch.Tensor:
        """The fixed, seeded fitting sample (the whole vocabulary when n_fit >= V)."""
        order = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(self.seed))
        return order[: min(self.n_fit, vocab_size)]

    @torch.no_grad()
    def fit(self, whitebox: WhiteBox, prefix: PrefixCache) -> SurrogateFit:
        """A_p for ``prefix``: n_fit exact steps on it, then one ridge solve (memoised per prefix)."""
        return memoised(whitebox, "surrogate-fits", self._key(prefix), lambda: self._fit(whitebox, prefix),
                        size=MEMO_SIZE)

    def _fit(self, whitebox: WhiteBox, prefix: PrefixCache) -> SurrogateFit:
        x = design_matrix(whitebox, prefix.layer, self.chunk)
        sample = self.sample_ids(whitebox.vocab_size).to(whitebox.device)
        states = sweep_states(whitebox, prefix, ids=sample, chunk=self.chunk)
        coef = ridge(x[sample], states, torch.ones(sample.numel(), device=x.device), self.lam)
        norms = torch.cat([(part @ coef).pow(2).sum(1) for part in x.split(8192)])
        return SurrogateFit(prefix.layer, prefix.length, coef, norms, sample, states)

    @torch.no_grad()
    def refine(self, whitebox: WhiteBox, fit: SurrogateFit, ids: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
        """A_p re-fitted with extra exactly verified tokens ``ids`` (states ``states``) up-weighted."""
        x = design_matrix(whitebox, fit.layer, self.chunk)
        rows = torch.cat([fit.sample, ids.to(fit.sample.device)])
        ys = torch.cat([fit.sample_states, states])
        weights = torch.cat([torch.ones(fit.sample.numel()), torch.full((ids.numel(),), self.refine_weight)])
        return ridge(x[rows], ys, weights.to(x.device), self.lam)

    @torch.no_grad()
    def predicted_sq_distances(self, whitebox: WhiteBox, fit: SurrogateFit, target: torch.Tensor) -> torch.Tensor:
        """||mu^_v - target||^2 for every token v, ``(V,)`` (a ranking score, not a decision)."""
        x = design_matrix(whitebox, fit.layer, self.chunk)
        target = target.to(x.dtype)
        return fit.row_sq_norms - 2 * (x @ (fit.coef @ target)) + target.pow(2).sum()

    @torch.no_grad()
    def subset_sq_distances(self, whitebox: WhiteBox, layer: int, coef: torch.Tensor, ids: torch.Tensor,
                            target: torch.Tensor) -> torch.Tensor:
        """||[z(F_v), 1] coef - target||^2 for the tokens ``ids`` only (re-ranking a pool)."""
        x = design_matrix(whitebox, layer, self.chunk)[ids.to(whitebox.device)]
        return (x @ coef - target.to(x.dtype)).pow(2).sum(1)
