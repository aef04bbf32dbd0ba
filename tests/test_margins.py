"""Margins Delta_t: equal to a brute-force reference of full forwards; the robustness theorem."""

from __future__ import annotations

import pytest
import torch

from attacks.robust import NearestNeighbour
from sipit.margins import margin_from_distances, margin_from_states, margins, position_margin
from sipit.sweep import sweep_distances, sweep_states


pytestmark = pytest.mark.usefixtures("one_thread")


def prompt(lm, n=5):
    return lm.tokenizer("the quick brown fox jumps over", add_special_tokens=False).input_ids[:n]


@pytest.mark.parametrize("layer", [2, -1])
def test_margins_equal_bruteforce_full_forwards(tiny, layer):
    lm, wb = tiny
    ids = prompt(lm, 4)
    m = margins(wb, ids, layer, chunk=100)  # chunk not dividing V exercises the ragged last chunk
    assert m.delta.shape == (4,) and m.true_states.shape == (4, wb.d)
    for t in range(len(ids)):
        # Reference: one full (uncached, unbatched) forward per candidate prompt p_t + v.
        ref = torch.stack([wb.states(ids[:t] + [v], layer)[-1] for v in range(wb.vocab_size)])
        d = (ref - ref[ids[t]]).norm(dim=-1)
        d[ids[t]] = float("inf")
        assert float(m.delta[t]) == pytest.approx(float(d.min()), rel=1e-4, abs=1e-6)
        # The competitor attains the minimum (ties within float noise are allowed).
        assert float(d[int(m.competitor[t])]) == pytest.approx(float(d.min()), rel=1e-4, abs=1e-6)
        assert int(m.competitor[t]) != ids[t]
        torch.testing.assert_close(m.true_states[t], ref[ids[t]], rtol=1e-4, atol=1e-5)
    assert m.to_dict()["delta"] == m.delta.tolist()


def test_sweep_distances_do_not_depend_on_chunking(tiny):
    lm, wb = tiny
    ids = prompt(lm, 3)
    prefix = wb.prefix_cache(ids, -1)
    target = torch.randn(wb.d, generator=torch.Generator().manual_seed(0))
    a = sweep_distances(wb, prefix, target, chunk=512)
    b = sweep_distances(wb, prefix, target, chunk=77)
    assert a.shape == (wb.vocab_size,)
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError):
        sweep_distances(wb, prefix, target, chunk=0)


def test_every_form_of_delta_agrees_with_margins(tiny):
    """position_margin on a prefix cache, margin_from_states on a table and margin_from_distances on
    a distance vector give margins()'s Delta_t and competitor."""
    lm, wb = tiny
    ids = prompt(lm, 3)
    m = margins(wb, ids, 2, chunk=128)
    for t in range(len(ids)):
        prefix = wb.prefix_cache(ids[:t], 2)
        one = position_margin(wb, prefix, ids[t], chunk=100)
        assert one.delta == pytest.approx(float(m.delta[t]), rel=1e-5) and one.competitor == int(m.competitor[t])
        torch.testing.assert_close(one.true_state, m.true_states[t], rtol=1e-5, atol=1e-6)
        assert one.extended.tokens == tuple(ids[: t + 1])
        delta, competitor = margin_from_states(sweep_states(wb, prefix), ids[t])
        assert delta == pytest.approx(float(m.delta[t]), rel=1e-5) and competitor == int(m.competitor[t])
        dist = sweep_distances(wb, prefix, m.true_states[t])
        before = dist.clone()
        assert margin_from_distances(dist, ids[t])[1] == int(m.competitor[t])
        assert torch.equal(dist, before)  # the caller's vector is left as it was


def test_theorem_is_tight_toward_the_nearest_competitor(tiny):
    """Noise of norm 0.49 Delta toward the competitor is decoded correctly; 0.51 Delta is not."""
    lm, wb = tiny
    ids = prompt(lm, 4)
    m = margins(wb, ids, -1)
    for t in range(len(ids)):
        prefix = wb.prefix_cache(ids[:t], -1)
        direction = wb.step(prefix, m.competitor[t : t + 1]).states[0] - m.true_states[t]
        direction = direction / direction.norm()
        for scale, recovered in [(0.49, True), (0.51, False)]:
            observed = m.true_states[t] + scale * float(m.delta[t]) * direction
            dist = sweep_distances(wb, prefix, observed)
            assert (int(dist.argmin()) == ids[t]) is recovered


def test_theorem_holds_at_every_position_under_gaussian_noise(tiny):
    """Every position with a correct decoded prefix and ||n_t|| < Delta_t / 2 is recovered by NN."""
    lm, wb = tiny
    ids = prompt(lm, 6)
    m = margins(wb, ids, -1)
    h = wb.states(ids, -1)
    checked = violated = 0
    generator = torch.Generator().manual_seed(1)
    for sigma_rel in [0.05, 0.15, 0.3, 0.6]:  # sigma * sqrt(d) as a fraction of the mean Delta
        sigma = sigma_rel * float(m.delta.mean()) / wb.d**0.5
        noise = sigma * torch.randn(h.shape, generator=generator)
        inv = NearestNeighbour(stop="exact", sigma=sigma).invert(h + noise, wb, -1)
        for t in range(len(ids)):
            prefix_ok = inv.ids[:t] == ids[:t]
            # m.true_states and h differ by the cached-vs-full float gap; count it against the bound.
            norm = float((h[t] + noise[t] - m.true_states[t]).norm())
            if prefix_ok and norm < float(m.delta[t]) / 2:
                checked += 1
                violated += inv.ids[t] != ids[t]
    assert checked >= 6
    assert violated == 0


def test_collision_audit_matches_direct_pairwise_and_extension(tiny):
    from sipit.audit import audit, extension_min

    lm, wb = tiny
    texts = ["the cat", "the dog", "a cat sat", "the cat"]  # a duplicate prompt is audited once
    prompts = [lm.tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    (row,) = audit(wb, prompts, [-1], pairs=1, chunk=128)
    assert row.n_prompts == 3
    last = [wb.states(p, -1)[-1] for p in prompts[:3]]
    direct = min(float((last[i] - last[j]).norm()) for i in range(3) for j in range(i + 1, 3))
    assert row.min_distance == pytest.approx(direct, rel=1e-5)
    a, b = (prompts[k] for k in row.closest_pair)
    ext = min(float((wb.states(a + [v], -1)[-1] - wb.states(b + [v], -1)[-1]).norm()) for v in range(wb.vocab_size))
    assert row.extension_min == pytest.approx(ext, rel=1e-3, abs=1e-6)
    assert extension_min(wb, a, b, -1)[0] == pytest.approx(row.extension_min, rel=1e-4)


def test_stored_margins_equal_the_computed_ones_survive_damage_and_never_cross_layers(tiny, tmp_path, monkeypatch):
    from sipit.margin_store import store_path, stored_margin

    monkeypatch.setenv("SIPIT_CACHE_DIR", str(tmp_path))
    _, wb = tiny
    ids = [5, 17, 42, 99]
    exact = float(margins(wb, ids, 2).delta[3])
    calls = []

    def compute():
        calls.append(1)
        return position_margin(wb, wb.prefix_cache(ids[:3], 2), ids[3]).delta

    assert stored_margin(wb, 2, ids, compute) == pytest.approx(exact, rel=1e-6)
    assert stored_margin(wb, 2, ids, compute) == pytest.approx(exact, rel=1e-6) and len(calls) == 1  # from disk
    assert store_path(wb, 1) != store_path(wb, 2)
    assert stored_margin(wb, 1, ids, lambda: -1.0) == -1.0  # another layer never reads layer 2's entry
    store_path(wb, 2).write_text("{not json")
    assert stored_margin(wb, 2, ids, compute) == pytest.approx(exact, rel=1e-6) and len(calls) == 2  # recomputed
