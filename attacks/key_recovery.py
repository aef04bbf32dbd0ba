"""Attacks on keyed obfuscation (defenses.keyed): decode without the key, or recover it from known pairs.

A secret mixing h~ = h M of the exposed states hides nothing that M leaves invariant, and SipIt only
needs to tell candidates apart:

- a permutation keeps each state's multiset of values: sorted(h~_t) = sorted(h_t). At position 0 the
  state depends on the token alone, so the token is the row of the position-0 table F whose sorted
  values equal those of h~_0 (the vocab-matching attack's sorted-value matching), and the pair (F_s,
  h~_0) gives the whole key where its values are distinct (:func:`permutation_from_row`). Every row is
  then un-permuted and exact SipIt runs as usual. Nothing is learned from other prompts: it works per
  prompt, so a per-prompt key does not help.
- an orthogonal rotation keeps every inner product: h~_t . h~_s = h_t . h_s. Decoding left to right,
  the decoded prefix's own states H (recomputed by the attacker, unrotated) and the exposure's rows E
  give, for position t, the invariants g_t = (||h~_t||, E h~_t) that the true token's state must
  reproduce: ||mu|| = ||h~_t|| and H mu = E h~_t (:func:`gram_residual`). Candidates are verified
  against them exactly (within SipIt's float tolerance); the position-0 state has only its norm, so
  the tokens whose table row has that norm are tried in turn (depth first, backtracking when no
  candidate at a later position fits). The projection of h_t on the decoded states' span is known
  exactly (H^T (H H^T)^-1 E h~_t) and ranks the candidates through the inverse head.
- with k known (prompt, exposure) pairs under the same key (deployment scope) the key itself follows
  once the pairs hold as many independent rows as dimensions: orthogonal Procrustes
  (:func:`procrustes`), least squares for a general invertible mixing (:func:`least_squares_mixing`),
  the assignment problem for a permutation (:func:`assign_permutation`, which needs far fewer rows).

:class:`KeyedAttack` is the registered attack ("key-recovery", attacks.registry): it tries the invariants
first (exact when they hold), then the known pairs, and says in its records which route it took. When
neither gives a key (a general invertible mixing and too few known rows), it raises, or with
``fallback=True`` (the registry's: a benchmark scores the attacker, it does not stop) returns the model's
greedy prior guess, every position unverified: what an attacker without the key outputs.
"""

from __future__ import annotations

import time

import torch

from attacks.result import Inversion, PositionRecord
from sipit.tolerance import DEFAULT_REL_TOL, acceptance_radius
from sipit.whitebox import SipitInputError, WhiteBox


# --------------------------------------------------------------------------- keys from data
def permutation_from_row(clean: torch.Tensor, exposed: torch.Tensor) -> torch.Tensor:
    """The key ``p`` with ``exposed = clean[p]`` for one row whose values are distinct: sort both and align."""
    key = torch.empty(clean.numel(), dtype=torch.long)
    key[torch.argsort(exposed.cpu())] = torch.argsort(clean.cpu())
    return key


def assign_permutation(clean: torch.Tensor, exposed: torch.Tensor) -> torch.Tensor:
    """The key ``p`` minimising sum_j ||exposed[:, j] - clean[:, p_j]||^2 over matched rows ``(N, d)`` (the
    assignment problem on the columns' profiles, scipy's Hungarian solver)."""
    from scipy.optimize import linear_sum_assignment

    cost = torch.cdist(exposed.T.double().cpu(), clean.T.double().cpu()).pow(2).numpy()
    rows, cols = linear_sum_assignment(cost)
    key = torch.empty(clean.shape[1], dtype=torch.long)
    key[torch.as_tensor(rows)] = torch.as_tensor(cols)
    return key


def procrustes(clean: torch.Tensor, exposed: torch.Tensor) -> torch.Tensor:
    """argmin over orthogonal Q of ||clean Q - exposed||_F (rows matched, ``(N, d)``): U V^T of the SVD of
    clean^T exposed (Schoenemann 1966). Unique when the rows span all d dimensions."""
    u, _, vh = torch.linalg.svd(clean.double().T @ exposed.double())
    return u @ vh


def least_squares_mixing(clean: torch.Tensor, exposed: torch.Tensor) -> torch.Tensor:
    """argmin over M of ||clean M - exposed||_F: exact for an invertible M once the rows span all d dimensions."""
    return torch.linalg.lstsq(clean.double(), exposed.double()).solution


def gram_invariants(exposed: torch.Tensor, t: int) -> torch.Tensor:
    """g_t = (||h~_t||, h~_s . h~_t / ||h~_s|| for s < t): what a rotation keeps of row t, in units of a norm."""
    rows = exposed.double()
    return torch.cat([rows[t].norm().reshape(1), rows[:t] @ rows[t] / rows[:t].norm(dim=-1)])


def gram_residual(candidates: torch.Tensor, decoded: torch.Tensor, invariants: torch.Tensor) -> torch.Tensor:
    """||(||mu||, h_s . mu / ||h_s||) - g_t|| for each candidate state mu (rows of ``candidates``), h_s the decoded
    prefix's states ``(t, d)`` and g_t from :func:`gram_invariants`: 0 for the true token under an orthogonal
    mixing (module docstring)."""
    x, unit = candidates.double(), torch.nn.functional.normalize(decoded.double(), dim=-1)
    mine = torch.cat([x.norm(dim=-1, keepdim=True), x @ unit.T], dim=-1)
    return (mine - invariants.double()).norm(dim=-1)


# --------------------------------------------------------------------------- the attack
class KeyedAttack:
    """Inversion of an exposure mixed by a secret key (module docstring). ``scheme``: ``permute`` or
    ``rotate``; ``known``: (token ids, exposed states) pairs of other prompts under the same key; ``policy``: the
    candidate order of the SipIt that decodes the un-mixed states (attacks.policies; default: learned)."""

    def __init__(self, scheme: str, known: list[tuple[list[int], torch.Tensor]] | None = None, *,
                 rel_tol: float = DEFAULT_REL_TOL, budget: int = 4096, progress: bool = False, fallback: bool = False,
                 policy=None, seed: int = 0):
        if scheme not in ("permute", "rotate"):
            raise ValueError(f"scheme must be permute or rotate, got {scheme!r}")
        self.scheme, self.known, self.rel_tol, self.budget, self.progress = scheme, known or [], rel_tol, budget, progress
        self.fallback, self.policy, self.seed = fallback, policy, seed
        self.route = ""  # how the last call decoded: which invariant, or which key estimate

    @property
    def name(self) -> str:
        return f"keyed-{self.scheme}"

    def invert(self, observed: torch.Tensor, whitebox: WhiteBox, layer: int, tokenizer=None,
               length: int | None = None) -> Inversion:
        from attacks.sipit import SipIt
        from sipit.vocab_table import position_zero_table

        layer = whitebox.resolve_layer(layer)
        observed = whitebox.check_states(observed, length)
        started = time.perf_counter()
        table = position_zero_table(whitebox, layer, progress=self.progress).states
        unmixed = self._unmixed(observed, whitebox, layer, table)
        if unmixed is not None:
            inversion = SipIt(self.policy, seed=self.seed).invert(unmixed, whitebox, layer, tokenizer)
            inversion.seconds = time.perf_counter() - started
            inversion.setup = [*inversion.setup, f"key-recovery: {self.route}"]
            return inversion
        try:
            if self.scheme == "rotate":
                self.route = "gram invariants (no key: inner products are what a rotation keeps)"
                return self._gram_decode(observed, whitebox, layer, table, tokenizer, started)
            raise SipitInputError("no key estimate: the exposure's position-0 values match no token's, and no known "
                                  "pairs were given")
        except SipitInputError as err:
            if not self.fallback:
                raise
            self.route = f"failed ({err}): the prior's greedy guess"
            return self._prior_guess(observed.shape[0], whitebox, tokenizer, started)

    def _prior_guess(self, length: int, whitebox: WhiteBox, tokenizer, started: float) -> Inversion:
        """The model's greedy next-token guess for ``length`` positions, none verified (no key, no invariant)."""
        from sipit.prior import NextTokenPrior

        prior, path = NextTokenPrior(whitebox.model), []
        for _ in range(length):
            logprobs = prior.logprobs
            path.append(0 if logprobs is None else int(logprobs.argmax()))
            prior.push(path[-1])
        seconds = time.perf_counter() - started
        records = [PositionRecord(t, v, float("nan"), 0.0, 0, seconds / length, False) for t, v in enumerate(path)]
        return Inversion(ids=path, text=tokenizer.decode(path) if tokenizer is not None else "", positions=records,
                         seconds=seconds, vocab_size=whitebox.vocab_size, setup=[f"key-recovery: {self.route}"])

    def _unmixed(self, observed: torch.Tensor, whitebox: WhiteBox, layer: int, table: torch.Tensor):
        """The exposure with the key undone, or None when neither route gives a key."""
        if self.scheme == "permute":
            distance = (table.sort(dim=-1).values - observed[0].sort().values).norm(dim=-1)
            token = int(distance.argmin())
            if float(distance[token]) <= float(acceptance_radius(observed[:1], self.rel_tol)[0]):
                self.route = "sorted values at position 0, key from that row"
                key = permutation_from_row(table[token], observed[0])
                return observed[:, torch.argsort(key).to(observed.device)]
        if self.known:
            clean = torch.cat([whitebox.states(ids, layer) for ids, _ in self.known])
            exposed = torch.cat([states.float() for _, states in self.known]).to(clean.device)
            if self.scheme == "permute":
                self.route = f"assignment from {len(self.known)} known pairs"
                return observed[:, torch.argsort(assign_permutation(clean, exposed)).to(observed.device)]
            if clean.shape[0] >= clean.shape[1]:
                mixing = least_squares_mixing(clean, exposed)
                self.route = f"least squares from {len(self.known)} known pairs ({clean.shape[0]} rows)"
                return (observed.double() @ torch.linalg.inv(mixing)).float()
        return None

    def _gram_decode(self, observed: torch.Tensor, whitebox: WhiteBox, layer: int, table: torch.Tensor,
                     tokenizer, started: float) -> Inversion:
        """Depth-first decoding against the Gram invariants, position 0 by its norm (module docstring)."""
        from sipit.prior import NextTokenPrior

        radii = acceptance_radius(observed, self.rel_tol).double()
        norms = observed.double().norm(dim=-1)
        first = (table.double().norm(dim=-1) - norms[0]).abs()
        starts = torch.argsort(first)[: int((first <= radii[0]).sum())].tolist()
        tried: list[int] = [len(starts)]
        for start in starts:
            path, records = [start], []
            prefix = whitebox.prefix_cache([], layer)
            batch = whitebox.step(prefix, torch.tensor([start]))
            states = [batch.states[0].double()]
            prefix = batch.extended(0)
            prior = NextTokenPrior(whitebox.model)
            prior.push(start)
            ok = True
            for t in range(1, observed.shape[0]):
                radius = float(radii[t]) * (t + 1) ** 0.5  # t + 1 invariants, each within rel_tol ||h~_t||
                found = self._gram_step(whitebox, prefix, torch.stack(states), gram_invariants(observed, t), radius,
                                        prior)
                tried.append(found[2])
                if found[0] is None:
                    ok = False
                    break
                token, state, _, prefix = found
                path.append(token)
                states.append(state)
                if t + 1 < observed.shape[0]:
                    prior.push(token)
            if ok:
                seconds = time.perf_counter() - started
                records = [PositionRecord(t, v, 0.0, float(radii[t]), tried[t] if t < len(tried) else 0,
                                          seconds / len(path), True) for t, v in enumerate(path)]
                return Inversion(ids=path, text=tokenizer.decode(path) if tokenizer is not None else "",
                                 positions=records, seconds=seconds, vocab_size=whitebox.vocab_size)
        raise SipitInputError(f"no token sequence fits the exposure's inner products ({len(starts)} position-0 "
                              "candidates tried): is it an orthogonal mixing of this model's layer states?")

    def _gram_step(self, whitebox: WhiteBox, prefix, decoded: torch.Tensor, invariants: torch.Tensor, radius: float,
                   prior) -> tuple:
        """(token, state, candidates tried, extended prefix) of the first candidate whose Gram residual lies
        within ``radius``, in the prior's order then the whole vocabulary's; (None, None, tried, None) if
        none does within the vocabulary."""
        order = torch.argsort(prior.logprobs.cpu(), descending=True)
        tried = 0
        size = 16
        while tried < whitebox.vocab_size:
            candidates = order[tried : tried + size]
            batch = whitebox.step(prefix, candidates)
            residual = gram_residual(batch.states, decoded, invariants)
            tried += len(candidates)
            j = int(residual.argmin())
            if float(residual[j]) <= radius:
                return int(candidates[j]), batch.states[j].double(), tried, batch.extended(j)
            size = min(2 * size, 1024)
        return None, None, tried, None
