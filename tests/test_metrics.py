"""benchmarks.metrics: the rates a run reports, their standard errors and upper bounds."""

from __future__ import annotations

import math

import pytest
import torch

from attacks.result import Inversion
from benchmarks.metrics import (bag_f1, chance_hits, clopper_pearson_lower, clopper_pearson_upper, clustered_accuracy,
                               defence_leakage, excess_bounds, span_leaks, summarise)


def _inv(ids: list[int]) -> Inversion:
    return Inversion(ids=ids, text="", positions=[], seconds=1.0, vocab_size=100)


def test_clopper_pearson_upper_bound_matches_its_closed_forms_and_coverage():
    # k = 0: the bound solves (1 - U)^n = 0.05
    for n in (1, 10, 300):
        assert clopper_pearson_upper(0, n) == pytest.approx(1 - 0.05 ** (1 / n))
    assert clopper_pearson_upper(0, 300) < 0.01 < clopper_pearson_upper(0, 290)  # "about 300 tokens for 1%"
    assert clopper_pearson_upper(7, 7) == 1.0 and math.isnan(clopper_pearson_upper(0, 0))
    # coverage: over many binomial draws the true p lies below the bound at least 95% of the time
    g = torch.Generator().manual_seed(0)
    for p, n in ((0.02, 50), (0.3, 40)):
        draws = torch.binomial(torch.full((2000,), float(n)), torch.full((2000,), p), generator=g).long().tolist()
        covered = sum(p <= clopper_pearson_upper(k, n) for k in draws) / len(draws)
        assert covered >= 0.95


def test_bag_f1_counts_tokens_whatever_their_order():
    assert bag_f1([1, 2, 3], [3, 2, 1]) == 1.0
    assert bag_f1([1, 1, 2], [1, 2, 2]) == pytest.approx(2 / 3)
    assert bag_f1([4, 5], [1, 2]) == 0.0 and bag_f1([], [1]) == 0.0


def test_summary_rates_bounds_and_clustered_se():
    truths = [[1, 2, 3, 4], [5, 6, 7, 8]]
    s = summarise("x", truths, [_inv([1, 2, 3, 4]), _inv([6, 5, 9, 9])])
    assert s.exact_match == 0.5 and s.token_accuracy == pytest.approx(4 / 8)
    assert s.exact_match_upper95 == pytest.approx(clopper_pearson_upper(1, 2))
    assert s.token_accuracy_upper95 == pytest.approx(clopper_pearson_upper(4, 8))
    assert s.bag_f1 == pytest.approx((1.0 + 0.5) / 2)  # the second prompt leaked {5, 6} out of order
    mean, se = clustered_accuracy([[True] * 4, [False] * 4])
    assert mean == 0.5 and se == pytest.approx(0.5)


def test_a_span_leaks_only_when_it_comes_back_verbatim_and_only_if_the_prompt_holds_it():
    spans = ("Alice Smith", "555-0199", "Baker Street")
    truth = "My name is Alice Smith and my phone is 555-0199."  # "Baker Street" was cut off
    assert span_leaks(spans, truth, "My name is Alice Smith and my phone is 555-0198.") == (
        ["Alice Smith", "555-0199"], ["Alice Smith"])
    assert span_leaks(spans, truth, "Alice Smyth, 555-0199") == (["Alice Smith", "555-0199"], ["555-0199"])
    assert span_leaks(spans, truth, "555-0199 ... Alice Smith")[1] == ["Alice Smith", "555-0199"]  # order-free


def test_rates_carry_value_n_se_and_upper_bound_and_the_defence_takes_the_strongest_attacker():
    truths = [[1, 2, 3, 4], [5, 6, 7, 8]]
    exact = summarise("a", truths, [_inv([1, 2, 3, 4]), _inv([5, 6, 7, 8])], [(2, 2), (1, 1)]).to_dict()
    shuffled = summarise("b", truths, [_inv([4, 3, 2, 1]), _inv([8, 7, 6, 5])], [(2, 0), (1, 0)]).to_dict()
    assert exact["rates"]["bag_f1"]["value"] == 1.0 and shuffled["rates"]["bag_f1"]["value"] == 1.0
    rate = shuffled["rates"]["token_accuracy"]
    assert {k: rate[k] for k in ("value", "n", "se", "upper95")} == {"value": 0.0, "n": 8, "se": 0.0,
                                                                     "upper95": pytest.approx(clopper_pearson_upper(0, 8))}
    assert (rate["chance_hits"], rate["chance_comparisons"]) == (0, 8) and rate["excess_upper95"] > 0
    assert shuffled["rates"]["span_recall"]["value"] == 0.0 and shuffled["rates"]["span_recall"]["n"] == 3
    assert exact["rates"]["span_recall"]["value"] == 1.0 and exact["rates"]["exact_match"]["upper95"] == 1.0
    leak = defence_leakage({"a": exact, "b": shuffled})
    assert leak["token_accuracy"]["attack"] == "a" and leak["token_accuracy"]["value"] == 1.0
    assert leak["span_recall"] == {**exact["rates"]["span_recall"], "attack": "a"}
    half = summarise("c", truths, [_inv([1, 2, 0, 0]), _inv([0, 0, 0, 0])]).to_dict()
    assert math.isnan(half["span_recall"]) and half["n_spans"] == 0  # prompts without spans: no rate
    assert "span_recall" not in defence_leakage({"c": half})
    assert half["bag_f1_upper95"] == pytest.approx(clopper_pearson_upper(2, 8))


def test_chance_is_what_an_attacker_scores_on_the_other_prompts_and_leakage_is_measured_above_it():
    """An attacker that writes the same frequent tokens whatever the state hits each prompt as often as it
    hits the others: its accuracy is all chance, and the bound above chance falls to 0 with enough prompts.
    An exact inversion of distinct prompts has (almost) no chance hits and a lower bound near 1."""
    assert chance_hits([[1, 2, 3], [1, 4], [5, 2, 3]], [[1, 2, 3], [1, 4], [5, 2, 3]]) == (6, 14)
    g = torch.Generator().manual_seed(0)
    truths = [torch.randint(0, 4, (int(n),), generator=g).tolist() for n in torch.randint(1, 7, (12,), generator=g)]
    guesses = [torch.randint(0, 4, (int(n),), generator=g).tolist() for n in torch.randint(1, 7, (12,), generator=g)]
    pairs = [(r, x) for i, r in enumerate(guesses) for j, x in enumerate(truths) if i != j]  # the definition
    assert chance_hits(truths, guesses) == (sum(a == b for r, x in pairs for a, b in zip(r, x)),
                                            sum(min(len(r), len(x)) for r, x in pairs))
    truths = [[7, 8 + i % 3, 100 + i, 200 + i] for i in range(60)]  # all start with 7; 3 tokens take turns second
    constant = summarise("c", truths, [_inv([7, 8, 0, 0]) for _ in truths])
    assert constant.token_accuracy == pytest.approx((60 + 20) / 240)
    assert constant.token_accuracy_chance == pytest.approx(constant.chance_hits / constant.chance_comparisons)
    assert constant.token_accuracy_chance == pytest.approx(constant.token_accuracy, abs=0.002)
    assert constant.token_accuracy_upper95 > 0.38 and constant.token_accuracy_excess_upper95 < 0.13
    exact = summarise("e", truths, [_inv(list(t)) for t in truths])
    lower, upper = excess_bounds(240, 240, exact.chance_hits, exact.chance_comparisons)
    assert exact.token_accuracy_chance < 0.42 and lower > 0.5
    assert upper == pytest.approx(1.0 - clopper_pearson_lower(exact.chance_hits, exact.chance_comparisons, 0.975))
    # the two bounds hold together: each side at 97.5%, so the excess bound is wider than the plain one's gap
    assert excess_bounds(3, 100, 300, 10_000)[1] > clopper_pearson_upper(3, 100) - 0.03
    assert excess_bounds(3, 100, 0, 0) == (0.0, pytest.approx(clopper_pearson_upper(3, 100, 0.975)))
