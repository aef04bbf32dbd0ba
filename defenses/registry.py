"""One registry of defences by CLI name, and chains of them ('quant,noise')."""

from __future__ import annotations

from defenses.base import Chain, Defense, DefenseParamError, NoDefense
from defenses.dp import DPNoise
from defenses.keyed import Permute, Rotate
from defenses.noise import GaussianNoise
from defenses.pooling import Pooling
from defenses.quant import Quantization
from defenses.tying import WeightTying

DEFENSES: dict[str, type[Defense]] = {
    "none": NoDefense,
    "noise": GaussianNoise,
    "quant": Quantization,
    "tying": WeightTying,
    "pooling": Pooling,
    "permute": Permute,
    "rotate": Rotate,
    "dp": DPNoise,
}


def _lookup(name: str) -> type[Defense]:
    try:
        return DEFENSES[name]
    except (KeyError, TypeError):
        raise DefenseParamError(f"unknown defence {name!r}: choose one of {sorted(DEFENSES)}") from None


def make_defense(name: str, **params) -> Defense:
    """A defence by registry name; unknown names or parameters raise ``ValueError``."""
    cls = _lookup(name)
    unknown = sorted(set(params) - set(cls.param_names))
    if unknown:
        raise DefenseParamError(
            f"defence {name!r} has no parameter(s) {unknown}; it takes {list(cls.param_names) or 'none'}"
        )
    return cls(**params)


def make_chain(names: list[str] | str, **params) -> Defense:
    """``'quant,noise'`` (or a list) -> a :class:`Chain`; each member takes the params it knows.

    A single name gives that defence itself. A parameter no member knows raises ``ValueError``.
    """
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    if not names:
        raise DefenseParamError("no defence named")
    classes = [_lookup(n) for n in names]
    known = set().union(*(c.param_names for c in classes))
    unknown = sorted(set(params) - known)
    if unknown:
        raise DefenseParamError(f"no defence in {names} takes parameter(s) {unknown}")
    members = [c(**{k: v for k, v in params.items() if k in c.param_names}) for c in classes]
    return members[0] if len(members) == 1 else Chain(members)
