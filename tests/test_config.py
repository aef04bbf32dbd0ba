"""benchmarks.config: the run configuration the CLI and run_benchmark share, and defence spec strings."""

from __future__ import annotations

import pytest

from benchmarks import run
from benchmarks.cli import UsageError
from benchmarks.config import RunConfig, legacy_specs, parse_spec, sweep_configs


def _configs_from_cli(*argv: str) -> list[RunConfig]:
    options = vars(run.build_parser().parse_args(list(argv)))
    options.pop("progress")
    return sweep_configs(**options)


def _config_from_cli(*argv: str) -> RunConfig:
    (config,) = _configs_from_cli(*argv)
    return config


def test_spec_values_are_read_as_int_float_or_text():
    assert parse_spec("pooling:mode=mean,over=window,k=4") == ("pooling", {"mode": "mean", "over": "window", "k": 4})
    assert parse_spec(" noise:sigma=0.1, placement=exposure ") == ("noise", {"sigma": 0.1, "placement": "exposure"})
    assert parse_spec("none") == ("none", {})
    with pytest.raises(UsageError, match="not key=value"):
        parse_spec("noise:sigma")


def test_cli_specs_chain_in_order_and_match_the_legacy_flags():
    specs = _config_from_cli("--defense", "quant:weights=int8", "--defense", "noise:sigma=0.5,relative_to=rms")
    legacy = _config_from_cli("--defense", "quant,noise", "--quant", "int8", "--sigma-rel", "0.5")
    assert specs.defense_names() == legacy.defense_names() == ["quant", "noise"]
    assert specs.chain().params() == legacy.chain().params()
    assert specs.record() == legacy.record() and specs.hash() == legacy.hash()
    assert [m.name for m in specs.chain().members] == ["quant", "noise"]


def test_the_documented_command_keeps_its_meaning():
    config = _config_from_cli("--defense", "noise", "--sigma", "0.1")
    params = config.chain().params()
    assert config.defenses == ("noise:sigma=0.1,relative_to=abs",)
    assert params["sigma"] == 0.1 and params["relative_to"] == "abs" and params["seed"] == config.seeds["noise"]
    assert RunConfig.from_options(defense="noise", sigma=0.1) == config


def test_bad_specs_are_usage_errors_naming_the_spec():
    with pytest.raises(UsageError, match=r"--defense noise:sigmaa=0.1: .*no parameter"):
        RunConfig(defenses=("noise:sigmaa=0.1",)).validate()
    with pytest.raises(UsageError, match="unknown defence"):
        RunConfig(defenses=("nosie",)).validate()
    with pytest.raises(UsageError, match="pools the exposure, so it must come last"):
        RunConfig(defenses=("pooling:mode=mean", "noise:sigma=0.1")).validate()
    with pytest.raises(UsageError, match="not both"):
        RunConfig.from_options(defense="noise:sigma=0.1", sigma=0.2)
    with pytest.raises(UsageError, match="--n-prompts"):
        RunConfig(n_prompts=0).validate()
    with pytest.raises(UsageError, match="no defence in"):
        legacy_specs(["quant"], sigma=0.1)


def test_seeds_follow_the_run_seed():
    assert RunConfig(seed=5).seeds == {"prompts": 5, "noise": 6, "head": 7, "attack": 5, "margin_positions": 8,
                                       "utility": 5}
    assert RunConfig(seed=5, defenses=("noise:sigma=0.1",)).chain().params()["seed"] == 6
    assert RunConfig(seed=5, defenses=("noise:sigma=0.1,seed=42",)).chain().params()["seed"] == 42


def test_sweeps_expand_into_one_config_per_setting_in_both_forms():
    legacy = _configs_from_cli("--defense", "noise", "--sigma", "0.1,3,10", "--placement", "model,exposure")
    assert [c.chain().params()["sigma"] for c in legacy] == [0.1, 0.1, 3.0, 3.0, 10.0, 10.0]
    assert [c.chain().params()["placement"] for c in legacy] == ["model", "exposure"] * 3
    specs = _configs_from_cli("--defense", "quant:weights=int8|nf4", "--defense", "noise:sigma=0.1|3,placement=model")
    assert [c.defenses for c in specs] == [("quant:weights=int8", "noise:sigma=0.1,placement=model"),
                                           ("quant:weights=int8", "noise:sigma=3,placement=model"),
                                           ("quant:weights=nf4", "noise:sigma=0.1,placement=model"),
                                           ("quant:weights=nf4", "noise:sigma=3,placement=model")]
    assert len({c.hash() for c in legacy + specs}) == 10  # every setting has its own folder / resume key
    assert _configs_from_cli("--defense", "pooling", "--pool", "mean", "--pool-window", "2,4")[1].chain().params()["k"] == 4


def test_policy_option_reaches_exact_sipit_and_is_checked():
    from attacks.registry import AttackOptions, Exposure, build

    config = _config_from_cli("--policy", "gradient")
    assert config.policy == "gradient" and RunConfig().policy == "learned" == _config_from_cli().policy
    # the gradient order is not recorded, so runs made before the learned default keep their hash
    assert "policy" not in config.record() and RunConfig().record()["policy"] == "learned"
    assert RunConfig().hash() == _config_from_cli().hash() != config.hash()
    assert build("sipit", Exposure(), AttackOptions(policy="learned")).name == "sipit-learned"
    radius = build("sipit", Exposure(sigma=0.5), AttackOptions(policy="learned", robust="radius"))
    assert radius.name == "nn-heuristic" and radius.scorer.policy.name == "learned"  # the radius decoder's order
    default = build("sipit", Exposure(sigma=0.5), AttackOptions(policy="learned"))
    assert default.name == "map" and default.scorer.ranking == "learned"  # MAP on the noise-adapted heads' shortlist
    with pytest.raises(UsageError, match="--policy"):
        RunConfig(policy="psychic").validate()


def test_radius_budget_caps_the_radius_decoder_and_is_recorded_only_when_set():
    from attacks.registry import AttackOptions, Exposure, build

    assert RunConfig().radius_budget == 1024 and RunConfig().record()["radius_budget"] == 1024
    assert "radius_budget" not in _config_from_cli("--radius-budget", "0").record()  # runs before the option
    radius = build("sipit", Exposure(sigma=0.5), AttackOptions(robust="radius", max_candidates=_config_from_cli(
        "--radius-budget", "64").radius_budget))
    assert radius.scorer.max_candidates == 64
    with pytest.raises(UsageError, match="--radius-budget"):
        RunConfig(radius_budget=-1).validate()
