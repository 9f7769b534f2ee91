"""Where a step's GPU time goes: kernels grouped into phases, against the hardware's floor.

Issue 14 asks for a table per phase of a workload: measured, floor, fraction. The pieces:

- ``kernel_category``: a kernel's name -> "gemm" (cuBLAS, and pageserve's GEMVs and tile
  matmuls), "attention", "norm", "rope_kv", "activation", "sampling", "copy" or "other".
- ``profile_kernels``: run a function under ``torch.profiler`` and add up the device time of
  each kernel it launched (eager launches and CUDA-graph replays alike).
- ``by_category``: those rows summed per category.
- ``linear_flops`` / ``prefill_attention_flops`` / ``decode_bytes``: what a prefill of T tokens
  must compute and a decode step must read, from the model's shape (a ``ModelConfig``), to divide by the
  measured TFLOP/s and GB/s (``kernel_bench.ceilings.measure_ceilings``).

``scripts/profile_steps.py`` puts them together on the GPU (stage ``profile_steps`` of
scripts/h200_run.sh); everything here but ``profile_kernels`` is plain arithmetic, tested on
the CPU.
"""
from __future__ import annotations

import collections
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

# (category, substrings of a kernel's name, lower case); the first match wins
CATEGORY_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", ("paged", "decode_split", "decode_merge", "prefill_attn", "attention", "flash", "fmha")),
    ("norm", ("rms_norm", "rmsnorm", "layer_norm")),
    ("rope_kv", ("rope", "rotary", "kv_write", "reshape_and_cache")),
    ("activation", ("silu", "gelu", "act_and_mul")),
    ("sampling", ("sample", "softmax", "argmax", "topk", "top_k", "top_p", "gumbel", "exponential", "multinomial",
                  "log_softmax", "penalt", "sort")),
    ("gemm", ("gemv", "gemm", "matmul", "nvjet", "cutlass", "xmma", "cublas", "splitkreduce", "sm90_", "sm80_",
              "ampere_", "turing_")),
    ("copy", ("copy", "memcpy", "memset", "gather", "index", "cat_", "fill")),
)
CATEGORIES = tuple(c for c, _ in CATEGORY_RULES) + ("other",)


def kernel_category(name: str) -> str:
    """The phase a kernel belongs to, from its name (``CATEGORY_RULES``)."""
    low = name.lower()
    for category, needles in CATEGORY_RULES:
        if any(n in low for n in needles):
            return category
    return "other"


@dataclass(frozen=True)
class KernelRow:
    name: str
    us: float  # device time per call of the profiled function
    launches: int  # launches per call

    @property
    def category(self) -> str:
        return kernel_category(self.name)


def profile_kernels(fn: Callable[[], object], repeats: int = 1) -> list[KernelRow]:
    """Device time of each kernel ``fn`` launches, per call of ``fn`` (``repeats`` profiled
    calls after one unprofiled one), largest first. Needs CUDA: on the CPU nothing is a kernel."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    if not torch.cuda.is_available():  # nothing to count: run it as the GPU run would, return no rows
        for _ in range(repeats):
            fn()
        return []
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    total: dict[str, float] = collections.defaultdict(float)
    count: dict[str, int] = collections.defaultdict(int)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            total[e.name] += e.device_time
            count[e.name] += 1
    rows = [KernelRow(n, t / repeats, count[n] // repeats) for n, t in total.items()]
    return sorted(rows, key=lambda r: -r.us)


def by_category(rows: Iterable[KernelRow]) -> dict[str, float]:
    """Microseconds per category (every category present, 0.0 where nothing ran)."""
    out = dict.fromkeys(CATEGORIES, 0.0)
    for r in rows:
        out[r.category] += r.us
    return out


def linear_flops(config, tokens: int, sampled_rows: int = 0) -> float:
    """FLOPs of every linear layer for ``tokens`` rows (qkv, o, gate_up, down in each layer),
    plus the LM head for the ``sampled_rows`` rows whose logits are computed."""
    h, i = config.hidden_size, config.intermediate_size
    qkv = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
    per_token_layer = qkv * h + h * config.num_heads * config.head_dim + 2 * i * h + h * i
    return 2.0 * (tokens * config.num_layers * per_token_layer + sampled_rows * config.vocab_size * h)


def prefill_attention_flops(config, prompt_len: int, num_prompts: int = 1) -> float:
    """FLOPs of causal attention over whole prompts (QK^T and PV, the visible half only)."""
    pairs = prompt_len * (prompt_len + 1) / 2
    return 2 * 2.0 * pairs * config.head_dim * config.num_heads * config.num_layers * num_prompts


def decode_bytes(model, batch: int, context_len: int, dtype_bytes: int = 2, weights: float | None = None) -> float:
    """Bytes one decode step must read: every weight once (``weights`` if given, e.g. an int8
    model's, else ``peers.weight_bytes``) and ``batch`` sequences' K and V at ``context_len``."""
    from .peers import kv_bytes, weight_bytes

    return (weight_bytes(model, dtype_bytes) if weights is None else weights) + batch * kv_bytes(
        model, context_len, dtype_bytes)


def phase_rows(categories_us: dict[str, float], floors_us: dict[str, float]) -> list[dict]:
    """Table rows (phase, measured µs, floor µs, floor / measured) for the categories that ran,
    largest first; a category with no floor gets None there."""
    rows = []
    for cat, us in categories_us.items():
        if us <= 0:
            continue
        floor = floors_us.get(cat)
        rows.append({"phase": cat, "measured_us": us, "floor_us": floor,
                     "fraction": (floor / us) if floor else None})
    return sorted(rows, key=lambda r: -r["measured_us"])
