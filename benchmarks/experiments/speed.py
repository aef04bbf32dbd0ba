"""Speed of SipIt (learned proposals by default) against BruteForce (random order) on the same positions.

    python -m benchmarks.experiments.speed [--model smollm2-135m] [--n-prompts 10] [--length 20]
                               [--layers first,middle,last] [--bruteforce-positions 3]
                               [--policy learned|gradient|random]

For each layer: SipIt inverts every prompt (90% natural / 10% random tokens). With the learned
policy the one-time cost of the position-0 table and the inverse head is reported on its own
(built, or loaded from the disk cache), and so is the rank of the true token under each proposal
source on the true prefixes (table at position 0; prior, head and head + prior at later ones). BruteForce costs
~V/2 candidate evaluations per position, so it runs on ``--bruteforce-positions`` positions per
layer, each on the true prefix of a prompt (its expected cost per position does not depend on the
prefix), and its per-prompt time and candidate counts are extrapolated as per-position mean x
prompt length. The report says so. Results go to ``--out`` as JSON and markdown.
"""

from __future__ import annotations

if __name__ == "__main__":  # before the imports: Ctrl-C while they load is one line (benchmarks.startup)
    from benchmarks.startup import guard_startup

    guard_startup()

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Sequence

import torch
from tqdm.auto import tqdm

from attacks.policies import POLICIES, LearnedPolicy, RandomPolicy, make_policy
from attacks.proposals import true_ranks
from attacks.sipit import SipIt
from benchmarks.cli import arg, check_int, default_out_dir, run_main, split_list, usage_error
from benchmarks.out_dir import check_provenance
from benchmarks.prompts import SPLITS, prompt_set
from sipit.models import DEFAULT_MODEL, load_model
from sipit.atomic import write_text_atomic
from sipit.prior import NextTokenPrior
from sipit.tolerance import acceptance_radius
from sipit.whitebox import SipitInputError, WhiteBox


LAYER_NAMES = ("first", "middle", "last")


def check_layer_spec(spec: str | Sequence[str | int], *, name: str = "--layers") -> list[str | int]:
    """A non-empty comma list of ``first``/``middle``/``last`` and layer integers (range checked
    against the model by :func:`named_layers`)."""
    items = split_list(spec)
    if not items:
        raise usage_error(name, f"is empty: give {', '.join(LAYER_NAMES)} or layer numbers")
    layers: list[str | int] = []
    for item in items:
        try:
            layers.append(item if item in LAYER_NAMES else int(item))
        except ValueError:
            raise usage_error(name, f"{item!r} is neither {', '.join(LAYER_NAMES)} nor a layer number") from None
    return layers


def named_layers(spec: str | Sequence[str | int], whitebox: WhiteBox, name: str = "--layers") -> list[int]:
    """``first,middle,last`` (or integers, negative from the end) -> layer indices of ``whitebox``
    (first = 1, middle = L // 2, last = L); a layer the model lacks raises SipitInputError."""
    n_layers = whitebox.n_layers
    names = {"first": 1, "middle": n_layers // 2, "last": n_layers}
    try:
        return [names[x] if isinstance(x, str) else whitebox.resolve_layer(x) for x in check_layer_spec(spec, name=name)]
    except SipitInputError as err:
        raise usage_error(f"{name}:", str(err)) from None


def bruteforce_positions(attack: SipIt, whitebox: WhiteBox, prompts, layer: int, n_positions: int, seed: int):
    """Run BruteForce at ``n_positions`` (prompt, position) pairs on their true prefixes."""
    generator = torch.Generator().manual_seed(seed)
    picks = [(i % len(prompts), int(torch.randint(0, len(prompts[0].ids), (1,), generator=generator)))
             for i in range(n_positions)]
    records = []
    for prompt_index, t in tqdm(picks, desc=f"bruteforce L{layer}", leave=False):
        ids = prompts[prompt_index].ids
        observed = whitebox.states(ids, layer)
        prefix = whitebox.prefix_cache(ids[:t], layer)
        radius = float(acceptance_radius(observed[t : t + 1], attack.rel_tol)[0])
        record, _ = attack.decode_position(whitebox, prefix, observed[t], radius, None, generator)
        records.append({"prompt": prompt_index, "position": t, "correct": record.token == ids[t],
                        "candidates_tried": record.candidates_tried, "seconds": record.seconds})
    return records


def prior_logprobs(whitebox: WhiteBox, ids: list[int]) -> torch.Tensor:
    """log P(s_t | s_<t) rows for t = 1..T-1 along the true prefix, ``(T-1, V)``."""
    prior = NextTokenPrior(whitebox.model)
    rows = []
    for token in ids[:-1]:
        prior.push(token)
        rows.append(prior.logprobs.cpu())
    return torch.stack(rows)


def summarise_ranks(ranks: list[int]) -> dict:
    """Median/mean rank (0 = first) and recall@1/@16 of the true token."""
    r = torch.tensor(ranks, dtype=torch.float64)
    return {"n": len(ranks), "median": float(r.median()), "mean": float(r.mean()),
            "top1": float((r < 1).double().mean()), "top16": float((r < 16).double().mean())}


@torch.no_grad()
def proposal_ranks(policy: LearnedPolicy, whitebox: WhiteBox, prompts, layer: int) -> dict:
    """Rank of the true token under each proposal source, on the true prefixes of ``prompts``."""
    ranks: dict[str, list[int]] = {"table (position 0)": [], "prior": [], "head": [], "head + prior": []}
    for prompt in prompts:
        states = whitebox.states(prompt.ids, layer).float().cpu()
        ids = torch.tensor(prompt.ids)
        policy.observe(states)
        table = policy.table.neg_sq_distances(states[0]).float().cpu()
        ranks["table (position 0)"] += true_ranks(table[None], ids[:1]).tolist()
        if len(prompt.ids) > 1:
            prior = prior_logprobs(whitebox, prompt.ids)
            head = torch.stack([policy.head_log_probs(t, states[t]) for t in range(1, len(prompt.ids))])
            for name, score in (("prior", prior), ("head", head), ("head + prior", head + prior)):
                ranks[name] += true_ranks(score, ids[1:]).tolist()
    return {name: summarise_ranks(r) for name, r in ranks.items() if r}


def run_speed(
    model: str = DEFAULT_MODEL,
    n_prompts: int = 10,
    length: int = 20,
    layers: str | Sequence[str | int] = "first,middle,last",
    bruteforce_positions_per_layer: int = 3,
    seed: int = 0,
    out: str | Path | None = None,
    policy: str = "learned",
    split: str = "test",
) -> dict:
    """Measure SipIt vs BruteForce; write ``speed.json`` and ``speed.md`` under ``out``
    (default :func:`benchmarks.cli.default_out_dir` ``("speed")``). Bad values raise
    :class:`benchmarks.cli.UsageError` (or SipitInputError) before the model runs."""
    check_int(n_prompts, low=1, name="--n-prompts")
    check_int(length, low=1, name="--length")
    check_int(bruteforce_positions_per_layer, low=1, name="--bruteforce-positions")
    check_layer_spec(layers)
    if policy not in POLICIES:
        raise usage_error("--policy", f"{policy!r} is not one of {', '.join(sorted(POLICIES))}")
    loaded = load_model(model)
    whitebox = WhiteBox(loaded.model)
    layer_list = named_layers(layers, whitebox)
    whitebox.check_length(length, "--length")
    prompts = prompt_set(loaded.tokenizer, n_prompts, length=length, seed=seed, split=split)
    vocab = whitebox.vocab_size
    report = {"model": model, "n_prompts": n_prompts, "length": length, "vocab_size": vocab,
              "threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine(),
              "torch": torch.__version__, "policy": policy, "split": split, "layers": []}
    for layer in layer_list:
        sipit = SipIt(make_policy(policy), seed=seed)
        one_time = prepare_policy(sipit.policy, whitebox, layer, loaded.tokenizer)
        rows = []
        for prompt in tqdm(prompts, desc=f"sipit L{layer}", leave=False):
            inversion = sipit.invert(whitebox.states(prompt.ids, layer), whitebox, layer, loaded.tokenizer)
            rows.append({"kind": prompt.kind, "exact": inversion.ids == prompt.ids,
                         "token_accuracy": inversion.token_accuracy(prompt.ids),
                         "seconds": inversion.seconds, "candidates": inversion.candidates_tried,
                         "per_position": [p.candidates_tried for p in inversion.positions]})
        brute = bruteforce_positions(SipIt(RandomPolicy(), use_prior=False, seed=seed), whitebox, prompts,
                                     layer, bruteforce_positions_per_layer, seed)
        seconds = [r["seconds"] for r in rows]
        per_position = statistics.mean(r["candidates"] for r in rows) / length
        brute_per_position = statistics.mean(b["candidates_tried"] for b in brute)
        brute_seconds_per_prompt = statistics.mean(b["seconds"] for b in brute) * length
        entry = {
            "layer": layer,
            "one_time": one_time,
            "proposal_ranks": proposal_ranks(sipit.policy, whitebox, prompts, layer)
            if isinstance(sipit.policy, LearnedPolicy) else {},
            "sipit": {
                "exact_match_rate": statistics.mean(r["exact"] for r in rows),
                "token_accuracy": statistics.mean(r["token_accuracy"] for r in rows),
                "median_seconds_per_prompt": statistics.median(seconds),
                "mean_seconds_per_prompt": statistics.mean(seconds),
                "median_seconds_natural": statistics.median(r["seconds"] for r in rows if r["kind"] == "natural")
                if any(r["kind"] == "natural" for r in rows) else None,
                "candidates_per_position": per_position,
                "explored_percent": 100 * per_position / vocab,
                "prompts": rows,
            },
            "bruteforce": {
                "positions": brute,
                "candidates_per_position": brute_per_position,
                "explored_percent": 100 * brute_per_position / vocab,
                "seconds_per_prompt_extrapolated": brute_seconds_per_prompt,
                "correct": all(b["correct"] for b in brute),
            },
            "speedup_candidates": brute_per_position / per_position,
            "speedup_time_mean": brute_seconds_per_prompt / statistics.mean(seconds),
            # the one-time setup this run paid (built, or loaded from the cache) spread over its prompts
            "speedup_time_amortised": brute_seconds_per_prompt * len(rows) / (sum(seconds) + _one_time_seconds(one_time)),
            "one_time_built": bool(one_time) and not _one_time_cached(one_time),
        }
        report["layers"].append(entry)
        print(format_row(entry), flush=True)
        for line in detail_lines(entry):
            print(line, flush=True)
    out = Path(out) if out is not None else default_out_dir("speed")
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "speed.json", json.dumps(report, indent=2))
    write_text_atomic(out / "speed.md", to_markdown(report))
    return report


def prepare_policy(policy, whitebox: WhiteBox, layer: int, tokenizer) -> dict:
    """Build (or load) what the policy needs for ``layer`` before timing; report what it cost."""
    started = time.perf_counter()
    policy.prepare(whitebox, layer, tokenizer)
    if not isinstance(policy, LearnedPolicy):
        return {}
    return {"seconds": time.perf_counter() - started,
            "table": {"seconds": policy.table.seconds, "cached": policy.table.cached},
            "heads": [report.to_dict() for _, report in policy.heads.values()]}


def _one_time_seconds(one_time: dict) -> float:
    return float(one_time.get("seconds", 0.0)) if one_time else 0.0


def _one_time_cached(one_time: dict) -> bool:
    return one_time["table"]["cached"] and all(head["cached"] for head in one_time["heads"])


def detail_lines(entry: dict) -> list[str]:
    """The one-time cost and the proposal ranks of one layer, as plain lines."""
    lines = []
    if entry["one_time"]:
        table = entry["one_time"]["table"]
        lines.append(f"  layer {entry['layer']} one-time: position-0 table {table['seconds']:.1f} s "
                     f"({'loaded' if table['cached'] else 'built'})")
        for head in entry["one_time"]["heads"]:
            lines.append(f"  layer {entry['layer']} one-time: inverse head of position"
                         f"{' 1' if head['slot'] == 1 else 's >= 2'} {head['seconds']:.1f} s "
                         f"({'loaded' if head['cached'] else 'trained on ' + str(head['n_train']) + ' tokens'}; "
                         f"held-out recall@1 {head['top1']:.3f}, @16 {head['top16']:.3f})")
    for name, r in entry["proposal_ranks"].items():
        lines.append(f"  layer {entry['layer']} rank of the true token under {name}: median {r['median']:.0f}, "
                     f"mean {r['mean']:.1f}, recall@1 {r['top1']:.3f}, @16 {r['top16']:.3f} (n={r['n']})")
    return lines


HEADER = ("| layer | exact | token acc | median s/prompt | mean s/prompt | cand./pos | % vocab | "
          "BF cand./pos | BF s/prompt (extrap.) | fewer cand. | less time | less time incl. one-time |")


def format_row(entry: dict) -> str:
    s, b = entry["sipit"], entry["bruteforce"]
    return (f"| {entry['layer']} | {s['exact_match_rate']:.2f} | {s['token_accuracy']:.3f} | "
            f"{s['median_seconds_per_prompt']:.2f} | {s['mean_seconds_per_prompt']:.2f} | "
            f"{s['candidates_per_position']:.1f} | {s['explored_percent']:.3f} | "
            f"{b['candidates_per_position']:.0f} | {b['seconds_per_prompt_extrapolated']:.1f} | "
            f"{entry['speedup_candidates']:.0f}x | {entry['speedup_time_mean']:.0f}x | "
            f"{entry['speedup_time_amortised']:.0f}x ({'built' if entry['one_time_built'] else 'loaded'}) |")


def to_markdown(report: dict) -> str:
    lines = [f"# SipIt vs BruteForce on {report['model']}", "",
             f"{report['n_prompts']} prompts of {report['length']} tokens (90% natural, 10% random), "
             f"V = {report['vocab_size']}, {report['threads']} threads, torch {report['torch']}. "
             "BruteForce ran on the listed positions only; its per-prompt time is the per-position "
             "mean x prompt length. 'less time incl. one-time' spreads the one-time setup this run paid "
             "(position-0 table and inverse heads, built or loaded from the cache) over its prompts.", "",
             HEADER, "|" + "---|" * 12]
    lines += [format_row(e) for e in report["layers"]]
    lines += ["", f"Policy: {report['policy']}. One-time costs and proposal ranks (rank 0 = first):", ""]
    lines += [f"- {line.strip()}" for e in report["layers"] for line in detail_lines(e)]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.experiments.speed", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL, help="registry name, HF model dir, .gguf file or hub id")
    parser.add_argument("--n-prompts", type=arg(check_int, low=1), default=10)
    parser.add_argument("--length", type=arg(check_int, low=1), default=20, help="tokens per prompt")
    parser.add_argument("--layers", type=arg(check_layer_spec, name=""), default="first,middle,last",
                        help="comma list of first, middle, last or layer numbers (negative: from the end)")
    parser.add_argument("--bruteforce-positions", type=arg(check_int, low=1), default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--split", choices=SPLITS, default="test", help="the prompts' split (benchmarks.prompts)")
    parser.add_argument("--policy", choices=sorted(POLICIES), default="learned",
                        help="SipIt's candidate order (gradient: no learned parts, as before)")
    parser.add_argument("--out", default=None, help=f"results folder (default {default_out_dir('speed')})")
    return parser


def speed_command(args: argparse.Namespace) -> int:
    print(HEADER, flush=True)
    started = time.perf_counter()
    out = Path(args.out) if args.out is not None else default_out_dir("speed")
    check_provenance(out)
    run_speed(args.model, args.n_prompts, args.length, args.layers, args.bruteforce_positions, args.seed, out,
              args.policy, args.split)
    print(f"total {time.perf_counter() - started:.0f} s; written to {out}/speed.json and speed.md")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_main(build_parser(), speed_command, argv)


if __name__ == "__main__":
    raise SystemExit(main())
