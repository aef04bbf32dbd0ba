"""Offline English text: a snapshot of CPython 3.11.7's ``pydoc_data.topics``, shipped with the package.

Every offline text of the benchmark comes from here, and its splits are made here:

- :func:`corpus_text`: every topic, sorted by name, joined by blank lines: the learned attacks'
  training text (attacks.corpus: the inverse heads and the softmax head) and the tiny models'
  tokenizer text (:mod:`sipit.tiny_tokenizer`);
- :func:`held_out_text`: every ``HELD_OUT_EVERY``-th topic (index % 5 == 0): the utility text, on
  which a defence's cost to the model and to the uses of its states is measured (defenses.utility,
  defenses.uses);
- :func:`frequency_text`: the other topics: the token frequencies of the rare-token tying defence,
  disjoint from the utility text.

None of them meets the evaluation prompts (benchmarks/data/natural.txt is text written for this
project; random-token prompts share nothing with any text), which are split into a dev and a test
part of their own (benchmarks.prompts).
A snapshot, not the running interpreter's ``pydoc_data``, so the text and every token id built from it
are the same on every Python version.

``sipit/data/pydoc-topics.json.gz``: the topics dict (name -> text) of CPython 3.11.7 as JSON, keys
sorted, gzip-compressed; provenance and licence in ``sipit/data/README.md``. Loading checks the file
against :data:`SNAPSHOT_SHA256` and raises :class:`SnapshotError` when it differs.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from functools import lru_cache
from pathlib import Path

SNAPSHOT = Path(__file__).parent / "data" / "pydoc-topics.json.gz"
SNAPSHOT_SHA256 = "e7efa528c40a8bf6514b1db3ad0fee8ec864708e473deff6c4001a57a65be58f"


class SnapshotError(RuntimeError):
    """The shipped text snapshot is missing, damaged or not what the code expects."""


HELD_OUT_EVERY = 5


@lru_cache(maxsize=1)
def pydoc_topics() -> tuple[tuple[str, str], ...]:
    """Every pydoc topic as ``(name, text)``, sorted by name, from the checked snapshot."""
    try:
        data = SNAPSHOT.read_bytes()
    except OSError as err:
        raise SnapshotError(f"cannot read the offline text snapshot {SNAPSHOT}: {err.strerror}") from err
    digest = hashlib.sha256(data).hexdigest()
    if digest != SNAPSHOT_SHA256:
        raise SnapshotError(f"{SNAPSHOT} is damaged or replaced: sha256 {digest}, expected {SNAPSHOT_SHA256}")
    return tuple(sorted(json.loads(gzip.decompress(data)).items()))


def corpus_text() -> str:
    """Every topic, in sorted order, joined by blank lines (module docstring)."""
    return "\n\n".join(text for _, text in pydoc_topics())


def held_out_text() -> str:
    """The utility text: every ``HELD_OUT_EVERY``-th topic, joined by blank lines."""
    return "\n\n".join(text for i, (_, text) in enumerate(pydoc_topics()) if i % HELD_OUT_EVERY == 0)


def frequency_text() -> str:
    """The tying defence's frequency text: the topics :func:`held_out_text` leaves out, joined by blank lines."""
    return "\n\n".join(text for i, (_, text) in enumerate(pydoc_topics()) if i % HELD_OUT_EVERY != 0)
