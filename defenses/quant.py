"""bitsandbytes quantisation: of the served weights, and/or of the exposed activations.

Served weights (``weights``: ``int8``, ``nf4``, ``fp4`` or ``none``): every ``nn.Linear`` inside
the transformer blocks (attention q/k/v/o and MLP projections; GPT-2's ``Conv1D`` layers are
converted to ``nn.Linear`` first) is replaced by ``bnb.nn.Linear8bitLt`` (``has_fp16_weights=False``,
``threshold=0``) or ``bnb.nn.Linear4bit`` (``quant_type`` nf4/fp4, ``compress_statistics=False``,
``compute_dtype=float32``). The input embeddings, position embeddings, norms and the LM head stay in
full precision (as ``BitsAndBytesConfig`` does by default: it skips the head). The model is a
quantised *copy* of the fp32 model (GGUF loading cannot be combined with ``quantization_config``);
by-hand replacement with ``compress_statistics=False`` and ``.eval()`` matches ``from_pretrained``.

``threshold=0`` turns off LLM.int8's outlier decomposition: with it on, the outlier columns are
chosen over the whole batch, so a candidate's state would depend on the other candidates in the
batch (measured up to 0.66 apart on SmolLM2) and batched exact verification would break. With
``threshold=0`` int8 is batch-independent (tested). But every quantised matmul rounds its input
coarsely: int8 quantises each activation row to 256 levels, the 4-bit matmuls on this CPU run a
bf16 kernel whatever the compute dtype. Both kernels are row-invariant, yet the rounding magnifies
the ~1e-7 differences between attention over a cached prefix and over the whole prompt: a cached
candidate step misses the served state by up to 14% relative with int8 and 1.3% with nf4 (smollm2,
layers 15 and 30; 0 at layer 1 for int8). Quantised weights therefore set
:attr:`served_shape_matters`: the attacker holding them verifies each candidate with a forward of
the served prompt's shape, which reproduces the served state bit for bit
(sipit.whitebox.WhiteBox.at_served_shape).

Exposed activations (``activations``: ``int8``, ``nf4``, ``fp4`` or ``none``): the layer-l state
tensor is stored with ``bitsandbytes.functional.quantize_blockwise`` (8-bit dynamic, blocks of
``blocksize``) or ``quantize_4bit`` (nf4/fp4, blocks of ``blocksize``) and dequantised by whoever
reads it. The exposure's error is reported as :meth:`Quantization.noise_sigma` (the RMS of
Q(h) - h), so the attacker decodes it as noise of that size.

Attacker: ``knows_defense=True`` holds the same quantised weights (the served model);
``False`` holds only the fp32 weights (mismatch: the recomputed states differ from the leak by
the quantisation error, so exact verification needs a wide radius or nearest-candidate decoding).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from defenses.base import Defense, DefenseParamError, check_choice, check_number, copy_loaded
from sipit.models import LoadedModel
from sipit.whitebox import WhiteBox

logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # one line per int8 matmul otherwise

import bitsandbytes as bnb  # noqa: E402
import bitsandbytes.functional as bnbf  # noqa: E402

WEIGHT_KINDS = ("none", "int8", "nf4", "fp4")
ACTIVATION_KINDS = ("none", "int8", "nf4", "fp4")


def _as_linear(module: nn.Module) -> nn.Linear | None:
    """``nn.Linear`` as is; GPT-2's ``Conv1D`` (weight stored transposed) as an equivalent Linear."""
    if isinstance(module, nn.Linear) and not isinstance(module, (bnb.nn.Linear8bitLt, bnb.nn.Linear4bit)):
        return module
    if type(module).__name__ == "Conv1D":
        in_f, out_f = module.weight.shape
        linear = nn.Linear(in_f, out_f, bias=module.bias is not None)
        linear.weight = nn.Parameter(module.weight.detach().t().contiguous(), requires_grad=False)
        if module.bias is not None:
            linear.bias = nn.Parameter(module.bias.detach().clone(), requires_grad=False)
        return linear
    return None


def quantize_linear(linear: nn.Linear, kind: str) -> nn.Module:
    """A bitsandbytes module holding ``linear``'s weights quantised to ``kind`` (int8/nf4/fp4)."""
    weight = linear.weight.detach().float().clone()
    has_bias = linear.bias is not None
    if kind == "int8":
        new = bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, bias=has_bias,
                                  has_fp16_weights=False, threshold=0.0)
        new.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
    else:
        new = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=has_bias,
                                compute_dtype=torch.float32, compress_statistics=False, quant_type=kind)
        new.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type=kind, compress_statistics=False)
    if has_bias:
        new.bias = nn.Parameter(linear.bias.detach().float().clone(), requires_grad=False)
    new = new.to(linear.weight.device)  # bitsandbytes quantises on .to(device)
    new.eval()
    return new


def quantize_blocks(model: nn.Module, kind: str) -> int:
    """Replace every linear layer inside the model's blocks by its ``kind`` bnb module, in place.

    Returns the number of layers replaced. Embeddings, norms and the LM head are not touched.
    """
    whitebox = WhiteBox(model)
    replaced = 0
    for block in whitebox.blocks:
        for name, module in list(block.named_modules()):
            linear = _as_linear(module)
            if linear is None or not name:
                continue
            parent_name, _, child = name.rpartition(".")
            parent = block.get_submodule(parent_name) if parent_name else block
            setattr(parent, child, quantize_linear(linear, kind))
            replaced += 1
    model.eval()
    return replaced


def quantize_activations(states: torch.Tensor, kind: str, blocksize: int) -> torch.Tensor:
    """Store ``states`` block-wise quantised (bitsandbytes) and read them back (dequantised)."""
    if kind == "none":
        return states
    flat = states.detach().float().contiguous()
    if kind == "int8":
        q, qstate = bnbf.quantize_blockwise(flat, blocksize=blocksize)
        out = bnbf.dequantize_blockwise(q, qstate)
    else:
        q, qstate = bnbf.quantize_4bit(flat, blocksize=blocksize, quant_type=kind)
        out = bnbf.dequantize_4bit(q, qstate)
    return out.reshape(states.shape).to(dtype=states.dtype, device=states.device)


class Quantization(Defense):
    name = "quant"
    param_names = ("weights", "activations", "blocksize")

    def __init__(self, weights: str = "int8", activations: str = "none", blocksize: int = 64):
        check_choice("weights", weights, WEIGHT_KINDS)
        check_choice("activations", activations, ACTIVATION_KINDS)
        if weights == "none" and activations == "none":
            raise DefenseParamError("quant with weights='none' and activations='none' does nothing; use 'none'")
        self.blocksize = check_number("blocksize", blocksize, integer=True, minimum=64)
        if self.blocksize not in (64, 128, 256, 512, 1024, 2048, 4096):
            raise DefenseParamError(f"blocksize must be a power of two in 64..4096, got {blocksize}")
        self.weights, self.activations = weights, activations

    def serve(self, loaded: LoadedModel, layer: int) -> LoadedModel:
        if self.weights == "none":
            return loaded
        # One quantised copy per source model (the adaptive attacker shares it; layer-independent).
        def build() -> LoadedModel:
            served = copy_loaded(loaded, self.spec())
            quantize_blocks(served.model, self.weights)
            with torch.no_grad():  # bnb repacks 4-bit weights for its CPU kernel on the first forward:
                served.model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=served.model.device))
            return served  # do it now, so the weights (and the caches keyed by their hash) never change

        return self.served_copy(loaded, build)

    @property
    def alters_exposure(self) -> bool:
        return self.activations != "none"

    @property
    def served_shape_matters(self) -> bool:  # type: ignore[override]
        return self.weights != "none"

    def expose(self, states: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        return quantize_activations(states, self.activations, self.blocksize)

    def noise_sigma(self, states: torch.Tensor) -> float:
        """The stored activations' error as a per-coordinate sigma: sqrt(mean((Q(h) - h)^2)) over
        ``states`` (0 when activations are exact). The attacker who knows the format gets this number
        by quantising states it computes itself; with it the registry's strongest attack for the
        exposure is the noise-robust decoder with this radius (attacks.registry.strongest), not a
        nearest neighbour on a small shortlist (which credited stored int8 with hiding half the
        tokens at the last layer)."""
        if self.activations == "none":
            return 0.0
        error = quantize_activations(states, self.activations, self.blocksize).float() - states.detach().float()
        return float(error.pow(2).mean().sqrt())

    def attacker_model(self, loaded: LoadedModel, layer: int, knows_defense: bool = True) -> LoadedModel:
        return self.serve(loaded, layer) if knows_defense else loaded

    def params(self) -> dict:
        return {"weights": self.weights, "activations": self.activations, "blocksize": self.blocksize}

    def describe(self) -> str:
        served = ("served model unchanged" if self.weights == "none" else
                  f"served model: block linear layers bnb {self.weights} "
                  "(embeddings, norms, LM head fp32; int8 threshold 0 = batch-independent)")
        exposed = ("exposure: exact states" if self.activations == "none" else
                   f"exposure: states stored bnb block-wise {self.activations} (blocks of {self.blocksize}), dequantised")
        return (f"quant: {served}; {exposed}. Attacker knows_defense=True holds the same quantised "
                "weights, False only the fp32 weights (mismatch).")
