"""Prompt sets: natural English prompts written for this project plus seeded random-token prompts.

The default mix is 90% natural / 10% random tokens, as in the paper's SipIt evaluation
(docs/theory.md, "Reported numbers"). Natural prompts live in ``benchmarks/data/natural.txt`` (one per line, ``\\n`` for a
line break inside code); each is tokenised and truncated to a fixed token count.

Splits: every named set has a ``dev`` part, read by whatever chooses an option (tuning, diagnosis,
the search), and a ``test`` part that only final measurements read (``benchmarks.run``'s default).
Natural prompts split by their line among the prompts of ``natural.txt``: even lines (0, 2, ...) are
dev, odd lines test, so appending prompts never moves one between splits. Random-token prompts
draw from a generator seeded by (seed, split): the two splits never share a draw. A command that
tunes refuses the test split (:func:`check_split`). A prompt file given by path is the user's own and
is not split. ``split=None`` reads every line (what the commands did before splits existed; kept
for the studies stored then).

Private spans: ``benchmarks/data/natural_spans.json`` marks, per natural prompt (keyed by its line),
the substrings a user would fear to see come back: names, numbers (dates, amounts, account and
ID numbers), e-mail and street addresses, credentials, medical terms. A prompt file given by path
may carry the same marks in ``<file>.spans.json`` next to it. benchmarks.metrics counts a span as
leaked only when it comes back verbatim.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

DATA_DIR = Path(__file__).parent / "data"
NATURAL_FILE = DATA_DIR / "natural.txt"
SPANS_SUFFIX = ".spans.json"
NATURAL_SPANS = DATA_DIR / "natural_spans.json"
PROMPT_SETS = ("mixed", "natural", "random")
#: dev: options are chosen on it; test: only final measurements read it (module docstring)
SPLITS = ("dev", "test")


class SplitRefused(ValueError):
    """A command that chooses options was asked to read the test split."""


def check_split(split: str | None, *, tunes: bool, command: str = "") -> str | None:
    """``split`` if it is a split name (or None: every line); a command that ``tunes`` (chooses options by
    reading true tokens) may not read the test split: :class:`SplitRefused` says where to measure it."""
    if split is not None and split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    if tunes and split != "dev":
        raise SplitRefused(f"{command or 'this command'} chooses options by reading the prompts, so it reads the "
                               f"dev split only; measure the chosen setting on the test split with "
                               f"`python -m benchmarks.run --split test`")
    return split


def split_lines(texts: list[str], split: str | None) -> list[str]:
    """The prompts of ``split`` among ``texts`` (in file order): dev = even lines, test = odd (None: all)."""
    if split is None:
        return list(texts)
    return texts[SPLITS.index(split)::2]


@dataclass(frozen=True)
class Prompt:
    """One evaluation prompt: its token ids, where it came from, and its source text."""

    ids: list[int]
    kind: str  # "natural" or "random"
    text: str = ""
    spans: tuple[str, ...] = ()  # its private spans (module docstring), whole or cut by the truncation


def spans_file(source: str | Path) -> Path:
    """Where the private-span marks of a prompt file live (``natural.txt`` -> ``natural_spans.json``)."""
    source = Path(source)
    return NATURAL_SPANS if source.resolve() == NATURAL_FILE.resolve() else source.with_name(source.name + SPANS_SUFFIX)


def read_spans(source: str | Path) -> dict[str, tuple[str, ...]]:
    """Prompt text -> its private span texts, from :func:`spans_file` (empty when there is none).

    The file maps each prompt's line (as written in the prompt file) to a list of
    ``{"kind": ..., "text": ...}``; every span must occur in its prompt.
    """
    import json

    path = spans_file(source)
    if not path.is_file():
        return {}
    try:
        marks = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as err:
        raise ValueError(f"span file {path} is not valid JSON: {err}") from None
    spans = {}
    for line, items in marks.items():
        text = line.replace("\\n", "\n")
        bad = [item.get("text") for item in items if item.get("text", "") not in text or not item.get("text")]
        if bad:
            raise ValueError(f"span file {path}: {bad} not found in the prompt {line[:60]!r}")
        spans[text] = tuple(item["text"] for item in items)
    return spans


def span_positions(tokenizer, ids: list[int], spans) -> list[int]:
    """The token positions of ``ids`` whose characters overlap an occurrence of a span in the decoded
    text (token t covers the characters between len(decode(ids[:t])) and len(decode(ids[:t+1])))."""
    text = tokenizer.decode(ids)
    ends = [len(tokenizer.decode(ids[: t + 1])) for t in range(len(ids))]
    covered = set()
    for span in spans:
        start = text.find(span)
        while start >= 0:
            stop = start + len(span)
            covered.update(t for t, end in enumerate(ends) if end > start and (ends[t - 1] if t else 0) < stop)
            start = text.find(span, start + 1)
    return sorted(covered)


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
    split: str | None = "dev",
) -> list[Prompt]:
    """``n`` prompts of exactly ``length`` tokens from ``split`` (module docstring): natural ones first,
    then random-token ones.

    Natural prompts are drawn (seeded) from the split's lines of ``source`` among those with at least
    ``length`` tokens; ``round(n * (1 - natural_fraction))`` prompts are random tokens.
    """
    check_split(split, tunes=False)
    if n < 1:
        raise ValueError(f"need at least one prompt, got n={n}")
    if length < 1:
        raise ValueError(f"prompt length must be positive, got {length}")
    if not 0.0 <= natural_fraction <= 1.0:
        raise ValueError(f"natural_fraction must lie in [0, 1], got {natural_fraction}")
    vocab_size = vocab_size or len(tokenizer)
    # one stream per (seed, split); None (every line) keeps the stream of the seed alone, as before splits
    generator = torch.Generator().manual_seed(seed if split is None else 2 * seed + 1 + SPLITS.index(split))
    n_random = round(n * (1.0 - natural_fraction))
    n_natural = n - n_random
    texts = split_lines(read_texts(source), split)
    long_enough = [(t, ids) for t in texts if len(ids := encode(tokenizer, t, length)) == length]
    if n_natural > len(long_enough):
        where = f"the {split} split of {source}" if split else str(source)
        raise ValueError(f"asked for {n_natural} natural prompts of {length} tokens, {where} has {len(long_enough)}")
    order = torch.randperm(len(long_enough), generator=generator)[:n_natural].tolist()
    spans = read_spans(source)
    prompts = [Prompt(ids=long_enough[i][1], kind="natural", text=long_enough[i][0],
                      spans=spans.get(long_enough[i][0], ())) for i in order]
    for _ in range(n_random):
        ids = random_ids(tokenizer, vocab_size, length, generator)
        prompts.append(Prompt(ids=ids, kind="random", text=tokenizer.decode(ids)))
    return prompts


def load_prompts(
    tokenizer, n: int, length: int = 20, seed: int = 0, natural_fraction: float = 0.9, **kwargs
) -> list[list[int]]:
    """Token ids of :func:`prompt_set` (the mixed set by default)."""
    return [p.ids for p in prompt_set(tokenizer, n, length=length, seed=seed, natural_fraction=natural_fraction, **kwargs)]


def named_prompt_set(name_or_path: str, tokenizer, n: int, *, length: int = 20, seed: int = 0,
                     split: str | None = "dev") -> list[Prompt]:
    """A prompt set by name (``mixed`` 90/10, ``natural``, ``random``), its ``split``; or a text file
    (the user's own: not split)."""
    fractions = {"mixed": 0.9, "natural": 1.0, "random": 0.0}
    if name_or_path in fractions:
        return prompt_set(tokenizer, n, length=length, seed=seed, natural_fraction=fractions[name_or_path],
                          split=split)
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(f"unknown prompt set {name_or_path!r}: use one of {list(PROMPT_SETS)} or a file path")
    texts, spans = read_texts(path)[:n], read_spans(path)
    return [Prompt(ids=encode(tokenizer, t, length), kind="file", text=t, spans=spans.get(t, ())) for t in texts]
