"""Smoke tests of the experiment scripts (benchmarks/experiments/) on a tiny model, through their CLIs.

Each runs its command-line entry in process with the smallest sizes, and checks what it writes
and one property its report rests on (at sigma = 0 the shortlist noise decoders are exact, margins are
positive, the same-model attacker of int8 serving is exact, exposure-only noise costs no
perplexity). benchmarks.experiments.speed has its own file (tests/test_speed.py).
"""

from __future__ import annotations

import json
import os

import pytest

from benchmarks.experiments import defense_report, gap, margins_table, noise, quant_recovery


def test_noise_decoders_exact_at_sigma_zero_and_report_written(tmp_path):
    out = tmp_path / "noise"
    code = noise.main(["--model", "tiny-llama", "--sigmas", "0,1", "--n-prompts", "2", "--length", "3",
                       "--exact-prompts", "1", "--exact-positions", "2", "--draws", "1", "--n-fit", "64",
                       "--k-proxy", "16", "--k-prior", "8", "--k-grad", "8", "--refine-k", "4", "--out", str(out)])
    assert code == 0
    assert {"noise.json", "noise.md", "noise.png"} <= {p.name for p in out.iterdir()}
    result = json.loads((out / "noise.json").read_text())
    # the refined beam also records its search's own path, and the summary that path's accuracy
    beam_rows = [r for r in result["free"] if r["decoder"] == "beam"]
    assert beam_rows and all("searched" in r for r in beam_rows)
    assert not any("searched" in r for r in result["free"] if r["decoder"] != "beam")
    for row in result["summary"]["by_sigma"]:
        rows = [r for r in beam_rows if r["sigma"] == row["sigma"]]
        assert row["beam_searched"] == pytest.approx(sum(r["searched"] == r["true"] for r in rows) / len(rows))
    assert "beam before refine" in (out / "noise.md").read_text()
    zero = [r for r in result["free"] if r["sigma"] == 0]
    assert {r["decoder"] for r in zero} == set(noise.DECODERS)
    # the shortlist decoders are exact at sigma = 0; the radius stop is capped at k_prior + k_grad = 16
    # candidates here (its cap in this study), so it may stop on the nearest of too few
    assert all(r["correct"] for r in zero if r["decoder"] != "nn-heuristic"), [r for r in zero if not r["correct"]]
    assert all(r["candidates"] <= 16 for r in zero if r["decoder"] == "nn-heuristic")
    assert all(r["delta"] > 0 for r in result["exact"])
    # every decoded path carries its energy and the truth's under the decoder's own score; a correct path is the truth
    paths: dict = {}
    for r in result["free"]:
        paths.setdefault((r["decoder"], r["sigma"], r["prompt"]), []).append(r)
    for path in paths.values():
        assert len({(r["energy"], r["true_energy"]) for r in path}) == 1
        assert (path[0]["energy"] == path[0]["true_energy"]) >= all(r["correct"] for r in path)
    for row in result["summary"]["by_sigma"]:
        for name in noise.DECODERS:
            wrong = {r["prompt"] for r in result["free"] if r["decoder"] == name and r["sigma"] == row["sigma"]
                     and not r["correct"]}
            assert row[name + "_posterior_errors"] + row[name + "_search_errors"] == len(wrong)
            assert len(row[name + "_by_position"]) == 3  # equal positions per prompt: their mean is the rate
            assert sum(row[name + "_by_position"]) / 3 == pytest.approx(row[name])
    noise.plot({**result["summary"], "by_ratio": []}, tmp_path / "free-only.png", "no exact part")  # by position
    assert (tmp_path / "free-only.png").stat().st_size > 0
    # --rescore recomputes the same energies from the written run, decoding nothing
    assert noise.main(["--rescore", str(out / "noise.json"), "--out", str(tmp_path / "again")]) == 0
    again = json.loads((tmp_path / "again" / "noise.json").read_text())
    assert [e for r in again["free"] for e in (r["energy"], r["true_energy"])] == pytest.approx(
        [e for r in result["free"] for e in (r["energy"], r["true_energy"])], rel=1e-9)
    with pytest.raises(SystemExit) as exited:  # not a run's noise.json: one error line, exit code 2
        noise.main(["--rescore", str(out / "noise.md"), "--out", str(tmp_path / "bad")])
    assert exited.value.code == 2
    assert not (tmp_path / "bad").exists()


def test_an_interrupted_noise_run_keeps_its_finished_prompts_and_the_same_command_finishes_it(tmp_path, monkeypatch):
    out = tmp_path / "noise"

    def argv(folder, length="3"):
        return ["--model", "tiny-llama", "--sigmas", "1", "--n-prompts", "3", "--length", length, "--exact-prompts",
                "0", "--decoders", "map", "--n-fit", "64", "--k-proxy", "16", "--k-prior", "8", "--k-grad", "8",
                "--out", str(folder)]

    real, draws = noise.free_noise, []

    def drawn(h, sigma, seed, sigma_index, prompt):  # the noise of one (sigma, prompt): decoding it starts here
        draws.append(prompt)
        if prompt == stop_at:
            raise KeyboardInterrupt
        return real(h, sigma, seed, sigma_index, prompt)

    monkeypatch.setattr(noise, "free_noise", drawn)
    stop_at = 2
    assert noise.main(argv(out)) == 130
    assert not (out / "noise.json").exists()
    kept = json.loads((out / noise.PROGRESS_FILE).read_text())["rows"]
    assert sorted({r["prompt"] for r in kept}) == [0, 1] and len(kept) == 6
    draws.clear()
    stop_at = None
    assert noise.main(argv(out)) == 0
    assert draws == [2, 0, 1, 2]  # only prompt 2 is decoded again; then every path's energy is scored
    assert sorted(p.name for p in out.iterdir()) == ["noise.json", "noise.md", "noise.png"]  # no progress, no partial
    umask = os.umask(0)
    os.umask(umask)
    assert (out / "noise.json").stat().st_mode & 0o777 == 0o666 & ~umask  # written atomically, mode as open() gives
    resumed = json.loads((out / "noise.json").read_text())["free"]
    assert noise.main(argv(tmp_path / "whole")) == 0
    whole = json.loads((tmp_path / "whole" / "noise.json").read_text())["free"]
    assert [{k: v for k, v in r.items() if k != "seconds"} for r in resumed] == \
        [{k: v for k, v in r.items() if k != "seconds"} for r in whole]
    # an unfinished run is never mixed with rows of other options: one error line, exit code 2, nothing written
    stop_at = 1
    assert noise.main(argv(tmp_path / "other")) == 130
    stop_at = None
    with pytest.raises(SystemExit) as exited:
        noise.main(argv(tmp_path / "other", length="2"))
    assert exited.value.code == 2
    assert not (tmp_path / "other" / "noise.json").exists()
    assert (tmp_path / "other" / noise.PROGRESS_FILE).exists()


def test_gap_is_below_the_tolerance_it_derives(capsys):
    table = gap.measure_gaps("tiny-llama", "first,last", n_prompts=1, length=6)
    assert len(table) == 2
    for row in table.values():
        assert 0 <= row["median_gap"] <= row["max_gap"] < row["derived_rel_tol"]
    assert gap.main(["--model", "tiny-llama", "--layers", "last", "--n-prompts", "1"]) == 0
    assert "| layer | max rel. gap" in capsys.readouterr().out


def test_margins_table_writes_positive_margins(tmp_path):
    assert margins_table.main(["--model", "tiny-llama", "--layers", "first,last", "--positions", "2",
                               "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "margins.json").read_text())["rows"]
    assert [r["positions"] for r in rows] == [2, 2]
    assert all(0 < r["delta_min"] <= r["delta_median"] <= r["delta_max"] for r in rows)
    assert (tmp_path / "margins.md").read_text().startswith("| layer |")


def test_quant_recovery_same_4bit_model_is_exact_at_the_served_shape(tmp_path):
    assert quant_recovery.main(["--model", "tiny-llama", "--layers", "4", "--kinds", "int8,fp4", "--n-prompts", "2",
                                "--length", "12", "--policy", "gradient", "--shortlist", "16",
                                "--margin-positions", "2", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "quant_recovery.json").read_text())
    assert [(r["kind"], r["layer"], r["served_shape"]) for r in rows] == [("int8", 4, True), ("fp4", 4, True)]
    for row in rows:
        assert row["same"]["exact"] == 2 and row["same"]["token_acc"] == 1.0 and row["same"]["verified"]
        assert 0 <= row["mismatch_fp32"]["token_acc"] <= 1 and row["mismatch_fp32"]["tokens"] == 24
        assert len(row["margins_quant"]["deltas"]) == 4 and all(d > 0 for d in row["margins_quant"]["deltas"].values())
        assert row["margins_quant"]["deltas"].keys() == row["margins_fp32"]["deltas"].keys()
    assert (tmp_path / "quant_recovery.md").read_text().startswith("| layer | weights |")


def test_quant_recovery_refuses_an_unknown_format_before_writing(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        quant_recovery.main(["--model", "tiny-llama", "--kinds", "int9", "--out", str(tmp_path / "q")])
    assert exit_info.value.code == 2 and "int9" in capsys.readouterr().err
    assert not (tmp_path / "q").exists()


def test_defense_report_prices_exposure_noise_by_its_use_not_by_the_served_model(tmp_path):
    assert defense_report.main(["--model", "tiny-llama", "--layer", "2", "--n-tokens", "64",
                                "--only", "none,noise", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "report.json").read_text())
    assert [r["defense"] for r in rows] == ["none"] + ["noise"] * 6
    for row in rows:
        exposure_only = row["defense"] == "none" or "placement=exposure" in row["setting"]
        assert (row["ppl_rel_increase"] == 0) == exposure_only, row
    loud = next(r for r in rows if r["setting"] == "sigma=1.0, relative_to=rms, placement=exposure")
    assert loud["uses"]["continued"]["loss"] > 0.01  # free for the served model, not for inference continued from it
    report = (tmp_path / "report.md").read_text()
    assert "| defence | setting |" in report and "continued: ppl rel. increase" in report
    line = next(x for x in report.splitlines() if "sigma=1.0, relative_to=rms, placement=exposure" in x)
    assert f"{loud['uses']['continued']['loss']:+.3f}" in line and line.count("n/a") == 0


def test_noise_options_reach_the_beam_and_its_shortlist():
    """--early-width, --early-positions and --table-positions set the beam's early width, how many positions it
    covers and the positions scored over the whole vocabulary, --refine-k its refinement; unset, the beam keeps
    --width throughout, the ranking's own default and no refinement."""
    parse = noise.build_parser().parse_args
    (beam,) = noise.decoders(1.0, parse(["--decoders", "beam", "--width", "4", "--early-width", "32",
                                         "--table-positions", "2", "--ranking", "learned+surrogate"]))
    assert [beam.width_at(t) for t in range(4)] == [32, 32, 4, 4] and beam.scorer.exact_positions == 2
    (beam,) = noise.decoders(1.0, parse(["--decoders", "beam", "--width", "4", "--ranking", "learned+surrogate"]))
    assert [beam.width_at(t) for t in range(4)] == [4, 4, 4, 4] and beam.scorer.exact_positions == 1
    assert beam.refine_k == 0
    (beam,) = noise.decoders(1.0, parse(["--decoders", "beam", "--width", "4", "--early-width", "32",
                                         "--early-positions", "3", "--refine-k", "8"]))
    assert [beam.width_at(t) for t in range(5)] == [32, 32, 32, 4, 4] and beam.refine_k == 8
