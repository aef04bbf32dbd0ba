"""The benchmark run: SipIt vs a trained softmax classification head under a defence, logged to MLflow.

    python -m benchmarks.run --defense noise --sigma 0.1
    python -m benchmarks.run --defense none
    python -m benchmarks.run --model tiny-gpt2 --defense quant,noise --quant int8 --sigma-rel 0.05
    python -m benchmarks.run --defense quant:weights=nf4 --defense noise:sigma=0.5,placement=exposure

One run: load the model, apply the defence (served model + exposure), expose the layer-l states
of every evaluation prompt, then invert them with each attack and compare with the truth.
Prints a comparison table, writes ``results.json`` (plus CSVs and plots) to ``--out`` and logs
one parent MLflow run with one nested run per attack (benchmarks.tracking). The options form a
:class:`benchmarks.config.RunConfig` (defence specs, attacks, sizes, seeds, output), which the CLI
builds and :func:`run_benchmark` runs; the measurement itself goes through benchmarks.pipeline
(expose -> attack -> metrics), as the search's trials do.

Attacks (``--attacks``, comma list):

- ``sipit``: the strongest SipIt form that knows the defence, chosen by attacks.registry
  (``strongest``): exact SipIt on exact exposure; under Gaussian noise (and for stored activations,
  whose format error the attacker knows as a sigma) the ``--robust`` decoder given that absolute
  sigma (``map``, the default: greedy MAP on the shortlist; ``beam``; ``shortlist``; ``radius``: SipIt's
  own loop accepting the first token within the chi^2 noise radius, else the nearest of
  ``--radius-budget`` candidates; docs/noise.md); nearest neighbour on the gradient shortlist for
  inexact states whose error the attacker does not know (``--no-knows-defense``); the pooled beam
  search on pooled exposure; key recovery on a keyed exposure (permute, rotate; ``--known-pairs``).
- ``blind``: the ``--robust`` noise decoder not told sigma: it estimates it from the exposure
  (attacks.blind), beside ``sipit``'s informed decoder.
- ``softmax-head``: the learned head of attacks.head, trained on the offline corpus
  (benchmarks.corpus). Under a defence two variants run: trained on clean states, and
  ``softmax-head-adaptive`` trained on states passed through the defence's exposure.
  candidates_tried = 0 (it never runs the model).
- ``inverse-head``: the classification baseline made of the learned inverse heads (attacks.head.
  InverseHeadAttack: position 0 from the position-0 table, later positions by the head's argmax;
  trained once per model and layer on a large offline corpus and cached, minutes at smollm2's deep
  layers the first time). Trained on clean states (no noise-adapted variant yet).
- ``bruteforce``: SipIt with a random candidate order (optional; ~V/2 candidates per position).

Margins: Delta_t over the full vocabulary costs one sweep of V candidates (~100 s per position at
the last layer of smollm2 on 2 cores). Position 0 of every prompt reads the position-0 table
(built once per model and layer and cached; the learned proposals use the same table); of
``--margin-positions`` seeded (prompt, position) pairs, each later position gets a sweep (-1 = every
position, fine on tiny models). ||n_t|| is measured at every position (the benchmark knows the true states).

Candidate order (``--policy``): ``learned`` (the default) orders exact SipIt's candidates, and the
radius decoder's under noise, with the position-0 table and the inverse heads (attacks.proposals:
trained once per model and layer, minutes the first time at smollm2's deep layers, then loaded in
about a second); ``gradient`` skips every learned part.
"""

from __future__ import annotations

if __name__ == "__main__":  # before the imports: Ctrl-C while they load is one line (benchmarks.startup)
    from benchmarks.startup import guard_startup

    guard_startup()

import argparse
import json
import sys
import time
from pathlib import Path


from attacks.policies import POLICIES
from attacks.registry import EXACT_ATTACKS, ROBUST, RUN_ATTACKS, AttackOptions, describe
from benchmarks.config import MINIMUMS, RunConfig, sweep_configs
from benchmarks.prompts import SPLITS
from sipit.models import DTYPES
from sipit.whitebox import EXPOSURES
from benchmarks.run_outputs import RunState, flat_metrics, format_table, write_outputs
from benchmarks.cli import UsageError, arg, check_floats, check_int, default_out_dir, interrupt_once, run_main
from benchmarks.out_dir import claim

DEFAULTS = RunConfig()

BenchmarkUsageError = UsageError  # the name callers of run_benchmark know


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM) stopped the run; ``str()`` says what the cleanup actually did."""


# --------------------------------------------------------------------------- the run
def run_benchmark(config: RunConfig | None = None, *, progress: bool = True, log=print, parent_run: str | None = None,
                  **options) -> dict:
    """Run the benchmark ``config`` (or ``RunConfig.from_options(**options)``); return the results dict
    (also written to ``config.out``/results.json).

    Raises :class:`BenchmarkUsageError` for bad options before any heavy work. On Ctrl-C (or
    SIGTERM) once the run has started, further Ctrl-C are ignored while the partial results are
    written (``status: interrupted``) and the MLflow runs are marked FAILED; then
    :class:`RunInterrupted` (a KeyboardInterrupt) propagates, saying what the cleanup did.
    """
    started = time.perf_counter()
    if config is None:
        config = RunConfig.from_options(**options)
    elif options:
        raise BenchmarkUsageError(f"give either a RunConfig or options, not both (got {sorted(options)})")
    config.validate()  # cheap checks first
    loaded, clean_wb = load_for(config)
    layer, prompt_set = check_against_model(config, loaded, clean_wb)
    out = claim(config.out if config.out is not None else default_out_dir(f"run-{config.hash()}"))
    try:
        return _run_claimed(config, out, loaded, clean_wb, layer, prompt_set, progress=progress, log=log,
                            parent_run=parent_run, started=started)
    finally:
        out.release()


def load_for(config: RunConfig):
    """(LoadedModel, WhiteBox) of ``config.model``; a model that cannot be loaded is a UsageError naming --model."""
    from sipit.models import load_model
    from sipit.whitebox import WhiteBox

    try:
        loaded = load_model(config.model, dtype=config.dtype, device=config.device)
    except (ValueError, OSError, ModuleNotFoundError) as err:
        raise BenchmarkUsageError(f"--model {config.model!r}: {err}") from None
    return loaded, WhiteBox(loaded.model, exposure=config.exposure)


def check_against_model(config: RunConfig, loaded, clean_wb) -> tuple[int, list]:
    """The checks that need the model, before anything is written: the layer, the length, the defence's
    parameters (e.g. more tying groups than tokens, a pooling group that does not divide d, noise too large
    for float32), the utility text and the prompts. Returns (resolved layer, prompt set); UsageError names
    the flag."""
    from benchmarks.prompts import named_prompt_set
    from defenses.base import DefenseParamError
    from sipit.whitebox import SipitInputError

    c = config
    try:
        layer = clean_wb.resolve_layer(c.layer)
    except SipitInputError as err:
        raise BenchmarkUsageError(f"--layer: {err}") from None
    try:
        clean_wb.check_length(c.length, "--length")
    except SipitInputError as err:
        raise BenchmarkUsageError(str(err)) from None
    try:
        c.chain().check_model(loaded)
        c.chain().check_exposure(clean_wb.exposure, clean_wb.d)
    except DefenseParamError as err:
        raise BenchmarkUsageError(f"--defense {' '.join(c.defenses)}: {err}") from None
    if c.known_pairs > 4 * clean_wb.d:
        raise BenchmarkUsageError(f"--known-pairs {c.known_pairs}: more than 4 x d = {4 * clean_wb.d} pairs add nothing "
                                  f"(each pair gives at least one row; d independent rows determine a d x d mixing)")
    if c.utility_tokens:
        from defenses.utility import held_out_ids

        try:
            held_out_ids(loaded.tokenizer, c.utility_tokens, c.seeds["utility"])
        except ValueError as err:
            raise BenchmarkUsageError(f"--utility-tokens {c.utility_tokens}: {err}") from None
    try:
        prompt_set = named_prompt_set(c.prompts, loaded.tokenizer, c.n_prompts, length=c.length,
                                      seed=c.seeds["prompts"], split=c.split)
    except ValueError as err:
        raise BenchmarkUsageError(f"--prompts {c.prompts!r}: {err}") from None
    prompt_set = [p for p in prompt_set if p.ids]
    if not prompt_set:
        raise BenchmarkUsageError(f"--prompts {c.prompts!r}: no prompt has any token")
    return layer, prompt_set


def _run_claimed(c: RunConfig, out, loaded, clean_wb, layer_r: int, prompt_set, *, progress: bool, log,
                 parent_run: str | None, started: float) -> dict:
    """The run of :func:`run_benchmark` once its results folder ``out`` (benchmarks.out_dir) is claimed."""
    from benchmarks import tracking as tracking_mod

    chain, defense_names, seeds = c.chain(), c.defense_names(), c.seeds
    recorded, chash, out_dir = c.record(), c.hash(), out.path
    # ---------------------------------------------------------------- tracking store
    tracker, tracking_error = None, None
    if c.track:
        try:
            tracker = tracking_mod.Tracker(c.tracking_uri, c.experiment)
        except tracking_mod.TrackingError as err:
            tracking_error = str(err)
            log(f"error: {err}\n  -> continuing without MLflow; results are still written to {out_dir}", file=sys.stderr)
    orphan = out.previous.get("mlflow_run")
    if tracker is not None and orphan and out.previous.get("tracking_uri") == tracker.uri:
        closed = tracker.close_orphan(orphan, f"killed: closed by the next run in {out_dir} "
                                              f"(the run of pid {out.previous.get('pid')} ended without closing it)")
        if closed:
            log(f"[run] closed {closed} MLflow run(s) left RUNNING by a killed run in {out_dir}", file=sys.stderr)

    title = (f"{loaded.name} layer {layer_r}/{clean_wb.n_layers} | defence {','.join(defense_names)} "
             f"{json.dumps(chain.params(), default=str)} | {len(prompt_set)} prompts x {c.length} tokens")
    results: dict = {
        "status": "running", "title": title, "config": recorded, "config_hash": chash, "seeds": seeds,
        "git_commit": tracking_mod.git_commit(), "packages": tracking_mod.package_versions(),
        "model": {"name": loaded.name, "n_layers": clean_wb.n_layers, "d": clean_wb.d,
                  "vocab_size": clean_wb.vocab_size, "layer": layer_r},
        "defense": {"names": defense_names, "params": chain.params(), "describe": chain.describe(),
                    "per_position": chain.per_position},
        "attacks": {}, "heads": {}, "prompts": [], "margins": {}, "utility": {},
        "tracking": {"uri": tracker.uri if tracker else c.tracking_uri, "error": tracking_error, "run_id": None},
        "out": str(out_dir),
    }
    state = RunState(results)
    with interrupt_once():
        try:
            tracker = _start_parent(tracker, results, defense_names, chash, loaded.name, log, parent_run,
                                    prompt_set=prompt_set, tokenizer=loaded.tokenizer)
            if tracker is not None:
                out.note(mlflow_run=tracker.parent_id, tracking_uri=tracker.uri)
            _run(state, tracker, c, loaded, clean_wb, layer_r, chain, prompt_set, progress=progress, log=log)
            results["status"] = "finished"
            results["seconds"] = time.perf_counter() - started
            _finish(state, tracker, out_dir, log)
        except KeyboardInterrupt:  # later Ctrl-C are ignored from here on (interrupt_once)
            log("\ninterrupted: writing partial results and closing the MLflow runs (further Ctrl-C ignored)",
                file=sys.stderr)
            raise RunInterrupted(_close(state, tracker, out_dir, "interrupted", started)) from None
        except BaseException as err:
            _close(state, tracker, out_dir, f"failed: {type(err).__name__}: {err}", started)
            raise
    return results


def _start_parent(tracker, results: dict, defense_names: list[str], chash: str, model_name: str, log,
                  parent_run: str | None = None, prompt_set=(), tokenizer=None):
    """Open the run's MLflow run (nested under ``parent_run``, a sweep's, when given) with the prompt set
    as its dataset input; on a store error, record it and go on without tracking (None)."""
    if tracker is None:
        return None
    try:
        tracker.start_parent(f"{','.join(defense_names)}-{chash[:6]}", {
            "config": results["config"], "seeds": results["seeds"], "packages": results["packages"],
            "git_commit": results["git_commit"], "model_info": results["model"]},
            {"config_hash": chash, "git_commit": results["git_commit"], "defense": ",".join(defense_names),
             "model": model_name, **({"mlflow.parentRunId": parent_run} if parent_run else {})})
        if prompt_set:
            c = results["config"]
            texts = [tokenizer.decode(p.ids) for p in prompt_set]  # spans: those whole in the text, as results.json
            rows = [{"index": i, "kind": p.kind, "text": text, "ids": p.ids,
                     "spans": [s for s in getattr(p, "spans", ()) if s in text]}
                    for i, (p, text) in enumerate(zip(prompt_set, texts))]
            tracker.log_prompts(tracker.parent_id, rows, f"prompts-{Path(str(c['prompts'])).name}-{len(rows)}x{c['length']}",
                                {"prompts": c["prompts"], "length": c["length"], "seed": results["seeds"]["prompts"],
                                 "tokenizer": model_name})
    except Exception as err:  # noqa: BLE001
        tracker.fail(f"cannot start the run: {err}")
        results["tracking"]["error"] = f"cannot log to MLflow store {tracker.uri!r}: {type(err).__name__}: {err}"
        log(f"error: {results['tracking']['error']}\n  -> continuing without MLflow", file=sys.stderr)
        return None
    results["tracking"]["run_id"] = tracker.parent_id
    return tracker


def _finish(state: RunState, tracker, out_dir: Path, log) -> None:
    """Write the outputs of a finished run and log them on the parent run, closed FINISHED."""
    results = state.results
    paths = write_outputs(out_dir, state)
    if tracker is None:
        return
    try:
        parent = tracker.parent_id
        tracker.log_metrics(parent, {"seconds_total": results["seconds"], **flat_metrics(results)})
        tracker.log_artifacts(parent, paths)
        tracker.finish(parent)
        results["tracking"]["url"] = tracker.run_url()
    except Exception as err:  # noqa: BLE001
        results["tracking"]["error"] = f"logging failed: {type(err).__name__}: {err}"
        tracker.fail(results["tracking"]["error"])
        log(f"error: {results['tracking']['error']}", file=sys.stderr)
    (out_dir / "results.json").write_text(json.dumps(results, indent=2, default=str))


def _close(state: RunState, tracker, out_dir: Path, status: str, started: float) -> str:
    """Write the partial results and mark the open MLflow runs FAILED; return what really happened."""
    state.results["status"] = status
    state.results["seconds"] = time.perf_counter() - started
    done = []
    try:
        write_outputs(out_dir, state)
        done.append(f"partial results written to {out_dir}")
    except Exception as err:  # noqa: BLE001 - report it, the runs must still be closed
        done.append(f"writing partial results to {out_dir} FAILED ({type(err).__name__}: {err})")
    if tracker is None:
        done.append("no MLflow run was open")
        return "; ".join(done)
    open_runs = list(tracker.open_runs)
    tracker.fail(f"{status}: partial results in {out_dir}")
    try:
        statuses = [tracker.client.get_run(run_id).info.status for run_id in open_runs]
    except Exception as err:  # noqa: BLE001
        done.append(f"MLflow run status unknown ({type(err).__name__}: {err})")
        return "; ".join(done)
    failed = sum(s == "FAILED" for s in statuses)
    done.append(f"{failed} of {len(statuses)} open MLflow runs marked FAILED" if failed < len(statuses)
                else f"MLflow run{'s' if len(statuses) > 1 else ''} marked FAILED ({len(statuses)})")
    return "; ".join(done)


def _run(state: RunState, tracker, config: RunConfig, loaded, clean_wb, layer: int, chain, prompt_set, *, progress, log):
    """expose -> margins -> utility -> attacks (benchmarks.pipeline), recorded into ``state`` and MLflow."""
    from benchmarks.metrics import defence_leakage, describe_noise, median, noise_summary
    from benchmarks.pipeline import expose, margins_on_subset

    results = state.results
    truths = [p.ids for p in prompt_set]
    seeds, utility_tokens, attack_names = config.seeds, config.utility_tokens, list(config.attacks)
    exposed = expose(chain, loaded, clean_wb, layer, truths, seed=seeds["noise"], knows_defense=config.knows_defense,
                     progress=progress)
    results["defense"]["sigma_abs_median"] = median(exposed.sigmas)
    results["defense"]["exposure_exact"] = all(exposed.exact)
    guarantee = chain.guarantee(max(len(ids) for ids in truths))  # a formal claim (defenses.dp); T: the longest prompt
    if guarantee is not None:
        results["defense"]["guarantee"] = guarantee
    results["margins"] = margins_on_subset(exposed, config.margin_positions, seeds["margin_positions"], progress=progress)
    m = results["margins"]
    results["noise"] = noise_summary(exposed.sigmas, exposed.state_rms, exposed.noise_norms, m["positions"], m["deltas"])
    log(f"[run] {describe_noise(results['noise'])}", file=sys.stderr)
    if utility_tokens and clean_wb.exposure != "residual":
        results["utility"] = {"skipped": "utility is measured for the residual exposure only: inference continued "
                                         "from defended keys and values is not implemented"}
        log(f"[run] utility cost: {results['utility']['skipped']}", file=sys.stderr)
    elif utility_tokens:
        from defenses.utility import utility_cost

        log(f"[run] utility cost of the defence on {utility_tokens} held-out tokens", file=sys.stderr)
        results["utility"] = utility_cost(loaded, chain, layer, n_tokens=utility_tokens, seed=seeds["utility"]).to_dict()
    if tracker is not None:
        tracker.log_metrics(tracker.parent_id, flat_metrics(results))
    plan = [(name, "head-clean" if name == "softmax-head" else name) for name in attack_names]
    if "softmax-head" in attack_names and chain.name != "none" and config.knows_defense:
        plan.insert(plan.index(("softmax-head", "head-clean")) + 1, ("softmax-head-adaptive", "head-adaptive"))
    attacked = {name: exposed for name, _ in plan}
    if config.dtype != "fp32" and "sipit" in attack_names:
        from benchmarks.pipeline import naive_fp32
        from sipit.models import load_model

        plan.insert(plan.index(("sipit", "sipit")) + 1, ("sipit-fp32", "sipit"))
        attacked["sipit-fp32"] = naive_fp32(exposed, load_model(config.model, dtype="fp32", device=config.device))
    options = AttackOptions(robust=config.robust, beam_width=config.beam_width, seed=seeds["attack"],
                            policy=config.policy, max_candidates=config.radius_budget or None, progress=progress,
                            known_pairs=config.known_pairs)
    for result_name, kind in plan:
        log(f"[run] attack {result_name} started", file=sys.stderr)
        if (kind.startswith("head") or kind == "blind") and not chain.per_position:
            results["attacks"][result_name] = {"skipped": "pooled exposure has no per-position states",
                                               "decoder": "BlindAttack" if kind == "blind" else "SoftmaxHead"}
            continue
        _attack(state, tracker, attacked[result_name], prompt_set, result_name, kind, options, seeds, loaded.tokenizer,
                head_tokens=config.head_tokens, head_epochs=config.head_epochs, progress=progress, log=log)
    results["leakage"] = defence_leakage(results["attacks"])
    results["prompts"] = [_prompt_record(i, p, state.prompt_rows, loaded.tokenizer) for i, p in enumerate(prompt_set)]


def _prompt_record(i: int, prompt, prompt_rows: list[dict], tokenizer) -> dict:
    """What results.json keeps of prompt i: truth, each attack's recovery, its private spans (the
    token positions they cover) and which of them each attack leaked verbatim."""
    from benchmarks.metrics import eligible_spans
    from benchmarks.prompts import span_positions

    truth_text = tokenizer.decode(prompt.ids)
    spans = eligible_spans(prompt.spans, truth_text)
    mine = [r for r in prompt_rows if r["prompt"] == i]
    return {"index": i, "kind": prompt.kind, "truth_ids": prompt.ids, "truth_text": truth_text,
            "recovered": {r["attack"]: r["recovered_text"] for r in mine},
            "spans": spans, "span_positions": span_positions(tokenizer, prompt.ids, spans),
            "spans_leaked": {r["attack"]: r["spans_leaked"] for r in mine}}


def _attack(state: RunState, tracker, exposed, prompt_set, result_name: str, kind: str, options: AttackOptions,
            seeds: dict, tokenizer, *, head_tokens: int, head_epochs: int, progress: bool, log) -> None:
    """One attack over every exposed prompt: its summary, per-position and per-prompt rows, its MLflow run."""
    from attacks.result import layer_hint
    from benchmarks.metrics import overlap_with, span_leaks, summarise
    from benchmarks.pipeline import attack_for, invert_all, train_softmax_head

    results, truths = state.results, exposed.prompt_ids
    summary: dict = {}
    extra: dict = {}
    if kind.startswith("head"):
        variant = "clean" if kind == "head-clean" else "adaptive"
        head, report, corpus = train_softmax_head(exposed, variant, n_tokens=head_tokens, epochs=head_epochs,
                                                  seed=seeds["head"], progress=progress)
        results.setdefault("head_corpus", {
            "source": "the inverse heads' corpus (attacks.proposals.corpus_examples)" if not corpus["ablation"]
            else f"ablation: the first {head_tokens} text tokens only",
            "n_tokens": corpus["n_tokens"], "ablation": corpus["ablation"],
            "overlap_8gram_with_prompts": overlap_with(corpus["windows"], truths),
        })
        info = report.to_dict()
        info["coverage"] = head.coverage(truths)
        results["heads"][variant] = extra["head"] = info
        make = lambda i: head  # noqa: E731
        decoder = f"SoftmaxHead({variant})"
    else:
        make = lambda i: attack_for(exposed, i, kind, options)  # noqa: E731
        decoder = "SipIt(random order)" if kind == "bruteforce" else describe(make(0))
    summary["decoder"] = decoder
    child = None
    if tracker is not None:
        child = tracker.start_child(result_name, {"attack": result_name, "decoder": decoder,
                                                  "config_hash": results["config_hash"], **extra})
    results["attacks"][result_name] = summary
    deltas = {tuple(k): d for k, d in zip(results["margins"]["positions"], results["margins"]["deltas"])}
    inversions: list = []
    span_counts: list[tuple[int, int]] = []

    def record(i: int, inv) -> None:
        ids = truths[i]
        inversions.append(inv)
        truth_text = tokenizer.decode(ids)
        eligible, leaked = span_leaks(prompt_set[i].spans, truth_text, tokenizer.decode(inv.ids))
        span_counts.append((len(eligible), len(leaked)))
        token_text = results.setdefault("token_text", {})  # id -> text, for the HTML report
        for token in (*ids, *inv.ids):
            token_text.setdefault(str(token), tokenizer.decode([token]))
        for t, truth_tok in enumerate(ids):
            rec = inv.positions[t] if t < len(inv.positions) else None
            got = inv.ids[t] if t < len(inv.ids) else None
            delta = deltas.get((i, t))
            norm = exposed.noise_norms[i][t]
            state.rows.append({
                "attack": result_name, "prompt": i, "position": t, "true_token": truth_tok,
                "recovered_token": got, "correct": int(got == truth_tok), "delta": delta, "noise_norm": norm,
                "ratio": (norm / (delta / 2)) if (delta and norm is not None) else None,
                "candidates_tried": rec.candidates_tried if rec else None,
                "distance": rec.distance if rec else None, "seconds": rec.seconds if rec else None,
            })
        state.prompt_rows.append({
            "attack": result_name, "prompt": i, "kind": prompt_set[i].kind, "exact": int(inv.ids == ids),
            "token_accuracy": sum(a == b for a, b in zip(inv.ids, ids)) / len(ids),
            "truth_text": truth_text, "recovered_text": inv.text, "spans": len(eligible), "spans_leaked": leaked,
        })
        summary.update(summarise(result_name, truths[: i + 1], inversions, span_counts).to_dict())
        if not progress:
            log(f"[run] {result_name} prompt {i + 1}/{len(truths)} done", file=sys.stderr)

    invert_all(exposed, make, tokenizer, progress=progress, desc=result_name, on_prompt=record)
    summary.update(group_recovery(exposed.chain, truths, inversions))
    hint = layer_hint(inversions, exposed.layer) if kind in EXACT_ATTACKS and all(exposed.exact) else None
    if hint:
        summary["hint"] = hint
        log(f"[run] {result_name}: hint: {hint}", file=sys.stderr)
    if child is not None:
        tracker.log_metrics(child, {k: v for k, v in summary.items() if k not in ("attack", "decoder")})
        tracker.finish(child)


def group_recovery(chain, truths: list[list[int]], inversions: list) -> dict:
    """Under weight tying, tied tokens have identical states: the attacker that knows the tied model
    recovers at best the group, and picks the member by the served model's prior (attacks.tied).
    ``group_accuracy`` = fraction of positions whose recovered token is in the true token's group;
    ``group_member_accuracy`` = of those, the fraction where the exact token was picked;
    ``tied_positions`` = positions whose true token shares its group with others, and
    ``tied_member_accuracy`` = the exact-token fraction among them (how often the prior resolves a
    real tie). {} without tying."""
    import torch

    from defenses.base import find_member

    tying = find_member(chain, "tying")
    if tying is None:
        return {}
    groups = tying.groups()
    sizes = torch.bincount(groups, minlength=len(groups))
    pairs = [(a, b) for truth, inv in zip(truths, inversions) for a, b in zip(inv.ids, truth)]
    in_group = [(a, b) for a, b in pairs if int(groups[a]) == int(groups[b])]
    tied = [(a, b) for a, b in pairs if int(sizes[groups[b]]) > 1]
    return {"group_accuracy": len(in_group) / len(pairs) if pairs else float("nan"),
            "group_member_accuracy": sum(a == b for a, b in in_group) / len(in_group) if in_group else float("nan"),
            "tied_positions": len(tied),
            "tied_member_accuracy": sum(a == b for a, b in tied) / len(tied) if tied else float("nan")}


# --------------------------------------------------------------------------- CLI
def _minimum(flag: str):
    """The argparse type of an integer option with its :data:`benchmarks.config.MINIMUMS` bound."""
    return arg(check_int, low=MINIMUMS[flag[2:].replace("-", "_")])


def _default_noise_sigma() -> float:
    """The relative sigma the noise defence uses when given no sigma (its own default)."""
    import inspect

    from defenses.noise import GaussianNoise

    return inspect.signature(GaussianNoise).parameters["sigma"].default


def build_parser() -> argparse.ArgumentParser:
    from benchmarks.tracking import default_tracking_uri
    from defenses.registry import DEFENSES

    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="registry name, HF model dir, .gguf file or hub id")
    p.add_argument("--layer", type=int, default=-1, help="layer attacked (negative: from the end; -1 = last block)")
    p.add_argument("--dtype", default=DEFAULTS.dtype, choices=tuple(DTYPES),
                   help="the precision the provider serves in; the informed attacker recomputes in it, verifying "
                        "candidates at the served shape in half precision (incremental kernels differ there), and "
                        "with --attacks sipit a naive fp32 attacker runs beside it (sipit-fp32)")
    p.add_argument("--exposure", default=DEFAULTS.exposure, choices=EXPOSURES,
                   help="what leaks at --layer: the residual stream, or block l's keys and values as the model's "
                        "KV cache holds them (l >= 1)")
    p.add_argument("--device", default=DEFAULTS.device,
                   help="auto (CUDA, else MPS, else CPU), cpu, cuda, cuda:N or mps; a device not there is an error")
    p.add_argument("--defense", action="append", default=None,
                   help=f"defence(s) applied in order, repeatable: a spec name:key=value,... (e.g. "
                        f"noise:sigma=0.1,placement=exposure) or a comma chain of names taking the flags below; "
                        f"names: {', '.join(DEFENSES)}")
    g = p.add_argument_group("defence parameters (a comma list, or a|b in a spec, sweeps: one setting per value)")
    noise_default = f"--sigma-rel {_default_noise_sigma():g}"
    g.add_argument("--sigma", type=arg(check_floats, low=0.0), default=argparse.SUPPRESS,
                   help=f"noise: absolute per-coordinate sigma (neither --sigma nor --sigma-rel: {noise_default})")
    g.add_argument("--sigma-rel", type=arg(check_floats, low=0.0), default=argparse.SUPPRESS,
                   help=f"noise: sigma as a multiple of the state RMS (neither --sigma nor --sigma-rel: {noise_default})")
    g.add_argument("--placement", help="noise: on the exposed copy or inside the model (exposure, model)")
    g.add_argument("--quant", help="quant: weight kind (e.g. int8, nf4, fp4, none)")
    g.add_argument("--quant-activations", help="quant: activation kind of the exposed states")
    g.add_argument("--tie-groups", help="tying: k-means groups of embedding rows")
    g.add_argument("--tie-rare", help="tying: tie the m rarest tokens")
    g.add_argument("--pool", help="pooling: mode (mean, max)")
    g.add_argument("--pool-window", help="pooling: pool over windows of k positions")
    g.add_argument("--pool-dims", help="pooling: pool groups of g hidden dims")
    a = p.add_argument_group("attacks")
    a.add_argument("--attacks", default=",".join(DEFAULTS.attacks), help=f"comma list from: {', '.join(RUN_ATTACKS)}")
    a.add_argument("--robust", default=DEFAULTS.robust, choices=tuple(ROBUST),
                   help="decoder under Gaussian noise (and stored activations' error): map = greedy MAP on the "
                        "shortlist (noise-adapted inverse heads + prior with --policy learned; the heads are "
                        "trained once per noise level and layer, attacks.proposals.head_noise), beam = MAP beam "
                        "search with backtracking, "
                        "shortlist = nearest neighbour on MAP's shortlist, radius = SipIt's loop stopping at the "
                        "first token inside the chi-square noise radius (cheap; it can take a wrong token once "
                        "~14 sigma exceeds the margins, attacks.registry)")
    a.add_argument("--policy", default=DEFAULTS.policy, choices=sorted(POLICIES),
                   help="candidate order of exact SipIt and of the radius decoder under noise: learned (position-0 "
                        "table and inverse heads: trained once per model and layer, then ~10 candidates per "
                        "position at smollm2's last layer), gradient (+ prior; no learned parts), random")
    a.add_argument("--beam-width", type=_minimum("--beam-width"), default=4)
    a.add_argument("--radius-budget", type=_minimum("--radius-budget"), default=DEFAULTS.radius_budget,
                   help="the radius decoder verifies at most this many candidates per position, then takes the "
                        "nearest so far (0 = the whole vocabulary: ~100 s per position at smollm2's last layer when "
                        "no candidate falls inside the noise radius, e.g. sigma 10 there)")
    a.add_argument("--no-knows-defense", dest="knows_defense", action="store_false",
                   help="the naive attacker: the original weights only, not the noise sigma or the storage "
                        "format's error (inexact states: nearest neighbour on the gradient shortlist), and no "
                        "softmax head trained on defended states")
    a.add_argument("--known-pairs", type=_minimum("--known-pairs"), default=DEFAULTS.known_pairs,
                   help="keyed defences (permute, rotate): known (prompt, exposure) pairs under the provider's key "
                        "that the key-recovery attacker gets (random-token prompts; 0 = the exposure alone)")
    a.add_argument("--head-tokens", type=_minimum("--head-tokens"), default=DEFAULTS.head_tokens,
                   help="the softmax head's training corpus: 0 = the inverse heads' (offline text and random-token "
                        "windows, sized to the vocabulary: ~180k tokens for smollm2); N = only its first N text tokens "
                        "(the small-corpus ablation, labelled so in the results)")
    a.add_argument("--head-epochs", type=_minimum("--head-epochs"), default=DEFAULTS.head_epochs)
    d = p.add_argument_group("data and measurement")
    d.add_argument("--prompts", default="mixed", help="prompt set (mixed, natural, random) or a text file, one per line")
    d.add_argument("--split", default=DEFAULTS.split, choices=SPLITS,
                   help="which part of a named prompt set: test (final measurements) or dev (where options are "
                        "chosen; benchmarks.prompts); a prompt file is not split")
    d.add_argument("--n-prompts", type=_minimum("--n-prompts"), default=DEFAULTS.n_prompts)
    d.add_argument("--length", type=_minimum("--length"), default=DEFAULTS.length,
                   help="tokens per prompt (at most the model's context length)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--margin-positions", type=_minimum("--margin-positions"), default=DEFAULTS.margin_positions,
                   help="positions with an exact full-vocabulary margin Delta (-1 = all)")
    d.add_argument("--utility-tokens", type=_minimum("--utility-tokens"), default=DEFAULTS.utility_tokens,
                   help="0 skips the utility cost")
    t = p.add_argument_group("output")
    t.add_argument("--tracking-uri", default=None, help=f"MLflow tracking URI (default {default_tracking_uri()})")
    t.add_argument("--experiment", default="sipit-bench")
    t.add_argument("--no-tracking", dest="track", action="store_false", help="do not log to MLflow")
    t.add_argument("--out", default=None, help=f"results folder (default {default_out_dir('run-<config hash>')})")
    t.add_argument("--no-progress", dest="progress", action="store_false")
    return p


def run_command(args: argparse.Namespace) -> int:
    """Run the benchmark from parsed options; print the table (0), or why it stopped (130, 3)."""

    def log(*items, **kwargs):
        print(*items, **kwargs, flush=True)

    options = vars(args)
    progress = options.pop("progress")
    configs = sweep_configs(**options)
    if len(configs) > 1:
        return _sweep_command(configs, progress, log)
    try:
        results = run_benchmark(configs[0], progress=progress, log=log)
    except RunInterrupted as report:
        print(f"interrupted: {report}", file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print("\ninterrupted before the run started: nothing written, no MLflow run opened", file=sys.stderr)
        return 130
    print(format_table(results))
    print(f"results: {results['out']}/results.json")
    if results["tracking"].get("error"):
        print(f"error: {results['tracking']['error']} (results are in {results['out']})", file=sys.stderr)
        return 3
    if results["tracking"].get("url"):
        print(f"mlflow run {results['tracking']['run_id']} (open with the command in mlflow/README.md): "
              f"{results['tracking']['url']}")
    return 0


def _sweep_command(configs: list[RunConfig], progress: bool, log) -> int:
    """Several settings: benchmarks.sweep; print its table, or why it stopped (130)."""
    from benchmarks.sweep import run_sweep

    try:
        summary = run_sweep(configs, progress=progress, log=log)
    except KeyboardInterrupt as report:
        print(f"interrupted: {report}; the finished settings are kept, a rerun skips them", file=sys.stderr)
        return 130
    print(summary["table"])
    print(f"sweep: {summary['out']}/sweep.md, sweep.png; each setting in its own folder there")
    if summary.get("url"):
        print(f"mlflow parent run {summary['run_id']}: {summary['url']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_main(build_parser(), run_command, argv)


if __name__ == "__main__":
    sys.exit(main())
