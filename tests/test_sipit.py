"""SipIt recovers prompts exactly, records every position honestly, and refuses bad input."""

import pytest
import torch

from attacks.policies import GradientPolicy, RandomPolicy, make_policy
from attacks.sipit import SipIt
from benchmarks.invert import format_inversion, invert_text
from benchmarks.prompts import prompt_set
from sipit.whitebox import SipitInputError


@pytest.mark.parametrize(
    "policy, layers", [("gradient", (0, 1, 2, 4)), ("random", (1, 4))]
)
def test_exact_recovery_of_natural_and_random_prompts_at_several_layers(tiny, policy, layers):
    loaded, wb = tiny
    prompts = prompt_set(loaded.tokenizer, 2, length=10, natural_fraction=0.5, seed=1)
    assert {p.kind for p in prompts} == {"natural", "random"}
    for layer in layers:
        for prompt in prompts:
            inversion = SipIt(make_policy(policy)).invert(wb.states(prompt.ids, layer), wb, layer, loaded.tokenizer)
            assert inversion.ids == prompt.ids, (layer, prompt.kind)
            assert inversion.all_verified
            assert inversion.text == loaded.tokenizer.decode(prompt.ids)
            assert all(r.distance <= r.radius for r in inversion.positions)
            assert all(1 <= r.candidates_tried <= wb.vocab_size for r in inversion.positions)


def test_gradient_policy_tries_fewer_candidates_than_bruteforce(tiny_llama):
    loaded, wb = tiny_llama
    prompts = prompt_set(loaded.tokenizer, 6, length=12, seed=2)
    tried = {"gradient": 0, "random": 0}
    for prompt in prompts:
        observed = wb.states(prompt.ids, wb.n_layers)
        for name in tried:
            tried[name] += SipIt(make_policy(name)).invert(observed, wb, wb.n_layers).candidates_tried
    assert tried["gradient"] * 3 < tried["random"], tried


def test_exhausted_vocabulary_returns_the_nearest_candidate_flagged_unverified(tiny_llama):
    loaded, wb = tiny_llama
    ids = loaded.tokenizer("hello world", add_special_tokens=False).input_ids
    observed = wb.states(ids, 2)
    observed[1] += 0.05 * observed[1].norm() / observed.shape[1] ** 0.5  # no token matches any more
    inversion = SipIt(GradientPolicy(), batch_size=64).invert(observed, wb, 2)
    second = inversion.positions[1]
    assert not second.verified and second.candidates_tried == wb.vocab_size
    assert second.distance > second.radius
    assert second.token == ids[1]  # the perturbation is far below the margin: nearest is still right
    assert inversion.positions[0].verified and not inversion.all_verified


def test_random_policy_is_seeded(tiny_llama):
    loaded, wb = tiny_llama
    ids = loaded.tokenizer("seeded order", add_special_tokens=False).input_ids
    observed = wb.states(ids, 1)
    runs = [[r.candidates_tried for r in SipIt(RandomPolicy(), seed=s).invert(observed, wb, 1).positions]
            for s in (5, 5, 6)]
    assert runs[0] == runs[1] != runs[2]


def test_bad_inputs_give_clear_errors(tiny_llama):
    loaded, wb = tiny_llama
    attack = SipIt()
    with pytest.raises(SipitInputError, match="out of range"):
        attack.invert(torch.zeros(3, wb.d), wb, 9)
    with pytest.raises(SipitInputError, match="shape"):
        attack.invert(torch.zeros(3, wb.d - 1), wb, 1)
    with pytest.raises(SipitInputError, match="NaN"):
        attack.invert(torch.full((3, wb.d), float("nan")), wb, 1)
    with pytest.raises(SipitInputError, match="no positions"):
        attack.invert(torch.zeros(0, wb.d), wb, 1)
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("psychic")
    with pytest.raises(SipitInputError, match="empty prompt"):
        invert_text("   ", model="tiny-llama")


def test_invert_command_function_reports_every_position():
    truth, inversion, tokenizer = invert_text("Dear Maria, thank you", model="tiny-gpt2", layer=-2)
    assert inversion.ids == truth
    table = format_inversion(inversion, truth, tokenizer)
    assert "exact recovery: True" in table
    assert len(table.splitlines()) == len(truth) + 2
