"""Measure the numerical gap between cached, batched candidate steps and the full forward.

    python -m benchmarks.experiments.gap [--model smollm2-135m] [--layers first,middle,last] [--n-prompts 3]
        [--dtype fp32|bf16|fp16] [--exposure residual|kv] [--device auto]

Prints, per layer, the largest relative L2 gap ||mu_cached - h_full|| / ||h_full|| over every
position of the prompts and the tolerance the documented rule derives from it
(sipit.tolerance.tolerance_from_gaps), next to the default rel_tol SipIt uses; and the same gap
when candidates are verified at the served shape (sipit.whitebox.WhiteBox.at_served_shape), which
is what the attacker of a half-precision model does. The prompts are the dev split's: the rule
chooses an option.
"""

from __future__ import annotations

if __name__ == "__main__":  # before the imports: Ctrl-C while they load is one line (benchmarks.startup)
    from benchmarks.startup import guard_startup

    guard_startup()

import argparse

import torch

from benchmarks.cli import arg, check_int, run_main
from benchmarks.prompts import prompt_set
from benchmarks.experiments.speed import check_layer_spec, named_layers
from sipit.models import DEFAULT_MODEL, DTYPES, load_model
from sipit.tolerance import DEFAULT_REL_TOL, measure_gap, tolerance_from_gaps
from sipit.whitebox import EXPOSURES, WhiteBox


def measure_gaps(model: str = DEFAULT_MODEL, layers: str | list = "first,middle,last", n_prompts: int = 3,
                 length: int = 20, seed: int = 0, *, dtype: str = "fp32", exposure: str = "residual",
                 device: str = "auto") -> dict[int, dict[str, float]]:
    """Per layer: max and median relative gap of incremental steps over all positions, the derived rel_tol,
    and the max gap of served-shape verification."""
    loaded = load_model(model, dtype=dtype, device=device)
    whitebox = WhiteBox(loaded.model, exposure=exposure)
    prompts = prompt_set(loaded.tokenizer, n_prompts, length=length, seed=seed, natural_fraction=0.67, split="dev")
    table = {}
    for layer in named_layers(layers, whitebox):
        gaps = torch.cat([measure_gap(whitebox, p.ids, layer) for p in prompts])
        served = torch.cat([measure_gap(whitebox.at_served_shape(len(p.ids)), p.ids, layer) for p in prompts])
        table[layer] = {"max_gap": float(gaps.max()), "median_gap": float(gaps.median()),
                        "derived_rel_tol": tolerance_from_gaps(gaps), "served_shape_max_gap": float(served.max())}
    return table


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.experiments.gap", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--layers", type=arg(check_layer_spec, name=""), default="first,middle,last")
    parser.add_argument("--n-prompts", type=arg(check_int, low=1), default=3)
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="fp32", help="the precision the model is served in")
    parser.add_argument("--exposure", choices=EXPOSURES, default="residual")
    parser.add_argument("--device", default="auto", help="auto (CUDA, else MPS, else CPU), cpu, cuda, cuda:N, mps")
    return parser


def gap_command(args: argparse.Namespace) -> int:
    print(f"{args.model}, {args.dtype}, {args.exposure} exposure\n")
    print("| layer | max rel. gap | median rel. gap | derived rel_tol | default rel_tol | served-shape max gap |\n"
          "|---|---|---|---|---|---|")
    rows = measure_gaps(args.model, args.layers, args.n_prompts, dtype=args.dtype, exposure=args.exposure,
                        device=args.device)
    for layer, row in rows.items():
        print(f"| {layer} | {row['max_gap']:.2e} | {row['median_gap']:.2e} | "
              f"{row['derived_rel_tol']:.2e} | {DEFAULT_REL_TOL:.0e} | {row['served_shape_max_gap']:.1e} |")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_main(build_parser(), gap_command, argv)


if __name__ == "__main__":
    raise SystemExit(main())
