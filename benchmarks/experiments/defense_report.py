"""Utility-cost table of every defence setting on one model: ``python -m benchmarks.experiments.defense_report``.

Each setting is priced for every use of the states (defenses.utility.utility_cost): the served
model's perplexity, inference continued from the exposed states, an embedding store of defended
sentence vectors (recall@1 lost) and linear probes trained on clean states (accuracy lost); "n/a"
where a use does not apply (continued inference from a pooled exposure).

Prints a markdown table and writes it (``report.md``) with the JSON rows (``report.json``) to ``--out``. Run it under
the CPU lock: ``flock /tmp/sipit-heavy.lock .venv/bin/python -m benchmarks.experiments.defense_report``.
"""

from __future__ import annotations

if __name__ == "__main__":  # before the imports: Ctrl-C while they load is one line (benchmarks.startup)
    from benchmarks.startup import guard_startup

    guard_startup()

import argparse
import json
import time
from pathlib import Path

from benchmarks.cli import arg, check_int, check_names, default_out_dir, run_main
from defenses.registry import DEFENSES, make_defense
from defenses.utility import utility_cost
from sipit.models import DEFAULT_MODEL, load_model

SETTINGS: list[tuple[str, dict]] = [
    ("none", {}),
    *[("noise", {"sigma": s, "relative_to": "rms", "placement": p}) for p in ("exposure", "model") for s in (0.01, 0.1, 1.0)],
    *[("quant", {"weights": w}) for w in ("int8", "nf4", "fp4")],
    *[("quant", {"weights": "none", "activations": a}) for a in ("int8", "nf4", "fp4")],
    *[("tying", {"groups": g}) for g in (512, 2048)],
    *[("tying", {"rare": m}) for m in (10000, 30000)],
    ("pooling", {"mode": "mean", "over": "all"}),
    ("pooling", {"mode": "max", "over": "all"}),
    *[("pooling", {"mode": m, "over": "window", "k": k}) for m in ("mean", "max") for k in (2, 4)],
    ("pooling", {"mode": "mean", "over": "dims", "g": 4}),
]


def _fmt(value, digits=3) -> str:
    return "-" if value is None else f"{value:.{digits}g}" if isinstance(value, float) else str(value)


def run(model: str, layer: int, n_tokens: int, seed: int, only: list[str] | None = None) -> list[dict]:
    loaded = load_model(model)
    rows = []
    for name, params in SETTINGS:
        if only and name not in only:
            continue
        started = time.perf_counter()
        defense = make_defense(name, **params)
        report = utility_cost(loaded, defense, layer, n_tokens=n_tokens, seed=seed).to_dict()
        report["setting"] = ", ".join(f"{k}={v}" for k, v in params.items()) or "-"
        report["total_seconds"] = time.perf_counter() - started  # includes serve (k-means, quantise)
        rows.append(report)
        print(json.dumps({k: report[k] for k in ("defense", "setting", "ppl_served", "top1_agreement",
                                                   "state_rel_l2", "total_seconds")}), flush=True)
    return rows


def use_loss(row: dict, use: str, spec: str) -> str:
    """The loss of ``use`` in a report row, formatted; "n/a" where the use does not apply."""
    found = row.get("uses", {}).get(use)
    if not found or not found.get("applicable") or found.get("loss") is None:
        return "n/a"
    return format(found["loss"], spec)


def table(rows: list[dict]) -> str:
    head = ("| defence | setting | served ppl | served: ppl rel. increase | served: top-1 agreement "
            "| continued: ppl rel. increase | store: recall@1 lost | probing: accuracy lost | state rel. L2 "
            "| state cosine | exposure shape | seconds |\n|---|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r['defense']} | {r['setting']} | {r['ppl_served']:.2f} | {r['ppl_rel_increase']:+.3f} | "
            f"{r['top1_agreement']:.3f} | {use_loss(r, 'continued', '+.3f')} | {use_loss(r, 'embedding_store', '.3f')} | "
            f"{use_loss(r, 'probing', '.3f')} | {_fmt(r['state_rel_l2'])} | {_fmt(r['state_cosine'], 4)} | "
            f"{tuple(r['exposure_shape'])} | {r['total_seconds']:.1f} |"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.experiments.defense_report",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--layer", type=int, default=15)
    parser.add_argument("--n-tokens", type=arg(check_int, low=16), default=2048)
    parser.add_argument("--seed", type=arg(check_int, low=0), default=0)
    parser.add_argument("--only", type=arg(check_names, choices=tuple(DEFENSES)), default=None,
                        help="comma list of defence names to include (default: all)")
    parser.add_argument("--out", default=None,
                        help=f"results folder: report.md and report.json (default {default_out_dir('defense-report')})")
    return parser


def report_command(args: argparse.Namespace) -> int:
    """Measure every setting, then write report.md and report.json to ``--out``."""
    rows = run(args.model, args.layer, args.n_tokens, args.seed, args.only)
    text = table(rows)
    print(text)
    out = Path(args.out) if args.out is not None else default_out_dir("defense-report")
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(text + "\n")
    (out / "report.json").write_text(json.dumps(rows, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_main(build_parser(), report_command, argv)


if __name__ == "__main__":
    raise SystemExit(main())
