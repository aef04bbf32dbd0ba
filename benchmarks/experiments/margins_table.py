"""Margins Delta_t per layer on a few positions, and the margin / plain-forward speed ratio.

    python -m benchmarks.experiments.margins_table --model smollm2-135m --layers first,middle,last \
        --n-prompts 1 --positions 3 --out runs/margins
    python -m benchmarks.experiments.margins_table --model smollm2-135m --audit-prompts 50 --positions 0  # Table 1

Delta_t is exact (full vocabulary, sipit.margins.margins) at the first ``--positions`` positions
of each prompt. Speed: at the measured positions the full-vocabulary margin costs T*V candidate
steps; it is compared with (a) ``WhiteBox.step`` of the same candidates without distances and
(b) a plain batched full forward (``WhiteBox.states`` semantics, no cache) of an equal number of
tokens, arranged as V/(t+1) sequences of length t+1 so each token attends over as many positions.

``--dtype bf16|fp16`` and ``--exposure kv`` measure the margins and the collision audit of that exposure
(the audit's states come from whole forwards, as served; the margins' candidate states from cached
steps, which in half precision differ from the served forward by the gap that
benchmarks.experiments.gap measures: read small margins against it).
"""

from __future__ import annotations

if __name__ == "__main__":  # before the imports: Ctrl-C while they load is one line (benchmarks.startup)
    from benchmarks.startup import guard_startup

    guard_startup()

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path

import torch

from benchmarks.cli import arg, check_int, default_out_dir, run_main
from benchmarks.experiments.speed import check_layer_spec, named_layers
from benchmarks.prompts import load_prompts
from sipit.audit import audit, table
from sipit.margins import margins, position_margin
from sipit.models import DEFAULT_MODEL, DTYPES, load_model
from sipit.whitebox import EXPOSURES, WhiteBox


@torch.no_grad()
def speed_ratio(wb: WhiteBox, ids: list[int], layer: int, chunk: int = 1024) -> dict:
    """Seconds for one position's full-vocabulary margin vs a plain step vs a plain full forward."""
    t = len(ids) - 1
    prefix = wb.prefix_cache(ids[:t], layer)
    wb.step(prefix, torch.arange(min(chunk, wb.vocab_size)))  # warm-up, not timed
    # Margin at position t on the cached prefix (the work margins() does per position).
    started = time.perf_counter()
    position_margin(wb, prefix, ids[t], chunk=chunk)
    margin_s = time.perf_counter() - started
    started = time.perf_counter()
    for c in torch.arange(wb.vocab_size).split(chunk):
        wb.step(prefix, c)
    step_s = time.perf_counter() - started
    # Plain forward: V tokens as sequences of length t+1 (batches of ~chunk tokens).
    seq = t + 1
    n_seq = wb.vocab_size // seq
    per_batch = max(1, chunk // seq)
    layer = wb.resolve_layer(layer)
    g = torch.Generator().manual_seed(0)
    started = time.perf_counter()
    for i in range(0, n_seq, per_batch):
        b = min(per_batch, n_seq - i)
        batch_ids = torch.randint(0, wb.vocab_size, (b, seq), generator=g)
        wb._forward_to(wb.embed(batch_ids), layer, 0, None)
    forward_s = (time.perf_counter() - started) * wb.vocab_size / (n_seq * seq)
    return {"position": t, "layer": layer, "tokens": wb.vocab_size, "margin_s": margin_s, "step_s": step_s,
            "forward_s": forward_s, "margin_over_step": margin_s / step_s, "margin_over_forward": margin_s / forward_s}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.experiments.margins_table", description=__doc__.split("\n")[0])
    count, layers = arg(check_int, low=1), arg(check_layer_spec, name="")
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--layers", type=layers, default="first,middle,last")
    ap.add_argument("--n-prompts", type=count, default=1)
    ap.add_argument("--positions", type=arg(check_int, low=0), default=3)
    ap.add_argument("--chunk", type=count, default=1024)
    ap.add_argument("--threads", type=count, default=None)
    ap.add_argument("--speed-layers", default="", help="layers (same syntax) at which to measure the speed ratio")
    ap.add_argument("--audit-prompts", type=arg(check_int, low=0), default=0,
                    help="collision audit over this many prompts")
    ap.add_argument("--audit-length", type=count, default=12)
    ap.add_argument("--audit-layers", type=layers, default="first,middle,last")
    ap.add_argument("--audit-pairs", type=arg(check_int, low=0), default=1,
                    help="closest pairs extended by every token (0: no extension, the pairwise minimum only)")
    ap.add_argument("--dtype", choices=tuple(DTYPES), default="fp32", help="the precision the model is served in")
    ap.add_argument("--exposure", choices=EXPOSURES, default="residual")
    ap.add_argument("--out", default=None, help=f"results folder (default {default_out_dir('margins')})")
    return ap


def main(argv=None) -> int:
    return run_main(build_parser(), margins_command, argv)


def margins_command(args: argparse.Namespace) -> int:
    """Margins per layer, optional speed ratio and collision audit, written to ``--out``."""
    if args.threads:
        torch.set_num_threads(args.threads)
    lm = load_model(args.model, dtype=args.dtype)
    wb = WhiteBox(lm.model, exposure=args.exposure)
    prompts = ([p[: args.positions] for p in load_prompts(lm.tokenizer, args.n_prompts, length=args.positions)]
               if args.positions > 0 else [])
    out = Path(args.out) if args.out is not None else default_out_dir("margins")
    out.mkdir(parents=True, exist_ok=True)
    rows, speeds = [], []
    if args.audit_prompts:
        audit_prompts = load_prompts(lm.tokenizer, args.audit_prompts, length=args.audit_length)
        arows = audit(wb, audit_prompts, named_layers(args.audit_layers, wb, "--audit-layers"), pairs=args.audit_pairs, chunk=args.chunk)
        (out / "audit.json").write_text(json.dumps([asdict(r) for r in arows], indent=1))
        (out / "audit.md").write_text(table(args.model, arows))
        print(table(args.model, arows), flush=True)
    for layer in named_layers(args.layers, wb) if args.positions > 0 else []:
        started = time.perf_counter()
        ms = [margins(wb, ids, layer, chunk=args.chunk) for ids in prompts]
        secs = time.perf_counter() - started
        deltas = torch.cat([m.delta for m in ms])
        norms = torch.cat([m.true_states.norm(dim=-1) for m in ms])
        rows.append({"layer": layer, "positions": int(deltas.numel()), "delta_min": float(deltas.min()),
                     "delta_median": float(deltas.median()), "delta_max": float(deltas.max()),
                     "rel_delta_median": float((deltas / norms).median()), "state_norm_median": float(norms.median()),
                     "seconds_per_position": secs / deltas.numel(),
                     "per_prompt": [m.to_dict() for m in ms]})
        print(f"layer {layer:2d}: Delta min {deltas.min():.4g} median {deltas.median():.4g} max {deltas.max():.4g}"
              f"  (||h|| median {norms.median():.4g}; {secs / deltas.numel():.1f} s/position)", flush=True)
        if layer in (named_layers(args.speed_layers, wb, "--speed-layers") if args.speed_layers else []):
            speeds.append(speed_ratio(wb, prompts[0], layer, args.chunk))
            print("  speed:", {k: round(v, 3) if isinstance(v, float) else v for k, v in speeds[-1].items()}, flush=True)
    (out / "margins.json").write_text(json.dumps({"model": args.model, "dtype": args.dtype, "exposure": args.exposure,
                                                  "rows": rows, "speed": speeds,
                                                  "threads": torch.get_num_threads()}, indent=1))
    lines = ["| layer | positions | Delta min | Delta median | Delta max | Delta/||h|| median | s/position |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['layer']} | {r['positions']} | {r['delta_min']:.4g} | {r['delta_median']:.4g} | "
                     f"{r['delta_max']:.4g} | {r['rel_delta_median']:.3g} | {r['seconds_per_position']:.1f} |")
    if speeds:
        lines += ["", "| layer | margin s | step-only s | plain forward s | margin/step | margin/forward |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {s['layer']} | {s['margin_s']:.2f} | {s['step_s']:.2f} | {s['forward_s']:.2f} | "
                  f"{s['margin_over_step']:.2f} | {s['margin_over_forward']:.2f} |" for s in speeds]
    (out / "margins.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
