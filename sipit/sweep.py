"""The whole-vocabulary sweep: every token's state on one cached prefix, chunk by chunk.

    mu_{p,v} = Phi^l(p + v)_{|p|}        for every token v of the vocabulary (or of a given id set)

The prefix p is cached once (``WhiteBox.prefix_cache``); the candidates are stepped on it in
chunks of ``chunk`` tokens (``WhiteBox.step``: one incremental position per candidate, no block
above the prefix's layer), and each chunk's :class:`~sipit.whitebox.CandidateBatch` is handed to a
reducer, so a caller keeps only what it needs (a distance per token, a running minimum) instead
of a ``(V, d)`` table. Cost: V incremental candidate positions, about a plain forward of V tokens
up to layer l.

:func:`sweep` is the one loop; the thin forms are :func:`sweep_states` (the ``(V, d)`` table
mu_{p,.}) and :func:`sweep_distances` (``||mu_{p,v} - target||_2``, ``(V,)``). Every
whole-vocabulary computation of sipit-bench goes through it: the margins Delta_t
(sipit.margins), the position-0 and per-prefix tables (sipit.vocab_table), the collision audit's
extensions (sipit.audit), the surrogate's fitting sample (attacks.surrogate), the prototype head
(attacks.head) and exact nearest-neighbour decoding (attacks.robust). Nothing here is cached:
the tables worth keeping are memoised by the WhiteBox that owns the model (sipit.vocab_table).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from tqdm.auto import tqdm

from sipit.whitebox import CandidateBatch, PrefixCache, WhiteBox

Reducer = Callable[[torch.Tensor, CandidateBatch], Any]


def _chunks(whitebox: WhiteBox, ids: torch.Tensor | None, chunk: int) -> list[torch.Tensor]:
    """``ids`` (default: the whole vocabulary, in id order) split into runs of ``chunk`` tokens."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    if ids is None:
        ids = torch.arange(whitebox.vocab_size, device=whitebox.device)
    else:
        ids = torch.as_tensor(ids, dtype=torch.long, device=whitebox.device).flatten()
    return list(ids.split(chunk))


@torch.no_grad()
def sweep(whitebox: WhiteBox, prefix: PrefixCache, reduce: Reducer, *, ids: torch.Tensor | None = None,
          chunk: int = 1024, first: int | None = None, progress: bool = False, desc: str = "vocabulary sweep") -> list:
    """Step every token of ``ids`` (default: the vocabulary) on ``prefix``, ``chunk`` at a time.

    For each chunk c (the token ids, a 1-D tensor on the model's device) this calls
    ``reduce(c, whitebox.step(prefix, c))`` -- the batch's ``states[i]`` is mu_{p,c[i]} and
    ``extended(i)`` the prefix cache extended by ``c[i]`` -- and returns the reducer's results in
    the order the chunks were stepped. The chunks are consecutive runs of ``ids``, whatever their
    order: ``first`` (a token among ``ids``) moves the chunk that holds it to the front, for
    reducers that need that token's state before the others'. ``chunk < 1`` raises ValueError.
    """
    chunks = _chunks(whitebox, ids, chunk)
    if first is not None:
        home = next((i for i, c in enumerate(chunks) if bool((c == first).any())), None)
        if home is None:
            raise ValueError(f"token {first} is not among the swept ids")
        chunks = [chunks[home]] + chunks[:home] + chunks[home + 1 :]
    return [reduce(c, whitebox.step(prefix, c))
            for c in tqdm(chunks, desc=desc, disable=not progress, leave=False)]


@torch.no_grad()
def sweep_states(whitebox: WhiteBox, prefix: PrefixCache, *, ids: torch.Tensor | None = None, chunk: int = 1024,
                 progress: bool = False, desc: str = "vocabulary sweep") -> torch.Tensor:
    """mu_{p,v} for every token v of ``ids`` (default: the vocabulary), ``(len(ids), d)`` in that order,
    written chunk by chunk into one preallocated tensor (peak memory: the table plus one chunk)."""
    n = whitebox.vocab_size if ids is None else int(torch.as_tensor(ids).numel())
    out = torch.empty(n, whitebox.d, dtype=torch.float32, device=whitebox.device)
    filled = [0]

    def write(c: torch.Tensor, batch: CandidateBatch) -> None:
        out[filled[0] : filled[0] + len(c)] = batch.states
        filled[0] += len(c)

    sweep(whitebox, prefix, write, ids=ids, chunk=chunk, progress=progress, desc=desc)
    return out


@torch.no_grad()
def sweep_distances(whitebox: WhiteBox, prefix: PrefixCache, target: torch.Tensor, *,
                    ids: torch.Tensor | None = None, chunk: int = 1024) -> torch.Tensor:
    """||mu_{p,v} - target||_2 for every token v of ``ids`` (default: the vocabulary), ``(len(ids),)`` float32.

    The distances are taken chunk by chunk: no ``(V, d)`` table is held.
    """
    target = target.to(device=whitebox.device, dtype=torch.float32)
    parts = sweep(whitebox, prefix, lambda c, batch: (batch.states - target).norm(dim=-1).float(), ids=ids, chunk=chunk)
    return torch.cat(parts)
