"""Formal noise: differentially private exposure of each state, with the guarantee it claims and an audit.

Every exposed state h (one row: the residual stream's d, or a K/V row) is first clipped to L2 norm at
most ``clip`` (``h * min(1, C / ||h||)``), then noised. Two clipped states lie within 2C of each other,
so every mechanism below is calibrated so that ANY two states are ``epsilon``-indistinguishable
(``(epsilon, delta)`` for the Gaussian): a guarantee per exposed state, against replacing it by any
other (the prompt's token at that position and everything before it).

- ``laplace-l2``: n = r u, u uniform on the unit sphere, r ~ Gamma(d, 1 / eta), density
  proportional to exp(-eta ||n||): eta-metric DP in L2 (d_chi-privacy, as Split-and-Denoise
  calibrates it), eta = epsilon / (2C), so (epsilon, 0)-DP over the clip ball.
- ``gaussian``: n ~ N(0, sigma^2 I) with the smallest sigma for which the analytic Gaussian mechanism
  (Balle & Wang 2018) is (epsilon, delta)-DP at L2 sensitivity 2C (any epsilon > 0, not only < 1).
- ``elliptical``: the Laplace-L2 mechanism in the metric of a public diagonal scale s (Mahalanobis,
  as SPARSE shapes its noise): n = s * m with m Laplace-L2 of rate eta, the clip applied to h / s, so
  (epsilon, 0)-DP over the ellipse {h : ||h / s|| <= C}. s is the per-dimension standard deviation of
  the model's layer-l states over the public frequency text (sipit.offline_text), fitted when the
  defence first serves the model; noise then follows the states' own spread.

Composition over the T states of a prompt (:meth:`DPNoise.guarantee`): basic composition
(T epsilon, T delta) for every mechanism; for the Gaussian also zero-concentrated DP (Bun & Steinke
2016): rho = Delta^2 / (2 sigma^2) per state, T rho in all, epsilon(delta) = T rho + 2 sqrt(T rho ln(1/delta)).

The audit (:func:`epsilon_lower_bound`): a distinguishing game between two inputs; any (epsilon,
delta)-DP mechanism forces every test to have FPR + e^eps FNR >= 1 - delta and FNR + e^eps FPR >= 1 -
delta, so one-sided Clopper-Pearson upper bounds on the measured FPR and FNR give an epsilon that the
mechanism provably exceeds with the stated confidence (Jagielski et al. 2020; Nasr et al. 2021).
benchmarks.experiments.dp_audit plays the game with the benchmark's attacker.

The adaptive attacker knows the mechanism, its parameters and the clip (:meth:`DPNoise.knowledge`): it
holds the clean model with the clip applied to its layer-l states (:meth:`DPNoise.attacker_model`), so its
candidates are clipped as the exposed states were, and decodes the exposure as noise of the mechanism's
per-coordinate standard deviation (:meth:`DPNoise.noise_sigma`; a Gaussian likelihood for the Laplace
mechanisms too, matched in variance).
"""

from __future__ import annotations

import math
import secrets
from dataclasses import replace

import torch
from scipy.stats import beta, norm

from defenses.base import Defense, DefenseParamError, check_choice, check_number, copy_loaded

MECHANISMS = ("laplace-l2", "gaussian", "elliptical")


def analytic_gaussian_sigma(epsilon: float, delta: float, sensitivity: float) -> float:
    """The smallest sigma for which N(0, sigma^2 I) is (epsilon, delta)-DP at L2 sensitivity Delta (Balle & Wang
    2018, Theorem 8): delta(sigma) = Phi(Delta / (2 sigma) - epsilon sigma / Delta)
    - e^epsilon Phi(-Delta / (2 sigma) - epsilon sigma / Delta) <= delta, solved by bisection."""

    def achieved(sigma: float) -> float:
        a, b = sensitivity / (2 * sigma), epsilon * sigma / sensitivity
        return float(norm.cdf(a - b) - math.exp(epsilon + norm.logcdf(-a - b)))  # log space: e^eps overflows

    low, high = 1e-12 * sensitivity, sensitivity
    while achieved(high) > delta:
        high *= 2
    for _ in range(200):
        mid = (low + high) / 2
        low, high = (mid, high) if achieved(mid) > delta else (low, mid)
    return high


def epsilon_lower_bound(false_positives: int, false_negatives: int, n_negative: int, n_positive: int,
                        delta: float = 0.0, confidence: float = 0.95) -> float:
    """The epsilon a mechanism exceeds with probability >= ``confidence``, from a test that called
    ``false_positives`` of ``n_negative`` draws of input B "A" and missed ``false_negatives`` of ``n_positive``
    draws of input A (module docstring). 0 when the test says nothing."""
    fpr = _clopper_pearson_upper(false_positives, n_negative, confidence)
    fnr = _clopper_pearson_upper(false_negatives, n_positive, confidence)
    bounds = [math.log((1 - delta - x) / y) for x, y in ((fpr, fnr), (fnr, fpr)) if 1 - delta - x > 0 and y > 0]
    return max([0.0, *bounds])


def distinguishing_game(defence: "DPNoise", a: torch.Tensor, b: torch.Tensor, n: int, generator: torch.Generator,
                        confidence: float = 0.95) -> dict:
    """The audit's game on one pair of states ``a``, ``b`` (each ``(d,)``): ``n`` exposures of each through
    ``defence.expose``; the attacker says "a" when the exposure is nearer a's clipped state than b's, in the
    mechanism's metric (L2; L2 of h / s for the elliptical one): the likelihood-ratio test of every
    mechanism here at its midpoint. Returns the counts, the measured error rates and
    :func:`epsilon_lower_bound` at ``confidence`` beside the claimed epsilon."""
    scale = defence.scale if defence.mechanism == "elliptical" else None
    clean = defence.clipped(torch.stack([a, b]).float())
    ca, cb = clean[0], clean[1]

    def says_a(rows: torch.Tensor) -> torch.Tensor:
        x = rows.float() if scale is None else rows.float() / scale
        pa, pb = (ca, cb) if scale is None else (ca / scale, cb / scale)
        return (x - pa).norm(dim=-1) < (x - pb).norm(dim=-1)

    ya = defence.expose(a.expand(n, -1).clone(), generator)
    yb = defence.expose(b.expand(n, -1).clone(), generator)
    false_positives, false_negatives = int(says_a(yb).sum()), int((~says_a(ya)).sum())
    lower = epsilon_lower_bound(false_positives, false_negatives, n, n, defence.delta or 0.0, confidence)
    distance = float(((ca - cb) if scale is None else (ca - cb) / scale).norm())
    return {"n_per_input": n, "false_positives": false_positives, "false_negatives": false_negatives,
            "fpr": false_positives / n, "fnr": false_negatives / n, "clipped_distance": distance,
            "epsilon_claimed": defence.epsilon, "delta": defence.delta or 0.0,
            "epsilon_lower_bound": lower, "confidence": confidence}


def _clopper_pearson_upper(k: int, n: int, confidence: float) -> float:
    """One-sided upper Clopper-Pearson bound of a binomial proportion k / n."""
    return 1.0 if k >= n else float(beta.ppf(confidence, k + 1, n - k))


def clip_rows(states: torch.Tensor, clip: float, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Each row h with ||h / s|| <= ``clip``: h * min(1, C / ||h / s||) (s = ``scale``, or 1)."""
    x = states.float() if scale is None else states.float() / scale
    factor = (clip / x.norm(dim=-1, keepdim=True).clamp_min(1e-30)).clamp(max=1.0)
    return states.float() * factor


def laplace_l2(shape: tuple[int, ...], eta: float, generator: torch.Generator) -> torch.Tensor:
    """Rows with density proportional to exp(-eta ||n||) in R^d: a uniform direction times a Gamma(d, 1/eta) norm
    (the sum of d standard exponentials, -sum log U, exactly Gamma(d, 1) for integer d)."""
    direction = torch.nn.functional.normalize(torch.randn(shape, generator=generator, dtype=torch.float64), dim=-1)
    uniform = torch.rand(shape, generator=generator, dtype=torch.float64).clamp_min(1e-300)
    radius = -torch.log(uniform).sum(-1, keepdim=True)
    return (direction * radius / eta).float()


class DPNoise(Defense):
    """Clip each exposed state, add calibrated noise (module docstring)."""

    name = "dp"
    param_names = ("mechanism", "epsilon", "delta", "clip", "seed", "secure")

    def __init__(self, mechanism: str = "gaussian", epsilon: float = 1.0, delta: float | None = None,
                 clip: float = 1.0, seed: int = 0, secure: bool = False):
        check_choice("mechanism", mechanism, MECHANISMS)
        self.mechanism = mechanism
        self.epsilon = check_number("epsilon", epsilon, minimum=0.0, exclusive=True)
        self.clip = check_number("clip", clip, minimum=0.0, exclusive=True)
        if mechanism == "gaussian":
            delta = 1e-5 if delta is None else check_number("delta", delta, minimum=0.0, exclusive=True)
            if delta >= 1:
                raise DefenseParamError(f"delta must lie in (0, 1), got {delta}")
        elif delta is not None:
            raise DefenseParamError(f"delta is only used by mechanism='gaussian' (got mechanism={mechanism!r})")
        self.delta = delta
        self.seed = check_number("seed", seed, minimum=0, integer=True)
        if not isinstance(secure, bool):
            raise DefenseParamError(f"secure must be a bool, got {secure!r}")
        self.secure = secure
        self._generator = torch.Generator().manual_seed(self.seed)
        self.scale: torch.Tensor | None = None  # the elliptical mechanism's public per-dimension scale s
        self._attacker = None  # (model, layer, the clipped copy) of attacker_model
        self.sigma = (analytic_gaussian_sigma(self.epsilon, delta, 2 * self.clip) if mechanism == "gaussian"
                      else None)

    @property
    def eta(self) -> float:
        """The metric-DP rate of the Laplace mechanisms: epsilon / (2 clip)."""
        return self.epsilon / (2 * self.clip)

    @property
    def alters_exposure(self) -> bool:
        return True

    def serve(self, loaded, layer: int):
        """The elliptical mechanism fits its public scale on the clean model (the served model is unchanged)."""
        if self.mechanism == "elliptical" and self.scale is None:
            self.scale = public_scale(loaded, layer)
        return loaded

    def attacker_model(self, loaded, layer: int, knows_defense: bool = True):
        """The clean model whose layer-l states are clipped as the exposure's are (a copy with a forward hook on
        block l, sipit.whitebox.WhiteBox.transform_layer: the states at layer l are the clipped ones, nothing
        below it changes); the naive attacker holds the clean model. One copy per (model, layer)."""
        if not knows_defense:
            return loaded
        from sipit.whitebox import WhiteBox

        held = self._attacker
        if held is not None and held[0] is loaded.model and held[1] == layer:
            return held[2]
        if self.mechanism == "elliptical" and self.scale is None:
            self.scale = public_scale(loaded, layer)
        attacker = copy_loaded(loaded, f"{self.spec()}-clipped@{layer}")
        scale = self.scale if self.mechanism == "elliptical" else None

        def clip(states: torch.Tensor) -> torch.Tensor:
            return clip_rows(states, self.clip, None if scale is None else scale.to(states.device)).to(states.dtype)

        what = "rows / s" if scale is not None else "rows"
        WhiteBox(attacker.model).transform_layer(layer, clip, key=f"dp clip {what} to L2 norm {self.clip!r}")
        self._attacker = (loaded.model, layer, attacker)
        return attacker

    def check_exposure(self, exposure: str, d: int) -> None:
        """The residual exposure only, for now: the informed attacker clips its candidates through a hook on the
        residual stream (:meth:`attacker_model`), which the keys and values of the ``kv`` exposure never pass
        through (and the elliptical scale is fitted on the residual stream)."""
        if exposure != "residual":
            raise DefenseParamError(f"dp acts on the residual exposure only for now (got {exposure!r}): its informed "
                                    "attacker clips residual states, not the keys and values it computes")

    def knowledge(self, exposure, knows_defense: bool = True):
        """The mechanism, its parameters and noise scale (the Gaussian's sigma, the Laplace rate eta); the
        per-coordinate standard deviation the decoders take is the exposure's sigma (:meth:`noise_sigma`)."""
        if not knows_defense:
            return exposure
        scale = {"sigma": self.sigma} if self.mechanism == "gaussian" else {"eta": self.eta}
        return replace(exposure, dp={"mechanism": self.mechanism, "epsilon": self.epsilon, "delta": self.delta,
                                     "clip": self.clip, **scale})

    def _stream(self, generator: torch.Generator | None) -> torch.Generator:
        if self.secure:
            return torch.Generator().manual_seed(secrets.randbits(63))
        return generator if generator is not None else self._generator

    def expose(self, states: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        stream = self._stream(generator)
        if self.mechanism == "gaussian":
            out = clip_rows(states, self.clip) + self.sigma * torch.randn(states.shape, generator=stream)
        elif self.mechanism == "laplace-l2":
            out = clip_rows(states, self.clip) + laplace_l2(tuple(states.shape), self.eta, stream)
        else:
            scale = self._fitted_scale(states.shape[-1])
            out = clip_rows(states, self.clip, scale) + scale * laplace_l2(tuple(states.shape), self.eta, stream)
        return out.to(device=states.device, dtype=states.dtype)

    def _fitted_scale(self, width: int) -> torch.Tensor:
        if self.scale is None:
            raise RuntimeError("the elliptical mechanism fits its scale on the model: call serve(loaded, layer) first")
        if self.scale.numel() != width:
            raise DefenseParamError(f"the elliptical scale has {self.scale.numel()} dimensions, the exposure {width} "
                                    "(it is fitted on the residual stream)")
        return self.scale

    def noise_sigma(self, states: torch.Tensor) -> float:
        """The noise's per-coordinate standard deviation: sigma; sqrt(d + 1) / eta for Laplace-L2 (E||n||^2 =
        d (d + 1) / eta^2); for the elliptical one the same times the RMS of s."""
        if self.mechanism == "gaussian":
            return self.sigma
        d = states.shape[-1]
        spread = 1.0 if self.mechanism == "laplace-l2" else float(self._fitted_scale(d).pow(2).mean().sqrt())
        return math.sqrt(d + 1) / self.eta * spread

    def clipped(self, states: torch.Tensor) -> torch.Tensor:
        """The deterministic part of the exposure (the clip), which the attacker applies to its candidates too."""
        return clip_rows(states, self.clip, self.scale if self.mechanism == "elliptical" else None)

    def guarantee(self, n_states: int) -> dict:
        """The claim: per exposed state and composed over ``n_states`` states (module docstring)."""
        per = {"epsilon": self.epsilon, "delta": self.delta or 0.0}
        out = {"mechanism": self.mechanism, "per_state": per, "n_states": n_states,
               "basic_composition": {"epsilon": n_states * self.epsilon, "delta": n_states * (self.delta or 0.0),
                                     "name": "basic composition over the prompt's T states: (T epsilon, T delta)"},
               "neighbours": f"any two states within the clip ball (L2 sensitivity {2 * self.clip:g})"}
        if self.mechanism == "gaussian":
            rho = n_states * (2 * self.clip) ** 2 / (2 * self.sigma**2)
            out["zcdp"] = {"rho": rho, "delta": self.delta,
                           "epsilon": rho + 2 * math.sqrt(rho * math.log(1 / self.delta)),
                           "name": "zero-concentrated DP (Bun & Steinke 2016): rho = T Delta^2 / (2 sigma^2), "
                                   "epsilon(delta) = rho + 2 sqrt(rho ln(1/delta))"}
        return out

    def params(self) -> dict:
        return {"mechanism": self.mechanism, "epsilon": self.epsilon, "delta": self.delta, "clip": self.clip,
                "seed": self.seed, "secure": self.secure}

    def describe(self) -> str:
        noise = (f"Gaussian sigma {self.sigma:.4g} ((epsilon, delta) = ({self.epsilon:g}, {self.delta:g}))"
                 if self.mechanism == "gaussian" else
                 f"{self.mechanism} rate eta = {self.eta:.4g} (epsilon {self.epsilon:g})")
        return (f"dp: each exposed state clipped to norm {self.clip:g}, then {noise} per state; the attacker "
                "knows the mechanism and its parameters.")


@torch.no_grad()
def public_scale(loaded, layer: int, n_tokens: int = 2048) -> torch.Tensor:
    """Per-dimension standard deviation of the clean model's layer-``layer`` states over the first ``n_tokens``
    of the public frequency text (sipit.offline_text), floored at 1e-3 of its mean."""
    from sipit.offline_text import frequency_text
    from sipit.whitebox import WhiteBox

    wb = WhiteBox(loaded.model)
    ids = loaded.tokenizer(frequency_text()[: 16 * n_tokens], add_special_tokens=False).input_ids[:n_tokens]
    states = torch.cat([wb.states(ids[i : i + 64], layer) for i in range(0, len(ids), 64) if len(ids[i : i + 64]) > 1])
    std = states.std(0)
    return std.clamp_min(1e-3 * float(std.mean())).cpu()
