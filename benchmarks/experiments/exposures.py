"""Exact SipIt on the exposures a deployment has: served precision x residual or KV x layer, per model.

    python -m benchmarks.experiments.exposures [--models smollm2-135m,gemma3-270m] [--dtypes fp32,bf16]
        [--exposures residual,kv] [--layers first,middle,last] [--n-prompts 5] [--length 20]
        [--device auto] [--out results/exposures]

For every (model, dtype, exposure, layer) the prompts' layer-l states are computed by the model served
in that dtype (what leaks) and inverted by the informed attacker: the same model in the same dtype,
verifying candidates at the served shape when the dtype is half precision (incremental kernels round
differently there; sipit.whitebox.WhiteBox.at_served_shape), in the learned proposals' order. A row
gives the fraction of prompts recovered exactly, decode seconds per prompt, candidates per position and
the one-time setup's seconds (position-0 table and inverse heads of that model, dtype, exposure and
layer: built on first use, then loaded from the cache). Per model and dtype: the load time and peak memory (peak
resident set growth on the CPU, peak allocated on CUDA) next to the weights' size in that dtype.

It is the prepared GPU check: ``--device cuda`` with the defaults runs in minutes on one GPU; on a
CPU use fewer prompts. Output: a markdown table on stdout and ``exposures.json`` / ``exposures.md``
in ``--out``.
"""

from __future__ import annotations

if __name__ == "__main__":  # before the imports: Ctrl-C while they load is one line (benchmarks.startup)
    from benchmarks.startup import guard_startup

    guard_startup()

import argparse
import json
import time

import torch
from tqdm.auto import tqdm

from attacks.policies import make_policy
from attacks.sipit import SipIt
from benchmarks.cli import UsageError, arg, check_int, check_names, run_main, split_list
from benchmarks.out_dir import claim
from benchmarks.experiments.speed import check_layer_spec, named_layers
from benchmarks.prompts import SPLITS, named_prompt_set
from sipit.atomic import write_text_atomic
from sipit.models import DTYPES, ModelLoadError, load_model, resolve_device
from sipit.resources import peak_rss
from sipit.whitebox import EXPOSURES, SipitInputError, WhiteBox


def _peak_bytes(device: torch.device) -> int:
    return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else peak_rss()


def load_measured(model: str, dtype: str, device: str) -> tuple[object, dict]:
    """(LoadedModel, {load_seconds, weight_bytes, peak_growth_bytes}) of ``model`` in ``dtype``.

    The peak growth is the resident set's peak after the load minus before it on the CPU (only a
    process's first load of a model measures it: a peak already reached hides a smaller one), the
    peak allocated bytes on CUDA."""
    target = resolve_device(device)
    if target.type == "cuda":
        torch.cuda.reset_peak_memory_stats(target)
    before = _peak_bytes(target)
    started = time.perf_counter()
    loaded = load_model(model, dtype=dtype, device=device)
    seconds = time.perf_counter() - started
    weights = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    return loaded, {"load_seconds": seconds, "weight_bytes": weights, "peak_growth_bytes": _peak_bytes(target) - before}


def invert_exposure(loaded, exposure: str, layer: int, prompts: list[list[int]], *, seed: int = 0,
                    progress: bool = False) -> dict:
    """Exact SipIt (learned proposals) on the served states of every prompt; the row of the table."""
    wb = WhiteBox(loaded.model, exposure=exposure)
    attack = SipIt(make_policy("learned", progress=progress), seed=seed, progress=progress)
    half = wb.dtype != torch.float32
    exact, seconds, wall, candidates, positions, setup = 0, 0.0, 0.0, 0, 0, []
    for ids in tqdm(prompts, desc=f"{exposure} layer {layer}", disable=not progress, leave=False):
        observed = wb.states(ids, layer)
        started = time.perf_counter()
        inversion = attack.invert(observed, wb.at_served_shape(len(ids)) if half else wb, layer, loaded.tokenizer)
        wall += time.perf_counter() - started
        seconds += sum(p.seconds for p in inversion.positions)  # the decode alone, not the one-time setup
        setup += list(inversion.setup)
        exact += inversion.ids == ids
        candidates += sum(p.candidates_tried for p in inversion.positions)
        positions += len(inversion.positions)
    n = len(prompts)
    return {"exposure": exposure, "layer": layer, "d": wb.d, "n_prompts": n, "exact": exact / n,
            "seconds_per_prompt": seconds / n, "candidates_per_position": candidates / max(positions, 1),
            "served_shape": half, "setup_seconds": wall - seconds, "setup": setup}


def measure(models: list[str], dtypes: list[str], exposures: list[str], layers: str, *, n_prompts: int, length: int,
            device: str = "auto", seed: int = 0, split: str = "test", progress: bool = False) -> list[dict]:
    """One row per (model, dtype, exposure, layer); see the module docstring."""
    rows = []
    for model in models:
        for dtype in dtypes:
            loaded, load = load_measured(model, dtype, device)
            prompts = [p.ids for p in named_prompt_set("natural", loaded.tokenizer, n_prompts, length=length, seed=seed,
                                                       split=split)]
            for exposure in exposures:
                wb = WhiteBox(loaded.model, exposure=exposure)
                for layer in named_layers(layers, wb):
                    row = invert_exposure(loaded, exposure, layer, prompts, seed=seed, progress=progress)
                    rows.append({"model": model, "split": split, "dtype": dtype, "device": str(wb.device), **load, **row})
            del loaded
    return rows


def format_rows(rows: list[dict]) -> str:
    lines = ["| model | dtype | exposure | layer | d | exact (n) | s/prompt | cand/pos | setup s | load s | weights MB | "
             "peak growth MB |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['dtype']} | {r['exposure']} | {r['layer']} | {r['d']} | "
                     f"{r['exact']:.2f} ({r['n_prompts']}) | {r['seconds_per_prompt']:.2f} | "
                     f"{r['candidates_per_position']:.1f} | {r['setup_seconds']:.1f} | {r['load_seconds']:.1f} | {r['weight_bytes'] / 2**20:.0f} | "
                     f"{r['peak_growth_bytes'] / 2**20:.0f} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.experiments.exposures", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="smollm2-135m,gemma3-270m", help="comma list of registry names or paths")
    p.add_argument("--dtypes", default="fp32,bf16", help=f"comma list from {', '.join(DTYPES)}")
    p.add_argument("--exposures", default=",".join(EXPOSURES), help=f"comma list from {', '.join(EXPOSURES)}")
    p.add_argument("--layers", type=arg(check_layer_spec, name="--layers"), default="first,middle,last")
    p.add_argument("--n-prompts", type=arg(check_int, low=1), default=5)
    p.add_argument("--length", type=arg(check_int, low=1), default=20)
    p.add_argument("--device", default="auto", help="auto (CUDA, else MPS, else CPU), cpu, cuda, cuda:N, mps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--split", choices=SPLITS, default="test", help="the natural prompts' split (benchmarks.prompts)")
    p.add_argument("--out", default="results/exposures")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    return p


def exposures_command(args: argparse.Namespace) -> int:
    dtypes = check_names(args.dtypes, tuple(DTYPES), name="--dtypes")
    exposures = check_names(args.exposures, EXPOSURES, name="--exposures")
    models = split_list(args.models)
    if not models:
        raise UsageError("--models is empty")
    try:
        resolve_device(args.device)
    except ModelLoadError as err:
        raise UsageError(f"--device: {err}") from None
    out = claim(args.out)  # writable and ours, before any model loads
    try:
        rows = measure(models, dtypes, exposures, args.layers, n_prompts=args.n_prompts, length=args.length,
                       device=args.device, seed=args.seed, split=args.split,
                       progress=args.progress)
        table = format_rows(rows)
        write_text_atomic(out.path / "exposures.json", json.dumps({"argv": vars(args), "rows": rows}, indent=1))
        write_text_atomic(out.path / "exposures.md", table + "\n")
    except (ModelLoadError, SipitInputError) as err:
        raise UsageError(str(err)) from None
    finally:
        out.release()
    print(table)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_main(build_parser(), exposures_command, argv)


if __name__ == "__main__":
    raise SystemExit(main())
