"""SipIt against quantised serving: same-quantised attacker (exact) vs fp32 attacker (mismatch).

``flock /tmp/sipit-heavy.lock .venv/bin/python -m defenses.quant_recovery [--margins]``

- same: the attacker holds the served bnb model. rel_tol is derived for that model with
  ``sipit.tolerance.measure_gap`` / ``tolerance_from_gaps`` (batched-vs-full gap under quant);
  SipIt + GradientPolicy must recover exactly, every position verified.
- mismatch: the attacker holds only the fp32 weights. Nearest-candidate decoding over a shortlist
  per position (top ``--shortlist`` of the attacker's prior and of the gradient ranking, greedy on
  the decoded prefix); reports token accuracy and how far the leak is from the fp32 recomputation.
- ``--margins``: Delta_t (sipit.margins, full vocabulary) at the first few positions, fp32 vs
  quantised, at a shallow layer (full-vocabulary sweeps are T x V steps).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from attacks.policies import GradientPolicy, StepContext
from attacks.sipit import SipIt
from defenses.quant import Quantization
from sipit.models import load_model
from sipit.prior import NextTokenPrior
from sipit.tolerance import measure_gap, tolerance_from_gaps
from sipit.whitebox import WhiteBox

PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Return the list of keys sorted by value.",
    "Paris is the capital of France and",
]


@torch.no_grad()
def nearest_decode(observed: torch.Tensor, whitebox: WhiteBox, layer: int, shortlist: int) -> list[int]:
    """Greedy nearest candidate per position among prior top-k and gradient top-k."""
    prior = NextTokenPrior(whitebox.model)
    prefix = whitebox.prefix_cache([], layer)
    policy = GradientPolicy()
    out = []
    for t in range(observed.shape[0]):
        ctx = StepContext(whitebox, prefix, observed[t], prior.logprobs, torch.Generator().manual_seed(0))
        cands = [policy.gradient_order(ctx)[:shortlist]]
        if prior.logprobs is not None:
            cands.append(torch.topk(prior.logprobs, shortlist).indices)
        cands = torch.unique(torch.cat(cands))
        batch = whitebox.step(prefix, cands)
        j = int((batch.states - observed[t]).norm(dim=-1).argmin())
        token = int(cands[j])
        out.append(token)
        prefix = batch.extended(j)
        prior.push(token)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--layer", type=int, default=15)
    parser.add_argument("--kinds", nargs="*", default=["int8", "nf4", "fp4"])
    parser.add_argument("--shortlist", type=int, default=256)
    parser.add_argument("--margins", action="store_true")
    parser.add_argument("--margin-layer", type=int, default=1)
    parser.add_argument("--margin-positions", type=int, default=3)
    args = parser.parse_args(argv)
    clean = load_model(args.model)
    clean_wb = WhiteBox(clean.model)
    prompts = [torch.tensor(clean.tokenizer(p, add_special_tokens=False)["input_ids"]) for p in PROMPTS]
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
            guess = nearest_decode(observed, clean_wb, args.layer, args.shortlist)
            fp32 = clean_wb.states(ids, args.layer)
            mismatch = {"token_acc": sum(a == b for a, b in zip(guess, ids.tolist())) / len(ids),
                        "exact": guess == ids.tolist(),
                        "leak_vs_fp32_rel": round(float((observed - fp32).norm(dim=-1).div(fp32.norm(dim=-1)).max()), 4),
                        "seconds": round(time.perf_counter() - t0, 1)}
            print(json.dumps({"kind": kind, "layer": args.layer, "T": len(ids), "max_gap": float(gaps.max()),
                              "rel_tol": rel_tol, "same": same, "mismatch_fp32": mismatch}), flush=True)
        if args.margins:
            from sipit.margins import margins

            ids = prompts[0][: args.margin_positions]
            m_q = margins(wb, ids, args.margin_layer, chunk=2048)
            m_c = margins(clean_wb, ids, args.margin_layer, chunk=2048)
            print(json.dumps({"kind": kind, "margin_layer": args.margin_layer, "delta_fp32": m_c.delta.tolist(),
                              "delta_quant": m_q.delta.tolist()}), flush=True)


if __name__ == "__main__":
    main()
