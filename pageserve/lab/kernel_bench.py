"""Correctness at full size and speed against the measured ceilings, for every kernel.

On the H200: ``python -m pageserve.lab.kernel_bench --out <dir>`` runs the checks in bf16, fp16
and fp32 at the 3B shapes, measures the ceilings (device-to-device copy, a pure read, a bf16
matmul; eager ``triton.testing.do_bench``) and times every kernel as GPU time: calls back to
back in one CUDA graph, replays timed with CUDA events (``graph_ms``), since the engine runs
the decode kernels in graphs and an eager launch from Python costs more than a small kernel
(inputs larger than L2, or weights rotated through copies). Bytes are counted as the fewest
the kernel must move: each input read once, each output written once. A failing kernel is
recorded and the run goes on. Writes ``<dir>/kernels_bench.json`` and prints a table.
``--parts sweep_m1`` runs the GEMV config sweep at M = 1 (``sweep_gemv_m1``).

The notebook 05_triton_kernels calls the same functions.
"""
from __future__ import annotations

import argparse
import dataclasses
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

from . import kernel_checks as checks  # noqa: E402
from ..kernels.activation import silu_and_mul  # noqa: E402
from ..kernels.gemv import GemvConfig, config_key, gemv, gemv_config, silu_mul_gemv, silu_mul_linear_reference  # noqa: E402
from ..kernels.kv_write import write_kv  # noqa: E402
from ..kernels.norm import add_rms_norm, rms_norm  # noqa: E402
from ..kernels.paged_decode import MAX_SPLITS, decode_num_splits, paged_decode_attention  # noqa: E402
from ..kernels.paged_prefill import paged_prefill_attention  # noqa: E402
from ..kernels.rope_kv import rotary_write_kv  # noqa: E402
from ..kernels.rotary import rotary  # noqa: E402
from ..kernels._util import cdiv, sm_count_for, use_pdl  # noqa: E402
from ..model.ops import rope_cos_sin  # noqa: E402

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
    """Eager: median ms of ``fn()`` launched from Python (do_bench flushes L2 before each call).
    Right for the ceilings (large ops); for a small kernel it measures Triton's launch path."""
    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


class CaptureFailed(RuntimeError):
    """The calls could not be captured in a CUDA graph."""


def graph_ms(fn, calls: int = 20, replays: int = 20) -> float:
    """Median ms per call of ``fn(i)`` for i in range(calls), captured back to back in one CUDA
    graph and replayed ``replays`` times, each replay timed with CUDA events. This is GPU time
    as the engine's graphed decode step sees it: no Python launch cost, but each kernel's ramp
    and tail and the gaps between dependent kernels. ``fn(0)`` runs once first, outside the
    graph (compiles, allocates); its errors propagate as they are, a failed capture raises
    ``CaptureFailed``. ``fn(i)`` may rotate inputs (``_weight_copies``) so that back-to-back
    calls read from HBM, not from L2. Without CUDA (a smoke run on the interpreter): one eager
    pass, wall clock."""
    fn(0)
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        for i in range(calls):
            fn(i)
        return (time.perf_counter() - t0) * 1e3 / calls
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for i in range(calls):
                fn(i)
    except Exception as e:
        raise CaptureFailed(f"{type(e).__name__}: {e}") from e
    for _ in range(2):  # the first replays upload the graph
        graph.replay()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    per_replay = sorted(start.elapsed_time(end) for start, end in events)
    del graph
    return per_replay[len(per_replay) // 2] / calls


def timed_ms(r: dict, name: str, fn, calls: int = 20) -> float:
    """``graph_ms``, or, if the capture fails, the eager ``_ms`` of ``fn(0)``, recorded in ``r``
    as ``<name>_timing: "eager"`` (with the capture error) so the figure is not read as GPU time."""
    try:
        return graph_ms(fn, calls)
    except CaptureFailed as e:
        r[f"{name}_timing"] = "eager"
        r[f"{name}_capture_error"] = str(e)[:300]
        return _ms(lambda: fn(0))


def _graph_us(fn, calls: int) -> float:
    return graph_ms(fn, calls) * 1e3


def _weight_copies(N: int, K: int, dtype, gen, min_bytes: float) -> list[torch.Tensor]:
    """Enough copies of an [N, K] weight to add up to ``min_bytes`` (2 to 16 of them), so that
    back-to-back calls in a graph read from HBM, not from the 50 MB L2."""
    es = torch.tensor([], dtype=dtype).element_size()
    n = max(2, min(16, math.ceil(min_bytes / (N * K * es))))
    return [torch.randn(N, K, device=gen.device, dtype=dtype, generator=gen) * K**-0.5 for _ in range(n)]


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


def bench_elementwise(dtype=torch.bfloat16, calls: int = 10) -> dict:
    """The elementwise kernels at prefill sizes (every input 64 MB or more, past the L2),
    ``calls`` back to back in a CUDA graph (``timed_ms``)."""
    es = torch.tensor([], dtype=dtype).element_size()
    dev, g = "cuda", torch.Generator(device="cuda").manual_seed(0)
    r = {}

    def rn(*shape):
        return torch.randn(*shape, device=dev, dtype=dtype, generator=g)

    T = 16384
    x, res, w = rn(T, HIDDEN), rn(T, HIDDEN), rn(HIDDEN)
    t = timed_ms(r, "rms_norm", lambda i: rms_norm(x, w, 1e-6), calls)
    r["rms_norm_ms"], r["rms_norm_gbps"] = t, _gbps((2 * T * HIDDEN + HIDDEN) * es, t)
    t = timed_ms(r, "add_rms_norm", lambda i: add_rms_norm(x, res, w, 1e-6), calls)
    r["add_rms_norm_ms"], r["add_rms_norm_gbps"] = t, _gbps((4 * T * HIDDEN + HIDDEN) * es, t)
    del x, res
    T2 = 8192
    gu = rn(T2, 2 * INTER)
    t = timed_ms(r, "silu_and_mul", lambda i: silu_and_mul(gu), calls)
    r["silu_and_mul_ms"], r["silu_and_mul_gbps"] = t, _gbps(3 * T2 * INTER * es, t)
    del gu
    qkv = rn(T, (HQ + 2 * HKV) * HEAD_DIM)
    q = qkv[:, : HQ * HEAD_DIM].view(T, HQ, HEAD_DIM)
    k = qkv[:, HQ * HEAD_DIM: (HQ + HKV) * HEAD_DIM].view(T, HKV, HEAD_DIM)
    pos = torch.randint(0, 32768, (T,), device=dev, generator=g)
    cs = rope_cos_sin(HEAD_DIM, 32768, 1e6, None, dev)
    t = timed_ms(r, "rotary", lambda i: rotary(q, k, pos, cs), calls)
    nbytes = 2 * T * (HQ + HKV) * HEAD_DIM * es + T * HEAD_DIM * 4 + T * 8
    r["rotary_ms"], r["rotary_gbps"] = t, _gbps(nbytes, t)
    # RoPE fused with the KV write: reads q, k, v, writes rotated q, k and the cache's k, v rows
    v = qkv[:, (HQ + HKV) * HEAD_DIM:].view(T, HKV, HEAD_DIM)
    kc = torch.empty(T // 16 + 64, 16, HKV, HEAD_DIM, device=dev, dtype=dtype)
    vc = torch.empty_like(kc)
    slots = torch.randperm(kc.shape[0] * 16, device=dev, generator=g)[:T]
    t = timed_ms(r, "rotary_write_kv", lambda i: rotary_write_kv(q, k, v, pos, cs, kc, vc, slots), calls)
    nbytes = (T * (HQ + 2 * HKV) + T * (HQ + HKV) + 2 * T * HKV) * HEAD_DIM * es + T * HEAD_DIM * 4 + T * 16
    r["rotary_write_kv_ms"], r["rotary_write_kv_gbps"] = t, _gbps(nbytes, t)
    del qkv, q, k, v, kc, vc
    T3, bs = 65536, 16
    kk, vv = rn(T3, HKV, HEAD_DIM), rn(T3, HKV, HEAD_DIM)
    nb = T3 // bs + 64
    kc = torch.empty(nb, bs, HKV, HEAD_DIM, device=dev, dtype=dtype)
    vc = torch.empty_like(kc)
    slots = torch.randperm(nb * bs, device=dev, generator=g)[:T3]
    slots[::97] = -1
    t = timed_ms(r, "write_kv", lambda i: write_kv(kk, vv, kc, vc, slots), calls)
    written = int((slots >= 0).sum())
    r["write_kv_ms"], r["write_kv_gbps"] = t, _gbps(2 * written * HKV * HEAD_DIM * es * 2 + T3 * 8, t)
    return r


DECODE_DEFAULT = dict(block_n=64, num_warps=4, num_stages=2)  # paged_decode_attention's defaults
DECODE_SWEEP = dict(block_n=(16, 32, 64, 128), num_warps=(2, 4, 8), num_stages=(1, 2, 3))


def decode_split_choices(auto: int) -> list[int]:
    """num_splits values the sweep tries: the auto value, 2x, 3x, 4x, and 8, 16, 32 (all <= MAX_SPLITS)."""
    return sorted({min(MAX_SPLITS, s) for s in (auto, 2 * auto, 3 * auto, 4 * auto, 8, 16, 32)})


def _decode_config_str(cfg: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in cfg.items())


def bench_decode_attention(batch=64, ctx=2048, dtype=torch.bfloat16, block_size=16, calls: int = 20,
                           sweep: bool = True, sweep_budget_s: float = 35.0, device: str = "cuda") -> dict:
    """Decode attention at ``batch`` x ``ctx`` (the KV, 134 MB at the defaults, is past the L2),
    ``calls`` back to back in a CUDA graph. ``paged_decode_attn_{ms,gbps}`` (and so
    ``paged_decode_attn_bw_frac``) are the default configuration, what the engine runs;
    ``paged_decode_attn_eager_ms`` is the same call launched from Python, for comparison.

    The sweep, in two rounds to keep compiles (~1 s each) down: each knob alone from the
    default (num_splits from ``decode_split_choices``, then ``DECODE_SWEEP``), then every
    combination of the two best num_splits, block_n and num_warps at the best num_stages.
    It stops at ``sweep_budget_s``. Records the best (``paged_decode_attn_best_*``, config as
    keywords of ``paged_decode_attention``) and the five fastest (``paged_decode_attn_top5``)."""
    es = torch.tensor([], dtype=dtype).element_size()
    gen = torch.Generator().manual_seed(0)
    q, _, _, kc, vc, meta = checks.random_paged_batch([1] * batch, [ctx] * batch, HQ, HKV, HEAD_DIM, block_size,
                                                      dtype, device, gen)
    out = torch.empty_like(q)
    scale = HEAD_DIM**-0.5
    nbytes = (2 * batch * ctx * HKV * HEAD_DIM * es + 2 * q.numel() * es
              + meta.block_tables.numel() * 4 + batch * 4)
    splits = decode_num_splits(batch, HKV, meta.block_tables.shape[1], block_size, sm_count_for(q))

    def attn(cfg: dict):
        return lambda i: paged_decode_attention(q, kc, vc, meta.seq_lens, meta.block_tables, scale, out=out, **cfg)

    r: dict = {}
    t = timed_ms(r, "paged_decode_attn", attn({}), calls)  # the default, as the engine calls it
    r.update({"paged_decode_attn_ms": t, "paged_decode_attn_gbps": _gbps(nbytes, t),
              "paged_decode_attn_splits": splits})
    if torch.cuda.is_available():
        r["paged_decode_attn_eager_ms"] = _ms(lambda: attn({})(0))
    if not sweep:
        return r
    default = {"num_splits": splits, **DECODE_DEFAULT}
    timed, failed = {tuple(default.items()): t}, set()
    t0 = time.perf_counter()

    def run(cfg: dict):
        key = tuple(cfg.items())
        if key in timed or key in failed:
            return
        if time.perf_counter() - t0 > sweep_budget_s:  # count what the budget left out
            r["paged_decode_attn_sweep_skipped"] = r.get("paged_decode_attn_sweep_skipped", 0) + 1
            return
        try:
            timed[key] = graph_ms(attn(cfg), calls, replays=10)
        except Exception as e:  # out of resources, a failed capture: skip the config
            failed.add(key)
            r[f"paged_decode_attn_sweep_error_{_decode_config_str(cfg).replace(' ', '_')}"] = \
                f"{type(e).__name__}: {e}"[:300]

    axes = {"num_splits": decode_split_choices(splits), **DECODE_SWEEP}
    for axis, values in axes.items():  # round 1: one knob at a time
        for v in values:
            run({**default, axis: v})

    def best_values(axis: str, n: int) -> list:
        return sorted(axes[axis], key=lambda v: timed.get(tuple({**default, axis: v}.items()), math.inf))[:n]

    stages = best_values("num_stages", 1)[0]
    for sp in best_values("num_splits", 2):  # round 2: the two best of the knobs that interact
        for bn in best_values("block_n", 2):
            for nw in best_values("num_warps", 2):
                run({"num_splits": sp, "block_n": bn, "num_warps": nw, "num_stages": stages})
    ranked = sorted(timed.items(), key=lambda kv: kv[1])
    r["paged_decode_attn_sweep_configs"] = len(timed)
    r["paged_decode_attn_sweep_s"] = time.perf_counter() - t0
    (best_cfg, best_t) = ranked[0]
    r["paged_decode_attn_best_ms"], r["paged_decode_attn_best_config"] = best_t, _decode_config_str(dict(best_cfg))
    r["paged_decode_attn_best_gbps"] = _gbps(nbytes, best_t)
    r["paged_decode_attn_top5"] = [{"config": _decode_config_str(dict(c)), "ms": tc, "gbps": _gbps(nbytes, tc)}
                                   for c, tc in ranked[:5]]
    return r


def bench_prefill_attention(dtype=torch.bfloat16, calls: int = 5) -> dict:
    """Four 2,048-token chunks, two of them over a 2,048-token cached prefix: compute-bound."""
    gen = torch.Generator().manual_seed(0)
    q_lens, ctx = [2048] * 4, [2048, 4096, 2048, 4096]
    q, _, _, kc, vc, meta = checks.random_paged_batch(q_lens, ctx, HQ, HKV, HEAD_DIM, 16, dtype, "cuda", gen)
    out = torch.empty_like(q)
    r: dict = {}
    t = timed_ms(r, "paged_prefill_attn", lambda i: paged_prefill_attention(q, kc, vc, meta, HEAD_DIM**-0.5, out=out),
                 calls)
    pairs = sum(n * (c - n) + n * (n + 1) // 2 for n, c in zip(q_lens, ctx))
    flops = 4 * HQ * HEAD_DIM * pairs
    r.update({"paged_prefill_attn_ms": t, "paged_prefill_attn_tflops": flops / t / 1e9})
    return r


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


def bench_gemv(M: int = 1, dtype=torch.bfloat16, tune: bool = True, min_bytes: float = 256e6,
               shapes: dict = GEMV_SHAPES, device: str = "cuda", tuned: dict | None = None) -> dict:
    """Each 3B linear at batch M: the GEMV (tuned over ``gemv_candidates``, best kept in
    into ``tuned`` under ``config_key`` when given) against torch.nn.functional.linear (cuBLAS). Both timed the same way: calls
    back to back in a CUDA graph (``timed_ms``), each call on the next of ``_weight_copies``
    so the weights stream from HBM as they do in a decode step."""
    es = torch.tensor([], dtype=dtype).element_size()
    g = torch.Generator(device=device).manual_seed(0)
    sms = sm_count_for(torch.empty(1, device=device))
    r: dict = {}
    stack_gemv = stack_cublas = 0.0
    for name, (N, K) in shapes.items():
        key = f"gemv_{name}_m{M}"
        ws = _weight_copies(N, K, dtype, g, min_bytes)
        calls = max(8, len(ws))
        x = torch.randn(M, K, device=device, dtype=dtype, generator=g)
        b = torch.randn(N, device=device, dtype=dtype, generator=g) if name == "qkv" else None
        out = torch.empty(M, N, device=device, dtype=dtype)
        nbytes = (N * K + M * K + M * N + (N if b is not None else 0)) * es

        def run(cfg):
            return lambda i: gemv(x, ws[i % len(ws)], b, config=cfg, out=out)

        t_cublas = timed_ms(r, f"cublas_{name}_m{M}",
                            lambda i: torch.nn.functional.linear(x, ws[i % len(ws)], b), calls)
        heuristic = gemv_config(M, N, K, sms)
        timed = {}
        for cfg in gemv_candidates(M, N, K, sms) if tune else [heuristic]:
            try:
                timed[cfg] = graph_ms(run(cfg), calls, replays=10)
            except Exception as e:  # a config that does not compile (or capture) is skipped
                r[f"{key}_cfg_error"] = f"{cfg}: {type(e).__name__}: {e}"[:500]
        if not timed:
            raise RuntimeError(f"{key}: no GEMV config ran (last error: {r.get(f'{key}_cfg_error')})")
        best_cfg = min(timed, key=timed.get)
        if tuned is not None:
            tuned[config_key(M, N, K)] = best_cfg
        t_gemv = timed_ms(r, key, run(best_cfg), calls)
        r[f"{key}_ms"], r[f"{key}_gbps"] = t_gemv, _gbps(nbytes, t_gemv)
        if heuristic in timed:
            r[f"{key}_heuristic_ms"] = timed[heuristic]
        r[f"cublas_{name}_m{M}_ms"], r[f"cublas_{name}_m{M}_gbps"] = t_cublas, _gbps(nbytes, t_cublas)
        r[f"{key}_vs_cublas"] = t_cublas / t_gemv  # > 1: the GEMV is faster
        r[f"{key}_config"] = repr(best_cfg)
        reps = 1 if name == "lm_head" else LAYERS
        stack_gemv += reps * t_gemv
        stack_cublas += reps * t_cublas
        del ws
    r[f"gemv_stack_m{M}_ms"] = stack_gemv  # 36 layers of qkv+o+gate_up+down, plus lm_head
    r[f"cublas_stack_m{M}_ms"] = stack_cublas
    r[f"gemv_stack_m{M}_vs_cublas"] = stack_cublas / stack_gemv
    return r


# ------------------------------------------------------------------------------ decode switches
def bench_switches(dtype=torch.bfloat16, batches=(1, 8), shapes: dict = GEMV_SHAPES, device: str = "cuda",
                   min_bytes: float = 256e6, configs: dict | None = None) -> dict:
    """The TritonOps decode switches, each variant in a CUDA graph (``graph_ms``), figures in µs:

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
            auto = gemv_config(M, N, K, sms, "auto")
            never = gemv_config(M, N, K, sms, "never")
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
            "unfused": lambda i: gemv(silu_and_mul(gu, out=act), ws[i % calls], out=out, configs=configs),
            "fused": lambda i: silu_mul_gemv(gu, ws[i % calls], out=out, configs=configs),
            "fused_never": lambda i: silu_mul_gemv(gu, ws[i % calls], out=out, split_k="never", configs=configs),
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


# ------------------------------------------------------------------------------ GEMV M = 1 sweep
M1_SWEEP = dict(block_n=(1, 2, 4, 8, 16, 32, 64), block_k=(256, 512, 1024), split_k=(1, 2, 4),
                num_warps=(2, 4, 8), num_stages=(2, 3, 4))


def m1_sweep_space(N: int, K: int, sms: int, elem_bytes: int = 2) -> list[GemvConfig]:
    """The M = 1 configs worth a compile (num_stages 3; ``sweep_gemv_m1`` varies it last):

    - 16 to 64 weight elements per thread in a [BLOCK_N, BLOCK_K] tile (at least two 16-byte
      loads each, at most 64 registers of weights);
    - split_k > 1 only while the rows alone give under 4 programs per SM, and only where the
      launch really makes that many splits (else it repeats a smaller split);
    - 1 to 128 programs per SM, each streaming at least 8 KB of weights;
    - ``defer_reduce`` where the [BLOCK_N, BLOCK_K] fp32 accumulator fits in 32 registers a
      thread (the heuristic's rule), plain per-tile reduction above.
    """
    cands = []
    for bn in M1_SWEEP["block_n"]:
        rows = cdiv(N, bn)
        for bk in M1_SWEEP["block_k"]:
            for nw in M1_SWEEP["num_warps"]:
                per_thread = bn * bk // (32 * nw)
                if not 16 <= per_thread <= 64:
                    continue
                for split in M1_SWEEP["split_k"]:
                    k_per_split = cdiv(cdiv(K, split), bk) * bk
                    if split > 1 and (rows >= 4 * sms or cdiv(K, k_per_split) != split):
                        continue
                    if not sms <= rows * split <= 128 * sms or bn * k_per_split * elem_bytes < 8192:
                        continue
                    cands.append(GemvConfig(bn, bk, split, nw, 3, defer_reduce=per_thread <= 32))
    return cands


def m1_sweep_rounds(space: list[GemvConfig]) -> tuple[list[GemvConfig], dict]:
    """The sweep's rounds over ``space``: round 1 is one config per grid shape (block_n, split_k),
    the one closest to a [BLOCK_N, 512] tile at 32 elements a thread; round 2 (the ``groups``
    returned) is every config of the three fastest grid shapes; round 3 varies num_stages."""
    groups: dict = {}
    for c in space:
        groups.setdefault((c.block_n, c.split_k), []).append(c)

    def typical(c: GemvConfig):
        return abs(math.log2(c.block_k / 512)), abs(math.log2(c.block_n * c.block_k / (32 * c.num_warps) / 32))

    return [min(cs, key=typical) for cs in groups.values()], groups


def _sweep_m1_target(r: dict, p: str, N: int, K: int, silu: bool, bias: bool, dtype, gen, sms: int,
                     allot_s: float, min_bytes: float, replays: int, device: str) -> GemvConfig | None:
    """One target of ``sweep_gemv_m1``: its figures into ``r`` under prefix ``p``; the best config."""
    t0 = time.perf_counter()
    es = torch.tensor([], dtype=dtype).element_size()
    ws = _weight_copies(N, K, dtype, gen, min_bytes)
    calls = max(8, len(ws))
    out = torch.empty(1, N, device=device, dtype=dtype)
    x = torch.randn(1, 2 * K if silu else K, device=device, dtype=dtype, generator=gen)  # gate|up for silu
    b = torch.randn(N, device=device, dtype=dtype, generator=gen) if bias else None
    if silu:
        def run(cfg):
            return lambda i: silu_mul_gemv(x, ws[i % len(ws)], config=cfg, out=out)

        def torch_fn(i):
            return silu_mul_linear_reference(x, ws[i % len(ws)])
    else:
        def run(cfg):
            return lambda i: gemv(x, ws[i % len(ws)], b, config=cfg, out=out)

        def torch_fn(i):
            return torch.nn.functional.linear(x, ws[i % len(ws)], b)
    nbytes = (N * K + x.numel() + N + (N if b is not None else 0)) * es
    t_torch = timed_ms(r, f"{p}_cublas", torch_fn, calls) * 1e3
    r[f"{p}_cublas_us"], r[f"{p}_cublas_gbps"] = t_torch, nbytes / t_torch / 1e3
    timed: dict = {}  # config -> µs per call
    failed: dict = {}  # config -> error

    def time_config(cfg: GemvConfig, budgeted: bool = True) -> None:
        if cfg in timed or cfg in failed:
            return
        if budgeted and time.perf_counter() - t0 > allot_s:
            r[f"{p}_skipped"] = r.get(f"{p}_skipped", 0) + 1
            return
        try:
            timed[cfg] = graph_ms(run(cfg), calls, replays) * 1e3
        except Exception as e:  # does not compile, out of resources, no capture: skip it
            failed[cfg] = f"{cfg}: {type(e).__name__}: {e}"[:300]

    heuristic = gemv_config(1, N, K, sms, "auto")
    never = gemv_config(1, N, K, sms, "never")
    time_config(heuristic, budgeted=False)
    time_config(never, budgeted=False)
    first, groups = m1_sweep_rounds(m1_sweep_space(N, K, sms, es))
    for cfg in first:  # round 1: one config per grid shape
        time_config(cfg)
    grid_rank = sorted({(c.block_n, c.split_k) for c in timed if (c.block_n, c.split_k) in groups},
                       key=lambda s: min(t for c, t in timed.items() if (c.block_n, c.split_k) == s))
    for grid in grid_rank[:3]:  # round 2: every tile of the three fastest grid shapes
        for cfg in groups[grid]:
            time_config(cfg)
    for cfg in sorted(timed, key=timed.get)[:2]:  # round 3: num_stages of the two fastest
        for ns in M1_SWEEP["num_stages"]:
            time_config(dataclasses.replace(cfg, num_stages=ns))
    r[f"{p}_configs_timed"], r[f"{p}_configs_failed"] = len(timed), len(failed)
    if failed:
        r[f"{p}_first_error"] = next(iter(failed.values()))
    for label, cfg in (("heuristic", heuristic), ("never", never)):
        r[f"{p}_{label}_config"] = repr(cfg)
        if cfg in timed:
            r[f"{p}_{label}_us"] = timed[cfg]
    if heuristic in timed:
        r[f"{p}_heuristic_gbps"] = nbytes / timed[heuristic] / 1e3
    best = min(timed, key=timed.get, default=None)
    if best is not None:
        t_best = graph_ms(run(best), calls) * 1e3  # again, with the full replay count
        r[f"{p}_best_config"], r[f"{p}_best_us"], r[f"{p}_best_gbps"] = repr(best), t_best, nbytes / t_best / 1e3
        r[f"{p}_best_vs_cublas"] = t_torch / t_best
        if heuristic in timed:
            r[f"{p}_best_vs_heuristic"] = timed[heuristic] / timed[best]
        r[f"{p}_top5"] = [{"config": repr(c), "us": t, "gbps": nbytes / t / 1e3}
                          for c, t in sorted(timed.items(), key=lambda ct: ct[1])[:5]]
    r[f"{p}_sweep_s"] = time.perf_counter() - t0
    return best


def sweep_gemv_m1(dtype=torch.bfloat16, budget_s: float = 100.0, min_bytes: float = 256e6,
                  shapes: dict = GEMV_SHAPES, device: str = "cuda", replays: int = 10,
                  tuned: dict | None = None) -> dict:
    """GemvConfig sweep at M = 1 for every 3B linear, and for ``silu_mul_gemv`` on the down
    shape (``silu_down``), each config timed in a CUDA graph with the weights rotated out of L2
    (``graph_ms``), in three rounds over ``m1_sweep_space`` (``m1_sweep_rounds``). Compiles
    dominate (~35 configs a target, ~0.5 s each, fewer where shapes share kernels); each target
    gets an equal share of what is left of ``budget_s``, and configs past it are counted in
    ``_skipped`` (the heuristic configs are always timed). Compile errors, out-of-resources and
    failed captures skip the config; a target that fails as a whole records ``_error``.

    Per target ``sweep_m1_<shape>_``: ``best_config`` (a GemvConfig repr),
    ``best_us`` / ``best_gbps``, ``heuristic_{config,us,gbps}`` (``split_k="auto"``, the default),
    ``never_{config,us}``, ``cublas_us`` / ``cublas_gbps`` (torch: F.linear; for silu_down
    TorchOps.silu_mul_linear), ``best_vs_cublas`` and ``best_vs_heuristic`` (> 1: best is faster),
    ``top5``, ``key`` and counts. ``sweep_m1_gemv_configs`` maps ``str(config_key)`` to the best
    config (``kernels.parse_configs`` reads it back); the bests also go into ``tuned`` when given."""
    gen = torch.Generator(device=device).manual_seed(0)
    sms = sm_count_for(torch.empty(1, device=device))
    targets = [(name, N, K, False) for name, (N, K) in shapes.items()] + [("silu_down", *shapes["down"], True)]
    r: dict = {}
    best_configs: dict = {}
    t_start = time.perf_counter()
    for done, (name, N, K, silu) in enumerate(targets):
        p = f"sweep_m1_{name}"
        key = config_key(1, N, K, silu)
        r[f"{p}_key"] = str(key)
        allot_s = (budget_s - (time.perf_counter() - t_start)) / (len(targets) - done)  # what is left, shared
        try:
            best = _sweep_m1_target(r, p, N, K, silu, name == "qkv", dtype, gen, sms, allot_s, min_bytes, replays,
                                    device)
        except Exception as e:  # e.g. out of memory: keep the other targets
            r[f"{p}_error"] = f"{type(e).__name__}: {e}"[:500]
            traceback.print_exc()
            continue
        if best is not None:
            if tuned is not None:
                tuned[key] = best
            best_configs[str(key)] = repr(best)
    r["sweep_m1_gemv_configs"] = best_configs
    r["sweep_m1_elapsed_s"] = time.perf_counter() - t_start
    return r


BENCH_PARTS = ("ceilings", "elementwise", "decode_attn", "prefill_attn", "gemv", "switches", "sweep_m1")
DEFAULT_PARTS = BENCH_PARTS[:-1]  # sweep_m1 (~2 min of compiles) only when asked for


def run_benchmarks(dtype=torch.bfloat16, tune_gemv: bool = True, gemv_batches=(1, 4, 8),
                   decode_batch: int = 64, decode_context: int = 2048, parts: tuple = DEFAULT_PARTS,
                   tuned: dict | None = None) -> dict:
    """The named ``parts`` of ``BENCH_PARTS`` (CUDA only; default: all but sweep_m1). Failures
    are recorded as ``<part>_error`` and skipped. Kernel timings are GPU time, calls back to
    back in a CUDA graph (``graph_ms``); only the ceilings are timed eagerly. The GEMV parts put
    their best configs into ``tuned`` (``config_key -> GemvConfig``), which the later parts use."""
    tuned = {} if tuned is None else tuned
    # 1: kernels over at most PDL_MAX_TOKENS rows launch with PDL (the M <= 8 GEMVs; not batch 64)
    figures: dict = {"pdl_launch": int(use_pdl(torch.empty(0, device="cuda"), 1))}
    table = [("ceilings", measure_ceilings), ("elementwise", lambda: bench_elementwise(dtype)),
             ("decode_attn", lambda: bench_decode_attention(decode_batch, decode_context, dtype)),
             ("prefill_attn", lambda: bench_prefill_attention(dtype))]
    table += [(f"gemv_m{m}", lambda m=m: bench_gemv(m, dtype, tune_gemv, tuned=tuned)) for m in gemv_batches]
    table += [("switches", lambda: bench_switches(dtype, configs=tuned)),
              ("sweep_m1", lambda: sweep_gemv_m1(dtype, tuned=tuned))]
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
        if "paged_decode_attn_gbps" in figures:  # the default configuration (the engine's), not the sweep's best
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
    ap.add_argument("--out", required=True, help="folder for the JSON (--json)")
    ap.add_argument("--no-tune", action="store_true", help="GEMV: heuristic config only, no sweep")
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--skip-bench", action="store_true")
    ap.add_argument("--parts", default=",".join(DEFAULT_PARTS),
                    help=f"comma-separated subset of {','.join(BENCH_PARTS)} (default: all but sweep_m1; "
                         "e.g. --parts switches, --parts sweep_m1)")
    ap.add_argument("--json", default="kernels_bench.json", help="file name under --out (default: %(default)s)")
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
    path = os.path.join(args.out, args.json)

    def save():
        record["elapsed_s"] = time.time() - t0
        with open(path, "w") as f:
            json.dump(record, f, indent=2, default=str)

    if not args.skip_checks:
        dtypes = (torch.bfloat16, torch.float16, torch.float32) if cuda else (torch.float32, torch.bfloat16)
        record["checks"] = run_checks(dtypes, full=cuda)
        save()
    if cuda and not args.skip_bench:
        tuned: dict = {}
        record["bench"] = run_benchmarks(tune_gemv=not args.no_tune, parts=parts, tuned=tuned)
        record["gemv_tuned_configs"] = {str(k): repr(v) for k, v in tuned.items()}
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
        sweep = [k.removesuffix("_best_us") for k in bench if k.startswith("sweep_m1_") and k.endswith("_best_us")]
        if sweep:
            print("\n== GEMV M=1 sweep (µs per call in a CUDA graph, weights rotated out of L2)")
            for p in sweep:
                print(f"  {p.removeprefix('sweep_m1_'):10s} best {bench[p + '_best_us']:7.2f}  "
                      f"heuristic {bench.get(p + '_heuristic_us', math.nan):7.2f}  "
                      f"torch {bench.get(p + '_cublas_us', math.nan):7.2f}  {bench[p + '_best_config']}")
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
