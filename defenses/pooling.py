"""Pooling: only a pooled summary of the layer-l states is exposed.

``over``:

- ``all``: ``mode`` (mean or max) over every position -> ``(1, 1, d)``;
- ``window``: over consecutive windows of ``k`` positions (stride k, the last window may be
  shorter) -> ``(1, ceil(T/k), d)``;
- ``dims``: per position, over groups of ``g`` consecutive hidden dimensions (d % g == 0)
  -> ``(1, T, d/g)``.

Pooled exposures always have the layout ``(1, P, D')`` (a batch of one pooled sequence), never the
``(T, d)`` layout of per-position states, so a per-position attack cannot mistake them for states
(``WhiteBox.check_states`` rejects them; :func:`defenses.base.require_per_position` says why).
The served model is unchanged (no utility cost to the task); the adaptive attacker holds the clean
model and knows the pooling (:class:`attacks.pooled.PooledBeamAttack`).
"""

from __future__ import annotations

import torch

from defenses.base import Defense, DefenseParamError, check_choice, check_number

MODES = ("mean", "max")
OVER = ("all", "window", "dims")


def reduce(x: torch.Tensor, mode: str, dim: int) -> torch.Tensor:
    return x.mean(dim=dim) if mode == "mean" else x.amax(dim=dim)


class Pooling(Defense):
    name = "pooling"
    per_position = False
    param_names = ("mode", "over", "k", "g")

    def __init__(self, mode: str = "mean", over: str = "all", k: int | None = None, g: int | None = None):
        check_choice("mode", mode, MODES)
        check_choice("over", over, OVER)
        if over == "window":
            if k is None:
                raise DefenseParamError("over='window' needs k (window length in positions)")
            k = check_number("k", k, integer=True, minimum=1)
        elif k is not None:
            raise DefenseParamError(f"k is only used with over='window' (got over={over!r})")
        if over == "dims":
            if g is None:
                raise DefenseParamError("over='dims' needs g (hidden dims per group)")
            g = check_number("g", g, integer=True, minimum=1)
        elif g is not None:
            raise DefenseParamError(f"g is only used with over='dims' (got over={over!r})")
        self.mode, self.over, self.k, self.g = mode, over, k, g

    def pool_dims(self, states: torch.Tensor) -> torch.Tensor:
        """``(..., d) -> (..., d/g)`` for over='dims'; identity otherwise."""
        if self.over != "dims":
            return states
        d = states.shape[-1]
        if d % self.g:
            raise DefenseParamError(f"g={self.g} must divide the hidden size d={d}")
        return reduce(states.reshape(*states.shape[:-1], d // self.g, self.g), self.mode, -1)

    def window_length(self, length: int) -> int:
        """Positions per pooled row for a prompt of ``length`` tokens."""
        return {"all": length, "window": self.k, "dims": 1}[self.over]

    def expose(self, states: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        if states.dim() != 2 or states.shape[0] == 0:
            raise DefenseParamError(f"pooling expects layer-l states of shape (T, d), got {tuple(states.shape)}")
        feats = self.pool_dims(states)
        k = self.window_length(states.shape[0])
        rows = [reduce(part, self.mode, 0) for part in feats.split(k, dim=0)]
        return torch.stack(rows)[None]

    def params(self) -> dict:
        return {"mode": self.mode, "over": self.over, "k": self.k, "g": self.g}

    def describe(self) -> str:
        what = {"all": "over all positions", "window": f"over windows of {self.k} positions",
                "dims": f"over groups of {self.g} hidden dims per position"}[self.over]
        return (f"pooling: served model unchanged; exposure = {self.mode} {what}, shape (1, P, D'); "
                "attacker holds the clean model and knows the pooling (PooledBeamAttack).")
