"""The common interface of every defence: what it does to the served model and to what leaks.

A defence acts in up to three places (docs/architecture.md, "Where a defence acts"):

- :meth:`Defense.serve` — the model the provider runs (quantised weights, tied embeddings, noise
  injected inside the network). Returns a *new* :class:`LoadedModel` when it changes anything,
  never mutating the caller's model; the same object otherwise.
- :meth:`Defense.expose` — what leaks, computed from the served model's layer-l states ``(T, d)``
  (noisy, quantised-then-dequantised or pooled states).
- :meth:`Defense.attacker_model` — the white-box model an adaptive attacker holds
  (``knows_defense=True``: everything the defence does to the weights; ``False``: only the
  original full-precision weights).

What the attacker knows of the exposure is declared by the defence too: :meth:`Defense.knowledge`
adds its part to an ``attacks.registry.Exposure`` (the pooling, the tying groups, the keyed scheme,
the DP mechanism), which ``attacks.registry.strongest`` reads to pick the attack; a chain folds its
members' declarations in order. The formal guarantee a defence claims, if any, is
:meth:`Defense.guarantee`.

Parameters are validated once, in ``__init__``; a bad value raises :class:`DefenseParamError`
(a ``ValueError``) naming the parameter and what is allowed.
"""

from __future__ import annotations

import copy
import json
from abc import ABC, abstractmethod
from typing import Callable, ClassVar, TypeVar

import torch

from sipit.models import LoadedModel
from sipit.whitebox import SipitInputError

T = TypeVar("T")


class DefenseParamError(ValueError):
    """A defence parameter with a bad value, an unknown name, or a bad combination."""


class PooledExposureError(SipitInputError):
    """A per-position attack was given a pooled exposure (see :func:`require_per_position`)."""


class Defense(ABC):
    """Base class: named, validated parameters plus serve / expose / attacker_model."""

    name: ClassVar[str]
    per_position: ClassVar[bool] = True
    #: the keyword parameters this defence accepts (used by ``make_chain`` to route params)
    param_names: ClassVar[tuple[str, ...]] = ()

    def serve(self, loaded: LoadedModel, layer: int) -> LoadedModel:
        """The served model (default: the same object, the defence does not touch the weights)."""
        return loaded

    def expose(self, states: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """What leaks, from the served model's layer-l states ``(T, d)`` (default: the states)."""
        return states

    def attacker_model(self, loaded: LoadedModel, layer: int, knows_defense: bool = True) -> LoadedModel:
        """The white-box model an adaptive attacker holds (default: the clean model)."""
        return loaded

    def provider_view(self, states: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """What the provider itself continues inference from, given the served states (default: the exposure;
        a keyed defence restores its mixing, defenses.keyed)."""
        return self.expose(states, generator)

    @property
    def alters_exposure(self) -> bool:
        """Whether :meth:`expose` changes the served model's states (default: it returns them as they are)."""
        return False

    def noise_sigma(self, states: torch.Tensor) -> float:
        """Absolute per-coordinate sigma of Gaussian noise in the exposure (0.0 if none)."""
        return 0.0

    def knowledge(self, exposure, knows_defense: bool = True):
        """What an attacker knows of this defence's exposure, added to ``exposure`` (an
        ``attacks.registry.Exposure``: the measured noise sigma, whether the states are exact, and what the
        members before this one in a chain declared); returns the refined Exposure (``dataclasses.replace``).
        ``knows_defense=False`` is the naive attacker: a defence then declares only what no attack can
        ignore (a pooled layout). Default: nothing beyond the sigma (:meth:`noise_sigma`)."""
        return exposure

    def guarantee(self, n_states: int) -> dict | None:
        """The formal guarantee the defence claims for one prompt of ``n_states`` exposed states, per state and
        composed over them (defenses.dp); None: it claims none."""
        return None

    @property
    def served_shape_matters(self) -> bool:
        """Whether the served model's states depend on the shape of its forward pass (kernels that
        round to low precision), so that an attacker holding the served weights must verify its
        candidates at the served shape (sipit.whitebox.WhiteBox.at_served_shape). Default: no."""
        return False

    def served_copy(self, loaded: LoadedModel, build: Callable[[], T]) -> T:
        """``build()``'s modified copy of ``loaded`` (with whatever it returns alongside), made once per
        (defence, parameters) and held by ``loaded.served``, so a served model and the adaptive
        attacker's, and every search trial of the same setting, share it. One copy at a time: each is
        a whole model."""
        key = (self.name, json.dumps(self.params(), sort_keys=True, default=str))
        if key not in loaded.served:
            loaded.served.clear()
            loaded.served[key] = build()
        return loaded.served[key]

    def check_model(self, loaded: LoadedModel) -> None:
        """Raise :class:`DefenseParamError` if the parameters do not fit ``loaded`` (e.g. more groups
        than tokens); cheap, so callers run it before any heavy work. Default: every model fits."""

    def check_exposure(self, exposure: str, d: int) -> None:
        """Raise :class:`DefenseParamError` if the defence cannot act on the exposure ``exposure``
        (sipit.whitebox.EXPOSURES) of width ``d`` (the residual's hidden size, or 2 x KV heads x head
        dim for ``kv``). Default: it acts on any exposed copy."""

    @abstractmethod
    def params(self) -> dict:
        """The validated parameters, for logging."""

    @abstractmethod
    def describe(self) -> str:
        """What the defence does to the served model, to the exposure, and what the attacker knows."""

    def spec(self) -> str:
        """Every parameter as a spec string, ``name:key=value,...`` (what names a served copy)."""
        params = ",".join(f"{k}={v}" for k, v in self.params().items() if v is not None)
        return f"{self.name}:{params}" if params else self.name

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params().items())
        return f"{type(self).__name__}({args})"


def copy_loaded(loaded: LoadedModel, suffix: str) -> LoadedModel:
    """A deep copy of the model (same tokenizer object), named ``<name>+<suffix>`` (the defence's
    :meth:`Defense.spec`: every parameter), in eval mode. Caches never key on the name
    (sipit.cache.model_key hashes the weights)."""
    model = copy.deepcopy(loaded.model)
    model.eval()
    model.requires_grad_(False)
    return LoadedModel(model=model, tokenizer=loaded.tokenizer, name=f"{loaded.name}+{suffix}")


def chain_members(defense: Defense) -> list[Defense]:
    """The defences ``defense`` applies, in order: a chain's members, or the defence itself."""
    return list(getattr(defense, "members", [defense]))


def find_member(defense: Defense, name: str) -> Defense | None:
    """The first defence named ``name`` among :func:`chain_members` (None if there is none)."""
    return next((m for m in chain_members(defense) if m.name == name), None)


def require_per_position(defense: Defense, attack_name: str = "this attack") -> None:
    """Raise :class:`PooledExposureError` when ``defense`` exposes pooled (non ``(T, d)``) states.

    Per-position attacks (SipIt, nearest-neighbour decoding) need one state per token. Pooled
    exposures have the layout ``(1, P, D')`` so ``WhiteBox.check_states`` rejects them anyway;
    this helper says why and what to use instead.
    """
    if not defense.per_position:
        raise PooledExposureError(
            f"{attack_name} decodes one state per position, but defence {defense.name!r} "
            f"({defense.params()}) exposes only pooled states; use "
            "attacks.pooled.PooledBeamAttack (the adaptive attack on pooled exposure)"
        )


def check_choice(param: str, value, choices) -> None:
    if value not in choices:
        raise DefenseParamError(f"{param} must be one of {list(choices)}, got {value!r}")


def check_number(param: str, value, *, minimum=None, exclusive: bool = False, integer: bool = False):
    """Validate a number (bool rejected); returns it as int/float."""
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind):
        raise DefenseParamError(f"{param} must be {'an int' if integer else 'a number'}, got {value!r}")
    if not integer and not float("-inf") < float(value) < float("inf"):
        raise DefenseParamError(f"{param} must be finite, got {value!r}")
    if minimum is not None:
        bad = value <= minimum if exclusive else value < minimum
        if bad:
            raise DefenseParamError(f"{param} must be {'>' if exclusive else '>='} {minimum}, got {value!r}")
    return int(value) if integer else float(value)


class NoDefense(Defense):
    """The undefended baseline: the model served as is, its states exposed exactly."""

    name = "none"

    def params(self) -> dict:
        return {}

    def describe(self) -> str:
        return "none: served model unchanged; exposure = exact layer-l states; attacker holds the same model."


class Chain(Defense):
    """Defences applied in order: serve folds left, exposure applies each member in turn."""

    name = "chain"

    def __init__(self, members: list[Defense]):
        if not members:
            raise DefenseParamError("a chain needs at least one defence")
        for i, member in enumerate(members[:-1]):
            if not member.per_position:
                raise DefenseParamError(
                    f"{member.name!r} pools the exposure, so it must come last in a chain (position {i})"
                )
        self.members = list(members)

    @property
    def per_position(self) -> bool:  # type: ignore[override]
        return all(m.per_position for m in self.members)

    def serve(self, loaded: LoadedModel, layer: int) -> LoadedModel:
        for member in self.members:
            loaded = member.serve(loaded, layer)
        return loaded

    @property
    def alters_exposure(self) -> bool:  # type: ignore[override]
        return any(m.alters_exposure for m in self.members)

    def expose(self, states: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        for member in self.members:
            states = member.expose(states, generator)
        return states

    def attacker_model(self, loaded: LoadedModel, layer: int, knows_defense: bool = True) -> LoadedModel:
        for member in self.members:
            loaded = member.attacker_model(loaded, layer, knows_defense)
        return loaded

    def provider_view(self, states: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        for member in self.members:
            states = member.provider_view(states, generator)
        return states

    @property
    def served_shape_matters(self) -> bool:  # type: ignore[override]
        return any(m.served_shape_matters for m in self.members)

    def noise_sigma(self, states: torch.Tensor) -> float:
        """Independent Gaussian noise adds in quadrature."""
        return float(sum(m.noise_sigma(states) ** 2 for m in self.members) ** 0.5)

    def knowledge(self, exposure, knows_defense: bool = True):
        """Each member's declaration in order (a pooling member comes last)."""
        for member in self.members:
            exposure = member.knowledge(exposure, knows_defense)
        return exposure

    def guarantee(self, n_states: int) -> dict | None:
        """The one member's claim when only one claims; each claiming member's by ``position. name`` otherwise."""
        claims = {f"{i + 1}. {m.name}": g for i, m in enumerate(self.members)
                  if (g := m.guarantee(n_states)) is not None}
        if len(claims) <= 1:
            return next(iter(claims.values()), None)
        return {"members": claims, "note": "each member's own claim; their composition is not computed"}

    def check_model(self, loaded: LoadedModel) -> None:
        for member in self.members:
            member.check_model(loaded)

    def check_exposure(self, exposure: str, d: int) -> None:
        for member in self.members:
            member.check_exposure(exposure, d)

    def params(self) -> dict:
        return {"members": [{"name": m.name, **m.params()} for m in self.members]}

    def describe(self) -> str:
        return "chain, in order:\n" + "\n".join(f"  {i + 1}. {m.describe()}" for i, m in enumerate(self.members))
