"""A sweep: the benchmark run over several defence settings, one parent MLflow run, one table, curves.

    python -m benchmarks.run --defense noise --sigma 0.1,3,10,30,100
    python -m benchmarks.run --defense noise:sigma=1|10,placement=model|exposure

benchmarks.config.sweep_configs expands the options into one RunConfig per setting; each runs with
benchmarks.benchmark.run_benchmark into ``--out/<config hash>/`` (its own results.json, CSVs, plots), its
MLflow run nested under the sweep's parent run (attack runs under it, as in a single run). After
every setting the sweep writes ``sweep.json``, ``sweep.md`` (one row per setting and attack) and
``sweep.png`` (token accuracy +- its prompt-clustered se against the swept parameter, per attack;
utility beside it), so an interrupted sweep leaves what it finished. A rerun with the same
options skips every setting whose results.json says ``finished`` (keyed by the configuration
hash) and runs the rest.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from dataclasses import replace
from pathlib import Path

from benchmarks.cli import default_out_dir
from benchmarks.out_dir import claim
from benchmarks.config import RunConfig, parse_spec

SUMMARY_KEYS = ("exact_match", "exact_match_se", "exact_match_upper95", "token_accuracy", "token_accuracy_se",
                "token_accuracy_upper95", "bag_f1", "span_recall", "span_recall_upper95", "n_spans",
                "candidates_per_position", "seconds_per_prompt")
UTILITY_KEYS = ("ppl_rel_increase", "top1_agreement", "continued_ppl_rel_increase", "continued_top1_agreement")


def sweep_hash(configs: list[RunConfig]) -> str:
    return hashlib.sha256("|".join(c.hash() for c in configs).encode()).hexdigest()[:12]


def swept_values(configs: list[RunConfig]) -> list[dict]:
    """Per config, the defence parameters that differ across the sweep (``{"noise.sigma": 0.1}``)."""
    params = [{f"{name}.{k}": v for name, p in map(parse_spec, c.defenses) for k, v in p.items()} for c in configs]
    varying = sorted({k for p in params for k in p if len({str(q.get(k)) for q in params}) > 1})
    return [{k: p.get(k) for k in varying} for p in params]


def _label(values: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in values.items()) or "-"


def sweep_rows(settings: list[dict]) -> list[dict]:
    """One row per (setting, attack): the swept values, the attack's rates and the setting's utility."""
    rows = []
    for s in settings:
        utility = {k: (s["results"].get("utility") or {}).get(k) for k in UTILITY_KEYS}
        uses = (s["results"].get("utility") or {}).get("uses") or {}
        utility.update({f"{name}_loss": (uses.get(name) or {}).get("loss") for name in ("embedding_store", "probing")})
        for attack, summary in s["results"].get("attacks", {}).items():
            rows.append({"setting": _label(s["values"]), **s["values"], "attack": attack,
                         "decoder": summary.get("decoder"), **{k: summary.get(k) for k in SUMMARY_KEYS}, **utility,
                         "config_hash": s["config_hash"], "status": s["results"].get("status")})
    return rows


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def sweep_table(rows: list[dict]) -> str:
    """Markdown: a row per setting and attack, the metrics with their units."""
    lines = ["| setting | attack | exact match | token accuracy ± se | token acc. upper 95% | bag-of-tokens F1 "
             "| private spans leaked (upper 95%) | ppl increase (served) | ppl increase (continued from exposed) "
             "| store recall@1 lost | probe accuracy lost |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("token_accuracy") is None:
            lines.append(f"| {r['setting']} | {r['attack']} | (not run) | | | | | | | | |")
            continue
        spans = (f"{_fmt(r.get('span_recall'), '.2f')} of {r['n_spans']} ({_fmt(r.get('span_recall_upper95'), '.2f')})"
                 if r.get("n_spans") else "-")
        lines.append(f"| {r['setting']} | {r['attack']} | {_fmt(r['exact_match'], '.2f')} | "
                     f"{r['token_accuracy']:.3f} ± {_fmt(r['token_accuracy_se'], '.3f')} | "
                     f"{_fmt(r['token_accuracy_upper95'], '.3f')} | {_fmt(r['bag_f1'], '.3f')} | {spans} | "
                     f"{_fmt(r['ppl_rel_increase'], '+.2%')} | {_fmt(r['continued_ppl_rel_increase'], '+.2%')} | "
                     f"{_fmt(r.get('embedding_store_loss'), '.3f')} | {_fmt(r.get('probing_loss'), '.3f')} |")
    return "\n".join(lines)


def noise_to_margin(results: dict) -> float | None:
    """A setting's median ||n|| / median (Delta/2): where its noise sits against the margin (None
    without noise or margins)."""
    m = results.get("margins") or {}
    norm, half = m.get("median_noise_norm"), m.get("median_half_delta")
    ok = all(isinstance(v, (int, float)) and math.isfinite(v) for v in (norm, half))
    return norm / half if ok and norm > 0 and half > 0 else None


def _accuracy_curves(ax, settings: list[dict], rows: list[dict], xs: list) -> None:
    """Token accuracy (+- se) of every attack at the settings' ``xs`` (None: left out)."""
    for attack in dict.fromkeys(r["attack"] for r in rows):
        mine = {r["config_hash"]: r for r in rows if r["attack"] == attack and r.get("token_accuracy") is not None}
        pts = [(x, mine[s["config_hash"]]) for x, s in zip(xs, settings) if s["config_hash"] in mine and x is not None]
        if pts:
            ax.errorbar([x for x, _ in pts], [r["token_accuracy"] for _, r in pts], capsize=3, marker="o",
                        yerr=[r["token_accuracy_se"] or 0 for _, r in pts], label=attack)
    ax.set_ylim(-0.05, 1.05)
    ax.set_ylabel("token accuracy (± prompt-clustered se)")


def sweep_plot(settings: list[dict], rows: list[dict], path: Path, title: str) -> Path:
    """Token accuracy (+- se) per attack against the swept parameter and against median ||n|| / (Delta/2)
    of each setting (when the settings add noise), and the utility cost beside them."""
    from benchmarks.plots import plt

    keys = list(settings[0]["values"]) if settings else []
    numeric = len(keys) == 1 and all(isinstance(s["values"][keys[0]], (int, float)) for s in settings)
    xs = [s["values"][keys[0]] for s in settings] if numeric else list(range(len(settings)))
    ratios = [noise_to_margin(s["results"]) for s in settings]
    panels = 3 if any(r is not None for r in ratios) else 2
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4.2))
    left, right = axes[0], axes[-1]
    _accuracy_curves(left, settings, rows, xs)
    if panels == 3:
        middle = axes[1]
        _accuracy_curves(middle, settings, rows, ratios)
        middle.axvline(1.0, color="grey", linestyle="--", linewidth=1)
        middle.set_xscale("log")
        middle.set_xlabel("median ||n|| / median (Delta/2) of the setting (dashed: 1, the margin)")
        middle.set_title("recovery against the noise-to-margin ratio")
        middle.legend(fontsize=8)
    for key, label in (("ppl_rel_increase", "served model"), ("continued_ppl_rel_increase", "continued from exposed")):
        util = [(x, (s["results"].get("utility") or {}).get(key)) for x, s in zip(xs, settings)]
        util = [(x, 100 * u) for x, u in util if u is not None]
        if util:
            right.plot([x for x, _ in util], [u for _, u in util], marker="s", label=label)
    for ax in (left, right):
        if numeric:
            ax.set_xlabel(keys[0])
            if min(xs) > 0 and max(xs) / min(xs) >= 10:
                ax.set_xscale("log")
        else:
            ax.set_xticks(xs, [_label(s["values"]) for s in settings], rotation=20, fontsize=7)
        if ax.get_lines():
            ax.legend(fontsize=8)
    if not right.get_lines():  # e.g. --utility-tokens 0
        right.text(0.5, 0.5, "perplexity not measured in this sweep", ha="center", va="center",
                   transform=right.transAxes)
    right.set_ylabel("perplexity increase (%)")
    if any(abs(y) > 100 for line in right.get_lines() for y in line.get_ydata()):
        right.set_yscale("symlog", linthresh=1)  # noise can raise perplexity by orders of magnitude
        right.set_ylim(bottom=-1)
    left.set_title(title)
    right.set_title("utility cost")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _finished(out: Path) -> dict | None:
    try:
        results = json.loads((out / "results.json").read_text())
    except (OSError, ValueError):
        return None
    return results if results.get("status") == "finished" else None


def run_sweep(configs: list[RunConfig], *, progress: bool = True, log=print) -> dict:
    """Run every config of a sweep (module docstring); return the sweep's summary dict."""
    from benchmarks.benchmark import check_against_model, load_for

    for config in configs:
        config.validate()  # every setting's options are checked before the first one runs
    first = configs[0]
    loaded, clean_wb = load_for(first)
    for config in configs:  # and against the model: a bad value is refused before minutes of earlier settings
        check_against_model(config, loaded, clean_wb)
    del loaded, clean_wb
    digest = sweep_hash(configs)
    claimed = claim(first.out if first.out is not None else default_out_dir(f"sweep-{digest}"))
    try:
        return _run_settings(configs, claimed, digest, progress=progress, log=log)
    finally:
        claimed.release()


def _run_settings(configs: list[RunConfig], claimed, digest: str, *, progress: bool, log) -> dict:
    """The settings of :func:`run_sweep`, once its folder is claimed (benchmarks.out_dir)."""
    from benchmarks import tracking
    from benchmarks.benchmark import run_benchmark

    first, out = configs[0], claimed.path
    values = swept_values(configs)
    tracker, parent = None, None
    if first.track:
        try:
            tracker = tracking.Tracker(first.tracking_uri, first.experiment)
            orphan = claimed.previous.get("mlflow_run")
            if orphan and claimed.previous.get("tracking_uri") == tracker.uri:
                tracker.close_orphan(orphan, f"killed: closed by the next sweep in {out}")
            parent = tracker.start_parent(f"sweep-{digest[:6]}", {"settings": [_label(v) for v in values],
                                                                  "config": first.record()},
                                          {"sweep_hash": digest, "model": first.model, "kind": "sweep",
                                           "defense": ",".join(first.defense_names())})
            claimed.note(mlflow_run=parent, tracking_uri=tracker.uri)
        except Exception as err:  # noqa: BLE001 - the sweep still runs and writes its files
            log(f"error: {err}\n  -> the sweep continues without MLflow; results in {out}", file=sys.stderr)
            tracker, parent = None, None
    summary = {"sweep_hash": digest, "out": str(out), "settings": [], "status": "running", "run_id": parent,
               "url": tracker.run_url() if tracker is not None else None}
    try:
        for i, (config, setting) in enumerate(zip(configs, values)):
            folder = out / config.hash()
            results = _finished(folder)
            if results is not None:
                log(f"[sweep] {i + 1}/{len(configs)} {_label(setting)}: finished earlier, kept ({folder})", file=sys.stderr)
            else:
                log(f"[sweep] {i + 1}/{len(configs)} {_label(setting)}", file=sys.stderr)
                results = run_benchmark(replace(config, out=str(folder), track=parent is not None),
                                        progress=progress, log=log, parent_run=parent)
            summary["settings"].append({"values": setting, "config_hash": config.hash(), "out": str(folder),
                                        "results": results})
            if tracker is not None:  # the curves in the parent run's charts: step = setting index
                try:
                    tracker.log_sweep_step(parent, i, setting, results)
                except Exception as err:  # noqa: BLE001 - the sweep's files still carry everything
                    log(f"error: logging setting {i} on the sweep's MLflow run: {tracking.describe_error(err)}",
                        file=sys.stderr)
            _write(summary, out, first)
        summary["status"] = "finished"
    except BaseException as err:
        summary["status"] = "interrupted" if isinstance(err, KeyboardInterrupt) else f"failed: {err}"
        _write(summary, out, first)
        if tracker is not None:
            tracker.fail(f"sweep {summary['status']}: finished settings in {out}")
        raise
    paths = _write(summary, out, first)
    if tracker is not None:
        tracker.log_artifacts(parent, paths)
        tracker.finish(parent)
    return summary


def _write(summary: dict, out: Path, first: RunConfig) -> list[Path]:
    """sweep.json, sweep.md and sweep.png of the settings finished so far."""
    settings = summary["settings"]
    rows = sweep_rows(settings)
    slim = {**summary, "settings": [{k: v for k, v in s.items() if k != "results"} for s in settings], "rows": rows}
    (out / "sweep.json").write_text(json.dumps(slim, indent=1, default=str))
    table = sweep_table(rows)
    (out / "sweep.md").write_text(table + "\n")
    paths = [out / "sweep.json", out / "sweep.md"]
    if settings:
        paths.append(sweep_plot(settings, rows, out / "sweep.png", f"{first.model} layer {first.layer}"))
    summary["table"] = table
    return paths
