"""Utility cost of a defence, on held-out offline English text (Python's pydoc topics, :mod:`sipit.offline_text`).

Text: the pydoc topics sorted by name; every 5th topic (index % 5 == 0) is held out for utility,
the other topics are the frequency corpus of the rare-token tying variant (:func:`token_counts`),
so the two never overlap. ``n_tokens`` tokens are taken from the tokenised held-out text at an
offset drawn from ``torch.Generator().manual_seed(seed)``: the same slice for every defence.

Measures (:class:`UtilityReport`):

- perplexity of the clean and the served model over the slice (non-overlapping windows of
  ``window`` tokens, capped at the model's context), and the relative increase;
- next-token top-1 agreement of the served model with the clean one;
- the use "continued inference" (split serving, cached states): the served model's blocks above
  layer l consume the *exposed* states (``defense.expose`` applied to the layer-l states of every
  window, seeded) and the perplexity / top-1 agreement are measured again. This prices what the
  served-model numbers cannot: noise on the exposed copy and stored-activation quantisation cost
  nothing to the served model but as much as their in-model twins to anyone who continues from the
  exposed states. Pooled exposures cannot feed the blocks above l: ``None`` (not applicable);
- for per-position exposures, the fidelity of what leaks vs the clean layer-l states on the first
  ``fidelity_tokens`` tokens: relative L2 error ``||E - H||_F / ||H||_F`` and mean row cosine.
  (Pooled exposures have no per-position fidelity; their shape is reported.)
- ``uses``: one object per use of the states, named (issue 14): ``served`` and ``continued`` (the
  numbers above, under their use's name), and those of :mod:`defenses.uses` asked for by ``uses``
  (``embedding_store``: retrieval recall@k of defended sentence vectors against a clean store;
  ``probing``: clean-trained linear probes on defended states). Each object: ``name``,
  ``applicable``, ``loss`` (the use's utility loss; ``None`` where the use does not apply),
  ``metrics`` (flat scalars), ``setup``, ``seconds``. The flat fields above stay as they were.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from functools import lru_cache

import torch

from defenses.base import Defense
from defenses.uses import USES, measure_uses
from sipit.memo import memoised
from sipit.models import LoadedModel
from sipit.offline_text import frequency_text, held_out_text
from sipit.whitebox import WhiteBox

@lru_cache(maxsize=8)
def _encode(tokenizer, which: str) -> torch.Tensor:
    text = held_out_text() if which == "held_out" else frequency_text()
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)


def token_counts(tokenizer, vocab_size: int) -> torch.Tensor:
    """Counts of each token id over the frequency corpus (disjoint from the utility text)."""
    return torch.bincount(_encode(tokenizer, "frequency"), minlength=vocab_size)[:vocab_size]


def held_out_ids(tokenizer, n_tokens: int = 2048, seed: int = 0) -> torch.Tensor:
    """The fixed utility slice: ``n_tokens`` ids at a seeded offset in the held-out text."""
    ids = _encode(tokenizer, "held_out")
    if n_tokens < 2 or n_tokens > ids.numel():
        raise ValueError(f"the held-out utility text holds {ids.numel()} tokens of this tokenizer: give 2..{ids.numel()}, "
                         f"got {n_tokens}")
    start = int(torch.randint(0, ids.numel() - n_tokens + 1, (1,), generator=torch.Generator().manual_seed(seed)))
    return ids[start : start + n_tokens]


@dataclass
class UtilityReport:
    defense: str
    params: dict
    layer: int
    n_tokens: int
    ppl_clean: float
    ppl_served: float
    ppl_rel_increase: float
    top1_agreement: float
    state_rel_l2: float | None = None
    state_cosine: float | None = None
    continued_ppl: float | None = None  # use "continued inference" (module docstring); None: not applicable
    continued_ppl_rel_increase: float | None = None
    continued_top1_agreement: float | None = None
    exposure_shape: list[int] = field(default_factory=list)
    uses: dict = field(default_factory=dict)  # use name -> {name, applicable, loss, metrics, setup, seconds}
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def _context(model) -> int:
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return int(getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", 1024))


@torch.no_grad()
def _nll_and_top1(model, ids: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per predicted token: negative log-likelihood and the argmax prediction."""
    nll, top1 = [], []
    for part in ids.split(window):
        if part.numel() < 2:
            continue
        logits = model(input_ids=part[None]).logits[0, :-1].float()
        logp = torch.log_softmax(logits, dim=-1)
        nll.append(-logp.gather(1, part[1:, None])[:, 0])
        top1.append(logits.argmax(dim=-1))
    return torch.cat(nll), torch.cat(top1)


@torch.no_grad()
def _continued(served: LoadedModel, defense: Defense, layer: int, ids: torch.Tensor, window: int,
               seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_nll_and_top1` of the served model whose layer-l states are replaced by what the provider
    continues from (``defense.provider_view``, seeded: the exposure itself, or for a keyed defence the
    exposure with its key undone), i.e. the blocks above l continue from the exposed copy."""
    generator = torch.Generator().manual_seed(seed)

    def exposed(states: torch.Tensor) -> torch.Tensor:
        return torch.stack([defense.provider_view(row, generator) for row in states])

    handle = WhiteBox(served.model).transform_layer(layer, exposed)
    try:
        return _nll_and_top1(served.model, ids, window)
    finally:
        handle.remove()


@torch.no_grad()
def utility_cost(
    clean: LoadedModel,
    defense: Defense,
    layer: int,
    *,
    n_tokens: int = 2048,
    seed: int = 0,
    window: int = 1024,
    fidelity_tokens: int = 256,
    uses=USES,
) -> UtilityReport:
    """Perplexity, top-1 agreement and exposure fidelity of ``defense`` vs the clean model, and its cost
    for each use (``uses``: which of :data:`defenses.uses.USES` to measure besides served / continued)."""
    started = time.perf_counter()
    ids = held_out_ids(clean.tokenizer, n_tokens, seed)
    window = min(window, _context(clean.model))
    # The clean model's losses on the slice: computed once per (slice, window), held by ``clean``.
    nll_clean, top1_clean = memoised(clean, "utility-clean", (n_tokens, seed, window),
                                     lambda: _nll_and_top1(clean.model, ids, window))
    served = defense.serve(clean, layer)
    if served.model is clean.model:
        nll_served, top1_served = nll_clean, top1_clean
    else:
        nll_served, top1_served = _nll_and_top1(served.model, ids, window)
    ppl_clean = math.exp(float(nll_clean.mean()))
    ppl_served = math.exp(float(nll_served.mean()))
    report = UtilityReport(
        defense=defense.name, params=defense.params(), layer=layer, n_tokens=int(ids.numel()),
        ppl_clean=ppl_clean, ppl_served=ppl_served, ppl_rel_increase=ppl_served / ppl_clean - 1.0,
        top1_agreement=float((top1_served == top1_clean).float().mean()),
    )
    probe = ids[:fidelity_tokens]
    states_clean = WhiteBox(clean.model).states(probe, layer)
    exposed = defense.expose(WhiteBox(served.model).states(probe, layer), torch.Generator().manual_seed(seed))
    report.exposure_shape = list(exposed.shape)
    if exposed.shape == states_clean.shape:
        diff = (exposed.float() - states_clean.float())
        report.state_rel_l2 = float(diff.norm() / states_clean.float().norm())
        report.state_cosine = float(torch.nn.functional.cosine_similarity(exposed.float(), states_clean.float(), dim=-1).mean())
    # after the fidelity probe: an in-model noise hook draws from the served model's own stream
    if defense.per_position:
        # an exposure equal to the served states continues exactly as the served model: no second pass
        nll_cont, top1_cont = (_continued(served, defense, layer, ids, window, seed) if defense.alters_exposure
                               else (nll_served, top1_served))
        report.continued_ppl = math.exp(float(nll_cont.mean()))
        report.continued_ppl_rel_increase = report.continued_ppl / ppl_clean - 1.0
        report.continued_top1_agreement = float((top1_cont == top1_clean).float().mean())
    report.uses = {
        "served": {"name": "served", "applicable": True, "loss": report.ppl_rel_increase,
                   "metrics": {"ppl": ppl_served, "ppl_rel_increase": report.ppl_rel_increase,
                               "top1_agreement": report.top1_agreement}},
        "continued": {"name": "continued", "applicable": report.continued_ppl is not None,
                      "loss": report.continued_ppl_rel_increase,
                      "metrics": {"ppl": report.continued_ppl, "ppl_rel_increase": report.continued_ppl_rel_increase,
                                  "top1_agreement": report.continued_top1_agreement}},
    }
    # last: a served model with in-model noise draws from its own stream, so the numbers above stay as before
    report.uses.update(measure_uses(clean, served, defense, layer, uses, seed=seed))
    report.seconds = time.perf_counter() - started
    return report
