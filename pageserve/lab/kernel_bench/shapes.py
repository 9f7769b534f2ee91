"""The shapes the kernel bench measures: Qwen2.5-3B's (the model the H200 figures are for)."""
from __future__ import annotations

import torch

# Qwen2.5-3B
HIDDEN, INTER, HQ, HKV, HEAD_DIM, VOCAB, LAYERS = 2048, 11008, 16, 2, 128, 151936, 36
GEMV_SHAPES = {  # name -> (N, K)
    "qkv": ((HQ + 2 * HKV) * HEAD_DIM, HIDDEN),
    "o": (HIDDEN, HQ * HEAD_DIM),
    "gate_up": (2 * INTER, HIDDEN),
    "down": (HIDDEN, INTER),
    "lm_head": (VOCAB, HIDDEN),
}
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
