"""Learned candidate proposals: an inverse head per (model, layer) that ranks tokens for a state.

The head maps a layer-l state h to a direction in the model's own input-embedding space and
scores every token by the cosine to its embedding:

    u(h) = W_2 GELU(W_1 z(h) + b_1) + b_2 + S z(h),     z(h) = (h - mean) / std

    s_v(h) = cos( u(h), E_v ),      log q(v | h) = log_softmax_v( s_v(h) / tau )

(a one-hidden-layer MLP with a linear skip, hidden width 4 d). It is trained with a sampled
softmax: for each minibatch of (h_t, s_t) pairs of an offline corpus (attacks.corpus: Python's
documentation plus seeded random-token windows; no evaluation prompt), the cross-entropy of
exp(a) s_v(h) over the batch's true tokens plus ``negatives`` seeded random tokens (``a`` is a
learned log-scale), Adam, ``epochs`` passes (at least ``min_steps`` steps). ``tau`` is then the temperature with the least
held-out negative log-likelihood on a grid. Because the head targets the embedding geometry
rather than a softmax over the tokens it has seen, it ranks tokens that never occur in its
corpus too. (A ridge-regression linear head was tried first and ranked worse than the MLP on
smollm2's last layer, in a development comparison that is not kept; the recall this head reaches is
in docs/sipit.md, "Learned proposals".)

The head only ORDERS candidates (attacks.policies.LearnedPolicy): exact SipIt verifies every
candidate against the observed state, so a bad head costs time, never correctness.

Noise-adapted heads (``HeadConfig.noise`` = sigma > 0): every training minibatch gets fresh
seeded Gaussian noise N(0, sigma^2 I) added to its states, and the temperature and the recall report
are measured on noisy held-out states, so the head ranks tokens for the exposure h~ = h + n that a
noisy defence publishes (the shortlist of the noise-robust decoders, attacks.robust).

A head is cached in memory by the WhiteBox (``WhiteBox.memo``) and on disk under
``sipit.cache.cache_dir() / "heads"``, keyed by the model (sipit.cache.model_key), the layer, the
configuration and the corpus token ids; an unreadable or malformed file is removed with a warning
and rebuilt. The corpus states (the costly part: a forward pass over the corpus)
are cached as well (``cache_dir() / "head-corpus"``, fp16, keyed by the model key, layer and corpus ids),
so further heads of the same layer (other noise levels) cost only their fit.

Noise levels share heads on the grid {1, 1.5, 2, 3, 5, 7} x 10^k (:func:`head_noise`, nearest in
log sigma; it holds the round sigmas sweeps use): sigma relative to each prompt's RMS gives every
prompt of a run its own absolute sigma, and a fit per prompt (minutes at smollm2's deep layers) would
cost more than the inversion. A head trained within a factor sqrt(5/3) (1.29) of the exposure's sigma
is assumed to rank about as well (not measured); it only orders candidates.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from attacks.corpus import corpus_windows, random_windows
from attacks.training import epochs_for, minibatches, sampled_classes
from sipit import cache
from sipit.cache import entry_path, model_key
from sipit.memo import memoised
from sipit.resources import FLOAT32, check_room
from sipit.whitebox import WhiteBox

TEMPERATURES = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5)
SLOTS = (1, 2)  # one head for position 1, one for positions >= 2


@dataclass(frozen=True)
class HeadConfig:
    """How an inverse head is trained."""

    n_text: int | None = None  # tokens of offline text (None: sized to the vocabulary, :meth:`sized`)
    n_random: int | None = None  # tokens of seeded random-token windows (None: sized)
    n_pairs: int | None = None  # two-token windows for the position-1 head (text bigrams + random pairs; None: sized)
    window: int = 64
    epochs: int = 3
    min_steps: int | None = None  # optimiser steps at least (small corpora take more passes; None: sized)
    batch_size: int = 256
    negatives: int = 4096  # sampled tokens per minibatch (the whole vocabulary when smaller)
    lr: float = 1e-3
    heldout_fraction: float = 0.05  # last windows of each source, for tau and the recall report
    seed: int = 0
    windows_per_pass: int = 16  # windows per batched forward pass
    noise: float = 0.0  # Gaussian sigma (absolute, per coordinate) added to the training states
    corpus_precision: str = "auto"  # forward passes over the corpus: "fp32", "bf16" or "auto" (corpus_precision())


    def sized(self, vocab_size: int) -> "HeadConfig":
        """This configuration with every size left at None set for a vocabulary of ``vocab_size`` tokens:
        n_text = min(150,000, 64 V), n_random = min(32,768, 16 V), n_pairs = min(16,384, 8 V) and
        min_steps = min(1000, V / 2). A head needs examples in proportion to the tokens it must tell apart:
        a 512-token toy model gets a 33k-token corpus (seconds), smollm2 (V = 49,152) and larger ones the
        full one."""
        sizes = {"n_text": min(150_000, 64 * vocab_size), "n_random": min(32_768, 16 * vocab_size),
                 "n_pairs": min(16_384, 8 * vocab_size), "min_steps": min(1000, vocab_size // 2)}
        return replace(self, **{k: v for k, v in sizes.items() if getattr(self, k) is None})


@dataclass
class HeadReport:
    """What a head cost and how well it ranks held-out corpus states."""

    layer: int
    slot: int  # 1: the head of position 1; 2: of positions >= 2
    n_train: int
    n_heldout: int
    top1: float  # held-out recall@1
    top16: float  # held-out recall@16
    median_rank: float
    temperature: float
    seconds: float  # building (states + fit), or loading from disk
    cached: bool
    needs: str = ""  # what the build needed (sipit.resources.check_room), when it was built

    def to_dict(self) -> dict:
        return asdict(self)


class InverseHead(nn.Module):
    """log q(v | h) over the whole vocabulary (see the module docstring for the formula)."""

    def __init__(self, mean: torch.Tensor, scale: torch.Tensor, directions: torch.Tensor, temperature: float = 1.0):
        super().__init__()
        d, d_e = mean.numel(), directions.shape[1]
        self.register_buffer("mean", mean.float().clone())
        self.register_buffer("scale", scale.float().clone())
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d_e))
        self.skip = nn.Linear(d, d_e)
        self.log_scale = nn.Parameter(torch.tensor(3.0))  # training logits: exp(a) * cosine
        self.directions = directions.float()  # (V, d_E) unit embeddings (not saved: the model's own)
        self.temperature = float(temperature)

    def direction(self, h: torch.Tensor) -> torch.Tensor:
        """u(h) / ||u(h)|| for each row of ``h`` ``(N, d)``."""
        z = (h.float().cpu() - self.mean) / self.scale
        return nn.functional.normalize(self.mlp(z) + self.skip(z), dim=-1)

    @torch.no_grad()
    def cosines(self, h: torch.Tensor) -> torch.Tensor:
        """s_v(h) for each row of ``h`` ``(N, d)`` (or one state ``(d,)``): ``(N, V)`` or ``(V,)``."""
        single = h.dim() == 1
        out = self.direction(h.reshape(-1, self.mean.numel())) @ self.directions.T
        return out[0] if single else out

    def log_probs(self, h: torch.Tensor) -> torch.Tensor:
        """log q(v | h) = log_softmax(s(h) / tau)."""
        return torch.log_softmax(self.cosines(h) / self.temperature, dim=-1)


#: mantissas of the noise grid of the heads (module docstring)
NOISE_GRID = (1.0, 1.5, 2.0, 3.0, 5.0, 7.0)


def head_noise(sigma: float) -> float:
    """The grid sigma g x 10^k (g in NOISE_GRID) nearest to ``sigma`` in log scale, the level a
    noise-adapted head is trained at; 0 for sigma <= 0."""
    if not sigma > 0:
        return 0.0
    k = math.floor(math.log10(sigma))
    points = [g * 10.0**e for e in (k, k + 1) for g in NOISE_GRID]
    best = min(points, key=lambda p: abs(math.log(p / sigma)))
    return float(f"{best:.6g}")  # 0.1, not 0.10000000000000002: the value keys the cache


def true_ranks(scores: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rank of ``ids[i]`` in row ``i`` of ``scores`` (0 = best; ties count against the truth)."""
    return (scores > scores.gather(1, ids[:, None])).sum(1)


def unit_embeddings(whitebox: WhiteBox, chunk: int = 8192) -> torch.Tensor:
    """E_v / ||E_v|| for every token, ``(V, d)`` fp32 (the model's own embedding-module outputs), computed
    ``chunk`` tokens at a time and memoised per WhiteBox: every head of the model shares one matrix."""

    def build() -> torch.Tensor:
        out = torch.empty(whitebox.vocab_size, whitebox.hidden_size)
        with torch.no_grad():
            for ids in torch.arange(whitebox.vocab_size).split(chunk):
                rows = whitebox.embed(ids.to(whitebox.device)).float().cpu()
                out[ids] = torch.nn.functional.normalize(rows, dim=1)
        return out

    return memoised(whitebox, "unit-embeddings", None, build)


def training_windows(tokenizer, vocab_size: int, config: HeadConfig, slot: int) -> tuple[list[list[int]], ...]:
    """The corpus of one head, as one list of equal-length windows per source (text, random tokens).

    ``slot`` 2 (positions >= 2): windows of ``config.window`` tokens. ``slot`` 1 (position 1, whose
    state mixes in position 0's very unlike one): two-token windows, half text bigrams at seeded
    offsets of the text, half random pairs.
    """
    config = config.sized(vocab_size)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    text = [t for w in corpus_windows(tokenizer, config.n_text, config.window) for t in w] if config.n_text else []
    if slot == 1:
        n_text = min(config.n_pairs // 2, max(len(text) - 1, 0))
        offsets = torch.randperm(max(len(text) - 1, 0), generator=torch.Generator().manual_seed(config.seed))[:n_text]
        sources = ([text[i : i + 2] for i in offsets.tolist()],
                   random_windows(vocab_size, 2 * (config.n_pairs - n_text), 2, config.seed, special))
    else:
        sources = ([text[i : i + config.window] for i in range(0, len(text), config.window)],
                   random_windows(vocab_size, config.n_random, config.window, config.seed, special)
                   if config.n_random else [])
    length = 2 if slot == 1 else config.window
    full = tuple([w for w in source if len(w) == length] for source in sources)
    if not any(full):
        raise ValueError("the inverse head's corpus holds no full window: raise n_text, n_random or n_pairs")
    return full


def heldout_mask(n_windows: int, window: int, fraction: float) -> torch.Tensor:
    """Row mask of the last ``round(fraction * n_windows)`` windows (at least one, at most all but one)."""
    n_held = min(max(1, round(n_windows * fraction)), n_windows - 1) if n_windows > 1 else 0
    mask = torch.zeros(n_windows, dtype=torch.bool)
    mask[n_windows - n_held :] = True
    return mask.repeat_interleave(window)


PRECISIONS = ("auto", "fp32", "bf16")


@functools.cache
def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` computes bf16 matrix products natively: a CUDA GPU that supports bf16, or a CPU
    with the avx512_bf16 or amx_bf16 instructions (Linux's /proc/cpuinfo). Elsewhere bf16 is emulated and
    slower than fp32."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    if device.type != "cpu":
        return False
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def corpus_precision(whitebox: WhiteBox, config: HeadConfig) -> str:
    """The precision of the corpus's forward passes: ``config.corpus_precision``, "auto" read as "bf16" where
    :func:`native_bf16` (3.6x faster at smollm2's last layer on 2 cores of an EPYC with avx512_bf16; states
    within ~1% of fp32's) and "fp32" elsewhere. The heads only rank candidates: verification stays exact."""
    if config.corpus_precision not in PRECISIONS:
        raise ValueError(f"corpus_precision must be one of {PRECISIONS}, got {config.corpus_precision!r}")
    if config.corpus_precision != "auto":
        return config.corpus_precision
    return "bf16" if native_bf16(whitebox.device) else "fp32"


@torch.no_grad()
def layer_states(whitebox: WhiteBox, windows: list[list[int]], layer: int, per_pass: int,
                 progress: bool = False, precision: str = "fp32") -> torch.Tensor:
    """Layer-``layer`` states of every window (batched forward passes, under bf16 autocast when
    ``precision`` is "bf16"), ``(sum of lengths, d)``."""
    groups = [windows[i : i + per_pass] for i in range(0, len(windows), per_pass)]
    with torch.autocast(whitebox.device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
        rows = [whitebox.states_batch(torch.tensor(g), layer).reshape(-1, whitebox.d).float().cpu()
                for g in tqdm(groups, desc=f"inverse-head corpus l={layer}", disable=not progress, leave=False)]
    return torch.cat(rows)


def add_noise(x: torch.Tensor, sigma: float, generator: torch.Generator) -> torch.Tensor:
    """``x + N(0, sigma^2 I)`` drawn from ``generator`` (``x`` itself when sigma is 0)."""
    return x + sigma * torch.randn(x.shape, generator=generator) if sigma > 0 else x


@torch.enable_grad()
def fit_head(x: torch.Tensor, y: torch.Tensor, directions: torch.Tensor, config: HeadConfig,
             progress: bool = False) -> InverseHead:
    """Train an :class:`InverseHead` on states ``x`` (N, d) of tokens ``y`` (N,) with a sampled
    softmax (module docstring), fresh noise of ``config.noise`` on every minibatch; every random
    choice is drawn from a generator seeded by ``config.seed``. Gradients are enabled here, so an
    attack may build its heads on first use inside its own ``torch.no_grad()`` decode."""
    config = config.sized(directions.shape[0])
    generator = torch.Generator().manual_seed(config.seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        head = InverseHead(x.mean(0), x.std(0).clamp_min(1e-6), directions)
    optimiser = torch.optim.Adam(head.parameters(), lr=config.lr)
    vocab = directions.shape[0]
    n_neg = min(config.negatives, vocab)
    epochs = epochs_for(x.shape[0], config.batch_size, config.epochs, config.min_steps)
    for rows in minibatches(x.shape[0], config.batch_size, epochs, generator, progress=progress,
                            desc="inverse-head training"):
        pool, label = sampled_classes(y[rows], vocab, n_neg, generator)
        logits = head.log_scale.exp() * head.direction(add_noise(x[rows], config.noise, generator)) @ directions[pool].T
        loss = nn.functional.cross_entropy(logits, label)
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
    head.eval()
    return head


SCORED_FLOATS = 1 << 24  # held-out rows x V cosines scored at once (64 MB), whatever the vocabulary


@torch.no_grad()
def heldout_evaluation(head: InverseHead, x: torch.Tensor, ids: torch.Tensor) -> tuple[float, torch.Tensor]:
    """(tau, ranks) on held-out states ``x`` (N, d) of tokens ``ids`` (N,): the tau of TEMPERATURES with the
    least mean NLL of ``ids`` under log_softmax(s(x) / tau), and the rank of each true token under s(x)
    (:func:`true_ranks`). The (rows, V) cosines are formed :data:`SCORED_FLOATS` at a time, so memory stays
    bounded for any vocabulary (all rows at once would be N x V floats: 9 GB for V = 262k)."""
    per_chunk = max(1, SCORED_FLOATS // head.directions.shape[0])
    nll = torch.zeros(len(TEMPERATURES), dtype=torch.float64)
    ranks = []
    for rows, truth in zip(x.split(per_chunk), ids.split(per_chunk)):
        cosines = head.cosines(rows)
        true = cosines.gather(1, truth[:, None])
        ranks.append((cosines > true).sum(1))
        for i, tau in enumerate(TEMPERATURES):
            nll[i] += float((torch.logsumexp(cosines / tau, 1) - true[:, 0] / tau).sum())
    return TEMPERATURES[int(nll.argmin())], torch.cat(ranks)


def _head_path(whitebox: WhiteBox, layer: int, slot: int, config: HeadConfig, windows) -> Path | None:
    """The head's cache file: the model key, the layer, the slot and a hash of the configuration and the
    corpus ids (None: the model has no cache key)."""
    key = model_key(whitebox)
    if key is None:
        return None
    fields = asdict(config)
    if not fields["noise"]:
        del fields["noise"]  # clean heads keep the key they had before noise-adapted heads existed
    fields["corpus_precision"] = corpus_precision(whitebox, config)
    if fields["corpus_precision"] == "fp32":
        del fields["corpus_precision"]  # and fp32 ones the key they had before bf16 corpora
    digest = hashlib.blake2b(repr((fields, windows)).encode(), digest_size=8).hexdigest()
    return entry_path("heads", f"inverse-{key}-l{layer}-p{slot}-{digest}.pt")


def corpus_states(whitebox: WhiteBox, windows: list[list[int]], layer: int, per_pass: int,
                  progress: bool = False, precision: str = "fp32") -> torch.Tensor:
    """:func:`layer_states` of ``windows``, from the disk cache when it holds them (fp16, keyed by the model
    key, layer, the window ids and the precision; a damaged or misshapen file is removed and recomputed)."""
    key = model_key(whitebox)
    digest = hashlib.blake2b(repr(windows).encode(), digest_size=8).hexdigest()
    tag = "" if precision == "fp32" else f"-{precision}"
    path = None if key is None else entry_path("head-corpus", f"states-{key}-l{layer}-{digest}{tag}.pt")
    shape = (sum(len(w) for w in windows), whitebox.d)
    states = cache.load(path, cache.check_tensor(shape)) if path is not None else None
    if states is not None:
        return states.float()
    states = layer_states(whitebox, windows, layer, per_pass, progress, precision).half()  # as a reload sees them
    if path is not None:
        cache.save(states, path)
    return states.float()


def _load_head(path: Path, whitebox: WhiteBox) -> tuple[InverseHead, HeadReport] | None:
    """The head stored at ``path``; None when missing; a file that is unreadable or not of this model's
    shape is removed with a warning (sipit.cache.load) and None returned."""
    built: dict = {}

    def check(data) -> str | None:
        state = data["state"]
        head = InverseHead(state["mean"], state["scale"], unit_embeddings(whitebox), data["temperature"])
        head.load_state_dict(state)  # raises on missing keys or other shapes
        if head.mean.shape != (whitebox.d,):
            return f"a head for d={head.mean.numel()}, the model has d={whitebox.d}"
        if not all(torch.isfinite(t).all() for t in head.state_dict().values()):
            return "holds NaN or inf"
        built["head"], built["report"] = head, HeadReport(**json.loads(data["report"]))
        return None

    if cache.load(path, check) is None:
        return None
    built["head"].eval()
    return built["head"], built["report"]


def _save_head(path: Path, head: InverseHead, report: HeadReport) -> None:
    cache.save({"state": head.state_dict(), "temperature": head.temperature,
                "report": json.dumps(report.to_dict())}, path)


def corpus_examples(whitebox: WhiteBox, layer: int, sources: tuple[list[list[int]], ...], first: int,
                    config: HeadConfig = HeadConfig(), progress: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(states (N, d), tokens (N,), held-out mask (N,)) of the positions >= ``first`` of every window of
    ``sources`` (one list of equal-length windows per source, e.g. :func:`training_windows`), the states
    from :func:`corpus_states` (cached) at ``config``'s corpus precision; each source holds out its last
    ``config.heldout_fraction`` of windows (:func:`heldout_mask`). The one corpus of every learned attack:
    the inverse heads and the softmax classification head (attacks.head) train on it."""
    layer = whitebox.resolve_layer(layer)
    precision = corpus_precision(whitebox, config)
    xs, ys, helds = [], [], []
    for windows in (w for w in sources if w):
        length = len(windows[0])
        per_pass = max(config.windows_per_pass, 1024 // length)
        keep = (torch.arange(length) >= first).repeat(len(windows))
        xs.append(corpus_states(whitebox, windows, layer, per_pass, progress, precision)[keep])
        ys.append(torch.tensor(windows).flatten()[keep])
        helds.append(heldout_mask(len(windows), length, config.heldout_fraction)[keep])
    return torch.cat(xs), torch.cat(ys), torch.cat(helds)


def train_inverse_head(whitebox: WhiteBox, layer: int, sources: tuple[list[list[int]], ...], slot: int,
                       config: HeadConfig = HeadConfig(), progress: bool = False) -> tuple[InverseHead, HeadReport]:
    """Fit a head on the layer-``layer`` states of ``sources`` (one list of equal-length windows per
    source, e.g. :func:`training_windows`) at the positions >= ``slot`` of each window; every source
    holds out its last windows for the temperature and the recall report. No cache."""
    started = time.perf_counter()
    layer = whitebox.resolve_layer(layer)
    directions = unit_embeddings(whitebox)
    x, y, held = corpus_examples(whitebox, layer, sources, slot, config, progress)
    head = fit_head(x[~held], y[~held], directions, config, progress)
    x_held = add_noise(x[held], config.noise, torch.Generator().manual_seed(config.seed + 1))
    if not held.any():
        x_held, y_held = x[:1], y[:1]
    else:
        y_held = y[held]
    head.temperature, ranks = heldout_evaluation(head, x_held, y_held)
    ranks = ranks.float()
    report = HeadReport(layer=layer, slot=slot, n_train=int((~held).sum()), n_heldout=int(held.sum()),
                        top1=float((ranks < 1).float().mean()), top16=float((ranks < 16).float().mean()),
                        median_rank=float(ranks.median()), temperature=head.temperature,
                        seconds=time.perf_counter() - started, cached=False)
    return head, report


def inverse_head(whitebox: WhiteBox, tokenizer, layer: int, config: HeadConfig = HeadConfig(), *, slot: int = 2,
                 use_disk: bool = True, progress: bool = False) -> tuple[InverseHead, HeadReport]:
    """The inverse head of ``layer`` for position 1 (``slot=1``) or positions >= 2 (``slot=2``):
    from memory, else from disk, else trained (and stored)."""
    if slot not in SLOTS:
        raise ValueError(f"slot must be one of {SLOTS}, got {slot}")
    layer = whitebox.resolve_layer(layer)
    config = config.sized(whitebox.vocab_size)
    key = ("inverse-head", layer, slot, config)
    if key in whitebox.memo:
        return whitebox.memo[key]
    started = time.perf_counter()
    sources = training_windows(tokenizer, whitebox.vocab_size, config, slot)
    path = _head_path(whitebox, layer, slot, config, sources) if use_disk else None
    loaded = _load_head(path, whitebox) if path is not None else None
    if loaded is not None:
        head, report = loaded
        report.seconds, report.cached = time.perf_counter() - started, True
    else:
        n = sum(len(w) for source in sources for w in source)
        needs = check_room(f"the inverse head of layer {layer}, {'position 1' if slot == 1 else 'positions >= 2'} "
                           f"({n} corpus tokens, V={whitebox.vocab_size})",
                           memory=(3 * n * whitebox.d + whitebox.vocab_size * whitebox.d) * FLOAT32 + SCORED_FLOATS * 8,
                           disk=n * whitebox.d * 2 if path is not None else 0,
                           folder=path.parent if path is not None else None)
        head, report = train_inverse_head(whitebox, layer, sources, slot, config, progress)
        report.needs = needs
        if path is not None:
            _save_head(path, head, report)
    whitebox.memo[key] = (head, report)
    return head, report
