"""pageserve's Triton kernels.

One file per kernel family, each with its plain-PyTorch reference importable beside it:

- ``paged_decode``  paged attention, one query per sequence, split-K + merge (CUDA-graph safe);
                    also with the step's RoPE and K/V write in the same launch (``rope_decode_attention``)
- ``paged_prefill`` paged attention for prefill chunks over a cached prefix (and mixed batches)
- ``kv_write``      K/V into the paged cache through slot_mapping (-1 skipped)
- ``norm``          RMSNorm, fused residual-add + RMSNorm
- ``activation``    fused SiLU(gate) * up
- ``rotary``        rotate-half RoPE on q and k in one launch
- ``rope_kv``       RoPE fused with the paged KV write (one launch instead of two)
- ``gemv``          GEMV / skinny GEMM for M <= 8, split-K or not (large M stays on cuBLAS);
                    also the down projection fused with SiLU(gate) * up
- ``step_inputs``   a decode step's inputs into the CUDA graphs' static buffers in one launch
- ``argmax``        each row's first maximal index over the vocabulary (the sampler's pick)
- ``token_bitmask`` structured outputs' allowed-token masks applied to the logits in place (banned: -inf)
- ``gate_up_silu``  the MLP's gate|up product with SiLU·mul in its epilogue for prefill-sized steps
                    (gate and up rows interleaved in one tile: one MMA chain; a persistent TMA walk on Hopper)
- ``gemv_int8``     int8 weight-only (W8A16) linears: the decode GEMV (and its SiLU·mul form),
                    a GEMM for larger M, and a dequantize kernel for dequantize-then-cuBLAS
- ``int8_planes``   int8 weight-only linears for 1-8 rows on the integer MMAs: the activations as
                    int8 digit planes, the weights never converted (and its SiLU·mul form)

``reference`` holds the plain-PyTorch math each kernel is checked against. This package
imports torch and triton and nothing else of pageserve (``pageserve.model.triton_ops`` is
the layer that uses it). Importing it changes no process-wide state, and nothing here keeps
a setting between calls: each wrapper takes its launch options (``pdl=``, and the GEMVs' tuned
``configs=``) as arguments. To run the kernels on Triton's CPU interpreter, set
``TRITON_INTERPRET=1`` before triton is first imported.
"""
from __future__ import annotations

from . import reference  # noqa: F401
from .activation import silu_and_mul
from .argmax import argmax_rows
from ._util import interpreting
from .gemv import SPLIT_K_MODES, GemvConfig, gemv, load_device_configs, parse_configs, silu_mul_gemv
from .gate_up_silu import gate_up_silu
from .gemv_int8 import dequantize_int8, gemm_int8, gemv_int8, silu_mul_gemv_int8
from .int8_planes import gemv_int8_planes, silu_mul_gemv_int8_planes
from .kv_write import write_kv
from .matmul_invariant import matmul_invariant
from .norm import add_rms_norm, rms_norm
from .paged_decode import paged_decode_attention, rope_decode_attention
from .paged_invariant import paged_attention_invariant
from .paged_prefill import chunk_prefill_attention, paged_prefill_attention
from .rope_kv import rotary_write_kv
from .rotary import rotary
from .step_inputs import stage_decode_inputs

__all__ = [
    "reference", "GemvConfig", "SPLIT_K_MODES", "interpreting", "load_device_configs", "parse_configs",
    "gemv", "silu_mul_gemv", "gate_up_silu", "gemv_int8", "silu_mul_gemv_int8", "gemm_int8", "dequantize_int8",
    "gemv_int8_planes", "silu_mul_gemv_int8_planes", "write_kv", "rms_norm", "add_rms_norm", "silu_and_mul",
    "rotary", "rotary_write_kv", "stage_decode_inputs", "argmax_rows", "paged_decode_attention", "rope_decode_attention",
    "paged_prefill_attention",
    "chunk_prefill_attention",
    "matmul_invariant", "paged_attention_invariant",  # batch-invariant (deterministic mode, issue 15)
]
