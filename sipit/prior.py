"""The model's own next-token distribution log P(v | p_t), streamed along a growing prefix.

Used by candidate policies (to order candidates) and by MAP decoding (as the prior). It runs the
full model, head included, on the prefix the attacker has decoded so far (a full-depth KV cache,
separate from the layer-l cache). Lazily: :meth:`NextTokenPrior.push` only records the token,
and reading :attr:`NextTokenPrior.logprobs` runs every pending token in one incremental pass. An
attack that needs the prior at few positions (a confident learned proposal) pays for few passes;
on 2 CPU cores a pass over k pending tokens costs about as much as a pass over one.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel


def resolve_start_token(model: PreTrainedModel, start_token: int | None = None) -> int | None:
    """The token that conditions the first guess: ``start_token``, else the config's BOS id; None
    when neither is a token of the model's vocabulary."""
    if start_token is None:
        start_token = getattr(model.config, "bos_token_id", None)
    vocab = model.get_input_embeddings().weight.shape[0]
    return start_token if isinstance(start_token, int) and 0 <= start_token < vocab else None


@torch.no_grad()
def sequence_logprobs(model: PreTrainedModel, ids: list[int], start_token: int | None = None) -> torch.Tensor:
    """``(T, V)``: row t = log P(. | start, s_1..s_{t-1}) for a known sequence, in one forward pass
    (what :class:`NextTokenPrior` streams); row 0 is NaN when there is no start token."""
    return paths_logprobs(model, torch.tensor([list(ids)]), start_token)[0]


@torch.no_grad()
def paths_logprobs(model: PreTrainedModel, paths: torch.Tensor, start_token: int | None = None) -> torch.Tensor:
    """``(B, T, V)``: :func:`sequence_logprobs` of each row of the ``(B, T)`` id batch ``paths``, in one pass."""
    start = resolve_start_token(model, start_token)
    device = model.get_input_embeddings().weight.device
    paths = torch.as_tensor(paths, dtype=torch.long, device=device)
    context = paths[:, :-1] if start is None else torch.cat([torch.full_like(paths[:, :1], start), paths[:, :-1]], 1)
    out = torch.log_softmax(model(input_ids=context).logits.float(), dim=-1) if context.shape[1] else None
    if start is None:
        vocab = out.shape[-1] if out is not None else model.get_input_embeddings().weight.shape[0]
        nan = torch.full((paths.shape[0], 1, vocab), float("nan"), device=device)
        out = nan if out is None else torch.cat([nan, out], 1)
    return out


class NextTokenPrior:
    """log P(. | prefix) for a prefix that grows one token at a time."""

    def __init__(self, model: PreTrainedModel, start_token: int | None = None):
        """``start_token`` (default: the config's BOS id, if any) conditions the first guess:
        log P(s_1 | BOS). It is a context for the prior only, never part of the decoded prompt."""
        self.model = model
        self.cache = DynamicCache(config=model.config)
        self.length = 0
        self._pending: list[int] = []
        self._logprobs: torch.Tensor | None = None
        start_token = resolve_start_token(model, start_token)
        if start_token is not None:
            self.push(start_token)

    @property
    def logprobs(self) -> torch.Tensor | None:
        """``(V,)`` log-probabilities of the next token (``None``: empty prefix and no BOS)."""
        self._flush()
        return self._logprobs

    def push(self, token: int) -> None:
        """Append ``token`` to the prefix (computed when :attr:`logprobs` is next read)."""
        self._pending.append(int(token))

    @torch.no_grad()
    def _flush(self) -> None:
        """Run the pending tokens in one incremental pass; keep the last position's log-probs."""
        if not self._pending:
            return
        device = self.model.get_input_embeddings().weight.device
        n = len(self._pending)
        out = self.model(
            input_ids=torch.tensor([self._pending], device=device),
            position_ids=torch.arange(self.length, self.length + n, device=device)[None],
            cache=self.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        self.length += n
        self._pending = []
        self._logprobs = torch.log_softmax(out.logits[0, -1].float(), dim=-1)

    def fork(self) -> "NextTokenPrior":
        """An independent copy (for beam search: each hypothesis extends its own prefix)."""
        self._flush()
        other = NextTokenPrior.__new__(NextTokenPrior)
        other.model = self.model
        other.cache = DynamicCache(config=self.model.config)
        for src, dst in zip(self.cache.layers, other.cache.layers):
            if src.is_initialized:
                dst.lazy_initialization(src.keys, src.values)
                dst.keys, dst.values = src.keys, src.values  # update() concatenates: no aliasing
        other.length = self.length
        other._pending = []
        other._logprobs = self._logprobs
        return other
