"""The whole-vocabulary sweep (sipit.sweep) and the tables the WhiteBox keeps (sipit.vocab_table)."""

from __future__ import annotations

import pytest
import torch

import sipit.vocab_table as vocab_table
from attacks.surrogate import LinearSurrogate
from sipit.memo import is_memoised
from sipit.sweep import sweep, sweep_distances, sweep_states
from sipit.vocab_table import position_zero_table, vocabulary_states
from sipit.whitebox import WhiteBox

pytestmark = pytest.mark.usefixtures("one_thread")


def _ids(lm, n: int = 4) -> list[int]:
    return lm.tokenizer("the quick brown fox jumps over", add_special_tokens=False).input_ids[:n]


@pytest.mark.parametrize("layer", [2, -1])
@pytest.mark.parametrize("prefix_len", [0, 3])
def test_sweep_states_are_the_full_forward_states_of_prefix_plus_v(tiny, layer, prefix_len):
    """mu_{p,v} = Phi^l(p + v)_{|p|}: row v of the sweep is the last state of a plain forward of p + v."""
    lm, wb = tiny
    p = _ids(lm)[:prefix_len]
    table = sweep_states(wb, wb.prefix_cache(p, layer), chunk=100)  # 100 does not divide V: a ragged last chunk
    assert table.shape == (wb.vocab_size, wb.d)
    for v in [0, 1, 99, 100, 257, wb.vocab_size - 1]:
        torch.testing.assert_close(table[v], wb.states(p + [v], layer)[-1], rtol=1e-4, atol=1e-5)


def test_chunk_size_does_not_change_the_result(tiny):
    lm, wb = tiny
    prefix = wb.prefix_cache(_ids(lm, 3), -1)
    whole = sweep_states(wb, prefix, chunk=wb.vocab_size)
    for chunk in (1024, 100, 7):
        torch.testing.assert_close(sweep_states(wb, prefix, chunk=chunk), whole, rtol=1e-5, atol=1e-6)
    target = whole[5] + 0.1
    torch.testing.assert_close(sweep_distances(wb, prefix, target, chunk=33), (whole - target).norm(dim=-1),
                               rtol=1e-5, atol=1e-5)
    for bad in (0, -1):
        with pytest.raises(ValueError):
            sweep_states(wb, prefix, chunk=bad)


def test_a_given_id_set_keeps_its_order(tiny):
    lm, wb = tiny
    prefix = wb.prefix_cache(_ids(lm, 2), 2)
    whole = sweep_states(wb, prefix)
    ids = torch.tensor([400, 3, 5, 3, wb.vocab_size - 1])
    torch.testing.assert_close(sweep_states(wb, prefix, ids=ids, chunk=2), whole[ids], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sweep_distances(wb, prefix, whole[3], ids=ids), (whole[ids] - whole[3]).norm(dim=-1),
                               rtol=1e-5, atol=1e-5)


def test_reducer_sees_every_chunk_once_and_first_moves_its_chunk_to_the_front(tiny):
    lm, wb = tiny
    p = _ids(lm, 2)
    prefix = wb.prefix_cache(p, -1)
    token = 300
    seen = sweep(wb, prefix, lambda ids, batch: (ids.clone(), batch), chunk=128, first=token)
    assert token in seen[0][0].tolist() and [len(ids) for ids, _ in seen] == [128] * 4
    assert sorted(torch.cat([ids for ids, _ in seen]).tolist()) == list(range(wb.vocab_size))
    # A batch's extended cache is the cache of p + v: stepping on it equals stepping on a fresh one.
    ids, batch = seen[0]
    at = int((ids == token).nonzero()[0])
    nxt = torch.tensor([7, 11])
    torch.testing.assert_close(wb.step(batch.extended(at), nxt).states,
                               wb.step(wb.prefix_cache(p + [token], -1), nxt).states, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError):
        sweep(wb, prefix, lambda ids, batch: None, ids=torch.tensor([1, 2]), first=3)


def test_vocabulary_tables_are_held_by_the_whitebox_in_a_bounded_lru(tiny, monkeypatch, tmp_path):
    monkeypatch.setenv("SIPIT_CACHE_DIR", str(tmp_path))  # the position-0 tables go to disk
    lm, _ = tiny
    wb = WhiteBox(lm.model)  # a fresh owner: nothing memoised yet
    monkeypatch.setattr(vocab_table, "TABLE_MEMO_SIZE", 2)
    ids = _ids(lm, 4)
    prefixes = [wb.prefix_cache(ids[:n], -1) for n in (1, 2, 3)]
    first = vocabulary_states(wb, prefixes[0])
    assert vocabulary_states(wb, wb.prefix_cache(ids[:1], -1)) is first  # a hit, by prefix tokens
    torch.testing.assert_close(first, sweep_states(wb, prefixes[0]), rtol=1e-5, atol=1e-6)
    for prefix in prefixes[1:]:
        vocabulary_states(wb, prefix)
    assert list(wb.memo["vocabulary-states"]) == [(wb.n_layers, tuple(ids[:2])), (wb.n_layers, tuple(ids[:3]))]
    # The empty prefix is the position-0 table, not another entry.
    assert vocabulary_states(wb, wb.prefix_cache([], -1)) is position_zero_table(wb, -1, use_disk=False).states
    assert len(wb.memo["vocabulary-states"]) == 2
    # Another WhiteBox of the same model owns its own memo: no module-level cache is shared.
    other = WhiteBox(lm.model)
    surrogate = LinearSurrogate(n_fit=32)
    surrogate.fit(wb, prefixes[0])
    assert surrogate.has_fit(wb, prefixes[0]) and not surrogate.has_fit(other, prefixes[0])
    assert is_memoised(wb, "surrogate-design", wb.n_layers) and not other.memo
