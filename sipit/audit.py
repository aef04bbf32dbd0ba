"""Collision audit (docs/theory.md, "Claim"): how close do distinct prompts' last-token states get?

For a prompt set and a layer: the minimum pairwise L2 distance between last-token states
Phi^l(s)_T of distinct prompts, and, for the ``pairs`` closest pairs (a, b), the minimum over every
one-token extension v of ||Phi^l(a + v)_last - Phi^l(b + v)_last|| (full vocabulary, chunked
cached steps on each prompt's prefix cache). :func:`table` formats a row like the paper's Table 1.
CLI (benchmarks side, so sipit/ imports nothing from benchmarks):

    python -m benchmarks.experiments.margins_table --model smollm2-135m --audit-prompts 50 --audit-pairs 1 \
        --positions 0 --out runs/audit
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sipit.sweep import sweep
from sipit.whitebox import WhiteBox


@dataclass
class AuditRow:
    layer: int
    n_prompts: int
    min_distance: float
    closest_pair: tuple[int, int]
    extension_min: float | None  # min over v and over the audited pairs
    extension_token: int | None
    pairs_extended: int


def min_pairwise(states: torch.Tensor) -> tuple[float, int, int, torch.Tensor]:
    """Minimum off-diagonal L2 distance of the rows of ``states`` and the (N, N) distance matrix."""
    dist = torch.cdist(states.double(), states.double())
    dist.fill_diagonal_(float("inf"))
    k = int(dist.argmin())
    i, j = divmod(k, dist.shape[0])
    return float(dist[i, j]), min(i, j), max(i, j), dist


@torch.no_grad()
def extension_min(wb: WhiteBox, a: list[int], b: list[int], layer: int, chunk: int = 1024) -> tuple[float, int]:
    """min_v ||Phi^l(a + v)_last - Phi^l(b + v)_last|| over the full vocabulary, and its v."""
    pa, pb = wb.prefix_cache(a, layer), wb.prefix_cache(b, layer)
    d = torch.cat(sweep(wb, pa, lambda ids, batch: (batch.states - wb.step(pb, ids).states).norm(dim=-1), chunk=chunk))
    j = int(d.argmin())
    return float(d[j]), j


@torch.no_grad()
def audit(wb: WhiteBox, prompts: list[list[int]], layers: list[int], *, pairs: int = 1, chunk: int = 1024) -> list[AuditRow]:
    """Collision audit of distinct prompts at each layer."""
    unique = [list(p) for p in dict.fromkeys(tuple(p) for p in prompts)]
    if len(unique) < 2:
        raise ValueError("need at least two distinct prompts")
    rows = []
    for layer in layers:
        layer = wb.resolve_layer(layer)
        last = torch.stack([wb.states(p, layer)[-1] for p in unique])
        d, i, j, dist = min_pairwise(last)
        ext, ext_tok = None, None
        if pairs > 0:
            upper = torch.triu(dist, diagonal=1)
            upper[upper == 0] = float("inf")
            flat = torch.topk(upper.flatten(), min(pairs, len(unique) * (len(unique) - 1) // 2), largest=False).indices
            for k in flat.tolist():
                a, b = divmod(k, len(unique))
                e, v = extension_min(wb, unique[a], unique[b], layer, chunk)
                if ext is None or e < ext:
                    ext, ext_tok = e, v
        rows.append(AuditRow(layer, len(unique), d, (i, j), ext, ext_tok, pairs))
    return rows


def table(model: str, rows: list[AuditRow]) -> str:
    head = "| model | " + " | ".join(f"layer {r.layer} min" for r in rows) + " | " + \
        " | ".join(f"layer {r.layer} ext. min" for r in rows) + " |"
    cells = " | ".join(f"{r.min_distance:.4g}" for r in rows) + " | " + \
        " | ".join("-" if r.extension_min is None else f"{r.extension_min:.4g}" for r in rows)
    return "\n".join([head, "|---" * (1 + 2 * len(rows)) + "|", f"| {model} | {cells} |"]) + "\n"
