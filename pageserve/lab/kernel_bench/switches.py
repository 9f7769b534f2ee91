"""The TritonOps decode switches measured kernel by kernel: split-K or not, SiLU·mul fused into
the down GEMV, RoPE fused with the KV write; µs per call in a CUDA graph."""
from __future__ import annotations

import math

import torch

from ...kernels.activation import silu_and_mul
from ...kernels.gemv import GemvConfig, gemv, gemv_config, silu_mul_gemv
from ...kernels.kv_write import write_kv
from ...kernels._util import sm_count_for
from ...kernels.rope_kv import rotary_write_kv
from ...kernels.rotary import rotary
from ...model.ops import rope_cos_sin
from .shapes import GEMV_SHAPES, HEAD_DIM, HKV, HQ
from .timing import graph_us, weight_copies


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
            ws = weight_copies(N, K, dtype, g, min_bytes)
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
                    timed[cfg] = graph_us(lambda i, c=cfg: gemv(x, ws[i % len(ws)], b, config=c, out=out), len(ws))
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
        ws = weight_copies(N, K, dtype, g, min_bytes)
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
                r[f"sw_silu_down_m{M}_{v}_us"] = graph_us(fn, calls)
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
                r[f"sw_rope_kv_t{T}_{v}_us"] = graph_us(fn, 16)
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
