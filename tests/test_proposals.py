"""Learned proposals: the position-0 table, the inverse head, their caches, and exactness."""

import pytest
import torch

from attacks.policies import GradientPolicy, LearnedPolicy
from attacks.proposals import HeadConfig, inverse_head, true_ranks
from attacks.sipit import SipIt
from benchmarks.prompts import prompt_set
from sipit.models import load_model
from sipit.cache import model_key
from sipit.vocab_table import position_zero_table, table_path
from sipit.whitebox import WhiteBox

SMALL = HeadConfig(n_text=4096, n_random=2048, n_pairs=4096, min_steps=300)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SIPIT_CACHE_DIR", str(tmp_path))


def fresh(name: str) -> tuple:
    loaded = load_model(name)
    return loaded, WhiteBox(loaded.model)


def test_position_zero_table_equals_the_models_own_states(tiny, one_thread):
    _, wb = tiny
    for layer in (1, wb.n_layers):
        table = position_zero_table(wb, layer, use_disk=False).states
        assert table.shape == (wb.vocab_size, wb.d)
        for v in (0, 7, 300, wb.vocab_size - 1):
            torch.testing.assert_close(table[v], wb.states([v], layer)[0], rtol=1e-5, atol=1e-5)



def test_scores_ahead_equal_each_positions_own_and_read_each_head_once(tiny_llama, one_thread, monkeypatch):
    """observe() lets the heads score every observed row in one product per head; each row's
    log q equals the row scored alone, and a target that is not the observed row is scored alone."""
    loaded, wb = tiny_llama
    policy = LearnedPolicy(SMALL)
    policy.prepare(wb, 2, loaded.tokenizer)
    observed = wb.states(prompt_set(loaded.tokenizer, 1, length=10, seed=2)[0].ids, 2)
    alone = {t: policy.head_at(t).log_probs(observed[t]) for t in range(1, 10)}
    calls = []
    for head, _ in policy.heads.values():
        monkeypatch.setattr(head, "log_probs", lambda h, f=head.log_probs: calls.append(h.shape) or f(h))
    policy.observe(observed)
    moved = observed[3] + 0.5
    torch.testing.assert_close(policy.head_log_probs(3, moved), policy.head_at(3).log_probs(moved))
    assert not torch.allclose(policy.head_log_probs(3, moved), alone[3])
    calls.clear()
    for t in range(1, 10):
        torch.testing.assert_close(policy.head_log_probs(t, observed[t]), alone[t], rtol=1e-5, atol=1e-5)
    assert calls == [(1, wb.d), (8, wb.d)]  # position 1's head once, the later positions' head once
    table = policy.table
    direct = -(table.states - observed[0]).pow(2).sum(1)
    fast = table.neg_sq_distances(observed[0])
    torch.testing.assert_close(fast, direct, rtol=1e-4, atol=1e-4 * float(table.states.pow(2).sum(1).max()))
    assert int(fast.argmax()) == int(direct.argmax())


@pytest.mark.parametrize("tying", [{"rare": 200}, {"groups": 64}])
def test_a_tied_copy_steps_only_the_rows_its_original_lacks(tying, one_thread, monkeypatch):
    """F_v depends on v only through e_v: a copy tied to its original's rows steps nothing, one tied
    to k-means centroids steps one token per group, and either table equals the copy's own states."""
    import sipit.vocab_table as vocab_table
    from defenses import make_defense

    loaded, wb = fresh("tiny-llama")
    original = position_zero_table(wb, 2, use_disk=False).states
    defense = make_defense("tying", **tying)
    copy = WhiteBox(defense.serve(loaded, 2).model, proposals_from=wb)
    stepped: list[int] = []
    sweep = vocab_table.sweep_states

    def counted(*args, ids=None, **kwargs):
        stepped.append(wb.vocab_size if ids is None else len(ids))
        return sweep(*args, ids=ids, **kwargs)

    monkeypatch.setattr(vocab_table, "sweep_states", counted)
    table = position_zero_table(copy, 2, use_disk=False).states
    groups = defense.groups()
    if "rare" in tying:
        assert stepped == []  # every row is one of the original's: read from its table
        torch.testing.assert_close(table, original[groups], rtol=0, atol=0)
    else:
        assert stepped == [int(groups.unique().numel())] and stepped[0] <= 64
    tied = [v for v in range(wb.vocab_size) if int(groups[v]) != v][:3] + [0, wb.vocab_size - 1]
    for v in tied:
        torch.testing.assert_close(table[v], copy.states([v], 2)[0], rtol=1e-5, atol=1e-5)
    quantised = WhiteBox(make_defense("quant", weights="nf4").serve(loaded, 2).model, proposals_from=wb)
    stepped.clear()
    position_zero_table(quantised, 2, use_disk=False)
    assert stepped == [wb.vocab_size]  # other block weights: nothing borrowed, every row stepped

def test_learned_proposals_never_change_the_recovered_ids(tiny, one_thread):
    loaded, wb = tiny
    prompts = prompt_set(loaded.tokenizer, 3, length=10, seed=3)
    learned = SipIt(LearnedPolicy(SMALL))
    gradient = SipIt(GradientPolicy())
    for layer in (1, wb.n_layers):
        for prompt in prompts:
            observed = wb.states(prompt.ids, layer)
            fast = learned.invert(observed, wb, layer, loaded.tokenizer)
            slow = gradient.invert(observed, wb, layer, loaded.tokenizer)
            assert fast.ids == slow.ids == prompt.ids
            assert fast.all_verified
            assert fast.candidates_tried <= slow.candidates_tried


def test_a_useless_head_costs_candidates_not_correctness(tiny_llama, one_thread):
    loaded, wb = tiny_llama
    policy = LearnedPolicy(SMALL, trust=64)
    policy.prepare(wb, 2, loaded.tokenizer)
    good = SipIt(policy)
    prompt = prompt_set(loaded.tokenizer, 1, length=10, seed=5)[0]
    observed = wb.states(prompt.ids, 2)
    baseline = good.invert(observed, wb, 2, loaded.tokenizer)
    # Scramble the heads in place (prepare() returns the memoised objects): proposals become noise.
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for head, _ in policy.heads.values():
            for weight in head.parameters():
                weight.copy_(torch.randn(weight.shape, generator=generator))
    scrambled = good.invert(observed, wb, 2, loaded.tokenizer)
    assert scrambled.ids == baseline.ids == prompt.ids
    assert scrambled.all_verified
    assert scrambled.candidates_tried > baseline.candidates_tried
    # Every position confident: the scrambled head's lone guess misses, and the full order takes over.
    policy.confident = 1e-9
    overconfident = good.invert(observed, wb, 2, loaded.tokenizer)
    assert overconfident.ids == prompt.ids
    assert overconfident.all_verified
    assert any(p.candidates_tried > 1 for p in overconfident.positions[1:])


@pytest.mark.parametrize("slot", [1, 2])
def test_inverse_head_ranks_far_better_than_chance(tiny, one_thread, slot):
    loaded, wb = tiny
    head, report = inverse_head(wb, loaded.tokenizer, wb.n_layers, SMALL, slot=slot)
    assert report.n_heldout > 0 and not report.cached and report.slot == slot
    # Random-token prompts the head never saw: chance would put the truth at median rank V/2.
    prompts = prompt_set(loaded.tokenizer, 8, length=30, seed=11, natural_fraction=0.0)
    states = torch.stack([wb.states(p.ids, wb.n_layers)[slot] for p in prompts]) if slot == 1 else \
        wb.states(prompts[0].ids, wb.n_layers)[2:]
    truth = torch.tensor([p.ids[1] for p in prompts] if slot == 1 else prompts[0].ids[2:])
    ranks = true_ranks(head.cosines(states), truth)
    assert float(ranks.float().median()) < wb.vocab_size / 20
    assert report.top16 > 0.5


def test_caches_are_keyed_by_weights_and_layer(tmp_path):
    loaded, wb = fresh("tiny-llama")
    other_loaded, other = fresh("tiny-gpt2")
    assert model_key(wb) != model_key(other)
    assert table_path(wb, 1) != table_path(wb, 2)
    first = position_zero_table(wb, 1)
    assert not first.cached and table_path(wb, 1).is_file()
    # Same weights in a new WhiteBox: the disk copy is reused and equal.
    again = position_zero_table(WhiteBox(loaded.model), 1)
    assert again.cached
    torch.testing.assert_close(again.states, first.states)
    # Changed weights: a new key, nothing reused.
    with torch.no_grad():
        loaded.model.get_input_embeddings().weight[5] += 1.0
    changed = WhiteBox(loaded.model)
    assert model_key(changed) != model_key(wb)
    assert not position_zero_table(changed, 1).cached
    head_a = inverse_head(changed, loaded.tokenizer, 1, SMALL)[1]
    head_b = inverse_head(changed, loaded.tokenizer, 2, SMALL)[1]
    assert not head_a.cached and not head_b.cached
    assert inverse_head(WhiteBox(loaded.model), loaded.tokenizer, 1, SMALL)[1].cached
    assert not inverse_head(WhiteBox(loaded.model), loaded.tokenizer, 1, SMALL, slot=1)[1].cached


@pytest.mark.parametrize("damage", ["garbage", "truncated", "wrong-shape"])
def test_a_damaged_cache_file_is_rebuilt(damage):
    loaded, wb = fresh("tiny-gpt2")
    built = position_zero_table(wb, 2)
    path = table_path(wb, 2)
    if damage == "garbage":
        path.write_bytes(b"not a tensor at all")
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[:1000])
    else:
        torch.save(torch.zeros(3, wb.d), path)
    rebuilt = position_zero_table(WhiteBox(loaded.model), 2)
    assert not rebuilt.cached
    torch.testing.assert_close(rebuilt.states, built.states)
    assert position_zero_table(WhiteBox(loaded.model), 2).cached  # the rebuilt file is good again


def test_a_damaged_head_file_is_retrained(tmp_path):
    loaded, wb = fresh("tiny-gpt2")
    inverse_head(wb, loaded.tokenizer, 2, SMALL)
    (head_file,) = (tmp_path / "heads").glob("*.pt")
    head_file.write_bytes(head_file.read_bytes()[:500])
    _, report = inverse_head(WhiteBox(loaded.model), loaded.tokenizer, 2, SMALL)
    assert not report.cached
    _, report = inverse_head(WhiteBox(loaded.model), loaded.tokenizer, 2, SMALL)
    assert report.cached


def test_learned_policy_needs_the_tokenizer(tiny_llama):
    _, wb = tiny_llama
    observed = wb.states([5, 6, 7], 1)
    with pytest.raises(ValueError, match="tokenizer"):
        SipIt(LearnedPolicy(SMALL)).invert(observed, wb, 1)


def test_inverse_head_attack_classifies_without_running_the_model():
    """The heads as the classification baseline: no candidate is stepped, position 0 comes from the
    table, and on clean states it beats chance by far (and is never better than exact SipIt)."""
    from attacks.head import InverseHeadAttack
    from attacks.sipit import SipIt
    from benchmarks.prompts import prompt_set

    loaded, wb = fresh("tiny-llama")
    attack = InverseHeadAttack(SMALL)
    right = total = 0
    for p in prompt_set(loaded.tokenizer, 3, length=8, seed=5):
        observed = wb.states(p.ids, 2)
        inv = attack.invert(observed, wb, 2, loaded.tokenizer, length=len(p.ids))
        assert all(r.candidates_tried == 0 for r in inv.positions) and inv.setup
        assert inv.ids[0] == p.ids[0]  # position 0 by lookup in the exact table
        right += sum(a == b for a, b in zip(inv.ids, p.ids))
        total += len(p.ids)
        assert SipIt().invert(observed, wb, 2, loaded.tokenizer).ids == p.ids
    assert right / total > 0.5  # chance is 1/512
    with pytest.raises(ValueError, match="positions"):
        attack.invert(observed, wb, 2, loaded.tokenizer, length=len(p.ids) + 1)


def test_a_noise_adapted_head_ranks_noisy_states_better_and_reuses_the_corpus_states(tiny_llama, one_thread, tmp_path):
    loaded, wb = tiny_llama
    prompts = prompt_set(loaded.tokenizer, 8, length=16, seed=3)
    states = [wb.states(p.ids, -1)[2:] for p in prompts]
    sigma = 2.5 * float(torch.cat(states).pow(2).mean().sqrt())  # 2.5 x the state RMS
    clean, _ = inverse_head(wb, loaded.tokenizer, -1, SMALL)
    corpus_files = sorted((tmp_path / "head-corpus").iterdir())
    assert corpus_files  # the corpus states were stored once
    noisy, report = inverse_head(wb, loaded.tokenizer, -1, HeadConfig(**{**SMALL.__dict__, "noise": sigma}))
    assert sorted((tmp_path / "head-corpus").iterdir()) == corpus_files  # reused, not recomputed
    assert len(list((tmp_path / "heads").glob("inverse-*.pt"))) == 2  # keyed by the noise level
    truth = torch.tensor([t for p in prompts for t in p.ids[2:]])
    observed = torch.cat(states) + sigma * torch.randn(truth.shape[0], wb.d, generator=torch.Generator().manual_seed(1))
    rank_clean = true_ranks(clean.cosines(observed.float()), truth).float().median()
    rank_noisy = true_ranks(noisy.cosines(observed.float()), truth).float().median()
    assert rank_noisy < rank_clean


def test_the_learned_shortlist_of_the_beam_holds_the_truth_and_bounds_the_work(tiny_llama, one_thread):
    from attacks.robust import MapBeamSearch

    loaded, wb = tiny_llama
    beam = MapBeamSearch(0.0, width=2, ranking="learned", k_prior=4, k_proxy=16, extra_rounds=1, head_config=SMALL)
    for p in prompt_set(loaded.tokenizer, 3, length=10, seed=4):
        got = beam.invert(wb.states(p.ids, -1), wb, -1, loaded.tokenizer)
        assert got.ids == p.ids  # noise-free: the heads + prior shortlist holds every true token
        assert all(len(c) <= 4 + 16 + 32 for c in beam.last_candidates[1:])  # position 0: the whole table
        assert len(beam.last_candidates[0]) == wb.vocab_size


def test_a_served_copy_ranks_with_its_originals_heads_and_still_recovers_exactly(tmp_path, one_thread):
    from defenses import make_defense

    loaded, wb = fresh("tiny-llama")
    copy = WhiteBox(make_defense("quant", weights="nf4").serve(loaded, 2).model, proposals_from=wb)
    own = LearnedPolicy(SMALL)
    own.prepare(wb, 2, loaded.tokenizer)
    borrowed = LearnedPolicy(SMALL)
    lines = borrowed.prepare(copy, 2, loaded.tokenizer)
    assert any("full-precision original" in line for line in lines)
    assert all(borrowed.heads[s][0] is own.heads[s][0] for s in own.heads)  # the original's, memoised
    heads = sorted(p.name for p in (tmp_path / "heads").iterdir())
    assert heads and all(model_key(wb) in name for name in heads)  # no head trained for the copy
    assert model_key(copy) in table_path(copy, 2).name and table_path(copy, 2).is_file()  # its own table
    prompt = prompt_set(loaded.tokenizer, 1, length=10, seed=9)[0]
    inv = SipIt(borrowed).invert(copy.states(prompt.ids, 2), copy, 2, loaded.tokenizer)
    assert inv.ids == prompt.ids and inv.all_verified


def test_noise_levels_share_heads_on_a_grid_that_holds_round_sigmas():
    """head_noise: nearest grid point in log sigma, so nearby per-prompt sigmas share one head; the round
    sigmas of sweeps keep their own level; a decoder's learned shortlist asks for the grid level."""
    import math

    from attacks.proposals import NOISE_GRID, head_noise
    from attacks.robust import CandidateScorer

    for sigma in (0.001, 0.05, 0.1, 3.0, 10.0, 30.0, 100.0, 1.5e3):
        assert head_noise(sigma) == sigma
    assert head_noise(0.0) == 0.0 and head_noise(-1.0) == 0.0
    sigmas = [10 ** (e / 50) for e in range(-150, 151)]
    levels = [head_noise(s) for s in sigmas]
    assert levels == sorted(levels)  # monotone
    assert len(set(levels)) == 6 * 6 + 1  # six levels per decade over six decades, plus the last end point
    worst = max(abs(math.log(g / s)) for g, s in zip(levels, sigmas))
    assert worst <= 0.5 * math.log(5 / 3) + 1e-9  # never further than the widest gap's midpoint
    assert {round(g / 10 ** math.floor(math.log10(g) + 1e-9), 6) for g in levels} == set(NOISE_GRID)
    quick = HeadConfig(n_text=512, n_random=256, n_pairs=512, min_steps=20, epochs=1)
    loaded = load_model("tiny-llama")
    first, second = CandidateScorer(ranking="learned", head_config=quick), CandidateScorer(ranking="learned",
                                                                                          head_config=quick)
    first.prepare(WhiteBox(loaded.model), -1, loaded.tokenizer, sigma=0.0123)
    assert first._learned.head_config.noise == 0.015
    second.prepare(WhiteBox(loaded.model), -1, loaded.tokenizer, sigma=0.0139)  # another prompt's sigma
    assert all(report.cached for _, report in second._learned.heads.values())  # the same heads, from disk


def test_the_union_shortlist_verifies_what_the_learned_one_does_and_the_surrogates_picks(tiny_llama, one_thread):
    """ranking="learned+surrogate": every candidate of the learned shortlist, plus the surrogate's fit sample
    and picks (the learned shortlist alone misses the true token at a third of the positions at smollm2's
    layer 15, sigma 19.3); noise-free the beam on it still recovers exactly."""
    from attacks.robust import CandidateScorer, MapBeamSearch
    from sipit.prior import NextTokenPrior

    loaded, wb = tiny_llama
    (p,) = prompt_set(loaded.tokenizer, 1, length=8, seed=5)
    h = wb.states(p.ids, -1)
    sigma = float(h.pow(2).mean().sqrt())  # 1 x the state RMS
    t = 4
    observed = h[t] + sigma * torch.randn(wb.d, generator=torch.Generator().manual_seed(2))
    prior = NextTokenPrior(wb.model)
    for token in p.ids[:t]:
        prior.push(token)
    shortlists, samples = {}, {}
    for ranking in ("learned", "surrogate", "learned+surrogate"):
        scorer = CandidateScorer(ranking=ranking, k_prior=4, k_proxy=16, n_fit=64, n_rerank=128, extra_rounds=1,
                                 head_config=SMALL)
        scorer.prepare(wb, -1, loaded.tokenizer, sigma=sigma)
        got = scorer.score(wb, wb.prefix_cache(p.ids[:t], -1), observed, prior.logprobs, sigma)
        shortlists[ranking] = set(got.candidates.tolist())
        samples[ranking] = set() if scorer._last_fit is None else set(scorer._last_fit.sample.tolist())
    union = shortlists["learned+surrogate"]
    assert shortlists["learned"] <= union and samples["learned+surrogate"] == samples["surrogate"] <= union
    assert len(union) > len(shortlists["learned"]) and not samples["learned"]
    beam = MapBeamSearch(0.0, width=2, ranking="learned+surrogate", k_prior=4, k_proxy=16, n_fit=64, extra_rounds=1,
                         head_config=SMALL)
    assert beam.invert(h, wb, -1, loaded.tokenizer).ids == p.ids


def test_k_wide_gives_the_widening_hypothesis_both_orders_top_k_and_the_others_nothing_more(tiny_llama, one_thread):
    """CandidateScorer(k_wide=K): the hypothesis that widens (sigma given) verifies the top K of head + prior and
    of the head alone, which a wrong token inside the noise radius would otherwise cut short; a beam sibling
    (no sigma) keeps the base shortlist."""
    from attacks.robust import CandidateScorer
    from sipit.prior import NextTokenPrior

    loaded, wb = tiny_llama
    (p,) = prompt_set(loaded.tokenizer, 1, length=8, seed=5)
    h = wb.states(p.ids, -1)
    sigma, t, k = float(h.pow(2).mean().sqrt()), 4, 48
    observed = h[t] + sigma * torch.randn(wb.d, generator=torch.Generator().manual_seed(2))
    prior = NextTokenPrior(wb.model)
    for token in p.ids[:t]:
        prior.push(token)
    prefix = wb.prefix_cache(p.ids[:t], -1)
    got = {}
    for k_wide in (0, k):
        scorer = CandidateScorer(ranking="learned", k_prior=4, k_proxy=8, extra_rounds=0, k_wide=k_wide,
                                 head_config=SMALL)
        scorer.prepare(wb, -1, loaded.tokenizer, sigma=sigma)
        for widen in (True, False):
            scored = scorer.score(wb, prefix, observed, prior.logprobs, sigma if widen else None)
            assert len(set(scored.candidates.tolist())) == scored.candidates.numel()  # each token stepped once
            got[k_wide, widen] = set(scored.candidates.tolist())
    head = scorer._learned.head_log_probs(t, observed)
    both = set(torch.topk(head, k).indices.tolist()) | set(torch.topk(head + prior.logprobs.cpu(), k).indices.tolist())
    assert both <= got[k, True] and len(got[k, True]) <= 4 + 8 + len(both)
    assert got[k, False] == got[0, True] == got[0, False]  # siblings and k_wide=0: the base shortlist only
    with pytest.raises(ValueError, match="k_wide"):
        CandidateScorer(ranking="learned", k_wide=-1)


def test_the_corpus_runs_in_bf16_only_where_asked_or_native_and_each_precision_has_its_own_cache(tiny_llama,
                                                                                                  one_thread, tmp_path):
    """HeadConfig.corpus_precision: "fp32" and "bf16" as asked, "auto" by native_bf16(); bf16 states stay close
    to fp32's (they only train a ranking head); the corpus cache never serves one precision's states for the other."""
    from attacks.proposals import corpus_precision, corpus_states, native_bf16

    loaded, wb = tiny_llama
    assert corpus_precision(wb, HeadConfig(corpus_precision="fp32")) == "fp32"
    assert corpus_precision(wb, HeadConfig(corpus_precision="bf16")) == "bf16"
    assert corpus_precision(wb, HeadConfig()) == ("bf16" if native_bf16(wb.device) else "fp32")
    with pytest.raises(ValueError, match="corpus_precision"):
        corpus_precision(wb, HeadConfig(corpus_precision="fp8"))
    windows = [p.ids for p in prompt_set(loaded.tokenizer, 4, length=16, seed=6)]
    full = corpus_states(wb, windows, -1, 4, precision="fp32")
    half = corpus_states(wb, windows, -1, 4, precision="bf16")
    torch.testing.assert_close(full, torch.cat([wb.states(w, -1) for w in windows]).half().float())
    assert not torch.equal(full, half)  # computed in bf16, not read from the fp32 cache
    relative = (half - full).norm(dim=1) / full.norm(dim=1)
    assert float(relative.median()) < 0.05
    assert len(list((tmp_path / "head-corpus").iterdir())) == 2
    assert torch.equal(corpus_states(wb, windows, -1, 4, precision="bf16"), half)  # from its own cache
