"""SipIt against quantised serving: the attacker holding the served weights vs the fp32 attacker.

``flock /tmp/sipit-heavy.lock .venv/bin/python -m benchmarks.experiments.quant_recovery --layers middle,last``

Everything goes through the benchmark's own pipeline (benchmarks.pipeline: expose -> the
registry's strongest attack -> invert), per layer and served weight format:

- ``same``: the attacker holds the served bnb model (``knows_defense``). Quantised weights are verified
  at the served shape (sipit.whitebox.WhiteBox.at_served_shape), so exact SipIt at the default
  eps applies; ``cached_gap`` is the largest relative gap a cached candidate step would have had
  (sipit.tolerance.measure_gap), i.e. why the ordinary verifier failed on quantised weights.
- ``mismatch_fp32``: the attacker holds only the fp32 weights: nearest-neighbour decoding over the
  gradient shortlist (attacks.registry ``nn-gradient``).
- margins: Delta_t of the served model and of the fp32 model on the same prompts, at position 0 of
  every prompt (each model's position-0 table, one sweep of the vocabulary per model and layer)
  and at ``--margin-positions`` seeded later positions (one sweep each), by
  benchmarks.pipeline.margins_on_subset; the cost is reported.

Writes ``quant_recovery.json`` (one row per layer and format) and ``quant_recovery.md``.
"""

from __future__ import annotations

if __name__ == "__main__":  # before the imports: Ctrl-C while they load is one line (benchmarks.startup)
    from benchmarks.startup import guard_startup

    guard_startup()

import argparse
import json
from pathlib import Path

import torch

from attacks.registry import AttackOptions
from benchmarks.cli import arg, check_int, check_names, default_out_dir, run_main
from benchmarks.experiments.speed import check_layer_spec, named_layers
from benchmarks.metrics import clopper_pearson_upper, median
from benchmarks.pipeline import attack_for, expose, invert_all, margins_on_subset
from benchmarks.prompts import named_prompt_set
from defenses import make_chain
from defenses.quant import WEIGHT_KINDS
from sipit.models import DEFAULT_MODEL, load_model
from sipit.tolerance import measure_gap
from sipit.whitebox import WhiteBox

WEIGHTS = tuple(k for k in WEIGHT_KINDS if k != "none")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.experiments.quant_recovery",
                                     description=__doc__.splitlines()[0])
    count = arg(check_int, low=1)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--layers", type=arg(check_layer_spec, name=""), default="middle,last",
                        help="comma list of first, middle, last or layer numbers")
    parser.add_argument("--kinds", type=arg(check_names, choices=WEIGHTS), default="int8,nf4,fp4",
                        help="comma list of served weight formats")
    parser.add_argument("--n-prompts", type=count, default=10)
    parser.add_argument("--length", type=count, default=20, help="tokens per prompt")
    parser.add_argument("--prompts", default="natural",
                        help="prompt set (benchmarks.prompts.named_prompt_set): natural, mixed, random or a text file")
    parser.add_argument("--policy", default="learned", choices=("learned", "gradient"),
                        help="exact SipIt's candidate order")
    parser.add_argument("--shortlist", type=count, default=256, help="the fp32 attacker's prior and gradient shortlists")
    parser.add_argument("--margin-positions", type=arg(check_int, low=0), default=3,
                        help="later positions with a full-vocabulary margin (position 0 of every prompt is always measured)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None,
                        help=f"results folder (default {default_out_dir('quant-recovery')})")
    return parser


def main(argv=None) -> int:
    return run_main(build_parser(), recovery_command, argv)


def _accuracy(inversions, prompt_ids) -> dict:
    hits = sum(a == b for inv, ids in zip(inversions, prompt_ids) for a, b in zip(inv.ids, ids))
    total = sum(len(ids) for ids in prompt_ids)
    return {"token_acc": round(hits / total, 4), "tokens": total,
            "exact": sum(inv.ids == ids for inv, ids in zip(inversions, prompt_ids)), "prompts": len(prompt_ids)}


def _attack(exposed, options: AttackOptions, tokenizer) -> dict:
    inversions = invert_all(exposed, lambda i: attack_for(exposed, i, "sipit", options), tokenizer)
    row = _accuracy(inversions, exposed.prompt_ids)
    row["verified"] = all(inv.all_verified for inv in inversions)
    row["explored"] = round(sum(inv.explored_fraction for inv in inversions) / len(inversions), 6)
    row["seconds_per_prompt"] = round(median(inv.seconds for inv in inversions), 2)
    row["seconds"] = round(sum(inv.seconds for inv in inversions), 1)  # decoding only, no one-time setup
    return row


def _margins(exposed, positions: int, seed: int) -> dict:
    m = margins_on_subset(exposed, positions, seed)
    deltas = dict(zip(map(tuple, m["positions"]), m["deltas"]))
    return {"deltas": {f"{i}:{t}": round(d, 4) for (i, t), d in deltas.items()}, "seconds": round(m["seconds"], 1)}


def recovery_command(args: argparse.Namespace) -> int:
    """Every (layer, kind) row printed as it is measured; json and markdown written at the end."""
    clean = load_model(args.model)
    clean_wb = WhiteBox(clean.model)
    layers = named_layers(args.layers, clean_wb)
    prompt_ids = [p.ids for p in named_prompt_set(args.prompts, clean.tokenizer, args.n_prompts,
                                                  length=args.length, seed=args.seed)]
    options = AttackOptions(policy=args.policy, seed=args.seed,
                            shortlist={"k_prior": args.shortlist, "k_grad": args.shortlist})
    rows = []
    for layer in layers:
        fp32_margins = None
        fp32_states = [clean_wb.states(ids, layer) for ids in prompt_ids]
        for kind in args.kinds:
            chain = make_chain("quant", weights=kind)
            adaptive = expose(chain, clean, clean_wb, layer, prompt_ids, seed=args.seed)
            naive = expose(chain, clean, clean_wb, layer, prompt_ids, seed=args.seed, knows_defense=False)
            gaps = torch.cat([measure_gap(adaptive.attacker_wb, torch.tensor(ids), layer) for ids in prompt_ids[:2]])
            if fp32_margins is None:
                fp32_margins = _margins(naive, args.margin_positions, args.seed)
            quant_margins = _margins(adaptive, args.margin_positions, args.seed)
            rows.append({
                "kind": kind, "layer": layer, "served_shape": adaptive.served_shape,
                "cached_gap": float(gaps.max()),
                "same": _attack(adaptive, options, clean.tokenizer),
                "mismatch_fp32": _attack(naive, options, clean.tokenizer),
                "leak_vs_fp32_rel": round(max(float((a - b).norm(dim=-1).div(b.norm(dim=-1)).max())
                                              for a, b in zip(adaptive.states, fp32_states)), 4),
                "margins_quant": quant_margins, "margins_fp32": fp32_margins,
            })
            print(json.dumps(rows[-1]), flush=True)
            clean.served.clear()  # one quantised copy in memory at a time
    out = Path(args.out) if args.out is not None else default_out_dir("quant-recovery")
    out.mkdir(parents=True, exist_ok=True)
    (out / "quant_recovery.json").write_text(json.dumps(rows, indent=1))
    (out / "quant_recovery.md").write_text(markdown(rows))
    return 0


def _rate(row: dict) -> str:
    """``acc (<= upper95, n tokens; exact prompts)``: token accuracy with its 95% Clopper-Pearson upper bound."""
    hits = round(row["token_acc"] * row["tokens"])
    upper = clopper_pearson_upper(hits, row["tokens"])
    return f"{row['token_acc']:.3f} (<= {upper:.3f}, n={row['tokens']}; {row['exact']}/{row['prompts']} exact)"


def markdown(rows: list[dict]) -> str:
    """One line per (layer, format): both attackers, the cached gap, and the margin ratio."""
    lines = ["| layer | weights | same-model SipIt: token acc. | explored / position | s / prompt "
             "| cached-step gap | fp32 attacker: token acc. | s / prompt | leak vs fp32 | median Delta quant / fp32 (n) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s, m = r["same"], r["mismatch_fp32"]
        q, f = r["margins_quant"]["deltas"], r["margins_fp32"]["deltas"]
        common = [k for k in q if k in f]
        ratio = median(q[k] / f[k] for k in common) if common else float("nan")
        lines.append(f"| {r['layer']} | {r['kind']} | {_rate(s)} | {100 * s['explored']:.4f}% | {s['seconds_per_prompt']} "
                     f"| {r['cached_gap']:.1e} | {_rate(m)} | {m['seconds_per_prompt']} | {r['leak_vs_fp32_rel']:.3f} "
                     f"| {ratio:.3f} ({len(common)}) |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
