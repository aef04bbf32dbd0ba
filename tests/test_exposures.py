"""Real exposures: half-precision serving, the KV cache, devices, models loaded in their served dtype."""

from __future__ import annotations

import json

import pytest
import torch

from attacks.policies import GradientPolicy
from attacks.sipit import SipIt
from sipit.cache import model_key
from sipit.models import ModelLoadError, load_model, resolve_device, resolve_dtype
from sipit.whitebox import SipitInputError, WhiteBox

TEXT = "The cat sat on the mat."


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-gpt2"])
def tiny(request):
    return load_model(request.param)


def own_cache_rows(loaded, ids: list[int], layer: int) -> torch.Tensor:
    """Block ``layer``'s keys and values as the model's own forward caches them, one row per position."""
    out = loaded.model(torch.tensor([ids]), use_cache=True)
    cache = out.past_key_values
    keys, values = cache.layers[layer - 1].keys[0], cache.layers[layer - 1].values[0]
    return torch.cat([keys.transpose(0, 1).reshape(len(ids), -1), values.transpose(0, 1).reshape(len(ids), -1)], -1)


@pytest.mark.parametrize("layer", [1, 2, 4])
def test_kv_states_are_the_models_own_cache(tiny, layer):
    ids = tiny.tokenizer(TEXT, add_special_tokens=False).input_ids
    wb = WhiteBox(tiny.model, exposure="kv")
    states = wb.states(ids, layer)
    assert states.shape == (len(ids), wb.d) and states.dtype == torch.float32
    torch.testing.assert_close(states, own_cache_rows(tiny, ids, layer).float(), rtol=1e-5, atol=1e-6)
    prefix = wb.prefix_cache(ids[:5], layer)  # the incremental step too (same values up to float rounding)
    torch.testing.assert_close(wb.step(prefix, torch.tensor([ids[5], 3])).states[0], states[5], rtol=1e-5, atol=1e-6)


def test_kv_exposure_inverts_exactly_and_has_its_own_cache_key(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("SIPIT_CACHE_DIR", str(tmp_path))
    ids = tiny.tokenizer(TEXT, add_special_tokens=False).input_ids
    wb = WhiteBox(tiny.model, exposure="kv")
    for layer in (1, 4):
        inv = SipIt(GradientPolicy()).invert(wb.states(ids, layer), wb, layer, tiny.tokenizer)
        assert inv.ids == ids and inv.all_verified
    learned = SipIt().invert(wb.states(ids, 2), wb, 2, tiny.tokenizer)  # table and heads over K/V rows
    assert learned.ids == ids and learned.all_verified
    assert model_key(wb) == model_key(WhiteBox(tiny.model)) + "-kv"


def test_layer_0_has_no_kv_and_bad_names_are_one_line_errors(tiny):
    with pytest.raises(SipitInputError, match="layer 0 has no keys or values"):
        WhiteBox(tiny.model, exposure="kv").states([1, 2], 0)
    with pytest.raises(SipitInputError, match="exposure must be one of residual, kv"):
        WhiteBox(tiny.model, exposure="keys")
    with pytest.raises(ModelLoadError, match="dtype must be one of fp32, bf16, fp16"):
        resolve_dtype("fp8")
    with pytest.raises(ModelLoadError, match="device must be one of"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ModelLoadError, match="device 'cuda' is not available on this machine"):
            load_model("tiny-llama", device="cuda")
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "mps"
                                           if torch.backends.mps.is_available() else "cpu")


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("exposure", ["residual", "kv"])
def test_half_precision_served_states_invert_exactly_at_the_served_shape(dtype, exposure):
    loaded = load_model("tiny-llama", dtype=dtype)
    assert {p.dtype for p in loaded.model.parameters()} == {resolve_dtype(dtype)}
    ids = loaded.tokenizer(TEXT, add_special_tokens=False).input_ids
    wb = WhiteBox(loaded.model, exposure=exposure)
    for layer in (1, 4):
        served = wb.states(ids, layer)  # the provider's forward of the whole prompt, in its dtype
        view = wb.at_served_shape(len(ids))
        prefix = view.prefix_cache(ids[:6], layer)
        assert torch.equal(view.step(prefix, torch.tensor([ids[6], 9])).states[0], served[6])  # bit for bit
        inv = SipIt(GradientPolicy()).invert(served, view, layer, loaded.tokenizer)
        assert inv.ids == ids and inv.all_verified


def test_a_model_loaded_in_bf16_holds_no_fp32_copy_of_its_weights():
    loaded = load_model("tiny-llama", dtype="bf16")
    params = sum(p.numel() for p in loaded.model.parameters())
    fp32 = [name for name, t in [*loaded.model.named_parameters(), *loaded.model.named_buffers()]
            if t.dtype == torch.float32 and t.numel() > params // 100]
    assert fp32 == [] and {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    reference = load_model("tiny-llama")
    assert torch.equal(loaded.model.get_input_embeddings().weight,
                       reference.model.get_input_embeddings().weight.to(torch.bfloat16))  # the fp32 weights, rounded


@pytest.mark.smollm
def test_the_bundled_model_loads_in_bf16_from_its_own_bf16_cache():
    from sipit.cache import cache_dir

    loaded = load_model("smollm2-135m", dtype="bf16")
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    assert any(cache_dir().glob("gguf/SmolLM2-135M-Instruct.Q4_1-*-bf16/model.safetensors"))


# --------------------------------------------------------------------------- the run's --dtype/--exposure/--device
RUN = ["--model", "tiny-llama", "--n-prompts", "2", "--length", "6", "--attacks", "sipit", "--utility-tokens", "0",
       "--margin-positions", "0", "--no-progress", "--no-tracking"]


def test_the_run_serves_in_bf16_inverts_exactly_and_reports_the_naive_fp32_attacker(tmp_path):
    """--dtype bf16: the informed attacker (bf16, served-shape verification) recovers every prompt; the
    naive fp32 attacker's row sits beside it; the config records the dtype."""
    from benchmarks import run as bench

    assert bench.main(RUN + ["--dtype", "bf16", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["config"]["dtype"] == "bf16"
    assert results["attacks"]["sipit"]["exact_match"] == 1.0
    naive = results["attacks"]["sipit-fp32"]
    assert naive["decoder"].startswith("NearestNeighbour") and 0.0 <= naive["token_accuracy"] <= 1.0


def test_the_run_attacks_the_kv_exposure_and_refuses_defences_that_cannot_act_on_it(tmp_path, capsys):
    from benchmarks import run as bench

    assert bench.main(RUN + ["--exposure", "kv", "--layer", "2", "--out", str(tmp_path / "kv")]) == 0
    results = json.loads((tmp_path / "kv" / "results.json").read_text())
    assert results["config"]["exposure"] == "kv" and results["attacks"]["sipit"]["exact_match"] == 1.0
    width = WhiteBox(load_model("tiny-llama").model, exposure="kv").d
    refusals = {"noise:sigma=0.1,placement=model": "placement=exposure",
                f"pooling:over=dims,g={width + 1}": f"width d={width} of the kv exposure"}
    for spec, message in refusals.items():
        with pytest.raises(SystemExit) as info:
            bench.main(RUN + ["--exposure", "kv", "--layer", "2", "--defense", spec, "--out", str(tmp_path / "no")])
        assert info.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "no").exists()


@pytest.mark.parametrize("flag, value, message", [("--dtype", "fp8", "invalid choice"),
                                                  ("--exposure", "keys", "invalid choice"),
                                                  ("--device", "tpu", "device must be one of")])
def test_a_bad_dtype_exposure_or_device_is_a_one_line_error_before_anything_is_written(tmp_path, capsys, flag, value,
                                                                                        message):
    from benchmarks import run as bench

    with pytest.raises(SystemExit) as info:
        bench.main(RUN + [flag, value, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert info.value.code == 2 and message in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()
