"""sipit.cache: entries keyed by what the model computes, damaged files rebuilt, never trusted."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attacks.proposals import HeadConfig, corpus_examples, inverse_head, training_windows
from defenses import make_defense
from sipit import cache
from sipit.cache import CacheDirError, model_key
from sipit.margin_store import store_path, stored_margin
from sipit.models import load_model
from sipit.vocab_table import position_zero_table, table_path
from sipit.whitebox import WhiteBox

SMALL = HeadConfig(n_text=1024, n_random=512, n_pairs=512, min_steps=20, epochs=1)
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SIPIT_CACHE_DIR", str(tmp_path))
    return tmp_path


def tiny(name: str = "tiny-llama"):
    loaded = load_model(name)
    return loaded, WhiteBox(loaded.model)


def served_key(loaded, spec: str) -> str:
    name, _, rest = spec.partition(":")
    params = {k: int(v) for k, v in (item.split("=") for item in rest.split(",") if item)}
    return model_key(WhiteBox(make_defense(name, **params).serve(loaded, 2).model))


def test_served_copies_with_different_parameters_never_share_a_key(fresh_cache):
    loaded, wb = tiny()
    keys = {spec: served_key(loaded, spec) for spec in
            ("tying:groups=50,seed=0", "tying:groups=50,seed=1", "tying:rare=50", "quant", "none")}
    assert len(set(keys.values())) == len(keys), keys  # seed, method and defence each change the key
    assert keys["none"] == model_key(wb)
    assert served_key(loaded, "tying:groups=50,seed=0") == keys["tying:groups=50,seed=0"]  # same copy: same key


def test_a_model_with_noise_inside_caches_nothing(fresh_cache):
    loaded, _ = tiny()
    noisy = WhiteBox(make_defense("noise", sigma=0.5, placement="model").serve(loaded, 2).model)
    assert model_key(noisy) is None and table_path(noisy, 2) is None and store_path(noisy, 2) is None
    position_zero_table(noisy, 2)
    assert not list(fresh_cache.rglob("*.pt"))


def test_a_keyed_forward_change_changes_the_key_only_while_it_is_on(fresh_cache):
    _, wb = tiny()
    before = model_key(wb)
    handle = wb.transform_layer(1, lambda h: 2 * h, key="double")
    on = model_key(wb)
    handle.remove()
    assert on not in (None, before) and model_key(wb) == before
    handle = wb.transform_layer(1, lambda h: h + torch.randn_like(h))  # random: no key
    assert model_key(wb) is None
    handle.remove()
    assert model_key(wb) == before


def test_a_model_directory_whose_weights_change_in_place_gets_a_new_key(fresh_cache, tmp_path):
    loaded, _ = tiny()
    folder = tmp_path / "model"
    loaded.model.save_pretrained(folder)
    loaded.tokenizer.save_pretrained(folder)
    first = model_key(WhiteBox(load_model(str(folder)).model))
    with torch.no_grad():
        loaded.model.get_input_embeddings().weight[3] += 0.5
    loaded.model.save_pretrained(folder)
    assert model_key(WhiteBox(load_model(str(folder)).model)) != first


@pytest.mark.parametrize("damage", [b"", b"garbage", os.urandom(4096)])
def test_damaged_cache_files_are_removed_with_a_warning_and_rebuilt(fresh_cache, damage, caplog):
    loaded, wb = tiny()
    table = position_zero_table(wb, 2).states
    head = inverse_head(wb, loaded.tokenizer, 2, SMALL)[0]
    sources = training_windows(loaded.tokenizer, wb.vocab_size, SMALL, 2)
    states = corpus_examples(wb, 2, sources, 2, SMALL)[0]
    ids = [5, 7, 9]
    delta = stored_margin(wb, 2, ids, lambda: 1.25)
    files = [p for p in fresh_cache.rglob("*") if p.is_file()]
    assert {p.parent.name for p in files} == {"tables", "heads", "head-corpus", "margins"}
    for path in files:
        path.write_bytes(damage)
    with caplog.at_level(logging.WARNING, logger="sipit.cache"):
        fresh = WhiteBox(loaded.model)
        assert torch.equal(position_zero_table(fresh, 2).states, table) and not position_zero_table(fresh, 2).cached
        rebuilt = inverse_head(fresh, loaded.tokenizer, 2, SMALL)
        assert not rebuilt[1].cached and torch.equal(rebuilt[0].mlp[0].weight, head.mlp[0].weight)
        assert torch.equal(corpus_examples(fresh, 2, sources, 2, SMALL)[0], states)
        assert stored_margin(fresh, 2, ids, lambda: 1.25) == delta
    damaged = [r.getMessage() for r in caplog.records if "damaged cache file" in r.getMessage()]
    for path in files:
        assert any(str(path) in message for message in damaged), path
    again = WhiteBox(loaded.model)  # rebuilt files are whole: read back without a warning
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="sipit.cache"):
        assert position_zero_table(again, 2).cached and inverse_head(again, loaded.tokenizer, 2, SMALL)[1].cached
    assert not caplog.records


def test_a_misshapen_table_is_rebuilt_not_trusted(fresh_cache):
    _, wb = tiny()
    first = position_zero_table(wb, 1)
    cache.save(first.states[:-1].clone(), table_path(wb, 1))  # one row short: another model's table
    assert not position_zero_table(WhiteBox(wb.model), 1).cached


def test_cache_dir_that_is_a_file_is_an_error_not_a_silent_no_cache(tmp_path, monkeypatch):
    a_file = tmp_path / "cache.txt"
    a_file.write_text("")
    for value in (a_file, a_file / "below"):
        monkeypatch.setenv("SIPIT_CACHE_DIR", str(value))
        with pytest.raises(CacheDirError, match="is a file, not a folder"):
            cache.cache_dir()
    result = subprocess.run([sys.executable, "-m", "benchmarks.invert", "hello", "--model", "tiny-llama"],
                            cwd=REPO, env={**os.environ, "SIPIT_CACHE_DIR": str(a_file)}, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 2 and "is a file, not a folder" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_leftovers_of_a_killed_process_are_removed_and_a_live_ones_kept(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    (tmp_path / f".partial-{dead_pid}-abc").mkdir()
    (tmp_path / f".partial-{dead_pid}-abc" / "model.safetensors").write_bytes(b"x" * 100)
    (tmp_path / f".partial-{dead_pid}-def.pt").write_bytes(b"x")
    (tmp_path / f".partial-{os.getpid()}-ghi.pt").write_bytes(b"x")  # this process: still writing
    (tmp_path / "table.pt").write_bytes(b"x")
    cache.remove_stale_partials(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".partial-{os.getpid()}-ghi.pt", "table.pt"]


def test_an_interrupted_gguf_cache_build_leaves_nothing_and_a_finished_one_has_open_modes(fresh_cache, monkeypatch):
    from sipit import models

    source = fresh_cache / "src"
    loaded, _ = tiny()
    loaded.model.save_pretrained(source)
    loaded.tokenizer.save_pretrained(source)
    gguf = fresh_cache / "fake.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 64)
    monkeypatch.setattr(models, "_read_gguf", lambda path: (load_model(str(source)).model, loaded.tokenizer))
    real_save = type(loaded.tokenizer).save_pretrained

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(type(loaded.tokenizer), "save_pretrained", interrupted)
    with pytest.raises(KeyboardInterrupt):
        models.load_model(str(gguf))
    assert not list((fresh_cache / "gguf").iterdir())  # no .partial-* folder left behind
    monkeypatch.setattr(type(loaded.tokenizer), "save_pretrained", real_save)
    models.load_model(str(gguf))
    (folder,) = list((fresh_cache / "gguf").iterdir())
    umask = os.umask(0)
    os.umask(umask)
    assert folder.stat().st_mode & 0o777 == 0o777 & ~umask  # not mkdtemp's 0700


def test_the_softmax_heads_of_two_tied_copies_read_their_own_corpus_states(fresh_cache):
    """The case a hostile user found: tying seed 0, then seed 1 on the same cache loaded the first copy's
    corpus states (keyed by the model's name). Each copy now computes and caches its own."""
    from benchmarks.pipeline import expose, train_softmax_head

    loaded, wb = tiny()
    heads = []
    for seed in (0, 1):
        chain = make_defense("tying", groups=50, seed=seed)
        exposed = expose(chain, loaded, wb, 2, [[5, 6, 7]], seed=0)
        heads.append(train_softmax_head(exposed, "clean", n_tokens=512, epochs=2, seed=0)[0])
    assert len(list((fresh_cache / "head-corpus").glob("*.pt"))) == 2
    assert not torch.equal(heads[0].mean, heads[1].mean)  # trained on different states
