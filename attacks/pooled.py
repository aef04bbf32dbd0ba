"""The adaptive attack on pooled exposure: beam search over prefixes (docs/theory.md, "Pooling").

SipIt needs one state per position; a pooled exposure (:class:`defenses.pooling.Pooling`) has
only ``(1, P, D')`` pooled rows. The attacker knows the pooling and holds the model, so it
searches token sequences whose pooled states explain the target:

    for t = 0, 1, ...:
        for each hypothesis (prefix, its layer-l KV cache, running pool of its current window):
            candidates v: the whole vocabulary in chunks (V <= full_vocab_limit, tiny models)
                          or the top-k of the model's own next-token prior (NextTokenPrior),
                          with ``proposals`` also the top ``head_k`` of the learned proposals
                          on the position's proxy state (below)
            mu_{p,v} = WhiteBox.step(prefix cache, candidates)   (one incremental position each)
            running pool' = pool(running pool, pool_dims(mu))    (sum for mean, max for max)
            score = sum over completed windows ||pooled - target_w||^2
                    + partial_weight * partial(window in progress)
                    - prior_weight * log P(prefix)
        keep the ``beam`` best children; extend their caches by slicing the candidate batch.

Partial score of a window in progress with n of its k positions: mean pooling
``||(sum + sum_{j > t} m_j) / k - target_w||^2``, the window's mean with each of its k - n
positions still to come filled by a typical state m_j = m (with ``proposals``: the mean of the
corpus states the inverse head of positions >= 2 was trained on, LearnedPolicy.typical_state;
without: m_j = target_w, which ranks like ``||sum/n - target_w||^2``); max pooling
``||relu(running max - target_w)||^2`` (the true prefix never exceeds the target's max). The fill
matters where one position dominates a window: SmolLM2's position-0 state has ~9x the norm of the
others (layer 30), so ``sum/n`` compares a position-0 state with half of it, and the true first
token of a mean window of 2 ranked 8,605th to 35,651st of 49,152 (layer 30, 5 natural prompts).
With the fill it ranks 0th or 1st at layer 15 (9th to 888th at layer 30 with the mean of the other
prompts' states); filled with the position-1 head's own mean instead, 8,254th to 19,115th
(typical_state says why).
A completed window is scored exactly, so with windows of k = 1 (or pooling over dims) the true
token scores ~0 and the search is exact; k = 2 needs the true first token of each window in the
beam. Mean over all positions is a single constraint on the sum of T states: the search returns a
sequence that explains it, usually not the prompt (measure token accuracy, bag-of-tokens overlap).

Learned proposals (``proposals``: an attacks.policies.LearnedPolicy, pooling over positions only):
the prior's top-k misses what it cannot guess (names, numbers), so each position also takes the
top ``head_k`` of the position-0 table (t = 0: nearest rows) or of the inverse head log q(v | x)
(t >= 1) at a proxy x of the position's state. With mean pooling and a known window length k_w,
x = k_w * target_w - (sum of the window's earlier states) - (sum of m_j over its later
positions): exact for the position that completes the window (its state is then determined by the
prefix, and the step is exact SipIt's), the fill's estimate before it. Max pooling (and an
unknown length) uses x = target_w, the pooled row (a head that is roughly linear in the state
ranks the window's tokens high on their mean).

Length: if ``length`` is given it is used; otherwise every admissible length is tried
(window: (P-1)k+1 .. Pk; all: 1 .. ``max_length``; dims: P) and the best complete hypothesis
over all lengths wins.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from attacks.policies import LearnedPolicy
from attacks.result import Inversion, PositionRecord
from defenses.pooling import Pooling
from sipit.prior import NextTokenPrior
from sipit.tolerance import check_rel_tol
from sipit.whitebox import PrefixCache, SipitInputError, WhiteBox


def partial_score(mode: str, acc: torch.Tensor, n: int, target: torch.Tensor, k: int | None = None,
                  fill: torch.Tensor | None = None) -> torch.Tensor:
    """The score of a window in progress after n of its k positions (module docstring), per row of
    ``acc`` (the running sum for ``mode`` mean, the running max for max): mean with ``fill`` (the
    sum of the expected states of the k - n positions still to come) ``||(acc + fill)/k - target||^2``,
    mean without ``||acc/n - target||^2``, max ``||relu(acc - target)||^2``."""
    if mode == "mean":
        if fill is not None and k is not None:
            return ((acc + fill) / k - target).pow(2).sum(-1)
        return (acc / n - target).pow(2).sum(-1)
    return torch.relu(acc - target).pow(2).sum(-1)


@dataclass
class _Hyp:
    ids: list[int]
    prefix: PrefixCache
    done: float  # exact score of the completed windows
    acc: torch.Tensor | None  # running sum (mean) or max of the window in progress, (D',)
    n_in: int  # positions in the window in progress
    logp: float
    prior: NextTokenPrior | None


class PooledBeamAttack:
    """Beam search over prefixes scored by how well their running pooled states fit the target."""

    def __init__(
        self,
        pooling: Pooling,
        *,
        beam: int = 16,
        topk: int = 256,
        full_vocab_limit: int = 4096,
        chunk: int = 1024,
        partial_weight: float = 1.0,
        prior_weight: float = 0.0,
        max_length: int = 32,
        rel_tol: float = 1e-4,
        proposals: LearnedPolicy | None = None,
        head_k: int = 64,
    ):
        if not isinstance(pooling, Pooling):
            raise TypeError(f"PooledBeamAttack needs the Pooling defence it attacks, got {type(pooling).__name__}")
        if beam < 1 or topk < 1 or chunk < 1 or max_length < 1 or head_k < 1:
            raise ValueError("beam, topk, chunk, max_length and head_k must be >= 1")
        if partial_weight < 0 or prior_weight < 0:
            raise ValueError("partial_weight and prior_weight must be >= 0")
        self.pooling = pooling
        self.beam, self.topk, self.full_vocab_limit, self.chunk = beam, topk, full_vocab_limit, chunk
        self.partial_weight, self.prior_weight = partial_weight, prior_weight
        self.max_length, self.rel_tol = max_length, check_rel_tol(rel_tol)
        self.proposals, self.head_k = proposals, head_k

    @property
    def name(self) -> str:
        return f"pooled-beam-{self.pooling.mode}-{self.pooling.over}"

    # ---------------------------------------------------------------------------- geometry
    def _lengths(self, n_rows: int, length: int | None) -> list[int]:
        pool = self.pooling
        if length is not None:
            if isinstance(length, bool) or not isinstance(length, int) or length < 1:
                raise SipitInputError(f"length must be a positive int, got {length!r}")
            expected = {"all": 1, "window": -(-length // (pool.k or 1)), "dims": length}[pool.over]
            if expected != n_rows:
                raise SipitInputError(f"length {length} gives {expected} pooled rows, the exposure has {n_rows}")
            return [length]
        if pool.over == "dims":
            return [n_rows]
        if pool.over == "window":
            return list(range((n_rows - 1) * pool.k + 1, n_rows * pool.k + 1))
        if n_rows != 1:
            raise SipitInputError(f"pooling over all positions exposes 1 row, got {n_rows}")
        return list(range(1, self.max_length + 1))

    def _window(self, t: int, total: int | None) -> tuple[int, int | None]:
        """(window index of position t, window length or None if unknown yet)."""
        pool = self.pooling
        if pool.over == "all":
            return 0, total
        k = pool.k if pool.over == "window" else 1
        w = t // k
        if total is None:
            return w, k
        return w, min(k, total - w * k)

    def _accumulate(self, acc: torch.Tensor | None, feats: torch.Tensor) -> torch.Tensor:
        """The running pool of a window after one more position: sum (mean pooling) or max."""
        if acc is None:
            return feats
        return acc + feats if self.pooling.mode == "mean" else torch.maximum(acc, feats)

    def _pooled(self, acc: torch.Tensor, n: int) -> torch.Tensor:
        return acc / n if self.pooling.mode == "mean" else acc

    def _fill(self, t: int, count: int, learned: bool, target: torch.Tensor) -> torch.Tensor | None:
        """sum of m_j over the ``count`` positions after t, m_j = the typical state after position 0
        (module docstring); None without proposals."""
        if not learned or count <= 0:
            return None
        return count * self.pooling.pool_dims(self.proposals.typical_state().to(target))

    # ---------------------------------------------------------------------------- search
    def _candidates(self, hyp: _Hyp, vocab: int, device, learned: bool, t: int, tgt: torch.Tensor,
                    k_eff: int | None, fill: torch.Tensor | None) -> torch.Tensor:
        """The whole vocabulary (small ones), else the prior's top-k, with ``learned`` also the
        proposals' top ``head_k`` at the position's proxy state (module docstring; ``fill``: the
        step's :meth:`_fill`)."""
        if vocab <= self.full_vocab_limit or ((hyp.prior is None or hyp.prior.logprobs is None) and not learned):
            return torch.arange(vocab, device=device)
        parts = []
        if hyp.prior is not None and hyp.prior.logprobs is not None:
            parts.append(torch.topk(hyp.prior.logprobs, min(self.topk, vocab)).indices.cpu())
        if learned:
            proxy = tgt
            if self.pooling.mode == "mean" and k_eff is not None:  # this position's state, estimated
                proxy = k_eff * tgt - (0 if hyp.acc is None else hyp.acc) - (0 if fill is None else fill)
            if t == 0:
                scores = self.proposals.table.neg_sq_distances(proxy)
            else:
                scores = self.proposals.head_log_probs(t, proxy.cpu())
            parts.append(torch.topk(scores.cpu(), min(self.head_k, vocab)).indices)
        return torch.unique(torch.cat(parts)).to(device)

    @torch.no_grad()
    def invert(self, pooled: torch.Tensor, whitebox: WhiteBox, layer: int, tokenizer=None, length: int | None = None) -> Inversion:
        """Decode a token sequence whose pooled layer-``layer`` states match ``pooled`` ``(1, P, D')``."""
        layer = whitebox.resolve_layer(layer)
        if not isinstance(pooled, torch.Tensor) or pooled.dim() != 3 or pooled.shape[0] != 1:
            raise SipitInputError(
                f"pooled exposure must have shape (1, P, D'), got {tuple(getattr(pooled, 'shape', ()))}"
            )
        feat_dim = whitebox.d // (self.pooling.g or 1)
        if pooled.shape[2] != feat_dim or not torch.isfinite(pooled).all():
            raise SipitInputError(f"pooled rows must be finite with {feat_dim} features, got {tuple(pooled.shape)}")
        target = pooled[0].to(device=whitebox.device, dtype=torch.float32)
        lengths = self._lengths(target.shape[0], length)
        known = lengths[0] if len(lengths) == 1 else None
        vocab = whitebox.vocab_size
        need_prior = vocab > self.full_vocab_limit or self.prior_weight > 0
        learned = self.proposals is not None and self.pooling.over != "dims" and vocab > self.full_vocab_limit
        setup = self.proposals.prepare(whitebox, layer, tokenizer) if learned else []  # one-time: not timed
        started = time.perf_counter()
        beams = [_Hyp([], whitebox.prefix_cache([], layer), 0.0, None, 0, 0.0,
                      NextTokenPrior(whitebox.model) if need_prior else None)]
        best: tuple[float, list[int]] | None = None
        tried_per_step: list[int] = []
        step_seconds: list[float] = []
        for t in range(max(lengths)):
            t0 = time.perf_counter()
            w, k_eff = self._window(t, known)
            tgt = target[w]
            scores, where = [], []
            n = beams[0].n_in + 1  # windows are aligned: every hypothesis has the same n
            fill = self._fill(t, (k_eff or 0) - n, learned, tgt)
            tried = 0
            for h_index, hyp in enumerate(beams):
                cands = self._candidates(hyp, vocab, whitebox.device, learned, t, tgt, k_eff, fill)
                prior_lp = hyp.prior.logprobs if (hyp.prior is not None and hyp.prior.logprobs is not None) else None
                for part in cands.split(self.chunk):
                    batch = whitebox.step(hyp.prefix, part)
                    acc = self._accumulate(hyp.acc, self.pooling.pool_dims(batch.states.float()))
                    if k_eff is not None and n == k_eff:
                        s = hyp.done + (self._pooled(acc, n) - tgt).pow(2).sum(-1)
                    else:
                        s = hyp.done + self.partial_weight * partial_score(self.pooling.mode, acc, n, tgt, k_eff, fill)
                    logp = hyp.logp + (prior_lp[part].float() if prior_lp is not None else torch.zeros(len(part)))
                    s = s - self.prior_weight * logp
                    scores.append(s)
                    where.extend((h_index, batch, j, float(logp[j])) for j in range(len(part)))
                    tried += len(part)
            flat = torch.cat(scores)
            keep = torch.topk(-flat, min(self.beam, flat.numel())).indices.tolist()
            new_beams = []
            for i in keep:
                h_index, batch, j, logp = where[i]
                parent = beams[h_index]
                token = int(batch.candidates[j])
                acc = self._accumulate(parent.acc, self.pooling.pool_dims(batch.states[j].float()))
                n = parent.n_in + 1
                done = parent.done
                if k_eff is not None and n == k_eff:  # window complete: score it, start the next
                    done += float((self._pooled(acc, n) - tgt).pow(2).sum())
                    acc, n = None, 0
                prior = None
                if parent.prior is not None:
                    prior = parent.prior.fork()
                    prior.push(token)
                new_beams.append(_Hyp(parent.ids + [token], batch.extended(j), done, acc, n, logp, prior))
            beams = new_beams
            tried_per_step.append(tried)
            step_seconds.append(time.perf_counter() - t0)
            if t + 1 in lengths:  # a complete hypothesis of this length: close its last window
                for hyp in beams:
                    final = hyp.done
                    if hyp.acc is not None:
                        final += float((self._pooled(hyp.acc, hyp.n_in) - target[-1]).pow(2).sum())
                    if known is None and self.pooling.over == "window" and (t // self.pooling.k) != target.shape[0] - 1:
                        continue
                    final -= self.prior_weight * hyp.logp
                    if best is None or final < best[0]:
                        best = (final, hyp.ids)
        assert best is not None
        score, ids = best
        distance = max(score, 0.0) ** 0.5
        radius = self.rel_tol * float(target.norm())
        records = [
            PositionRecord(position=t, token=tok, distance=distance, radius=radius,
                           candidates_tried=tried_per_step[t], seconds=step_seconds[t], verified=distance <= radius)
            for t, tok in enumerate(ids)
        ]
        return Inversion(ids=list(ids), text=tokenizer.decode(ids) if tokenizer is not None else "",
                         positions=records, seconds=time.perf_counter() - started, vocab_size=vocab, setup=setup)
