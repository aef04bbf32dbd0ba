"""Defences a provider could deploy: keyed obfuscation and formal (DP) noise, and the attacks that break them."""

from __future__ import annotations

import math

import pytest
import torch

from attacks.key_recovery import (KeyedAttack, assign_permutation, least_squares_mixing, permutation_from_row,
                                  procrustes)
from defenses import make_defense
from defenses.dp import analytic_gaussian_sigma, laplace_l2
from defenses.utility import utility_cost
from sipit.models import load_model
from sipit.whitebox import WhiteBox

TEXTS = ["The cat sat on the mat.", "Send the invoice to Alice by Friday.", "My PIN is 4821 and my name is Bob."]


@pytest.fixture(scope="module")
def llama():
    loaded = load_model("tiny-llama")
    return loaded, WhiteBox(loaded.model)


def ids_of(loaded, text):
    return loaded.tokenizer(text, add_special_tokens=False).input_ids


@pytest.mark.parametrize("name, spec", [("permute", {}), ("permute", {"scope": "prompt"}), ("rotate", {}),
                                        ("rotate", {"scope": "prompt"}), ("rotate", {"rank": 4})])
def test_the_providers_inverse_restores_the_exact_states_and_continued_inference_costs_nothing(llama, name, spec):
    loaded, wb = llama
    defense = make_defense(name, **spec)
    states = wb.states(ids_of(loaded, TEXTS[0]), 2)
    exposed = defense.expose(states, torch.Generator().manual_seed(1))
    assert not torch.allclose(exposed, states)
    restored = defense.restore(exposed)
    if name == "permute":
        assert torch.equal(restored, states)
    else:
        torch.testing.assert_close(restored, states, rtol=1e-6, atol=1e-6)
    report = utility_cost(loaded, defense, 2, n_tokens=128)
    assert abs(report.continued_ppl_rel_increase) < 1e-5 and report.continued_top1_agreement == 1.0


def test_scopes_a_deployment_key_is_one_key_a_prompt_key_is_fresh(llama):
    loaded, wb = llama
    states = wb.states(ids_of(loaded, TEXTS[0]), 2)
    deployment, per_prompt = make_defense("permute"), make_defense("permute", scope="prompt")
    generator = torch.Generator().manual_seed(0)
    assert torch.equal(deployment.expose(states, generator), deployment.expose(states, generator))
    assert not torch.equal(per_prompt.expose(states, generator), per_prompt.expose(states, generator))
    secure = make_defense("rotate", secure=True, scope="prompt")
    assert not torch.equal(secure.expose(states), secure.expose(states))  # OS-random keys


def test_keys_from_known_pairs():
    generator = torch.Generator().manual_seed(0)
    clean = torch.randn(200, 16, generator=generator, dtype=torch.float64)
    q, _ = torch.linalg.qr(torch.randn(16, 16, generator=generator, dtype=torch.float64))
    torch.testing.assert_close(procrustes(clean[:16], clean[:16] @ q), q)  # as many rows as dimensions: exact
    mixing = torch.eye(16, dtype=torch.float64) + 0.3 * torch.randn(16, 16, generator=generator, dtype=torch.float64)
    torch.testing.assert_close(least_squares_mixing(clean[:16], clean[:16] @ mixing), mixing)
    key = torch.randperm(16, generator=generator)
    assert torch.equal(assign_permutation(clean[:3], clean[:3, key]), key)  # three rows are enough
    assert torch.equal(permutation_from_row(clean[0], clean[0, key]), key)  # one row with distinct values


@pytest.mark.parametrize("scope", ["deployment", "prompt"])
@pytest.mark.parametrize("name", ["permute", "rotate"])
def test_without_the_key_the_invariants_recover_every_prompt(llama, name, scope, tmp_path, monkeypatch):
    """k = 0 known pairs: a permutation keeps sorted values, a rotation keeps inner products."""
    monkeypatch.setenv("SIPIT_CACHE_DIR", str(tmp_path))
    loaded, wb = llama
    defense = make_defense(name, scope=scope)
    generator = torch.Generator().manual_seed(0)
    for text in TEXTS:
        ids = ids_of(loaded, text)
        attack = KeyedAttack(name)
        inv = attack.invert(defense.expose(wb.states(ids, 2), generator), wb, 2, loaded.tokenizer)
        assert inv.ids == ids, (attack.route, inv.ids, ids)
        assert ("sorted values" if name == "permute" else "gram") in attack.route


def test_a_general_mixing_needs_as_many_known_rows_as_dimensions(llama, tmp_path, monkeypatch):
    monkeypatch.setenv("SIPIT_CACHE_DIR", str(tmp_path))
    loaded, wb = llama
    defense = make_defense("rotate", rank=8)
    generator = torch.Generator().manual_seed(0)
    from benchmarks.prompts import prompt_set

    known = [(p.ids, defense.expose(wb.states(p.ids, 2), generator))
             for p in prompt_set(loaded.tokenizer, 8, length=10, seed=5, natural_fraction=0.0)]
    ids = ids_of(loaded, TEXTS[1])
    observed = defense.expose(wb.states(ids, 2), generator)
    attack = KeyedAttack("rotate", known=known)
    assert attack.invert(observed, wb, 2, loaded.tokenizer).ids == ids and "least squares" in attack.route


def test_the_dp_mechanisms_noise_scales_match_their_formulas():
    # analytic Gaussian: the classical sigma = Delta sqrt(2 ln(1.25 / delta)) / epsilon is sufficient for
    # epsilon < 1, so the tight one is smaller, and it achieves delta exactly
    sigma = analytic_gaussian_sigma(0.5, 1e-5, 2.0)
    assert sigma < 2.0 * math.sqrt(2 * math.log(1.25 / 1e-5)) / 0.5
    from scipy.stats import norm

    a, b = 2.0 / (2 * sigma), 0.5 * sigma / 2.0
    assert norm.cdf(a - b) - math.exp(0.5) * norm.cdf(-a - b) == pytest.approx(1e-5, rel=1e-3)
    dp = make_defense("dp", mechanism="gaussian", epsilon=0.5, delta=1e-5, clip=1.0)
    assert dp.sigma == pytest.approx(sigma)
    # Laplace-L2: the norm of the noise is Gamma(d, 1 / eta): mean d / eta, and eta = epsilon / (2 clip)
    lap = make_defense("dp", mechanism="laplace-l2", epsilon=8.0, clip=2.0)
    noise = laplace_l2((4000, 32), lap.eta, torch.Generator().manual_seed(0))
    assert lap.eta == 2.0 and float(noise.norm(dim=-1).mean()) == pytest.approx(32 / 2.0, rel=0.02)
    assert float(noise.pow(2).mean().sqrt()) == pytest.approx(lap.noise_sigma(noise), rel=0.03)
    states = torch.randn(6, 32) * 10
    assert float(dp.clipped(states).norm(dim=-1).max()) <= 1.0 + 1e-6
    claim = dp.guarantee(20)
    rho = 20 * 2.0**2 / (2 * sigma**2)
    assert claim["basic_composition"]["epsilon"] == pytest.approx(10.0)
    assert claim["zcdp"]["epsilon"] == pytest.approx(rho + 2 * math.sqrt(rho * math.log(1e5)))


def test_the_audit_never_exceeds_a_correct_mechanisms_epsilon_and_catches_a_miscalibrated_one():
    """The distinguishing game (defenses.dp.distinguishing_game) on two states whose clipped forms lie 2C apart
    (the worst case), 4000 exposures each through the mechanism itself: below the claim for every correct
    mechanism, above it once the Gaussian's noise is 10x smaller than its claim requires."""
    from defenses.dp import DPNoise, distinguishing_game

    d, n = 16, 4000
    a = torch.zeros(d)
    a[0] = 5.0  # clipped to norm 1
    b = -a
    for mechanism in ("gaussian", "laplace-l2"):
        honest = DPNoise(mechanism=mechanism, epsilon=1.0, clip=1.0)
        game = distinguishing_game(honest, a, b, n, torch.Generator().manual_seed(0))
        assert game["clipped_distance"] == pytest.approx(2.0)
        assert 0.0 <= game["epsilon_lower_bound"] <= 1.0, game
    broken = DPNoise(mechanism="gaussian", epsilon=1.0, clip=1.0)
    broken.sigma /= 10  # miscalibrated: the claim says epsilon 1
    game = distinguishing_game(broken, a, b, n, torch.Generator().manual_seed(0))
    assert game["epsilon_lower_bound"] > 1.0, game


def test_the_blind_estimate_of_sigma_is_within_ten_percent_on_a_clean_synthetic_case(llama, tmp_path, monkeypatch):
    """Noise well inside the margins of the tiny model's last layer: the position-0 estimate, refined on every
    decoded position, lands within 10% of the sigma the attacker was not told; it then decodes exactly."""
    from attacks.blind import BlindAttack, sigma_from_position_zero
    from attacks.robust import MapDecoder
    from sipit.vocab_table import position_zero_table

    monkeypatch.setenv("SIPIT_CACHE_DIR", str(tmp_path))
    loaded, wb = llama
    sigma = 0.004
    generator = torch.Generator().manual_seed(0)
    exposures = [(ids_of(loaded, t), None) for t in TEXTS]
    exposures = [(ids, wb.states(ids, 4) + sigma * torch.randn(len(ids), wb.d, generator=generator))
                 for ids, _ in exposures]
    table = position_zero_table(wb, 4).states
    pooled = sigma_from_position_zero(torch.stack([obs[0] for _, obs in exposures]), table)
    assert abs(pooled - sigma) / sigma < 0.25  # d = 64 per row: chi-square's spread, three rows
    for ids, observed in exposures:
        attack = BlindAttack(lambda s: MapDecoder(s, ranking="gradient"))
        inv = attack.invert(observed, wb, 4, loaded.tokenizer)
        assert abs(attack.estimated_sigma - sigma) / sigma < 0.10
        assert inv.ids == ids


def test_the_dp_audit_experiment_never_proves_more_than_a_correct_setting_claims(tmp_path):
    """benchmarks.experiments.dp_audit on the tiny model: every mechanism, both pair kinds, lower bound <= claim."""
    import json

    from benchmarks.experiments import dp_audit

    assert dp_audit.main(["--model", "tiny-llama", "--layer", "2", "--n-prompts", "1", "--length", "4",
                          "--epsilons", "1,30", "--draws", "400", "--out", str(tmp_path), "--no-progress"]) == 0
    rows = json.loads((tmp_path / "dp_audit.json").read_text())["rows"]
    assert {(r["mechanism"], r["pair"]) for r in rows} == {(m, p) for m in ("laplace-l2", "gaussian", "elliptical")
                                                           for p in ("worst", "token")}
    assert all(0.0 <= r["epsilon_lower_bound"] <= r["epsilon_claimed"] for r in rows)
    assert any(r["epsilon_lower_bound"] > 1.0 for r in rows if r["epsilon"] == 30)  # the game does detect leakage
