"""The training loop the learned attacks share: seeded minibatches with one progress bar, sampled classes.

Both the inverse heads (attacks.proposals.fit_head) and the softmax classification head
(attacks.head.train_head) train with Adam on minibatches of a corpus of (state, token) pairs, scoring
each minibatch against its own true classes plus ``negatives`` classes drawn uniformly: a sampled
softmax, affordable for 49k- or 262k-token vocabularies on a CPU.
"""

from __future__ import annotations

from typing import Iterator

import torch
from tqdm.auto import tqdm


def minibatches(n_rows: int, batch_size: int, epochs: int, generator: torch.Generator, *, progress: bool = False,
                desc: str = "training") -> Iterator[torch.Tensor]:
    """Row indices of ``epochs`` passes over ``n_rows`` rows, each pass a fresh permutation drawn from
    ``generator``, cut into batches of ``batch_size``; one progress bar (with ETA) over every step."""
    per_epoch = -(-n_rows // batch_size)
    with tqdm(total=epochs * per_epoch, desc=desc, disable=not progress, leave=False) as bar:
        for _ in range(epochs):
            order = torch.randperm(n_rows, generator=generator)
            for start in range(0, n_rows, batch_size):
                yield order[start : start + batch_size]
                bar.update()


def epochs_for(n_rows: int, batch_size: int, epochs: int, min_steps: int) -> int:
    """``epochs``, raised so that the passes take at least ``min_steps`` optimiser steps."""
    return max(epochs, -(-min_steps // -(-n_rows // batch_size)))


def sampled_classes(targets: torch.Tensor, n_classes: int, negatives: int,
                    generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(pool, index): the sorted class ids ``targets`` plus ``negatives`` uniform draws from ``n_classes``,
    and each target's index in the pool (the cross-entropy label over the pool's logits)."""
    pool = torch.unique(torch.cat([targets, torch.randint(0, n_classes, (negatives,), generator=generator)]))
    return pool, torch.searchsorted(pool, targets)
