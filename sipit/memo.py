"""Memoisation held by the object that owns the model (no module-level caches).

A result derived from one model alone (a vocabulary table, a surrogate fit, a design matrix) is
kept in the ``memo`` dict of the object that owns that model -- :class:`sipit.whitebox.WhiteBox`
(``WhiteBox.memo``) or :class:`sipit.models.LoadedModel` (``LoadedModel.memo``) -- so it lives
exactly as long as its owner and can never be served to another model. Each kind of result has
its own family, ``owner.memo[family]`` (an ``OrderedDict`` of key -> value); a family with a
``size`` is a bounded LRU.

Families in use: on the WhiteBox ``"vocabulary-states"`` (sipit.vocab_table),
``"surrogate-design"`` and ``"surrogate-fits"`` (attacks.surrogate); on the LoadedModel
``"utility-clean"`` (defenses.utility), ``"uses-text"``, ``"uses-store"`` and ``"uses-probes"``
(defenses.uses).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, TypeVar

T = TypeVar("T")


def memoised(owner, family: str, key, build: Callable[[], T], *, size: int | None = None) -> T:
    """``build()`` memoised in ``owner.memo[family][key]``.

    With ``size``, the family keeps the ``size`` most recently used entries (least recently used
    evicted first); without, it keeps every entry.
    """
    store = owner.memo.setdefault(family, OrderedDict())
    if key in store:
        store.move_to_end(key)
        return store[key]
    value = store[key] = build()
    while size is not None and len(store) > size:
        store.popitem(last=False)
    return value


def is_memoised(owner, family: str, key) -> bool:
    """Whether ``owner.memo[family]`` holds ``key`` (does not count as a use)."""
    return key in owner.memo.get(family, {})
