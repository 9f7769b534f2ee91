"""Kernels timed at their engine defaults: the elementwise kernels at prefill sizes (GB/s) and
prefill attention (TFLOP/s)."""
from __future__ import annotations

import torch

from .. import kernel_checks as checks
from ...kernels.activation import silu_and_mul
from ...kernels.kv_write import write_kv
from ...kernels.norm import add_rms_norm, rms_norm
from ...kernels.paged_prefill import paged_prefill_attention
from ...kernels.rope_kv import rotary_write_kv
from ...kernels.rotary import rotary
from ...model.ops import rope_cos_sin
from .shapes import HEAD_DIM, HIDDEN, HKV, HQ, INTER
from .timing import gbps, timed_ms


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
    r["rms_norm_ms"], r["rms_norm_gbps"] = t, gbps((2 * T * HIDDEN + HIDDEN) * es, t)
    t = timed_ms(r, "add_rms_norm", lambda i: add_rms_norm(x, res, w, 1e-6), calls)
    r["add_rms_norm_ms"], r["add_rms_norm_gbps"] = t, gbps((4 * T * HIDDEN + HIDDEN) * es, t)
    del x, res
    T2 = 8192
    gu = rn(T2, 2 * INTER)
    t = timed_ms(r, "silu_and_mul", lambda i: silu_and_mul(gu), calls)
    r["silu_and_mul_ms"], r["silu_and_mul_gbps"] = t, gbps(3 * T2 * INTER * es, t)
    del gu
    qkv = rn(T, (HQ + 2 * HKV) * HEAD_DIM)
    q = qkv[:, : HQ * HEAD_DIM].view(T, HQ, HEAD_DIM)
    k = qkv[:, HQ * HEAD_DIM: (HQ + HKV) * HEAD_DIM].view(T, HKV, HEAD_DIM)
    pos = torch.randint(0, 32768, (T,), device=dev, generator=g)
    cs = rope_cos_sin(HEAD_DIM, 32768, 1e6, None, dev)
    t = timed_ms(r, "rotary", lambda i: rotary(q, k, pos, cs), calls)
    nbytes = 2 * T * (HQ + HKV) * HEAD_DIM * es + T * HEAD_DIM * 4 + T * 8
    r["rotary_ms"], r["rotary_gbps"] = t, gbps(nbytes, t)
    # RoPE fused with the KV write: reads q, k, v, writes rotated q, k and the cache's k, v rows
    v = qkv[:, (HQ + HKV) * HEAD_DIM:].view(T, HKV, HEAD_DIM)
    kc = torch.empty(T // 16 + 64, 16, HKV, HEAD_DIM, device=dev, dtype=dtype)
    vc = torch.empty_like(kc)
    slots = torch.randperm(kc.shape[0] * 16, device=dev, generator=g)[:T]
    t = timed_ms(r, "rotary_write_kv", lambda i: rotary_write_kv(q, k, v, pos, cs, kc, vc, slots), calls)
    nbytes = (T * (HQ + 2 * HKV) + T * (HQ + HKV) + 2 * T * HKV) * HEAD_DIM * es + T * HEAD_DIM * 4 + T * 16
    r["rotary_write_kv_ms"], r["rotary_write_kv_gbps"] = t, gbps(nbytes, t)
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
    r["write_kv_ms"], r["write_kv_gbps"] = t, gbps(2 * written * HKV * HEAD_DIM * es * 2 + T3 * 8, t)
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
