"""Correctness at full size and speed against the measured ceilings, for every kernel.

On the H200: ``python -m pageserve.kernels.bench --out <dir>`` runs the checks in bf16, fp16
and fp32 at the 3B shapes, measures the ceilings (device-to-device copy, a pure read, a bf16
matmul) and times every kernel with ``triton.testing.do_bench`` (median; it flushes L2
before each call). Bytes are counted as the fewest the kernel must move: each input read
once, each output written once. A failing kernel is recorded and the run goes on. Writes
``<dir>/kernels_bench.json`` and prints a table.

The notebook 05_triton_kernels calls the same functions.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from . import checks  # noqa: E402
from .activation import silu_and_mul  # noqa: E402
from .gemv import GEMV_CONFIGS, GemvConfig, gemv, gemv_config, silu_mul_gemv  # noqa: E402
from .kv_write import write_kv  # noqa: E402
from .norm import add_rms_norm, rms_norm  # noqa: E402
from .paged_decode import decode_num_splits, paged_decode_attention  # noqa: E402
from .paged_prefill import paged_prefill_attention  # noqa: E402
from .rope_kv import rotary_write_kv  # noqa: E402
from .rotary import rotary  # noqa: E402
from ._util import next_pow2, sm_count_for  # noqa: E402
from ..ops import rope_cos_sin  # noqa: E402

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


# ------------------------------------------------------------------------------ correctness
def small_checks(dtype, device="cpu", seed=0) -> dict:
    """Small shapes (the CPU interpreter's size): name -> thunk returning a relative error."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "paged_decode_attn": lambda: checks.check_decode([0, 1, 16, 33, 70], 16, 2, 128, 16, dtype, device, gen,
                                                         num_splits=3),
        "paged_prefill_attn": lambda: checks.check_prefill([5, 1, 20, 1, 0], [40, 33, 20, 1, 0], 16, 2, 128, 16,
                                                           dtype, device, gen, pad_tokens=2),
        "write_kv": lambda: checks.check_write_kv([5, 1, 20], [40, 33, 20], 2, 128, 16, dtype, device, gen),
        "rms_norm": lambda: checks.check_rms_norm(4, 2048, dtype, device, gen),
        "add_rms_norm": lambda: checks.check_add_rms_norm(4, 2048, dtype, device, gen),
        "silu_and_mul": lambda: checks.check_silu_and_mul(4, 1024, dtype, device, gen),
        "rotary": lambda: checks.check_rotary(4, 16, 2, 128, dtype, device, gen),
        "gemv_m1": lambda: checks.check_gemv(1, 96, 512, dtype, device, gen),
        "gemv_m4": lambda: checks.check_gemv(4, 96, 512, dtype, device, gen),
        "gemv_nosplit_m1": lambda: checks.check_gemv(1, 96, 512, dtype, device, gen, split_k="never"),
        "gemv_nosplit_m4": lambda: checks.check_gemv(4, 96, 512, dtype, device, gen, split_k="never"),
        "silu_mul_gemv_m1": lambda: checks.check_silu_mul_gemv(1, 96, 512, dtype, device, gen),
        "silu_mul_gemv_m4": lambda: checks.check_silu_mul_gemv(4, 96, 512, dtype, device, gen),
        "rotary_write_kv": lambda: checks.check_rotary_write_kv([5, 1, 20], [40, 33, 20], 16, 2, 128, 16,
                                                                dtype, device, gen),
    }


def run_checks(dtypes=(torch.bfloat16,), full: bool | None = None, seed: int = 0) -> dict:
    """Every kernel vs its reference for each dtype. Returns ``{<kernel>_<dtype>_rel_err: float}``
    plus ``<kernel>_<dtype>_error`` (the exception text) for any that raised, and
    ``<kernel>_<dtype>_pass`` (1/0 against checks.TOLERANCE)."""
    cuda = torch.cuda.is_available()
    full = cuda if full is None else full
    device = "cuda" if cuda else "cpu"
    out: dict = {}
    for dtype in dtypes:
        dn = DTYPE_NAMES[dtype]
        table = (checks.full_size_checks(dtype, device, torch.Generator().manual_seed(seed)) if full
                 else small_checks(dtype, device, seed))
        for name, thunk in table.items():
            key = f"{name}_{dn}"
            try:
                err = float(thunk())
                out[f"{key}_rel_err"] = err
                out[f"{key}_pass"] = int(err <= checks.TOLERANCE[dtype])
            except Exception as e:  # record and go on: one broken kernel must not hide the rest
                out[f"{key}_error"] = f"{type(e).__name__}: {e}"[:2000]
                out[f"{key}_pass"] = 0
                traceback.print_exc()
            if cuda:
                torch.cuda.synchronize()
    return out


# ------------------------------------------------------------------------------ timing
def _ms(fn, warmup=25, rep=100) -> float:
    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


@triton.jit
def _read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    base = tl.program_id(0).to(tl.int64) * BLOCK * ITERS
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(ITERS):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, axis=0))


def measure_ceilings(gib: float = 2.0) -> dict:
    """Measured on this device, in this run: device-to-device copy (read + write GB/s), a pure
    read (the best of torch.sum and a streaming Triton reduction), a bf16 8192^3 matmul."""
    n = int(gib * 2**30) // 2
    a = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    b = torch.empty_like(a)
    res = {}
    t = _ms(lambda: b.copy_(a))
    res["copy_gbps"] = 2 * a.numel() * 2 / t / 1e6
    t = _ms(lambda: a.sum(dtype=torch.float32))
    res["read_torch_sum_gbps"] = a.numel() * 2 / t / 1e6
    BLOCK, ITERS = 4096, 16
    part = torch.empty(triton.cdiv(n, BLOCK * ITERS), device="cuda", dtype=torch.float32)
    t = _ms(lambda: _read_kernel[(part.numel(),)](a, part, n, BLOCK=BLOCK, ITERS=ITERS, num_warps=8))
    res["read_triton_gbps"] = a.numel() * 2 / t / 1e6
    res["read_gbps"] = max(res["read_torch_sum_gbps"], res["read_triton_gbps"])
    del a, b
    m = 8192
    x = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    t = _ms(lambda: x @ y)
    res["matmul_bf16_tflops"] = 2 * m**3 / t / 1e9
    return res


def _gbps(nbytes: int, ms: float) -> float:
    return nbytes / ms / 1e6


def bench_elementwise(dtype=torch.bfloat16) -> dict:
    es = torch.tensor([], dtype=dtype).element_size()
    dev, g = "cuda", torch.Generator(device="cuda").manual_seed(0)
    r = {}

    def rn(*shape):
        return torch.randn(*shape, device=dev, dtype=dtype, generator=g)

    T = 16384
    x, res, w = rn(T, HIDDEN), rn(T, HIDDEN), rn(HIDDEN)
    t = _ms(lambda: rms_norm(x, w, 1e-6))
    r["rms_norm_ms"], r["rms_norm_gbps"] = t, _gbps((2 * T * HIDDEN + HIDDEN) * es, t)
    t = _ms(lambda: add_rms_norm(x, res, w, 1e-6))
    r["add_rms_norm_ms"], r["add_rms_norm_gbps"] = t, _gbps((4 * T * HIDDEN + HIDDEN) * es, t)
    del x, res
    T2 = 8192
    gu = rn(T2, 2 * INTER)
    t = _ms(lambda: silu_and_mul(gu))
    r["silu_and_mul_ms"], r["silu_and_mul_gbps"] = t, _gbps(3 * T2 * INTER * es, t)
    del gu
    qkv = rn(T, (HQ + 2 * HKV) * HEAD_DIM)
    q = qkv[:, : HQ * HEAD_DIM].view(T, HQ, HEAD_DIM)
    k = qkv[:, HQ * HEAD_DIM: (HQ + HKV) * HEAD_DIM].view(T, HKV, HEAD_DIM)
    pos = torch.randint(0, 32768, (T,), device=dev, generator=g)
    cs = rope_cos_sin(HEAD_DIM, 32768, 1e6, None, dev)
    t = _ms(lambda: rotary(q, k, pos, cs))
    nbytes = 2 * T * (HQ + HKV) * HEAD_DIM * es + T * HEAD_DIM * 4 + T * 8
    r["rotary_ms"], r["rotary_gbps"] = t, _gbps(nbytes, t)
    T3, bs = 65536, 16
    kk, vv = rn(T3, HKV, HEAD_DIM), rn(T3, HKV, HEAD_DIM)
    nb = T3 // bs + 64
    kc = torch.empty(nb, bs, HKV, HEAD_DIM, device=dev, dtype=dtype)
    vc = torch.empty_like(kc)
    slots = torch.randperm(nb * bs, device=dev, generator=g)[:T3]
    slots[::97] = -1
    t = _ms(lambda: write_kv(kk, vv, kc, vc, slots))
    written = int((slots >= 0).sum())
    r["write_kv_ms"], r["write_kv_gbps"] = t, _gbps(2 * written * HKV * HEAD_DIM * es * 2 + T3 * 8, t)
    return r


def bench_decode_attention(batch=64, ctx=2048, dtype=torch.bfloat16, block_size=16) -> dict:
    es = torch.tensor([], dtype=dtype).element_size()
    gen = torch.Generator().manual_seed(0)
    q, _, _, kc, vc, meta = checks.random_paged_batch([1] * batch, [ctx] * batch, HQ, HKV, HEAD_DIM, block_size,
                                                      dtype, "cuda", gen)
    out = torch.empty_like(q)
    scale = HEAD_DIM**-0.5
    t = _ms(lambda: paged_decode_attention(q, kc, vc, meta.seq_lens, meta.block_tables, scale, out=out))
    nbytes = (2 * batch * ctx * HKV * HEAD_DIM * es + 2 * q.numel() * es
              + meta.block_tables.numel() * 4 + batch * 4)
    splits = decode_num_splits(batch, HKV, meta.block_tables.shape[1], block_size, sm_count_for(q))
    # CUDA-graph replay: the way the engine runs it (launch gaps shrink)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_attention(q, kc, vc, meta.seq_lens, meta.block_tables, scale, out=out)
    tg = _ms(graph.replay)
    r = {"paged_decode_attn_ms": t, "paged_decode_attn_gbps": _gbps(nbytes, t),
         "paged_decode_attn_graph_ms": tg, "paged_decode_attn_graph_gbps": _gbps(nbytes, tg),
         "paged_decode_attn_splits": splits}
    # a small sweep, to show whether the defaults (BLOCK_N 64, 4 warps, auto splits) leave speed behind
    best = (t, f"block_n=64 num_warps=4 splits={splits}")
    for bn in (32, 64, 128):
        for nw in (4, 8):
            for sp in sorted({splits, 2 * splits, max(1, splits // 2)}):
                try:
                    ts = _ms(lambda: paged_decode_attention(q, kc, vc, meta.seq_lens, meta.block_tables, scale,
                                                            out=out, num_splits=sp, block_n=bn, num_warps=nw),
                             warmup=5, rep=20)
                except Exception as e:
                    r[f"paged_decode_attn_sweep_error_{bn}_{nw}_{sp}"] = f"{type(e).__name__}: {e}"[:300]
                    continue
                if ts < best[0]:
                    best = (ts, f"block_n={bn} num_warps={nw} splits={sp}")
    r["paged_decode_attn_best_ms"], r["paged_decode_attn_best_config"] = best
    r["paged_decode_attn_best_gbps"] = _gbps(nbytes, best[0])
    return r


def bench_prefill_attention(dtype=torch.bfloat16) -> dict:
    """Four 2,048-token chunks, two of them over a 2,048-token cached prefix: compute-bound."""
    gen = torch.Generator().manual_seed(0)
    q_lens, ctx = [2048] * 4, [2048, 4096, 2048, 4096]
    q, _, _, kc, vc, meta = checks.random_paged_batch(q_lens, ctx, HQ, HKV, HEAD_DIM, 16, dtype, "cuda", gen)
    t = _ms(lambda: paged_prefill_attention(q, kc, vc, meta, HEAD_DIM**-0.5))
    pairs = sum(n * (c - n) + n * (n + 1) // 2 for n, c in zip(q_lens, ctx))
    flops = 4 * HQ * HEAD_DIM * pairs
    return {"paged_prefill_attn_ms": t, "paged_prefill_attn_tflops": flops / t / 1e9}


def gemv_candidates(M: int, N: int, K: int, sms: int) -> list[GemvConfig]:
    base = gemv_config(M, N, K, sms)
    cands = {base}
    for bn in (8, 16, 32, 64):
        for bk in (256, 512) if M == 1 else (64, 128):
            if bn * bk > 16384:  # [64, 512] tiles spill registers
                continue
            for nw in (4, 8):
                rows = triton.cdiv(N, bn)
                for mult in ((2, 4, 8) if M == 1 else (4,)):
                    split = max(1, min(triton.cdiv(mult * sms, rows), K // (2 * bk)))
                    cands.add(GemvConfig(bn, bk, split, nw, 3))
    return sorted(cands, key=lambda c: (c.block_n, c.block_k, c.num_warps, c.split_k))


def bench_gemv(M: int = 1, dtype=torch.bfloat16, tune: bool = True) -> dict:
    """Each 3B linear at batch M: the GEMV (tuned over a small grid, best kept in GEMV_CONFIGS)
    against torch.nn.functional.linear (cuBLAS)."""
    es = torch.tensor([], dtype=dtype).element_size()
    g = torch.Generator(device="cuda").manual_seed(0)
    r: dict = {}
    stack_gemv = stack_cublas = 0.0
    for name, (N, K) in GEMV_SHAPES.items():
        w = torch.randn(N, K, device="cuda", dtype=dtype, generator=g) * K**-0.5
        x = torch.randn(M, K, device="cuda", dtype=dtype, generator=g)
        b = torch.randn(N, device="cuda", dtype=dtype, generator=g) if name == "qkv" else None
        nbytes = (N * K + M * K + M * N + (N if b is not None else 0)) * es
        t_cublas = _ms(lambda: torch.nn.functional.linear(x, w, b))
        best_cfg, best_t = None, math.inf
        cands = gemv_candidates(M, N, K, sm_count_for(x)) if tune else [gemv_config(M, N, K, sm_count_for(x))]
        for cfg in cands:
            try:
                t = _ms(lambda: gemv(x, w, b, config=cfg), warmup=5, rep=20)
            except Exception as e:  # a config that does not compile is skipped
                r[f"gemv_{name}_m{M}_cfg_error"] = f"{cfg}: {type(e).__name__}: {e}"[:500]
                continue
            if t < best_t:
                best_cfg, best_t = cfg, t
        GEMV_CONFIGS[(next_pow2(M), N, K)] = best_cfg
        t_gemv = _ms(lambda: gemv(x, w, b, config=best_cfg))
        key = f"gemv_{name}_m{M}"
        r[f"{key}_ms"], r[f"{key}_gbps"] = t_gemv, _gbps(nbytes, t_gemv)
        r[f"cublas_{name}_m{M}_ms"], r[f"cublas_{name}_m{M}_gbps"] = t_cublas, _gbps(nbytes, t_cublas)
        r[f"{key}_vs_cublas"] = t_cublas / t_gemv  # > 1: the GEMV is faster
        r[f"{key}_config"] = f"{best_cfg}"
        reps = 1 if name == "lm_head" else LAYERS
        stack_gemv += reps * t_gemv
        stack_cublas += reps * t_cublas
        del w
    r[f"gemv_stack_m{M}_ms"] = stack_gemv  # 36 layers of qkv+o+gate_up+down, plus lm_head
    r[f"cublas_stack_m{M}_ms"] = stack_cublas
    r[f"gemv_stack_m{M}_vs_cublas"] = stack_cublas / stack_gemv
    return r


# ------------------------------------------------------------------------------ decode switches
def _graph_us(fn, calls: int) -> float:
    """Median µs per call of ``fn(i)`` for i in range(calls), captured back to back in one CUDA
    graph (as the engine runs decode steps: launch latency, ramp and tail included).
    Without CUDA (a smoke run on the interpreter): one eager pass, wall clock."""
    fn(0)  # compile outside the capture
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        for i in range(calls):
            fn(i)
        return (time.perf_counter() - t0) * 1e6 / calls
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    return _ms(graph.replay, warmup=10, rep=50) * 1e3 / calls


def _weight_copies(N: int, K: int, dtype, gen, min_bytes: float) -> list[torch.Tensor]:
    """Enough copies of an [N, K] weight to add up to ``min_bytes`` (2 to 16 of them), so that
    back-to-back calls in a graph read from HBM, not from the 50 MB L2."""
    es = torch.tensor([], dtype=dtype).element_size()
    n = max(2, min(16, math.ceil(min_bytes / (N * K * es))))
    return [torch.randn(N, K, device=gen.device, dtype=dtype, generator=gen) * K**-0.5 for _ in range(n)]


def bench_switches(dtype=torch.bfloat16, batches=(1, 8), shapes: dict = GEMV_SHAPES, device: str = "cuda",
                   min_bytes: float = 256e6) -> dict:
    """The TritonOps decode switches, each variant in a CUDA graph (``_graph_us``), figures in µs:

    - ``sw_gemv_<shape>_m<M>_{auto,never}_us``: every 3B linear, split-K heuristic vs one kernel
      (the heuristic, plus a small sweep of BLOCK_N / warps, best in ``..._never_best_*``);
    - ``sw_silu_down_m<M>_{unfused,fused}_us`` (and ``fused_never``): silu_and_mul + down GEMV
      vs ``silu_mul_gemv``;
    - ``sw_rope_kv_t<T>_{unfused,fused}_us``: rotary + write_kv vs ``rotary_write_kv``;
    - ``sw_layer_m<M>_saved_us_<switch>``: µs per decoder layer each switch saves (x36 per step).
    """
    dev = device
    g = torch.Generator(device=dev).manual_seed(0)
    sms = sm_count_for(torch.empty(1, device=dev))
    r: dict = {}
    for M in batches:
        for name, (N, K) in shapes.items():
            ws = _weight_copies(N, K, dtype, g, min_bytes)
            x = torch.randn(M, K, device=dev, dtype=dtype, generator=g)
            b = torch.randn(N, device=dev, dtype=dtype, generator=g) if name == "qkv" else None
            out = torch.empty(M, N, device=dev, dtype=dtype)
            key = f"sw_gemv_{name}_m{M}"
            auto = gemv_config(M, N, K, sms, "auto", use_tuned=False)
            never = gemv_config(M, N, K, sms, "never", use_tuned=False)
            sweep = {never, GemvConfig(never.block_n, never.block_k, 1, 8, never.num_stages, never.defer_reduce)}
            for bn in (never.block_n // 2, never.block_n * 2):
                if bn >= (1 if M == 1 else 4):
                    sweep.add(GemvConfig(bn, never.block_k, 1, 4, never.num_stages, never.defer_reduce))
            timed = {}
            for cfg in [auto, *sorted(sweep, key=str)]:
                try:
                    timed[cfg] = _graph_us(lambda i, c=cfg: gemv(x, ws[i % len(ws)], b, config=c, out=out), len(ws))
                except Exception as e:
                    r[f"{key}_error_{cfg.block_n}_{cfg.num_warps}"] = f"{type(e).__name__}: {e}"[:300]
            r[f"{key}_auto_us"], r[f"{key}_auto_config"] = timed.get(auto, math.nan), str(auto)
            r[f"{key}_never_us"], r[f"{key}_never_config"] = timed.get(never, math.nan), str(never)
            best = min((c for c in timed if c is not auto and c.split_k == 1), key=timed.get, default=None)
            if best is not None:
                r[f"{key}_never_best_us"], r[f"{key}_never_best_config"] = timed[best], str(best)
            nbytes = (N * K + M * K + M * N) * torch.tensor([], dtype=dtype).element_size()
            for v in ("auto", "never"):
                r[f"{key}_{v}_gbps"] = nbytes / r[f"{key}_{v}_us"] / 1e3
            del ws
        # SiLU·mul + down projection
        N, K = shapes["down"]
        ws = _weight_copies(N, K, dtype, g, min_bytes)
        gu = torch.randn(M, 2 * K, device=dev, dtype=dtype, generator=g)
        out = torch.empty(M, N, device=dev, dtype=dtype)
        act = torch.empty(M, K, device=dev, dtype=dtype)
        calls = len(ws)
        variants = {
            "unfused": lambda i: gemv(silu_and_mul(gu, out=act), ws[i % calls], out=out),
            "fused": lambda i: silu_mul_gemv(gu, ws[i % calls], out=out),
            "fused_never": lambda i: silu_mul_gemv(gu, ws[i % calls], out=out, split_k="never"),
        }
        for v, fn in variants.items():
            try:
                r[f"sw_silu_down_m{M}_{v}_us"] = _graph_us(fn, calls)
            except Exception as e:
                r[f"sw_silu_down_m{M}_{v}_error"] = f"{type(e).__name__}: {e}"[:300]
        del ws
        # RoPE + KV write, T = M decode tokens into a 3B-shaped cache
        T, bs = M, 16
        qkv = torch.randn(T, (HQ + 2 * HKV) * HEAD_DIM, device=dev, dtype=dtype, generator=g)
        q = qkv[:, : HQ * HEAD_DIM].view(T, HQ, HEAD_DIM)
        k = qkv[:, HQ * HEAD_DIM: (HQ + HKV) * HEAD_DIM].view(T, HKV, HEAD_DIM)
        v_ = qkv[:, (HQ + HKV) * HEAD_DIM:].view(T, HKV, HEAD_DIM)
        kc = torch.randn(1024, bs, HKV, HEAD_DIM, device=dev, dtype=dtype, generator=g)
        vc = torch.randn_like(kc)
        pos = torch.randint(0, 4096, (T,), device=dev, generator=g)
        slots = torch.randperm(1024 * bs, device=dev, generator=g)[:T]
        cs = rope_cos_sin(HEAD_DIM, 4096, 1e6, None, dev)

        def unfused(i):
            qr, kr = rotary(q, k, pos, cs)
            write_kv(kr, v_, kc, vc, slots)

        variants = {"unfused": unfused, "fused": lambda i: rotary_write_kv(q, k, v_, pos, cs, kc, vc, slots)}
        for v, fn in variants.items():
            try:
                r[f"sw_rope_kv_t{T}_{v}_us"] = _graph_us(fn, 16)
            except Exception as e:
                r[f"sw_rope_kv_t{T}_{v}_error"] = f"{type(e).__name__}: {e}"[:300]
        # per decoder layer: what each switch saves (positive = faster)
        layer = ("qkv", "o", "gate_up", "down")
        r[f"sw_layer_m{M}_saved_us_gemv_split_k_never"] = sum(
            r.get(f"sw_gemv_{n}_m{M}_auto_us", math.nan) - r.get(f"sw_gemv_{n}_m{M}_never_us", math.nan) for n in layer)
        r[f"sw_layer_m{M}_saved_us_fuse_silu_down"] = (r.get(f"sw_silu_down_m{M}_unfused_us", math.nan)
                                                       - r.get(f"sw_silu_down_m{M}_fused_us", math.nan))
        r[f"sw_layer_m{M}_saved_us_fuse_rope_kv"] = (r.get(f"sw_rope_kv_t{M}_unfused_us", math.nan)
                                                     - r.get(f"sw_rope_kv_t{M}_fused_us", math.nan))
    return r


BENCH_PARTS = ("ceilings", "elementwise", "decode_attn", "prefill_attn", "gemv", "switches")


def run_benchmarks(dtype=torch.bfloat16, tune_gemv: bool = True, gemv_batches=(1, 4, 8),
                   decode_batch: int = 64, decode_context: int = 2048, parts: tuple = BENCH_PARTS) -> dict:
    """All timings (CUDA only), or the named ``parts`` of ``BENCH_PARTS``. Failures are
    recorded as ``<part>_error`` and skipped."""
    figures: dict = {}
    table = [("ceilings", measure_ceilings), ("elementwise", lambda: bench_elementwise(dtype)),
             ("decode_attn", lambda: bench_decode_attention(decode_batch, decode_context, dtype)),
             ("prefill_attn", lambda: bench_prefill_attention(dtype))]
    table += [(f"gemv_m{m}", lambda m=m: bench_gemv(m, dtype, tune_gemv)) for m in gemv_batches]
    table += [("switches", lambda: bench_switches(dtype))]
    for part, fn in table:
        if ("gemv" if part.startswith("gemv_m") else part) not in parts:
            continue
        try:
            figures.update(fn())
        except Exception as e:
            figures[f"{part}_error"] = f"{type(e).__name__}: {e}"[:2000]
            traceback.print_exc()
        torch.cuda.synchronize()
    read = figures.get("read_gbps")
    if read:
        if "paged_decode_attn_gbps" in figures:
            figures["paged_decode_attn_bw_frac"] = figures["paged_decode_attn_gbps"] / read
        for k in list(figures):
            if k.endswith("_gbps") and not k.startswith(("read", "copy")):
                figures[k.removesuffix("_gbps") + "_read_frac"] = figures[k] / read
    if "matmul_bf16_tflops" in figures and "paged_prefill_attn_tflops" in figures:
        figures["paged_prefill_attn_mma_frac"] = figures["paged_prefill_attn_tflops"] / figures["matmul_bf16_tflops"]
    return figures


def summary_figures(check_results: dict, bench_results: dict, dtype=torch.bfloat16) -> dict:
    """The record's figures: ``<kernel>_rel_err`` in ``dtype`` (and ``<kernel>_<dtype>_rel_err`` for
    every dtype checked), ``checks_failed``, then every timing figure."""
    dn = DTYPE_NAMES[dtype]
    figures = {}
    for k, v in check_results.items():
        if k.endswith("_rel_err"):
            figures[k] = v
            if k.endswith(f"_{dn}_rel_err"):
                figures[k.removesuffix(f"_{dn}_rel_err") + "_rel_err"] = v
    figures["checks_failed"] = sum(1 for k, v in check_results.items() if k.endswith("_pass") and not v)
    figures.update({k: v for k, v in bench_results.items() if isinstance(v, (int, float))})
    return figures


def gbps_table(figures: dict) -> list[dict]:
    """Rows (kernel, GB/s, fraction of the read ceiling) for printing and plotting."""
    rows = []
    read = figures.get("read_gbps")
    for k, v in figures.items():
        if k.endswith("_gbps") and not k.startswith(("read", "copy")) and isinstance(v, (int, float)):
            name = k.removesuffix("_gbps")
            rows.append({"kernel": name, "gbps": v, "frac_of_read": v / read if read else None})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for kernels_bench.json")
    ap.add_argument("--no-tune", action="store_true", help="GEMV: heuristic config only, no sweep")
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--skip-bench", action="store_true")
    ap.add_argument("--parts", default=",".join(BENCH_PARTS),
                    help=f"comma-separated subset of {','.join(BENCH_PARTS)} (e.g. --parts switches)")
    args = ap.parse_args(argv)
    parts = tuple(p for p in args.parts.split(",") if p)
    unknown = set(parts) - set(BENCH_PARTS)
    if unknown:
        ap.error(f"unknown --parts {sorted(unknown)}; choose from {BENCH_PARTS}")
    os.makedirs(args.out, exist_ok=True)
    cuda = torch.cuda.is_available()
    record: dict = {"device": torch.cuda.get_device_name(0) if cuda else "cpu (interpreter)",
                    "torch": torch.__version__, "triton": triton.__version__}
    t0 = time.time()
    path = os.path.join(args.out, "kernels_bench.json")

    def save():
        record["elapsed_s"] = time.time() - t0
        with open(path, "w") as f:
            json.dump(record, f, indent=2, default=str)

    if not args.skip_checks:
        dtypes = (torch.bfloat16, torch.float16, torch.float32) if cuda else (torch.float32, torch.bfloat16)
        record["checks"] = run_checks(dtypes, full=cuda)
        save()
    if cuda and not args.skip_bench:
        record["bench"] = run_benchmarks(tune_gemv=not args.no_tune, parts=parts)
        record["gemv_tuned_configs"] = {str(k): str(v) for k, v in GEMV_CONFIGS.items()}
    save()

    checks_ = record.get("checks", {})
    failed = sorted(k.removesuffix("_pass") for k, v in checks_.items() if k.endswith("_pass") and not v)
    print(f"\n== checks: {sum(1 for k in checks_ if k.endswith('_pass'))} run, {len(failed)} failed: {failed}")
    for k, v in checks_.items():
        if k.endswith("_rel_err"):
            print(f"  {k:45s} {v:.3g}")
    bench = record.get("bench", {})
    if bench:
        print(f"\n== ceilings: copy {bench.get('copy_gbps', float('nan')):.0f} GB/s, read {bench.get('read_gbps', float('nan')):.0f} GB/s, "
              f"bf16 matmul {bench.get('matmul_bf16_tflops', float('nan')):.0f} TFLOP/s")
        for row in gbps_table(bench):
            frac = row["frac_of_read"]
            print(f"  {row['kernel']:32s} {row['gbps']:8.0f} GB/s  {'' if frac is None else f'{frac:6.1%}'}")
        for k, v in bench.items():
            if k.endswith(("_vs_cublas", "_stack_m1_ms", "_bw_frac", "_tflops", "_mma_frac", "_error", "_config")):
                print(f"  {k:40s} {v}")
        switches = {k: v for k, v in bench.items() if k.startswith("sw_") and k.endswith("_us")}
        if switches:
            print("\n== decode switches (µs per call in a CUDA graph; saved_us: per layer, x36 per step)")
            for k, v in switches.items():
                print(f"  {k:45s} {v:8.2f}")
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
