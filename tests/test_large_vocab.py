"""A first use on a model with a large vocabulary stays in bounded memory (the build that was killed for
memory on Gemma's 262k tokens held every held-out state's V scores at once: N x V floats)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VOCAB = 65_536
BUILD = f"""
import json, torch
from transformers import AutoModelForCausalLM, LlamaConfig
from attacks.policies import LearnedPolicy
from attacks.proposals import HeadConfig
from sipit.models import tiny_tokenizer
from sipit.resources import peak_rss
from sipit.whitebox import WhiteBox

config = LlamaConfig(vocab_size={VOCAB}, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                     tie_word_embeddings=False)
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(config).eval()
wb, tokenizer = WhiteBox(model), tiny_tokenizer()
before = peak_rss()
policy = LearnedPolicy(HeadConfig(epochs=1))
lines = policy.prepare(wb, 2, tokenizer)
print(json.dumps({{"before": before, "after": peak_rss(), "lines": lines,
                  "table": list(policy.table.states.shape), "n_train": policy.heads[2][1].n_train}}))
"""


def test_the_one_time_build_of_a_65k_vocabulary_stays_within_bounded_memory(tmp_path):
    env = {**os.environ, "SIPIT_CACHE_DIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", BUILD], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["table"] == [VOCAB, 32] and report["n_train"] > 100_000  # the full-size corpus
    grown = (report["after"] - report["before"]) / 2**20
    # table 8 MB, unit embeddings 8 MB, ~180k corpus states x 32 dims (23 MB, a few copies), scoring in 64 MB
    # chunks: a correct build adds ~100-300 MB; the held-out scores of the old build alone were 2.4 GB.
    assert grown < 600, f"the build raised the peak resident memory by {grown:.0f} MB"
    assert any("needs about" in line for line in report["lines"])
    assert any("peak resident memory" in line for line in report["lines"])
