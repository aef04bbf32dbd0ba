"""Keyed obfuscation: the exposed states mixed by a secret key that the provider can undo.

Two families, each acting on the last dimension of what is exposed (the residual stream's d, or the
K/V row's width under the KV exposure):

- ``permute``: a secret permutation pi of the dimensions, ``h~ = h P`` (``h~_i = h_{pi(i)}``);
- ``rotate``: a secret random orthogonal matrix Q (Haar: the Q of a QR factorisation of a Gaussian
  matrix, column signs fixed by R's diagonal), ``h~ = h Q``; with ``rank=r > 0`` instead the random
  invertible low-rank-plus-identity mixing ``M = I + U V^T / sqrt(d)`` (U, V Gaussian d x r), inverted
  by the Woodbury identity.

The key is drawn from a generator seeded by ``seed`` (reproducible benchmarks) or, with
``secure=true``, from a seed taken from the OS CSPRNG (``secrets``), as a deployment would. Scope:
``deployment`` draws one key for every exposure; ``prompt`` a fresh key for every exposed prompt (the
attacker then sees one exposure per key).

The provider holds the key: :meth:`restore` undoes the mixing of the last exposure (up to float
rounding for ``rotate``, bit for bit for ``permute``), so inference continued from the exposed states
costs nothing (defenses.utility measures it through :meth:`Defense.provider_view`). The attacker knows
the scheme and the scope, never the key: its strongest attacks recover the key from the exposure's
statistics or from known (prompt, exposure) pairs (attacks.key_recovery).
"""

from __future__ import annotations

import math
import secrets
from dataclasses import replace

import torch

from defenses.base import Defense, DefenseParamError, check_choice, check_number

SCOPES = ("deployment", "prompt")


class KeyedMixing(Defense):
    """A secret, invertible mixing of the exposed dimensions (module docstring); subclasses draw the key."""

    param_names = ("scope", "seed", "secure")

    def __init__(self, scope: str = "deployment", seed: int = 0, secure: bool = False):
        check_choice("scope", scope, SCOPES)
        self.scope = scope
        self.seed = check_number("seed", seed, minimum=0, integer=True)
        if not isinstance(secure, bool):
            raise DefenseParamError(f"secure must be a bool, got {secure!r}")
        self.secure = secure
        self._stream = torch.Generator().manual_seed(self.seed)  # prompt scope without a caller's generator
        self._deployment_key = None
        self.last_key = None  # the key of the last exposure: the provider's, for restore()

    @property
    def alters_exposure(self) -> bool:
        return True

    def _generator(self, generator: torch.Generator | None) -> torch.Generator:
        if self.secure:
            return torch.Generator().manual_seed(secrets.randbits(63))
        if self.scope == "deployment":
            return torch.Generator().manual_seed(self.seed)
        return self._stream if generator is None else generator

    def key_for(self, width: int, generator: torch.Generator | None = None):
        """The key that mixes an exposure of ``width`` dimensions: the deployment's (drawn once), or a fresh
        one per call (scope prompt, drawn from ``generator``: the run's seeded stream)."""
        if self.scope == "deployment":
            if self._deployment_key is None or self._width(self._deployment_key) != width:
                self._deployment_key = self.draw_key(width, self._generator(None))
            return self._deployment_key
        return self.draw_key(width, self._generator(generator))

    def expose(self, states: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        self.last_key = self.key_for(states.shape[-1], generator)
        return self.mix(states, self.last_key)

    def restore(self, exposed: torch.Tensor, key=None) -> torch.Tensor:
        """The provider's inverse: the states before :meth:`expose` mixed them (with the last key by default)."""
        key = self.last_key if key is None else key
        if key is None:
            raise RuntimeError("nothing was exposed yet: there is no key to undo")
        return self.unmix(exposed, key)

    def provider_view(self, states: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """What the key holder continues from: the exposure, restored."""
        return self.restore(self.expose(states, generator))

    def knowledge(self, exposure, knows_defense: bool = True):
        """The scheme, scope and (rotate) rank, never the key: the key-recovery attacker's input
        (attacks.key_recovery). The naive attacker is not told the exposure is mixed."""
        if not knows_defense:
            return exposure
        return replace(exposure, keyed={"scheme": self.name, "scope": self.scope, "rank": getattr(self, "rank", 0)})

    def params(self) -> dict:
        return {"scope": self.scope, "seed": self.seed, "secure": self.secure}

    # subclasses: draw_key, _width, mix, unmix


class Permute(KeyedMixing):
    """h~ = h P: a secret permutation of the exposed dimensions."""

    name = "permute"

    def draw_key(self, width: int, generator: torch.Generator) -> torch.Tensor:
        return torch.randperm(width, generator=generator)

    @staticmethod
    def _width(key: torch.Tensor) -> int:
        return int(key.numel())

    def mix(self, states: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        return states[..., key.to(states.device)]

    def unmix(self, exposed: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        return exposed[..., torch.argsort(key).to(exposed.device)]

    def describe(self) -> str:
        return (f"permute: the exposed dimensions permuted by a secret key ({self.scope} scope, "
                f"{'OS-random' if self.secure else f'seed {self.seed}'}); the provider undoes it exactly; the "
                "attacker knows the scheme, not the key.")


class Rotate(KeyedMixing):
    """h~ = h Q, Q Haar-random orthogonal; or h~ = h (I + U V^T / sqrt(d)) with ``rank`` r > 0."""

    name = "rotate"
    param_names = KeyedMixing.param_names + ("rank",)

    def __init__(self, scope: str = "deployment", seed: int = 0, secure: bool = False, rank: int = 0):
        super().__init__(scope, seed, secure)
        self.rank = check_number("rank", rank, minimum=0, integer=True)

    def draw_key(self, width: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """(M, M^-1) in float64: Q and Q^T, or I + U V^T / sqrt(d) and its Woodbury inverse."""
        if self.rank:
            u = torch.randn(width, self.rank, generator=generator, dtype=torch.float64)
            v = torch.randn(width, self.rank, generator=generator, dtype=torch.float64) / math.sqrt(width)
            mixing = torch.eye(width, dtype=torch.float64) + u @ v.T
            small = torch.eye(self.rank, dtype=torch.float64) + v.T @ u  # Woodbury: (I + U V^T)^-1
            inverse = torch.eye(width, dtype=torch.float64) - u @ torch.linalg.solve(small, v.T)
            return mixing, inverse
        q, r = torch.linalg.qr(torch.randn(width, width, generator=generator, dtype=torch.float64))
        q = q * torch.sign(torch.diagonal(r))  # Haar measure (Mezzadri 2007)
        return q, q.T

    @staticmethod
    def _width(key) -> int:
        return int(key[0].shape[0])

    def mix(self, states: torch.Tensor, key) -> torch.Tensor:
        return (states.double() @ key[0].to(states.device)).to(states.dtype)

    def unmix(self, exposed: torch.Tensor, key) -> torch.Tensor:
        return (exposed.double() @ key[1].to(exposed.device)).to(exposed.dtype)

    def params(self) -> dict:
        return {**super().params(), "rank": self.rank}

    def describe(self) -> str:
        what = (f"a secret invertible mixing I + U V^T (rank {self.rank})" if self.rank
                else "a secret random orthogonal rotation")
        return (f"rotate: the exposed states multiplied by {what} ({self.scope} scope, "
                f"{'OS-random' if self.secure else f'seed {self.seed}'}); the provider undoes it; the attacker "
                "knows the scheme, not the key.")
