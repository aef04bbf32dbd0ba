"""The offline training corpus of the softmax classification head, and its cached hidden states.

The head (attacks.head) is trained on (h_t, s_t) pairs: layer-l states of a text corpus and the
tokens that produced them. The corpus is Python's own ``pydoc_data.topics`` (a snapshot shipped with
sipit, no network: :mod:`sipit.offline_text`), which is disjoint from the evaluation prompts
(benchmarks/data/natural.txt is text written for this project; random-token prompts share nothing
with any corpus):
:func:`overlap_with` measures the shared 8-grams so a run can report it.

The corpus text is tokenised once (topics in sorted order, joined by blank lines), cut into
windows of ``window`` tokens (each window is its own sequence starting at position 0, like a
prompt), and the first ``n_tokens`` tokens are kept. Layer-l states of every window are cached on
disk under ``sipit.models.cache_dir() / "head-states"`` keyed by model name, layer and a hash of
the token ids, so a second run with the same model/layer/corpus loads them in well under a second.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from attacks.corpus import DEFAULT_WINDOW, corpus_windows
from sipit.models import cache_dir, save_to_cache

DEFAULT_CORPUS_TOKENS = 4096


@dataclass
class CorpusStates:
    """Layer-l states of the corpus: ``states`` (N, d), ``ids`` (N,), ``windows`` (N,) window index."""

    states: torch.Tensor
    ids: torch.Tensor
    windows: torch.Tensor
    key: str
    cached: bool  # True when loaded from disk

    def __len__(self) -> int:
        return int(self.ids.numel())


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_")[-80:] or "model"


def states_key(model_name: str, layer: int, windows: list[list[int]]) -> str:
    """Cache key: model name, layer and the sha256 of the windows' token ids."""
    digest = hashlib.sha256(repr(windows).encode()).hexdigest()[:16]
    return f"{_slug(model_name)}-l{layer}-{digest}"


def corpus_states(
    loaded,
    whitebox,
    layer: int,
    *,
    n_tokens: int = DEFAULT_CORPUS_TOKENS,
    window: int = DEFAULT_WINDOW,
    use_cache: bool = True,
    progress: bool = False,
) -> CorpusStates:
    """Layer-``layer`` states of the head corpus, computed once and cached on disk."""
    layer = whitebox.resolve_layer(layer)
    windows = corpus_windows(loaded.tokenizer, n_tokens, window)
    key = states_key(loaded.name, layer, windows)
    path = cache_dir() / "head-states" / f"{key}.pt"
    if use_cache and path.is_file():
        try:
            data = torch.load(path, map_location="cpu", weights_only=True)
            return CorpusStates(data["states"], data["ids"], data["windows"], key, cached=True)
        except (OSError, RuntimeError, KeyError, EOFError):
            pass  # a damaged cache file is recomputed below
    states, ids, where = [], [], []
    for i, w in enumerate(tqdm(windows, desc=f"head corpus states l={layer}", disable=not progress, leave=False)):
        states.append(whitebox.states(w, layer).float().cpu())
        ids.extend(w)
        where.extend([i] * len(w))
    out = CorpusStates(
        torch.cat(states), torch.tensor(ids, dtype=torch.long), torch.tensor(where, dtype=torch.long), key, cached=False
    )
    if use_cache:
        save_to_cache({"states": out.states, "ids": out.ids, "windows": out.windows}, path)
    return out


def overlap_with(windows: list[list[int]], prompts: list[list[int]], n: int = 8) -> float:
    """Fraction of the prompts' token n-grams that also occur in the corpus windows."""
    corpus = {tuple(w[i : i + n]) for w in windows for i in range(len(w) - n + 1)}
    grams = [tuple(p[i : i + n]) for p in prompts for i in range(len(p) - n + 1)]
    return sum(g in corpus for g in grams) / len(grams) if grams else 0.0
