"""Utility by use: what a defence costs a vector store and a probe built on the layer-l states.

Two uses of exposed hidden states (issue 14, item 1), beside the served model and inference continued
from the exposed states (:mod:`defenses.utility`). Each compares what the defence exposes with the
clean model's layer-l states of the same text, and is computed by :func:`measure_uses`.

Text. Held-out ``pydoc_data`` topics (every 5th topic, as :mod:`defenses.utility`: disjoint from the
tying frequency corpus) that start at least ``TEXT_START`` = 100,000 characters into the head corpus
(:func:`sipit.offline_text.corpus_text`, the topics in the same sorted order): the softmax heads train on
that corpus's first ``head_tokens`` tokens (4096 in a run, 1024 in a search, ~4 characters a
token), so the two do not meet. The learned-proposal policy's inverse heads read the whole pydoc
text (``attacks.proposals``: 150,000 tokens) and no pydoc text is disjoint from them. The evaluation
prompts are text written for this project. The text is tokenised once and cut into blocks of
``BLOCK`` = 64 tokens; a seeded permutation (``torch.Generator().manual_seed(seed)``) gives the
documents (the first ``doc_tokens`` tokens of the first ``n_documents`` blocks) and the probe's
sequences (the next ``n_probe_blocks`` blocks). Every block or document is its own sequence from
position 0, like a prompt.

Use "embedding_store" (:func:`embedding_store`): the store holds the sentence vectors of the clean
layer-l states ``H`` (T, d) of each document, two kinds:

- mean-pooled: ``v = (1/T) sum_t H_t``;
- last-token: ``v = H_T``.

Each document is queried with the same kind of vector computed from what the defence exposes for
it (``E = expose(served states)``). Recall@k: the fraction of documents whose own clean vector is
among the k store vectors most cosine-similar to its defended query, ties counted against the query
(``hit_i  <=>  #{j != i : cos(q_i, s_j) >= cos(q_i, s_i)} < k``). With no defence the query is the
store vector itself: recall 1.0 (for distinct documents). ``cosine``: mean ``cos(q_i, s_i)``.

A pooled exposure (:mod:`defenses.pooling`, rows ``R_p`` (P, D'), row p covering ``w_p``
positions) gives its vectors as follows (:func:`pooled_vectors`):

- mean-pooled query: ``sum_p w_p R_p / sum_p w_p``. For mean pooling over all positions or over
  windows this is exactly the clean mean-pooled vector of the exposed states (so, without noise,
  recall 1.0); for max pooling it is the length-weighted mean of the window maxima, a different
  vector, which the recall prices;
- last-token query: the row that covers the last position (for over='all' the whole-sequence pool);
- over='dims' (rows are positions, D' = d/g): the vectors above, each group value repeated g times
  back to d dimensions (for mean the orthogonal projection onto group-constant vectors, the
  least-squares reconstruction), compared with the full clean store.

The use's ``loss`` is ``1 - max(mean recall@1, last recall@1)``: the store's owner picks the
sentence vector that survives the defence.

Use "probing" (:func:`probing`): linear probes (standardised features, multinomial logistic
regression, sklearn, deterministic lbfgs) trained on clean layer-l states of 3/4 of the probe
blocks and evaluated on the other 1/4, on the clean states and on the defended exposure of the same
positions. Two labelled tasks, labels derived from the text alone:

- ``token_class``: the current token's coarse class from its own text, ``whitespace`` / ``number``
  (a digit) / ``capitalised`` / ``lowercase`` (first non-space character an upper / lower case
  letter) / ``symbol``: the lexical, part-of-speech-like property that probes most often read;
- ``code_vs_prose``: whether the token ends on a line indented by >= 3 spaces (pydoc's literal
  blocks: code examples and grammar) or in prose: a property of the context, not of the token (the
  same word occurs in both), like the syntactic / semantic / topical properties probes are trained
  for (the "is this inside a quote / which clause / which topic" kind).

Probes on a layer are trained once on states that someone collected, then applied to new states;
here the new states are the defended ones, so the drop measures what the defence costs such a
probe. Metrics: per task the accuracy on clean and on defended states, the drop, and the
majority-class rate (the training majority class's rate on the test positions: chance); the use's
``accuracy_*`` are the means over the two tasks and its ``loss`` is the mean drop. Pooled exposures
with no per-position rows (over='all' or 'window') cannot feed a per-position probe: not applicable
(``None``); over='dims' rows are upsampled as for the store.
"""

from __future__ import annotations

import math
import time

import torch

from defenses.base import Chain, Defense
from defenses.pooling import Pooling
from sipit.memo import memoised
from sipit.models import LoadedModel
from sipit.offline_text import HELD_OUT_EVERY, pydoc_topics
from sipit.whitebox import WhiteBox

USES = ("embedding_store", "probing")
TEXT_START = 100_000
BLOCK = 64
KS = (1, 5)
TOKEN_CLASSES = ("whitespace", "number", "capitalised", "lowercase", "symbol")
TASKS = ("token_class", "code_vs_prose")
CODE_INDENT = "   "


# --------------------------------------------------------------------------- text and labels
def uses_text() -> str:
    """The held-out topics that start >= TEXT_START characters into the head corpus, joined by blank lines."""
    parts, offset = [], 0
    for i, (_, text) in enumerate(pydoc_topics()):
        if i % HELD_OUT_EVERY == 0 and offset >= TEXT_START:
            parts.append(text)
        offset += len(text) + 2  # corpus_text joins the topics by a blank line
    return "\n\n".join(parts)


def token_class(piece: str) -> int:
    """Index in TOKEN_CLASSES of a token's text (module docstring)."""
    s = piece.strip()
    if not s:
        return 0
    if any(ch.isdigit() for ch in s):
        return 1
    if s[0].isalpha():
        return 2 if s[0].isupper() else 3
    return 4


def code_lines(text: str) -> torch.Tensor:
    """Per character of ``text``: 1 if its line starts with CODE_INDENT (a literal block), else 0."""
    flags = torch.zeros(len(text), dtype=torch.long)
    pos = 0
    for line in text.split("\n"):
        if line.startswith(CODE_INDENT):
            flags[pos : pos + len(line) + 1] = 1
        pos += len(line) + 1
    return flags


def _ends(tokenizer, text: str, ids: list[int]) -> list[int]:
    """Character offset just past each token (offset mapping, else the decoded pieces' lengths)."""
    try:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        if enc["input_ids"] == ids:
            return [end for _, end in enc["offset_mapping"]]
    except (NotImplementedError, ValueError, KeyError, TypeError):
        pass
    ends, pos = [], 0
    for token in ids:
        pos += len(tokenizer.decode([token]))
        ends.append(pos)
    return ends


def labelled_tokens(tokenizer) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The uses text's token ids and, per task, one label per token."""
    text = uses_text()
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    code = code_lines(text)
    ends = _ends(tokenizer, text, ids)
    labels = {
        "token_class": torch.tensor([token_class(tokenizer.decode([t])) for t in ids]),
        "code_vs_prose": torch.tensor([int(code[min(max(e - 1, 0), len(text) - 1)]) for e in ends]),
    }
    return torch.tensor(ids, dtype=torch.long), labels


def split_blocks(n_tokens: int, n_documents: int, n_probe_blocks: int, seed: int) -> tuple[list[int], list[int]]:
    """Seeded choice of the document blocks and the probe blocks (disjoint), as block indices."""
    n_blocks = n_tokens // BLOCK
    if n_documents + n_probe_blocks > n_blocks:
        raise ValueError(f"the uses text holds {n_blocks} blocks of {BLOCK} tokens; asked for "
                         f"{n_documents} documents + {n_probe_blocks} probe blocks")
    order = torch.randperm(n_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    return order[:n_documents], order[n_documents : n_documents + n_probe_blocks]


# --------------------------------------------------------------------------- maths
def pooled_vectors(pooling: Pooling | None, exposure: torch.Tensor, length: int, d: int) -> dict[str, torch.Tensor]:
    """Mean-pooled and last-token sentence vectors (d,) from one sequence's exposure.

    Per-position exposure ``E`` (T, d): ``mean = (1/T) sum_t E_t``, ``last = E_T``. Pooled exposure
    (1, P, D') from ``pooling``, row p covering ``w_p`` positions: ``mean = sum_p w_p R_p / sum_p w_p``,
    ``last = R_P``; over='dims' repeats each of the D' = d/g values g times (module docstring).
    """
    if pooling is None:
        rows, weights = exposure.float(), torch.ones(exposure.shape[0])
    else:
        rows = exposure.float()[0]
        k = pooling.window_length(length)
        weights = torch.tensor([min(k, length - start) for start in range(0, length, k)], dtype=torch.float32)
    vectors = {"mean": (weights[:, None] * rows).sum(0) / weights.sum(), "last": rows[-1]}
    if rows.shape[-1] != d:  # over='dims'
        vectors = {kind: v.repeat_interleave(d // v.shape[-1]) for kind, v in vectors.items()}
    return vectors


def recall_at_k(queries: torch.Tensor, store: torch.Tensor, ks=KS) -> dict[int, float]:
    """Recall@k of query i against store row i by cosine similarity, ties counted against the query:
    ``hit_i <=> #{j != i : cos(q_i, s_j) >= cos(q_i, s_i)} < k``."""
    q = torch.nn.functional.normalize(queries.double(), dim=-1)
    s = torch.nn.functional.normalize(store.double(), dim=-1)
    sims = q @ s.T
    own = sims.diagonal()
    rivals = (sims >= own[:, None]).sum(1) - 1  # the own document always counts itself
    return {k: float((rivals < k).double().mean()) for k in ks}


def row_cosine(queries: torch.Tensor, store: torch.Tensor) -> float:
    """Mean ``cos(q_i, s_i)``."""
    return float(torch.nn.functional.cosine_similarity(queries.double(), store.double(), dim=-1).mean())


def upsample_dims(pooling: Pooling | None, exposure: torch.Tensor, d: int) -> torch.Tensor | None:
    """Per-position rows (T, d) of an exposure for a per-position probe: the states themselves, over='dims'
    rows with each group value repeated g times, ``None`` for pooled rows that are not positions."""
    if pooling is None:
        return exposure.float()
    if pooling.over != "dims":
        return None
    rows = exposure.float()[0]
    return rows.repeat_interleave(d // rows.shape[-1], dim=-1)


def pooling_of(defense: Defense) -> Pooling | None:
    """The pooling that shapes ``defense``'s exposure (a chain's last member), or None if per-position."""
    if isinstance(defense, Pooling):
        return defense
    if isinstance(defense, Chain) and isinstance(defense.members[-1], Pooling):
        return defense.members[-1]
    return None


# --------------------------------------------------------------------------- the uses
def _use(name: str, loss, metrics: dict, setup: dict, seconds: float) -> dict:
    return {"name": name, "applicable": loss is not None, "loss": loss, "metrics": metrics, "setup": setup,
            "seconds": seconds}


def _states(whitebox: WhiteBox, ids: torch.Tensor, layer: int) -> torch.Tensor:
    return whitebox.states(ids, layer).detach().float()


def _served_states(clean: LoadedModel, served: LoadedModel, layer: int, sequences, clean_states) -> list[torch.Tensor]:
    """The served model's layer-l states of each sequence: the clean ones (memoised) when it is the clean model."""
    if served.model is clean.model:
        return clean_states
    wb = WhiteBox(served.model)
    return [_states(wb, seq, layer) for seq in sequences]


@torch.no_grad()
def embedding_store(clean: LoadedModel, served: LoadedModel, defense: Defense, layer: int, *, n_documents: int = 48,
                    doc_tokens: int = 32, seed: int = 0) -> dict:
    """The use "embedding_store" (module docstring): recall@k of defended sentence vectors against the clean store."""
    started = time.perf_counter()
    if not 2 <= doc_tokens <= BLOCK:
        raise ValueError(f"doc_tokens must lie in 2..{BLOCK}, got {doc_tokens}")
    ids, _ = memoised(clean, "uses-text", (), lambda: labelled_tokens(clean.tokenizer))
    doc_blocks, _ = split_blocks(ids.numel(), n_documents, 0, seed)
    docs = [ids[b * BLOCK : b * BLOCK + doc_tokens] for b in doc_blocks]
    clean_wb = WhiteBox(clean.model)
    d = clean_wb.d

    def clean_store():
        states = [_states(clean_wb, doc, layer) for doc in docs]
        vecs = [pooled_vectors(None, h, doc_tokens, d) for h in states]
        return {"states": states, **{kind: torch.stack([v[kind] for v in vecs]) for kind in ("mean", "last")}}

    store = memoised(clean, "uses-store", (layer, n_documents, doc_tokens, seed), clean_store, size=4)
    pooling = pooling_of(defense)
    served_states = _served_states(clean, served, layer, docs, store["states"])
    generator = torch.Generator().manual_seed(seed)
    vecs = [pooled_vectors(pooling, defense.expose(h, generator), doc_tokens, d) for h in served_states]
    metrics = {}
    for kind in ("mean", "last"):
        queries = torch.stack([v[kind] for v in vecs])
        for k, value in recall_at_k(queries, store[kind]).items():
            metrics[f"{kind}_recall_at_{k}"] = value
        metrics[f"{kind}_cosine"] = row_cosine(queries, store[kind])
    loss = 1.0 - max(metrics["mean_recall_at_1"], metrics["last_recall_at_1"])
    setup = {"layer": layer, "n_documents": n_documents, "doc_tokens": doc_tokens, "seed": seed,
             "exposure": "per-position" if pooling is None else f"pooled ({pooling.mode} over {pooling.over})"}
    return _use("embedding_store", loss, metrics, setup, time.perf_counter() - started)


def _fit_probes(clean: LoadedModel, layer: int, blocks: list[int], ids: torch.Tensor, labels: dict) -> dict:
    """Per task: the probe trained on the clean states of the training blocks, and the test blocks' labels."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    wb = WhiteBox(clean.model)
    n_train = (3 * len(blocks)) // 4
    train, test = blocks[:n_train], blocks[n_train:]
    x_train = torch.cat([_states(wb, ids[b * BLOCK : (b + 1) * BLOCK], layer) for b in train]).numpy()
    test_states = [_states(wb, ids[b * BLOCK : (b + 1) * BLOCK], layer) for b in test]
    x_test = torch.cat(test_states).numpy()
    fitted = {}
    for task in TASKS:
        y_train = torch.cat([labels[task][b * BLOCK : (b + 1) * BLOCK] for b in train]).numpy()
        y_test = torch.cat([labels[task][b * BLOCK : (b + 1) * BLOCK] for b in test]).numpy()
        probe = make_pipeline(StandardScaler(), LogisticRegression(max_iter=1000, C=1.0))
        probe.fit(x_train, y_train)
        majority = torch.bincount(torch.as_tensor(y_train)).argmax().item()
        fitted[task] = {"probe": probe, "y_test": y_test, "accuracy_clean": float(probe.score(x_test, y_test)),
                        "majority_rate": float((y_test == majority).mean()), "n_train": int(len(y_train)),
                        "n_test": int(len(y_test))}
    return {"tasks": fitted, "test_blocks": test, "test_states": test_states}


@torch.no_grad()
def probing(clean: LoadedModel, served: LoadedModel, defense: Defense, layer: int, *, n_documents: int = 48,
            n_probe_blocks: int = 64, seed: int = 0) -> dict:
    """The use "probing" (module docstring): clean-trained linear probes evaluated on defended states."""
    started = time.perf_counter()
    ids, labels = memoised(clean, "uses-text", (), lambda: labelled_tokens(clean.tokenizer))
    _, blocks = split_blocks(ids.numel(), n_documents, n_probe_blocks, seed)
    if len(blocks) < 4:
        raise ValueError(f"probing needs at least 4 probe blocks, got {len(blocks)}")
    fitted = memoised(clean, "uses-probes", (layer, n_documents, n_probe_blocks, seed),
                      lambda: _fit_probes(clean, layer, blocks, ids, labels), size=4)
    setup = {"layer": layer, "tasks": list(TASKS), "token_classes": list(TOKEN_CLASSES), "block_tokens": BLOCK,
             "n_train": fitted["tasks"][TASKS[0]]["n_train"], "n_test": fitted["tasks"][TASKS[0]]["n_test"],
             "seed": seed}
    pooling = pooling_of(defense)
    d = WhiteBox(clean.model).d
    blocks = [ids[b * BLOCK : (b + 1) * BLOCK] for b in fitted["test_blocks"]]
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for h in _served_states(clean, served, layer, blocks, fitted["test_states"]):
        rows.append(upsample_dims(pooling, defense.expose(h, generator), d))
        if rows[-1] is None:
            metrics = {f"{t}_{k}": v for t in TASKS for k, v in (("accuracy_clean", fitted["tasks"][t]["accuracy_clean"]),
                                                                 ("majority_rate", fitted["tasks"][t]["majority_rate"]))}
            return _use("probing", None, metrics, setup, time.perf_counter() - started)
    x_defended = torch.cat(rows).numpy()
    metrics = {}
    for task in TASKS:
        f = fitted["tasks"][task]
        defended = float(f["probe"].score(x_defended, f["y_test"]))
        metrics.update({f"{task}_accuracy_clean": f["accuracy_clean"], f"{task}_accuracy_defended": defended,
                        f"{task}_accuracy_drop": f["accuracy_clean"] - defended, f"{task}_majority_rate": f["majority_rate"]})
    for key in ("accuracy_clean", "accuracy_defended", "accuracy_drop"):
        metrics[key] = sum(metrics[f"{t}_{key}"] for t in TASKS) / len(TASKS)
    return _use("probing", metrics["accuracy_drop"], metrics, setup, time.perf_counter() - started)


def measure_uses(clean: LoadedModel, served: LoadedModel, defense: Defense, layer: int, uses=USES, *,
                 seed: int = 0, n_documents: int = 48, doc_tokens: int = 32, n_probe_blocks: int = 64) -> dict:
    """``{name: use object}`` for each of ``uses`` (a subset of USES); each object carries ``name``,
    ``applicable``, ``loss`` (None: not applicable), flat scalar ``metrics``, ``setup`` and ``seconds``."""
    unknown = sorted(set(uses) - set(USES))
    if unknown:
        raise ValueError(f"unknown use(s) {unknown}: choose from {', '.join(USES)}")
    out = {}
    if "embedding_store" in uses:
        out["embedding_store"] = embedding_store(clean, served, defense, layer, n_documents=n_documents,
                                                 doc_tokens=doc_tokens, seed=seed)
    if "probing" in uses:
        out["probing"] = probing(clean, served, defense, layer, n_documents=n_documents,
                                 n_probe_blocks=n_probe_blocks, seed=seed)
    for use in out.values():
        use["metrics"] = {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in use["metrics"].items()}
    return out
