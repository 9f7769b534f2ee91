"""LoRA's first product for a batch of rows that each use their own adapter slot, masked, in one launch.

Reference: ``pageserve.kernels.reference.lora_shrink``: every row's product with every slot's stacked A
(``linear``), then a select that keeps only the columns of the row's own slot. That is two launches a projection,
four with the second product and its add; at the 3B shape's 36 layers x 4 fused projections a decode step with
LoRA on ran ~600 more kernels than without, and cost 1.53x the plain step at batch 1 and 1.66x at 64 (H100,
session 47, ``scripts/lora_bench.py``). Here each program computes a [BLOCK_M, BLOCK_N] tile of the product and
writes zeros where a row's slot does not own the column; a tile that no row of its block needs (every row of no
adapter, or of other slots) skips its K loop and writes zeros without reading A. The second product and its add
are one ``addmm_`` (``model.lora.LoRASlots.add``).

A decode batch's launch has 1-12 tiles, so K is split (``splits_for``): on the H100 (session 48) one program
walking all of K (11,008 for down) made a 3B decode step with adapters 4.5-5.2x the plain one. Each slice stores
its fp32 part; the tile's last slice to finish (a ticket on a counter) sums the parts in slice order, so the
output does not depend on which slice ran when.

Off by default (``model.lora.LoRASlots.USE_KERNELS``): in the same H100 run the reference path, whose products
are the engine's tuned GEMVs, cost 1.54x plain at batch 1 with adapters in use against this path's 1.70x
(``results/h100/lora_bench.log``). A skipped tile still launches its every slice (each takes a ticket), which put
the no-adapter case at 1.35x against the unsplit kernel's 1.27x; a tile no row needs could leave all but one
slice idle.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference import lora_shrink as lora_shrink_reference
from ._util import KERNEL_DTYPES, cdiv, check, check_device, dot_precision, dot_upcast, mma, sm_count_for

__all__ = ["lora_shrink", "lora_shrink_reference"]

BLOCK_N = 64
BLOCK_K = 64


@triton.jit
def _lora_shrink_kernel(x_ptr, a_ptr, slots_ptr, w_ptr, out_ptr, part_ptr, count_ptr, T, K, C, width, eps,
                        k_split, splits, stride_x, stride_a, stride_out,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STATS_K: tl.constexpr,
                        PREC: tl.constexpr, UPCAST: tl.constexpr, NORM: tl.constexpr, SILU_MUL: tl.constexpr,
                        SPLIT: tl.constexpr):
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    c0 = pid_n * BLOCK_N
    rn = c0 + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    in_m, in_n = rm < T, rn < C
    slot = tl.load(slots_ptr + rm, mask=in_m, other=-1)
    # the slots whose columns this tile holds: c0 // width .. (c0 + BLOCK_N - 1) // width
    wanted = (slot >= c0 // width) & (slot <= (c0 + BLOCK_N - 1) // width)
    needed = tl.sum(wanted.to(tl.int32), axis=0) > 0  # the same in every K slice of the tile
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if needed:
        x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_x
        a_cols = a_ptr + rn.to(tl.int64)[None, :] * stride_a
        inv = tl.zeros((BLOCK_M,), dtype=tl.float32)
        if NORM:  # each row's RMS over the whole row (every slice reads it), as reference.rms_norm: fp32
            rs = tl.arange(0, STATS_K)
            ss = tl.zeros((BLOCK_M,), dtype=tl.float32)
            for k0 in range(0, K, STATS_K):
                kk = k0 + rs
                xf = tl.load(x_rows + kk[None, :], mask=in_m[:, None] & (kk[None, :] < K), other=0.0).to(tl.float32)
                ss += tl.sum(xf * xf, axis=1)
            inv = 1.0 / tl.sqrt(ss / K + eps)
        k_lo = pid_k * k_split
        k_hi = tl.minimum(k_lo + k_split, K)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            kk = k0 + rk
            in_k = kk < k_hi
            xmask = in_m[:, None] & in_k[None, :]
            xt = tl.load(x_rows + kk[None, :], mask=xmask, other=0.0)
            # each prologue in fp32, rounded to x's dtype once for the product (the reference rounds twice: the
            # same values up to an ulp of its input, and the interpreter's bf16 conversions truncate)
            if NORM:  # weight * x * inv, as reference.rms_norm
                w = tl.load(w_ptr + kk, mask=in_k, other=0.0)
                xt = (xt.to(tl.float32) * inv[:, None] * w[None, :].to(tl.float32)).to(xt.dtype)
            if SILU_MUL:  # x is gate|up [T, 2K]: SiLU(gate) * up, as reference.silu_and_mul
                up = tl.load(x_rows + K + kk[None, :], mask=xmask, other=0.0)
                g = xt.to(tl.float32)
                xt = (g * tl.sigmoid(g) * up.to(tl.float32)).to(xt.dtype)
            at = tl.load(a_cols + kk[:, None], mask=in_n[None, :] & in_k[:, None], other=0.0)
            acc += mma(xt, at, PREC, UPCAST)
    tile_mask = in_m[:, None] & in_n[None, :]
    last = True
    if SPLIT:  # K in ``splits`` slices: each stores its fp32 part; the tile's last slice to finish sums them in
        # slice order (the same bits whatever order the slices ran in) and resets the tile's counter
        parts = part_ptr + rm.to(tl.int64)[:, None] * C + rn[None, :]
        if needed:
            tl.store(parts + pid_k.to(tl.int64) * T * C, acc, mask=tile_mask)
        tile = pid_m * tl.num_programs(1) + pid_n
        last = tl.atomic_add(count_ptr + tile, 1) == splits - 1  # acq_rel: the other slices' stores are seen
        if last:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            if needed:
                for s in range(0, splits):
                    acc += tl.load(parts + s * T * C, mask=tile_mask, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(count_ptr + tile, 0)
    if last:
        own = (rn[None, :] // width) == slot[:, None]
        acc = tl.where(own, acc, 0.0)
        tl.store(out_ptr + rm.to(tl.int64)[:, None] * stride_out + rn[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=tile_mask)


def block_m_for(rows: int) -> int:
    """Rows a program covers: 16 (the smallest ``tl.dot`` tile) up to 64 rows, 64 above."""
    return 16 if rows <= 64 else 64


MIN_SPLIT_TILES = 2  # K tiles a slice walks at the least
MAX_SPLITS = 32
COUNTERS = 1024  # per-tile tickets a split launch may use (split launches have fewer tiles than the GPU has SMs)


def splits_for(tiles: int, K: int, sms: int, block_k: int = BLOCK_K, max_splits: int = MAX_SPLITS) -> tuple[int, int]:
    """(slices, K per slice): enough slices of K that the launch fills the GPU once (``sms`` programs), each at
    least ``MIN_SPLIT_TILES`` K tiles, at most ``MAX_SPLITS``. A decode batch's launch has 1-12 tiles: one
    program walking all of K (11,008 for the 3B shape's down) made a 3B decode step with adapters 4.5-5.2x
    the plain one (H100, session 48); a launch of many tiles (prefill) is not split."""
    k_tiles = cdiv(K, block_k)
    n = max(1, min(cdiv(sms, tiles), k_tiles // MIN_SPLIT_TILES, max_splits))
    k_split = cdiv(k_tiles, n) * block_k
    return cdiv(K, k_split), k_split


def lora_shrink(x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor, width: int,
                norm_weight: torch.Tensor | None = None, eps: float = 0.0, silu_mul: bool = False,
                counters: torch.Tensor | None = None, splits: int | None = None, block_k: int = BLOCK_K,
                max_splits: int = MAX_SPLITS, num_stages: int | None = None) -> torch.Tensor:
    """[T, C]: ``x`` [T, K] @ ``a`` [C, K]^T where column c belongs to slot ``c // width`` and row t keeps only
    the columns of its slot ``token_slots[t]`` (-1, or any slot with no columns: a row of zeros). ``token_slots``:
    [>= T] int64 (its first T entries are read). x and a: one float dtype, last dim contiguous.
    Prologues, so the base projection can stay fused: ``norm_weight`` [K]: x is first ``rms_norm(x, norm_weight,
    eps)``; ``silu_mul``: x is gate|up [T, 2K] and the product's input is ``SiLU(gate) * up``.
    A launch of few tiles splits K (``splits_for``; ``splits`` forces a count): each slice's fp32 part goes to a
    scratch buffer and the tile's last slice sums them in slice order, counted on ``counters`` ([>= COUNTERS]
    int32, zeros, left zeros; the engine's ``LoRASlots`` owns one, made before any graph is captured; without it
    a split launch allocates its own). ``block_k``, ``max_splits``, ``num_stages``: the tile, the split cap and the
    pipeline depth (``scripts/lora_shrink_probe.py`` times them; the defaults are what the engine runs)."""
    check("x", x, ndim=2, dtype=KERNEL_DTYPES)
    check("a", a, ndim=2, dtype=(x.dtype,))
    check("token_slots", token_slots, ndim=1, dtype=torch.int64)
    check_device(x=x, a=a, token_slots=token_slots)
    if norm_weight is not None and silu_mul:
        raise ValueError("lora_shrink: one prologue at a time (norm_weight or silu_mul)")
    T, K = x.shape[0], x.shape[1] // 2 if silu_mul else x.shape[1]
    C = a.shape[0]
    if a.shape[1] != K or (silu_mul and x.shape[1] != 2 * K):
        raise ValueError(f"lora_shrink: x has {x.shape[1]} columns{' (gate|up)' if silu_mul else ''} but a has "
                         f"{a.shape[1]}")
    if norm_weight is not None:
        check("norm_weight", norm_weight, shape=(K,))
        check_device(x=x, norm_weight=norm_weight)
    if token_slots.shape[0] < T:
        raise ValueError(f"lora_shrink: {T} rows but {token_slots.shape[0]} slots")
    if width <= 0:
        raise ValueError(f"lora_shrink: width must be positive, got {width}")
    out = torch.empty(T, C, dtype=x.dtype, device=x.device)
    if T and C:
        bm = block_m_for(T)
        grid_m, grid_n = cdiv(T, bm), cdiv(C, BLOCK_N)
        if splits is None:
            n_split, k_split = splits_for(grid_m * grid_n, K, sm_count_for(x), block_k, max_splits)
        else:
            k_split = cdiv(cdiv(K, block_k), max(1, splits)) * block_k
            n_split = cdiv(K, k_split)
        part = out
        if n_split > 1:
            if counters is None:
                counters = torch.zeros(grid_m * grid_n, dtype=torch.int32, device=x.device)
            check("counters", counters, ndim=1, dtype=(torch.int32,))
            if counters.shape[0] < grid_m * grid_n:
                raise ValueError(f"lora_shrink: {grid_m * grid_n} tiles but {counters.shape[0]} counters")
            part = torch.empty(n_split, T, C, dtype=torch.float32, device=x.device)
        else:
            counters = token_slots  # unread without SPLIT
        w = x if norm_weight is None else norm_weight  # unread without NORM
        _lora_shrink_kernel[(grid_m, grid_n, n_split)](
            x, a, token_slots, w, out, part, counters, T, K, C, width, float(eps), k_split, n_split,
            x.stride(0), a.stride(0), out.stride(0),
            BLOCK_M=bm, BLOCK_N=BLOCK_N, BLOCK_K=block_k, STATS_K=256 if bm == 16 else 64,
            PREC=dot_precision(x.dtype), UPCAST=dot_upcast(x.dtype), NORM=norm_weight is not None,
            SILU_MUL=silu_mul, SPLIT=n_split > 1, num_warps=4, **({} if num_stages is None else
                                                                  {"num_stages": num_stages}))
    return out
