"""Plots of a benchmark run (matplotlib, Agg backend, PNG files).

- :func:`recovery_vs_ratio`: per attack, the fraction of positions decoded correctly against
  ||n_t|| / (Delta_t / 2) (binned on a log axis), over the positions whose margin was computed.
  Left of 1 the robustness theorem guarantees nearest-neighbour recovery; where recovery really
  breaks is what the plot shows.
- :func:`delta_distribution`: histogram of Delta_t with the median ||n_t|| marked (x 2, so both
  sit on the Delta axis: recovery is guaranteed where Delta > 2 ||n||).
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def recovery_vs_ratio(rows: list[dict], path: Path, title: str = "") -> Path:
    """``rows``: per-position dicts with attack, delta, noise_norm, correct (delta may be None)."""
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    usable = [r for r in rows if r.get("delta") not in (None, "") and float(r["delta"]) > 0]
    attacks = sorted({r["attack"] for r in usable})
    for attack in attacks:
        pts = sorted((float(r["noise_norm"]) / (float(r["delta"]) / 2), float(bool(r["correct"])))
                     for r in usable if r["attack"] == attack)
        ratios = [max(p[0], 1e-6) for p in pts]
        lo, hi = math.log10(min(ratios)), math.log10(max(ratios))
        n_bins = max(1, min(8, len(pts) // 3))
        edges = [lo + (hi - lo + 1e-9) * i / n_bins for i in range(n_bins + 1)]
        xs, ys = [], []
        for a, b in zip(edges, edges[1:]):
            inside = [c for r, c in zip(ratios, (p[1] for p in pts)) if a <= math.log10(r) <= b]
            if inside:
                xs.append(10 ** ((a + b) / 2))
                ys.append(sum(inside) / len(inside))
        ax.plot(xs, ys, marker="o", label=f"{attack} (n={len(pts)})")
    ax.axvline(1.0, color="grey", linestyle="--", linewidth=1, label="||n|| = Delta/2")
    ax.set_xscale("log")
    ax.set_ylim(-0.05, 1.05)
    ax.set_xlabel("||n_t|| / (Delta_t / 2)")
    ax.set_ylabel("fraction of positions recovered")
    return _finish(fig, ax, path, title or "recovery vs noise / half-margin", empty=not usable)


def delta_distribution(deltas: list[float], noise_norms: list[float], path: Path, title: str = "") -> Path:
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    deltas = [d for d in deltas if d is not None and math.isfinite(d)]
    if deltas:
        ax.hist(deltas, bins=max(5, min(40, len(deltas))), color="tab:blue", alpha=0.8, label=f"Delta_t (n={len(deltas)})")
    norms = sorted(n for n in noise_norms if n is not None and math.isfinite(n))
    if norms and norms[-1] > 0:
        med = norms[len(norms) // 2]
        ax.axvline(2 * med, color="tab:red", linestyle="--", label=f"2 x median ||n|| = {2 * med:.3g}")
    ax.set_xlabel("Delta_t = min_{v != s_t} ||mu_{p,v} - mu_{p,s_t}||")
    ax.set_ylabel("positions")
    return _finish(fig, ax, path, title or "margin distribution", empty=not deltas)


def _finish(fig, ax, path: Path, title: str, *, empty: bool) -> Path:
    """Title, legend, a note when there was nothing to plot; save as PNG and close."""
    ax.set_title("\n".join(textwrap.wrap(title, 70)), fontsize=9)  # run titles are long
    if empty:
        ax.text(0.5, 0.5, "no margins computed", ha="center", va="center", transform=ax.transAxes)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
