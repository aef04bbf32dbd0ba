"""The softmax head baseline and the prototype-head equivalence with SipIt's NN decision."""

from __future__ import annotations

import torch
import pytest

from attacks.head import PrototypeHead, train_head
from attacks.policies import RandomPolicy
from attacks.sipit import SipIt
from benchmarks.corpus import corpus_states, corpus_windows, overlap_with
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


def test_head_training_accuracy_cache_and_invert(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("SIPIT_CACHE_DIR", str(tmp_path))
    loaded, wb = tiny
    first = corpus_states(loaded, wb, -1, n_tokens=1024, window=64)
    again = corpus_states(loaded, wb, -1, n_tokens=1024, window=64)
    assert not first.cached and again.cached and torch.equal(first.states, again.states)
    assert list((tmp_path / "head-states").glob("*.pt"))
    assert first.states.shape == (1024, wb.d)
    assert torch.allclose(first.states[:64], wb.states(first.ids[:64], -1), atol=1e-5)

    head, report = train_head(first.states, first.ids, vocab_size=wb.vocab_size, windows=first.windows,
                              epochs=30, seed=0)
    same, _ = train_head(first.states, first.ids, vocab_size=wb.vocab_size, windows=first.windows, epochs=30, seed=0)
    assert torch.equal(head.linear.weight, same.linear.weight)  # seeded
    chance = 1.0 / report.n_classes
    assert report.train_accuracy > 0.9 and report.heldout_accuracy > 10 * chance
    assert report.n_train + report.n_heldout == 1024
    weight, bias = head.affine()  # g(h) = W^T h + b on raw states
    h = first.states[:10]
    assert torch.allclose(h @ weight + bias, head(h), atol=1e-3)

    ids = load_prompts(loaded.tokenizer, 1, length=8, seed=1)[0]
    inv = head.invert(wb.states(ids, -1), wb, -1, loaded.tokenizer)
    assert len(inv.ids) == 8 and inv.candidates_tried == 0 and all(0 <= v < wb.vocab_size for v in inv.ids)
    assert inv.ids == head.predict(wb.states(ids, -1)).tolist()

    noisy, noisy_report = train_head(
        first.states, first.ids, vocab_size=wb.vocab_size, windows=first.windows, epochs=30, seed=0, variant="adaptive",
        augment=lambda x, g: x + 2.0 * torch.randn(x.shape, generator=g))
    assert noisy.name == "softmax-head-adaptive" and noisy_report.heldout_accuracy_exposed is not None
    assert 0.0 <= noisy_report.heldout_accuracy_exposed <= 1.0


def test_corpus_is_disjoint_from_eval_prompts(tiny):
    loaded, _ = tiny
    windows = corpus_windows(loaded.tokenizer, 4096)
    prompts = load_prompts(loaded.tokenizer, 20, length=16, natural_fraction=1.0)
    assert overlap_with(windows, prompts) < 0.05
    assert overlap_with(windows, windows[:3]) == 1.0
