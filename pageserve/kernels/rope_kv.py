"""RoPE on q and k fused with the paged KV-cache write: one program per token, all heads.

Reference: ``reference.rotary_write_kv`` (``rotary``, then ``write_kv``). Saves one launch per
layer over the two kernels it replaces; the rotated k is rounded to the storage dtype once
and that same value goes to ``k_out`` and to the cache, so the cache matches the two-kernel
path bit for bit. A slot of -1 (padding) writes nothing to the cache; its q and k are still
rotated (the attention kernels skip padding rows themselves).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import reference
from ._util import (KERNEL_DTYPES, check, check_device, next_pow2, pdl_args, pdl_enter_after_inputs,
                    pdl_enter_before_inputs)
from .rotary import _cos_sin, _rotate_heads, rope_first_half, rope_second_half

rotary_write_kv_reference = reference.rotary_write_kv


@triton.jit
def _rope_kv_kernel(
    q_ptr, k_ptr, v_ptr, qo_ptr, ko_ptr, kc_ptr, vc_ptr, pos_ptr, cs_ptr, slot_ptr,
    HQ, HKV, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_qot, stride_qoh, stride_kot, stride_koh, stride_cs,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    PAGE: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_enter_before_inputs(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    # the step's positions and slots and the cos|sin table before the wait; q, k, v after it
    cos, sin, d, dmask = _cos_sin(cs_ptr, pos_ptr, t, stride_cs, HALF, BLOCK_HALF)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    pdl_enter_after_inputs(USE_PDL)
    _rotate_heads(q_ptr, qo_ptr, t, HQ, stride_qt, stride_qh, stride_qot, stride_qoh, cos, sin, d, dmask,
                  HALF, BLOCK_HQ)
    # k: rotate once, round once, store to k_out and (unless padding) to the cache
    h = tl.arange(0, BLOCK_HKV)
    mask = (h < HKV)[:, None] & dmask[None, :]
    hd = h[:, None]
    k_src = k_ptr + t * stride_kt + hd * stride_kh + d[None, :]
    k1 = tl.load(k_src, mask=mask, other=0.0).to(tl.float32)
    k2 = tl.load(k_src + HALF, mask=mask, other=0.0).to(tl.float32)
    r1 = rope_first_half(k1, k2, cos[None, :], sin[None, :]).to(ko_ptr.dtype.element_ty)
    r2 = rope_second_half(k1, k2, cos[None, :], sin[None, :]).to(ko_ptr.dtype.element_ty)
    k_dst = ko_ptr + t * stride_kot + hd * stride_koh + d[None, :]
    tl.store(k_dst, r1, mask=mask)
    tl.store(k_dst + HALF, r2, mask=mask)
    if slot >= 0:
        page = slot // PAGE
        off = slot % PAGE
        kc = kc_ptr + page * stride_kcb + off * stride_kcs + hd * stride_kch + d[None, :]
        tl.store(kc, r1.to(kc_ptr.dtype.element_ty), mask=mask)
        tl.store(kc + HALF, r2.to(kc_ptr.dtype.element_ty), mask=mask)
        v_src = v_ptr + t * stride_vt + hd * stride_vh + d[None, :]
        vc = vc_ptr + page * stride_vcb + off * stride_vcs + hd * stride_vch + d[None, :]
        tl.store(vc, tl.load(v_src, mask=mask, other=0.0).to(vc_ptr.dtype.element_ty), mask=mask)
        tl.store(vc + HALF, tl.load(v_src + HALF, mask=mask, other=0.0).to(vc_ptr.dtype.element_ty), mask=mask)


def rotary_write_kv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, pdl: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, Hq, D], k, v: [T, Hkv, D] (strided views are fine; last dim contiguous),
    positions: [T] int, cos_sin: [max_pos, D] fp32 (cos|sin), caches: [num_blocks, block_size,
    Hkv, D], slot_mapping: [T] int (-1 = skip; not bounds-checked on the device).
    Returns new contiguous (q_rot, k_rot). ``pdl``: see ``_util.use_pdl``."""
    check("q", q, ndim=3, dtype=KERNEL_DTYPES)
    T, Hq, D = q.shape
    check("k", k, shape=(T, None, D), dtype=q.dtype)
    Hkv = k.shape[1]
    check("v", v, shape=(T, Hkv, D), dtype=q.dtype)
    check("positions", positions, shape=(T,), dtype=(torch.int32, torch.int64), last_contiguous=False)
    check("cos_sin", cos_sin, shape=(None, D), dtype=torch.float32)
    check("k_cache", k_cache, shape=(None, None, Hkv, D), dtype=KERNEL_DTYPES)
    check("v_cache", v_cache, shape=tuple(k_cache.shape), dtype=k_cache.dtype)
    check("slot_mapping", slot_mapping, shape=(T,), dtype=(torch.int32, torch.int64), last_contiguous=False)
    check_device(q=q, k=k, v=v, positions=positions, cos_sin=cos_sin, k_cache=k_cache, v_cache=v_cache,
                 slot_mapping=slot_mapping)
    if D % 2:
        raise ValueError(f"head_dim must be even, got {D}")
    positions = positions.contiguous()
    slot_mapping = slot_mapping.contiguous()
    qo = torch.empty((T, Hq, D), dtype=q.dtype, device=q.device)
    ko = torch.empty((T, Hkv, D), dtype=k.dtype, device=k.device)
    if T == 0:
        return qo, ko
    half = D // 2
    _rope_kv_kernel[(T,)](
        q, k, v, qo, ko, k_cache, v_cache, positions, cos_sin, slot_mapping, Hq, Hkv,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        qo.stride(0), qo.stride(1), ko.stride(0), ko.stride(1), cos_sin.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        PAGE=k_cache.shape[1], HALF=half, BLOCK_HALF=next_pow2(half),
        BLOCK_HQ=next_pow2(Hq), BLOCK_HKV=next_pow2(Hkv), num_warps=4, **pdl_args(q, T, pdl),
    )
    return qo, ko
