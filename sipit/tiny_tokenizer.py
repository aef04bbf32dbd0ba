"""The tiny models' 512-token byte-level BPE tokenizer, shipped as ``sipit/data/tiny-tokenizer.json``.

The file is what :func:`train` gave on CPython 3.11.7 with tokenizers 0.23.3, saved with
``tokenizers.Tokenizer.save``: a byte-level BPE trained on the offline pydoc text
(:func:`sipit.offline_text.pydoc_topics`, topics in sorted order). The tiny models load the file
(:func:`load`) rather than train, so their token ids, which recorded regression cases hold, do not
depend on the Python or tokenizers version.

    python -m sipit.tiny_tokenizer           # train again; exit 1 if the result differs from the file
    python -m sipit.tiny_tokenizer --write   # replace the file (every recorded tiny-model id may change)
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from sipit.offline_text import pydoc_topics

FILE = Path(__file__).parent / "data" / "tiny-tokenizer.json"
VOCAB_SIZE = 512
EOS = "<|endoftext|>"


def train(vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """A byte-level BPE tokenizer of ``vocab_size`` tokens (``EOS`` is id 0) trained on the pydoc topics."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[EOS],
        show_progress=False,
    )
    tok.train_from_iterator([text for _, text in pydoc_topics()], trainer)
    return tok


def load() -> Tokenizer:
    """The shipped tokenizer (``FILE``)."""
    return Tokenizer.from_file(str(FILE))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sipit.tiny_tokenizer", description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help=f"write the trained tokenizer to {FILE}")
    args = parser.parse_args(argv)
    trained = train()
    if args.write:
        trained.save(str(FILE))
        print(f"wrote {FILE}")
        return 0
    same = trained.to_str() == load().to_str()
    print(f"training here {'gives' if same else 'does NOT give'} the shipped {FILE}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
