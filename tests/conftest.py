import pytest
import torch

from sipit.models import load_model
from sipit.whitebox import WhiteBox


@pytest.fixture(scope="session", params=["tiny-gpt2", "tiny-llama"])
def tiny(request):
    """A tiny random model (both block families) with its WhiteBox."""
    loaded = load_model(request.param)
    return loaded, WhiteBox(loaded.model)


@pytest.fixture(scope="session")
def tiny_llama():
    loaded = load_model("tiny-llama")
    return loaded, WhiteBox(loaded.model)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
