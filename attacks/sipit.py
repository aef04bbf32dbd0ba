"""SipIt: exact left-to-right inversion of a prompt from its layer-l hidden states.

docs/theory.md, "SipIt". At step t the prefix p_t = (s_1..s_{t-1}) is already decoded. For candidate
tokens v the attacker recomputes mu_{p_t,v} = Phi^l(p_t + v)_t and accepts v when

    ||mu_{p_t,v} - h~_t||_2 <= eps_t        (eps_t: sipit.tolerance.acceptance_radius)

By injectivity only the true token lands inside the ball. The loop below is the whole attack:

    for t in 0..T-1:
        order candidates with the policy            (attacks.policies)
        verify them in batches on the cached prefix (WhiteBox.step: one incremental pass)
        accept the first within eps_t, else keep the nearest and go on
        extend the prefix cache with the chosen token (sliced from the batch, no extra pass)

If the whole vocabulary is exhausted without a match, the nearest candidate is returned and the
position is flagged ``verified=False`` (never a silent default token).

Differences from the paper's reference code: L2 acceptance with a measured, scale-aware eps
instead of element-wise allclose(1e-5); prefix KV caching; batched verification (batch size
doubling from ``batch_size`` to ``max_batch``); no block above l is computed; the gradient policy
is interleaved with the model's own next-token prior.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from attacks.policies import CandidatePolicy, LearnedPolicy, StepContext
from attacks.result import Inversion, PositionRecord
from sipit.prior import NextTokenPrior
from sipit.tolerance import DEFAULT_REL_TOL, acceptance_radius
from sipit.whitebox import PrefixCache, WhiteBox


class SipIt:
    """Exact inversion of layer-l states with a pluggable candidate policy."""

    def __init__(
        self,
        policy: CandidatePolicy | None = None,
        *,
        rel_tol: float = DEFAULT_REL_TOL,
        batch_size: int | None = None,
        max_batch: int = 512,
        use_prior: bool = True,
        seed: int = 0,
        progress: bool = False,
    ):
        if rel_tol <= 0:
            raise ValueError(f"rel_tol must be positive, got {rel_tol}")
        self.policy = policy if policy is not None else LearnedPolicy()
        batch_size = self.policy.first_batch if batch_size is None else batch_size
        if batch_size < 1 or max_batch < batch_size:
            raise ValueError("need 1 <= batch_size <= max_batch")
        self.rel_tol = rel_tol
        self.batch_size = batch_size
        self.max_batch = max_batch
        self.use_prior = use_prior
        self.seed = seed
        self.progress = progress

    @property
    def name(self) -> str:
        return f"sipit-{self.policy.name}"

    def invert(self, observed: torch.Tensor, whitebox: WhiteBox, layer: int, tokenizer=None,
               length: int | None = None) -> Inversion:
        """Decode the token ids whose layer-``layer`` states are ``observed`` ``(T, d)`` (``T == length`` if given)."""
        layer = whitebox.resolve_layer(layer)
        observed = whitebox.check_states(observed, length)
        radii = acceptance_radius(observed, self.rel_tol)
        setup = self.policy.prepare(whitebox, layer, tokenizer)  # one-time per (model, layer): not timed below
        self.policy.observe(observed)
        generator = torch.Generator().manual_seed(self.seed)
        prior = NextTokenPrior(whitebox.model) if self.use_prior else None
        prefix = whitebox.prefix_cache([], layer)
        records: list[PositionRecord] = []
        started = time.perf_counter()
        for t in tqdm(range(observed.shape[0]), desc=self.name, disable=not self.progress, leave=False):
            record, prefix = self.decode_position(
                whitebox, prefix, observed[t], float(radii[t]),
                prior, generator,
            )
            records.append(record)
            if prior is not None and t + 1 < observed.shape[0]:
                prior.push(record.token)
        ids = [r.token for r in records]
        return Inversion(
            ids=ids,
            text=tokenizer.decode(ids) if tokenizer is not None else "",
            positions=records,
            seconds=time.perf_counter() - started,
            vocab_size=whitebox.vocab_size,
            setup=setup,
        )

    def decode_position(
        self,
        whitebox: WhiteBox,
        prefix: PrefixCache,
        target: torch.Tensor,
        radius: float,
        prior: NextTokenPrior | torch.Tensor | None,
        generator: torch.Generator,
    ) -> tuple[PositionRecord, PrefixCache]:
        """Find the token at position ``prefix.length``: verify candidates in growing batches
        until one lies within ``radius`` of ``target`` or the vocabulary is exhausted.

        Returns the position's record and the prefix cache extended by the chosen token.
        """
        started = time.perf_counter()
        ctx = StepContext(whitebox, prefix, target, prior, generator)
        self.policy.start(ctx)
        found = verify(whitebox, prefix, target, radius, self.policy, ctx,
                       first_batch=self.batch_size, max_batch=self.max_batch)
        record = PositionRecord(
            position=prefix.length,
            token=found.token,
            distance=found.distance,
            radius=radius,
            candidates_tried=found.tried,
            seconds=time.perf_counter() - started,
            verified=found.distance <= radius,
        )
        return record, found.prefix


@dataclass
class Verified:
    """What :func:`verify` found at one position: the nearest candidate, its distance, the prefix
    extended by it, and every candidate verified (ids and distances, batch by batch)."""

    token: int
    distance: float
    prefix: PrefixCache
    ids: list[torch.Tensor]
    distances: list[torch.Tensor]

    @property
    def tried(self) -> int:
        return sum(int(i.numel()) for i in self.ids)


def verify(whitebox: WhiteBox, prefix: PrefixCache, target: torch.Tensor, radius: float, policy: CandidatePolicy,
           ctx: StepContext, *, first_batch: int, max_batch: int, cap: int | None = None) -> Verified:
    """SipIt's inner loop: candidates in ``policy``'s order, verified on the cached prefix in batches
    doubling from ``first_batch`` to ``max_batch``, until the nearest so far lies within ``radius``
    of ``target`` or ``cap`` candidates (default: the whole vocabulary) have been tried."""
    cap = whitebox.vocab_size if cap is None else min(cap, whitebox.vocab_size)
    tried = torch.zeros(whitebox.vocab_size, dtype=torch.bool)
    found = Verified(-1, float("inf"), prefix, [], [])
    batch_size = first_batch
    while found.tried < cap:
        candidates = policy.propose(ctx, tried, min(batch_size, cap - found.tried))
        if candidates.numel() == 0:
            break
        batch = whitebox.step(prefix, candidates)
        distances = (batch.states - target).norm(dim=-1)
        tried[candidates] = True
        found.ids.append(candidates)
        found.distances.append(distances)
        j = int(distances.argmin())
        if float(distances[j]) < found.distance:
            found.distance, found.token = float(distances[j]), int(candidates[j])
            found.prefix = batch.extended(j)
            ctx.anchor = found.token
        if found.distance <= radius:
            break
        batch_size = min(2 * batch_size, max_batch)
    return found
