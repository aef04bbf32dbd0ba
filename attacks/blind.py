"""The blind attacker: not told the noise, it estimates the scale from the exposure, then decodes with it.

Every noisy exposure of the benchmark hands the attacker the noise's sigma; a real attacker must
estimate it (BeamClean estimates the noise parameters from the exposure while decoding). Here:

1. from position 0, whose state depends on the token alone: h~_0 = F_s + n, so with the position-0
   table F, sigma_0^2 = min_v ||F_v - h~_0||^2 / d (a chi-square_d / d draw times sigma^2 when the
   nearest row is the true one; the minimum can only underestimate when it is not), pooled over the
   prompts the attacker holds (:func:`sigma_from_position_zero`);
2. the decoder built for sigma_0 inverts the prompt; its decoded states give every position's residual,
   sigma_1^2 = sum_t ||mu_t - h~_t||^2 / (T d) (T d degrees of freedom instead of d), and the decoder
   runs again with sigma_1 when it differs from sigma_0 by more than ``tolerance`` (one step of the
   expectation-maximisation that BeamClean iterates).

:class:`BlindAttack` wraps any decoder that takes a sigma (``make(sigma)``); its records keep the
estimate (``estimated_sigma``).
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from attacks.result import Inversion
from sipit.whitebox import WhiteBox


def sigma_from_position_zero(rows: torch.Tensor, table: torch.Tensor) -> float:
    """sqrt(mean over the rows h~_0 (``(P, d)``, position 0 of P prompts) of min_v ||F_v - h~_0||^2 / d)."""
    rows = rows.float().to(table.device).reshape(-1, table.shape[1])
    squared = torch.stack([(table - row).pow(2).sum(-1).min() for row in rows])
    return math.sqrt(float(squared.mean()) / table.shape[1])


def sigma_from_residuals(inversion: Inversion, d: int) -> float:
    """sqrt(sum_t distance_t^2 / (T d)) of a decoded prompt's records."""
    return math.sqrt(sum(r.distance**2 for r in inversion.positions) / (len(inversion.positions) * d))


class BlindAttack:
    """A noise decoder that estimates its own sigma (module docstring)."""

    def __init__(self, make: Callable[[float], object], *, tolerance: float = 0.05, progress: bool = False):
        self.make, self.tolerance, self.progress = make, tolerance, progress
        self.estimated_sigma: float | None = None

    @property
    def name(self) -> str:
        return f"blind-{getattr(self.make(1.0), 'name', 'decoder')}"

    def invert(self, observed: torch.Tensor, whitebox: WhiteBox, layer: int, tokenizer=None,
               length: int | None = None) -> Inversion:
        from sipit.vocab_table import position_zero_table

        observed = whitebox.check_states(observed, length)
        table = position_zero_table(whitebox, layer, progress=self.progress).states
        sigma = sigma_from_position_zero(observed[:1], table)
        inversion = self.make(sigma).invert(observed, whitebox, layer, tokenizer, length)
        refined = sigma_from_residuals(inversion, whitebox.d)
        if abs(refined - sigma) > self.tolerance * max(sigma, 1e-30):
            sigma = refined
            inversion = self.make(sigma).invert(observed, whitebox, layer, tokenizer, length)
        self.estimated_sigma = sigma
        inversion.setup = [*inversion.setup, f"blind: sigma estimated from the exposure: {sigma:.4g}"]
        return inversion
