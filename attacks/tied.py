"""The attacker that knows a tying defence: SipIt recovers the group, the model's prior picks the member.

Tokens tied to one input-embedding row (defenses.tying) give identical states at every layer, so
exact SipIt accepts whichever member of the true token's group its candidate order reaches first:
the group is recovered, the member is the order's accident. The served model's own LM head is not
tied, so its next-token distribution still tells the members apart. This attack decodes with the
inner attack, then at every position t whose group G(s~_t) has more than one member picks

    s_t = argmax_{v in G(s~_t)} log P(v | s_1 .. s_{t-1})        (P: the served model, BOS-conditioned)

Members share their input row, so the choice at t changes neither the states nor the prior at any
later position: choosing after decoding is the same as choosing during it. Without a BOS token
position 0 has no prior and keeps the inner attack's member.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from attacks.result import Inversion
from sipit.prior import sequence_logprobs
from sipit.whitebox import WhiteBox


class MemberByPrior:
    """``inner`` (exact SipIt) for the group, the served model's prior for the member (module docstring)."""

    def __init__(self, inner, groups: torch.Tensor):
        self.inner = inner
        self.groups = torch.as_tensor(groups, dtype=torch.long)

    @property
    def name(self) -> str:
        return f"{getattr(self.inner, 'name', 'attack')}+prior-member"

    def members(self, token: int) -> torch.Tensor:
        """The tokens tied with ``token`` (itself included)."""
        return torch.nonzero(self.groups == self.groups[token]).flatten()

    def invert(self, observed: torch.Tensor, whitebox: WhiteBox, layer: int, tokenizer=None,
               length: int | None = None) -> Inversion:
        inversion = self.inner.invert(observed, whitebox, layer, tokenizer, length)
        started = time.perf_counter()
        logprobs = sequence_logprobs(whitebox.model, inversion.ids)
        ids = list(inversion.ids)
        for t, token in enumerate(ids):
            group = self.members(token)
            if len(group) > 1 and not torch.isnan(logprobs[t, 0]):
                ids[t] = int(group[int(logprobs[t, group].argmax())])
        positions = [replace(record, token=token) for record, token in zip(inversion.positions, ids)]
        return replace(inversion, ids=ids, positions=positions, seconds=inversion.seconds + time.perf_counter() - started,
                       text=tokenizer.decode(ids) if tokenizer is not None else inversion.text)
