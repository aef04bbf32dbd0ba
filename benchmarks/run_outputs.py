"""What a benchmark run writes: results.json, per-position and per-prompt CSVs, plots, the table it
prints, and the flat metrics it logs to MLflow (benchmarks.run fills a :class:`RunState`)."""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.metrics import use_lines



@dataclass
class RunState:
    """What a run has produced so far (saved as partial results on Ctrl-C)."""

    results: dict
    rows: list[dict] = field(default_factory=list)  # per-position
    prompt_rows: list[dict] = field(default_factory=list)  # per-prompt


# --------------------------------------------------------------------------- outputs
def write_outputs(out: Path, state: RunState) -> list[Path]:
    """results.json, per_prompt.csv, per_position.csv, the plots and report.html, in ``out``."""
    from benchmarks import plots, report_html

    out.mkdir(parents=True, exist_ok=True)
    paths = []
    per_position = out / "per_position.csv"
    fields = ["attack", "prompt", "position", "true_token", "recovered_token", "correct", "delta", "noise_norm",
              "ratio", "candidates_tried", "distance", "seconds"]
    with per_position.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        writer.writerows({k: ("" if r.get(k) is None else r.get(k)) for k in fields} for r in state.rows)
    paths.append(per_position)
    per_prompt = out / "per_prompt.csv"
    pfields = ["attack", "prompt", "kind", "exact", "token_accuracy", "truth_text", "recovered_text", "spans",
               "spans_leaked"]
    with per_prompt.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=pfields)
        writer.writeheader()
        writer.writerows({k: "; ".join(v) if isinstance(v, list) else v for k, v in r.items()} for r in state.prompt_rows)
    paths.append(per_prompt)
    title = state.results.get("title", "")
    images = [plots.recovery_vs_ratio(state.rows, out / "recovery_vs_ratio.png", title)]
    margins = state.results.get("margins", {})
    images.append(plots.delta_distribution(margins.get("deltas", []), margins.get("noise_norms_all", []),
                                           out / "delta_distribution.png", title))
    paths += images
    report = out / "report.html"
    report.write_text(report_html.render(state.results, state.rows, images))
    paths.append(report)
    results = out / "results.json"
    results.write_text(json.dumps(state.results, indent=2, default=str))
    paths.append(results)
    return paths


def _above_chance(rate: dict) -> str:
    """``; chance c, above it <= u`` for a rate that carries its chance level (benchmarks.metrics.rates)."""
    if rate.get("excess_upper95") is None or rate.get("chance") is None:
        return ""
    return f"; chance {rate['chance']:.3f}, above it <= {rate['excess_upper95']:.3f}"


def format_table(results: dict) -> str:
    lines = [results.get("title", "")]
    if results.get("noise"):
        from benchmarks.metrics import describe_noise

        lines.append(describe_noise(results["noise"]))
    lines.append("")
    head = f"{'attack':<24} {'decoder':<32} {'exact':>13} {'token acc ± se (n tok/prompts)':>32} {'s/prompt':>9} {'cand/pos':>9}"
    lines += [head, "-" * len(head)]
    for name, s in results.get("attacks", {}).items():
        if "exact_match" not in s:
            lines.append(f"{name:<24} {s.get('decoder', ''):<32} {'(not run: ' + s.get('skipped', '') + ')'}")
            continue
        acc = f"{s['token_accuracy']:.3f} ± {s['token_accuracy_se']:.3f} ({s['n_tokens']}/{s['n_prompts']})"
        exact = f"{s['exact_match']:.2f} ± {s['exact_match_se']:.2f}"
        lines.append(f"{name:<24} {s.get('decoder', '')[:32]:<32} {exact:>13} {acc:>32} "
                     f"{s['seconds_per_prompt']:>9.3g} {s['candidates_per_position']:>9.1f}")
    spans = {name: s for name, s in results.get("attacks", {}).items() if s.get("n_spans")}
    if spans:
        lines.append("private spans leaked verbatim: " + "; ".join(
            f"{name} {round(s['span_recall'] * s['n_spans'])}/{s['n_spans']} (95% upper {s['span_recall_upper95']:.3f})"
            for name, s in spans.items()))
    leak = results.get("leakage") or {}
    if leak:
        lines.append("defence leakage (max over attacks, 95% upper): " + ", ".join(
            f"{name} {r['value']:.3f} by {r['attack']} (<= {r['upper95']:.3f}" + _above_chance(r) + f", n={r['n']})"
            for name, r in leak.items()))
    grouped = {name: s for name, s in results.get("attacks", {}).items() if "group_accuracy" in s}
    if grouped:
        lines.append("tied groups: " + "; ".join(f"{name} recovers the group at {s['group_accuracy']:.3f} of positions, "
                                                 f"the exact member at {s['group_member_accuracy']:.3f} of those; "
                                                 f"{s['tied_member_accuracy']:.3f} of the {s['tied_positions']} positions "
                                                 "whose token is tied with others"
                                                 for name, s in grouped.items()))
    u = results.get("utility") or {}
    if u:
        lines.append(f"defence utility: perplexity {u.get('ppl_clean', float('nan')):.3f} -> {u.get('ppl_served', float('nan')):.3f} "
                     f"({100 * u.get('ppl_rel_increase', 0):+.2f}%), top-1 agreement {u.get('top1_agreement', float('nan')):.3f} "
                     f"on {u.get('n_tokens')} tokens")
        if u.get("continued_ppl") is not None:
            lines.append(f"continued from the exposed states: perplexity {u['continued_ppl']:.3f} "
                         f"({100 * u['continued_ppl_rel_increase']:+.2f}%), top-1 agreement "
                         f"{u['continued_top1_agreement']:.3f}")
    for line in use_lines(u.get("uses") or {}):
        lines.append(line)
    m = results.get("margins") or {}
    if m:
        lines.append(f"margins: median Delta/2 = {m.get('median_half_delta', float('nan')):.4g} "
                     f"({m.get('n_positions', 0)} positions: at position 0 "
                     f"{m.get('median_half_delta_position0', float('nan')):.4g}, at {m.get('n_later_positions', 0)} "
                     f"later positions {m.get('median_half_delta_later', float('nan')):.4g}), "
                     f"median ||n|| = {m.get('median_noise_norm', float('nan')):.4g} "
                     f"(all {m.get('n_noise_positions', 0)} positions)")
    for variant, h in (results.get("heads") or {}).items():
        lines.append(f"head {variant}: train acc {h['train_accuracy']:.3f}, held-out acc {h['heldout_accuracy']:.3f}"
                     + (f" (exposed {h['heldout_accuracy_exposed']:.3f})" if h.get("heldout_accuracy_exposed") is not None else "")
                     + f", {h['n_classes']} classes, coverage of eval tokens {h.get('coverage', float('nan')):.3f}")
    return "\n".join(lines)


def flat_metrics(results: dict) -> dict:
    metrics = {}
    for key in ("ppl_clean", "ppl_served", "ppl_rel_increase", "top1_agreement", "state_rel_l2", "state_cosine",
                "continued_ppl", "continued_ppl_rel_increase", "continued_top1_agreement"):
        value = (results.get("utility") or {}).get(key)
        if value is not None:
            metrics[f"utility.{key}"] = value
    for name, use in ((results.get("utility") or {}).get("uses") or {}).items():
        if use.get("applicable"):
            metrics[f"utility.{name}.loss"] = use.get("loss")
            metrics.update({f"utility.{name}.{k}": v for k, v in (use.get("metrics") or {}).items()})
    m = results.get("margins") or {}
    for key in ("median_half_delta", "median_half_delta_position0", "median_half_delta_later", "median_noise_norm",
                "n_positions", "seconds"):
        if key in m:
            metrics[f"margins.{key}"] = m[key]
    for name, s in results.get("attacks", {}).items():
        for key in ("exact_match", "token_accuracy", "token_accuracy_se", "seconds_per_prompt", "candidates_per_position",
                    "exact_match_upper95", "token_accuracy_upper95", "bag_f1", "bag_f1_upper95", "span_recall",
                    "span_recall_upper95", "n_spans", "token_accuracy_chance", "token_accuracy_excess_upper95",
                    "group_accuracy", "group_member_accuracy",
                    "tied_positions", "tied_member_accuracy"):
            if key in s:
                metrics[f"{name}.{key}"] = s[key]
    for rate, r in (results.get("leakage") or {}).items():
        metrics[f"defence.{rate}"] = r["value"]
        metrics[f"defence.{rate}_upper95"] = r["upper95"]
        if "excess_upper95" in r:
            metrics[f"defence.{rate}_excess_upper95"] = r["excess_upper95"]
    for variant, h in (results.get("heads") or {}).items():
        for key in ("train_accuracy", "heldout_accuracy", "heldout_accuracy_exposed", "coverage"):
            if h.get(key) is not None:
                metrics[f"head_{variant}.{key}"] = h[key]
    return metrics
