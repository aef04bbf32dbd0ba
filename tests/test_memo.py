"""Caches held by the object that owns the model (sipit.memo): LRU bounds, no sharing between owners."""

from __future__ import annotations

import pytest

import defenses.utility as utility
from defenses.registry import make_defense
from sipit.memo import is_memoised, memoised
from sipit.models import load_model


class Owner:
    def __init__(self):
        self.memo: dict = {}


def test_memoised_builds_once_and_keeps_the_most_recently_used():
    owner, calls = Owner(), []

    def build(key):
        calls.append(key)
        return [key]

    a = memoised(owner, "f", "a", lambda: build("a"), size=2)
    assert memoised(owner, "f", "a", lambda: build("a"), size=2) is a and calls == ["a"]
    memoised(owner, "f", "b", lambda: build("b"), size=2)
    memoised(owner, "f", "a", lambda: build("a"), size=2)  # a is now the most recently used
    memoised(owner, "f", "c", lambda: build("c"), size=2)  # evicts b, the least recently used
    assert list(owner.memo["f"]) == ["a", "c"] and calls == ["a", "b", "c"]
    assert not is_memoised(owner, "f", "b") and not is_memoised(owner, "other", "a")
    for key in range(5):  # no size: every entry is kept
        memoised(owner, "g", key, lambda: key)
    assert len(owner.memo["g"]) == 5
    assert not is_memoised(Owner(), "f", "a")  # another owner shares nothing


def test_utility_clean_losses_are_held_by_the_loaded_model(monkeypatch):
    calls, continuing = [], []
    real, real_continued = utility._nll_and_top1, utility._continued

    def counted(model, ids, window):
        if not continuing:  # the continued-inference pass (hooked model) is another measurement
            calls.append(model)
        return real(model, ids, window)

    def continued(*args, **kwargs):
        continuing.append(True)
        try:
            return real_continued(*args, **kwargs)
        finally:
            continuing.pop()

    monkeypatch.setattr(utility, "_nll_and_top1", counted)
    monkeypatch.setattr(utility, "_continued", continued)
    lm = load_model("tiny-llama")
    first = utility.utility_cost(lm, make_defense("noise", sigma=0.1), 2, n_tokens=128)
    again = utility.utility_cost(lm, make_defense("none"), 2, n_tokens=128)
    assert len(calls) == 1  # the clean losses were computed once; 'none' and exposure noise serve the clean model
    assert again.ppl_clean == first.ppl_clean and len(lm.memo["utility-clean"]) == 1
    other = load_model("tiny-llama")  # the same name, another model: its own memo
    utility.utility_cost(other, make_defense("none"), 2, n_tokens=128)
    assert len(calls) == 2 and calls[1] is other.model
    assert utility.utility_cost(lm, make_defense("none"), 2, n_tokens=256).ppl_clean != pytest.approx(first.ppl_clean)
    assert len(calls) == 3
