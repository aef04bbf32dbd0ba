"""The provider defences in the benchmark: each defence declares what the attacker knows, strongest() picks the
attacker that breaks it, and a run records it (tiny-llama; gradient candidate order, so no inverse heads train)."""

from __future__ import annotations

import json

import pytest
import torch

from attacks.registry import AttackOptions, Exposure, strongest
from benchmarks import run as bench
from benchmarks.config import RunConfig
from benchmarks.pipeline import expose
from defenses import make_chain
from defenses.base import chain_members, find_member

pytestmark = pytest.mark.usefixtures("one_thread")  # 2 shared cores: oversubscribed threads slow tiny steps ~20x
QUIET = dict(n_prompts=3, length=8, utility_tokens=0, margin_positions=0, policy="gradient", track=False,
             progress=False, log=lambda *a, **k: None)


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SIPIT_CACHE_DIR", str(tmp_path / "cache"))


def _old_knowledge(exposed, i: int) -> Exposure:
    """Exposed.knowledge as it was before the defences declared it: by name and the pooling special case."""
    pooling = None if exposed.chain.per_position else chain_members(exposed.chain)[-1]
    tying = find_member(exposed.chain, "tying")
    groups = tying.groups() if tying is not None and exposed.exact[i] else None
    sigma = exposed.sigmas[i] if exposed.knows_defense else 0.0
    return Exposure(sigma=sigma, exact=exposed.exact[i], pooling=pooling, groups=groups)


@pytest.mark.parametrize("names, params", [
    ("none", {}), ("noise", {"sigma": 0.05, "relative_to": "rms"}),
    ("quant", {"weights": "none", "activations": "int8"}),
    ("tying", {"rare": 400}), ("pooling", {"over": "window", "k": 2}),
    ("quant,noise", {"weights": "none", "activations": "int8", "sigma": 0.1}), ("tying,pooling", {"rare": 400}),
])
def test_the_existing_defences_declare_what_the_attacker_knew_before(tiny_llama, names, params):
    loaded, clean_wb = tiny_llama
    ids = loaded.tokenizer("Send the invoice to Alice", add_special_tokens=False).input_ids
    for knows in (True, False):
        exposed = expose(make_chain(names, **params), loaded, clean_wb, 2, [ids], seed=0, knows_defense=knows)
        new, old = exposed.knowledge(0), _old_knowledge(exposed, 0)
        assert (new.sigma, new.exact, new.pooling) == (old.sigma, old.exact, old.pooling)
        assert (new.groups is None and old.groups is None) or torch.equal(new.groups, old.groups)
        assert new.keyed is None and new.dp is None and new.known == ()
        for robust in ("map", "radius"):
            assert strongest(new, AttackOptions(robust=robust)) == strongest(old, AttackOptions(robust=robust))


def test_keyed_and_dp_exposures_declare_their_scheme_and_get_their_attacker(tiny_llama):
    loaded, clean_wb = tiny_llama
    ids = loaded.tokenizer("My PIN is 4821", add_special_tokens=False).input_ids
    keyed = expose(make_chain("rotate", scope="prompt", rank=4), loaded, clean_wb, 2, [ids], seed=0).knowledge(0)
    assert keyed.keyed == {"scheme": "rotate", "scope": "prompt", "rank": 4} and not keyed.exact
    assert strongest(keyed, AttackOptions()) == "key-recovery"
    naive = expose(make_chain("permute"), loaded, clean_wb, 2, [ids], seed=0, knows_defense=False).knowledge(0)
    assert naive.keyed is None and strongest(naive, AttackOptions()) == "nn-gradient"  # not told it is mixed
    chain = make_chain("dp", mechanism="gaussian", epsilon=100.0, clip=0.1)
    dp = expose(chain, loaded, clean_wb, 2, [ids], seed=0)
    know = dp.knowledge(0)
    assert know.dp["mechanism"] == "gaussian" and know.dp["sigma"] == pytest.approx(chain.sigma) == know.sigma
    assert strongest(know, AttackOptions()) == "map"
    # the informed attacker's candidates are clipped as the exposure was (block 2's output only)
    attacker = dp.attacker_wb
    assert float(clean_wb.states(ids, 2).norm(dim=-1).min()) > 0.1
    torch.testing.assert_close(attacker.states(ids, 2).norm(dim=-1), torch.full((len(ids),), 0.1))
    assert torch.equal(attacker.states(ids, 1), clean_wb.states(ids, 1))
    assert dp.noise_norms[0] == pytest.approx([float(n) for n in (dp.states[0] - attacker.states(ids, 2)).norm(dim=-1)])
    chain.check_exposure("residual", 64)
    with pytest.raises(ValueError, match="residual exposure only"):
        chain.check_exposure("kv", 64)  # its attacker cannot clip keys and values yet


@pytest.mark.parametrize("defense", ["permute", "rotate"])
def test_a_keyed_run_recovers_every_prompt_through_key_recovery(tmp_path, defense):
    """The CLI end to end: 'sipit' is the key-recovery attacker, with no known pair (k = 0)."""
    out = tmp_path / "out"
    assert bench.main(["--model", "tiny-llama", "--defense", defense, "--n-prompts", "3", "--length", "8",
                       "--attacks", "sipit", "--policy", "gradient", "--utility-tokens", "0", "--margin-positions", "0",
                       "--no-tracking", "--no-progress", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    sipit = results["attacks"]["sipit"]
    assert sipit["decoder"] == f"KeyedAttack(keyed-{defense})"
    assert sipit["exact_match"] == 1.0 and sipit["token_accuracy"] == 1.0 and sipit["n_prompts"] == 3
    assert "guarantee" not in results["defense"]  # no formal claim
    assert "known_pairs" not in results["config"]  # k = 0: the hash of earlier runs is kept


def test_known_pairs_give_a_general_mixing_key_and_without_them_the_run_still_scores(tmp_path):
    """rank-4 mixing I + U V^T: no invariant; 8 known prompts x 8 tokens = 64 rows = d give the key."""
    with_pairs = bench.run_benchmark(model="tiny-llama", defense="rotate:rank=4", attacks="sipit", known_pairs=8,
                                     out=tmp_path / "k8", **QUIET)
    assert with_pairs["attacks"]["sipit"]["exact_match"] == 1.0 and with_pairs["config"]["known_pairs"] == 8
    alone = bench.run_benchmark(model="tiny-llama", defense="rotate:rank=4", attacks="sipit", out=tmp_path / "k0",
                                **QUIET)
    assert alone["status"] == "finished" and alone["attacks"]["sipit"]["exact_match"] == 0.0  # the prior's guess


def test_a_dp_run_records_the_claimed_guarantee_beside_the_informed_and_the_blind_attacker(tmp_path):
    """Noise far inside the margins (epsilon 1e4 per state: a claim no one would make, chosen so that the attack
    succeeds on the tiny model): the informed MAP attacker and the blind one both recover every prompt."""
    results = bench.run_benchmark(model="tiny-llama", defense="dp:mechanism=gaussian,epsilon=10000,clip=0.3",
                                  attacks="sipit,blind", out=tmp_path / "dp", **QUIET)
    claim = results["defense"]["guarantee"]
    assert claim["mechanism"] == "gaussian" and claim["per_state"] == {"epsilon": 10000.0, "delta": 1e-5}
    assert claim["n_states"] == 8 and claim["basic_composition"]["epsilon"] == pytest.approx(80000.0)
    assert claim["basic_composition"]["delta"] == pytest.approx(8e-5) and "basic" in claim["basic_composition"]["name"]
    assert "zCDP" in claim["zcdp"]["name"] or "zero-concentrated" in claim["zcdp"]["name"]
    informed, blind = results["attacks"]["sipit"], results["attacks"]["blind"]
    assert informed["decoder"] == "MapDecoder(map)" and blind["decoder"] == "BlindAttack(blind-map)"
    assert informed["token_accuracy"] == 1.0 and blind["token_accuracy"] == 1.0
    written = json.loads((tmp_path / "dp" / "results.json").read_text())
    assert written["defense"]["guarantee"] == json.loads(json.dumps(claim))


def test_blind_is_a_run_attack_and_known_pairs_a_recorded_option():
    assert RunConfig.from_options(attacks="sipit,blind").attacks == ("sipit", "blind")
    assert "known_pairs" not in RunConfig().record() and RunConfig(known_pairs=3).record()["known_pairs"] == 3
    assert RunConfig().hash() != RunConfig(known_pairs=3).hash()


def test_the_search_space_draws_the_provider_families_and_checks_given_settings():
    """permute, rotate and dp are search families: both corners of each build a valid defence, a given setting
    is typed and range-checked like a drawn one."""
    from benchmarks.search.space import FAMILIES, check_given_setting, corner_settings
    from defenses.registry import make_chain

    ranges = dict(vocab_size=512, length=6, sigma_low=0.1, sigma_high=1.0)
    for family in ("permute", "rotate", "dp"):
        assert family in FAMILIES
        for names, params in corner_settings(family, **ranges):
            assert make_chain(names, **params).name == family
    drawn = check_given_setting({"family": "dp", "dp.mechanism": "gaussian", "dp.epsilon": 3.0}, FAMILIES, **ranges)
    assert drawn == {"family": "dp", "dp.mechanism": "gaussian", "dp.epsilon": 3.0}
    with pytest.raises(ValueError, match="dp.epsilon"):
        check_given_setting({"family": "dp", "dp.mechanism": "gaussian", "dp.epsilon": 1e9}, FAMILIES, **ranges)
    with pytest.raises(ValueError, match="rotate.rank"):
        check_given_setting({"family": "rotate", "rotate.scope": "prompt", "rotate.rank": 5}, FAMILIES, **ranges)
