"""Gaussian noise on layer-l states: n ~ N(0, sigma^2 I), exposure-only or inside the model.

Placements (``placement``):

- ``exposure``: the served model is unchanged; only the exported copy of the layer-l states is
  noisy (:meth:`GaussianNoise.expose`).
- ``model``: a forward hook on block l (pre-hook on block 1 for l = 0) adds the noise to the
  residual stream, so every later block and the head compute with the noisy state (this costs
  utility); the exposed states are then the served model's (already noisy) layer-l states.
  By causality the layer-l states themselves are the same in law under both placements; the
  placements differ in what the rest of the network sees.

Scale (``relative_to``): ``abs`` sigma is absolute; ``rms`` sigma is a multiple of the RMS of the
noised state tensor (one sigma for the whole tensor, ``sqrt(mean(h^2))``, so the noise stays
isotropic N(0, sigma^2 I) with ``||n|| ~ sigma * ||h||`` on average); ``delta`` sigma is a
multiple of a given ``delta / 2`` (the robustness radius, docs/theory.md, "Margin and noise").

Randomness: a ``torch.Generator`` seeded with ``seed`` (default, reproducible). ``secure=True``
draws a fresh 64-bit seed from ``secrets`` (the OS CSPRNG) for every call, as opacus's
``secure_mode`` does, so no fixed seed can be replayed by an attacker.

Adaptive attacker: holds the clean model and knows sigma (:meth:`noise_sigma`), e.g. for MAP or
beam decoding.
"""

from __future__ import annotations

import secrets

import torch

from defenses.base import Defense, DefenseParamError, check_choice, check_number, copy_loaded
from sipit.models import LoadedModel
from sipit.whitebox import WhiteBox

PLACEMENTS = ("exposure", "model")
RELATIVE_TO = ("abs", "rms", "delta")


def rms(states: torch.Tensor) -> float:
    """Root mean square over all entries."""
    return float(states.detach().float().pow(2).mean().sqrt())


class GaussianNoise(Defense):
    name = "noise"
    param_names = ("sigma", "relative_to", "delta", "placement", "seed", "secure")

    def __init__(
        self,
        sigma: float = 0.1,
        relative_to: str = "rms",
        delta: float | None = None,
        placement: str = "exposure",
        seed: int = 0,
        secure: bool = False,
    ):
        self.sigma = check_number("sigma", sigma, minimum=0.0)
        check_choice("relative_to", relative_to, RELATIVE_TO)
        check_choice("placement", placement, PLACEMENTS)
        if relative_to == "delta":
            if delta is None:
                raise DefenseParamError("relative_to='delta' needs delta (the margin Delta_t), e.g. delta=2.5")
            delta = check_number("delta", delta, minimum=0.0, exclusive=True)
        elif delta is not None:
            raise DefenseParamError(f"delta is only used with relative_to='delta' (got relative_to={relative_to!r})")
        self.relative_to, self.delta, self.placement = relative_to, delta, placement
        self.seed = check_number("seed", seed, minimum=0, integer=True)
        if not isinstance(secure, bool):
            raise DefenseParamError(f"secure must be a bool, got {secure!r}")
        self.secure = secure
        self._generator = torch.Generator().manual_seed(self.seed)

    def check_model(self, loaded: LoadedModel) -> None:
        """Refuse noise whose distances would overflow float32 in every attack: the squared norm of (6 sigma)
        per coordinate over d dimensions must stay below float32's largest value / 100 (absolute sigma;
        a relative sigma is bounded as if the state RMS were 1e4, far above any model's)."""
        d = int(loaded.model.get_input_embeddings().weight.shape[1])
        largest = (torch.finfo(torch.float32).max / 100 / d) ** 0.5 / 6
        scale = {"abs": 1.0, "rms": 1e4, "delta": (self.delta or 0) / 2}[self.relative_to]
        if self.sigma * scale > largest:
            raise DefenseParamError(f"sigma={self.sigma:g} ({self.relative_to}) is too large: distances to states "
                                    f"this noisy overflow float32 (at most {largest / scale:.3g} for d={d})")

    def check_exposure(self, exposure: str, d: int) -> None:
        """Noise inside the model perturbs the residual stream after block l, which block l's keys and
        values never see: with the KV exposure only ``placement=exposure`` means anything."""
        if exposure == "kv" and self.placement == "model":
            raise DefenseParamError("placement=model adds the noise to the residual stream after block l, which "
                                    "block l's keys and values do not depend on: use placement=exposure with the "
                                    "kv exposure")

    # ------------------------------------------------------------------------------ noise
    def noise_sigma(self, states: torch.Tensor) -> float:
        if self.relative_to == "abs":
            return self.sigma
        if self.relative_to == "delta":
            return self.sigma * self.delta / 2
        return self.sigma * rms(states)

    def _generator_for_call(self, generator: torch.Generator | None) -> torch.Generator:
        if self.secure:
            return torch.Generator().manual_seed(secrets.randbits(63))
        return generator if generator is not None else self._generator

    def add_noise(self, states: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """states + N(0, sigma^2 I) (sigma from :meth:`noise_sigma` of these states)."""
        sigma = self.noise_sigma(states)
        if sigma == 0.0:
            return states.clone()
        noise = torch.randn(states.shape, generator=self._generator_for_call(generator), dtype=torch.float32)
        return states + (sigma * noise).to(device=states.device, dtype=states.dtype)

    # ------------------------------------------------------------------------------ defence
    def serve(self, loaded: LoadedModel, layer: int) -> LoadedModel:
        if self.placement == "exposure":
            return loaded
        served = copy_loaded(loaded, f"{self.spec()}@{layer}")
        whitebox = WhiteBox(served.model)
        layer = whitebox.resolve_layer(layer)
        generator = torch.Generator().manual_seed(self.seed)  # the served model's own stream
        # random: no key, so nothing derived from this copy is cached on disk (sipit.cache.model_key)
        whitebox.transform_layer(layer, lambda states: self.add_noise(states, generator))
        return served

    @property
    def alters_exposure(self) -> bool:
        return self.placement == "exposure"

    def expose(self, states: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        if self.placement == "model":
            return states  # the served model's layer-l states already carry the noise
        return self.add_noise(states, generator)

    def params(self) -> dict:
        return {"sigma": self.sigma, "relative_to": self.relative_to, "delta": self.delta,
                "placement": self.placement, "seed": self.seed, "secure": self.secure}

    def describe(self) -> str:
        scale = {"abs": "absolute", "rms": "x RMS of the state", "delta": f"x Delta/2 (Delta={self.delta})"}[self.relative_to]
        where = ("inside the model: a hook on block l adds the noise, later blocks and the head see it"
                 if self.placement == "model" else
                 "exposure only: served model unchanged, the exported states get noise")
        rng = "secure (fresh OS-random seed per call)" if self.secure else f"seeded generator (seed {self.seed})"
        return (f"noise: N(0, sigma^2 I), sigma = {self.sigma} {scale}; {where}; {rng}. "
                "Attacker holds the clean model and knows sigma.")
