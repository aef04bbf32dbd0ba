"""Margins already computed, kept on disk: Delta_t of a (model, layer, prefix, token) never changes.

One sweep of the vocabulary per position makes Delta_t the slowest number a run reports (~50 s per
position at smollm2's last layer on 2 cores), and a sweep over defence settings, or a rerun, asks
for the same positions again. :func:`stored_margin` looks Delta_t up in
``sipit.cache.cache_dir() / "margins" / "delta-<model key>-l<layer>.json"`` (keyed by the token ids
s_1..s_t, the prefix and the true token) and computes it only when absent; the file is rewritten
atomically after each new entry, so an interrupted run keeps what it finished. An unreadable file is
removed with a warning and rebuilt. The model key (sipit.cache.model_key) keeps a quantised or tied
attacker model apart from the clean one; a model without one (random forward changes) is never stored.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from sipit.atomic import write_text_atomic
from sipit.cache import discard, entry_path, model_key
from sipit.whitebox import WhiteBox


def store_path(whitebox: WhiteBox, layer: int) -> Path | None:
    """The margin file of this model at ``layer`` (None: the model has no cache key)."""
    key = model_key(whitebox)
    return None if key is None else entry_path("margins", f"delta-{key}-l{whitebox.resolve_layer(layer)}.json")


def _read(path: Path) -> dict[str, float]:
    """The stored margins; a damaged file is removed with a warning (sipit.cache.discard) and read as empty."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as err:
        discard(path, f"{type(err).__name__}: {err}")
        return {}
    if not isinstance(data, dict) or not all(isinstance(v, (int, float)) for v in data.values()):
        discard(path, "not a JSON object of numbers")
        return {}
    return {k: float(v) for k, v in data.items()}


def stored_margin(whitebox: WhiteBox, layer: int, ids: list[int], compute: Callable[[], float]) -> float:
    """Delta of the last token of ``ids`` on the prefix ``ids[:-1]``: from the store, else ``compute()``
    (then stored)."""
    path = store_path(whitebox, layer)
    if path is None:
        return float(compute())
    key = ",".join(str(int(i)) for i in ids)
    known = _read(path)
    if key in known:
        return known[key]
    value = float(compute())
    try:
        merged = {**_read(path), key: value}  # entries another process added meanwhile stay
        write_text_atomic(path, json.dumps(merged))
    except OSError:
        pass  # a read-only cache only costs a recomputation next time
    return value
