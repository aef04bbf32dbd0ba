"""One pipeline for every measurement: expose -> attack -> metrics (recording is the caller's).

``benchmarks.run`` (one setting, full report) and ``benchmarks.search`` (one trial per setting)
both go through these functions, so the exposure a defence produces, the attack that knows it and
the head trained against it are the same in both:

1. :func:`expose`: serve the model through the defence chain, take the layer-l states of each
   prompt and pass them through the chain's exposure (seeded generator); note for each prompt the
   absolute noise sigma, whether the exposed states are exactly the attacker model's, and the
   noise norm ||h~_t - mu_t|| at every position (per-position exposures only).
2. :func:`attack_for` (attacks.registry) / :func:`train_softmax_head`: the attack that knows the
   exposure; the softmax head trained on corpus states, clean or passed through the defence's
   exposure (:func:`exposure_fn`: the adaptive head).
3. :func:`invert_all`: every prompt through one ``invert(observed, whitebox, layer, tokenizer,
   length)`` call (a pooled exposure needs the length; per-position attacks check it).
4. :func:`margins_on_subset`: the margin Delta_t at a seeded subset of positions, next to the noise
   norms, so recovery can be read against ||n_t|| / (Delta_t / 2).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import torch
from tqdm.auto import tqdm

from attacks.registry import AttackOptions, Exposure, build
from defenses.base import chain_members


@dataclass
class Exposed:
    """The exposed states of a prompt set under one defence chain, and what the attacker runs on."""

    chain: object  # defences.base.Chain
    attacker: object  # sipit.models.LoadedModel the attacker runs (the served copy when it knows the defence)
    attacker_wb: object  # sipit.whitebox.WhiteBox of ``attacker``
    layer: int
    prompt_ids: list[list[int]]
    states: list[torch.Tensor]  # what the attacker observes, per prompt
    sigmas: list[float]  # absolute noise sigma per prompt (0: none)
    exact: list[bool]  # exposed states equal the attacker's own, bit for bit
    noise_norms: list[list[float | None]]  # ||h~_t - mu_t|| per position (None: pooled)
    state_rms: list[float]  # RMS of the served model's layer-l states, per prompt (the unit of a relative sigma)
    served_shape: bool = False  # verify candidates at the served shape (the attacker holds shape-dependent weights)
    knows_defense: bool = True  # False: the naive attacker (original weights, no noise sigma or format error)
    known: list = field(default_factory=list)  # (ids, exposed states) pairs the attacker knows (add_known_pairs)

    def verifier(self, i: int):
        """The WhiteBox that verifies prompt ``i``'s candidates: ``attacker_wb``, at the served shape
        of prompt ``i`` when the defence's kernels depend on it (defenses.base.Defense.served_shape_matters)
        and the exposure is exact (under noise or stored-activation quantisation the bf16 gap is far
        inside what the decoders tolerate, and a served-shape step costs ~n incremental ones)."""
        if self.served_shape and self.exact[i]:
            return self.attacker_wb.at_served_shape(len(self.prompt_ids[i]))
        return self.attacker_wb

    def knowledge(self, i: int) -> Exposure:
        """What the attacker knows about prompt ``i``'s exposure (attacks.registry.Exposure), as the defence
        declares it (defenses.base.Defense.knowledge: the pooling, the tying groups, the keyed scheme, the DP
        mechanism), given the measured noise sigma and whether the states are exactly the attacker's.

        The naive attacker (``knows_defense=False``) holds the original weights and does not know the
        noise sigma or the storage format's error: inexact states then get the nearest neighbour on the
        gradient shortlist. The pooling stays known either way: a pooled exposure has no per-position
        states for any other attack to read. Known (prompt, exposure) pairs (:func:`add_known_pairs`) go
        to an attacker of a keyed exposure."""
        sigma = self.sigmas[i] if self.knows_defense else 0.0
        exposure = self.chain.knowledge(Exposure(sigma=sigma, exact=self.exact[i]), self.knows_defense)
        if exposure.keyed is not None and self.known:
            exposure = replace(exposure, known=tuple(self.known))
        return exposure


def add_known_pairs(exposed: "Exposed", k: int, seed: int) -> None:
    """Give the attacker ``k`` known (prompt, exposure) pairs (``exposed.known``): random-token prompts of
    the exposed prompts' length, drawn with ``seed``, passed through the defence's exposure as the provider
    would serve them (a deployment key is the target's key; a per-prompt key is fresh for each, drawn from
    a stream of their own). Their states are the attacker model's, i.e. the served model's whenever the
    attacker holds the served weights. Nothing for ``k`` = 0 or pairs already given."""
    from benchmarks.prompts import prompt_set

    if k <= 0 or len(exposed.known) >= k:
        return
    length = max(len(ids) for ids in exposed.prompt_ids)
    prompts = prompt_set(exposed.attacker.tokenizer, k, length=length, seed=seed, natural_fraction=0.0,
                         vocab_size=exposed.attacker_wb.vocab_size)
    generator = torch.Generator().manual_seed(seed)
    exposed.known = [(p.ids, exposed.chain.expose(exposed.attacker_wb.states(p.ids, exposed.layer), generator))
                     for p in prompts[:k]]


def expose(chain, loaded, clean_wb, layer: int, prompt_ids: list[list[int]], *, seed: int,
           knows_defense: bool = True, progress: bool = False) -> Exposed:
    """Serve ``loaded`` through ``chain`` and expose layer ``layer`` of every prompt (module docstring, 1)."""
    from sipit.whitebox import WhiteBox

    served = chain.serve(loaded, layer)
    attacker = chain.attacker_model(loaded, layer, knows_defense)
    served_wb = clean_wb if served.model is loaded.model else WhiteBox(served.model, exposure=clean_wb.exposure)
    attacker_wb = clean_wb if attacker.model is loaded.model else WhiteBox(attacker.model, proposals_from=clean_wb,
                                                                            exposure=clean_wb.exposure)
    generator = torch.Generator().manual_seed(seed)
    states, sigmas, exact, norms, state_rms = [], [], [], [], []
    for ids in tqdm(prompt_ids, desc="expose states", disable=not progress, leave=False):
        h_served = served_wb.states(ids, layer)
        exposed = chain.expose(h_served, generator)
        states.append(exposed)
        sigmas.append(float(chain.noise_sigma(h_served)))
        state_rms.append(float(h_served.float().pow(2).mean().sqrt()))
        if chain.per_position:
            h_true = attacker_wb.states(ids, layer)  # mu_{p_t, s_t} as the attacker computes it
            norms.append((exposed.float() - h_true.float()).norm(dim=-1).tolist())
            exact.append(bool(torch.equal(exposed, h_true)))
        else:
            norms.append([None] * len(ids))
            exact.append(False)
    # half-precision kernels differ between an incremental step and the served forward (sipit.whitebox):
    # an attacker that holds the served weights verifies at the served shape, bit for bit
    half = served_wb.dtype != torch.float32
    served_shape = (chain.served_shape_matters or half) and attacker.model is served.model
    return Exposed(chain, attacker, attacker_wb, layer, prompt_ids, states, sigmas, exact, norms, state_rms,
                   served_shape, knows_defense)


def naive_fp32(exposed: Exposed, fp32) -> Exposed:
    """The same exposure attacked by the naive attacker of half-precision states (what peers do): it
    recomputes in fp32 (``fp32``: the model loaded in fp32), does not know the serving dtype, and takes
    the states as they come (inexact unless they match its fp32 recomputation bit for bit: nearest
    neighbour, attacks.registry.strongest)."""
    from sipit.whitebox import WhiteBox

    wb = WhiteBox(fp32.model, exposure=exposed.attacker_wb.exposure)
    recomputed = [wb.states(ids, exposed.layer) for ids in exposed.prompt_ids]
    exact = [bool(torch.equal(h, r)) for h, r in zip(exposed.states, recomputed)]
    norms = ([(h.float() - r.float()).norm(dim=-1).tolist() for h, r in zip(exposed.states, recomputed)]
             if exposed.chain.per_position else exposed.noise_norms)
    return replace(exposed, attacker=fp32, attacker_wb=wb, exact=exact, noise_norms=norms, served_shape=False,
                   knows_defense=False)


def attack_for(exposed: Exposed, i: int, name: str, options: AttackOptions):
    """The registered attack ``name`` built for prompt ``i``'s exposure (with ``options.known_pairs`` known
    pairs, :func:`add_known_pairs`, where the exposure is keyed)."""
    if options.known_pairs and exposed.knowledge(i).keyed is not None:
        add_known_pairs(exposed, options.known_pairs, seed=options.seed + 1000)
    return build(name, exposed.knowledge(i), options)


def invert_all(exposed: Exposed, make: Callable[[int], object], tokenizer, *, progress: bool = False,
               desc: str = "invert", on_prompt: Callable[[int, object], None] | None = None,
               indices: Sequence[int] | None = None) -> list:
    """``make(i).invert(...)`` on every exposed prompt (or those of ``indices``); ``on_prompt(i, inversion)`` after each."""
    inversions = []
    for i in tqdm(range(len(exposed.prompt_ids)) if indices is None else indices, desc=desc, disable=not progress):
        ids = exposed.prompt_ids[i]
        inversion = make(i).invert(exposed.states[i], exposed.verifier(i), exposed.layer, tokenizer, length=len(ids))
        inversions.append(inversion)
        if on_prompt is not None:
            on_prompt(i, inversion)
    return inversions


def exposure_fn(defense) -> Callable[[torch.Tensor, torch.Generator], torch.Tensor]:
    """States -> what the attacker sees, for training the adaptive head on corpus states.

    Noise placed inside the model is added directly (its layer-l states are the noisy ones)."""
    members = chain_members(defense)

    def apply(states: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        for member in members:
            if getattr(member, "placement", "exposure") == "model" and hasattr(member, "add_noise"):
                states = member.add_noise(states, generator)
            else:
                states = member.expose(states, generator)
        return states

    return apply


def train_softmax_head(exposed: Exposed, variant: str, *, n_tokens: int, epochs: int, seed: int,
                       progress: bool = False):
    """(head, report, corpus) of the softmax head trained on the attacker model's corpus states.

    The corpus is the inverse heads' (attacks.proposals.corpus_examples: text and random-token windows,
    states shared with them through the cache); ``n_tokens`` > 0 keeps only its first ``n_tokens`` text
    tokens instead (the small-corpus ablation). ``variant="adaptive"`` passes every training batch through
    the defence's exposure (:func:`exposure_fn`); ``"clean"`` trains on the states as they are. ``corpus``
    says what the head was trained on: ``{"n_tokens", "ablation", "windows"}`` (windows: the token ids).
    """
    from attacks.head import train_head
    from attacks.proposals import HeadConfig, corpus_examples, training_windows

    wb = exposed.attacker_wb
    config = HeadConfig() if not n_tokens else replace(HeadConfig(), n_text=n_tokens, n_random=0)
    sources = training_windows(exposed.attacker.tokenizer, wb.vocab_size, config, slot=2)
    x, y, held = corpus_examples(wb, exposed.layer, sources, 0, config, progress)
    head, report = train_head(x, y, held, vocab_size=wb.vocab_size, epochs=epochs, seed=seed, variant=variant,
                              augment=exposure_fn(exposed.chain) if variant == "adaptive" else None, progress=progress)
    corpus = {"n_tokens": int(y.numel()), "ablation": bool(n_tokens), "windows": [w for src in sources for w in src]}
    return head, report, corpus


def margins_on_subset(exposed: Exposed, margin_positions: int, seed: int, *, progress: bool = False) -> dict:
    """Delta_t over the full vocabulary (sipit.margins) at position 0 of every prompt and at the later
    positions among a seeded subset of ``margin_positions`` (prompt, position) pairs (-1: every
    position), beside the noise norm ||n_t|| measured at every position.

    Position 0 reads the position-0 table (sipit.vocab_table: one sweep of the vocabulary per model
    and layer, cached on disk, the one the learned proposals use), so its margins cost nothing once
    the table exists; every later position costs one sweep of the vocabulary on its prefix, once:
    sipit.margin_store keeps it on disk for the next setting of a sweep or the next run.
    """
    from benchmarks.metrics import median
    from sipit.margin_store import stored_margin
    from sipit.margins import margin_from_distances, margin_from_states
    from sipit.sweep import sweep_distances
    from sipit.vocab_table import position_zero_table

    started = time.perf_counter()
    all_norms = [n for row in exposed.noise_norms for n in row if n is not None]
    truths, wb, layer = exposed.prompt_ids, exposed.attacker_wb, exposed.layer
    pairs = [(i, t) for i, ids in enumerate(truths) for t in range(len(ids))]
    if not exposed.chain.per_position:
        pairs = []
    elif margin_positions != -1:  # the seeded subset, drawn over every position as before position 0 was free
        pick = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(seed))
        pairs = [pairs[j] for j in sorted(pick[:margin_positions].tolist())]
    first = sorted({i for i, ids in enumerate(truths) if ids} if exposed.chain.per_position else set())
    later = [(i, t) for i, t in pairs if t > 0]
    deltas: dict[tuple[int, int], float] = {}
    if first:
        table = position_zero_table(wb, layer, progress=progress).states
        deltas.update({(i, 0): margin_from_states(table, truths[i][0])[0] for i in first})
    def sweep_margin(ids: torch.Tensor, t: int) -> float:
        prefix = wb.prefix_cache(ids[:t], layer)
        mu_true = wb.step(prefix, ids[t : t + 1]).states[0]
        return margin_from_distances(sweep_distances(wb, prefix, mu_true), int(ids[t]))[0]

    for i, t in tqdm(later, desc=f"margins Delta (full vocab, {len(later)} positions)", disable=not progress, leave=False):
        ids = torch.tensor(truths[i])
        deltas[(i, t)] = stored_margin(wb, layer, truths[i][: t + 1], lambda: sweep_margin(ids, t))
    deltas = dict(sorted(deltas.items()))
    half = {k: d / 2 for k, d in deltas.items()}
    return {
        "n_positions": len(deltas), "positions": [list(k) for k in deltas], "deltas": list(deltas.values()),
        "median_half_delta": median(half.values()),
        "median_half_delta_position0": median(h for (_, t), h in half.items() if t == 0),
        "median_half_delta_later": median(h for (_, t), h in half.items() if t > 0),
        "n_later_positions": len(later),
        "median_noise_norm": median(all_norms), "n_noise_positions": len(all_norms),
        "noise_norms_all": all_norms, "seconds": time.perf_counter() - started,
        "note": "Delta over the full vocabulary at position 0 of every prompt (position-0 table) and at a "
                "seeded subset of later positions (--margin-positions)",
    }
