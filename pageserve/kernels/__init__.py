"""Triton kernels for pageserve, and ``TritonOps``: the ops object that uses them.

One file per kernel family, each with its plain-PyTorch reference importable beside it:

- ``paged_decode``  paged attention, one query per sequence, split-K + merge (CUDA-graph safe)
- ``paged_prefill`` paged attention for prefill chunks over a cached prefix (and mixed batches)
- ``kv_write``      K/V into the paged cache through slot_mapping (-1 skipped)
- ``norm``          RMSNorm, fused residual-add + RMSNorm
- ``activation``    fused SiLU(gate) * up
- ``rotary``        rotate-half RoPE on q and k in one launch
- ``gemv``          split-K GEMV / skinny GEMM for M <= 8 (large M stays on cuBLAS)

Without CUDA, importing this package sets ``TRITON_INTERPRET=1`` (unless already set) so
that the kernels run on Triton's CPU interpreter: the flag is read when a kernel is
decorated, so it must be set before the kernel modules are imported.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from ..attention import AttentionMetadata  # noqa: E402
from ..ops import TorchOps  # noqa: E402
from .activation import silu_and_mul  # noqa: E402
from .gemv import GemvConfig, gemv  # noqa: E402
from .kv_write import write_kv  # noqa: E402
from .norm import add_rms_norm, rms_norm  # noqa: E402
from .paged_decode import paged_decode_attention  # noqa: E402
from .paged_prefill import paged_prefill_attention  # noqa: E402
from .rotary import rotary  # noqa: E402

__all__ = [
    "TritonOps", "GemvConfig", "gemv", "write_kv", "rms_norm", "add_rms_norm", "silu_and_mul", "rotary",
    "paged_decode_attention", "paged_prefill_attention",
]


class TritonOps(TorchOps):
    """Same methods and signatures as ``TorchOps``; each runs a Triton kernel.

    ``gemv``: use the split-K GEMV for ``linear`` when the batch has at most ``gemv_max_m``
    rows (larger batches, and ``gemv=False``, go to cuBLAS through torch).
    ``decode_num_splits``: force the split count of the decode kernel (None: from shapes).
    Decode-only batches (``meta.max_query_len == 1`` and one query row per sequence) use the
    CUDA-graph-safe decode kernel; anything else the prefill kernel.
    """

    name = "triton"

    def __init__(self, gemv: bool = True, gemv_max_m: int = 8, decode_num_splits: int | None = None) -> None:
        self.use_gemv = gemv
        self.gemv_max_m = gemv_max_m
        self.decode_num_splits = decode_num_splits

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.use_gemv and x.dim() == 2 and 0 < x.shape[0] <= self.gemv_max_m and x.stride(-1) == 1:
            return gemv(x, weight, bias)
        return torch.nn.functional.linear(x, weight, bias)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        return add_rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(gate_up)

    def rotary(self, q, k, positions, cos_sin):
        return rotary(q, k, positions, cos_sin)

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        write_kv(k, v, k_cache, v_cache, slot_mapping)

    def paged_attention(self, q: torch.Tensor, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if meta.max_query_len == 1 and q.shape[0] == meta.seq_lens.shape[0]:
            return paged_decode_attention(q, k_cache, v_cache, meta.seq_lens, meta.block_tables, scale,
                                          num_splits=self.decode_num_splits)
        return paged_prefill_attention(q, k_cache, v_cache, meta, scale)
