"""The white-box forward map Phi^l: hidden states at one layer, prefix caches, candidate steps.

What "layer l" means (the one definition used everywhere in sipit-bench):

- ``layer 0`` is the input of the first block: the output of the model's own embedding module
  plus whatever the model adds before its first block (GPT-2's position embeddings, Gemma's
  sqrt(d) scale), i.e. HF's ``hidden_states[0]``.
- ``layer l`` for ``1 <= l <= L`` is the residual stream at the output of block ``l``.
  For ``l < L`` this is HF's ``hidden_states[l]``. For ``l = L`` it is the output of the last
  block *before* the final norm (HF's ``hidden_states[L]`` applies the final norm; ours does not:
  the final norm belongs to the head, so every layer is a raw residual-stream state).
- Negative ``l`` counts from the end as in Python: ``-1`` is ``L``, ``-L-1`` is ``0``.

No block above ``l`` is ever computed: a hook on block ``l`` captures its output and stops the
forward pass there (``blocks_run`` counts the blocks that completed, for tests).

Verification at the served shape (:meth:`WhiteBox.at_served_shape`): a candidate's state is
normally one incremental step on the cached prefix, which equals the full forward's state up to
float rounding (sipit.tolerance measures the gap). Quantised kernels make that gap large: they
round their inputs coarsely (bitsandbytes int8 to 256 levels per row, its 4-bit CPU matmul to
bf16), so the ~1e-7 differences between attention over t+1 keys (a cached step) and over n keys
(the served forward of the whole prompt) flip roundings and grow through the blocks (smollm2,
layers 15 and 30: up to 1.3% relative with nf4, 14% with int8). The kernels themselves are row-invariant, and a causal model's state at position t does not depend on the tokens
after t (masked keys add exact zeros), so a forward of the served shape ``(B, n)``, with the
candidate at t and any filler after it, reproduces the served state at t bit for bit.

The model is reached only through generic handles: its embedding module
(``get_input_embeddings``), its ``ModuleList`` of blocks, and its base model's ``forward`` with
``inputs_embeds``/``position_ids``/``cache``. GPT-2 and Llama blocks, tied or untied heads and
scaled embeddings all go through the same path.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from transformers import DynamicCache, PreTrainedModel


class SipitInputError(ValueError):
    """Bad user input: wrong layer, wrong shape, non-finite states, empty prompt..."""


class _StopForward(Exception):
    """Raised from a hook to stop the forward pass once layer l is reached."""


@dataclass
class PrefixCache:
    """Keys/values of a fixed prefix for the blocks up to ``layer`` (batch 1).

    ``kv[i]`` holds ``(keys, values)`` of block ``i`` with shape ``(1, heads, length, head_dim)``;
    ``tokens`` the prefix's token ids (a key for per-prefix memoisation, e.g. attacks.surrogate).
    """

    layer: int
    length: int
    kv: list[tuple[torch.Tensor, torch.Tensor]]
    tokens: tuple[int, ...] = ()


class _ForwardChange:
    """A forward hook that the model lists in ``_sipit_forward_changes`` while it is on (sipit.cache.model_key
    reads the list); ``remove()`` takes both away."""

    def __init__(self, model: nn.Module, handle, key: str | None):
        self.model, self.handle, self.key = model, handle, key
        model.__dict__.setdefault("_sipit_forward_changes", []).append(key)

    def remove(self) -> None:
        self.handle.remove()
        changes = self.model.__dict__.get("_sipit_forward_changes", [])
        if self.key in changes:
            changes.remove(self.key)


def _find_blocks(base: nn.Module, n_layers: int) -> nn.ModuleList:
    """The model's block list: the ``ModuleList`` with ``num_hidden_layers`` entries."""
    lists = [m for m in base.modules() if isinstance(m, nn.ModuleList) and len(m) == n_layers]
    if not lists:
        raise TypeError(f"{type(base).__name__}: found no ModuleList of {n_layers} blocks")
    return lists[0]


EXPOSURES = ("residual", "kv")


class WhiteBox:
    """Phi^l for one causal LM: states, prefix caches, batched candidate steps, relaxed steps.

    ``exposure`` names what "the states at layer l" are (module docstring, "Exposures"): the residual
    stream (``d`` = the hidden size) or the keys and values block l writes to the model's own cache
    (``d`` = 2 x KV heads x head dim). Every state this class returns is float32 whatever the model's
    dtype (a bf16 or fp16 value is a float32 value exactly), so distances are taken in float32."""

    def __init__(self, model: PreTrainedModel, proposals_from: "WhiteBox | None" = None, exposure: str = "residual"):
        if exposure not in EXPOSURES:
            raise SipitInputError(f"exposure must be one of {', '.join(EXPOSURES)}, got {exposure!r}")
        self.model = model
        self.exposure = exposure
        # The model whose inverse heads (attacks.proposals) rank this one's candidates: the
        # full-precision original of a served copy (quantised, tied), so a copy trains no heads
        # of its own. Heads only order candidates; acceptance is verified on this model, so
        # exactness never depends on them. (Position 0 still reads this model's own table: the
        # original's rows can lie far from a 4-bit copy's, measured 17,919 candidates on smollm2.)
        self.proposals_from = proposals_from
        self.config = model.config
        self.base = model.get_decoder() if hasattr(model, "get_decoder") else model.base_model
        text_config = self.config.get_text_config() if hasattr(self.config, "get_text_config") else self.config
        self.n_layers: int = int(text_config.num_hidden_layers)
        self.blocks = _find_blocks(self.base, self.n_layers)
        self.embedding: nn.Module = model.get_input_embeddings()
        self.vocab_size: int = int(self.embedding.weight.shape[0])
        self.hidden_size: int = int(text_config.hidden_size)
        context = getattr(text_config, "max_position_embeddings", None)  # GPT-2 maps it to n_positions
        self.context_length: int | None = int(context) if context else None
        self._token_embeddings: torch.Tensor | None = None
        self.blocks_run = 0  # blocks completed by this WhiteBox's forward passes (for tests)
        # Results derived from this model alone (position-0 tables, inverse heads, weight hash),
        # kept as long as the WhiteBox: one owner for every per-model cache, no module globals.
        self.memo: dict = {}
        # None: candidates are verified by one incremental step on the cached prefix; n: by a
        # forward of the served shape (B, n) (module docstring, at_served_shape).
        self.served_length: int | None = None
        self.d: int = self.hidden_size if exposure == "residual" else self._kv_width()

    def at_served_shape(self, length: int | None) -> "WhiteBox":
        """This WhiteBox (same model, same ``memo``) verifying candidates at the served shape.

        :meth:`step` then computes mu_{p,v} as position ``|p|`` of a forward of ``B`` sequences
        of ``length`` tokens, ``p + v + (v, ..., v)``: bit for bit the state the provider's forward
        of a ``length``-token prompt produced, whatever the kernels' dependence on the sequence
        shape, at about ``length`` times the cost of an incremental step. ``None``: the same model
        with incremental steps (what vocabulary sweeps and tables use; ``self`` if it already is).
        """
        if length is None:
            if self.served_length is None:
                return self
        elif isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise SipitInputError(f"the served length must be an int >= 1, got {length!r}")
        else:
            self.check_length(length, "the served prompt")
        view = copy.copy(self)
        view.served_length = length
        return view

    @property
    def device(self) -> torch.device:
        return self.embedding.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the model computes in (its served precision)."""
        return self.embedding.weight.dtype

    def _kv_width(self) -> int:
        """2 x KV heads x head dim, read off one token's cache at block 1 (no config arithmetic)."""
        with torch.no_grad():
            cache = DynamicCache(config=self.config)
            self._forward_to(self.embed(torch.zeros(1, 1, dtype=torch.long, device=self.device)), 1, 0, cache)
        keys, values = cache.layers[0].keys, cache.layers[0].values
        return int(keys.shape[1] * keys.shape[3] + values.shape[1] * values.shape[3])

    # ----------------------------------------------------------------------------- validation
    def resolve_layer(self, layer: int) -> int:
        """Map a possibly negative layer index to ``0..L`` (Python indexing over L+1 layers)."""
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise SipitInputError(f"layer must be an int, got {layer!r}")
        n = self.n_layers + 1
        if not -n <= layer < n:
            raise SipitInputError(
                f"layer {layer} out of range: this model has layers 0..{self.n_layers} "
                f"(0 = embeddings, {self.n_layers} = last block), or -{n}..-1 from the end"
            )
        if self.exposure == "kv" and layer % n == 0:
            raise SipitInputError("layer 0 has no keys or values: the KV exposure is block l's cache, l >= 1")
        return layer % n

    def transform_layer(self, layer: int, fn: Callable[[torch.Tensor], torch.Tensor], key: str | None = None):
        """Make every forward of the model replace its layer-``layer`` states h (B, n, d) by ``fn(h)``
        before the blocks above consume them (layer 0: the input of block 1). Returns the hook handle
        (``.remove()`` undoes it).

        ``key`` names the change for the disk cache (sipit.cache.model_key): the same key must mean the
        same function. ``None`` (the default) declares it random or unnamed: while the hook is on, nothing
        derived from the model is cached on disk."""
        layer = self.resolve_layer(layer)
        if layer == 0:

            def on_input(module, args, kwargs):
                if args:
                    return (fn(args[0]),) + tuple(args[1:]), kwargs
                return args, dict(kwargs, hidden_states=fn(kwargs["hidden_states"]))

            handle = self.blocks[0].register_forward_pre_hook(on_input, with_kwargs=True)
        else:

            def on_output(module, args, output):
                if isinstance(output, tuple):
                    return (fn(output[0]),) + tuple(output[1:])
                return fn(output)

            handle = self.blocks[layer - 1].register_forward_hook(on_output)
        return _ForwardChange(self.model, handle, None if key is None else f"layer {layer}: {key}")

    def check_ids(self, ids: torch.Tensor | list[int]) -> torch.Tensor:
        """Token ids as a 1-D long tensor on the model's device; rejects empty/out-of-vocab."""
        ids = torch.as_tensor(ids, dtype=torch.long, device=self.device)
        if ids.dim() != 1:
            raise SipitInputError(f"expected a 1-D sequence of token ids, got shape {tuple(ids.shape)}")
        if ids.numel() == 0:
            raise SipitInputError("empty prompt: there is nothing to invert")
        if int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size:
            raise SipitInputError(f"token ids must lie in 0..{self.vocab_size - 1}")
        self.check_length(ids.numel())
        return ids

    def check_length(self, n_positions: int, what: str = "the sequence") -> None:
        """Refuse ``n_positions`` beyond the model's context length (:attr:`context_length`)."""
        if self.context_length is not None and n_positions > self.context_length:
            raise SipitInputError(
                f"{what}: {n_positions} positions, more than the model's context length of "
                f"{self.context_length} tokens"
            )

    def check_states(self, states: torch.Tensor, length: int | None = None) -> torch.Tensor:
        """Observed states as a finite ``(T, d)`` float tensor on the model's device.

        ``length``: the prompt length the caller expects (every attack's ``invert`` takes it, since a
        pooled exposure needs it); per-position states must then hold exactly ``length`` rows.

        Refused: non-tensors, integer/bool dtypes (cast states have lost what the attack compares),
        wrong shapes, more positions than the context, NaN/inf, and states so large that their
        squared norms overflow float32 (every distance would be inf: no token could be chosen).
        """
        if not isinstance(states, torch.Tensor):
            raise SipitInputError(f"states must be a torch.Tensor, got {type(states).__name__}")
        if not states.is_floating_point():
            raise SipitInputError(
                f"states must be a real floating-point tensor, got dtype {states.dtype} "
                "(hidden states are floats; integer states have lost the values the attack compares)"
            )
        if states.dim() != 2 or states.shape[1] != self.d:
            hint = (
                " (a pooled exposure holds no per-position states: per-position attacks cannot run "
                "on it; use attacks.pooled.PooledBeamAttack)"
                if states.dim() == 3 else ""
            )
            raise SipitInputError(
                f"states must have shape (T, {self.d}) for this model, got {tuple(states.shape)}{hint}"
            )
        if states.shape[0] == 0:
            raise SipitInputError("states hold no positions: there is nothing to invert")
        if length is not None and states.shape[0] != length:
            raise SipitInputError(f"states hold {states.shape[0]} positions, the prompt length given is {length}")
        self.check_length(states.shape[0], "the states")
        if not torch.isfinite(states).all():
            bad = (~torch.isfinite(states)).any(dim=1).nonzero().flatten().tolist()
            raise SipitInputError(f"states contain NaN or inf at positions {bad[:10]}")
        squared = states.detach().float().pow(2).sum(dim=-1)
        if not torch.isfinite(squared).all():
            bad = (~torch.isfinite(squared)).nonzero().flatten().tolist()
            raise SipitInputError(
                f"states at positions {bad[:10]} are too large (max |x| = {float(states.abs().max()):.3g}): "
                "their squared norms overflow float32, so no distance to them is finite; real hidden "
                "states are many orders of magnitude smaller (were they rescaled?)"
            )
        return states.to(device=self.device, dtype=torch.float32)

    # ------------------------------------------------------------------------------ forward
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The model's own embedding module applied to ids (any leading shape)."""
        return self.embedding(ids)

    def token_embeddings(self) -> torch.Tensor:
        """Embedding-module outputs of every token, ``(V, d)``: the points a relaxed input moves among."""
        if self._token_embeddings is None:
            with torch.no_grad():
                self._token_embeddings = self.embed(torch.arange(self.vocab_size, device=self.device))
        return self._token_embeddings

    def _forward_to(
        self, embeds: torch.Tensor, layer: int, start: int, cache: DynamicCache | None
    ) -> torch.Tensor:
        """Run ``embeds`` (B, n, d) at positions ``start..start+n-1`` up to ``layer``; return (B, n, d)."""
        captured: dict[str, torch.Tensor] = {}

        def count(module, args, output):
            self.blocks_run += 1

        # registered first, so they run before the hook that stops the pass
        counters = [block.register_forward_hook(count) for block in self.blocks]
        if layer == 0:

            def grab_input(module, args, kwargs):
                captured["h"] = args[0] if args else kwargs["hidden_states"]
                raise _StopForward

            handle = self.blocks[0].register_forward_pre_hook(grab_input, with_kwargs=True)
        else:

            def grab_output(module, args, output):
                captured["h"] = output[0] if isinstance(output, tuple) else output
                raise _StopForward

            handle = self.blocks[layer - 1].register_forward_hook(grab_output)
        batch, n = embeds.shape[:2]
        positions = torch.arange(start, start + n, device=self.device).unsqueeze(0).expand(batch, n)
        try:
            self.base(
                inputs_embeds=embeds,
                position_ids=positions,
                cache=cache,
                use_cache=cache is not None,
            )
        except _StopForward:
            pass
        finally:
            handle.remove()
            for counter in counters:
                counter.remove()
        if "h" not in captured:
            raise RuntimeError("the forward pass ended before reaching the requested layer")
        return captured["h"]

    def _exposed(self, embeds: torch.Tensor, layer: int, start: int, cache: DynamicCache | None) -> torch.Tensor:
        """What is exposed of ``embeds`` (B, n, d_model) at positions ``start..start+n-1``, float32 ``(B, n, d)``:
        the layer-``layer`` residual states, or block ``layer``'s keys and values for those positions as the
        cache holds them (per KV head, after the rotary embedding), heads concatenated, keys then values."""
        if self.exposure == "residual":
            return self._forward_to(embeds, layer, start, cache).float()
        if cache is None:
            cache = DynamicCache(config=self.config)
        self._forward_to(embeds, layer, start, cache)
        n = embeds.shape[1]
        rows = [kv[:, :, -n:, :].transpose(1, 2).reshape(embeds.shape[0], n, -1)
                for kv in (cache.layers[layer - 1].keys, cache.layers[layer - 1].values)]
        return torch.cat(rows, dim=-1).float()

    @torch.no_grad()
    def states(self, ids: torch.Tensor | list[int], layer: int) -> torch.Tensor:
        """Phi^l(ids): layer-``layer`` states of every position, ``(T, d)`` float32; no block above runs."""
        ids = self.check_ids(ids)
        layer = self.resolve_layer(layer)
        return self._exposed(self.embed(ids)[None], layer, 0, None)[0]

    @torch.no_grad()
    def states_batch(self, ids: torch.Tensor, layer: int) -> torch.Tensor:
        """Phi^l of ``B`` equal-length sequences at once, ``(B, T)`` ids -> ``(B, T, d)`` states."""
        ids = torch.as_tensor(ids, dtype=torch.long, device=self.device)
        if ids.dim() != 2 or ids.numel() == 0:
            raise SipitInputError(f"expected a (B, T) batch of token ids, got shape {tuple(ids.shape)}")
        for row in ids:
            self.check_ids(row)
        return self._exposed(self.embed(ids), self.resolve_layer(layer), 0, None)

    @torch.no_grad()
    def prefix_cache(self, prefix: torch.Tensor | list[int], layer: int) -> PrefixCache:
        """Keys/values of ``prefix`` for blocks ``1..layer`` (computed once per decoding step)."""
        layer = self.resolve_layer(layer)
        prefix = torch.as_tensor(prefix, dtype=torch.long, device=self.device)
        tokens = tuple(prefix.tolist())
        if prefix.numel() == 0 or layer == 0:
            return PrefixCache(layer=layer, length=int(prefix.numel()), kv=[], tokens=tokens)
        cache = DynamicCache(config=self.config)
        self._forward_to(self.embed(prefix)[None], layer, 0, cache)
        kv = [(cache.layers[i].keys, cache.layers[i].values) for i in range(layer)]
        return PrefixCache(layer=layer, length=int(prefix.numel()), kv=kv, tokens=tokens)

    def _expanded_cache(self, prefix: PrefixCache, batch: int) -> DynamicCache | None:
        """A throwaway cache whose keys/values are views of the prefix's, expanded to ``batch``."""
        if prefix.layer == 0:
            return None
        cache = DynamicCache(config=self.config)
        if prefix.length == 0:
            return cache
        for i, (keys, values) in enumerate(prefix.kv):
            layer_cache = cache.layers[i]
            layer_cache.lazy_initialization(keys, values)
            layer_cache.keys = keys.expand(batch, *keys.shape[1:])
            layer_cache.values = values.expand(batch, *values.shape[1:])
        return cache

    def step_embeds(self, prefix: PrefixCache, embeds: torch.Tensor) -> torch.Tensor:
        """Layer-l state at position ``prefix.length`` of prefix + e for each row e of ``embeds``.

        ``embeds`` is ``(B, d)`` in embedding-module output space; this is the relaxed forward
        used by gradient policies (differentiable in ``embeds``; wrap in ``no_grad`` otherwise).
        """
        return self._step(prefix, embeds)[0]

    def _step(self, prefix: PrefixCache, embeds: torch.Tensor) -> tuple[torch.Tensor, DynamicCache | None]:
        cache = self._expanded_cache(prefix, embeds.shape[0])
        states = self._exposed(embeds[:, None, :], prefix.layer, prefix.length, cache)[:, 0, :]
        return states, cache

    @torch.no_grad()
    def step(self, prefix: PrefixCache, candidates: torch.Tensor) -> CandidateBatch:
        """mu_{p,v} for a batch of candidate tokens v in one incremental pass on the cached prefix.

        Returns the ``(B, d)`` states and, for whichever candidate is accepted, the extended
        prefix cache without another forward pass (:meth:`CandidateBatch.extended`).
        """
        candidates = torch.as_tensor(candidates, dtype=torch.long, device=self.device)
        states, cache = self._step(prefix, self.embed(candidates))
        if self.served_length is not None:
            states = self._served_shape_states(prefix, candidates)
        return CandidateBatch(candidates=candidates, states=states, prefix=prefix, cache=cache)

    def _served_shape_states(self, prefix: PrefixCache, candidates: torch.Tensor, chunk_tokens: int = 8192) -> torch.Tensor:
        """mu_{p,v} read at position ``|p|`` of ``(B, served_length)`` forwards (at_served_shape).

        The incremental step above still provides the extended prefix cache (the policies' gradient
        and prior use it); only the states that decide acceptance come from here."""
        n, t = self.served_length, prefix.length
        if t >= n:
            raise SipitInputError(f"position {t} is past the served length {n}")
        rows = torch.tensor(prefix.tokens, dtype=torch.long, device=self.device).expand(len(candidates), t)
        ids = torch.cat([rows, candidates[:, None].expand(-1, n - t)], dim=1)
        per_chunk = max(1, chunk_tokens // n)
        return torch.cat([self._exposed(self.embed(part), prefix.layer, 0, None)[:, t]
                          for part in ids.split(per_chunk)])

    @torch.no_grad()
    def extend(self, prefix: PrefixCache, token: int) -> PrefixCache:
        """The cache of prefix + token (one incremental position)."""
        return self.step(prefix, torch.tensor([token])).extended(0)


@dataclass
class CandidateBatch:
    """States of prefix + v for a batch of candidates v, with the caches they produced."""

    candidates: torch.Tensor
    states: torch.Tensor
    prefix: PrefixCache
    cache: DynamicCache | None

    def extended(self, index: int) -> PrefixCache:
        """The prefix cache extended by ``candidates[index]``, sliced from this batch's cache."""
        tokens = self.prefix.tokens + (int(self.candidates[index]),)
        if self.cache is None:
            return PrefixCache(layer=self.prefix.layer, length=self.prefix.length + 1, kv=[], tokens=tokens)
        kv = [
            (self.cache.layers[i].keys[index : index + 1], self.cache.layers[i].values[index : index + 1])
            for i in range(self.prefix.layer)
        ]
        return PrefixCache(layer=self.prefix.layer, length=self.prefix.length + 1, kv=kv, tokens=tokens)
