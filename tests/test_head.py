"""The softmax head baseline and the prototype-head equivalence with SipIt's NN decision."""

from __future__ import annotations

import torch
import pytest

from attacks.head import PrototypeHead, train_head
from attacks.policies import RandomPolicy
from attacks.sipit import SipIt
from attacks.corpus import corpus_windows
from attacks.proposals import HeadConfig, corpus_examples, training_windows
from benchmarks.metrics import overlap_with
from benchmarks.prompts import load_prompts
from sipit.models import load_model
from sipit.tolerance import acceptance_radius
from sipit.whitebox import WhiteBox


@pytest.fixture(scope="module")
def tiny():
    loaded = load_model("tiny-gpt2")
    return loaded, WhiteBox(loaded.model)


@pytest.mark.parametrize("noise_scale", [0.0, 3.0])
def test_prototype_head_equals_sipit_nearest_neighbour(tiny, noise_scale):
    loaded, wb = tiny
    layer = wb.n_layers
    ids = torch.tensor(load_prompts(loaded.tokenizer, 1, length=6, seed=3)[0])
    clean = wb.states(ids, layer)
    gen = torch.Generator().manual_seed(0)
    observed = clean + noise_scale * clean.pow(2).mean().sqrt() * torch.randn(clean.shape, generator=gen)
    radii = acceptance_radius(observed)
    sipit = SipIt(RandomPolicy(), use_prior=False)
    wrong = 0
    for t in range(ids.numel()):
        head = PrototypeHead.on_prefix(wb, ids[:t], layer)
        prefix = wb.prefix_cache(ids[:t], layer)
        record, _ = sipit.decode_position(wb, prefix, observed[t], float(radii[t]), None, torch.Generator().manual_seed(t))
        assert int(head.predict(observed[t])) == record.token
        # scores = ||h||^2 - ||mu_v - h||^2: the same ranking as the distances, numerically too.
        dist = (head.prototypes - observed[t]).norm(dim=-1)
        assert torch.allclose(head.scores(observed[t]), observed[t].pow(2).sum() - dist.pow(2), rtol=1e-3, atol=1e-2)
        wrong += record.token != int(ids[t])
    if noise_scale == 0:
        assert wrong == 0
    else:
        assert wrong > 0  # the decision is non-trivial: noise moved the NN away from the truth


def test_head_training_accuracy_and_invert(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("SIPIT_CACHE_DIR", str(tmp_path))
    loaded, wb = tiny
    config = HeadConfig(n_text=1024, n_random=0)
    sources = training_windows(loaded.tokenizer, wb.vocab_size, config, slot=2)
    states, ids, held = corpus_examples(wb, -1, sources, 0, config)
    assert states.shape == (1024, wb.d) and held.any() and not held.all()
    assert torch.allclose(states[:64], wb.states(ids[:64], -1), atol=0.05)  # the cached fp16 / bf16 corpus states

    head, report = train_head(states, ids, held, vocab_size=wb.vocab_size, epochs=30, seed=0)
    same, _ = train_head(states, ids, held, vocab_size=wb.vocab_size, epochs=30, seed=0)
    assert torch.equal(head.linear.weight, same.linear.weight)  # seeded
    chance = 1.0 / report.n_classes
    assert report.train_accuracy > 0.9 and report.heldout_accuracy > 10 * chance
    assert report.n_train + report.n_heldout == 1024 and report.n_heldout == int(held.sum())
    weight, bias = head.affine()  # g(h) = W^T h + b on raw states
    h = states[:10]
    assert torch.allclose(h @ weight + bias, head(h), atol=1e-3)

    ids8 = load_prompts(loaded.tokenizer, 1, length=8, seed=1)[0]
    inv = head.invert(wb.states(ids8, -1), wb, -1, loaded.tokenizer)
    assert len(inv.ids) == 8 and inv.candidates_tried == 0 and all(0 <= v < wb.vocab_size for v in inv.ids)
    assert inv.ids == head.predict(wb.states(ids8, -1)).tolist()

    noisy, noisy_report = train_head(
        states, ids, held, vocab_size=wb.vocab_size, epochs=30, seed=0, variant="adaptive",
        augment=lambda x, g: x + 2.0 * torch.randn(x.shape, generator=g))
    assert noisy.name == "softmax-head-adaptive" and noisy_report.heldout_accuracy_exposed is not None
    assert 0.0 <= noisy_report.heldout_accuracy_exposed <= 1.0


def test_sampled_softmax_trains_a_head_over_every_class_it_saw(tiny):
    """With fewer negatives than classes each step scores a sample, yet the head predicts over all classes
    and learns them: on separable synthetic states it is as accurate as the full softmax."""
    _, wb = tiny
    generator = torch.Generator().manual_seed(0)
    centres = 5 * torch.randn(300, 16, generator=generator)
    ids = torch.arange(300).repeat(20)
    states = centres[ids] + 0.1 * torch.randn(ids.numel(), 16, generator=generator)
    held = torch.zeros(ids.numel(), dtype=torch.bool)
    held[-300:] = True
    sampled, report = train_head(states, ids, held, vocab_size=300, epochs=20, negatives=16, seed=0)
    full, full_report = train_head(states, ids, held, vocab_size=300, epochs=20, negatives=4096, seed=0)
    assert report.n_classes == 300 and sampled.linear.weight.shape[0] == 300
    assert report.heldout_accuracy > 0.95 and full_report.heldout_accuracy > 0.95


def test_corpus_is_disjoint_from_eval_prompts(tiny):
    loaded, _ = tiny
    windows = corpus_windows(loaded.tokenizer, 4096)
    prompts = load_prompts(loaded.tokenizer, 20, length=16, natural_fraction=1.0)
    assert overlap_with(windows, prompts) < 0.05
    assert overlap_with(windows, windows[:3]) == 1.0
