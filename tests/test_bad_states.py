"""Bad observed states and tolerances are refused with a clear error; answers are never flagged
verified when they are not (issue 17)."""

import math

import pytest
import torch

from attacks.policies import GradientPolicy
from attacks.result import layer_hint
from attacks.robust import MapBeamSearch, MapDecoder, NearestNeighbour, _record
from attacks.sipit import SipIt
from defenses.base import DefenseParamError
from defenses.tying import WeightTying
from sipit.tolerance import acceptance_radius
from sipit.whitebox import SipitInputError

TEXT = "The cat sat on the mat."


def ids_of(loaded, text=TEXT):
    return loaded.tokenizer(text, add_special_tokens=False).input_ids


def every_attack():
    return [SipIt(GradientPolicy()), NearestNeighbour(stop="exact"), NearestNeighbour(stop="heuristic", sigma=0.1),
            MapDecoder(0.1, exact=True), MapBeamSearch(0.1, width=2, exact=True)]


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_integer_states_are_refused(tiny_llama, dtype):
    loaded, wb = tiny_llama
    states = wb.states(ids_of(loaded), 2).round().to(dtype)
    with pytest.raises(SipitInputError, match=f"floating-point tensor, got dtype {dtype}"):
        wb.check_states(states)
    with pytest.raises(SipitInputError, match="floating-point"):
        SipIt().invert(states, wb, 2)


def test_states_scaled_by_1e30_are_refused_by_every_attack(tiny_llama):
    loaded, wb = tiny_llama
    states = wb.states(ids_of(loaded)[:3], 2) * 1e30
    assert torch.isfinite(states).all()  # finite, but the squared norms overflow float32
    for attack in every_attack():
        with pytest.raises(SipitInputError, match="squared norms overflow float32"):
            attack.invert(states, wb, 2)


def test_states_at_the_edge_of_float32_still_invert(tiny_llama):
    """The overflow check only refuses what cannot be scored: 1e15-scaled states still run."""
    loaded, wb = tiny_llama
    ids = ids_of(loaded)[:2]
    inv = NearestNeighbour(stop="exact").invert(wb.states(ids, 2) * 1e15, wb, 2)
    assert len(inv.ids) == 2 and all(math.isfinite(p.distance) for p in inv.positions)


def test_a_non_finite_distance_is_never_a_verified_answer():
    with pytest.raises(SipitInputError, match="no candidate lies at a finite distance"):
        _record(0, 5, math.inf, math.inf, 10, 0.0)
    with pytest.raises(SipitInputError, match="no candidate lies at a finite distance"):
        _record(0, -1, math.inf, 1.0, 10, 0.0)
    with pytest.raises(SipitInputError):
        _record(0, 3, math.nan, 1.0, 10, 0.0)
    assert _record(0, 3, 0.5, 1.0, 10, 0.0).verified and not _record(0, 3, 2.0, 1.0, 10, 0.0).verified


@pytest.mark.parametrize("rel_tol", [math.nan, math.inf, 0.0, -1e-4])
def test_non_finite_or_non_positive_rel_tol_is_refused(tiny_llama, rel_tol):
    loaded, wb = tiny_llama
    states = wb.states(ids_of(loaded)[:2], 2)
    with pytest.raises(SipitInputError, match="rel_tol must be a finite number > 0"):
        acceptance_radius(states, rel_tol)
    if rel_tol == rel_tol and rel_tol <= 0:
        return  # SipIt's own constructor already refuses these (attacks/sipit.py)
    with pytest.raises(SipitInputError, match="rel_tol"):
        SipIt(rel_tol=rel_tol).invert(states, wb, 2)  # before any candidate is scanned


@pytest.mark.parametrize("make", [lambda r: NearestNeighbour(rel_tol=r), lambda r: MapDecoder(0.1, rel_tol=r),
                                  lambda r: MapBeamSearch(0.1, rel_tol=r)])
def test_robust_decoders_refuse_nan_rel_tol_when_built(make):
    with pytest.raises(SipitInputError, match="rel_tol"):
        make(math.nan)


def test_sequences_beyond_the_context_are_refused(tiny):
    loaded, wb = tiny
    assert wb.context_length == 256
    with pytest.raises(SipitInputError, match="257 positions, more than the model's context length of 256"):
        wb.check_ids([1] * 257)
    with pytest.raises(SipitInputError, match="context length of 256"):
        wb.check_states(torch.zeros(257, wb.d))
    wb.check_ids([1] * 256)


def test_states_of_another_layer_get_a_layer_hint(tiny_llama):
    loaded, wb = tiny_llama
    ids = ids_of(loaded)[:3]
    right = SipIt(GradientPolicy()).invert(wb.states(ids, 4), wb, 4)
    assert right.ids == ids and layer_hint([right], 4) is None
    wrong = SipIt(GradientPolicy()).invert(wb.states(ids, 1), wb, 4)  # layer-1 states named layer 4
    assert wrong.unverified == 3
    hint = layer_hint([wrong], 4)
    assert hint.startswith("no position verified") and "layer 4" in hint and "--layer" in hint


def test_tying_with_more_groups_than_tokens_is_refused_before_serving(tiny_llama):
    loaded, _ = tiny_llama
    with pytest.raises(DefenseParamError, match="groups=100000 exceeds the vocabulary size 512"):
        WeightTying(groups=100000).check_model(loaded)
    with pytest.raises(DefenseParamError, match="rare=512 must be below the vocabulary size 512"):
        WeightTying(rare=512).check_model(loaded)
    WeightTying(groups=8).check_model(loaded)
