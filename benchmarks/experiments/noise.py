"""Recovery under Gaussian noise versus the margin Delta/2 and versus sigma.

    python -m benchmarks.experiments.noise --model smollm2-135m --layer 15 --sigmas 10,16,22 --n-prompts 20 \
        --length 5 --exact-prompts 1 --exact-positions 2 --draws 30 --n-fit 1024 \
        --decoders nn-shortlist,map,beam --out runs/noise-l15

Two parts, both with isotropic noise n ~ N(0, sigma^2 I_d) added to the full-forward states h:

A. EXACT, teacher-forced (first ``--exact-prompts`` prompts, first ``--exact-positions``
   positions each): on the TRUE prefix every token's state mu_{p_t,v} is computed (full
   vocabulary, chunked), giving Delta_t exactly, and for each sigma and each of ``--draws`` noise
   draws the exact nearest neighbour and the exact MAP token (prior = the model's next-token
   distribution on the true prefix). The theorem is asserted here: whenever
   ||h~_t - mu_{p_t,s_t}|| < Delta_t / 2 the exact NN must return s_t (a violation raises).
B. FREE-RUNNING decoders on ``--n-prompts`` prompts (``--decoders``): greedy NN (shortlist), NN
   with the heuristic chi2 stop, MAP and beam+prior (attacks.robust; all but the heuristic on the
   same surrogate-ranked shortlist, ``--ranking``/``--n-fit``/``--k-proxy``), one noise draw per
   (prompt, sigma) shared by every decoder. Reported: token accuracy, exact recovery, how often
   the true token was outside greedy's shortlist (at positions whose decoded prefix was
   correct), how often greedy's choice equals the exact NN of the same observed state (where
   part A holds the position's full table), how often the heuristic stop accepted a wrong token
   inside the noise radius, and the sigma where greedy (and exact NN) cross 50% with every
   decoder's accuracy interpolated there.

Where Delta_t is known (part A positions), part B positions also get ||n_t|| / (Delta_t / 2).
Each free-running path also gets the decoder's own energy (negative log posterior) and the true path's on the
same noise: a wrong path that scores better is an error of the posterior (no search fixes it), one that scores
worse an error of the search. ``--rescore NOISE_JSON`` adds these to an earlier run without decoding.
Outputs: ``noise.json`` (every position record), ``noise.md`` (tables), ``noise.png`` (plot).

Part B keeps its finished prompts in ``--out``/``noise.progress.json`` (rewritten atomically after each
prompt): an interrupted run loses at most the prompt it was decoding, and the same command continues it
(the noise draws depend only on the seed, the sigma and the prompt). A run with other options refuses that
folder rather than mix rows; the file is removed once ``noise.json`` is written.
"""

from __future__ import annotations

if __name__ == "__main__":  # before the imports: Ctrl-C while they load is one line (benchmarks.startup)
    from benchmarks.startup import guard_startup

    guard_startup()

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from attacks.policies import POLICIES
from attacks.registry import AttackOptions, Exposure, build
from attacks.robust import RANKINGS
from benchmarks.cli import (arg, check_float, check_floats, check_int, check_names, default_out_dir, interrupt_once,
                            run_main)
from benchmarks.out_dir import check_provenance
from benchmarks.prompts import SPLITS, load_prompts
from sipit.atomic import write_text_atomic
from sipit.margins import margin_from_states
from sipit.models import DEFAULT_MODEL, load_model
from sipit.prior import NextTokenPrior
from sipit.vocab_table import vocabulary_states
from sipit.whitebox import WhiteBox

PROGRESS_FILE = "noise.progress.json"
PARTIAL_FILE = "noise.partial.md"  # the summary of the sigmas finished so far, while a run goes on
NOT_RUN_OPTIONS = ("out", "threads", "rescore")  # options that do not change a run's rows
MIN_PLOTTED = 10  # free-running positions a ratio bin needs before the plot draws it
RATIO_BINS = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0, math.inf]


@torch.no_grad()
def exact_part(wb, prompts, layer, sigmas, draws, positions, chunk, seed) -> tuple[list[dict], dict]:
    """Part A: exact Delta_t, exact NN and MAP on the true prefix, theorem asserted.

    Returns the rows and the full-vocabulary state tables ``{(prompt, position): (V, d)}`` (part B
    uses them to check its shortlist decoders against the exact nearest neighbour)."""
    rows, tables = [], {}
    g = torch.Generator().manual_seed(seed + 1)
    for p, ids in enumerate(prompts):
        h = wb.states(ids, layer)
        prefix = wb.prefix_cache([], layer)
        prior = NextTokenPrior(wb.model)
        for t in range(min(positions, len(ids))):
            s = ids[t]
            mu = tables[(p, t)] = vocabulary_states(wb, prefix, chunk)  # memoised: the decoders reuse it
            delta, competitor = margin_from_states(mu, s)
            logp = prior.logprobs.double() if prior.logprobs is not None else torch.zeros(wb.vocab_size, dtype=torch.float64)
            for sigma in sigmas:
                for k in range(draws):
                    observed = h[t] + sigma * torch.randn(wb.d, generator=g)
                    dist = (mu - observed).norm(dim=-1)
                    noise = float(dist[s])  # ||h~_t - mu_{p_t,s_t}||: the noise plus the float gap
                    nn = int(dist.argmin())
                    if sigma > 0:
                        mp = int((dist.double() ** 2 / (2 * sigma**2) - logp).argmin())
                    else:
                        mp = nn
                    if noise < delta / 2 and nn != s:
                        raise AssertionError(f"theorem violated: prompt {p} position {t} ||n||={noise} "
                                             f"Delta/2={delta / 2} decoded {nn} true {s}")
                    rows.append({"prompt": p, "position": t, "sigma": sigma, "draw": k, "delta": delta,
                                 "competitor": competitor, "noise": noise, "ratio": noise / (delta / 2),
                                 "noise_over_sigma_sqrt_d": noise / (sigma * math.sqrt(wb.d)) if sigma else 0.0,
                                 "nn_exact": nn == s, "map_exact": mp == s})
            prefix = wb.extend(prefix, s)
            prior.push(s)
            print(f"  exact: prompt {p} position {t} Delta={delta:.4g}", flush=True)
    return rows, tables


DECODERS = ("nn-shortlist", "nn-heuristic", "map", "beam")  # attacks.registry names


def decoders(sigma: float, args) -> list:
    """The free-running decoders named in ``args.decoders`` (attacks.registry), all on the same shortlist settings."""
    table = {"exact_positions": args.table_positions} if args.table_positions is not None else {}
    options = AttackOptions(beam_width=args.width, beam_early_width=args.early_width,
                            beam_early_positions=args.early_positions, beam_refine_k=args.refine_k,
                            prior_mix=args.prior_mix, policy=args.policy,
                            max_candidates=args.k_prior + args.rounds * args.k_grad,
                            shortlist=dict(k_prior=args.k_prior, k_grad=args.k_grad, rounds=args.rounds,
                                           ranking=args.ranking, n_fit=args.n_fit, k_proxy=args.k_proxy,
                                           k_wide=args.k_wide, **table))
    return [build(name, Exposure(sigma=sigma, exact=False), options) for name in args.decoders]


def free_noise(h: torch.Tensor, sigma: float, seed: int, sigma_index: int, prompt: int) -> torch.Tensor:
    """Part B's noise draw for one (prompt, sigma): shared by every decoder, reproducible from the seed."""
    g = torch.Generator().manual_seed(seed * 1000 + sigma_index * 100 + prompt)
    return sigma * torch.randn(h.shape, generator=g)


def add_energies(wb, layer, prompts, sigmas, args, rows: list[dict]) -> None:
    """Each free-running row gets ``energy`` and ``true_energy``: the decoder's own objective
    (attacks.robust.MapBeamSearch.path_energy) of the path it decoded and of the true path, on the same
    noise draw. A wrong path with the lower energy is the posterior's error, one with the higher the search's."""
    for si, sigma in enumerate(sigmas):
        for p, ids in enumerate(prompts):
            h = wb.states(ids, layer)
            observed = h + free_noise(h, sigma, args.seed, si, p)
            for dec in decoders(sigma, args):
                path = [r for r in rows if r["decoder"] == dec.name and r["sigma"] == sigma and r["prompt"] == p]
                if not path:
                    continue
                decoded = [r["token"] for r in sorted(path, key=lambda r: r["position"])]
                energy = dec.path_energy(observed, wb, layer, decoded)
                true_energy = energy if decoded == ids else dec.path_energy(observed, wb, layer, ids)
                for r in path:
                    r["energy"], r["true_energy"] = energy, true_energy


def free_part(wb, prompts, layer, sigmas, args, deltas: dict, on_sigma=None, tables: dict | None = None,
              tokenizer=None, done: list[dict] | None = None, on_prompt=None) -> list[dict]:
    """Part B: free-running decoders, one shared noise draw per (prompt, sigma).

    Where part A holds the full-vocabulary table of a (prompt, position) and the decoded prefix is
    correct, the row also records the exact nearest neighbour of the same observed state. The rows of
    ``done`` (whole (sigma, prompt) pairs of an interrupted run) are kept and not decoded again;
    ``on_prompt(rows)`` is called after each prompt."""
    tables = tables or {}
    rows = []
    for si, sigma in enumerate(sigmas):
        started = time.perf_counter()
        for p, ids in enumerate(prompts):
            kept = [r for r in done or [] if r["sigma"] == sigma and r["prompt"] == p]
            if kept:
                rows.extend(kept)
                continue
            h = wb.states(ids, layer)
            noise = free_noise(h, sigma, args.seed, si, p)
            for dec in decoders(sigma, args):
                inv = dec.invert(h + noise, wb, layer, tokenizer)  # the learned ranking trains heads on text
                cands = getattr(dec, "last_candidates", None)
                searched = dec.searched if getattr(dec, "refine_k", 0) else None  # the beam's path before refine()
                for t, rec in enumerate(inv.positions):
                    prefix_ok = inv.ids[:t] == ids[:t]
                    delta = deltas.get((p, t))
                    n_norm = float(noise[t].norm())
                    table = tables.get((p, t)) if prefix_ok else None
                    exact_nn = int((table - (h[t] + noise[t])).norm(dim=-1).argmin()) if table is not None else None
                    rows.append({"decoder": dec.name, "sigma": sigma, "prompt": p, "position": t,
                                 "token": rec.token, "true": ids[t], "correct": rec.token == ids[t],
                                 "prefix_correct": prefix_ok, "noise": n_norm,
                                 "ratio": n_norm / (delta / 2) if delta else None,
                                 "in_radius": rec.verified, "candidates": rec.candidates_tried,
                                 "in_shortlist": bool((cands[t] == ids[t]).any()) if cands and prefix_ok else None,
                                 "exact_nn": exact_nn,
                                 "agrees_exact_nn": rec.token == exact_nn if exact_nn is not None else None,
                                 "seconds": rec.seconds, **({"searched": searched[t]} if searched else {})})
            if on_prompt is not None:
                on_prompt(rows)
            print(f"  free: sigma={sigma} prompt {p} done ({time.perf_counter() - started:.0f} s)", flush=True)
        print(f"  free: sigma={sigma} done in {time.perf_counter() - started:.0f} s", flush=True)
        if on_sigma is not None:
            on_sigma(sigmas[: si + 1], rows)
    return rows


def _mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else float("nan")


def summarise(exact_rows, free_rows, sigmas, d) -> dict:
    names = sorted({r["decoder"] for r in free_rows}, key=DECODERS.index)
    by_sigma = {}
    for sigma in sigmas:
        row = {"sigma": sigma, "sigma_sqrt_d": sigma * math.sqrt(d)}
        for name in names:
            rs = [r for r in free_rows if r["decoder"] == name and r["sigma"] == sigma]
            row[name] = _mean(r["correct"] for r in rs)
            row[name + "_exact_prompts"] = _mean(
                all(r["correct"] for r in rs if r["prompt"] == p) for p in {r["prompt"] for r in rs})
            row.update({f"{name}_{k}": v for k, v in error_sources(rs).items()})
            if rs and all("searched" in r for r in rs):
                row[name + "_searched"] = _mean(r["searched"] == r["true"] for r in rs)
            row[name + "_by_position"] = [_mean(r["correct"] for r in rs if r["position"] == t)
                                          for t in range(max((r["position"] + 1 for r in rs), default=0))]
        ex = [r for r in exact_rows if r["sigma"] == sigma]
        row["nn_exact_tf"] = _mean(r["nn_exact"] for r in ex)
        row["map_exact_tf"] = _mean(r["map_exact"] for r in ex)
        sl = [r["in_shortlist"] for r in free_rows if r["decoder"] == "nn-shortlist" and r["sigma"] == sigma
              and r["in_shortlist"] is not None]
        row["true_outside_shortlist"] = 1 - _mean(sl) if sl else float("nan")
        he = [r for r in free_rows if r["decoder"] == "nn-heuristic" and r["sigma"] == sigma and r["prefix_correct"]]
        row["heuristic_wrong_stop"] = _mean(r["in_radius"] and not r["correct"] for r in he)
        ag = [r["agrees_exact_nn"] for r in free_rows if r["decoder"] == "nn-shortlist" and r["sigma"] == sigma
              and r.get("agrees_exact_nn") is not None]
        row["shortlist_nn_agrees_exact"] = _mean(ag)
        row["n_agree_checked"] = len(ag)
        by_sigma[sigma] = row
    by_ratio = []
    for lo, hi in zip(RATIO_BINS[:-1], RATIO_BINS[1:]):
        ex = [r for r in exact_rows if lo <= r["ratio"] < hi and r["sigma"] > 0]
        entry = {"lo": lo, "hi": hi, "n_exact": len(ex), "nn_exact_tf": _mean(r["nn_exact"] for r in ex),
                 "map_exact_tf": _mean(r["map_exact"] for r in ex)}
        for name in names:
            rs = [r for r in free_rows if r["decoder"] == name and r["ratio"] is not None and r["sigma"] > 0
                  and lo <= r["ratio"] < hi]
            entry[name] = _mean(r["correct"] for r in rs)
            entry["n_" + name] = len(rs)
        by_ratio.append(entry)
    # Where exact NN collapses (< 50%) in units of Delta/2, and the sigma where greedy drops to 50%.
    collapse = next((b for b in by_ratio if b["n_exact"] and b["nn_exact_tf"] < 0.5), None)
    rows = list(by_sigma.values())
    greedy50 = crossing(rows, "nn-shortlist", 0.5, d) if "nn-shortlist" in names else None
    exact50 = crossing(rows, "nn_exact_tf", 0.5, d) if exact_rows else None
    return {"decoders": names, "by_sigma": rows, "by_ratio": by_ratio,
            "nn_collapse_bin": collapse, "greedy_50": greedy50, "exact_nn_50": exact50}


def error_sources(rows: list[dict]) -> dict:
    """Of one decoder's wrong prompts (rows with energies, :func:`add_energies`), how many the posterior
    prefers to the truth (``posterior_errors``: no search over this score fixes them) and how many it does
    not (``search_errors``), with the wrong tokens in each."""
    out = {"posterior_errors": 0, "search_errors": 0, "posterior_error_tokens": 0, "search_error_tokens": 0}
    for p in sorted({r["prompt"] for r in rows}):
        path = [r for r in rows if r["prompt"] == p]
        wrong = sum(not r["correct"] for r in path)
        if not wrong or "energy" not in path[0]:
            continue
        kind = "posterior" if path[0]["energy"] <= path[0]["true_energy"] else "search"
        out[kind + "_errors"] += 1
        out[kind + "_error_tokens"] += wrong
    return out


def crossing(rows: list[dict], key: str, level: float, d: int) -> dict | None:
    """The first sigma where ``key`` falls below ``level`` (linear interpolation between measured
    sigmas), with every other measured curve interpolated at that sigma; None if it never does."""
    for r0, r1 in zip(rows, rows[1:]):
        a0, a1 = r0[key], r1[key]
        if a0 >= level > a1:
            w = (a0 - level) / (a0 - a1)
            s50 = r0["sigma"] + w * (r1["sigma"] - r0["sigma"])
            at = {k: r0[k] + w * (r1[k] - r0[k]) for k in r0
                  if k not in ("sigma", "sigma_sqrt_d") and isinstance(r0[k], float) and isinstance(r1[k], float)}
            return {"curve": key, "sigma": s50, "sigma_sqrt_d": s50 * math.sqrt(d),
                    "bracket": [r0["sigma"], r1["sigma"]], "interpolated": at}
    return None


def _crossing_line(label: str, c: dict | None, names: list[str]) -> str:
    if c is None:
        return f"{label}: not reached in the measured sigma range"
    vals = ", ".join(f"{n} {c['interpolated'][n]:.3f}" for n in names if n in c["interpolated"])
    return (f"{label}: sigma = {c['sigma']:.3g} (sigma*sqrt(d) = {c['sigma_sqrt_d']:.3g}, between measured "
            f"{c['bracket'][0]:g} and {c['bracket'][1]:g}); interpolated there: {vals}")


def markdown(summary, meta) -> str:
    names = summary["decoders"]
    extra = [("beam exact-prompt", "beam_exact_prompts", ".2f")] if "beam" in names else []
    if all("beam_searched" in r for r in summary["by_sigma"]) and summary["by_sigma"]:
        extra.append(("beam before refine", "beam_searched", ".3f"))
    extra += [("exact NN (TF)", "nn_exact_tf", ".3f"), ("exact MAP (TF)", "map_exact_tf", ".3f"),
              ("true outside shortlist", "true_outside_shortlist", ".3f"),
              ("greedy = exact NN", "shortlist_nn_agrees_exact", ".3f")]
    if "nn-heuristic" in names:
        extra.append(("heuristic wrong stop", "heuristic_wrong_stop", ".3f"))
    lines = [f"model {meta['model']}, layer {meta['layer']}, d={meta['d']}, {meta['n_prompts']} prompts x "
             f"{meta['length']} tokens (free-running); exact part: {meta['exact_positions_total']} positions x "
             f"{meta['draws']} draws per sigma", "",
             "| sigma | sigma*sqrt(d) | " + " | ".join(names + [e[0] for e in extra]) + " |",
             "|---" * (len(names) + len(extra) + 2) + "|"]
    for r in summary["by_sigma"]:
        cells = [f"{r[n]:.3f}" for n in names] + [format(r[k], f) for _, k, f in extra]
        lines.append(f"| {r['sigma']:g} | {r['sigma_sqrt_d']:.3g} | " + " | ".join(cells) + " |")
    lines += ["", "Recovery by ||n|| / (Delta/2) (TF = teacher-forced exact; others free-running, n in brackets)", "",
              "| ratio bin | n exact | exact NN (TF) | exact MAP (TF) | " + " | ".join(names) + " |",
              "|---" * (len(names) + 4) + "|"]
    for b in summary["by_ratio"]:
        if not b["n_exact"] and not any(b["n_" + n] for n in names):
            continue
        cells = " | ".join(f"{b[n]:.2f} ({b['n_' + n]})" if b["n_" + n] else "-" for n in names)
        lines.append(f"| [{b['lo']:g}, {b['hi']:g}) | {b['n_exact']} | {b['nn_exact_tf']:.2f} | {b['map_exact_tf']:.2f} | {cells} |")
    sources = [(r["sigma"], n, r) for r in summary["by_sigma"] for n in names
               if r.get(n + "_posterior_errors", 0) + r.get(n + "_search_errors", 0)]
    if sources:
        lines += ["", "Where the wrong prompts go wrong: the decoder's own energy (its negative log posterior) of the "
                  "decoded path against the true path's, same noise. Posterior errors: the wrong path scores better, "
                  "so no search over this score fixes them; search errors: the truth scores better.", "",
                  "| sigma | decoder | posterior errors: prompts (wrong tokens) | search errors: prompts (wrong tokens) |",
                  "|---|---|---|---|"]
        lines += [f"| {sigma:g} | {n} | {r[n + '_posterior_errors']} ({r[n + '_posterior_error_tokens']}) | "
                  f"{r[n + '_search_errors']} ({r[n + '_search_error_tokens']}) |" for sigma, n, r in sources]
    lines += ["", f"exact-NN collapse bin (<50%): {summary['nn_collapse_bin']}",
              _crossing_line("greedy NN (shortlist) at 50%", summary["greedy_50"], names),
              _crossing_line("exact NN (teacher-forced) at 50%", summary.get("exact_nn_50"), names)]
    return "\n".join(lines) + "\n"


def plot(summary, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    bins = [x for x in summary["by_ratio"] if x["n_exact"]]
    if not bins:  # no exact part: the free-running decoders' recovery by position instead
        for r in summary["by_sigma"]:
            for name in summary["decoders"]:
                accuracy = r.get(name + "_by_position", [])
                a.plot(range(len(accuracy)), accuracy, "o-", label=f"{name}, sigma {r['sigma']:g}")
        a.set_xlabel("position")
        a.set_ylabel("token recovery (free-running)")
        a.legend(fontsize=7)
    else:
        mids = [(x["lo"] + min(x["hi"], 2 * x["lo"] + 1)) / 2 for x in bins]
        a.plot(mids, [x["nn_exact_tf"] for x in bins], "o-", label="exact NN (teacher-forced)")
        a.plot(mids, [x["map_exact_tf"] for x in bins], "s-", label="exact MAP (teacher-forced)")
        for name in summary["decoders"]:
            pts = [(m, x[name]) for m, x in zip(mids, bins) if x["n_" + name] >= MIN_PLOTTED]
            if pts:
                a.plot(*zip(*pts), ".--", label=f"{name} (free-running, bins with n >= {MIN_PLOTTED})")
        a.axvline(1.0, color="grey", lw=0.8)
        a.set_xscale("symlog", linthresh=1)
        a.set_xlabel("||n|| / (Delta/2)")
        a.set_ylabel("token recovery")
        a.legend(fontsize=7)
    sig = [r["sigma"] for r in summary["by_sigma"]]
    for name in summary["decoders"]:
        b.plot(sig, [r[name] for r in summary["by_sigma"]], "o-", label=name)
    b.plot(sig, [r["nn_exact_tf"] for r in summary["by_sigma"]], "kx:", label="exact NN (TF)")
    b.set_xlabel("sigma (absolute, per coordinate)")
    b.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run(model: str, layer: int, sigmas: list[float], args, out: Path | None = None) -> dict:
    lm = load_model(model)
    wb = WhiteBox(lm.model)
    layer = wb.resolve_layer(layer)
    wb.check_length(args.length, "--length")
    prompts = load_prompts(lm.tokenizer, args.n_prompts, length=args.length, seed=args.seed, split=args.split)
    exact_rows, tables = exact_part(wb, prompts[: args.exact_prompts], layer, sigmas, args.draws,
                                    args.exact_positions, args.chunk, args.seed)
    deltas = {(r["prompt"], r["position"]): r["delta"] for r in exact_rows}
    meta = {"model": model, "layer": layer, "d": wb.d, "split": args.split, "n_prompts": len(prompts),
            "length": args.length,
            "draws": args.draws, "exact_positions_total": len({(r["prompt"], r["position"]) for r in exact_rows}),
            "args": vars(args), "threads": torch.get_num_threads()}

    def partial(done, rows):  # a run cut short by its time limit still leaves its finished sigmas
        if out is not None:
            write_text_atomic(out / PARTIAL_FILE, markdown(summarise(exact_rows, rows, done, wb.d), meta))

    options = run_options(args)
    progress = out / PROGRESS_FILE if out is not None else None
    done = resumed_rows(progress, options)
    if done:
        print(f"  resuming from {progress}: {len({(r['sigma'], r['prompt']) for r in done})} (sigma, prompt) "
              "pairs already decoded", flush=True)

    def checkpoint(rows):
        if progress is not None:
            write_text_atomic(progress, json.dumps({"options": options, "rows": rows}, default=str))

    free_rows = free_part(wb, prompts, layer, sigmas, args, deltas, partial, tables, lm.tokenizer, done, checkpoint)
    add_energies(wb, layer, prompts, sigmas, args, free_rows)
    summary = summarise(exact_rows, free_rows, sigmas, wb.d)
    return {"meta": meta, "summary": summary, "exact": exact_rows, "free": free_rows, "prompts": prompts}


def run_options(args: argparse.Namespace) -> dict:
    """The options that decide a run's rows, as JSON would give them back (a resumed run must match)."""
    return json.loads(json.dumps({k: v for k, v in vars(args).items() if k not in NOT_RUN_OPTIONS}, default=str))


def resumed_rows(progress: Path | None, options: dict) -> list[dict]:
    """The decoded rows an interrupted run of the same ``options`` left in ``progress`` (none if absent)."""
    if progress is None or not progress.exists():
        return []
    try:
        saved = json.loads(progress.read_text())
        saved_options, rows = saved["options"], saved["rows"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{progress} is not a progress file of this experiment ({err}): remove it to start over") from None
    differs = sorted(k for k in {**options, **saved_options} if options.get(k) != saved_options.get(k))
    if differs:
        raise ValueError(f"{progress.parent} holds an unfinished run with other options ({', '.join(differs)}): "
                         f"rerun its command to finish it, remove {progress.name} to discard it, or choose another --out")
    return rows


def rescore(path: Path) -> dict:
    """An earlier run's result (its ``noise.json``) with the energies of :func:`add_energies` added and
    its summary redone: no decoding, the run's own options and noise draws."""
    try:
        result = json.loads(Path(path).read_text())
        meta = result["meta"]  # a run recorded before an option was added ran its default
        run_args = argparse.Namespace(**{**vars(build_parser().parse_args([])), **meta["args"]})
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"--rescore {path}: not a noise.json of this experiment ({err})") from None
    wb = WhiteBox(load_model(meta["model"]).model)
    add_energies(wb, meta["layer"], result["prompts"], run_args.sigmas, run_args, result["free"])
    result["summary"] = summarise(result["exact"], result["free"], run_args.sigmas, wb.d)
    return result


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.experiments.noise", description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    count = arg(check_int, low=1)
    ap.add_argument("--model", default=DEFAULT_MODEL, help="registry name, HF model dir, .gguf file or hub id")
    ap.add_argument("--layer", type=int, default=-1, help="layer attacked (negative: from the end)")
    ap.add_argument("--sigmas", type=arg(check_floats, low=0.0), default="0,0.5,1,2",
                    help="comma list of absolute noise sigmas >= 0")
    ap.add_argument("--n-prompts", type=count, default=20)
    ap.add_argument("--length", type=count, default=8, help="tokens per prompt")
    ap.add_argument("--exact-prompts", type=arg(check_int, low=0), default=1)
    ap.add_argument("--exact-positions", type=arg(check_int, low=0), default=4)
    ap.add_argument("--draws", type=count, default=20)
    ap.add_argument("--k-prior", type=arg(check_int, low=0), default=32)
    ap.add_argument("--k-grad", type=count, default=32)
    ap.add_argument("--rounds", type=arg(check_int, low=0), default=1)
    ap.add_argument("--width", type=count, default=4)
    ap.add_argument("--early-width", type=count, default=None,
                    help="beam width at the first --early-positions positions (default: --width)")
    ap.add_argument("--early-positions", type=arg(check_int, low=0), default=None,
                    help="how many positions the beam keeps --early-width hypotheses after (default: 2)")
    ap.add_argument("--table-positions", type=arg(check_int, low=0), default=None,
                    help="positions the shortlist decoders' best hypothesis scores over the whole vocabulary "
                         "(default: 1 for the learned rankings, 2 for the others)")
    ap.add_argument("--policy", default=AttackOptions.policy, choices=sorted(POLICIES),
                    help="candidate order of the radius decoder (nn-heuristic): learned, gradient or random")
    ap.add_argument("--ranking", default="surrogate", choices=RANKINGS, help="how the shortlist is ranked")
    ap.add_argument("--n-fit", type=count, default=1536, help="tokens the linear surrogate is fitted on")
    ap.add_argument("--k-proxy", type=count, default=128, help="surrogate-ranked tokens verified per round")
    ap.add_argument("--k-wide", type=arg(check_int, low=0), default=0,
                    help="learned rankings: the beam's best hypothesis also verifies the top K of head + prior and "
                         "of the head alone (attacks.robust.CandidateScorer.k_wide)")
    ap.add_argument("--refine-k", type=arg(check_int, low=0), default=None,
                    help="the beam's path then tries the K best-scored candidates of each position as single-token "
                         "substitutions, kept when they lower the path's energy (attacks.robust.MapBeamSearch.refine; "
                         "default: none)")
    ap.add_argument("--prior-mix", type=arg(check_float, low=0.0, below=1.0), default=0.0,
                    help="MAP's and the beam's prior is (1 - MIX) P + MIX / V (attacks.robust.mixed_log_prior)")
    ap.add_argument("--decoders", type=arg(check_names, choices=DECODERS), default=",".join(DECODERS),
                    help=f"comma list of {', '.join(DECODERS)}")
    ap.add_argument("--chunk", type=count, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--split", choices=SPLITS, default="dev",
                    help="the prompts' split (benchmarks.prompts): dev while decoders and options are compared and "
                         "diagnosed; test once, for the final figures of the chosen options")
    ap.add_argument("--threads", type=count, default=None)
    ap.add_argument("--out", default=None, help=f"results folder (default {default_out_dir('noise')})")
    ap.add_argument("--rescore", default=None, metavar="NOISE_JSON",
                    help="decode nothing: add the path energies to an earlier run's noise.json (its own options "
                         "and noise draws; the options above are ignored) and write its tables to --out")
    return ap


def noise_command(args: argparse.Namespace) -> int:
    """Run both parts and write noise.json, noise.md and noise.png to ``--out``."""
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out) if args.out is not None else default_out_dir("noise")
    check_provenance(out)
    with interrupt_once():  # SIGINT or SIGTERM: say what is kept (the progress file) and exit 130
        try:
            result = rescore(args.rescore) if args.rescore else run(args.model, args.layer, args.sigmas, args, out)
        except KeyboardInterrupt:
            kept = out / PROGRESS_FILE
            where = f"the finished prompts are in {kept}; the same command continues" if kept.exists() else \
                "no prompt was finished"
            print(f"interrupted: {where}", file=sys.stderr, flush=True)
            return 130
    write_text_atomic(out / "noise.json", json.dumps(result, indent=1, default=str))
    md = markdown(result["summary"], result["meta"])
    write_text_atomic(out / "noise.md", md)
    plot(result["summary"], out / "noise.png", f"{result['meta']['model']} layer {result['meta']['layer']}")
    for leftover in (PROGRESS_FILE, PARTIAL_FILE):  # the finished files replace them
        (out / leftover).unlink(missing_ok=True)
    print(md)
    return 0


def main(argv=None) -> int:
    return run_main(build_parser(), noise_command, argv)


if __name__ == "__main__":
    raise SystemExit(main())
