"""Store this step's K and V into the paged cache through ``slot_mapping``.

Reference: ``pageserve.kernels.reference.write_kv``. One program per token writes all
KV heads of K and V; a slot of -1 (padding) writes nothing. No host sync: the -1 test is
an early exit inside the kernel, so the launch can be captured in a CUDA graph.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference import write_kv as write_kv_reference
from ._util import KERNEL_DTYPES, check, check_device, next_pow2, pdl_args, pdl_enter

__all__ = ["write_kv", "write_kv_reference"]


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, HKV, D,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    page = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h < HKV)[:, None] & (d < D)[None, :]
    k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask, other=0.0)
    v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask, other=0.0)
    kdst = kc_ptr + page * stride_kcb + off * stride_kcs + h[:, None] * stride_kch + d[None, :]
    vdst = vc_ptr + page * stride_vcb + off * stride_vcs + h[:, None] * stride_vch + d[None, :]
    tl.store(kdst, k.to(kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vdst, v.to(vc_ptr.dtype.element_ty), mask=mask)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, pdl: bool | None = None) -> None:
    """k, v: [T, Hkv, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D];
    slot_mapping: [T] int (-1 = skip). Slots are not bounds-checked on the device.
    ``pdl``: see ``_util.use_pdl``."""
    check("k", k, ndim=3, dtype=KERNEL_DTYPES)
    T, Hkv, D = k.shape
    check("v", v, shape=(T, Hkv, D), dtype=k.dtype)
    check("k_cache", k_cache, shape=(None, None, Hkv, D), dtype=KERNEL_DTYPES)
    check("v_cache", v_cache, shape=tuple(k_cache.shape), dtype=k_cache.dtype)
    check("slot_mapping", slot_mapping, shape=(T,), dtype=(torch.int32, torch.int64), last_contiguous=False)
    check_device(k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    if slot_mapping.stride(0) != 1:
        slot_mapping = slot_mapping.contiguous()
    if T == 0:
        return
    _write_kv_kernel[(T,)](
        k, v, k_cache, v_cache, slot_mapping, Hkv, D,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        BLOCK_SIZE=k_cache.shape[1], BLOCK_H=next_pow2(Hkv), BLOCK_D=next_pow2(D), num_warps=2, **pdl_args(k, T, pdl),
    )
