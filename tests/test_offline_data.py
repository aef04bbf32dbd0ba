"""The data shipped in sipit/data: the snapshot of Python's pydoc text and the tiny models' tokenizer."""

import hashlib
import platform

import pytest
import tokenizers

from defenses.uses import uses_text
from sipit.offline_text import corpus_text, frequency_text, held_out_text
from sipit import offline_text, tiny_tokenizer
from sipit.models import tiny_tokenizer as tiny_hf_tokenizer

# sha256 of each caller's text as it read CPython 3.11.7's own pydoc_data before the snapshot replaced it
TEXT_SHA256 = {
    corpus_text: "71f2ff5d99bdc1f9c48c5c2353ad138201c5ca1c377e0226857ef8fa89b8bcee",
    held_out_text: "5fd5ffe9b8aa4413167e41a19afbb797ef4be155eaf4f5e39801200c3fb4d4cf",
    frequency_text: "7506ff48f5f33b93813629ea7e5d6f99fad7d6854c425201ef4537690cf7a285",
    uses_text: "0ed87f066ef59d091362225aa8d8bbf83050f2d897bac0e61569d44f2b642686",
}
SENTENCE = "The tiny tokenizer turns this sentence into ids: 42 + x**2 == y!"
# the ids the tokenizer trained at import time gave on CPython 3.11.7 before it was shipped as a file
SENTENCE_IDS = [341, 259, 263, 89, 310, 389, 78, 73, 90, 299, 259, 355, 78, 83, 326, 354, 362, 78, 266, 411, 291, 84,
                79, 270, 68, 83, 26, 221, 20, 18, 221, 11, 221, 88, 300, 18, 221, 281, 221, 89, 1]


@pytest.fixture
def fresh_snapshot_cache():
    """Drop the loaded snapshot before and after the test, so a patched file is read and then forgotten."""
    offline_text.pydoc_topics.cache_clear()
    yield
    offline_text.pydoc_topics.cache_clear()


def test_snapshot_file_has_the_digest_the_code_expects():
    assert hashlib.sha256(offline_text.SNAPSHOT.read_bytes()).hexdigest() == offline_text.SNAPSHOT_SHA256
    topics = offline_text.pydoc_topics()
    assert len(topics) == 79 and [name for name, _ in topics] == sorted(name for name, _ in topics)


@pytest.mark.parametrize("text", list(TEXT_SHA256), ids=lambda f: f.__name__)
def test_every_caller_reads_the_text_it_read_from_pydoc_data(text):
    assert hashlib.sha256(text().encode()).hexdigest() == TEXT_SHA256[text]


def test_damaged_snapshot_is_refused_in_one_line(tmp_path, monkeypatch, fresh_snapshot_cache):
    damaged = bytearray(offline_text.SNAPSHOT.read_bytes())
    damaged[1000] ^= 0x01
    (tmp_path / "topics.json.gz").write_bytes(bytes(damaged))
    monkeypatch.setattr(offline_text, "SNAPSHOT", tmp_path / "topics.json.gz")
    with pytest.raises(offline_text.SnapshotError, match=r"is damaged or replaced: sha256 [0-9a-f]{64}, expected"):
        offline_text.pydoc_topics()


def test_missing_snapshot_is_refused_in_one_line(tmp_path, monkeypatch, fresh_snapshot_cache):
    monkeypatch.setattr(offline_text, "SNAPSHOT", tmp_path / "absent.json.gz")
    with pytest.raises(offline_text.SnapshotError, match="cannot read the offline text snapshot .*absent"):
        offline_text.pydoc_topics()


def test_shipped_tokenizer_gives_the_recorded_ids():
    tok = tiny_hf_tokenizer()
    assert len(tok) == tiny_tokenizer.VOCAB_SIZE and tok.eos_token_id == 0
    assert tok(SENTENCE, add_special_tokens=False).input_ids == SENTENCE_IDS
    assert tok.decode(SENTENCE_IDS) == SENTENCE


def test_training_here_gives_the_shipped_tokenizer():
    assert tiny_tokenizer.train().to_str() == tiny_tokenizer.load().to_str(), (
        f"training on Python {platform.python_version()} with tokenizers {tokenizers.__version__} no longer gives "
        f"{tiny_tokenizer.FILE.name} (made on Python 3.11.7, tokenizers 0.23.3); the tiny models load the file, "
        "so their ids are unchanged")
