"""Defences on the tiny models: each one's effect, validation, chains, utility, pooled attack."""

from __future__ import annotations

import bitsandbytes as bnb
import pytest
import torch
from torch import nn

from attacks.policies import GradientPolicy
from attacks.sipit import SipIt
from defenses import Chain, PooledExposureError, make_chain, make_defense, require_per_position
from defenses.base import find_member
from attacks.pooled import PooledBeamAttack, partial_score
from defenses.utility import held_out_ids, utility_cost
from sipit.models import load_model
from sipit.whitebox import SipitInputError, WhiteBox


@pytest.fixture(scope="module")
def llama():
    return load_model("tiny-llama")


@pytest.fixture(scope="module")
def gpt2():
    return load_model("tiny-gpt2")


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------ noise
def test_exposure_noise_matches_sigma_abs_and_rms(llama):
    states = WhiteBox(llama.model).states(_ids(64), 2)
    d = make_defense("noise", sigma=0.5, relative_to="abs", seed=3)
    noise = d.expose(states) - states
    assert abs(noise.std().item() - 0.5) < 0.02 and abs(noise.mean().item()) < 0.02
    rel = make_defense("noise", sigma=0.1, relative_to="rms")
    sigma = rel.noise_sigma(states)
    assert sigma == pytest.approx(0.1 * states.pow(2).mean().sqrt().item(), rel=1e-5)
    assert (rel.expose(states) - states).std().item() == pytest.approx(sigma, rel=0.05)
    half = make_defense("noise", sigma=1.0, relative_to="delta", delta=0.4)
    assert half.noise_sigma(states) == pytest.approx(0.2)


def test_noise_seeded_and_secure(llama):
    states = WhiteBox(llama.model).states(_ids(8), 1)
    a = make_defense("noise", sigma=0.1, seed=7).expose(states)
    b = make_defense("noise", sigma=0.1, seed=7).expose(states)
    assert torch.equal(a, b)
    secure = make_defense("noise", sigma=0.1, seed=7, secure=True)
    assert not torch.equal(secure.expose(states), secure.expose(states))
    assert not torch.equal(secure.expose(states), a)


@pytest.mark.parametrize("layer", [0, 2])
def test_in_model_noise_reaches_later_layers(llama, layer):
    ids = _ids(16)
    d = make_defense("noise", sigma=0.2, relative_to="abs", placement="model")
    served = d.serve(llama, layer)
    assert served.model is not llama.model
    clean_wb, served_wb = WhiteBox(llama.model), WhiteBox(served.model)
    diff = served_wb.states(ids, layer) - clean_wb.states(ids, layer)
    assert diff.std().item() == pytest.approx(0.2, rel=0.1)
    assert not torch.allclose(served_wb.states(ids, 4), clean_wb.states(ids, 4))
    assert torch.equal(d.expose(diff), diff)  # exposure adds nothing more
    # the clean model is untouched
    assert torch.equal(clean_wb.states(ids, layer), WhiteBox(llama.model).states(ids, layer))


# ------------------------------------------------------------------------------------ params
@pytest.mark.parametrize(
    "name, params, match",
    [
        ("noise", {"sigma": -1}, "sigma"),
        ("noise", {"sigma": float("nan")}, "sigma"),
        ("noise", {"relative_to": "delta"}, "delta"),
        ("noise", {"placement": "head"}, "placement"),
        ("quant", {"weights": "int4"}, "weights"),
        ("quant", {"weights": "none"}, "nothing"),
        ("quant", {"blocksize": 100}, "blocksize"),
        ("tying", {}, "exactly one"),
        ("tying", {"groups": 0}, "groups"),
        ("pooling", {"over": "window"}, "needs k"),
        ("pooling", {"mode": "median"}, "mode"),
        ("pooling", {"k": 2}, "only used"),
        ("noise", {"bogus": 1}, "no parameter"),
    ],
)
def test_bad_params_raise_clear_errors(name, params, match):
    with pytest.raises(ValueError, match=match):
        make_defense(name, **params)


def test_unknown_defence_lists_choices():
    with pytest.raises(ValueError, match="noise.*pooling|pooling.*noise"):
        make_defense("dropout")
    with pytest.raises(ValueError, match="groups"):
        make_chain("quant,noise", groups=3)


# ------------------------------------------------------------------------------------ quant
@pytest.mark.parametrize("kind, module, dtype, bound", [
    ("int8", bnb.nn.Linear8bitLt, torch.int8, 0.05),
    ("nf4", bnb.nn.Linear4bit, torch.uint8, 0.4),
    ("fp4", bnb.nn.Linear4bit, torch.uint8, 0.5),
])
@pytest.mark.parametrize("model_name", ["tiny-llama", "tiny-gpt2"])
def test_quantised_weights_are_bnb_modules(model_name, kind, module, dtype, bound, llama, gpt2):
    loaded = llama if model_name == "tiny-llama" else gpt2
    served = make_defense("quant", weights=kind).serve(loaded, 2)
    wb = WhiteBox(served.model)
    quantised = [m for b in wb.blocks for m in b.modules() if isinstance(m, module)]
    plain = [m for b in wb.blocks for m in b.modules()
             if (isinstance(m, nn.Linear) and not isinstance(m, module)) or type(m).__name__ == "Conv1D"]
    assert len(quantised) == (7 if model_name == "tiny-llama" else 4) * 4 and not plain
    assert all(m.weight.dtype == dtype for m in quantised)
    # embeddings and head untouched, fp32
    assert torch.equal(served.model.get_input_embeddings().weight, loaded.model.get_input_embeddings().weight)
    assert served.model.get_output_embeddings().weight.dtype == torch.float32
    ids = _ids(32)
    clean, quant = WhiteBox(loaded.model).states(ids, 4), wb.states(ids, 4)
    rel = ((quant - clean).norm() / clean.norm()).item()
    assert 0 < rel < bound


def test_int8_is_batch_independent(llama):
    served = make_defense("quant", weights="int8").serve(llama, 3)
    wb = WhiteBox(served.model)
    ids = _ids(6)
    prefix = wb.prefix_cache(ids[:5], 3)
    alone = wb.step(prefix, ids[5:6]).states[0]
    for seed in range(3):
        others = _ids(63, seed + 10)
        batch = torch.cat([others[:20], ids[5:6], others[20:]])
        assert torch.equal(wb.step(prefix, batch).states[20], alone)
    assert torch.allclose(wb.states(ids, 3)[5], alone, rtol=0, atol=1e-4 * alone.norm().item())


def test_activation_quantisation_error(llama):
    states = WhiteBox(llama.model).states(_ids(32), 4)
    errors = {}
    for kind in ["int8", "nf4", "fp4"]:
        d = make_defense("quant", weights="none", activations=kind)
        out = d.expose(states)
        assert out.shape == states.shape and out.dtype == states.dtype
        errors[kind] = ((out - states).norm() / states.norm()).item()
        assert d.serve(llama, 4) is llama
    assert 0 < errors["int8"] < 0.03 < errors["nf4"] < 0.2


def test_sipit_recovers_exactly_with_same_quantised_model(llama):
    d = make_defense("quant", weights="nf4")
    served = d.serve(llama, 2)
    attacker = d.attacker_model(llama, 2, knows_defense=True)
    assert attacker is served and d.attacker_model(llama, 2, knows_defense=False) is llama
    ids = _ids(6, 5)
    observed = d.expose(WhiteBox(served.model).states(ids, 2))
    inv = SipIt(GradientPolicy()).invert(observed, WhiteBox(attacker.model), 2, llama.tokenizer)
    assert inv.ids == ids.tolist() and inv.all_verified


# ------------------------------------------------------------------------------------ tying
@pytest.mark.parametrize("model_name", ["tiny-llama", "tiny-gpt2"])
def test_tied_tokens_produce_identical_states(model_name, llama, gpt2):
    loaded = llama if model_name == "tiny-llama" else gpt2
    d = make_defense("tying", groups=64)
    served = d.serve(loaded, 2)
    groups = d.groups()
    assert groups.shape == (512,) and groups.unique().numel() <= 64
    members = next(m for m in d.group_members().values() if len(m) >= 2)
    wb = WhiteBox(served.model)
    prefix = wb.prefix_cache(_ids(4), 3)
    states = wb.step(prefix, torch.tensor(members[:2])).states
    assert torch.equal(states[0], states[1])
    # the head keeps the original (untied) matrix; the clean model is unchanged
    head = served.model.get_output_embeddings().weight
    assert head.data_ptr() != served.model.get_input_embeddings().weight.data_ptr()
    assert torch.equal(head, loaded.model.get_output_embeddings().weight)
    clean_wb = WhiteBox(loaded.model)
    assert not torch.equal(clean_wb.step(clean_wb.prefix_cache(_ids(4), 3), torch.tensor(members[:2])).states[0],
                           clean_wb.step(clean_wb.prefix_cache(_ids(4), 3), torch.tensor(members[:2])).states[1])


def test_rare_tying_maps_rare_to_frequent(llama):
    from defenses.utility import token_counts

    d = make_defense("tying", rare=100)
    served = d.serve(llama, 1)
    rep = d.groups()
    moved = (rep != torch.arange(512)).nonzero().flatten()
    assert 0 < moved.numel() <= 100
    counts = token_counts(llama.tokenizer, 512)
    assert counts[moved].max() <= counts[rep[moved]].min()  # rare ones point at frequent ones
    emb = served.model.get_input_embeddings().weight
    assert torch.equal(emb[moved], emb[rep[moved]])


# ------------------------------------------------------------------------------------ pooling
def test_pooled_shapes_and_sipit_refuses(llama):
    wb = WhiteBox(llama.model)
    states = wb.states(_ids(7), 2)
    shapes = {
        ("mean", "all", None, None): (1, 1, 64),
        ("max", "window", 2, None): (1, 4, 64),
        ("mean", "window", 1, None): (1, 7, 64),
        ("mean", "dims", None, 8): (1, 7, 8),
    }
    for (mode, over, k, g), shape in shapes.items():
        d = make_defense("pooling", mode=mode, over=over, k=k, g=g)
        pooled = d.expose(states)
        assert tuple(pooled.shape) == shape and not d.per_position
        with pytest.raises(SipitInputError, match="pooled exposure holds no per-position states"):
            SipIt(GradientPolicy()).invert(pooled, wb, 2, llama.tokenizer)
        with pytest.raises(PooledExposureError, match="PooledBeamAttack"):
            require_per_position(d, "SipIt")
    mean2 = make_defense("pooling", over="window", k=2).expose(states)
    assert torch.allclose(mean2[0, 0], states[:2].mean(0)) and torch.allclose(mean2[0, 3], states[6])
    with pytest.raises(ValueError, match="divide"):
        make_defense("pooling", over="dims", g=5).expose(states)


@pytest.mark.parametrize("params, length", [
    ({"over": "window", "k": 1}, 4), ({"over": "window", "k": 2}, 4), ({"over": "window", "k": 2}, None),
    ({"over": "dims", "g": 4}, None),
])
def test_pooled_attack_recovers_short_prompts(llama, params, length):
    wb = WhiteBox(llama.model)
    ids = _ids(4, 2)
    d = make_defense("pooling", **params)
    inv = PooledBeamAttack(d, beam=4).invert(d.expose(wb.states(ids, 2)), wb, 2, llama.tokenizer, length=length)
    assert inv.ids == ids.tolist() and inv.all_verified


def test_learned_proposals_recover_what_the_prior_cannot_guess(llama, tmp_path, monkeypatch):
    """Random tokens lie outside the prior's top 4: the prior-only beam recovers almost none of them;
    with the learned proposals (the completing position of a mean window has an exact proxy state)
    windows of 2 come back exactly."""
    from attacks.policies import LearnedPolicy
    from attacks.proposals import HeadConfig

    monkeypatch.setenv("SIPIT_CACHE_DIR", str(tmp_path))
    wb = WhiteBox(llama.model)
    d = make_defense("pooling", over="window", k=2)
    policy = LearnedPolicy(HeadConfig(n_text=4096, n_random=2048, n_pairs=4096, min_steps=300))
    prior_only, learned, exact = 0, 0, 0
    for seed in range(4):
        ids = _ids(8, 40 + seed).tolist()
        target = d.expose(wb.states(ids, 2))
        a = PooledBeamAttack(d, beam=4, topk=4, full_vocab_limit=0).invert(target, wb, 2, llama.tokenizer, length=8)
        b = PooledBeamAttack(d, beam=4, topk=4, full_vocab_limit=0, proposals=policy, head_k=16).invert(
            target, wb, 2, llama.tokenizer, length=8)
        prior_only += sum(x == y for x, y in zip(a.ids, ids))
        learned += sum(x == y for x, y in zip(b.ids, ids))
        exact += b.ids == ids and b.all_verified
    assert prior_only <= 4 and learned >= 28 and exact >= 3
    assert any("inverse head" in line for line in b.setup)


def test_the_fill_ranks_a_dominant_first_state_that_the_running_mean_cannot():
    """A window of 2 whose first state is ~9x the second's (SmolLM2's position 0): ||acc/n - target||
    prefers first states that sit halfway to the second, the fill with E[h_1] puts the truth first."""
    gen = torch.Generator().manual_seed(0)
    d = 64
    sink = torch.zeros(d)
    sink[0] = 90.0  # the large direction every first state shares, its size varying by token (SmolLM2: |h_0| 4,991-5,905)
    scale = 1 + 0.05 * torch.randn(200, 1, generator=gen)
    firsts = sink * scale + torch.randn(200, d, generator=gen)  # 200 candidate first states
    truth = int(scale[:, 0].argsort()[100])  # a first token of median size
    seconds = 0.3 * torch.randn(50, d, generator=gen) + 1.0  # second states: mean ~1, norm ~8
    target = (firsts[truth] + seconds[0]) / 2
    plain = partial_score("mean", firsts, 1, target, k=2)
    filled = partial_score("mean", firsts, 1, target, k=2, fill=seconds[1:].mean(0))
    assert int((filled < filled[truth]).sum()) == 0
    assert int((plain < plain[truth]).sum()) > 50
    torch.testing.assert_close(partial_score("mean", firsts, 1, target), plain)  # no k: no fill
    below = torch.minimum(firsts, target)  # a running max the target's max can still reach: 0
    assert float(partial_score("max", below, 1, target).max()) == 0.0
    assert float(partial_score("max", target + 1.0, 1, target)) == pytest.approx(d)  # 1 above it in every dim


def test_pooled_attack_mean_over_all_fits_better_than_chance(gpt2):
    wb = WhiteBox(gpt2.model)
    ids = _ids(4, 3)
    d = make_defense("pooling", over="all")
    target = d.expose(wb.states(ids, 2))
    inv = PooledBeamAttack(d, beam=4).invert(target, wb, 2, gpt2.tokenizer, length=4)
    assert len(inv.ids) == 4
    fit = (d.expose(wb.states(inv.ids, 2)) - target).norm().item()
    random_fits = [(d.expose(wb.states(_ids(4, 100 + s), 2)) - target).norm().item() for s in range(5)]
    assert fit == pytest.approx(inv.positions[0].distance, rel=1e-3, abs=1e-4)
    assert fit < 0.5 * min(random_fits)


# ------------------------------------------------------------------------------------ chains + utility
def test_chain_quant_then_noise(llama):
    chain = make_chain("quant,noise", weights="int8", sigma=0.05, seed=1)
    assert isinstance(chain, Chain) and [m.name for m in chain.members] == ["quant", "noise"]
    served = chain.serve(llama, 2)
    assert any(isinstance(m, bnb.nn.Linear8bitLt) for m in served.model.modules())
    states = WhiteBox(served.model).states(_ids(32), 2)
    assert (chain.expose(states) - states).std().item() == pytest.approx(chain.noise_sigma(states), rel=0.1)
    assert chain.attacker_model(llama, 2) is served
    assert chain.per_position and "chain" in chain.describe()
    with pytest.raises(ValueError, match="last"):
        make_chain("pooling,noise")
    assert not make_chain(["noise", "pooling"]).per_position
    assert make_chain("noise").name == "noise"


def test_utility_cost(llama):
    clean = utility_cost(llama, make_defense("none"), 2, n_tokens=256)
    assert clean.ppl_rel_increase == 0 and clean.top1_agreement == 1 and clean.state_rel_l2 == 0
    noisy = utility_cost(llama, make_defense("noise", sigma=0.1), 2, n_tokens=256)
    assert noisy.ppl_served == clean.ppl_served and noisy.state_rel_l2 == pytest.approx(0.1, rel=0.1)
    inmodel = utility_cost(llama, make_defense("noise", sigma=1.0, placement="model"), 2, n_tokens=256)
    assert inmodel.ppl_served != clean.ppl_served and inmodel.top1_agreement < 1
    pooled = utility_cost(llama, make_defense("pooling", over="window", k=4), 2, n_tokens=256)
    assert pooled.state_rel_l2 is None and pooled.exposure_shape == [1, 64, 64]
    assert torch.equal(held_out_ids(llama.tokenizer, 256, 0), held_out_ids(llama.tokenizer, 256, 0))
    assert set(clean.to_dict()) >= {"ppl_clean", "ppl_served", "top1_agreement", "state_cosine"}


def test_continued_inference_prices_what_leaks_from_the_exposed_copy(llama):
    """The use "continued inference": the blocks above l consume the exposed states. Exposure-only
    defences are free for the served model but not for this use; with no defence it is the clean model."""
    before = WhiteBox(llama.model).states(_ids(6), 3)
    clean = utility_cost(llama, make_defense("none"), 2, n_tokens=256)
    assert clean.continued_ppl == clean.ppl_clean and clean.continued_top1_agreement == 1
    for defense in (make_defense("noise", sigma=1.0, placement="exposure"),
                    make_defense("quant", weights="none", activations="nf4")):
        cost = utility_cost(llama, defense, 2, n_tokens=256)
        assert cost.ppl_rel_increase == 0 and cost.top1_agreement == 1  # the served model is untouched
        assert cost.continued_ppl != cost.ppl_clean and cost.continued_top1_agreement < 1
    # the same noise inside the model and on the exposed copy cost this use alike (same layer-l law)
    inside = utility_cost(llama, make_defense("noise", sigma=1.0, placement="model"), 2, n_tokens=256)
    outside = utility_cost(llama, make_defense("noise", sigma=1.0, placement="exposure"), 2, n_tokens=256)
    assert abs(inside.continued_top1_agreement - outside.continued_top1_agreement) < 0.1
    pooled = utility_cost(llama, make_defense("pooling", mode="mean", over="all"), 2, n_tokens=256)
    assert pooled.continued_ppl is None and pooled.continued_top1_agreement is None
    # only an exposure that changes the states needs its own pass; the others continue as served
    assert [d.alters_exposure for d in (make_defense("none"), make_defense("quant", weights="int8"),
                                        make_defense("noise", sigma=1.0, placement="model"),
                                        make_defense("noise", sigma=1.0), make_chain(["quant", "noise"], weights="int8"))
            ] == [False, False, False, True, True]
    assert inside.continued_ppl == inside.ppl_served
    assert torch.equal(WhiteBox(llama.model).states(_ids(6), 3), before)  # no hook left on the clean model


def _fp4_prompt() -> torch.Tensor:
    # 24 seeded ids on which tiny-llama's fp4 copy showed a cached-step gap on an earlier machine's bf16 kernel
    return torch.randint(0, 512, (24,), generator=torch.Generator().manual_seed(24))


def test_served_shape_verification_reproduces_the_served_4bit_states_bit_for_bit(llama):
    served = make_defense("quant", weights="fp4").serve(llama, 4)
    wb = WhiteBox(served.model)
    ids, layer = _fp4_prompt(), wb.n_layers
    full = wb.states(ids, layer)
    view = wb.at_served_shape(len(ids))
    assert view.memo is wb.memo and wb.served_length is None and view.served_length == len(ids)
    prefix = view.prefix_cache([], layer)
    # Whether a plain cached step misses the served state depends on the CPU's 4-bit kernel: by more than
    # SipIt's eps on an earlier machine's CPU with avx512_bf16, not at all on an AMD EPYC with it
    # (2026-12-06). The served-shape step must equal it bit for bit on every CPU.
    for t, token in enumerate(ids.tolist()):
        candidates = torch.tensor([3, token, 11])
        batch = view.step(prefix, candidates)
        assert torch.equal(batch.states[1], full[t])  # the served state, whatever the batch holds
        prefix = batch.extended(1)
    with pytest.raises(SipitInputError, match="served length"):
        wb.at_served_shape(0)


def test_the_pipeline_verifies_4bit_candidates_at_the_served_shape_and_inverts_exactly(llama):
    from benchmarks.pipeline import expose, invert_all

    ids, layer = _fp4_prompt().tolist(), 4
    chain = make_chain("quant", weights="fp4")
    clean_wb = WhiteBox(llama.model)
    adaptive = expose(chain, llama, clean_wb, layer, [ids], seed=0)
    assert adaptive.served_shape and adaptive.exact == [True]
    assert adaptive.verifier(0).served_length == len(ids) and adaptive.attacker_wb.proposals_from is clean_wb
    inv = invert_all(adaptive, lambda i: SipIt(GradientPolicy()), llama.tokenizer)[0]
    assert inv.ids == ids and inv.all_verified
    naive = expose(chain, llama, clean_wb, layer, [ids], seed=0, knows_defense=False)
    assert not naive.served_shape and naive.verifier(0) is clean_wb and naive.exact == [False]
    assert make_chain("quant", weights="int8").served_shape_matters
    assert not make_chain("quant", weights="none", activations="int8").served_shape_matters
    noisy = expose(make_chain("quant,noise", weights="fp4", sigma=0.1), llama, clean_wb, layer, [ids], seed=0)
    assert noisy.served_shape and noisy.exact == [False] and noisy.verifier(0) is noisy.attacker_wb  # decoders tolerate the gap


@pytest.mark.parametrize("kind", ["int8", "nf4"])
def test_stored_activations_are_decoded_as_noise_of_their_own_error(llama, kind):
    """The attacker knows the storage format, so the exposure carries its error as a sigma and the
    strongest attack is the noise-robust decoder with that radius; it recovers the prompt."""
    from attacks.registry import AttackOptions, strongest
    from benchmarks.pipeline import attack_for, expose, invert_all

    clean_wb = WhiteBox(llama.model)
    ids = _ids(8, 7).tolist()
    chain = make_chain("quant", weights="none", activations=kind)
    exposed = expose(chain, llama, clean_wb, 2, [ids], seed=0)
    states = clean_wb.states(ids, 2)
    error = (exposed.states[0].float() - states.float()).pow(2).mean().sqrt().item()
    assert exposed.exact == [False] and exposed.sigmas[0] == pytest.approx(error, rel=1e-5) and error > 0
    assert strongest(exposed.knowledge(0), AttackOptions()) == "map"
    assert strongest(exposed.knowledge(0), AttackOptions(robust="radius")) == "nn-heuristic"
    inv = invert_all(exposed, lambda i: attack_for(exposed, i, "sipit", AttackOptions(policy="gradient")),
                     llama.tokenizer)[0]
    assert inv.ids == ids
    assert make_defense("quant", weights="int8").noise_sigma(states) == 0.0  # exact exposure: no error
    naive = expose(chain, llama, clean_wb, 2, [ids], seed=0, knows_defense=False)
    assert naive.sigmas == exposed.sigmas  # the exposure is the same; the naive attacker does not know its error
    assert naive.knowledge(0).sigma == 0.0 and strongest(naive.knowledge(0), AttackOptions()) == "nn-gradient"
    noisy = expose(make_chain("noise", sigma=0.5), llama, clean_wb, 2, [ids], seed=0, knows_defense=False)
    assert strongest(noisy.knowledge(0), AttackOptions()) == "nn-gradient"


def test_the_tied_attacker_recovers_the_group_and_the_prior_picks_the_member(llama):
    from attacks.registry import AttackOptions
    from attacks.tied import MemberByPrior
    from benchmarks.pipeline import attack_for, expose, invert_all
    from sipit.prior import NextTokenPrior

    chain = make_chain("tying", rare=400)
    served = chain.serve(llama, 3)
    groups = find_member(chain, "tying").groups()
    tied_groups = [g for g in groups.unique().tolist() if int((groups == g).sum()) > 1]
    # A prompt the prior decides: each position's true token is the prior's pick within its tied group.
    prior, ids = NextTokenPrior(served.model), []
    for g in torch.tensor(tied_groups)[torch.randperm(len(tied_groups), generator=torch.Generator().manual_seed(1))[:10]]:
        members = torch.nonzero(groups == g).flatten()
        ids.append(int(members[int(prior.logprobs[members].argmax())]))
        prior.push(ids[-1])
    exposed = expose(chain, llama, WhiteBox(llama.model), 3, [ids], seed=0)
    options = AttackOptions(policy="gradient")
    attack = attack_for(exposed, 0, "sipit", options)
    assert isinstance(attack, MemberByPrior)
    inv = invert_all(exposed, lambda i: attack, llama.tokenizer)[0]
    assert inv.ids == ids and inv.all_verified
    plain = invert_all(exposed, lambda i: attack.inner, llama.tokenizer)[0]  # the order's member
    assert torch.equal(groups[plain.ids], groups[ids]) and plain.ids != ids
    naive = expose(chain, llama, WhiteBox(llama.model), 3, [ids], seed=0, knows_defense=False)
    assert not isinstance(attack_for(naive, 0, "sipit", options), MemberByPrior)
