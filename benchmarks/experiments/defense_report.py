"""Utility-cost table of every defence setting on one model: ``python -m defenses.report``.

Writes a markdown table (stdout, and ``--out`` if given) plus JSON rows (``--json``). Run it under
the CPU lock: ``flock /tmp/sipit-heavy.lock .venv/bin/python -m defenses.report``.
"""

from __future__ import annotations

import argparse
import json
import time

from defenses.registry import make_defense
from defenses.utility import utility_cost
from sipit.models import load_model

SETTINGS: list[tuple[str, dict]] = [
    ("none", {}),
    *[("noise", {"sigma": s, "relative_to": "rms", "placement": p}) for p in ("exposure", "model") for s in (0.01, 0.1, 1.0)],
    *[("quant", {"weights": w}) for w in ("int8", "nf4", "fp4")],
    *[("quant", {"weights": "none", "activations": a}) for a in ("int8", "nf4")],
    *[("tying", {"groups": g}) for g in (512, 2048)],
    *[("tying", {"rare": m}) for m in (10000, 30000)],
    ("pooling", {"mode": "mean", "over": "all"}),
    ("pooling", {"mode": "max", "over": "all"}),
    ("pooling", {"mode": "mean", "over": "window", "k": 4}),
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


def table(rows: list[dict]) -> str:
    head = ("| defence | setting | ppl | ppl rel. increase | top-1 agreement | state rel. L2 | state cosine "
            "| exposure shape | seconds |\n|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r['defense']} | {r['setting']} | {r['ppl_served']:.2f} | {r['ppl_rel_increase']:+.3f} | "
            f"{r['top1_agreement']:.3f} | {_fmt(r['state_rel_l2'])} | {_fmt(r['state_cosine'], 4)} | "
            f"{tuple(r['exposure_shape'])} | {r['total_seconds']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--layer", type=int, default=15)
    parser.add_argument("--n-tokens", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", nargs="*", help="defence names to include (default: all)")
    parser.add_argument("--out", help="write the markdown table here")
    parser.add_argument("--json", help="write the rows as JSON here")
    args = parser.parse_args(argv)
    rows = run(args.model, args.layer, args.n_tokens, args.seed, args.only)
    text = table(rows)
    print(text)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(text + "\n")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=1)


if __name__ == "__main__":
    main()
