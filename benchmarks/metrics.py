"""Recovery metrics of a benchmark run: exact match, token accuracy with standard errors, cost.

Standard errors: exact match is a proportion over prompts, se = sqrt(p (1 - p) / n_prompts).
Token accuracy is the mean over all positions, but positions of one prompt are not independent
(one wrong commit poisons the rest of a prompt), so its se is the prompt-clustered one: the
standard deviation of per-prompt accuracies (weighted by length) over sqrt(n_prompts).

Upper bounds: the one-sided 95% Clopper-Pearson bound of a rate k / n,
U = Beta^-1(0.95; k + 1, n - k) (U = 1 when k = n), so that zero recovered out of n claims at most
1 - 0.05^(1/n) (about 1% needs n = 300). For token accuracy it treats tokens as independent, which
they are not within a prompt: read it next to the clustered se.

Order-free leakage: ``bag_f1`` is the mean over prompts of the F1 between the multisets of
recovered and true tokens (overlap = sum_v min(#v recovered, #v true)), so a prompt recovered in
the wrong order, or with a shifted span, still counts what leaked.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass


@dataclass
class AttackSummary:
    attack: str
    exact_match: float
    exact_match_se: float
    token_accuracy: float
    token_accuracy_se: float
    n_prompts: int
    n_tokens: int
    seconds_per_prompt: float
    candidates_per_position: float
    explored_fraction: float
    exact_match_upper95: float = float("nan")
    token_accuracy_upper95: float = float("nan")
    bag_f1: float = float("nan")

    def to_dict(self) -> dict:
        return asdict(self)


def proportion_se(p: float, n: int) -> float:
    return math.sqrt(max(p * (1.0 - p), 0.0) / n) if n > 0 else float("nan")


def clopper_pearson_upper(k: int, n: int, level: float = 0.95) -> float:
    """One-sided ``level`` Clopper-Pearson upper bound of a proportion with k successes in n trials."""
    from scipy.stats import beta

    if n <= 0:
        return float("nan")
    return 1.0 if k >= n else float(beta.ppf(level, k + 1, n - k))


def bag_f1(recovered: list[int], truth: list[int]) -> float:
    """F1 of the multisets of recovered and true tokens (module docstring)."""
    from collections import Counter

    if not recovered or not truth:
        return float(recovered == truth)
    overlap = sum((Counter(recovered) & Counter(truth)).values())
    if overlap == 0:
        return 0.0
    precision, recall = overlap / len(recovered), overlap / len(truth)
    return 2 * precision * recall / (precision + recall)


def clustered_accuracy(correct_per_prompt: list[list[bool]]) -> tuple[float, float]:
    """Mean accuracy over all positions and its prompt-clustered standard error."""
    n_tokens = sum(len(c) for c in correct_per_prompt)
    if n_tokens == 0:
        return float("nan"), float("nan")
    mean = sum(sum(c) for c in correct_per_prompt) / n_tokens
    k = len(correct_per_prompt)
    if k < 2:
        return mean, float("nan")
    # Ratio-estimator variance with cluster totals (sizes differ only for prompt files).
    sizes = [len(c) for c in correct_per_prompt]
    mean_size = n_tokens / k
    resid = [(sum(c) - mean * m) / mean_size for c, m in zip(correct_per_prompt, sizes)]
    return mean, math.sqrt(sum(r * r for r in resid) / (k * (k - 1)))


def summarise(attack: str, truths: list[list[int]], inversions: list) -> AttackSummary:
    """Per-attack summary over the prompts inverted so far (``inversions[i]`` for ``truths[i]``)."""
    pairs = list(zip(truths, inversions))
    n = len(pairs)
    exact = sum(inv.ids == truth for truth, inv in pairs) / n if n else float("nan")
    correct = [[a == b for a, b in zip(inv.ids, truth)] for truth, inv in pairs]
    acc, acc_se = clustered_accuracy(correct)
    n_tokens = sum(len(t) for t, _ in pairs)
    tried = sum(inv.candidates_tried for _, inv in pairs)
    vocab = max((inv.vocab_size for _, inv in pairs), default=0)
    return AttackSummary(
        attack=attack,
        exact_match=exact,
        exact_match_se=proportion_se(exact, n) if n else float("nan"),
        token_accuracy=acc,
        token_accuracy_se=acc_se,
        n_prompts=n,
        n_tokens=n_tokens,
        seconds_per_prompt=statistics.fmean(inv.seconds for _, inv in pairs) if n else float("nan"),
        candidates_per_position=tried / n_tokens if n_tokens else float("nan"),
        explored_fraction=tried / (n_tokens * vocab) if n_tokens and vocab else float("nan"),
        exact_match_upper95=clopper_pearson_upper(sum(inv.ids == truth for truth, inv in pairs), n),
        token_accuracy_upper95=clopper_pearson_upper(sum(sum(c) for c in correct), n_tokens),
        bag_f1=statistics.fmean(bag_f1(inv.ids, truth) for truth, inv in pairs) if n else float("nan"),
    )


def median(values) -> float:
    values = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    return statistics.median(values) if values else float("nan")
