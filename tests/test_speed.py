"""benchmarks.experiments.speed on a tiny model: the report it writes and what it measures."""

import json

import pytest

from benchmarks.experiments.speed import run_speed


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SIPIT_CACHE_DIR", str(tmp_path / "cache"))


def test_speed_report_with_learned_proposals(tmp_path, one_thread):
    report = run_speed("tiny-llama", n_prompts=2, length=8, layers="first,last", bruteforce_positions_per_layer=1,
                       out=tmp_path / "out")
    assert json.loads((tmp_path / "out" / "speed.json").read_text())["policy"] == "learned"
    assert "rank of the true token" in (tmp_path / "out" / "speed.md").read_text()
    for entry in report["layers"]:
        assert entry["sipit"]["exact_match_rate"] == 1.0
        assert entry["bruteforce"]["correct"]
        assert entry["sipit"]["candidates_per_position"] < entry["bruteforce"]["candidates_per_position"]
        assert not entry["one_time"]["table"]["cached"]  # a fresh cache: built in this run
        assert {h["slot"] for h in entry["one_time"]["heads"]} == {1, 2}
        ranks = entry["proposal_ranks"]
        assert ranks["table (position 0)"]["n"] == 2 and ranks["head + prior"]["n"] == 14
        assert ranks["table (position 0)"]["top1"] == 1.0  # the table holds h_0 itself


def test_speed_without_learned_parts(tmp_path, one_thread):
    report = run_speed("tiny-gpt2", n_prompts=2, length=6, layers="last", bruteforce_positions_per_layer=1,
                       out=tmp_path / "out", policy="gradient")
    (entry,) = report["layers"]
    assert entry["sipit"]["exact_match_rate"] == 1.0
    assert entry["one_time"] == {} and entry["proposal_ranks"] == {}
    assert not (tmp_path / "cache" / "heads").exists()
