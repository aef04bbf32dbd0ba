"""Weight tying: groups of tokens forced to share one input-embedding row (real collisions).

Two ways to form the groups (exactly one of ``groups`` / ``rare``):

- ``groups=G``: k-means (scikit-learn, ``random_state=seed``, one init, ``max_iter``) of the
  input-embedding matrix ``(V, d)`` into G clusters; every token's row becomes its cluster's
  centroid.
- ``rare=m``: the m rarest tokens (frequency = counts of the model's tokenizer over the offline
  corpus ``pydoc_data.topics`` minus the held-out utility topics, see :mod:`defenses.utility`;
  ties broken by token id) are each tied to their nearest (L2) frequent token, taking that token's
  row; the other V - m tokens keep their rows (and are their own groups).

Only the *input* embedding changes. Models with a tied LM head (the GGUF SmolLM2, GPT-2) are
untied first: the head keeps a clone of the original matrix, so the output distribution over
tokens is still resolvable and the only change is which inputs the network can tell apart.

Tokens of one group produce identical states at every layer given the same prefix, so no attack
can do better than the group: :meth:`WeightTying.groups` gives the token -> group map for
group-level recovery metrics. Served model and attacker both hold the tied model
(``knows_defense=False`` gives the attacker the original weights instead).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from defenses.base import Defense, DefenseParamError, check_number, copy_loaded
from sipit.models import LoadedModel


def untie_head(model: nn.Module) -> bool:
    """Give the LM head its own copy of the weights if it shares the input embedding. True if it did."""
    head = model.get_output_embeddings()
    emb = model.get_input_embeddings()
    if head is None or head.weight.data_ptr() != emb.weight.data_ptr():
        return False
    head.weight = nn.Parameter(head.weight.detach().clone(), requires_grad=False)
    model.config.tie_word_embeddings = False
    if hasattr(model.config, "get_text_config"):
        model.config.get_text_config().tie_word_embeddings = False
    return True


def kmeans_groups(embeddings: torch.Tensor, n_groups: int, seed: int, max_iter: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(labels (V,), centroids (G, d)) of a seeded k-means of the rows."""
    from sklearn.cluster import KMeans

    data = embeddings.detach().float().cpu().numpy()
    km = KMeans(n_clusters=n_groups, n_init=1, max_iter=max_iter, random_state=seed).fit(data)
    return torch.as_tensor(km.labels_, dtype=torch.long), torch.as_tensor(km.cluster_centers_, dtype=torch.float32)


def rare_groups(embeddings: torch.Tensor, counts: torch.Tensor, m: int, chunk: int = 2048) -> torch.Tensor:
    """token -> representative token: the m rarest map to their nearest frequent token, others to themselves."""
    vocab = embeddings.shape[0]
    order = sorted(range(vocab), key=lambda v: (int(counts[v]), v))
    rare = torch.tensor(order[:m], dtype=torch.long)
    frequent = torch.tensor(sorted(order[m:]), dtype=torch.long)
    rep = torch.arange(vocab)
    emb = embeddings.detach().float()
    targets = emb[frequent]
    for part in rare.split(chunk):
        nearest = torch.cdist(emb[part], targets).argmin(dim=1)
        rep[part] = frequent[nearest]
    return rep


class WeightTying(Defense):
    name = "tying"
    param_names = ("groups", "rare", "seed", "max_iter")

    def __init__(self, groups: int | None = None, rare: int | None = None, seed: int = 0, max_iter: int = 30):
        if (groups is None) == (rare is None):
            raise DefenseParamError("tying needs exactly one of groups=G (k-means) or rare=m (rarest tokens)")
        self.n_groups = None if groups is None else check_number("groups", groups, integer=True, minimum=1)
        self.rare = None if rare is None else check_number("rare", rare, integer=True, minimum=1)
        self.seed = check_number("seed", seed, integer=True, minimum=0)
        self.max_iter = check_number("max_iter", max_iter, integer=True, minimum=1)
        self._token_group: torch.Tensor | None = None

    def check_model(self, loaded: LoadedModel) -> None:
        """groups must not exceed the vocabulary, rare must stay below it."""
        vocab = loaded.model.get_input_embeddings().weight.shape[0]
        if self.n_groups is not None and self.n_groups > vocab:
            raise DefenseParamError(f"groups={self.n_groups} exceeds the vocabulary size {vocab} of {loaded.name}")
        if self.rare is not None and self.rare >= vocab:
            raise DefenseParamError(f"rare={self.rare} must be below the vocabulary size {vocab} of {loaded.name}")

    def fit(self, loaded: LoadedModel) -> torch.Tensor:
        """Compute the tied input-embedding matrix for ``loaded``; sets the token -> group map."""
        self.check_model(loaded)
        emb = loaded.model.get_input_embeddings().weight.detach()
        vocab = emb.shape[0]
        if self.n_groups is not None:
            labels, centroids = kmeans_groups(emb, self.n_groups, self.seed, self.max_iter)
            self._token_group = labels
            return centroids[labels].to(emb.dtype)
        from defenses.utility import token_counts

        rep = rare_groups(emb, token_counts(loaded.tokenizer, vocab), self.rare)
        self._token_group = rep  # group id = the representative (frequent) token
        return emb[rep].clone()

    def groups(self) -> torch.Tensor:
        """token -> group id, ``(V,)`` long (after :meth:`serve`)."""
        if self._token_group is None:
            raise RuntimeError("tying groups are fitted on a model: call serve(loaded, layer) first")
        return self._token_group

    def group_members(self) -> dict[int, list[int]]:
        """group id -> its tokens (groups of one included)."""
        out: dict[int, list[int]] = {}
        for token, group in enumerate(self.groups().tolist()):
            out.setdefault(group, []).append(token)
        return out

    def serve(self, loaded: LoadedModel, layer: int) -> LoadedModel:
        def build() -> tuple[LoadedModel, torch.Tensor]:
            tied = self.fit(loaded)
            served = copy_loaded(loaded, self.spec())
            untie_head(served.model)
            served.model.get_input_embeddings().weight.data.copy_(tied)
            return served, self._token_group

        served, self._token_group = self.served_copy(loaded, build)
        return served

    def attacker_model(self, loaded: LoadedModel, layer: int, knows_defense: bool = True) -> LoadedModel:
        return self.serve(loaded, layer) if knows_defense else loaded

    def knowledge(self, exposure, knows_defense: bool = True):
        """The token -> group map when the exposure is exact, i.e. the attacker holds the tied model (the naive
        attacker holds the original weights, so its states are not the exposure's and it gets no groups)."""
        return replace(exposure, groups=self.groups()) if exposure.exact else exposure

    def params(self) -> dict:
        return {"groups": self.n_groups, "rare": self.rare, "seed": self.seed, "max_iter": self.max_iter}

    def describe(self) -> str:
        how = (f"k-means of the input embeddings into {self.n_groups} groups, rows = centroids"
               if self.n_groups is not None else
               f"the {self.rare} rarest tokens (pydoc counts) take their nearest frequent token's row")
        return (f"tying: served model's input embedding tied ({how}); LM head untied and kept fp32; "
                "exposure = exact states of the tied model; attacker holds the tied model and can "
                "recover the group at best (groups() gives token -> group).")
