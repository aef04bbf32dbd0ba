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


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread: on 2 shared cores, oversubscribed threads make tiny steps ~20x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
