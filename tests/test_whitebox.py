"""Layer semantics, cached candidate steps and input validation of the white-box core."""

import pytest
import torch

from sipit.models import load_model
from sipit.tolerance import DEFAULT_REL_TOL, measure_gap, tolerance_from_gaps
from sipit.whitebox import SipitInputError, WhiteBox

TEXT = "My name is Alice Smith and my phone number is 555-0199."


def ids_of(loaded, text=TEXT):
    return loaded.tokenizer(text, add_special_tokens=False).input_ids


def test_layers_match_hf_hidden_states_and_last_layer_is_pre_norm(tiny):
    loaded, wb = tiny
    ids = ids_of(loaded)
    with torch.no_grad():
        hidden = loaded.model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    for layer in range(wb.n_layers):
        torch.testing.assert_close(wb.states(ids, layer), hidden[layer][0])
    last = wb.states(ids, wb.n_layers)
    # HF applies the final norm to hidden_states[L]; our layer L is the raw block output.
    assert not torch.allclose(last, hidden[wb.n_layers][0])
    assert torch.equal(wb.states(ids, -1), last)
    assert torch.equal(wb.states(ids, -wb.n_layers - 1), wb.states(ids, 0))


def test_no_block_above_the_layer_runs(tiny):
    loaded, wb = tiny
    ids = ids_of(loaded)
    for layer in range(wb.n_layers + 1):
        wb.blocks_run = 0
        wb.states(ids, layer)
        assert wb.blocks_run == layer
        prefix = wb.prefix_cache(ids[:5], layer)
        wb.blocks_run = 0
        wb.step(prefix, torch.tensor([1, 2, 3]))
        assert wb.blocks_run == layer


def test_cached_batched_steps_equal_full_recomputation(tiny):
    loaded, wb = tiny
    ids = ids_of(loaded)
    gaps = []
    for layer in (0, 1, wb.n_layers):
        full = wb.states(ids, layer)
        prefix = wb.prefix_cache([], layer)
        for t, token in enumerate(ids):
            candidates = torch.tensor([(token + 1) % wb.vocab_size, token, (token + 7) % wb.vocab_size])
            batch = wb.step(prefix, candidates)
            gaps.append(float((batch.states[1] - full[t]).norm() / full[t].norm()))
            # the other candidates are really different states
            assert float((batch.states[0] - full[t]).norm()) > 1e3 * DEFAULT_REL_TOL * float(full[t].norm())
            prefix = batch.extended(1)
        # a prefix computed in one pass gives the same next state as one grown step by step
        direct = wb.step(wb.prefix_cache(ids[:-1], layer), torch.tensor([ids[-1]])).states[0]
        torch.testing.assert_close(direct, full[-1], atol=1e-5, rtol=1e-5)
    assert max(gaps) < DEFAULT_REL_TOL / 20


def test_relaxed_forward_is_differentiable_and_matches_tokens(tiny):
    loaded, wb = tiny
    ids = ids_of(loaded)
    prefix = wb.prefix_cache(ids[:4], 2)
    embeds = wb.token_embeddings()[torch.tensor([ids[4], 9])].clone().requires_grad_(True)
    states = wb.step_embeds(prefix, embeds)
    torch.testing.assert_close(states.detach(), wb.step(prefix, torch.tensor([ids[4], 9])).states)
    states.pow(2).sum().backward()
    assert embeds.grad is not None and float(embeds.grad.abs().sum()) > 0


def test_measured_gap_gives_a_tolerance_below_the_default(tiny):
    loaded, wb = tiny
    gaps = measure_gap(wb, ids_of(loaded), wb.n_layers)
    assert len(gaps) == len(ids_of(loaded))
    assert tolerance_from_gaps(gaps) <= DEFAULT_REL_TOL


@pytest.mark.parametrize("layer", [5, -6, 100])
def test_layer_out_of_range_is_a_clear_error(tiny_llama, layer):
    _, wb = tiny_llama
    with pytest.raises(SipitInputError, match="out of range"):
        wb.states([1, 2, 3], layer)


def test_bad_ids_and_states_are_rejected(tiny_llama):
    _, wb = tiny_llama
    with pytest.raises(SipitInputError, match="empty prompt"):
        wb.states([], 1)
    with pytest.raises(SipitInputError, match="token ids"):
        wb.states([wb.vocab_size], 1)
    with pytest.raises(SipitInputError, match="shape"):
        wb.check_states(torch.zeros(3, wb.d + 1))
    with pytest.raises(SipitInputError, match="shape"):
        wb.check_states(torch.zeros(wb.d))
    bad = torch.zeros(4, wb.d)
    bad[2, 0] = float("nan")
    with pytest.raises(SipitInputError, match="NaN or inf at positions \\[2\\]"):
        wb.check_states(bad)
    bad[2, 0] = float("inf")
    with pytest.raises(SipitInputError, match="NaN or inf"):
        wb.check_states(bad)


def test_unknown_model_name_lists_the_registry():
    with pytest.raises(ValueError, match="tiny-gpt2"):
        load_model("no-such-model")


def test_tiny_models_are_seeded():
    a = load_model("tiny-llama", seed=3).model.get_input_embeddings().weight
    b = load_model("tiny-llama", seed=3).model.get_input_embeddings().weight
    c = load_model("tiny-llama", seed=4).model.get_input_embeddings().weight
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_scaled_embeddings_go_through_the_models_own_module(tiny_llama):
    """A Gemma-style model scales its embeddings: the white box must follow the module."""
    loaded, _ = tiny_llama
    import copy

    model = copy.deepcopy(loaded.model)
    embedding = model.get_input_embeddings()
    original_forward = embedding.forward
    embedding.forward = lambda ids: original_forward(ids) * 8.0
    wb = WhiteBox(model)
    ids = ids_of(loaded)
    with torch.no_grad():
        hidden = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    torch.testing.assert_close(wb.states(ids, 0), hidden[0][0])
    torch.testing.assert_close(wb.states(ids, 2), hidden[2][0])
    prefix = wb.prefix_cache(ids[:3], 2)
    torch.testing.assert_close(wb.step(prefix, torch.tensor([ids[3]])).states[0], hidden[2][0][3], atol=1e-5, rtol=1e-5)


def test_local_hf_directory_loads_the_same_model(tmp_path, tiny_llama):
    loaded, wb = tiny_llama
    loaded.model.save_pretrained(tmp_path / "m")
    loaded.tokenizer.save_pretrained(tmp_path / "m")
    again = load_model(str(tmp_path / "m"))
    ids = ids_of(loaded)
    torch.testing.assert_close(WhiteBox(again.model).states(ids, 2), wb.states(ids, 2))
