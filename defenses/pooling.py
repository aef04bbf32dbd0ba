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

from dataclasses import replace

import torch

from defenses.base import Defense, DefenseParamError, check_choice, check_number

MODES = ("mean", "max")
OVER = ("all", "window", "dims")


def reduce(x: torch.Tensor, mode: str, dim: int) -> torch.Tensor:
    return x.mean(dim=dim) if mode == "mean" else x.amax(dim=dim)


def _size(name: str, value, over: str, needed_by: str, meaning: str) -> int | None:
    """``value`` checked as an integer >= 1 when ``over == needed_by`` (then required), else it must be None."""
    if over != needed_by:
        if value is not None:
            raise DefenseParamError(f"{name} is only used with over={needed_by!r} (got over={over!r})")
        return None
    if value is None:
        raise DefenseParamError(f"over={needed_by!r} needs {name} ({meaning})")
    return check_number(name, value, integer=True, minimum=1)


class Pooling(Defense):
    name = "pooling"
    per_position = False
    param_names = ("mode", "over", "k", "g")

    def __init__(self, mode: str = "mean", over: str = "all", k: int | None = None, g: int | None = None):
        check_choice("mode", mode, MODES)
        check_choice("over", over, OVER)
        k = _size("k", k, over, "window", "window length in positions")
        g = _size("g", g, over, "dims", "hidden dims per group")
        self.mode, self.over, self.k, self.g = mode, over, k, g

    def pool_dims(self, states: torch.Tensor) -> torch.Tensor:
        """``(..., d) -> (..., d/g)`` for over='dims'; identity otherwise."""
        if self.over != "dims":
            return states
        d = states.shape[-1]
        if d % self.g:
            raise DefenseParamError(f"g={self.g} must divide the hidden size d={d}")
        return reduce(states.reshape(*states.shape[:-1], d // self.g, self.g), self.mode, -1)

    def check_exposure(self, exposure: str, d: int) -> None:
        """``g`` must divide the exposed width (over='dims'): the hidden size for the residual exposure,
        2 x KV heads x head dim for ``kv``."""
        if self.over == "dims" and d % self.g:
            raise DefenseParamError(f"g={self.g} must divide the width d={d} of the {exposure} exposure")

    def window_length(self, length: int) -> int:
        """Positions per pooled row for a prompt of ``length`` tokens."""
        return {"all": length, "window": self.k, "dims": 1}[self.over]

    @property
    def alters_exposure(self) -> bool:
        return True

    def expose(self, states: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        if states.dim() != 2 or states.shape[0] == 0:
            raise DefenseParamError(f"pooling expects layer-l states of shape (T, d), got {tuple(states.shape)}")
        feats = self.pool_dims(states)
        k = self.window_length(states.shape[0])
        rows = [reduce(part, self.mode, 0) for part in feats.split(k, dim=0)]
        return torch.stack(rows)[None]

    def knowledge(self, exposure, knows_defense: bool = True):
        """The pooling, known to every attacker (naive or not): a pooled exposure has no per-position states
        for any other attack to read."""
        return replace(exposure, pooling=self)

    def params(self) -> dict:
        return {"mode": self.mode, "over": self.over, "k": self.k, "g": self.g}

    def describe(self) -> str:
        what = {"all": "over all positions", "window": f"over windows of {self.k} positions",
                "dims": f"over groups of {self.g} hidden dims per position"}[self.over]
        return (f"pooling: served model unchanged; exposure = {self.mode} {what}, shape (1, P, D'); "
                "attacker holds the clean model and knows the pooling (PooledBeamAttack).")
