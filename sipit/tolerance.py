"""The acceptance threshold eps of exact SipIt, derived from measured numerical gaps.

Rule (L2, scale-aware): a candidate v is accepted at position t when

    ||mu_{p_t,v} - h~_t||_2 <= eps_t,   eps_t = rel_tol * ||h~_t||_2.

The only legitimate difference between a recomputed state and the observed one, without a
defence, is floating-point: batched and KV-cached evaluation sums in a different order than the
full forward that produced h. :func:`measure_gap` measures that gap per position as
``||mu_cached - h_full|| / ||h_full||``. :func:`tolerance_from_gaps` sets
``rel_tol = SAFETY * max(gap)`` (floored at ``MIN_REL_TOL``).

Measured on SmolLM2-135M in fp32 on this CPU (`python -m benchmarks.experiments.gap`, 3 prompts x 20
tokens): the largest relative gap was 6.6e-7 at layer 1, 5.3e-6 at layer 15 and 2.7e-6 at layer
30 (1e-3..5e-3 absolute at the last layer, where ||h|| ~ 1e3), while the nearest competitor lies
at a median relative distance Delta/||h|| of 0.0027-0.032 (docs/results/margins-smollm2, layers
8-30, 2 positions each; ||h|| includes position 0's massive activation). ``DEFAULT_REL_TOL = 1e-4``
is ~19x the largest gap measured and ~27x below the smallest median margin ratio seen.
For another model or dtype, derive it with :func:`measure_gap` and :func:`tolerance_from_gaps`.
"""

from __future__ import annotations

import math

import torch

from sipit.whitebox import SipitInputError

DEFAULT_REL_TOL = 1e-4
SAFETY = 20.0
MIN_REL_TOL = 1e-6


def check_rel_tol(rel_tol: float) -> float:
    """``rel_tol`` as a finite float > 0; NaN, inf, zero or negative raise :class:`SipitInputError`
    (a NaN radius accepts nothing: every position would scan the whole vocabulary unverified)."""
    if isinstance(rel_tol, bool) or not isinstance(rel_tol, (int, float)) or not (math.isfinite(rel_tol) and rel_tol > 0):
        raise SipitInputError(f"rel_tol must be a finite number > 0, got {rel_tol!r}")
    return float(rel_tol)


def acceptance_radius(observed: torch.Tensor, rel_tol: float = DEFAULT_REL_TOL) -> torch.Tensor:
    """eps_t = rel_tol * ||h~_t||_2 for each row of ``observed`` (``(T, d)`` -> ``(T,)``)."""
    return check_rel_tol(rel_tol) * observed.norm(dim=-1)


def measure_gap(whitebox, ids: torch.Tensor, layer: int, batch: int = 8) -> torch.Tensor:
    """Relative L2 gap between cached, batched candidate steps and the full forward, per position.

    The true token is verified inside a batch of ``batch`` candidates (the others random), as the
    attack does it, so batch-dependent kernels are exercised too.
    """
    ids = whitebox.check_ids(ids)
    full = whitebox.states(ids, layer)
    generator = torch.Generator().manual_seed(0)
    prefix = whitebox.prefix_cache(ids[:0], layer)
    gaps = []
    for t, token in enumerate(ids.tolist()):
        others = torch.randint(0, whitebox.vocab_size, (batch - 1,), generator=generator)
        candidates = torch.cat([others[: batch // 2], torch.tensor([token]), others[batch // 2 :]])
        result = whitebox.step(prefix, candidates)
        at = batch // 2
        gaps.append(((result.states[at] - full[t]).norm() / full[t].norm()).item())
        prefix = result.extended(at)
    return torch.tensor(gaps)


def tolerance_from_gaps(gaps: torch.Tensor) -> float:
    """rel_tol = SAFETY * max gap, at least MIN_REL_TOL."""
    return max(SAFETY * float(gaps.max()), MIN_REL_TOL)
