"""The linear surrogate that ranks candidates under noise (attacks.surrogate)."""

from __future__ import annotations

import pytest
import torch

from attacks.robust import CandidateScorer, MapDecoder, NearestNeighbour
from attacks.surrogate import LinearSurrogate, first_token_states
from sipit.sweep import sweep_states

pytestmark = pytest.mark.usefixtures("one_thread")


def _ids(lm, n: int = 6) -> list[int]:
    return lm.tokenizer("def main(): return the value of x", add_special_tokens=False).input_ids[:n]


def test_at_layer_zero_the_surrogate_is_exact(tiny):
    """Layer 0 is the embedding (plus GPT-2's position embedding): an affine function of F_v, so a
    plain least-squares fit (lam = 0) predicts every token's distance exactly."""
    lm, wb = tiny
    ids = _ids(lm)
    prefix = wb.prefix_cache(ids[:3], 0)
    exact = sweep_states(wb, prefix, chunk=256)
    target = wb.states(ids, 0)[3] + 0.1 * torch.randn(wb.d, generator=torch.Generator().manual_seed(0))
    surrogate = LinearSurrogate(n_fit=128, lam=0.0)
    predicted = surrogate.predicted_sq_distances(wb, surrogate.fit(wb, prefix), target)
    torch.testing.assert_close(predicted, (exact - target).pow(2).sum(1), rtol=1e-3, atol=1e-3)


def test_fits_are_memoised_per_prefix_and_hold_exact_states(tiny):
    lm, wb = tiny
    ids = _ids(lm)
    surrogate = LinearSurrogate(n_fit=64)
    a = wb.prefix_cache(ids[:2], -1)
    fit = surrogate.fit(wb, a)
    assert surrogate.has_fit(wb, a) and surrogate.fit(wb, wb.prefix_cache(ids[:2], -1)) is fit
    assert not surrogate.has_fit(wb, wb.prefix_cache(ids[:3], -1))
    torch.testing.assert_close(fit.sample_states, wb.step(a, fit.sample).states)
    torch.testing.assert_close(first_token_states(wb, wb.n_layers)[ids[0]], wb.states(ids[:1], -1)[0])


def test_surrogate_shortlist_finds_the_exact_nearest_neighbour_under_noise(tiny):
    """A shortlist of 128 of 512 tokens (96 fitted + 2 x 16 ranked) returns the exact NN's token;
    position 1 (exact_positions = 2) is scored over the whole vocabulary."""
    lm, wb = tiny
    ids = _ids(lm, 8)
    h = wb.states(ids, -1)
    scorer = CandidateScorer(n_fit=96, k_proxy=16, k_prior=0, extra_rounds=0)
    g = torch.Generator().manual_seed(0)
    agree = total = 0
    for t in range(1, len(ids)):
        prefix = wb.prefix_cache(ids[:t], -1)
        every = sweep_states(wb, prefix, chunk=512)
        for _ in range(4):
            observed = h[t] + 0.1 * torch.randn(wb.d, generator=g)
            scored = scorer.score(wb, prefix, observed, None, 0.1)
            size = wb.vocab_size if t < 2 else 128
            assert scored.candidates.numel() == size == scored.candidates.unique().numel()
            torch.testing.assert_close(scored.distances, (every[scored.candidates] - observed).norm(dim=-1))
            agree += int(scored.candidates[scored.distances.argmin()]) == int((every - observed).norm(dim=-1).argmin())
            total += 1
    assert agree / total >= 0.9


def test_shortlist_nearest_neighbour_picks_the_nearest_candidate_it_scored(tiny):
    lm, wb = tiny
    ids = _ids(lm, 8)
    sigma = 0.05
    observed = wb.states(ids, -1) + sigma * torch.randn(len(ids), wb.d, generator=torch.Generator().manual_seed(1))
    nn = NearestNeighbour(stop="shortlist", sigma=sigma, n_fit=96, k_proxy=16)
    inv = nn.invert(observed, wb, -1)
    assert len(nn.last_candidates) == len(ids)
    for t, (token, cands) in enumerate(zip(inv.ids, nn.last_candidates)):
        states = wb.step(wb.prefix_cache(inv.ids[:t], -1), cands).states
        assert token == int(cands[(states - observed[t]).norm(dim=-1).argmin()])
        assert inv.positions[t].candidates_tried == cands.numel()
    assert max(c.numel() for c in nn.last_candidates[2:]) < wb.vocab_size  # a shortlist past the exact positions


def test_bad_surrogate_options_raise():
    with pytest.raises(ValueError, match="ranking"):
        CandidateScorer(ranking="psychic")
    with pytest.raises(ValueError):
        LinearSurrogate(n_fit=1)
    with pytest.raises(TypeError):
        MapDecoder(0.1, k_proxxy=3)
