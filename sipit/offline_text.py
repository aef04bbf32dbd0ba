"""Offline English text: a snapshot of CPython 3.11.7's ``pydoc_data.topics``, shipped with the package.

Every offline text of the benchmark comes from here through :func:`pydoc_topics`: the tiny models'
tokenizer training text (:mod:`sipit.tiny_tokenizer`), the learned heads' corpus
(:func:`attacks.corpus.corpus_text`) and the utility text (:mod:`defenses.utility`, :mod:`defenses.uses`).
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
