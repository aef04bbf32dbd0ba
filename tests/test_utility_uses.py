"""Utility by use (defenses.uses): the embedding store and the linear probe, on tiny models."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks.metrics import overlap_with
from attacks.corpus import corpus_windows
from defenses import make_defense
from defenses.uses import (BLOCK, TEXT_START, TOKEN_CLASSES, embedding_store, labelled_tokens, pooled_vectors, probing,
                           recall_at_k, split_blocks, token_class, upsample_dims)
from defenses.utility import utility_cost
from sipit.models import load_model


@pytest.fixture(scope="module")
def llama():
    return load_model("tiny-llama")


def test_recall_at_k_counts_ties_against_the_query():
    store = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    assert recall_at_k(store, store) == {1: 1.0, 5: 1.0}
    queries = torch.tensor([[1.0, 1.0], [0.0, 1.0], [1.0, 1.0]])  # query 0 lands on document 2
    assert recall_at_k(queries, store, ks=(1, 2, 3)) == pytest.approx({1: 2 / 3, 2: 2 / 3, 3: 1.0})
    parallel = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 0.0]])  # documents 0 and 2 tie: both miss at k=1
    assert recall_at_k(parallel, parallel, ks=(1, 2)) == pytest.approx({1: 1 / 3, 2: 1.0})


def test_pooled_vectors_follow_the_pooling():
    states = torch.randn(10, 8, generator=torch.Generator().manual_seed(0))
    exact = pooled_vectors(None, states, 10, 8)
    assert torch.allclose(exact["mean"], states.mean(0)) and torch.equal(exact["last"], states[-1])
    for k in (1, 3, 4, 10):  # length-weighted window means give back the mean exactly (last window shorter)
        pooling = make_defense("pooling", mode="mean", over="window", k=k)
        vectors = pooled_vectors(pooling, pooling.expose(states), 10, 8)
        assert torch.allclose(vectors["mean"], states.mean(0), atol=1e-6)
        assert torch.allclose(vectors["last"], states[(9 // k) * k:].mean(0), atol=1e-6)
    dims = make_defense("pooling", mode="mean", over="dims", g=4)
    vectors = pooled_vectors(dims, dims.expose(states), 10, 8)
    assert vectors["mean"].shape == (8,) and torch.allclose(vectors["mean"][:4], states.mean(0)[:4].mean().expand(4))
    assert upsample_dims(dims, dims.expose(states), 8).shape == (10, 8)
    assert upsample_dims(make_defense("pooling", mode="mean", over="all"), torch.zeros(1, 1, 8), 8) is None


def test_labels_and_documents_are_deterministic_and_held_out(llama):
    ids, labels = labelled_tokens(llama.tokenizer)
    assert set(labels) == {"token_class", "code_vs_prose"} and all(len(v) == len(ids) for v in labels.values())
    assert set(labels["token_class"].tolist()) == set(range(len(TOKEN_CLASSES)))
    assert 0.2 < labels["code_vs_prose"].float().mean() < 0.8  # both prose and literal blocks occur
    assert [token_class(p) for p in (" \n", " 42", "Python", " the", " (")] == [0, 1, 2, 3, 4]
    docs, probes = split_blocks(ids.numel(), 48, 64, 0)
    assert (docs, probes) == split_blocks(ids.numel(), 48, 64, 0) and not set(docs) & set(probes)
    documents = [ids[b * BLOCK : (b + 1) * BLOCK].tolist() for b in docs + probes]
    head = corpus_windows(llama.tokenizer, 4096)  # a run's softmax-head corpus: the topics before TEXT_START
    assert len(llama.tokenizer.decode([t for w in head for t in w])) < TEXT_START
    assert overlap_with(head, documents) < 0.01  # other topics; only stock phrases of the docs recur
    with pytest.raises(ValueError, match="blocks"):
        split_blocks(ids.numel(), 10**6, 0, 0)


def test_embedding_store_recall_is_one_without_defence_and_falls_under_noise(llama):
    clean = embedding_store(llama, llama, make_defense("none"), 2)
    assert clean["name"] == "embedding_store" and clean["applicable"] and clean["loss"] == 0.0
    assert all(clean["metrics"][f"{kind}_recall_at_{k}"] == 1.0 for kind in ("mean", "last") for k in (1, 5))
    noisy = embedding_store(llama, llama, make_defense("noise", sigma=30.0), 2)
    assert noisy["metrics"]["mean_recall_at_1"] < 0.5 and noisy["metrics"]["last_recall_at_1"] < 0.5
    assert noisy["metrics"]["mean_recall_at_5"] >= noisy["metrics"]["mean_recall_at_1"] and noisy["loss"] > 0.5
    # mean pooling averages the noise over the document's positions: it survives more than the last token
    mild = embedding_store(llama, llama, make_defense("noise", sigma=3.0), 2)["metrics"]
    assert mild["mean_recall_at_1"] > mild["last_recall_at_1"] and mild["mean_cosine"] > mild["last_cosine"]


def test_probe_scores_above_chance_on_clean_states_and_falls_under_noise(llama):
    clean = probing(llama, llama, make_defense("none"), 2)
    m = clean["metrics"]
    assert m["token_class_accuracy_clean"] > m["token_class_majority_rate"] + 0.1  # a margin over chance
    assert m["accuracy_defended"] == m["accuracy_clean"] and clean["loss"] == 0.0
    noisy = probing(llama, llama, make_defense("noise", sigma=3.0), 2)["metrics"]
    assert noisy["token_class_accuracy_defended"] < noisy["token_class_accuracy_clean"] - 0.2
    assert noisy["accuracy_drop"] > 0.1 and noisy["token_class_accuracy_clean"] == m["token_class_accuracy_clean"]


def test_utility_names_every_use_and_mean_pooling_keeps_the_store(llama):
    """A pooled exposure cannot be continued or probed per position, but its mean is the mean-pooled vector."""
    none = utility_cost(llama, make_defense("none"), 2, n_tokens=128).to_dict()
    assert list(none["uses"]) == ["served", "continued", "embedding_store", "probing"]
    assert all(u["name"] == name and u["applicable"] for name, u in none["uses"].items())
    assert none["uses"]["continued"]["metrics"]["ppl"] == none["continued_ppl"]  # the flat fields stay
    pooled = utility_cost(llama, make_defense("pooling", mode="mean", over="all"), 2, n_tokens=128)
    assert pooled.continued_ppl is None and pooled.uses["continued"]["loss"] is None
    store = pooled.uses["embedding_store"]
    assert store["applicable"] and store["loss"] == 0.0 and store["metrics"]["mean_recall_at_1"] == 1.0
    assert store["metrics"]["mean_cosine"] == pytest.approx(1.0, abs=1e-6)
    assert store["metrics"]["last_recall_at_1"] < 1.0  # the whole-sequence pool is not the last token's vector
    assert not pooled.uses["probing"]["applicable"] and pooled.uses["probing"]["loss"] is None
    only = utility_cost(llama, make_defense("none"), 2, n_tokens=128, uses=())
    assert set(only.uses) == {"served", "continued"}
    with pytest.raises(ValueError, match="unknown use"):
        utility_cost(llama, make_defense("none"), 2, n_tokens=128, uses=("vector-db",))


def test_the_search_prices_the_store_and_the_probe(llama):
    """--utility-use embedding_store / probing: the use's loss; a use the setting cannot serve costs +inf."""
    from benchmarks.search.space import AttackBudget, TrialContext, evaluate

    losses = {}
    for use in ("embedding_store", "probing"):
        ctx = TrialContext(llama, 2, [[5, 17, 42, 99]], seed=0, utility_tokens=64, attacks=["sipit"],
                           budget=AttackBudget(k_prior=4, k_grad=4), utility_use=use)
        pooled = evaluate(ctx, ["pooling"], dict(mode="mean", over="all"))
        noise = evaluate(ctx, ["noise"], dict(sigma=30.0, relative_to="rms", placement="exposure"))
        losses[use] = (pooled["utility_loss"], noise["utility_loss"], noise["use_metrics"])
    assert losses["embedding_store"][0] == 0.0 and losses["embedding_store"][1] > 0.5
    assert "mean_recall_at_1" in losses["embedding_store"][2]
    assert math.isinf(losses["probing"][0]) and losses["probing"][1] > 0.1


def test_in_model_defences_query_with_the_served_states(llama):
    """The store is clean; the queries come from the served model (noise inside the network here)."""
    served = make_defense("noise", sigma=3.0, placement="model")
    store = embedding_store(llama, served.serve(llama, 2), served, 2)
    assert store["metrics"]["last_recall_at_1"] < 1.0 and store["metrics"]["last_cosine"] < 0.5
