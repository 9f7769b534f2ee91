"""Phase 06b: how much int8 weight-only quantization costs in accuracy, and what it buys in speed.

- ``eval_text`` / ``eval_token_ids``: a fixed English text shipped with the package
  (``lab/data/eval_text.txt``: the Declaration of Independence and two Lincoln speeches, public
  domain, 2,669 tokens for SmolLM2's tokenizer), so the accuracy figures need no download.
- ``int8_accuracy``: teacher-forced next-token top-1 agreement and perplexity of the int8 model
  against the same model unquantized, over every position of that text.
- ``int8_gemv_bench``, ``int8_linear_bench``, ``sweep_int8_gemv_m1`` (GPU): the int8 GEMV's time
  and achieved bandwidth per 3B linear at M = 1 against the bf16 GEMV; the larger-M paths (int8
  GEMM, dequantize + cuBLAS whole or in L2-sized slices, bf16 cuBLAS) per layer; and the hook
  that tunes the int8 M = 1 tiles (its result feeds ``TritonOps(int8_tuned_configs=...)`` or
  ``configs/<gpu>.json``'s ``int8_tuned_configs``).
"""
from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..kernels.gemv import gemv
from ..kernels.gemv_int8 import (GemvConfig, dequantize_int8, gemm_int8, gemm_int8_config, gemv_int8,
                                 gemv_int8_config, int8_config_key, silu_mul_gemv_int8)
from ..kernels.reference import quantize_int8
from ..model.quant import quantize_model
from .naive import ContiguousKVCache, forward_tokens

EVAL_TEXT_PATH = Path(__file__).parent / "data" / "eval_text.txt"


def eval_text() -> str:
    return EVAL_TEXT_PATH.read_text()


def eval_token_ids(tokenizer, max_tokens: int | None = None) -> list[int]:
    ids = list(tokenizer.encode(eval_text()))
    return ids[:max_tokens] if max_tokens else ids


@dataclass
class QuantAccuracy:
    positions: int  # teacher-forced next-token predictions compared
    top1_agreement: float  # fraction where int8's argmax equals the float model's
    ppl_float: float
    ppl_int8: float
    max_logit_rel_err: float  # max over chunks of ||int8 - float|| / ||float||, logits

    @property
    def ppl_ratio(self) -> float:
        return self.ppl_int8 / self.ppl_float


@torch.inference_mode()
def _hidden(model, ids: list[int]) -> torch.Tensor:
    cache = ContiguousKVCache.for_model(model, len(ids))
    return forward_tokens(model, cache, ids)  # [T, H]


@torch.inference_mode()
def int8_accuracy(model, ids: list[int], chunk: int = 256) -> QuantAccuracy:
    """Teacher-forced comparison on ``ids``: the unquantized ``model`` (left as it is) against an
    int8 copy of it (``quantize_model`` on a deep copy, same ops object). Position t predicts
    ids[t + 1]; logits are made ``chunk`` rows at a time so [T, V] never exists whole."""
    if len(ids) < 2:
        raise ValueError("need at least 2 tokens")
    qmodel = quantize_model(copy.deepcopy(model), "int8")
    h_float, h_int8 = _hidden(model, ids)[:-1], _hidden(qmodel, ids)[:-1]
    del qmodel
    target = torch.as_tensor(ids[1:], device=h_float.device)
    agree, nll_f, nll_q, max_err = 0, 0.0, 0.0, 0.0
    for i in range(0, target.numel(), chunk):
        lf = model.compute_logits(h_float[i:i + chunk])  # fp32 [c, V]
        lq = model.compute_logits(h_int8[i:i + chunk])  # the head is not quantized: the same weight
        t = target[i:i + chunk]
        agree += (lf.argmax(-1) == lq.argmax(-1)).sum().item()
        nll_f += torch.nn.functional.cross_entropy(lf, t, reduction="sum").item()
        nll_q += torch.nn.functional.cross_entropy(lq, t, reduction="sum").item()
        max_err = max(max_err, ((lq - lf).norm() / lf.norm()).item())
    n = target.numel()
    return QuantAccuracy(n, agree / n, math.exp(nll_f / n), math.exp(nll_q / n), max_err)


# ---------------------------------------------------------------------------------------- GPU timing
def layer_shapes(cfg) -> dict[str, tuple[int, int]]:
    """(N, K) of one decoder layer's four linears."""
    H, I = cfg.hidden_size, cfg.intermediate_size
    return {"qkv": (cfg.q_size + 2 * cfg.kv_size, H), "o": (H, cfg.q_size), "gate_up": (2 * I, H), "down": (H, I)}


def _int8_copies(N: int, K: int, dtype, gen, min_bytes: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
    n = max(2, min(16, math.ceil(min_bytes / (N * K))))
    return [quantize_int8(torch.randn(N, K, device=gen.device, generator=gen) * K**-0.5, dtype) for _ in range(n)]


def _float_copies(N: int, K: int, dtype, gen, min_bytes: float) -> list[torch.Tensor]:
    es = torch.tensor([], dtype=dtype).element_size()
    n = max(2, min(16, math.ceil(min_bytes / (N * K * es))))
    return [torch.randn(N, K, device=gen.device, dtype=dtype, generator=gen) * K**-0.5 for _ in range(n)]


def int8_gemv_bench(shapes: dict[str, tuple[int, int]], num_layers: int, M: int = 1, dtype=torch.bfloat16,
                    configs: dict | None = None, bf16_configs: dict | None = None, min_bytes: float = 256e6) -> dict:
    """Per shape: the int8 GEMV and the bf16 GEMV at batch M, each call on the next of several weight
    copies (so weights stream from HBM), CUDA-graph timed. Figures: ``int8_gemv_<shape>_us`` /
    ``_gbps`` (bytes: int8 weight + scales + x + out), ``bf16_gemv_<shape>_us`` / ``_gbps``, and the
    layer stack (``num_layers`` x the four shapes): ``int8_gemv_stack_ms``, ``bf16_gemv_stack_ms``,
    ``int8_gemv_stack_gbps``; and the int8 GEMV with the plain int8 -> fp32 conversion instead of
    the exponent trick (``magic=False``): ``int8_gemv_<shape>_m<M>_cvt_us``, ``int8_gemv_stack_m<M>_cvt_ms``;
    and with the exponent trick in Triton ops instead of PTX (``magic="ops"``, the default until
    session 13): ``..._ops_us``, ``int8_gemv_stack_m<M>_ops_ms``."""
    from .kernel_bench.timing import gbps, graph_ms

    g = torch.Generator(device="cuda").manual_seed(0)
    es = torch.tensor([], dtype=dtype).element_size()
    r: dict = {}
    stack_q = stack_f = stack_c = stack_w = stack_bytes = 0.0
    for name, (N, K) in shapes.items():
        x = torch.randn(M, K, device="cuda", dtype=dtype, generator=g)
        out = torch.empty(M, N, device="cuda", dtype=dtype)
        qs = _int8_copies(N, K, dtype, g, min_bytes)
        t_q = graph_ms(lambda i: gemv_int8(x, *qs[i % len(qs)], out=out, configs=configs), max(8, len(qs)))
        t_c = graph_ms(lambda i: gemv_int8(x, *qs[i % len(qs)], out=out, configs=configs, magic=False),
                       max(8, len(qs)))
        t_w = graph_ms(lambda i: gemv_int8(x, *qs[i % len(qs)], out=out, configs=configs, magic="ops"),
                       max(8, len(qs)))
        del qs
        ws = _float_copies(N, K, dtype, g, min_bytes)
        t_f = graph_ms(lambda i: gemv(x, ws[i % len(ws)], out=out, configs=bf16_configs), max(8, len(ws)))
        del ws
        qbytes = N * K + (N + M * K + M * N) * es
        fbytes = (N * K + M * K + M * N) * es
        r[f"int8_gemv_{name}_m{M}_us"], r[f"int8_gemv_{name}_m{M}_gbps"] = 1e3 * t_q, gbps(qbytes, t_q)
        r[f"int8_gemv_{name}_m{M}_cvt_us"] = 1e3 * t_c
        r[f"int8_gemv_{name}_m{M}_ops_us"] = 1e3 * t_w
        r[f"bf16_gemv_{name}_m{M}_us"], r[f"bf16_gemv_{name}_m{M}_gbps"] = 1e3 * t_f, gbps(fbytes, t_f)
        r[f"int8_gemv_{name}_m{M}_config"] = repr(gemv_int8_config(M, N, K, _sms(), configs=configs))
        stack_q, stack_f, stack_c, stack_bytes = stack_q + t_q, stack_f + t_f, stack_c + t_c, stack_bytes + qbytes
        stack_w += t_w
    r[f"int8_gemv_stack_m{M}_ms"] = num_layers * stack_q
    r[f"bf16_gemv_stack_m{M}_ms"] = num_layers * stack_f
    r[f"int8_gemv_stack_m{M}_gbps"] = gbps(stack_bytes, stack_q)
    r[f"int8_gemv_stack_m{M}_cvt_ms"] = num_layers * stack_c
    r[f"int8_gemv_stack_m{M}_ops_ms"] = num_layers * stack_w
    return r


def _sms() -> int:
    from ..kernels._util import sm_count_for

    return sm_count_for(torch.empty(1, device="cuda"))


def int8_linear_bench(shapes: dict[str, tuple[int, int]], Ms: list[int], dtype=torch.bfloat16,
                      configs: dict | None = None, min_bytes: float = 256e6) -> dict:
    """One layer's four linears at each M (> 8: decode batches and prefill chunks), summed: the
    split-K int8 GEMV where M <= 64 (``gemv_layer_m<M>_us``, the engine's ``"auto"`` path there), the
    int8 GEMM with its small-M tiles and split-K (``gemm_layer_m<M>_us``), dequantize + cuBLAS
    (``dequant_layer_m<M>_us``) and bf16 cuBLAS on a float weight
    (``bf16_layer_m<M>_us``), all under ``int8_prefill_``, with each int8 path's config per shape
    and the fastest int8 path (``best_m<M>``); CUDA-graph timed, weights rotated."""
    from .kernel_bench.timing import graph_ms

    g = torch.Generator(device="cuda").manual_seed(1)
    sms = _sms()
    r: dict = {}
    for M in Ms:
        paths = ("gemv", "gemm", "dequant", "bf16") if M <= 64 else ("gemm", "dequant", "bf16")
        tot = dict.fromkeys(paths, 0.0)
        for name, (N, K) in shapes.items():
            x = torch.randn(M, K, device="cuda", dtype=dtype, generator=g)
            out = torch.empty(M, N, device="cuda", dtype=dtype)
            qs = _int8_copies(N, K, dtype, g, min_bytes)
            calls = max(4, len(qs))
            if "gemv" in tot:
                tot["gemv"] += graph_ms(lambda i: gemv_int8(x, *qs[i % len(qs)], out=out, configs=configs), calls, 10)
                r[f"int8_prefill_gemv_{name}_m{M}_config"] = repr(gemv_int8_config(M, N, K, sms, configs=configs))
            tot["gemm"] += graph_ms(lambda i: gemm_int8(x, *qs[i % len(qs)], out=out, configs=configs), calls, 10)
            tot["dequant"] += graph_ms(
                lambda i: torch.nn.functional.linear(x, dequantize_int8(*qs[i % len(qs)])), calls, 10)
            del qs
            ws = _float_copies(N, K, dtype, g, min_bytes)
            tot["bf16"] += graph_ms(lambda i: torch.nn.functional.linear(x, ws[i % len(ws)]), max(4, len(ws)), 10)
            del ws
            r[f"int8_prefill_gemm_{name}_m{M}_config"] = repr(gemm_int8_config(M, N, K, configs, sms))
        for path, t in tot.items():
            r[f"int8_prefill_{path}_layer_m{M}_us"] = 1e3 * t
        r[f"int8_prefill_best_m{M}"] = min((p for p in tot if p != "bf16"), key=tot.get)
    return r


def m1_int8_candidates(N: int, K: int, sms: int) -> list[GemvConfig]:
    """The int8 M = 1 sweep space: 1-8 rows x 512-4096 int8 columns a tile (the deferred reduction
    where the accumulator stays <= 32 registers a thread), 2/4/8 warps, split-K where rows give
    fewer than 4 programs per SM."""
    out = []
    for block_n in (1, 2, 4, 8):
        for block_k in (512, 1024, 2048, 4096):
            if block_k > 2 * max(512, K):
                continue
            for warps in (2, 4, 8):
                defer = block_n * block_k <= 32 * 32 * warps
                rows = -(-N // block_n)
                splits = [1] if rows >= 4 * sms else sorted({1, max(1, min(-(-4 * sms // rows), K // (2 * block_k)))})
                for split in splits:
                    out.append(GemvConfig(block_n, block_k, split, warps, 3, defer))
    return out


def m1_int8_silu_candidates(N: int, K: int, sms: int) -> list[GemvConfig]:
    """The fused SiLU·mul + down sweep space at M = 1: 4-32 rows a tile (each program applies SiLU to
    its K slice of gate|up, so thin tiles repeat it: 1-2 rows measured ~0.5 ms a 3B step slower),
    256-1024 columns, 2/4/8 warps, K split to ~4 programs per SM or none."""
    out = []
    for block_n in (4, 8, 16, 32):
        for block_k in (256, 512, 1024):
            if block_n * block_k > 16384:
                continue
            for warps in (2, 4, 8):
                rows = -(-N // block_n)
                for split in sorted({1, max(1, min(-(-4 * sms // rows), K // (2 * block_k)))}):
                    out.append(GemvConfig(block_n, block_k, split, warps, 3, block_n * block_k <= 32 * 32 * warps))
    return out


def sweep_int8_gemv_m1(shapes: dict[str, tuple[int, int]], dtype=torch.bfloat16, budget_s: float = 40.0,
                       min_bytes: float = 256e6, silu_mul_shape: str | None = "down") -> tuple[dict, dict]:
    """Tune the int8 GEMV's M = 1 tiles on this GPU: every ``m1_int8_candidates`` config per shape
    (CUDA-graph timed, weights rotated), the time budget split evenly over the shapes (the heuristic
    is always timed first). Returns (configs ``int8_config_key -> GemvConfig`` for the engine,
    figures ``sweep_int8_m1_<shape>_{best_us,heuristic_us,best_config,tried}``). ``silu_mul_shape``:
    that shape is also tuned as the fused SiLU·mul GEMV (``silu_mul_gemv_int8`` reading gate|up,
    ``m1_int8_silu_candidates``), under its silu_mul key and figures ``sweep_int8_m1_silu_<shape>_*``
    (the plain shape's best is no stand-in: its 1-2 row tiles make every program redo the SiLU)."""
    from .kernel_bench.timing import graph_ms

    g = torch.Generator(device="cuda").manual_seed(2)
    sms = _sms()
    tuned, r = {}, {}
    jobs = [(name, N, K, False) for name, (N, K) in shapes.items()]
    if silu_mul_shape in shapes:
        jobs.append(("silu_" + silu_mul_shape, *shapes[silu_mul_shape], True))
    per_shape = budget_s / max(1, len(jobs))
    for name, N, K, silu in jobs:
        x = torch.randn(1, 2 * K if silu else K, device="cuda", dtype=dtype, generator=g)
        out = torch.empty(1, N, device="cuda", dtype=dtype)
        qs = _int8_copies(N, K, dtype, g, min_bytes)
        calls = max(8, len(qs))
        heuristic = gemv_int8_config(1, N, K, sms, silu_mul=silu)
        space = m1_int8_silu_candidates(N, K, sms) if silu else m1_int8_candidates(N, K, sms)
        kernel = silu_mul_gemv_int8 if silu else gemv_int8
        timed = {}
        t0 = time.perf_counter()
        for cfg in [heuristic] + [c for c in space if c != heuristic]:
            if timed and time.perf_counter() - t0 > per_shape:
                break
            try:
                timed[cfg] = graph_ms(lambda i: kernel(x, *qs[i % len(qs)], config=cfg, out=out), calls, 10)
            except Exception:  # a config that does not compile or capture is skipped
                continue
        del qs
        best = min(timed, key=timed.get)
        tuned[int8_config_key(1, N, K, "silu_mul" if silu else "gemv")] = best
        r[f"sweep_int8_m1_{name}_best_us"] = 1e3 * timed[best]
        r[f"sweep_int8_m1_{name}_heuristic_us"] = 1e3 * timed[heuristic]
        r[f"sweep_int8_m1_{name}_best_config"] = repr(best)
        r[f"sweep_int8_m1_{name}_tried"] = len(timed)
    r["sweep_int8_m1_configs"] = {str(k): repr(v) for k, v in tuned.items()}  # the int8_tuned_configs JSON form
    return tuned, r
