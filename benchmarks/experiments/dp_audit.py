"""Audit the DP defences: the epsilon the attacker's success proves, beside the epsilon each setting claims.

    python -m benchmarks.experiments.dp_audit [--model smollm2-135m] [--layer 15]
        [--mechanisms gaussian,laplace-l2,elliptical] [--epsilons 1,10,100] [--clip median]
        [--n-prompts 4] [--length 8] [--draws 2000] [--out results/dp-audit]

For every (mechanism, epsilon) the distinguishing game of defenses.dp.distinguishing_game is played on
pairs of layer-l states of the prompts (the split's, dev by default): at each position t >= 1 the true
state and, as its neighbour, either

- ``worst``: the opposite point of the clip sphere (two clipped states 2C apart: the pair the guarantee
  is calibrated on; this audits the mechanism), or
- ``token``: the state of the same prefix followed by another token drawn at random (a prompt that
  differs in one token: what an attacker tells apart in practice).

``--draws`` exposures of each state of a pair go through the defence; the attacker says "first" when the
exposure is nearer the first clipped state, in the mechanism's metric. Counts pooled over the positions
give one-sided Clopper-Pearson bounds on the error rates and so an epsilon the mechanism provably
exceeds (95%). A correct mechanism never shows a lower bound above its claim; a lower bound far below
it says only that this attacker's test is weaker than the worst case. ``--clip median`` clips at the
median state norm of the prompts' positions (most states then keep their direction and lose little).
Output: ``dp_audit.json`` and ``dp_audit.md`` in ``--out``, the table on stdout.
"""

from __future__ import annotations

if __name__ == "__main__":  # before the imports: Ctrl-C while they load is one line (benchmarks.startup)
    from benchmarks.startup import guard_startup

    guard_startup()

import argparse
import json

import torch
from tqdm.auto import tqdm

from benchmarks.cli import UsageError, arg, check_floats, check_int, check_names, run_main
from benchmarks.out_dir import claim
from benchmarks.prompts import SPLITS, prompt_set
from defenses.base import DefenseParamError
from defenses.dp import MECHANISMS, DPNoise, distinguishing_game, epsilon_lower_bound, public_scale
from sipit.atomic import write_text_atomic
from sipit.models import DEFAULT_MODEL, ModelLoadError, load_model
from sipit.whitebox import SipitInputError, WhiteBox

PAIRS = ("worst", "token")


def state_pairs(wb: WhiteBox, prompts: list[list[int]], layer: int, seed: int) -> dict[str, list]:
    """Per pair kind, the (a, b) state pairs at every position t >= 1 of every prompt (module docstring)."""
    generator = torch.Generator().manual_seed(seed)
    pairs: dict[str, list] = {kind: [] for kind in PAIRS}
    for ids in prompts:
        states = wb.states(ids, layer).float()
        for t in range(1, len(ids)):
            other = int(torch.randint(0, wb.vocab_size - 1, (1,), generator=generator))
            other += other >= ids[t]  # any token but the true one
            swapped = wb.states(ids[:t] + [other], layer)[t].float()
            pairs["worst"].append((states[t], -states[t]))
            pairs["token"].append((states[t], swapped))
    return pairs


def audit(defence: DPNoise, pairs: list, draws: int, seed: int) -> dict:
    """The game on every pair, its counts pooled: the pooled rates bound epsilon as a single pair's do (every
    pair's FPR + e^eps FNR >= 1 - delta, and an average keeps the inequality)."""
    generator = torch.Generator().manual_seed(seed)
    games = [distinguishing_game(defence, a, b, draws, generator) for a, b in pairs]
    fp, fn = sum(g["false_positives"] for g in games), sum(g["false_negatives"] for g in games)
    n = draws * len(games)
    return {"pairs": len(games), "n_per_input": n, "fpr": fp / n, "fnr": fn / n,
            "median_clipped_distance": float(torch.tensor([g["clipped_distance"] for g in games]).median()),
            "epsilon_claimed": defence.epsilon, "delta": defence.delta or 0.0,
            "epsilon_lower_bound": epsilon_lower_bound(fp, fn, n, n, defence.delta or 0.0)}


def run_audit(model: str, layer: int, mechanisms: list[str], epsilons: list[float], clip: str, *, n_prompts: int,
              length: int, draws: int, seed: int, split: str, progress: bool = True) -> dict:
    loaded = load_model(model)
    wb = WhiteBox(loaded.model)
    layer = wb.resolve_layer(layer)
    wb.check_length(length, "--length")
    prompts = [p.ids for p in prompt_set(loaded.tokenizer, n_prompts, length=length, seed=seed, split=split)]
    pairs = state_pairs(wb, prompts, layer, seed)
    norms = torch.stack([a for a, _ in pairs["token"]]).norm(dim=-1)
    clip_value = float(norms.median()) if clip == "median" else float(clip)
    scale = public_scale(loaded, layer) if "elliptical" in mechanisms else None
    rows = []
    settings = [(m, e) for m in mechanisms for e in epsilons]
    for mechanism, epsilon in tqdm(settings, desc="dp audit", disable=not progress):
        defence = DPNoise(mechanism=mechanism, epsilon=epsilon, clip=clip_value, seed=seed)
        if mechanism == "elliptical":
            defence.scale = scale
        for kind in PAIRS:
            rows.append({"mechanism": mechanism, "epsilon": epsilon, "clip": clip_value, "pair": kind,
                         **audit(defence, pairs[kind], draws, seed)})
    return {"model": model, "layer": layer, "split": split, "n_prompts": len(prompts), "length": length,
            "draws": draws, "seed": seed, "clip": clip_value, "median_state_norm": float(norms.median()), "rows": rows}


def to_markdown(report: dict) -> str:
    lines = [f"# DP audit: {report['model']} layer {report['layer']}", "",
             f"{report['n_prompts']} prompts x {report['length']} tokens ({report['split']} split), "
             f"{report['draws']} exposures per state and pair, clip {report['clip']:.4g} "
             f"(median state norm {report['median_state_norm']:.4g}). Lower bound: 95% one-sided Clopper-Pearson.", "",
             "| mechanism | epsilon claimed | pair | pairs | FPR | FNR | epsilon lower bound (95%) |",
             "|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        lines.append(f"| {r['mechanism']} | {r['epsilon']:g} | {r['pair']} | {r['pairs']} | {r['fpr']:.4f} | "
                     f"{r['fnr']:.4f} | {r['epsilon_lower_bound']:.3f} |")
    return "\n".join(lines) + "\n"


def _clip(text: str) -> str:
    if text == "median":
        return text
    try:
        value = float(text)
    except ValueError:
        raise UsageError(f"--clip is a positive number or 'median', got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise UsageError(f"--clip is a positive number or 'median', got {text!r}")
    return text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.experiments.dp_audit", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--layer", type=int, default=15)
    p.add_argument("--mechanisms", default=",".join(MECHANISMS), help=f"comma list from {', '.join(MECHANISMS)}")
    p.add_argument("--epsilons", type=arg(check_floats, low=0.0), default="1,10,100")
    p.add_argument("--clip", type=arg(_clip), default="median")
    p.add_argument("--n-prompts", type=arg(check_int, low=1), default=4)
    p.add_argument("--length", type=arg(check_int, low=2), default=8)
    p.add_argument("--draws", type=arg(check_int, low=10), default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--split", choices=SPLITS, default="dev", help="the prompts' split (benchmarks.prompts)")
    p.add_argument("--out", default="results/dp-audit")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    return p


def audit_command(args: argparse.Namespace) -> int:
    mechanisms = check_names(args.mechanisms, MECHANISMS, name="--mechanisms")
    if any(e <= 0 for e in args.epsilons):
        raise UsageError(f"--epsilons must all be > 0, got {args.epsilons}")
    out = claim(args.out)
    try:
        report = run_audit(args.model, args.layer, mechanisms, args.epsilons, args.clip, n_prompts=args.n_prompts,
                           length=args.length, draws=args.draws, seed=args.seed, split=args.split,
                           progress=args.progress)
        md = to_markdown(report)
        write_text_atomic(out.path / "dp_audit.json", json.dumps(report, indent=1))
        write_text_atomic(out.path / "dp_audit.md", md)
    except (ModelLoadError, SipitInputError, DefenseParamError) as err:
        raise UsageError(str(err)) from None
    finally:
        out.release()
    print(md)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_main(build_parser(), audit_command, argv)


if __name__ == "__main__":
    raise SystemExit(main())
