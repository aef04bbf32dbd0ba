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
corpus too. (A ridge-regression linear head was tried first: on smollm2 at layer 30 it put the
true token in its top 16 for 50% of held-out natural-text positions, the MLP for 65%, and cut the
mean rank ~8x; notes/issue-12.md.)

The head only ORDERS candidates (attacks.policies.LearnedPolicy): exact SipIt verifies every
candidate against the observed state, so a bad head costs time, never correctness.

Noise-adapted heads (``HeadConfig.noise`` = sigma > 0): every training minibatch gets fresh
seeded Gaussian noise N(0, sigma^2 I) added to its states, and the temperature and the recall report
are measured on noisy held-out states, so the head ranks tokens for the exposure h~ = h + n that a
noisy defence publishes (the shortlist of the noise-robust decoders, attacks.robust).

A head is cached in memory by the WhiteBox (``WhiteBox.memo``) and on disk under
``sipit.models.cache_dir() / "heads"``, keyed by the model's weights (sipit.vocab_table
.weights_fingerprint), the layer, the configuration and the corpus token ids; an unreadable or
malformed file is rebuilt. The corpus states (the costly part: a forward pass over the corpus)
are cached as well (``cache_dir() / "head-corpus"``, fp16, keyed by weights, layer and corpus ids),
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
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from attacks.corpus import corpus_windows, random_windows
from sipit.models import cache_dir, save_to_cache
from sipit.vocab_table import weights_fingerprint
from sipit.whitebox import WhiteBox

TEMPERATURES = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5)
SLOTS = (1, 2)  # one head for position 1, one for positions >= 2


@dataclass(frozen=True)
class HeadConfig:
    """How an inverse head is trained."""

    n_text: int = 150_000  # tokens of pydoc text
    n_random: int = 32_768  # tokens of seeded random-token windows
    n_pairs: int = 16_384  # two-token windows for the position-1 head (text bigrams + random pairs)
    window: int = 64
    epochs: int = 3
    min_steps: int = 1000  # optimiser steps at least (small corpora take more passes)
    batch_size: int = 256
    negatives: int = 4096  # sampled tokens per minibatch (the whole vocabulary when smaller)
    lr: float = 1e-3
    heldout_fraction: float = 0.05  # last windows of each source, for tau and the recall report
    seed: int = 0
    windows_per_pass: int = 16  # windows per batched forward pass
    noise: float = 0.0  # Gaussian sigma (absolute, per coordinate) added to the training states
    corpus_precision: str = "auto"  # forward passes over the corpus: "fp32", "bf16" or "auto" (corpus_precision())


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


def unit_embeddings(whitebox: WhiteBox) -> torch.Tensor:
    """E_v / ||E_v|| for every token, ``(V, d)`` (the model's own embedding-module outputs)."""
    return torch.nn.functional.normalize(whitebox.token_embeddings().float().cpu(), dim=1)


def training_windows(tokenizer, vocab_size: int, config: HeadConfig, slot: int) -> tuple[list[list[int]], ...]:
    """The corpus of one head, as one list of equal-length windows per source (text, random tokens).

    ``slot`` 2 (positions >= 2): windows of ``config.window`` tokens. ``slot`` 1 (position 1, whose
    state mixes in position 0's very unlike one): two-token windows, half text bigrams at seeded
    offsets of the text, half random pairs.
    """
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
    generator = torch.Generator().manual_seed(config.seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        head = InverseHead(x.mean(0), x.std(0).clamp_min(1e-6), directions)
    optimiser = torch.optim.Adam(head.parameters(), lr=config.lr)
    vocab = directions.shape[0]
    n_neg = min(config.negatives, vocab)
    per_epoch = -(-x.shape[0] // config.batch_size)
    epochs = max(config.epochs, -(-config.min_steps // per_epoch))
    for _ in tqdm(range(epochs), desc="inverse-head training", disable=not progress, leave=False):
        order = torch.randperm(x.shape[0], generator=generator)
        for start in range(0, x.shape[0], config.batch_size):
            rows = order[start : start + config.batch_size]
            pool = torch.unique(torch.cat([y[rows], torch.randint(0, vocab, (n_neg,), generator=generator)]))
            logits = head.log_scale.exp() * head.direction(add_noise(x[rows], config.noise, generator)) @ directions[pool].T
            loss = nn.functional.cross_entropy(logits, torch.searchsorted(pool, y[rows]))
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
    head.eval()
    return head


def choose_temperature(cosines: torch.Tensor, ids: torch.Tensor) -> float:
    """The tau of TEMPERATURES with the least mean NLL of ``ids`` under log_softmax(cosines / tau)."""
    def nll(tau: float) -> float:
        return float(-torch.log_softmax(cosines / tau, 1).gather(1, ids[:, None]).mean())
    return min(TEMPERATURES, key=nll)


def _head_path(whitebox: WhiteBox, layer: int, slot: int, config: HeadConfig, windows) -> Path:
    fields = asdict(config)
    if not fields["noise"]:
        del fields["noise"]  # clean heads keep the key they had before noise-adapted heads existed
    fields["corpus_precision"] = corpus_precision(whitebox, config)
    if fields["corpus_precision"] == "fp32":
        del fields["corpus_precision"]  # and fp32 ones the key they had before bf16 corpora
    digest = hashlib.blake2b(repr((fields, windows)).encode(), digest_size=8).hexdigest()
    return cache_dir() / "heads" / f"inverse-{weights_fingerprint(whitebox)}-l{layer}-p{slot}-{digest}.pt"


def corpus_states(whitebox: WhiteBox, windows: list[list[int]], layer: int, per_pass: int,
                  progress: bool = False, precision: str = "fp32") -> torch.Tensor:
    """:func:`layer_states` of ``windows``, from the disk cache when it holds them (fp16, keyed by
    weights, layer, the window ids and the precision; a damaged or misshapen file is recomputed)."""
    digest = hashlib.blake2b(repr(windows).encode(), digest_size=8).hexdigest()
    tag = "" if precision == "fp32" else f"-{precision}"
    path = cache_dir() / "head-corpus" / f"states-{weights_fingerprint(whitebox)}-l{layer}-{digest}{tag}.pt"
    shape = (sum(len(w) for w in windows), whitebox.d)
    try:
        states = torch.load(path, map_location="cpu", weights_only=True)
        if tuple(states.shape) == shape and bool(torch.isfinite(states).all()):
            return states.float()
    except Exception:  # noqa: BLE001 - missing or damaged: recomputed below
        pass
    states = layer_states(whitebox, windows, layer, per_pass, progress, precision).half()  # as a reload sees them
    save_to_cache(states, path)
    return states.float()


def _load_head(path, whitebox: WhiteBox) -> tuple[InverseHead, HeadReport] | None:
    """The head stored at ``path``; None when missing, unreadable or not of this model's shape."""
    if not os.path.isfile(path):
        return None
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
        state = data["state"]
        head = InverseHead(state["mean"], state["scale"], unit_embeddings(whitebox), data["temperature"])
        head.load_state_dict(state)  # raises on missing keys or other shapes
        report = HeadReport(**json.loads(data["report"]))
    except Exception:  # noqa: BLE001 - a damaged file fails with many types; it is rebuilt
        return None
    if head.mean.shape != (whitebox.d,) or not all(torch.isfinite(t).all() for t in head.state_dict().values()):
        return None
    head.eval()
    return head, report


def _save_head(path, head: InverseHead, report: HeadReport) -> None:
    save_to_cache({"state": head.state_dict(), "temperature": head.temperature,
                   "report": json.dumps(report.to_dict())}, path)


def train_inverse_head(whitebox: WhiteBox, layer: int, sources: tuple[list[list[int]], ...], slot: int,
                       config: HeadConfig = HeadConfig(), progress: bool = False) -> tuple[InverseHead, HeadReport]:
    """Fit a head on the layer-``layer`` states of ``sources`` (one list of equal-length windows per
    source, e.g. :func:`training_windows`) at the positions >= ``slot`` of each window; every source
    holds out its last windows for the temperature and the recall report. No cache."""
    started = time.perf_counter()
    layer = whitebox.resolve_layer(layer)
    directions = unit_embeddings(whitebox)
    precision = corpus_precision(whitebox, config)
    xs, ys, helds = [], [], []
    for windows in (w for w in sources if w):
        length = len(windows[0])
        per_pass = max(config.windows_per_pass, 1024 // length)
        keep = (torch.arange(length) >= slot).repeat(len(windows))
        xs.append(corpus_states(whitebox, windows, layer, per_pass, progress, precision)[keep])
        ys.append(torch.tensor(windows).flatten()[keep])
        helds.append(heldout_mask(len(windows), length, config.heldout_fraction)[keep])
    x, y, held = torch.cat(xs), torch.cat(ys), torch.cat(helds)
    head = fit_head(x[~held], y[~held], directions, config, progress)
    x_held = add_noise(x[held], config.noise, torch.Generator().manual_seed(config.seed + 1))
    cosines = torch.cat([head.cosines(part) for part in x_held.split(1024)]) if held.any() else head.cosines(x[:1])
    y_held = y[held] if held.any() else y[:1]
    head.temperature = choose_temperature(cosines, y_held)
    ranks = true_ranks(cosines, y_held).float()
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
    key = ("inverse-head", layer, slot, config)
    if key in whitebox.memo:
        return whitebox.memo[key]
    started = time.perf_counter()
    sources = training_windows(tokenizer, whitebox.vocab_size, config, slot)
    path = _head_path(whitebox, layer, slot, config, sources)
    loaded = _load_head(path, whitebox) if use_disk else None
    if loaded is not None:
        head, report = loaded
        report.seconds, report.cached = time.perf_counter() - started, True
    else:
        head, report = train_inverse_head(whitebox, layer, sources, slot, config, progress)
        if use_disk:
            _save_head(path, head, report)
    whitebox.memo[key] = (head, report)
    return head, report
