"""Invert one prompt from its layer-l hidden states and show how.

    python -m benchmarks.invert "some text" [--layer L] [--model M] [--policy gradient|random]
        [--dtype fp32|bf16|fp16] [--exposure residual|kv] [--device auto|cpu|cuda|mps]

The command computes the prompt's layer-L states with the model served in ``--dtype`` (what a leak
would expose: the residual stream, or block L's keys and values), then runs SipIt on those states
alone and prints the recovered text, each position's token, candidates tried and distance, and the
time. In half precision candidates are verified at the served shape (bit-exact; incremental
kernels differ there). Negative L counts from the last layer (default -1).
"""

from __future__ import annotations

if __name__ == "__main__":  # before the imports: Ctrl-C while they load is one line (benchmarks.startup)
    from benchmarks.startup import guard_startup

    guard_startup()

import argparse
import sys

import torch

from attacks.policies import POLICIES, make_policy
from attacks.result import Inversion, layer_hint
from attacks.sipit import SipIt
from benchmarks.cli import UsageError, arg, check_int, run_main
from sipit.models import DEFAULT_MODEL, DTYPES, load_model
from sipit.whitebox import EXPOSURES, SipitInputError, WhiteBox


def invert_text(
    text: str,
    *,
    model: str = DEFAULT_MODEL,
    layer: int = -1,
    policy: str = "learned",
    max_tokens: int | None = None,
    seed: int = 0,
    dtype: str = "fp32",
    exposure: str = "residual",
    device: str = "auto",
    progress: bool = False,
) -> tuple[list[int], Inversion, object]:
    """Tokenise ``text``, take its layer-``layer`` states and invert them with SipIt.

    Returns the true ids, the :class:`Inversion` (which never saw them) and the tokenizer.
    """
    if not text.strip():
        raise SipitInputError("empty prompt: there is nothing to invert")
    if max_tokens is not None:
        check_int(max_tokens, low=1, name="max_tokens")
    attack = SipIt(make_policy(policy, progress=progress), seed=seed, progress=progress)
    loaded = load_model(model, dtype=dtype, device=device)
    whitebox = WhiteBox(loaded.model, exposure=exposure)
    layer = whitebox.resolve_layer(layer)
    ids = loaded.tokenizer(text, add_special_tokens=False).input_ids[:max_tokens]
    try:
        whitebox.check_length(len(ids), "the prompt")
    except SipitInputError as err:
        raise UsageError(f"{err}: shorten it or keep its first tokens with --max-tokens {whitebox.context_length}") from None
    observed = whitebox.states(ids, layer)
    verifier = whitebox if whitebox.dtype == torch.float32 else whitebox.at_served_shape(len(ids))
    return ids, attack.invert(observed, verifier, layer, loaded.tokenizer), loaded.tokenizer


def format_inversion(inversion: Inversion, truth: list[int], tokenizer) -> str:
    """A per-position table and a summary line."""
    lines = [f"{'pos':>4} {'token':<20} {'ok':<3} {'tried':>7} {'distance':>10} {'ms':>8}"]
    for record, true_id in zip(inversion.positions, truth):
        token = repr(tokenizer.decode([record.token]))[:20]
        ok = "yes" if record.token == true_id else "NO"
        flag = "" if record.verified else "  (unverified: nearest candidate)"
        lines.append(
            f"{record.position:>4} {token:<20} {ok:<3} {record.candidates_tried:>7} "
            f"{record.distance:>10.3g} {1000 * record.seconds:>8.1f}{flag}"
        )
    exact = inversion.ids == truth
    lines.append(
        f"exact recovery: {exact}; token accuracy {inversion.token_accuracy(truth):.3f}; "
        f"candidates tried {inversion.candidates_tried} "
        f"({100 * inversion.explored_fraction:.3f}% of the vocabulary per position); "
        f"{inversion.seconds:.2f} s"
    )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.invert", description=__doc__.split("\n\n")[0])
    parser.add_argument("text", help="the prompt whose hidden states are inverted")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="registry name, HF dir, .gguf file or hub id")
    parser.add_argument("--layer", type=int, default=-1, help="layer to attack (negative: from the end)")
    parser.add_argument("--policy", choices=sorted(POLICIES), default="learned",
                        help="candidate order: learned (position-0 table + inverse head + prior, built once per "
                             "model and layer and cached), gradient (no learned parts), random (BruteForce)")
    parser.add_argument("--max-tokens", type=arg(check_int, low=1), default=None,
                        help="keep only the prompt's first N tokens (N >= 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="fp32", help="the precision the model is served in")
    parser.add_argument("--exposure", choices=EXPOSURES, default="residual",
                        help="the residual stream at layer L, or block L's keys and values (L >= 1)")
    parser.add_argument("--device", default="auto", help="auto (CUDA, else MPS, else CPU), cpu, cuda, cuda:N, mps")
    return parser


def invert_command(args: argparse.Namespace) -> int:
    """Run :func:`invert_text` and print the result; exit 0 on exact recovery, 1 otherwise."""
    truth, inversion, tokenizer = invert_text(
        args.text, model=args.model, layer=args.layer, policy=args.policy,
        max_tokens=args.max_tokens, seed=args.seed, dtype=args.dtype, exposure=args.exposure, device=args.device,
        progress=True,
    )
    for line in inversion.setup:
        print(f"one-time: {line}")
    print(f"recovered: {inversion.text!r}")
    print(format_inversion(inversion, truth, tokenizer))
    hint = layer_hint([inversion], args.layer)
    if hint:
        print(f"hint: {hint}", file=sys.stderr)
    return 0 if inversion.ids == truth else 1


def main(argv: list[str] | None = None) -> int:
    return run_main(build_parser(), invert_command, argv)


if __name__ == "__main__":
    sys.exit(main())
