"""The position-0 table: every token's layer-l state when it stands alone at position 0.

    F_v = Phi^l(v)_0        for every token v of the vocabulary, (V, d)

A state at position 0 depends on nothing but the token (causal attention sees only itself), so
this one table answers position 0 of every prompt: the observed h~_0 is (up to floating-point
noise) one of its rows, and the nearest rows are the candidates to verify first. It also gives
the linear surrogate (attacks.surrogate) its design matrix.

:func:`vocabulary_states` is the same table on any prefix p, mu_{p,v} = Phi^l(p + v)_{|p|}
(position 0 is F itself), kept in memory only (a bounded LRU per WhiteBox).

Cost: V single-position steps on the empty prefix, i.e. about a plain forward of V tokens up to
layer l (smollm2-135m, 2 CPU cores: ~75 s at layer 30, ~2 s at layer 1). Fewer when rows repeat:
F_v depends on v only through its input row e_v, so one token per distinct row is stepped, and a
copy whose layer-l computation is its original's but for the input embedding (a tied model,
``WhiteBox.proposals_from``, same :func:`sipit.cache.body_key`) reads the rows its original also has
from the original's table (tying the rarest tokens: no step at all). The table is computed
once per (model, layer), cached on disk under ``sipit.cache.cache_dir() / "tables"`` and kept
in memory by the WhiteBox that owns the model (``WhiteBox.memo``). The disk key is
:func:`sipit.cache.model_key` (every weight's bytes and every forward change), so a different model,
a fine-tuned copy or a quantised variant never reuses another's table; a file that is truncated,
corrupt or of the wrong shape is removed with a warning and rebuilt, never trusted.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from sipit import cache
from sipit.cache import body_key, entry_path, model_key
from sipit.memo import memoised
from sipit.resources import FLOAT32, check_room
from sipit.sweep import sweep_states
from sipit.whitebox import PrefixCache, WhiteBox

TABLE_MEMO_SIZE = 24  # per-prefix tables kept per WhiteBox (V x d each: 113 MB for smollm2)


@dataclass
class VocabTable:
    """F (V, d) for one (model, layer), with where it came from and what it cost."""

    states: torch.Tensor
    layer: int
    key: str
    seconds: float  # time to build, or to load from disk
    cached: bool  # True when loaded from disk
    needs: str = ""  # what the build needed (sipit.resources.check_room), when it was built
    _sq_norms: torch.Tensor | None = field(default=None, repr=False)  # ||F_v||^2, on first use

    def neg_sq_distances(self, h: torch.Tensor) -> torch.Tensor:
        """-||F_v - h||^2 for every token v, ``(V,)``, as 2 F h - ||F_v||^2 - ||h||^2.

        One matrix-vector product over F (the direct difference writes and re-reads a V x d
        temporary several times; 113 MB for smollm2). Cancellation costs ~1e-7 x ||F_v||^2 of
        absolute precision, which only orders candidates: acceptance is verified exactly."""
        table = self.states if self.states.dtype in (torch.float32, torch.float64) else self.states.float()
        if self._sq_norms is None:
            self._sq_norms = table.pow(2).sum(1)
        h = h.to(table.device, table.dtype)
        return 2 * (table @ h) - self._sq_norms - h.pow(2).sum()


def table_path(whitebox: WhiteBox, layer: int) -> Path | None:
    """Disk location of the position-0 table of this model at ``layer`` (None: the model has no cache key)."""
    key = model_key(whitebox)
    return None if key is None else entry_path("tables", f"pos0-{key}-l{layer}.pt")


def _row_keys(whitebox: WhiteBox, chunk: int = 4096) -> list[bytes]:
    """A 16-byte digest of each input-embedding row's bytes: equal keys, equal rows (bit for bit, up to a
    blake2b collision). Read ``chunk`` rows at a time, so no copy of the whole matrix is made."""
    rows = whitebox.embedding.weight.detach()
    keys = []
    for part in rows.split(chunk):
        data = part.cpu().contiguous().view(torch.uint8).numpy()
        keys += [hashlib.blake2b(row.tobytes(), digest_size=16).digest() for row in data]
    return keys


@torch.no_grad()
def build_table(whitebox: WhiteBox, layer: int, chunk: int = 1024, progress: bool = False) -> torch.Tensor:
    """F_v = Phi^l(v)_0 for every v, ``(V, d)``: the distinct input rows swept on the empty prefix
    (incremental steps, also for a WhiteBox that verifies at the served shape: the table ranks, it
    does not verify), each token reading its row's state; rows of the original's table where
    ``proposals_from`` has the same :func:`sipit.cache.body_key` (module docstring). Peak memory: the
    table, once more only where rows repeat, plus one chunk."""
    whitebox = whitebox.at_served_shape(None)
    keys = _row_keys(whitebox)
    row_of: dict[bytes, int] = {}  # distinct input row -> its index among the distinct rows
    first: list[int] = []  # the first token with each distinct row
    for token, key in enumerate(keys):
        if key not in row_of:
            row_of[key] = len(first)
            first.append(token)
    distinct = list(row_of)
    todo = list(range(len(distinct)))
    original = whitebox.proposals_from
    same_body = original is not None and body_key(original) is not None and body_key(original) == body_key(whitebox)
    shared: list[int] = []
    if same_body:
        theirs = {key: token for token, key in enumerate(_row_keys(original))}
        shared = [i for i in todo if distinct[i] in theirs]
        todo = [i for i in todo if distinct[i] not in theirs]
    if not shared and len(distinct) == len(keys):  # every row its own and nothing to borrow: one sweep, no copy
        return sweep_states(whitebox, whitebox.prefix_cache([], layer), chunk=chunk, progress=progress,
                            desc=f"position-0 table l={layer}")
    states = torch.empty(len(distinct), whitebox.d, dtype=torch.float32, device=whitebox.device)
    if shared:
        table = position_zero_table(original, layer, progress=progress).states
        states[shared] = table[[theirs[distinct[i]] for i in shared]].to(states)
    if todo:
        ids = torch.tensor([first[i] for i in todo], dtype=torch.long)
        states[todo] = sweep_states(whitebox, whitebox.prefix_cache([], layer), ids=ids, chunk=chunk,
                                    progress=progress, desc=f"position-0 table l={layer}")
    if len(distinct) == len(keys):
        return states
    return states[torch.tensor([row_of[key] for key in keys], dtype=torch.long, device=whitebox.device)]


def position_zero_table(whitebox: WhiteBox, layer: int, *, use_disk: bool = True, progress: bool = False,
                        chunk: int = 1024) -> VocabTable:
    """The position-0 table of ``layer``: from memory, else from disk, else built (and stored)."""
    layer = whitebox.resolve_layer(layer)
    key = ("pos0-table", layer)
    if key in whitebox.memo:
        return whitebox.memo[key]
    started = time.perf_counter()
    path = table_path(whitebox, layer) if use_disk else None
    states = cache.load(path, cache.check_tensor((whitebox.vocab_size, whitebox.d))) if path else None
    cached = states is not None
    needs = ""
    if states is None:
        size = whitebox.vocab_size * whitebox.d * FLOAT32
        needs = check_room(f"the position-0 table of layer {layer} (V={whitebox.vocab_size}, d={whitebox.d})",
                           memory=2 * size, disk=size if path is not None else 0,
                           folder=path.parent if path is not None else None)
        states = build_table(whitebox, layer, chunk, progress)
        if path is not None:
            cache.save(states.cpu(), path)
    table = VocabTable(states.to(device=whitebox.device, dtype=torch.float32), layer, path.stem if path else "",
                       time.perf_counter() - started, cached, needs)
    whitebox.memo[key] = table
    return table


def vocabulary_states(whitebox: WhiteBox, prefix: PrefixCache, chunk: int = 1024) -> torch.Tensor:
    """mu_{p,v} for every token v on ``prefix``, ``(V, d)``: one sweep of the vocabulary.

    Memoised per (layer, prefix tokens) in ``whitebox.memo["vocabulary-states"]`` (the
    :data:`TABLE_MEMO_SIZE` most recently used); on the empty prefix it is the position-0 table.
    """
    if prefix.length == 0:
        return position_zero_table(whitebox, prefix.layer, chunk=chunk).states
    plain = whitebox.at_served_shape(None)  # the memo is shared: always the incremental steps' states
    return memoised(whitebox, "vocabulary-states", (prefix.layer, prefix.tokens),
                    lambda: sweep_states(plain, prefix, chunk=chunk), size=TABLE_MEMO_SIZE)
