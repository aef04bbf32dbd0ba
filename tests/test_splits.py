"""The dev/test split of the prompt sets: disjoint, stable, the run reads test, what tunes refuses test."""

from __future__ import annotations

import json

import pytest

from benchmarks import run as bench
from benchmarks import search
from benchmarks.prompts import NATURAL_FILE, SplitRefused, check_split, prompt_set, read_texts, split_lines
from benchmarks.search import SearchUsageError
from sipit.models import load_model


@pytest.fixture(scope="module")
def tokenizer():
    return load_model("tiny-llama").tokenizer


def test_the_splits_share_no_natural_prompt_and_no_random_draw(tokenizer):
    texts = read_texts(NATURAL_FILE)
    dev, test = split_lines(texts, "dev"), split_lines(texts, "test")
    assert not set(dev) & set(test) and sorted(dev + test) == sorted(texts)
    assert split_lines(texts + ["an appended prompt"], "dev")[: len(dev)] == dev  # appending moves nothing
    sets = {s: prompt_set(tokenizer, 12, length=8, seed=0, natural_fraction=0.5, split=s) for s in ("dev", "test")}
    natural = {s: {p.text for p in ps if p.kind == "natural"} for s, ps in sets.items()}
    random = {s: [p.ids for p in ps if p.kind == "random"] for s, ps in sets.items()}
    assert natural["dev"] <= set(dev) and natural["test"] <= set(test)
    assert len(random["dev"]) == len(random["test"]) == 6 and not set(map(tuple, random["dev"])) & set(map(tuple, random["test"]))
    assert prompt_set(tokenizer, 12, length=8, seed=0, natural_fraction=0.5, split="test") == sets["test"]  # seeded


def test_a_command_that_tunes_refuses_the_test_split():
    assert check_split("test", tunes=False) == "test"
    with pytest.raises(SplitRefused, match="dev split only.*--split test"):
        check_split("test", tunes=True, command="the search")
    with pytest.raises(ValueError, match="split must be one of dev, test"):
        check_split("train", tunes=False)
    with pytest.raises(SearchUsageError, match="the search chooses options by reading the prompts"):
        search.make_config(model="tiny-llama", layer=-1, families="noise", mode="constrained", threshold=0.1, seed=0,
                           prompts="mixed", n_prompts=1, length=4, utility_tokens=32, attacks="sipit", budget=None,
                           sigma_low=0.1, sigma_high=1.0, tying_method="rare", experiment="e", split="test")


def test_the_run_reads_the_test_split_by_default_and_records_it(tmp_path):
    argv = ["--model", "tiny-llama", "--prompts", "natural", "--n-prompts", "2", "--length", "6", "--attacks", "sipit",
            "--utility-tokens", "0", "--margin-positions", "0", "--no-progress", "--no-tracking"]
    assert bench.main(argv + ["--out", str(tmp_path / "t")]) == 0
    assert bench.main(argv + ["--split", "dev", "--out", str(tmp_path / "d")]) == 0
    test_lines = set(split_lines(read_texts(NATURAL_FILE), "test"))
    for name, split in (("t", "test"), ("d", "dev")):
        results = json.loads((tmp_path / name / "results.json").read_text())
        assert results["config"]["split"] == split
        truths = [p["truth_text"] for p in results["prompts"]]
        inside = [any(line.startswith(t) for line in test_lines) for t in truths]
        assert all(inside) if split == "test" else not any(inside)
