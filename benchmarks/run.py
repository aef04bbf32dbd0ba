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
import sys


from attacks.policies import POLICIES
from attacks.registry import ROBUST, RUN_ATTACKS
from benchmarks.config import MINIMUMS, RunConfig, sweep_configs
from benchmarks.prompts import SPLITS
from sipit.models import DTYPES
from sipit.whitebox import EXPOSURES
from benchmarks.run_outputs import format_table
from benchmarks.cli import arg, check_floats, check_int, default_out_dir, run_main
# the run itself (benchmarks.sweep runs it too, and this command dispatches to either)
from benchmarks.benchmark import RunInterrupted, run_benchmark

DEFAULTS = RunConfig()


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
