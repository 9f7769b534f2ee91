"""Weight-only quantization of the decoder's linears (W8A16).

``quantize_model(model, "int8")`` replaces each layer's four projections (fused qkv, o, fused
gate_up, down) by a ``QuantizedLinear``: per-output-channel symmetric int8 weights
(``qweight [N, K]``) with one scale per row in the model dtype (``scale [N]``); a bias, where the
model has one, stays in the model dtype. Embeddings, norms and the output head stay as they are.

The model's code does not change: it passes ``proj.weight`` to its ops object as before, and a
``QuantizedLinear``'s ``weight`` is a ``QuantizedWeight`` (the two tensors), on which the ops
dispatch: ``TorchOps`` runs the reference (dequantize, then the float product), ``TritonOps``
the int8 kernels (``kernels/gemv_int8.py``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..kernels.reference import quantize_int8

QUANTIZATION_METHODS = ("int8",)
QUANTIZED_PROJECTIONS = (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"),
                         ("mlp", "down_proj"))


@dataclass(frozen=True)
class QuantizedWeight:
    """What a quantized projection hands its ops object in place of a float weight."""

    qweight: torch.Tensor  # [N, K] int8
    scale: torch.Tensor  # [N], the model dtype

    @property
    def shape(self) -> torch.Size:
        return self.qweight.shape

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the weight stands for (its scale's, the model's)."""
        return self.scale.dtype

    def dequantize(self) -> torch.Tensor:
        """q * scale: [N, K] in the model dtype."""
        return self.qweight.to(self.scale.dtype) * self.scale[:, None]


class QuantizedLinear(nn.Module):
    """An int8 weight-only linear: ``qweight [N, K]`` int8 and ``scale [N]`` buffers, an optional
    bias. ``weight`` is a ``QuantizedWeight`` view of the two (built on access, so it follows
    ``.to(device)``)."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.out_features, self.in_features = qweight.shape

    @property
    def weight(self) -> QuantizedWeight:
        return QuantizedWeight(self.qweight, self.scale)

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear) -> "QuantizedLinear":
        w = linear.weight
        qweight, scale = quantize_int8(w, scale_dtype=w.dtype)
        bias = linear.bias.detach() if linear.bias is not None else None
        return cls(qweight, scale, bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8, bias={self.bias is not None}"


def check_quantization(method: str | None) -> None:
    if method is not None and method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be None or one of {QUANTIZATION_METHODS}, got {method!r}")


@torch.no_grad()
def quantize_model(model: nn.Module, method: str | None = "int8") -> nn.Module:
    """Quantize ``model``'s decoder-layer projections in place, one at a time: each float weight
    is freed as soon as its int8 copy exists, so memory never holds more than the float model
    plus one projection's int8 weight (quantization runs on the weight's own device). Projections
    already quantized are left alone (calling it twice is harmless). ``method`` None: nothing."""
    check_quantization(method)
    if method is None:
        return model
    for layer in model.layers:
        for part, name in QUANTIZED_PROJECTIONS:
            parent = getattr(layer, part)
            linear = getattr(parent, name)
            if isinstance(linear, QuantizedLinear):
                continue
            setattr(parent, name, QuantizedLinear.from_linear(linear))
            del linear  # the float weight's last reference
    return model


def is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, QuantizedLinear) for m in model.modules())
