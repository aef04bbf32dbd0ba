"""Offline training text for learned attacks: Python's own documentation and random tokens.

The text is Python's ``pydoc_data.topics`` (CPython 3.11.7's, a snapshot shipped with sipit, no
network: :mod:`sipit.offline_text`), disjoint from the evaluation prompts (benchmarks/data/natural.txt
is text written for this project; random-token prompts share nothing with any corpus). It is
tokenised once (topics in sorted order, joined by blank lines) and cut into windows of ``window``
tokens, each its own sequence starting at position 0, like a prompt. :func:`random_windows` adds
seeded uniformly random token sequences, so rare tokens that the documentation never uses are seen too.
"""

from __future__ import annotations

import torch

from sipit.offline_text import corpus_text

DEFAULT_WINDOW = 64


def corpus_windows(tokenizer, n_tokens: int, window: int = DEFAULT_WINDOW) -> list[list[int]]:
    """The first ``n_tokens`` corpus tokens as consecutive windows of ``window`` tokens."""
    if n_tokens < 2:
        raise ValueError(f"the head corpus needs at least 2 tokens, got {n_tokens}")
    if window < 1:
        raise ValueError(f"window must be positive, got {window}")
    text = corpus_text()
    # Tokenising all ~1 MB is slow on big vocabularies; ~8 characters per token is generous.
    ids = tokenizer(text[: 8 * n_tokens + 1000], add_special_tokens=False).input_ids[:n_tokens]
    if len(ids) < n_tokens:
        ids = tokenizer(text, add_special_tokens=False).input_ids[:n_tokens]
    return [ids[i : i + window] for i in range(0, len(ids), window)]


def random_windows(vocab_size: int, n_tokens: int, window: int = DEFAULT_WINDOW, seed: int = 0,
                   exclude: set[int] | None = None) -> list[list[int]]:
    """``n_tokens`` uniformly random token ids (seeded, ``exclude`` left out) in windows of ``window``."""
    allowed = torch.tensor(sorted(set(range(vocab_size)) - (exclude or set())))
    picks = torch.randint(0, len(allowed), (n_tokens,), generator=torch.Generator().manual_seed(seed))
    ids = allowed[picks].tolist()
    return [ids[i : i + window] for i in range(0, len(ids), window)]
