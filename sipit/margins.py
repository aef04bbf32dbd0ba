"""Exact per-step margins Delta_t over the full vocabulary (docs/theory.md, "Margin and noise").

    Delta_t = min_{v != s_t} || mu_{p_t,v} - mu_{p_t,s_t} ||_2,   mu_{p,v} = Phi^l(p + v)_{|p|}

For every position the prefix p_t = s_1..s_{t-1} is cached once (``WhiteBox.prefix_cache``), the
whole vocabulary is stepped on it in chunks of ``chunk`` candidates (``WhiteBox.step``: one
incremental position per candidate, no block above ``layer``), and the prefix is extended by the
true token with ``CandidateBatch.extended`` (sliced from the chunk that holds it: no extra pass).

Cost: T * V incremental candidate positions, the same number of token-positions as a plain
batched forward of T * V tokens; the distances themselves are one (chunk, d) subtraction per
chunk. Measured ratio to plain forwards: notes/issue-4.md.

:func:`distances_to_all` is the one distance function over the full vocabulary; exact
nearest-neighbour decoding (attacks.robust) uses it too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

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


def _chunks(vocab_size: int, chunk: int, device) -> list[torch.Tensor]:
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    return list(torch.arange(vocab_size, device=device).split(chunk))


@torch.no_grad()
def _fill_distances(whitebox: WhiteBox, prefix: PrefixCache, target: torch.Tensor, chunks, out: torch.Tensor) -> None:
    target = target.to(device=whitebox.device, dtype=whitebox.embedding.weight.dtype)
    for ids in chunks:
        batch = whitebox.step(prefix, ids)
        out[ids] = (batch.states - target).norm(dim=-1).float()


@torch.no_grad()
def all_states(whitebox: WhiteBox, prefix: PrefixCache, chunk: int = 1024) -> torch.Tensor:
    """mu_{p,v} for every token v of the vocabulary, ``(V, d)`` (chunked steps on the cached prefix)."""
    return torch.cat([whitebox.step(prefix, ids).states for ids in _chunks(whitebox.vocab_size, chunk, whitebox.device)])


@torch.no_grad()
def distances_to_all(whitebox: WhiteBox, prefix: PrefixCache, target: torch.Tensor, *, chunk: int = 1024) -> torch.Tensor:
    """||mu_{p,v} - target||_2 for every token v of the vocabulary, ``(V,)`` (float32)."""
    out = torch.empty(whitebox.vocab_size, dtype=torch.float32, device=whitebox.device)
    _fill_distances(whitebox, prefix, target, _chunks(whitebox.vocab_size, chunk, whitebox.device), out)
    return out


@torch.no_grad()
def margins(whitebox: WhiteBox, ids, layer: int, *, chunk: int = 1024, progress: bool = False) -> Margins:
    """Exact Delta_t and nearest competitor for every position of ``ids`` at ``layer``.

    Per position, the chunk holding the true token runs first: its row is mu_{p_t,s_t} (the
    reference every distance is measured from) and its cache extends the prefix.
    """
    ids = whitebox.check_ids(ids)
    layer = whitebox.resolve_layer(layer)
    chunks = _chunks(whitebox.vocab_size, chunk, whitebox.device)
    size = chunks[0].numel()
    prefix = whitebox.prefix_cache(ids[:0], layer)
    deltas, competitors, states = [], [], []
    for t in tqdm(range(ids.numel()), desc=f"margins l={layer}", disable=not progress, leave=False):
        token = int(ids[t])
        home = token // size
        batch = whitebox.step(prefix, chunks[home])
        at = token - int(chunks[home][0])
        true_state = batch.states[at]
        dist = torch.empty(whitebox.vocab_size, dtype=torch.float32, device=whitebox.device)
        dist[chunks[home]] = (batch.states - true_state).norm(dim=-1).float()
        _fill_distances(whitebox, prefix, true_state, chunks[:home] + chunks[home + 1 :], dist)
        dist[token] = float("inf")
        j = int(dist.argmin())
        deltas.append(float(dist[j]))
        competitors.append(j)
        states.append(true_state)
        prefix = batch.extended(at)
    return Margins(
        delta=torch.tensor(deltas),
        competitor=torch.tensor(competitors, dtype=torch.long),
        true_states=torch.stack(states),
        ids=ids.cpu(),
        layer=layer,
    )
