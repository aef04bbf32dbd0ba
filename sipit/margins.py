"""Exact per-step margins Delta_t over the full vocabulary (docs/theory.md, "Margin and noise").

    Delta_t = min_{v != s_t} || mu_{p_t,v} - mu_{p_t,s_t} ||_2,   mu_{p,v} = Phi^l(p + v)_{|p|}

This module is the one place Delta is computed. For every position the prefix p_t = s_1..s_{t-1}
is cached once (``WhiteBox.prefix_cache``), the whole vocabulary is swept on it in chunks of
``chunk`` candidates (:func:`sipit.sweep.sweep`: one incremental position per candidate, no block
above ``layer``), and the prefix is extended by the true token with ``CandidateBatch.extended``
(sliced from the chunk that holds it: no extra pass).

- :func:`margins`: Delta_t and the nearest competitor at every position of a prompt;
- :func:`position_margin`: the same for one position on a given prefix cache;
- :func:`margin_from_states`: Delta from a full table mu_{p,.} ``(V, d)`` already at hand;
- :func:`margin_from_distances`: Delta from the distances ``||mu_{p,v} - mu_{p,s}||`` ``(V,)``.

Cost: T * V incremental candidate positions, the same number of token-positions as a plain
batched forward of T * V tokens; the distances themselves are one (chunk, d) subtraction per
chunk. Measured ratio to plain forwards: docs/noise.md, "Margins (exact)".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from sipit.sweep import sweep
from sipit.whitebox import PrefixCache, WhiteBox


@dataclass
class Margins:
    """Per-position margins of one prompt at one layer.

    ``delta[t]`` = Delta_t, ``competitor[t]`` the token v != s_t attaining it, ``true_states[t]``
    = mu_{p_t,s_t} (computed by the same cached step as the competitors), ``ids`` the prompt.
    """

    delta: torch.Tensor  # (T,)
    competitor: torch.Tensor  # (T,) long
    true_states: torch.Tensor  # (T, d)
    ids: torch.Tensor  # (T,) long
    layer: int

    def to_dict(self) -> dict:
        return {
            "layer": self.layer,
            "ids": self.ids.tolist(),
            "delta": self.delta.tolist(),
            "competitor": self.competitor.tolist(),
            "true_state_norm": self.true_states.norm(dim=-1).tolist(),
        }


@dataclass
class PositionMargin:
    """Delta at one position: the margin, the competitor attaining it, mu_{p,s} and the cache of p + s."""

    delta: float
    competitor: int
    true_state: torch.Tensor  # (d,)
    extended: PrefixCache


def margin_from_distances(distances: torch.Tensor, token: int) -> tuple[float, int]:
    """``(Delta, competitor)`` = min and argmin over v != ``token`` of ``distances`` (V,).

    ``distances[v]`` = ||mu_{p,v} - mu_{p,s}||; the entry of ``token`` (the true token s) is
    ignored, whatever it holds. The argument is not modified.
    """
    distances = distances.clone()
    distances[token] = float("inf")
    j = int(distances.argmin())
    return float(distances[j]), j


def margin_from_states(states: torch.Tensor, token: int) -> tuple[float, int]:
    """``(Delta, competitor)`` from a full table ``states`` (V, d) = mu_{p,.}, row ``token`` = mu_{p,s}."""
    return margin_from_distances((states - states[token]).norm(dim=-1), token)


@torch.no_grad()
def position_margin(whitebox: WhiteBox, prefix: PrefixCache, token: int, *, chunk: int = 1024) -> PositionMargin:
    """Delta at the position after ``prefix`` whose true token is ``token``: one sweep of the vocabulary.

    The chunk holding ``token`` is stepped first: its row is mu_{p,s} (the reference every
    distance is measured from, computed by the same cached step as the competitors) and its cache
    gives the extended prefix.
    """
    token = int(token)
    distances = torch.empty(whitebox.vocab_size, dtype=torch.float32, device=whitebox.device)
    true: dict = {}

    def reduce(ids: torch.Tensor, batch) -> None:
        if not true:  # the chunk holding the true token
            at = int((ids == token).nonzero()[0])
            true["state"], true["extended"] = batch.states[at], batch.extended(at)
        distances[ids] = (batch.states - true["state"]).norm(dim=-1).float()

    sweep(whitebox, prefix, reduce, chunk=chunk, first=token)
    delta, competitor = margin_from_distances(distances, token)
    return PositionMargin(delta, competitor, true["state"], true["extended"])


@torch.no_grad()
def margins(whitebox: WhiteBox, ids, layer: int, *, chunk: int = 1024, progress: bool = False) -> Margins:
    """Exact Delta_t and nearest competitor for every position of ``ids`` at ``layer``."""
    ids = whitebox.check_ids(ids)
    layer = whitebox.resolve_layer(layer)
    prefix = whitebox.prefix_cache(ids[:0], layer)
    found = []
    for t in tqdm(range(ids.numel()), desc=f"margins l={layer}", disable=not progress, leave=False):
        found.append(position_margin(whitebox, prefix, int(ids[t]), chunk=chunk))
        prefix = found[-1].extended
    return Margins(
        delta=torch.tensor([m.delta for m in found]),
        competitor=torch.tensor([m.competitor for m in found], dtype=torch.long),
        true_states=torch.stack([m.true_state for m in found]),
        ids=ids.cpu(),
        layer=layer,
    )
