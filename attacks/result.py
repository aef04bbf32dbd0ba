"""What an inversion attack returns: the decoded ids and a record of every position."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Iterable

#: fraction of unverified positions from which an exact attack's result suggests the wrong layer
UNVERIFIED_HINT_FRACTION = 0.5


@dataclass
class PositionRecord:
    """One decoded position.

    ``distance`` is ||mu_{p_t,v} - h~_t||_2 of the chosen token; ``verified`` is False when no
    candidate fell inside the acceptance radius and the nearest one was returned instead.
    """

    position: int
    token: int
    distance: float
    radius: float
    candidates_tried: int
    seconds: float
    verified: bool


@dataclass
class Inversion:
    """The result of inverting one sequence of observed states."""

    ids: list[int]
    text: str
    positions: list[PositionRecord] = field(default_factory=list)
    seconds: float = 0.0
    vocab_size: int = 0
    setup: list[str] = field(default_factory=list)  # one-time work before decoding (not in seconds)

    @property
    def candidates_tried(self) -> int:
        return sum(p.candidates_tried for p in self.positions)

    @property
    def all_verified(self) -> bool:
        return all(p.verified for p in self.positions)

    @property
    def explored_fraction(self) -> float:
        """Mean fraction of the vocabulary verified per position."""
        if not self.positions or not self.vocab_size:
            return 0.0
        return self.candidates_tried / (len(self.positions) * self.vocab_size)

    @property
    def unverified(self) -> int:
        """Positions where no candidate fell inside the acceptance radius."""
        return sum(not p.verified for p in self.positions)

    def token_accuracy(self, truth: list[int]) -> float:
        """Fraction of positions decoded to the true token."""
        if len(truth) != len(self.ids):
            raise ValueError(f"truth has {len(truth)} tokens, inversion has {len(self.ids)}")
        return sum(a == b for a, b in zip(self.ids, truth)) / max(len(truth), 1)

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(candidates_tried=self.candidates_tried, all_verified=self.all_verified,
                   explored_fraction=self.explored_fraction)
        return out


def layer_hint(inversions: Iterable[Inversion], layer: int) -> str | None:
    """A hint for the user when most positions of an exact attack stayed unverified, else None.

    Exact states of the named layer verify at (nearly) every position; states of another layer,
    or of another model, verify almost nowhere. Noise-robust decoders and heads have their own
    notion of ``verified``: call this for exact attacks (SipIt, BruteForce) only.
    """
    inversions = list(inversions)
    total = sum(len(inv.positions) for inv in inversions)
    unverified = sum(inv.unverified for inv in inversions)
    if not total or unverified < UNVERIFIED_HINT_FRACTION * total:
        return None
    what = "no position" if unverified == total else f"only {total - unverified} of {total} positions"
    return (f"{what} verified (no candidate within the acceptance radius): are these states from layer "
            f"{layer} of this model? check --layer (and --model)")
