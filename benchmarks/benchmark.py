"""One benchmark run (the library side of ``python -m benchmarks.run``): :func:`run_benchmark` loads the
model, checks the config against it, exposes the layer-l states under the defence, runs each attack
and writes the outputs (benchmarks.run_outputs) and the MLflow runs (benchmarks.tracking).

benchmarks.run (the command line) and benchmarks.sweep (several settings) both call it; it imports
neither. The attacks, margins and options are described in benchmarks.run's docstring.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


from attacks.registry import EXACT_ATTACKS, AttackOptions, describe
from benchmarks.config import RunConfig
from benchmarks.run_outputs import RunState, flat_metrics, write_outputs
from benchmarks.cli import UsageError, default_out_dir, interrupt_once
from benchmarks.out_dir import claim

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
