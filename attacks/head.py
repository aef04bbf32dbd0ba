"""The softmax classification-head baseline, and the prefix-aware prototype head (docs/theory.md,
"Classification head").

:class:`SoftmaxHead` is a learned inverter g(h) = W^T h + b: one affine map from a layer-l state
h_t to logits over tokens, trained with cross-entropy on (h_t, s_t) pairs of the offline corpus the
inverse heads learn from (attacks.proposals.corpus_examples: Python's documentation and seeded
random-token windows, ~180k tokens) by :func:`train_head`. It needs no forward access to the model and costs one
matrix product per position, but its weights are fixed, while SipIt's effective prototypes
mu_{p,v} move with the prefix.

Implementation notes (where this differs from the bare formula):

- Inputs are standardised with the training set's per-feature mean and std before the linear
  map; that is still affine in h (:meth:`SoftmaxHead.affine` returns the equivalent W, b).
- The output classes are the tokens that occur in the training corpus (``classes``). A token that
  never occurs would only have its logit pushed down by cross-entropy, so the head could never
  output it anyway. ``coverage`` (the fraction of evaluation tokens the head can output at all) is
  reported by the benchmark; the random-token windows of the corpus make it cover most of the
  vocabulary. Training uses a sampled softmax (each minibatch's true classes plus ``negatives``
  random ones), which makes a 49k-class head affordable on a CPU.
- ``augment``: the adaptive variant is trained on states passed through the defence's exposure
  (e.g. fresh Gaussian noise on every minibatch), so it has seen what it will be shown.
- :meth:`SoftmaxHead.invert` follows the common attack interface. It never runs the model, so
  every :class:`PositionRecord` has ``candidates_tried = 0``; ``distance`` and ``radius`` are 0 and
  ``verified`` is False (a head has no distance to verify against).

:class:`PrototypeHead` is the equivalence check: on ONE fixed prefix p, w_v = 2 mu_{p,v} and
b_v = -||mu_{p,v}||^2 gives argmax_v (w_v^T h + b_v) = argmin_v ||mu_{p,v} - h||, i.e. exactly
SipIt's nearest-neighbour decision at that position (tests/test_head.py checks it against SipIt's
own exhaustive search).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch
from torch import nn

from attacks.result import Inversion, PositionRecord
from attacks.training import epochs_for, minibatches, sampled_classes
from sipit.sweep import sweep_states

Augment = Callable[[torch.Tensor, torch.Generator], torch.Tensor]


@dataclass
class HeadReport:
    """How a head was trained and how well it classifies corpus states."""

    variant: str
    train_accuracy: float
    heldout_accuracy: float
    heldout_accuracy_exposed: float | None  # held-out states passed through the augmentation
    n_train: int
    n_heldout: int
    n_classes: int
    epochs: int
    final_loss: float
    seconds: float

    def to_dict(self) -> dict:
        return asdict(self)


class SoftmaxHead(nn.Module):
    """g(h) = W^T ((h - mean) / scale) + b over ``classes`` (token ids)."""

    def __init__(self, d: int, classes: torch.Tensor, vocab_size: int, mean: torch.Tensor, scale: torch.Tensor,
                 variant: str = "clean"):
        super().__init__()
        self.linear = nn.Linear(d, int(classes.numel()))
        self.register_buffer("classes", classes.long().clone())
        self.register_buffer("mean", mean.float().clone())
        self.register_buffer("scale", scale.float().clone())
        self.vocab_size = int(vocab_size)
        self.variant = variant

    @property
    def name(self) -> str:
        return "softmax-head" if self.variant == "clean" else f"softmax-head-{self.variant}"

    def forward(self, h: torch.Tensor, subset: torch.Tensor | None = None) -> torch.Tensor:
        """Logits over ``classes`` ``(N, K)``, or over the class indices ``subset`` only ``(N, len(subset))``."""
        z = (h.float() - self.mean) / self.scale
        if subset is None:
            return self.linear(z)
        return nn.functional.linear(z, self.linear.weight[subset], self.linear.bias[subset])

    def affine(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The equivalent raw-state head: ``W (d, K)``, ``b (K,)`` with g(h) = W^T h + b."""
        weight = self.linear.weight / self.scale  # (K, d)
        bias = self.linear.bias - weight @ self.mean
        return weight.T.detach(), bias.detach()

    @torch.no_grad()
    def predict(self, h: torch.Tensor) -> torch.Tensor:
        """Predicted token ids, ``(N,)``."""
        return self.classes[self.forward(h).argmax(dim=-1)]

    @torch.no_grad()
    def invert(self, observed: torch.Tensor, whitebox=None, layer: int | None = None, tokenizer=None,
               length: int | None = None) -> Inversion:
        """Classify every observed state independently (no forward pass: candidates_tried = 0)."""
        if whitebox is not None:
            observed = whitebox.check_states(observed, length)
        started = time.perf_counter()
        ids = self.predict(observed.cpu()).tolist()
        seconds = time.perf_counter() - started
        records = [
            PositionRecord(position=t, token=int(v), distance=0.0, radius=0.0, candidates_tried=0,
                           seconds=seconds / max(len(ids), 1), verified=False)
            for t, v in enumerate(ids)
        ]
        return Inversion(
            ids=[int(v) for v in ids],
            text=tokenizer.decode(ids) if tokenizer is not None else "",
            positions=records,
            seconds=seconds,
            vocab_size=self.vocab_size,
        )

    def coverage(self, ids) -> float:
        """Fraction of ``ids`` the head can output at all (tokens among its classes)."""
        ids = torch.as_tensor(ids, dtype=torch.long).flatten()
        if ids.numel() == 0:
            return 0.0
        return float(torch.isin(ids, self.classes).float().mean())


@torch.no_grad()
def accuracy(head: SoftmaxHead, states: torch.Tensor, ids: torch.Tensor, chunk: int = 4096) -> float:
    if ids.numel() == 0:
        return float("nan")
    correct = sum(int((head.predict(x) == y).sum()) for x, y in zip(states.split(chunk), ids.split(chunk)))
    return correct / ids.numel()


def train_head(
    states: torch.Tensor,
    ids: torch.Tensor,
    held: torch.Tensor,
    *,
    vocab_size: int,
    epochs: int = 3,
    min_steps: int = 0,
    batch_size: int = 512,
    negatives: int = 4096,
    lr: float = 3e-3,
    weight_decay: float = 1e-4,
    seed: int = 0,
    augment: Augment | None = None,
    variant: str = "clean",
    progress: bool = False,
) -> tuple[SoftmaxHead, HeadReport]:
    """Train a softmax head with cross-entropy and Adam (seeded) on (state, token) pairs; rows where
    ``held`` is True are held out (whole windows of the corpus, attacks.proposals.corpus_examples).

    The output classes are the tokens of the training rows. Each minibatch's softmax runs over its own
    true classes plus ``negatives`` classes drawn uniformly (all classes when there are fewer): a sampled
    softmax, so a 49k- or 262k-class head trains in minutes; prediction uses every class. ``epochs``
    passes, at least ``min_steps`` optimiser steps. ``augment(batch, generator)`` transforms each training
    minibatch (fresh draws every epoch: the noise-augmented, adaptive variant); held-out accuracy is
    reported on clean states and, with ``augment``, on augmented ones (one seeded draw).
    """
    states = states.float().cpu()
    ids = ids.long().cpu()
    held = held.bool().cpu()
    if states.dim() != 2 or states.shape[0] != ids.numel() or held.shape != ids.shape or int((~held).sum()) < 1:
        raise ValueError(f"need states (N, d), ids (N,) and a held-out mask (N,) leaving training rows, got "
                         f"{tuple(states.shape)}, {tuple(ids.shape)} and {tuple(held.shape)}")
    if min(epochs, batch_size, negatives) < 1 or min_steps < 0:
        raise ValueError("epochs, batch_size and negatives must be positive, min_steps >= 0")
    x_train, y_train = states[~held], ids[~held]
    x_held, y_held = states[held], ids[held]
    classes = torch.unique(y_train)
    index = torch.full((vocab_size,), -1, dtype=torch.long)
    index[classes] = torch.arange(classes.numel())
    target = index[y_train]
    mean = x_train.mean(0)
    scale = x_train.std(0).clamp_min(1e-6) if x_train.shape[0] > 1 else torch.ones_like(mean)
    generator = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = SoftmaxHead(states.shape[1], classes, vocab_size, mean, scale, variant=variant)
    optimiser = torch.optim.Adam(head.parameters(), lr=lr, weight_decay=weight_decay)
    n_classes = int(classes.numel())
    epochs = epochs_for(x_train.shape[0], batch_size, epochs, min_steps)
    started = time.perf_counter()
    loss_value = float("nan")
    for rows in minibatches(x_train.shape[0], batch_size, epochs, generator, progress=progress,
                            desc=f"train {head.name}"):
        batch = x_train[rows]
        if augment is not None:
            batch = augment(batch, generator).float()
        if negatives < n_classes:
            pool, label = sampled_classes(target[rows], n_classes, negatives, generator)
            loss = nn.functional.cross_entropy(head(batch, pool), label)
        else:
            loss = nn.functional.cross_entropy(head(batch), target[rows])
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        loss_value = float(loss.detach())
    head.eval()
    exposed = None
    if augment is not None and y_held.numel():
        exposed = accuracy(head, augment(x_held, torch.Generator().manual_seed(seed + 1)).float(), y_held)
    report = HeadReport(
        variant=variant,
        train_accuracy=accuracy(head, x_train, y_train),
        heldout_accuracy=accuracy(head, x_held, y_held),
        heldout_accuracy_exposed=exposed,
        n_train=int(y_train.numel()),
        n_heldout=int(y_held.numel()),
        n_classes=n_classes,
        epochs=epochs,
        final_loss=loss_value,
        seconds=time.perf_counter() - started,
    )
    return head, report


class PrototypeHead:
    """The linear head that reproduces nearest-neighbour decoding on ONE fixed prefix:
    w_v = 2 mu_{p,v}, b_v = -||mu_{p,v}||^2, for every token v of the vocabulary."""

    def __init__(self, prototypes: torch.Tensor):
        self.prototypes = prototypes.float()  # (V, d): mu_{p,v}
        self.weight = 2.0 * self.prototypes  # (V, d)
        self.bias = -(self.prototypes * self.prototypes).sum(-1)  # (V,)

    @classmethod
    @torch.no_grad()
    def on_prefix(cls, whitebox, prefix_ids, layer: int, *, chunk: int = 1024) -> "PrototypeHead":
        """mu_{p,v} = Phi^l(p + v)_{|p|} for all v: the vocabulary swept on the cached prefix."""
        prefix = whitebox.prefix_cache(torch.as_tensor(prefix_ids, dtype=torch.long), layer)
        return cls(sweep_states(whitebox, prefix, chunk=chunk).float().cpu())

    def scores(self, h: torch.Tensor) -> torch.Tensor:
        """w_v^T h + b_v for every v (``(V,)`` or ``(N, V)``) = ||h||^2 - ||mu_v - h||^2."""
        return h.float().cpu() @ self.weight.T + self.bias

    def predict(self, h: torch.Tensor) -> torch.Tensor:
        return self.scores(h).argmax(dim=-1)


class InverseHeadAttack:
    """The classification baseline built from the learned inverse heads (attacks.proposals): each
    position classified on its own, without running the model: position 0 by the nearest row of the
    position-0 table F (sipit.vocab_table, built offline like the heads' training states), later
    positions by argmax_v log q(v | h~_t) of the head for that position. The same heads order exact
    SipIt's candidates (attacks.policies.LearnedPolicy); here they decide alone (candidates_tried = 0)."""

    name = "inverse-head"

    def __init__(self, head_config=None, progress: bool = False):
        from attacks.policies import LearnedPolicy

        self.policy = LearnedPolicy(head_config, progress=progress)

    def invert(self, observed: torch.Tensor, whitebox, layer: int, tokenizer=None, length: int | None = None) -> Inversion:
        layer = whitebox.resolve_layer(layer)
        observed = whitebox.check_states(observed, length)
        setup = self.policy.prepare(whitebox, layer, tokenizer)  # one-time per (model, layer), may train: not timed
        self.policy.observe(observed)
        started = time.perf_counter()
        ids = []
        with torch.no_grad():
            for t in range(observed.shape[0]):
                if t == 0:
                    scores = self.policy.table.neg_sq_distances(observed[0])
                else:
                    scores = self.policy.head_log_probs(t, observed[t])
                ids.append(int(scores.argmax()))
        seconds = time.perf_counter() - started
        records = [PositionRecord(position=t, token=v, distance=0.0, radius=0.0, candidates_tried=0,
                                  seconds=seconds / len(ids), verified=False) for t, v in enumerate(ids)]
        return Inversion(ids=ids, text=tokenizer.decode(ids) if tokenizer is not None else "", positions=records,
                         seconds=seconds, vocab_size=whitebox.vocab_size, setup=setup)
