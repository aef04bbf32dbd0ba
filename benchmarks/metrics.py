"""Recovery metrics of a benchmark run: exact match, token accuracy with standard errors, cost.

Standard errors: exact match is a proportion over prompts, se = sqrt(p (1 - p) / n_prompts).
Token accuracy is the mean over all positions, but positions of one prompt are not independent
(one wrong commit poisons the rest of a prompt), so its se is the prompt-clustered one: the
standard deviation of per-prompt accuracies (weighted by length) over sqrt(n_prompts).

Upper bounds: the one-sided 95% Clopper-Pearson bound of a rate k / n,
U = Beta^-1(0.95; k + 1, n - k) (U = 1 when k = n), so that zero recovered out of n claims at most
1 - 0.05^(1/n) (about 1% needs n = 300); the lower one is L = Beta^-1(0.05; k, n - k + 1) (L = 0 when
k = 0). For token accuracy it treats tokens as independent, which
they are not within a prompt: read it next to the clustered se.

Chance: an attacker that reads nothing from the states still hits a frequent token now and then. Its
chance level is measured on the same run by scoring each prompt's recovered tokens against every *other*
prompt's true tokens, position by position (:func:`chance_hits`): c = k_c / n_c over all ordered pairs
i != j. Leakage above chance is p - c; its one-sided 95% bounds (:func:`excess_bounds`) combine a 97.5%
Clopper-Pearson bound of each (U_p - L_c and L_p - U_c: both hold together with probability >= 95%, by
the union bound), the n_c comparisons treated as independent like the tokens above.

Order-free leakage: ``bag_f1`` is the mean over prompts of the F1 between the multisets of
recovered and true tokens (overlap = sum_v min(#v recovered, #v true)), so a prompt recovered in
the wrong order, or with a shifted span, still counts what leaked. Every attack here returns as many tokens as the prompt has, and then
F1 = overlap / n_tokens, a proportion: its upper bound is the Clopper-Pearson one of the summed
overlap over all true tokens, its se the per-prompt standard error.

Private spans (benchmarks.prompts): a span is *eligible* when it lies whole in the prompt as
attacked (the truncated prompt, decoded) and *leaked* when it occurs verbatim in the recovered text,
anywhere (so an order-free attack that returns a name intact counts). ``span_recall`` = leaked /
eligible over all prompts, with its Clopper-Pearson bound; its se treats spans as independent.

:func:`rates` gives each rate as the object results.json carries (``value``, ``n``, ``se``,
``upper95``); :func:`defence_leakage` is a defence's leakage: per rate, the maximum over every
attacker that ran against it.
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
    bag_f1_se: float = float("nan")
    bag_f1_upper95: float = float("nan")
    span_recall: float = float("nan")
    span_recall_se: float = float("nan")
    span_recall_upper95: float = float("nan")
    n_spans: int = 0
    chance_hits: int = 0
    chance_comparisons: int = 0
    token_accuracy_chance: float = float("nan")
    token_accuracy_excess_upper95: float = float("nan")

    def to_dict(self) -> dict:
        return {**asdict(self), "rates": rates(self)}


#: the leakage rates reported per attack and per defence, with the count each is a rate over
RATES = {"exact_match": "n_prompts", "token_accuracy": "n_tokens", "bag_f1": "n_tokens", "span_recall": "n_spans"}


def rates(summary: AttackSummary) -> dict[str, dict]:
    """Each rate of :data:`RATES` as ``{"value", "n", "se", "upper95"}`` (NaN value: nothing to rate); token
    accuracy adds its ``chance`` level, the counts it rests on and ``excess_upper95`` (module docstring)."""
    out = {name: {"value": getattr(summary, name), "n": getattr(summary, n_field),
                  "se": getattr(summary, f"{name}_se"), "upper95": getattr(summary, f"{name}_upper95")}
           for name, n_field in RATES.items()}
    out["token_accuracy"].update(chance=summary.token_accuracy_chance, chance_hits=summary.chance_hits,
                                 chance_comparisons=summary.chance_comparisons,
                                 excess_upper95=summary.token_accuracy_excess_upper95)
    return out


def defence_leakage(attacks: dict[str, dict]) -> dict[str, dict]:
    """A defence's leakage: per rate, the attack with the largest value (``attack``) and the largest
    upper bound over all attacks (``upper95``, and ``excess_upper95`` above chance where the rate has one),
    so a defence is judged by its strongest attacker."""
    out = {}
    for name in RATES:
        rated = [(a, s["rates"][name]) for a, s in attacks.items() if "rates" in s and _finite(s["rates"][name]["value"])]
        if not rated:
            continue
        attack, best = max(rated, key=lambda item: item[1]["value"])
        out[name] = {**best, "attack": attack, "upper95": max(r["upper95"] for _, r in rated)}
        if "excess_upper95" in best:
            out[name]["excess_upper95"] = max(r["excess_upper95"] for _, r in rated)
    return out


def _finite(value) -> bool:
    return value is not None and math.isfinite(float(value))


def eligible_spans(spans, truth_text: str) -> list[str]:
    """The private spans that lie whole in the prompt as attacked (module docstring)."""
    return [span for span in spans if span in truth_text]


def span_leaks(spans, truth_text: str, recovered_text: str) -> tuple[list[str], list[str]]:
    """The eligible and the leaked private spans of one prompt (module docstring)."""
    eligible = eligible_spans(spans, truth_text)
    return eligible, [span for span in eligible if span in recovered_text]


def proportion_se(p: float, n: int) -> float:
    return math.sqrt(max(p * (1.0 - p), 0.0) / n) if n > 0 else float("nan")


def clopper_pearson_upper(k: int, n: int, level: float = 0.95) -> float:
    """One-sided ``level`` Clopper-Pearson upper bound of a proportion with k successes in n trials."""
    from scipy.stats import beta

    if n <= 0:
        return float("nan")
    return 1.0 if k >= n else float(beta.ppf(level, k + 1, n - k))


def clopper_pearson_lower(k: int, n: int, level: float = 0.95) -> float:
    """One-sided ``level`` Clopper-Pearson lower bound of a proportion with k successes in n trials."""
    from scipy.stats import beta

    if n <= 0:
        return float("nan")
    return 0.0 if k <= 0 else float(beta.ppf(1.0 - level, k, n - k + 1))


def chance_hits(truths: list[list[int]], recovered: list[list[int]]) -> tuple[int, int]:
    """``(k_c, n_c)``: the hits of each prompt's recovered tokens on every other prompt's true tokens, and the
    comparisons made, k_c = sum_{i != j} sum_t [r_i[t] = x_j[t]], n_c = sum_{i != j} min(|r_i|, |x_j|).

    Counted per position in O(prompts x length): k_c = sum_t (sum_v R_t(v) X_t(v) - #{i: r_i[t] = x_i[t]}),
    with R_t(v), X_t(v) the recovered and true tokens v at position t (the main job re-summarises after
    every prompt, so the O(prompts^2) pair loop would cost it O(prompts^3))."""
    from collections import Counter

    hits = comparisons = 0
    for t in range(max((len(ids) for ids in recovered), default=0)):
        rec = Counter(ids[t] for ids in recovered if len(ids) > t)
        true = Counter(x[t] for x in truths if len(x) > t)
        both = [(ids, x) for ids, x in zip(recovered, truths) if len(ids) > t and len(x) > t]
        hits += sum(n * true[v] for v, n in rec.items()) - sum(ids[t] == x[t] for ids, x in both)
        comparisons += sum(rec.values()) * sum(true.values()) - len(both)
    return hits, comparisons


def excess_bounds(k: int, n: int, k_chance: int, n_chance: int, level: float = 0.95) -> tuple[float, float]:
    """One-sided ``level`` bounds of the recovery above chance p - c, from k of n true hits and k_chance of
    n_chance chance hits (:func:`chance_hits`): (L_p - U_c, U_p - L_c), each bound of p and c taken at
    1 - (1 - level) / 2, clipped to [0, 1]. Without chance comparisons (one prompt) c is only known to
    lie in [0, 1]."""
    if n <= 0:
        return float("nan"), float("nan")
    each = 1.0 - (1.0 - level) / 2
    if n_chance > 0:
        chance_low = clopper_pearson_lower(k_chance, n_chance, each)
        chance_high = clopper_pearson_upper(k_chance, n_chance, each)
    else:
        chance_low, chance_high = 0.0, 1.0
    lower = clopper_pearson_lower(k, n, each) - chance_high
    upper = clopper_pearson_upper(k, n, each) - chance_low
    return min(max(lower, 0.0), 1.0), min(max(upper, 0.0), 1.0)


def bag_overlap(recovered: list[int], truth: list[int]) -> int:
    """sum_v min(#v recovered, #v true): the tokens that leaked, whatever their order."""
    from collections import Counter

    return sum((Counter(recovered) & Counter(truth)).values())


def bag_f1(recovered: list[int], truth: list[int]) -> float:
    """F1 of the multisets of recovered and true tokens (module docstring)."""
    if not recovered or not truth:
        return float(recovered == truth)
    overlap = bag_overlap(recovered, truth)
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


def summarise(attack: str, truths: list[list[int]], inversions: list,
              span_counts: list[tuple[int, int]] | None = None) -> AttackSummary:
    """Per-attack summary over the prompts inverted so far (``inversions[i]`` for ``truths[i]``;
    ``span_counts[i]``: :func:`span_leaks` of prompt i, when the prompts carry private spans)."""
    pairs = list(zip(truths, inversions))
    n = len(pairs)
    exact = sum(inv.ids == truth for truth, inv in pairs) / n if n else float("nan")
    correct = [[a == b for a, b in zip(inv.ids, truth)] for truth, inv in pairs]
    acc, acc_se = clustered_accuracy(correct)
    n_tokens = sum(len(t) for t, _ in pairs)
    tried = sum(inv.candidates_tried for _, inv in pairs)
    vocab = max((inv.vocab_size for _, inv in pairs), default=0)
    bags = [bag_f1(inv.ids, truth) for truth, inv in pairs]
    overlap = sum(bag_overlap(inv.ids, truth) for truth, inv in pairs)
    eligible = sum(e for e, _ in span_counts or [])
    leaked = sum(k for _, k in span_counts or [])
    span_recall = leaked / eligible if eligible else float("nan")
    hits = sum(sum(c) for c in correct)
    k_chance, n_chance = chance_hits(truths[:n], [inv.ids for _, inv in pairs])
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
        token_accuracy_upper95=clopper_pearson_upper(hits, n_tokens),
        bag_f1=statistics.fmean(bags) if n else float("nan"),
        bag_f1_se=statistics.stdev(bags) / math.sqrt(n) if n > 1 else float("nan"),
        bag_f1_upper95=clopper_pearson_upper(overlap, n_tokens),
        span_recall=span_recall,
        span_recall_se=proportion_se(span_recall, eligible) if eligible else float("nan"),
        span_recall_upper95=clopper_pearson_upper(leaked, eligible),
        n_spans=eligible,
        chance_hits=k_chance,
        chance_comparisons=n_chance,
        token_accuracy_chance=k_chance / n_chance if n_chance else float("nan"),
        token_accuracy_excess_upper95=excess_bounds(hits, n_tokens, k_chance, n_chance)[1],
    )


def overlap_with(windows: list[list[int]], prompts: list[list[int]], n: int = 8) -> float:
    """Fraction of the prompts' token n-grams that also occur in the corpus ``windows``."""
    corpus = {tuple(w[i : i + n]) for w in windows for i in range(len(w) - n + 1)}
    grams = [tuple(p[i : i + n]) for p in prompts for i in range(len(p) - n + 1)]
    return sum(g in corpus for g in grams) / len(grams) if grams else 0.0


def noise_summary(sigmas: list[float], state_rms: list[float], noise_norms: list[list[float | None]],
                  positions: list[list[int]], deltas: list[float]) -> dict:
    """What the exposure's noise is, in the three units a reader needs: sigma absolute per coordinate, as a
    multiple of the state RMS, and ||n_t|| / (Delta_t / 2) at the positions whose margin was measured
    (medians over prompts / positions), with a verdict: where ||n_t|| < Delta_t / 2 nearest-neighbour
    decoding provably returns the true token (docs/theory.md, "Margin and noise")."""
    rel = [s / r for s, r in zip(sigmas, state_rms) if r > 0]
    ratios = [noise_norms[i][t] / (d / 2) for (i, t), d in zip(positions, deltas)
              if d and noise_norms[i][t] is not None]
    below = sum(r < 1 for r in ratios)
    if not any(sigmas):
        verdict = "no noise"
    elif not ratios:
        verdict = "no margin measured: no guarantee either way"
    elif below == len(ratios):
        verdict = (f"far below the margin: ||n|| < Delta/2 at all {len(ratios)} measured positions (largest ratio "
                   f"{max(ratios):.3g}): recovery is guaranteed there, the noise is no defence")
    elif below:
        verdict = (f"below the margin at {below} of {len(ratios)} measured positions (recovery guaranteed there only), "
                   f"above it at the rest")
    else:
        verdict = (f"above the margin at all {len(ratios)} measured positions (median ratio {median(ratios):.3g}): "
                   "no guarantee; what the decoders recover is the measure")
    return {"sigma_abs_median": median(sigmas), "sigma_rms_multiple_median": median(rel),
            "ratio_to_half_delta_median": median(ratios), "ratio_to_half_delta_max": max(ratios, default=float("nan")),
            "n_ratio_positions": len(ratios), "n_below_half_delta": below, "verdict": verdict}


def describe_noise(summary: dict) -> str:
    """One line of :func:`noise_summary` for the console and the report."""
    if summary["verdict"] == "no noise":
        return "noise: none in the exposure"
    return (f"noise: sigma {summary['sigma_abs_median']:.4g} absolute per coordinate = "
            f"{summary['sigma_rms_multiple_median']:.4g} x the state RMS (medians over prompts); "
            f"median ||n|| / (Delta/2) = {summary['ratio_to_half_delta_median']:.3g}: {summary['verdict']}")


def use_lines(uses: dict) -> list[str]:
    """One line per use of the states beyond serving and continued inference (defenses.uses)."""
    lines = []
    store, probe = uses.get("embedding_store"), uses.get("probing")
    if store:
        m = store.get("metrics") or {}
        lines.append("embedding store: " + (
            f"recall@1 of defended queries {m.get('mean_recall_at_1', float('nan')):.3f} (mean-pooled), "
            f"{m.get('last_recall_at_1', float('nan')):.3f} (last token), loss {store['loss']:.3f}"
            if store.get("applicable") else "not applicable"))
    if probe:
        m = probe.get("metrics") or {}
        lines.append("linear probes: " + (
            f"accuracy {m.get('accuracy_clean', float('nan')):.3f} on clean -> "
            f"{m.get('accuracy_defended', float('nan')):.3f} on defended states (loss {probe['loss']:.3f})"
            if probe.get("applicable") else "not applicable (no per-position states)"))
    return lines


def median(values) -> float:
    values = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    return statistics.median(values) if values else float("nan")
