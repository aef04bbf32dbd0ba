"""SipIt against quantised serving: same-quantised attacker (exact) vs fp32 attacker (mismatch).

``flock /tmp/sipit-heavy.lock .venv/bin/python -m benchmarks.experiments.quant_recovery [--margins]``

- same: the attacker holds the served bnb model. rel_tol is derived for that model with
  ``sipit.tolerance.measure_gap`` / ``tolerance_from_gaps`` (batched-vs-full gap under quant);
  SipIt + GradientPolicy must recover exactly, every position verified.
- mismatch: the attacker holds only the fp32 weights. Nearest-neighbour decoding over the gradient
  shortlist (attacks.registry ``nn-gradient``: position 0 over the whole vocabulary, then the top
  ``--shortlist`` of the attacker's prior and of the gradient ranking, greedy on the decoded
  prefix); reports token accuracy and how far the leak is from the fp32 recomputation.
- ``--margins``: Delta_t (sipit.margins, full vocabulary) at the first few positions, fp32 vs
  quantised, at a shallow layer (full-vocabulary sweeps are T x V steps).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from attacks.policies import GradientPolicy
from attacks.registry import AttackOptions, Exposure, build
from attacks.sipit import SipIt
from benchmarks.cli import arg, check_int, check_names, default_out_dir, run_main
from defenses.quant import WEIGHT_KINDS, Quantization
from sipit.models import DEFAULT_MODEL, load_model
from sipit.tolerance import measure_gap, tolerance_from_gaps
from sipit.whitebox import WhiteBox

WEIGHTS = tuple(k for k in WEIGHT_KINDS if k != "none")
PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Return the list of keys sorted by value.",
    "Paris is the capital of France and",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.experiments.quant_recovery",
                                     description=__doc__.splitlines()[0])
    count = arg(check_int, low=1)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--layer", type=int, default=15)
    parser.add_argument("--kinds", type=arg(check_names, choices=WEIGHTS), default="int8,nf4,fp4",
                        help="comma list of served weight formats")
    parser.add_argument("--n-prompts", type=arg(check_int, low=1), default=len(PROMPTS), help=f"at most {len(PROMPTS)}")
    parser.add_argument("--length", type=count, default=None, help="tokens kept per prompt (default: all)")
    parser.add_argument("--shortlist", type=count, default=256)
    parser.add_argument("--margins", action="store_true")
    parser.add_argument("--margin-layer", type=int, default=1)
    parser.add_argument("--margin-positions", type=count, default=3)
    parser.add_argument("--out", default=None,
                        help=f"results folder: quant_recovery.json (default {default_out_dir('quant-recovery')})")
    return parser


def main(argv=None) -> int:
    return run_main(build_parser(), recovery_command, argv)


def recovery_command(args: argparse.Namespace) -> int:
    """Every (kind, prompt) row printed as it is measured, all rows written to ``--out`` at the end."""
    clean = load_model(args.model)
    clean_wb = WhiteBox(clean.model)
    args.layer = clean_wb.resolve_layer(args.layer)
    prompts = [torch.tensor(clean.tokenizer(p, add_special_tokens=False)["input_ids"][: args.length])
               for p in PROMPTS[: args.n_prompts]]
    rows = []
    for kind in args.kinds:
        defense = Quantization(weights=kind)
        served = defense.serve(clean, args.layer)
        wb = WhiteBox(served.model)
        gaps = torch.cat([measure_gap(wb, ids, args.layer) for ids in prompts])
        rel_tol = tolerance_from_gaps(gaps)
        for ids in prompts:
            observed = defense.expose(wb.states(ids, args.layer))
            t0 = time.perf_counter()
            inv = SipIt(GradientPolicy(), rel_tol=rel_tol).invert(observed, wb, args.layer, clean.tokenizer)
            same = {"exact": inv.ids == ids.tolist(), "verified": inv.all_verified,
                    "explored": round(inv.explored_fraction, 5), "seconds": round(time.perf_counter() - t0, 1)}
            t0 = time.perf_counter()
            mismatched = build("nn-gradient", Exposure(exact=False),
                               AttackOptions(shortlist={"k_prior": args.shortlist, "k_grad": args.shortlist}))
            guess = mismatched.invert(observed, clean_wb, args.layer).ids
            fp32 = clean_wb.states(ids, args.layer)
            mismatch = {"token_acc": sum(a == b for a, b in zip(guess, ids.tolist())) / len(ids),
                        "exact": guess == ids.tolist(),
                        "leak_vs_fp32_rel": round(float((observed - fp32).norm(dim=-1).div(fp32.norm(dim=-1)).max()), 4),
                        "seconds": round(time.perf_counter() - t0, 1)}
            rows.append({"kind": kind, "layer": args.layer, "T": len(ids), "max_gap": float(gaps.max()),
                         "rel_tol": rel_tol, "same": same, "mismatch_fp32": mismatch})
            print(json.dumps(rows[-1]), flush=True)
        if args.margins:
            from sipit.margins import margins

            ids = prompts[0][: args.margin_positions]
            m_q = margins(wb, ids, args.margin_layer, chunk=2048)
            m_c = margins(clean_wb, ids, args.margin_layer, chunk=2048)
            rows.append({"kind": kind, "margin_layer": args.margin_layer, "delta_fp32": m_c.delta.tolist(),
                         "delta_quant": m_q.delta.tolist()})
            print(json.dumps(rows[-1]), flush=True)
    out = Path(args.out) if args.out is not None else default_out_dir("quant-recovery")
    out.mkdir(parents=True, exist_ok=True)
    (out / "quant_recovery.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
