"""load_model refuses what is not a model with one clear line, and never waits on the network."""

import time

import pytest

from sipit.models import GGUF_MAGIC, ModelLoadError, load_model
from sipit.whitebox import SipitInputError


def test_directory_without_config_is_not_a_model_directory(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ModelLoadError, match=r"not a model directory: .* has no config.json"):
        load_model(str(tmp_path))


def test_broken_config_json(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", ')
    with pytest.raises(ModelLoadError, match="not a loadable model directory.*config.json"):
        load_model(str(tmp_path))


def test_config_without_tokenizer(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(ModelLoadError, match="not a loadable model directory"):
        load_model(str(tmp_path))


def test_corrupt_gguf_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(GGUF_MAGIC + b"\x03\x00\x00\x00" + bytes(range(255, 200, -1)))
    with pytest.raises(ModelLoadError, match=r"corrupt GGUF file .*model.gguf"):
        load_model(str(path))


def test_gguf_magic_is_what_counts_not_the_suffix(tmp_path):
    fake = tmp_path / "fake.gguf"
    fake.write_text("not a gguf file")
    with pytest.raises(ModelLoadError, match="does not start with the GGUF magic"):
        load_model(str(fake))
    other = tmp_path / "notes.txt"
    other.write_text("hello")
    with pytest.raises(ModelLoadError, match="not a model file"):
        load_model(str(other))


def test_unknown_name_lists_the_registry():
    with pytest.raises(ModelLoadError, match=r"unknown model 'does-not-exist': use one of \['gemma3-270m', 'smollm2-135m'"):
        load_model("does-not-exist")


def test_uncached_hub_id_fails_within_seconds_without_network(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    started = time.perf_counter()
    with pytest.raises(ModelLoadError, match="'someorg/nonexistent-model' is not in the local HF cache"):
        load_model("someorg/nonexistent-model")
    assert time.perf_counter() - started < 10


def test_model_load_errors_are_sipit_input_errors():
    assert issubclass(ModelLoadError, SipitInputError) and issubclass(ModelLoadError, ValueError)
