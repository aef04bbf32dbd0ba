"""The search's report: per defence group, the cheapest setting whose recovery stays <= threshold.

:func:`write_report` writes ``report.json``, ``report.md``, ``trials.csv``, ``pareto.png``
(the study's utility loss vs recovery, with the Pareto front) and ``pareto_uses.png`` (one panel per
use of the states, each trial priced for that use: :func:`per_use`) into the output folder, and logs them, the table
``search_best_and_pareto.json`` and summary metrics on the study's MLflow parent run.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

from benchmarks.metrics import clopper_pearson_upper
from benchmarks.search.runs import PARENT_ATTR, imported_runs, study_runs, with_retries
from benchmarks.search.space import UTILITY_USES
from benchmarks.search.study import CONSTRAINED, stored_config, tokens_needed, trial_counts

#: how the report names the utility use a study prices (benchmarks.search.study.UTILITY_USES)
USE_NAMES = {"served": "served model", "continued": "inference continued from the exposed states",
             "embedding_store": "embedding store (defended sentence vectors vs a clean store)",
             "probing": "linear probes trained on clean states"}
#: what the utility loss of each use is (long name, short name in the tables)
LOSS_NAMES = {"served": ("perplexity increase", "ppl"), "continued": ("perplexity increase", "ppl"),
              "embedding_store": ("recall@1 lost", "loss"), "probing": ("probe accuracy lost", "loss")}
CSV_FIELDS = ["trial", "group", "params", "utility_loss", "ppl_rel_increase", "top1_agreement", "state_rel_l2",
              "recovery", "recovery_upper95", "recovery_excess_upper95", "n_tokens", "claim", "attacks", "chance",
              "feasible", "retry_of", "reused_from"]


def _loss_names(config: dict) -> tuple[str, str]:
    return LOSS_NAMES[config["utility_use"]]


def _pareto(points: list[tuple[float, float, int]]) -> list[int]:
    front, best = [], math.inf
    for u, r, n in sorted(points):
        if r < best:
            front.append(n)
            best = r
    return front


def _row(trial, threshold: float, bound: str) -> dict:
    """One COMPLETE trial as a report row (``bound``: what the threshold applies to, search.study.BOUNDS)."""
    u = trial.user_attrs
    constrained = u[CONSTRAINED[bound]]
    return {"trial": trial.number, "group": u["group"], "family": u["family"], "params": trial.params,
            "utility_loss": u["utility_loss"], "utility_losses": u.get("utility_losses", {}), "ppl_rel_increase": u["ppl_rel_increase"],
            "top1_agreement": u.get("top1_agreement"), "state_rel_l2": u.get("state_rel_l2"),
            "recovery": u["recovery"], "recovery_upper95": u.get("recovery_upper95"),
            "recovery_excess_upper95": u.get("recovery_excess_upper95"), "constrained": constrained,
            "attacks": {k: v["token_accuracy"] for k, v in u["attacks"].items()},
            "chance": {k: v.get("chance") for k, v in u["attacks"].items()},
            "n_tokens": u.get("n_tokens"), "claim": u.get("claim"),
            "feasible": constrained <= threshold, "retry_of": trial.system_attrs.get("failed_trial"),
            "reused_from": u.get("reused_from")}


def per_use(rows: list[dict], config: dict) -> dict:
    """For each use a trial priced (``utility_losses``; trials made before every use was priced carry
    only the study's own): the Pareto front of (that use's loss, constrained recovery) over the trials
    the use can serve (finite loss), and the cheapest feasible one. The leakage is the trial's,
    whatever the use: one study answers every use."""
    own = config["utility_use"]
    out = {}
    for use in UTILITY_USES:
        priced = [dict(r, utility_loss=r["utility_losses"][use]) if use in r["utility_losses"]
                  else dict(r) if use == own else None for r in rows]
        priced = [r for r in priced if r is not None and math.isfinite(r["utility_loss"])]
        if not priced and use != own:
            continue
        front = set(_pareto([(r["utility_loss"], r["constrained"], r["trial"]) for r in priced]))
        ok = sorted((r for r in priced if r["feasible"]), key=lambda r: (r["utility_loss"], r["recovery"], r["trial"]))
        out[use] = {"n_trials": len(priced), "n_feasible": len(ok), "best": ok[0] if ok else None,
                    "pareto_front": sorted((r for r in priced if r["trial"] in front), key=lambda r: r["utility_loss"])}
    return out


def claim_note(config: dict, threshold: float) -> str | None:
    """What a trial's tokens cannot prove: None when zero recovered tokens out of the most a trial attacks
    (``max_prompts``) bound the recovery at or under ``threshold`` (or the study constrains the point
    estimate), else a sentence saying so."""
    if config["bound"] != "upper95":  # excess95: the floor depends on the chance level each trial measures
        return None
    n = config["max_prompts"] * config["length"]
    floor = clopper_pearson_upper(0, n)
    if floor <= threshold:
        return None
    return (f"No trial can be feasible: {n} attacked tokens per trial ({config['max_prompts']} prompts x "
            f"{config['length']} tokens) bound the recovery at {floor:.3f} or more even when none is recovered, above "
            f"the threshold {threshold:.3g}; the claim needs at least {tokens_needed(threshold)} tokens per trial.")


def stages_note(config: dict) -> str:
    """How many prompts a trial attacks: ``n_prompts``, and ``max_prompts`` unless those already show a leak."""
    if config["max_prompts"] == config["n_prompts"]:
        return f"{config['n_prompts']} x {config['length']} tokens"
    return (f"{config['n_prompts']} x {config['length']} tokens, {config['max_prompts']} x {config['length']} when "
            "the first show no leak (search.space.claim_after)")


def build_report(study, *, threshold: float | None = None, ppl_limit: float = 0.10) -> dict:
    """Per group: the cheapest COMPLETE trial with recovery <= threshold; plus the Pareto front."""
    from optuna.trial import TrialState

    config = stored_config(study.user_attrs["config"])
    threshold = config["threshold"] if threshold is None else threshold
    trials = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if "recovery" in t.user_attrs]
    rows = [_row(t, threshold, config["bound"]) for t in trials]
    groups: dict[str, dict] = {}
    for group in sorted({r["group"] for r in rows}):
        mine = [r for r in rows if r["group"] == group]
        ok = sorted((r for r in mine if r["feasible"] and math.isfinite(r["utility_loss"])),
                    key=lambda r: (r["utility_loss"], r["recovery"], r["trial"]))
        groups[group] = {"n_trials": len(mine), "n_feasible": len(ok), "best": ok[0] if ok else None,
                         "lowest_recovery": min(mine, key=lambda r: (r["constrained"], r["recovery"],
                                                                     r["utility_loss"]))}
    # an answer for the study's use: leakage under the threshold and a use the setting can serve (finite loss)
    feasible = sorted((r for r in rows if r["feasible"] and math.isfinite(r["utility_loss"])),
                      key=lambda r: (r["utility_loss"], r["recovery"], r["trial"]))
    front = set(_pareto([(r["utility_loss"], r["constrained"], r["trial"]) for r in rows]))
    answer = [r for r in feasible if r["utility_loss"] <= ppl_limit]  # the perplexity increase of the study's use
    counts = trial_counts(study)
    return {
        "study": study.study_name, "config": config, "threshold": threshold, "counts": counts,
        "bound": config["bound"], "claim_note": claim_note(config, threshold),
        "best": feasible[0] if feasible else None, "groups": groups,
        "pareto_front": sorted((r for r in rows if r["trial"] in front), key=lambda r: r["utility_loss"]),
        "uses": per_use(rows, config),
        "question": {"ppl_limit": ppl_limit, "reached": bool(answer), "cheapest": answer[0] if answer else None},
        "trials": sorted(rows, key=lambda r: r["trial"]),
        "mlflow_parent_run_id": study.user_attrs.get(PARENT_ATTR),
    }


def _fmt_params(params: dict) -> str:
    return ", ".join(f"{k.split('.', 1)[-1]}={v:.4g}" if isinstance(v, float) else f"{k.split('.', 1)[-1]}={v}"
                     for k, v in params.items() if k != "family")


#: how the report's header names what the threshold constrains (search.study.BOUNDS)
BOUND_NAMES = {"excess95": ", its one-sided 95% upper bound above the attack's chance level)",
               "upper95": ", its one-sided 95% Clopper-Pearson upper bound)", "point": ")"}


def _bounds(r: dict) -> str:
    """A row's bounds as text: the 95% upper bound, the one above chance and the tokens attacked, where the
    trial recorded them."""
    parts = [f"95% upper {r['recovery_upper95']:.3f}"] if r.get("recovery_upper95") is not None else []
    if r.get("recovery_excess_upper95") is not None:
        parts.append(f"above chance <= {r['recovery_excess_upper95']:.3f}")
    if r.get("n_tokens") is not None:
        parts.append(f"{r['n_tokens']} tokens")
    return ", ".join(parts)


def _agreement(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def _group_line(group: str, g: dict, short: str = "ppl") -> str:
    """The markdown table row of one group: its cheapest feasible setting, else its lowest recovery."""
    b = g["best"]
    if b is None:
        lo = g["lowest_recovery"]
        upper = f" ({_bounds(lo)})" if _bounds(lo) else ""
        return (f"| {group} | {g['n_trials']} (0) | none found (lowest recovery {lo['recovery']:.3f}{upper} at "
                f"{_fmt_params(lo['params'])}, {short} {100 * lo['utility_loss']:+.2f}%) | {lo['trial']} | | | |")
    attacks = ", ".join(f"{k} {v:.3f}" for k, v in b["attacks"].items())
    if _bounds(b):
        attacks += f" (strongest: {_bounds(b)})"
    return (f"| {group} | {g['n_trials']} ({g['n_feasible']}) | {_fmt_params(b['params'])} | {b['trial']} | "
            f"{100 * b['utility_loss']:+.2f}% | {_agreement(b['top1_agreement'])} | {attacks} |")


def format_report(report: dict) -> str:
    """The report as markdown: header, one table row per group, the answer, the Pareto front."""
    c = report["config"]
    long, short = _loss_names(c)
    lines = [f"# Search {report['study']}: {c['model']} layer {c['layer']}, mode {c['mode']}, "
             f"threshold recovery <= {report['threshold']:.3g} (token accuracy" + BOUND_NAMES[report["bound"]],
             f"trials: {report['counts']['COMPLETE']} complete, {report['counts']['FAIL']} failed (retried when stale), "
             f"{report['counts']['RUNNING']} running; prompts {c['prompts']} {stages_note(c)}; "
             f"utility ({USE_NAMES[c['utility_use']]}) on {c['utility_tokens']} tokens; "
             f"attacks {', '.join(c['attacks'])} (under noise: {c['robust']}, attacks.registry.ROBUST)", "",
             f"| family | trials (feasible) | cheapest setting with recovery <= threshold | trial | "
             f"{'ppl increase' if short == 'ppl' else long} | "
             "top-1 agr. | recovery per attack |", "|---|---|---|---|---|---|---|"]
    lines += [_group_line(group, g, short) for group, g in report["groups"].items()]
    if report.get("claim_note"):
        lines += ["", f"**{report['claim_note']}**"]
    q = report["question"]
    lines.append("")
    if q["reached"]:
        b = q["cheapest"]
        lines.append(f"A setting reaches recovery <= {report['threshold']:.3g} with {long} <= "
                     f"{100 * q['ppl_limit']:.0f}%: trial {b['trial']} {b['group']} ({_fmt_params(b['params'])}), "
                     f"{short} {100 * b['utility_loss']:+.2f}%, recovery {b['recovery']:.3f}.")
    else:
        lines.append(f"No setting found reaches recovery <= {report['threshold']:.3g} with {long} <= "
                     f"{100 * q['ppl_limit']:.0f}%.")
    lines.append("")
    lines.append("Pareto front (utility loss vs recovery): " + "; ".join(
        f"#{r['trial']} {r['group']} {short} {100 * r['utility_loss']:+.2f}% rec {r['recovery']:.3f}"
        for r in report["pareto_front"]))
    if report.get("uses"):
        lines += ["", *format_uses(report)]
    return "\n".join(lines)


def format_uses(report: dict) -> list[str]:
    """The per-use table: for each use, the cheapest setting whose recovery stays under the threshold
    (among the trials the use can serve) and that use's Pareto front."""
    lines = ["## Per use of the states (same trials, each priced for the use)", "",
             "| use | utility loss | trials it can serve (feasible) | cheapest setting with recovery <= threshold | "
             "trial | loss | recovery (bounds) | Pareto front (trial: loss, recovery) |", "|---|---|---|---|---|---|---|---|"]
    for use, u in report["uses"].items():
        long = LOSS_NAMES[use][0]
        front = "; ".join(f"#{r['trial']} {r['group']}: {100 * r['utility_loss']:+.2f}%, {r['recovery']:.3f}"
                          for r in u["pareto_front"])
        b = u["best"]
        if b is None:
            lines.append(f"| {use} | {long} | {u['n_trials']} (0) | none found | | | | {front} |")
            continue
        upper = f" ({_bounds(b)})" if _bounds(b) else ""
        lines.append(f"| {use} | {long} | {u['n_trials']} ({u['n_feasible']}) | {b['group']}: {_fmt_params(b['params'])} | "
                     f"{b['trial']} | {100 * b['utility_loss']:+.2f}% | {b['recovery']:.3f}{upper} | {front} |")
    return lines


def plot_report(report: dict, path: Path) -> Path:
    """Recovery vs the study's utility loss of every trial, by group, with the Pareto front and the threshold."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for group in sorted({r["group"] for r in report["trials"]}):
        mine = [r for r in report["trials"] if r["group"] == group]
        mine = [r for r in mine if math.isfinite(r["utility_loss"])]  # a use the setting cannot serve: not drawn
        ax.scatter([100 * r["utility_loss"] for r in mine], [r["recovery"] for r in mine], label=group, s=22)
    front = [r for r in report["pareto_front"] if math.isfinite(r["utility_loss"])]
    ax.plot([100 * r["utility_loss"] for r in front], [r["recovery"] for r in front], "k--", lw=1, label="Pareto front")
    ax.axhline(report["threshold"], color="red", lw=0.8, label=f"threshold {report['threshold']:.3g}")
    ax.set_xlabel(f"{_loss_names(report['config'])[0]} (%), {USE_NAMES[report['config'].get('utility_use', 'served')]}")
    ax.set_ylabel("recovery (token accuracy, strongest attack)")
    ax.set_xscale("symlog", linthresh=1.0)
    ax.set_title(f"{report['config']['model']} layer {report['config']['layer']}: {report['study']}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_uses(report: dict, path: Path) -> Path:
    """One panel per use: the constrained recovery (the strongest attack's 95% upper bound above chance, its
    95% upper bound, or its point estimate: search.study.BOUNDS) vs that use's loss of every trial it can serve, with its Pareto front."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    uses = list(report["uses"])
    cols = min(2, len(uses))
    rows_n = math.ceil(len(uses) / cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(6 * cols, 4 * rows_n), squeeze=False)
    groups = sorted({r["group"] for r in report["trials"]})
    colours = {g: plt.cm.tab10(i % 10) for i, g in enumerate(groups)}
    for ax, use in zip(axes.flat, uses):
        u = report["uses"][use]
        by_trial = {r["trial"]: r for r in u["pareto_front"]}
        for group in groups:
            pts = [(r["utility_losses"].get(use, r["utility_loss"] if use == report["config"]["utility_use"] else None),
                    r["constrained"]) for r in report["trials"] if r["group"] == group]
            pts = [(x, y) for x, y in pts if x is not None and math.isfinite(x)]
            if pts:
                ax.scatter([100 * x for x, _ in pts], [y for _, y in pts], s=18, color=colours[group], label=group)
        front = sorted(by_trial.values(), key=lambda r: r["utility_loss"])
        xs = [100 * r["utility_loss"] for r in front]
        ax.plot(xs, [r["constrained"] for r in front], "k--o", lw=1, mfc="none", ms=9, label="Pareto front")
        ax.axhline(report["threshold"], color="red", lw=0.8, label=f"threshold {report['threshold']:.3g}")
        ax.set_xscale("symlog", linthresh=1.0)
        ax.set_xlim(left=min([0.0, *xs]) - 0.5)
        ax.set_xlabel(f"{LOSS_NAMES[use][0]} (%)")
        ax.set_ylabel({"excess95": "recovery above chance, 95% upper bound", "upper95": "recovery, 95% upper bound"}
                      .get(report["bound"], "recovery"))
        ax.set_title(f"{use}: {USE_NAMES[use]}", fontsize=8)
    for ax in list(axes.flat)[len(uses):]:
        ax.axis("off")
    handles = {label: h for ax in axes.flat for h, label in zip(*ax.get_legend_handles_labels())}
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=min(len(handles), 5), fontsize=7)
    c = report["config"]
    fig.suptitle(f"{c['model']} layer {c['layer']}, {report['study']}: one Pareto front per use (threshold in red)", fontsize=9)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(study, out: Path, *, tracking_uri=None, track: bool = True, log=print) -> dict:
    """Build the report, write its files into ``out`` and log them on the MLflow parent run (then FINISHED)."""
    report = build_report(study)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str))
    text = format_report(report)
    (out / "report.md").write_text(text + "\n")
    with (out / "trials.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows({k: (json.dumps(v) if isinstance(v, dict) else v) for k, v in r.items()} for r in report["trials"])
    paths = [out / "report.json", out / "report.md", out / "trials.csv"]
    if report["trials"]:
        paths.append(plot_report(report, out / "pareto.png"))
        paths.append(plot_uses(report, out / "pareto_uses.png"))
    runs = study_runs(study, tracking_uri=tracking_uri, track=track, log=log)
    if runs is not None:
        runs.relog_pending(study)  # trials whose MLflow logging failed while the server was down
    elif track:  # a study that ran untracked: its runs are made now
        runs = imported_runs(study, tracking_uri=tracking_uri, log=log)
    if runs is not None:  # two commands of one study may log their reports at once (sqlite: a tag inserted twice)
        with_retries(lambda: _log_on_parent(runs.tracker, runs.parent_id, report, paths), runs.attempts)
    report["text"] = text
    report["out"] = str(out)
    return report


def _log_on_parent(tracker, parent: str, report: dict, paths: list[Path]) -> None:
    """The report's files, its best-and-Pareto table and summary metrics on the parent run, then FINISHED."""
    tracker.log_artifacts(parent, paths)
    table = {"trial": [], "group": [], "params": [], "ppl_rel_increase": [], "recovery": [], "best_in_group": []}
    best_ids = {g["best"]["trial"] for g in report["groups"].values() if g["best"]}
    for r in report["pareto_front"] + [g["best"] for g in report["groups"].values() if g["best"]]:
        table["trial"].append(r["trial"])
        table["group"].append(r["group"])
        table["params"].append(json.dumps(r["params"]))
        table["ppl_rel_increase"].append(r["ppl_rel_increase"])
        table["recovery"].append(r["recovery"])
        table["best_in_group"].append(r["trial"] in best_ids)
    tracker.client.log_table(parent, table, "search_best_and_pareto.json")
    metrics = {"trials_complete": report["counts"]["COMPLETE"], "trials_failed": report["counts"]["FAIL"],
               "question_reached": float(report["question"]["reached"])}
    if report["best"]:
        metrics.update(best_utility_loss=report["best"]["utility_loss"], best_recovery=report["best"]["recovery"],
                       best_trial=report["best"]["trial"])
    for use, u in report.get("uses", {}).items():
        metrics[f"use.{use}.n_feasible"] = u["n_feasible"]
        if u["best"]:
            metrics.update({f"use.{use}.best_utility_loss": u["best"]["utility_loss"],
                            f"use.{use}.best_recovery": u["best"]["recovery"], f"use.{use}.best_trial": u["best"]["trial"]})
    tracker.log_metrics(parent, metrics)
    tracker.finish(parent)
