"""Prompt sets: natural English prompts written for this project plus seeded random-token prompts.

The default mix is 90% natural / 10% random tokens, as in the paper's SipIt evaluation
(docs/theory.md, "Reported numbers"). Natural prompts live in ``benchmarks/data/natural.txt`` (one per line, ``\\n`` for a
line break inside code); each is tokenised and truncated to a fixed token count.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

DATA_DIR = Path(__file__).parent / "data"
NATURAL_FILE = DATA_DIR / "natural.txt"
PROMPT_SETS = ("mixed", "natural", "random")


@dataclass(frozen=True)
class Prompt:
    """One evaluation prompt: its token ids, where it came from, and its source text."""

    ids: list[int]
    kind: str  # "natural" or "random"
    text: str = ""


def read_texts(path: str | Path = NATURAL_FILE) -> list[str]:
    """Prompt texts from a file: one per line, ``#`` comments and blank lines skipped."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} does not exist")
    lines = path.read_text(encoding="utf-8").splitlines()
    texts = [line.replace("\\n", "\n") for line in lines if line.strip() and not line.startswith("#")]
    if not texts:
        raise ValueError(f"prompt file {path} holds no prompts")
    return texts


def encode(tokenizer, text: str, length: int | None) -> list[int]:
    """Token ids of ``text`` without added special tokens, truncated to ``length``."""
    ids = tokenizer(text, add_special_tokens=False).input_ids
    return ids[:length] if length is not None else ids


def random_ids(tokenizer, vocab_size: int, length: int, generator: torch.Generator) -> list[int]:
    """Uniformly random token ids, special tokens excluded."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    allowed = torch.tensor([v for v in range(vocab_size) if v not in special])
    picks = torch.randint(0, len(allowed), (length,), generator=generator)
    return allowed[picks].tolist()


def prompt_set(
    tokenizer,
    n: int,
    *,
    length: int = 20,
    seed: int = 0,
    natural_fraction: float = 0.9,
    vocab_size: int | None = None,
    source: str | Path = NATURAL_FILE,
) -> list[Prompt]:
    """``n`` prompts of exactly ``length`` tokens: natural ones first, then random-token ones.

    Natural prompts are drawn (seeded) from ``source`` among those with at least ``length``
    tokens; ``round(n * (1 - natural_fraction))`` prompts are random tokens.
    """
    if n < 1:
        raise ValueError(f"need at least one prompt, got n={n}")
    if length < 1:
        raise ValueError(f"prompt length must be positive, got {length}")
    if not 0.0 <= natural_fraction <= 1.0:
        raise ValueError(f"natural_fraction must lie in [0, 1], got {natural_fraction}")
    vocab_size = vocab_size or len(tokenizer)
    generator = torch.Generator().manual_seed(seed)
    n_random = round(n * (1.0 - natural_fraction))
    n_natural = n - n_random
    long_enough = [(t, ids) for t in read_texts(source) if len(ids := encode(tokenizer, t, length)) == length]
    if n_natural > len(long_enough):
        raise ValueError(
            f"asked for {n_natural} natural prompts of {length} tokens, {source} has {len(long_enough)}"
        )
    order = torch.randperm(len(long_enough), generator=generator)[:n_natural].tolist()
    prompts = [Prompt(ids=long_enough[i][1], kind="natural", text=long_enough[i][0]) for i in order]
    for _ in range(n_random):
        ids = random_ids(tokenizer, vocab_size, length, generator)
        prompts.append(Prompt(ids=ids, kind="random", text=tokenizer.decode(ids)))
    return prompts


def load_prompts(
    tokenizer, n: int, length: int = 20, seed: int = 0, natural_fraction: float = 0.9, **kwargs
) -> list[list[int]]:
    """Token ids of :func:`prompt_set` (the mixed set by default)."""
    return [p.ids for p in prompt_set(tokenizer, n, length=length, seed=seed, natural_fraction=natural_fraction, **kwargs)]


def named_prompt_set(name_or_path: str, tokenizer, n: int, *, length: int = 20, seed: int = 0) -> list[Prompt]:
    """A prompt set by name (``mixed`` 90/10, ``natural``, ``random``) or from a text file."""
    fractions = {"mixed": 0.9, "natural": 1.0, "random": 0.0}
    if name_or_path in fractions:
        return prompt_set(tokenizer, n, length=length, seed=seed, natural_fraction=fractions[name_or_path])
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(f"unknown prompt set {name_or_path!r}: use one of {list(PROMPT_SETS)} or a file path")
    texts = read_texts(path)[:n]
    return [Prompt(ids=encode(tokenizer, t, length), kind="file", text=t) for t in texts]
