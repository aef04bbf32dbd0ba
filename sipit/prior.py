"""The model's own next-token distribution log P(v | p_t), streamed along a growing prefix.

Used by candidate policies (to order candidates) and by MAP decoding (as the prior). It runs the
full model, head included, on the prefix the attacker has decoded so far, one incremental
position per accepted token (a full-depth KV cache, separate from the layer-l cache).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel


class NextTokenPrior:
    """log P(. | prefix) for a prefix that grows one token at a time."""

    def __init__(self, model: PreTrainedModel, start_token: int | None = None):
        """``start_token`` (default: the config's BOS id, if any) conditions the first guess:
        log P(s_1 | BOS). It is a context for the prior only, never part of the decoded prompt."""
        self.model = model
        self.cache = DynamicCache(config=model.config)
        self.length = 0
        self._logprobs: torch.Tensor | None = None
        if start_token is None:
            start_token = getattr(model.config, "bos_token_id", None)
        if isinstance(start_token, int) and 0 <= start_token < model.get_input_embeddings().weight.shape[0]:
            self.push(start_token)

    @property
    def logprobs(self) -> torch.Tensor | None:
        """``(V,)`` log-probabilities of the next token (``None``: empty prefix and no BOS)."""
        return self._logprobs

    @torch.no_grad()
    def push(self, token: int) -> torch.Tensor:
        """Append ``token`` to the prefix; return log P(. | new prefix)."""
        device = self.model.get_input_embeddings().weight.device
        out = self.model(
            input_ids=torch.tensor([[token]], device=device),
            position_ids=torch.tensor([[self.length]], device=device),
            cache=self.cache,
            use_cache=True,
        )
        self.length += 1
        logits = out.logits[0, -1].float()
        self._logprobs = torch.log_softmax(logits, dim=-1)
        return self._logprobs

    def fork(self) -> "NextTokenPrior":
        """An independent copy (for beam search: each hypothesis extends its own prefix)."""
        other = NextTokenPrior.__new__(NextTokenPrior)
        other.model = self.model
        other.cache = DynamicCache(config=self.model.config)
        for src, dst in zip(self.cache.layers, other.cache.layers):
            if src.is_initialized:
                dst.lazy_initialization(src.keys, src.values)
                dst.keys, dst.values = src.keys, src.values  # update() concatenates: no aliasing
        other.length = self.length
        other._logprobs = self._logprobs
        return other
