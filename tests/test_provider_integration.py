"""The provider defences in the benchmark: each defence declares what the attacker knows (tiny-llama)."""

from __future__ import annotations

import pytest
import torch

from attacks.registry import AttackOptions, Exposure, strongest
from benchmarks.pipeline import expose
from defenses import make_chain
from defenses.base import chain_members, find_member

pytestmark = pytest.mark.usefixtures("one_thread")  # 2 shared cores: oversubscribed threads slow tiny steps ~20x


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SIPIT_CACHE_DIR", str(tmp_path / "cache"))


def _old_knowledge(exposed, i: int) -> Exposure:
    """Exposed.knowledge as it was before the defences declared it: by name and the pooling special case."""
    pooling = None if exposed.chain.per_position else chain_members(exposed.chain)[-1]
    tying = find_member(exposed.chain, "tying")
    groups = tying.groups() if tying is not None and exposed.exact[i] else None
    sigma = exposed.sigmas[i] if exposed.knows_defense else 0.0
    return Exposure(sigma=sigma, exact=exposed.exact[i], pooling=pooling, groups=groups)


@pytest.mark.parametrize("names, params", [
    ("none", {}), ("noise", {"sigma": 0.05, "relative_to": "rms"}), ("quant", {"weights": "none", "activations": "int8"}),
    ("tying", {"rare": 400}), ("pooling", {"over": "window", "k": 2}),
    ("quant,noise", {"weights": "none", "activations": "int8", "sigma": 0.1}), ("tying,pooling", {"rare": 400}),
])
def test_the_existing_defences_declare_what_the_attacker_knew_before(tiny_llama, names, params):
    loaded, clean_wb = tiny_llama
    ids = loaded.tokenizer("Send the invoice to Alice", add_special_tokens=False).input_ids
    for knows in (True, False):
        exposed = expose(make_chain(names, **params), loaded, clean_wb, 2, [ids], seed=0, knows_defense=knows)
        new, old = exposed.knowledge(0), _old_knowledge(exposed, 0)
        assert (new.sigma, new.exact, new.pooling) == (old.sigma, old.exact, old.pooling)
        assert (new.groups is None and old.groups is None) or torch.equal(new.groups, old.groups)
        for robust in ("map", "radius"):
            assert strongest(new, AttackOptions(robust=robust)) == strongest(old, AttackOptions(robust=robust))
