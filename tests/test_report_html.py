"""The run's HTML report (benchmarks.report_html) rendered from a real tiny run: every position shown,
right and wrong tokens marked as the per-position results say, private spans underlined and the
leaked ones named, plots inlined."""

from __future__ import annotations

import csv
import html
import json
import re

from benchmarks import run as bench


def test_report_marks_each_recovered_and_wrong_token_as_the_results_say(tmp_path):
    out = tmp_path / "run"
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Bob is 42 and lives in Leeds.\nAnna paid 17 dollars to Carl.\n")
    (tmp_path / "prompts.txt.spans.json").write_text(json.dumps({
        "Bob is 42 and lives in Leeds.": [{"kind": "name", "text": "Bob"}, {"kind": "number", "text": "42"}],
        "Anna paid 17 dollars to Carl.": [{"kind": "name", "text": "Anna"}, {"kind": "number", "text": "17"}]}))
    assert bench.main(["--model", "tiny-gpt2", "--prompts", str(prompts), "--n-prompts", "2", "--length", "6",
                       "--defense", "noise", "--sigma-rel", "1", "--robust", "radius", "--attacks", "sipit",
                       "--utility-tokens", "64",
                       "--margin-positions", "2", "--no-tracking", "--no-progress", "--out", str(out)]) == 0
    page = (out / "report.html").read_text()
    results = json.loads((out / "results.json").read_text())
    rows = list(csv.DictReader((out / "per_position.csv").open()))
    right = sum(r["correct"] == "1" for r in rows)
    assert 0 < right < len(rows)  # noise at 1 x RMS: some tokens leak, some do not
    assert page.count('class="tok ok"') - 1 == right  # minus the legend's sample
    assert page.count('class="tok wrong"') - 1 == len(rows) - right
    truth_marks = re.findall(r'class="tok truth( private)?" title', page)
    assert len(truth_marks) == len(rows)
    underlined = sum(len(p["span_positions"]) for p in results["prompts"])
    assert 0 < underlined == sum(bool(m) for m in truth_marks)
    sipit_rows = {int(r["prompt"]): r for r in csv.DictReader((out / "per_prompt.csv").open())}
    for prompt in results["prompts"]:
        assert prompt["spans"], prompt  # each prompt's spans lie in its first 6 tokens
        leaked = prompt["spans_leaked"]["sipit"]
        # a span leaks exactly when its text is in the recovered text
        assert leaked == [s for s in prompt["spans"] if s in sipit_rows[prompt["index"]]["recovered_text"]]
        line = (f"leaked {len(leaked)}/{len(prompt['spans'])} private spans: {html.escape(', '.join(leaked))}"
                if leaked else f"0/{len(prompt['spans'])} private spans leaked")
        assert line in page
    for prompt in results["prompts"]:
        for token in prompt["truth_ids"]:
            shown = results["token_text"][str(token)].replace(" ", "·").replace("\n", "⏎")
            assert f'title="id {token}">{html.escape(shown)}</span>' in page
    store = results["utility"]["uses"]["embedding_store"]["metrics"]
    assert f"recall@1 of defended queries {store['mean_recall_at_1']:.3f} (mean-pooled)" in page  # every use priced
    assert "linear probes: accuracy" in page
    sipit = results["attacks"]["sipit"]
    assert f"{sipit['token_accuracy']:.3f} ± {sipit['token_accuracy_se']:.3f}" in page
    assert len(re.findall(r'src="data:image/png;base64,[A-Za-z0-9+/=]{100,}"', page)) == 2
