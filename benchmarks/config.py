"""One benchmark run as a configuration object: the CLI and ``run_benchmark(config)`` build the same one.

    RunConfig(model="tiny-gpt2", defenses=("quant:weights=int8", "noise:sigma=0.05,relative_to=rms"))

Defences are spec strings, ``name`` or ``name:key=value,key=value``, validated by the defence
itself (defenses.registry.make_defense); several specs chain in order (``--defense quant:weights=nf4
--defense noise:sigma=0.5``). The older form stays: a comma list of names (``--defense quant,noise``)
whose parameters come from the flags ``--sigma``, ``--sigma-rel``, ``--placement``, ``--quant``,
``--quant-activations``, ``--tie-groups``, ``--tie-rare``, ``--pool``, ``--pool-window``,
``--pool-dims`` (:func:`legacy_specs` turns them into specs). Values in a spec are read as int,
then float, then text. Gaussian noise without an explicit ``seed`` draws with the run's noise seed.

Sweeps (:func:`sweep_configs`): a defence parameter given several values, ``--sigma 0.1,1,10`` or
``noise:sigma=0.1|1|10`` in a spec, expands into one RunConfig per combination of values (the
product over every parameter given more than one), run in order by benchmarks.sweep.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import asdict, dataclass, fields

from attacks.policies import POLICIES
from attacks.registry import ROBUST, RUN_ATTACKS, AttackOptions
from benchmarks.cli import UsageError, check_float, check_int, check_names
from sipit.models import DTYPES, ModelLoadError, resolve_device
from sipit.whitebox import EXPOSURES

#: the smallest value of each integer option (field -> minimum), checked by the CLI and RunConfig alike
MINIMUMS = {"n_prompts": 1, "length": 1, "head_tokens": 0, "head_epochs": 1, "beam_width": 1,
            "utility_tokens": 0, "margin_positions": -1, "radius_budget": 0, "known_pairs": 0}
#: legacy defence flags (keyword names of run_benchmark) -> how each maps onto defence parameters
LEGACY_FLAGS = ("sigma", "sigma_rel", "placement", "quant", "quant_activations", "tie_groups", "tie_rare", "pool",
                "pool_window", "pool_dims")


def flag(name: str) -> str:
    """The command-line flag of a field: ``n_prompts`` -> ``--n-prompts``."""
    return "--" + name.replace("_", "-")


def _value(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_spec(spec: str) -> tuple[str, dict]:
    """``"noise:sigma=0.1,placement=exposure"`` -> ``("noise", {"sigma": 0.1, "placement": "exposure"})``."""
    name, _, rest = spec.strip().partition(":")
    params = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise UsageError(f"--defense {spec!r}: parameter {item!r} is not key=value")
        if key.strip() in params:
            raise UsageError(f"--defense {spec!r}: parameter {key.strip()!r} is given twice")
        params[key.strip()] = _value(value.strip())
    return name.strip(), params


def format_spec(name: str, params: dict) -> str:
    return name if not params else f"{name}:" + ",".join(f"{k}={v}" for k, v in params.items())


def legacy_specs(names: list[str], **flags) -> list[str]:
    """A comma-listed chain plus the legacy parameter flags -> one spec per defence (module docstring)."""
    from defenses.registry import DEFENSES

    if flags.get("sigma") is not None and flags.get("sigma_rel") is not None:
        raise UsageError("give either --sigma (absolute) or --sigma-rel (relative to the state RMS), not both")
    params: dict = {}
    if flags.get("sigma") is not None:
        params.update(sigma=check_float(flags["sigma"], low=0.0, name="--sigma"), relative_to="abs")
    if flags.get("sigma_rel") is not None:
        params.update(sigma=check_float(flags["sigma_rel"], low=0.0, name="--sigma-rel"), relative_to="rms")
    renames = {"placement": "placement", "quant": "weights", "quant_activations": "activations",
               "tie_groups": "groups", "tie_rare": "rare", "pool": "mode"}
    params.update({renames[k]: flags[k] for k in renames if flags.get(k) is not None})
    if flags.get("pool_window") is not None:
        params.update(over="window", k=flags["pool_window"])
    if flags.get("pool_dims") is not None:
        params.update(over="dims", g=flags["pool_dims"])
    check_names(names, tuple(DEFENSES), name="--defense")
    taken = set().union(*(DEFENSES[n].param_names for n in names))
    unknown = sorted(set(params) - taken)
    if unknown:
        raise UsageError(f"--defense {','.join(names)}: no defence in {names} takes parameter(s) {unknown}")
    return [format_spec(n, {k: v for k, v in params.items() if k in DEFENSES[n].param_names}) for n in names]


@dataclass(frozen=True)
class RunConfig:
    """Everything one benchmark run depends on (benchmarks.run); see ``--help`` for each option."""

    model: str = "smollm2-135m"
    layer: int = -1
    dtype: str = "fp32"  # the precision the provider serves in (sipit.models.DTYPES); the attacker computes in it too
    exposure: str = "residual"  # what leaks at layer l: the residual stream or block l's keys and values (sipit.whitebox)
    device: str = "auto"  # where every computation runs (sipit.models.resolve_device): auto = CUDA, else MPS, else CPU
    defenses: tuple[str, ...] = ("none",)
    attacks: tuple[str, ...] = ("sipit", "softmax-head", "inverse-head")
    robust: str = AttackOptions.robust  # the registry's default decoder under noise, written once there
    policy: str = "learned"
    beam_width: int = AttackOptions.beam_width
    radius_budget: int = 1024  # candidates the radius decoder verifies per position at most (0: the vocabulary)
    knows_defense: bool = True
    known_pairs: int = 0  # known (prompt, exposure) pairs the key-recovery attacker gets (keyed defences)
    prompts: str = "mixed"
    split: str = "test"  # the prompts' split (benchmarks.prompts): a run is a final measurement; choose options on dev
    n_prompts: int = 20
    length: int = 20
    seed: int = 0
    head_tokens: int = 0  # the softmax head's corpus: 0 = the inverse heads' whole corpus; N = its first N text tokens
    head_epochs: int = 3
    margin_positions: int = 6
    utility_tokens: int = 1024
    experiment: str = "sipit-bench"
    tracking_uri: str | None = None
    track: bool = True
    out: str | None = None

    @classmethod
    def from_options(cls, *, defense: list[str] | str | None = None, attacks: list[str] | str | None = None,
                     **options) -> "RunConfig":
        """From run_benchmark's keywords / the CLI's options: ``defense`` as specs or a comma chain plus
        the legacy flags (module docstring), ``attacks`` as a comma list or a list."""
        legacy = {k: options.pop(k) for k in LEGACY_FLAGS if k in options}
        given = [defense] if isinstance(defense, str) else list(defense or ["none"])
        if any(":" in d for d in given):
            if any(v is not None for v in legacy.values()):
                raise UsageError("give defence parameters either in --defense name:key=value specs or as flags "
                                 "(--sigma, --quant, ...), not both")
            specs = [s for d in given for s in ([d] if ":" in d else d.split(","))]
        else:
            names = [n.strip() for d in given for n in d.split(",") if n.strip()] or ["none"]
            if len(names) > 1:
                names = [n for n in names if n != "none"] or ["none"]
            specs = legacy_specs(names, **legacy)
        unknown = sorted(set(options) - {f.name for f in fields(cls)})
        if unknown:
            raise UsageError(f"unknown option(s) {unknown}")
        if attacks is not None:
            options["attacks"] = tuple(check_names(attacks, RUN_ATTACKS, name="--attacks"))
        return cls(defenses=tuple(s.strip() for s in specs if s.strip()), **options)

    def validate(self) -> None:
        """Cheap checks of every option (no model needed); :class:`UsageError` names the flag."""
        from benchmarks.prompts import PROMPT_SETS, SPLITS, read_texts

        check_names(list(self.attacks), RUN_ATTACKS, name="--attacks")
        check_names(self.robust, tuple(ROBUST), name="--robust")
        check_names(self.policy, tuple(POLICIES), name="--policy")
        check_names(self.dtype, tuple(DTYPES), name="--dtype")
        check_names(self.exposure, EXPOSURES, name="--exposure")
        try:
            resolve_device(self.device)
        except ModelLoadError as err:
            raise UsageError(f"--device: {err}") from None
        for name, low in MINIMUMS.items():
            check_int(getattr(self, name), low=low, name=flag(name))
        check_names(self.split, SPLITS, name="--split")
        if self.prompts not in PROMPT_SETS:
            try:
                read_texts(self.prompts)
            except (FileNotFoundError, ValueError) as err:
                raise UsageError(f"--prompts {self.prompts!r}: {err} (or use a set name: {', '.join(PROMPT_SETS)})") from None
        self.chain()

    @property
    def seeds(self) -> dict[str, int]:
        """Every random choice's seed, derived from ``seed``."""
        s = self.seed
        return {"prompts": s, "noise": s + 1, "head": s + 2, "attack": s, "margin_positions": s + 3, "utility": s}

    def defense_names(self) -> list[str]:
        return [parse_spec(spec)[0] for spec in self.defenses]

    def chain(self):
        """The defence chain the specs describe, validated by each defence (UsageError names the spec)."""
        from defenses.base import Chain, DefenseParamError
        from defenses.registry import make_defense

        members = []
        for spec in self.defenses:
            name, params = parse_spec(spec)
            if name == "noise" and "seed" not in params:
                params["seed"] = self.seeds["noise"]
            try:
                members.append(make_defense(name, **params))
            except DefenseParamError as err:
                raise UsageError(f"--defense {spec}: {err}") from None
        try:
            return members[0] if len(members) == 1 else Chain(members)
        except DefenseParamError as err:
            raise UsageError(f"--defense {' '.join(self.defenses)}: {err}") from None

    def record(self) -> dict:
        """What results.json and MLflow record as the run's configuration (and :meth:`hash` hashes)."""
        chain = self.chain()
        return dict(model=self.model, layer=self.layer,
                    # recorded when not the default, so fp32 residual runs keep their hash (sweep resume)
                    **({"dtype": self.dtype} if self.dtype != "fp32" else {}),
                    **({"exposure": self.exposure} if self.exposure != "residual" else {}),
                    **({"device": self.device} if self.device != "auto" else {}),
                    defense=self.defense_names(), defense_params=chain.params(),
                    attacks=list(self.attacks), robust=self.robust, beam_width=self.beam_width,
                    # the policy is recorded when not the default, so earlier runs keep their hash (sweep resume)
                    **({"policy": self.policy} if self.policy != "gradient" else {}),
                    # known pairs are recorded when given, so runs without them keep their hash
                    **({"known_pairs": self.known_pairs} if self.known_pairs else {}),
                    # a cap is recorded; no cap (the vocabulary) is how every run before the option worked
                    **({"radius_budget": self.radius_budget} if self.radius_budget else {}),
                    knows_defense=self.knows_defense, prompts=self.prompts, split=self.split, n_prompts=self.n_prompts,
                    length=self.length, seed=self.seed, head_tokens=self.head_tokens, head_epochs=self.head_epochs,
                    margin_positions=self.margin_positions, utility_tokens=self.utility_tokens,
                    experiment=self.experiment)

    def hash(self) -> str:
        return hashlib.sha256(json.dumps(self.record(), sort_keys=True, default=str).encode()).hexdigest()[:12]

    def to_dict(self) -> dict:
        return asdict(self)


#: legacy flags whose text value may hold a comma list of sweep values
LIST_FLAGS = ("placement", "quant", "quant_activations", "pool")


def _alternatives(value) -> list:
    """The sweep values of one option: a list as given, a comma list for the text flags, else one."""
    if isinstance(value, (list, tuple)):
        return list(value) or [None]
    if isinstance(value, str) and "," in value:
        return [v.strip() for v in value.split(",") if v.strip()]
    return [value]


def _spec_alternatives(spec: str) -> list[str]:
    """``"noise:sigma=0.1|1,placement=model"`` -> one spec per value combination."""
    name, params = parse_spec(spec.replace("|", "\x00"))
    if not params:
        return [spec]
    keys = list(params)
    values = [[_value(v) for v in str(params[k]).split("\x00")] for k in keys]
    return [format_spec(name, dict(zip(keys, combo))) for combo in itertools.product(*values)]


def sweep_configs(**options) -> list[RunConfig]:
    """Every RunConfig of a sweep (module docstring); one config when no parameter has several values."""
    defense = options.pop("defense", None)
    given = [defense] if isinstance(defense, str) else list(defense or [])
    if any(":" in d for d in given):
        per_spec = [_spec_alternatives(d) if ":" in d else [d] for d in given]
        return [RunConfig.from_options(defense=list(combo), **options) for combo in itertools.product(*per_spec)]
    for name in LEGACY_FLAGS:  # numeric flags as typed on a command line: "4" or "0.1,1,10"
        if name in options and name not in LIST_FLAGS and isinstance(options[name], str):
            options[name] = [_value(v.strip()) for v in options[name].split(",") if v.strip()]
    swept = [k for k in LEGACY_FLAGS if k in options and len(_alternatives(options[k])) > 1]
    options.update({k: _alternatives(options[k])[0] for k in LEGACY_FLAGS if k in options and k not in swept})
    combos = itertools.product(*(_alternatives(options[k]) for k in swept))
    return [RunConfig.from_options(defense=defense, **{**options, **dict(zip(swept, combo))}) for combo in combos]
