"""The sampler's candidate path in one launch: order each row's candidates, filter them (temperature, top-k, top-p,
min-p) and run the exponential race, one program a row.

Reference: ``pageserve.kernels.reference.candidate_race`` (``candidate_filter``, then argmax(probs / q)), which is
also the sampler's own path off CUDA. There a row's candidates take ~25 torch launches over [R, k] (a gather, the
ordered keys, an argsort, two gathers, the division, the masks, two softmaxes, a cumulative sum, the race's
division, argmax and gather); on a host that issues a launch in ~16 µs that was ~0.4 ms of every sampled step with
Qwen2.5-Instruct's defaults (top_k 20, top_p 0.8), which the GPU finished long before (NOTES, session 52).

A program holds its row's S = k + slack candidates in registers: the values are gathered from the penalised fp32
logits at the candidate ids, turned into the reference's int64 keys (value bits above the reversed id) and sorted,
so position j is rank j; every value comes back from its key's bits exactly. The filters then run in rank order on
the same fp32 values (IEEE divisions, ``div_rn``); the softmaxes' exponentials and sums and the cumulative mass
are this kernel's own, so a probability can differ from the reference's in its last bits, and a top-p cut or a race
that sits within that rounding can fall the other way (the tests compare tokens where the reference's margins are
wider than that). Seeded rows hash their noise from the candidate id here (the reference's integer hash and exact
conversion, its ``log`` libdevice's on CUDA: the one torch's ``log_`` compiles to); unseeded rows read it from
``noise`` in rank order, so a generator fills the same [R, k] draws as for the reference.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .reference import UNIFORM_BITS, GOLDEN, TOKEN_MUL, candidate_race as candidate_race_reference, signed64
from ._util import KERNEL_DTYPES, check, check_device, interpreting, next_pow2, pdl_args, pdl_enter
from .penalties import check_seen, seen_penalty

__all__ = ["candidate_race", "candidate_race_reference"]

_GOLDEN_I64: tl.constexpr = tl.constexpr(signed64(GOLDEN))
_TOKEN_MUL_I64: tl.constexpr = tl.constexpr(signed64(TOKEN_MUL))
_MIX1: tl.constexpr = tl.constexpr(signed64(0xBF58476D1CE4E5B9))
_MIX2: tl.constexpr = tl.constexpr(signed64(0x94D049BB133111EB))
_UBITS: tl.constexpr = tl.constexpr(UNIFORM_BITS)
_U_SCALE: tl.constexpr = tl.constexpr(2.0 ** -UNIFORM_BITS)


@triton.jit
def _srl(x, s: tl.constexpr):
    return (x.to(tl.uint64, bitcast=True) >> s).to(tl.int64, bitcast=True)  # int64's >> is arithmetic


@triton.jit
def _mix64(x):
    x = (x ^ _srl(x, 30)) * _MIX1
    x = (x ^ _srl(x, 27)) * _MIX2
    return x ^ _srl(x, 31)


@triton.jit
def _softmax(x):
    e = tl.exp(x - tl.max(x, axis=0))
    return tl.math.div_rn(e, tl.sum(e, axis=0))


@triton.jit
def _candidate_race_kernel(logits_ptr, stride_l, ids_ptr, stride_ids, S, rows_ptr, table_ptr, stride_t,
                           noise_ptr, stride_n, seeds_ptr, stride_s, out_ptr, K, words_ptr, stride_w, rep_ptr,
                           BLOCK: tl.constexpr, HAS_ROWS: tl.constexpr, HAS_NOISE: tl.constexpr,
                           HAS_SEEDS: tl.constexpr, HAS_SEEN: tl.constexpr, LIBDEVICE_LOG: tl.constexpr,
                           USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    r = tl.program_id(0).to(tl.int64)
    row = r
    if HAS_ROWS:
        row = tl.load(rows_ptr + r)
    j = tl.arange(0, BLOCK)
    ids = tl.load(ids_ptr + r * stride_ids + j, mask=j < S, other=-1)
    inside = ids >= 0  # -1: an unused slot (``topk_candidates``), as padding
    n_real = tl.sum(inside.to(tl.int32), axis=0)
    v = tl.load(logits_ptr + row * stride_l + ids, mask=inside, other=0.0).to(tl.float32)  # 16 bits: exact
    if HAS_SEEN:  # the repetition penalty on read (``kernels/penalties.py``)
        v = seen_penalty(v, ids, words_ptr + row * stride_w, tl.load(rep_ptr + row), inside)
    bits = v.to(tl.int32, bitcast=True).to(tl.int64)
    bits = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    key = (bits << 32) + (0xFFFFFFFF - ids)  # the reference's ordered_keys
    key = tl.where(inside, key, -9223372036854775807 - 1)  # padding below every key
    key = tl.sort(key, descending=True)  # position j: rank j
    hi = key >> 32
    tok = 0xFFFFFFFF - (key & 0xFFFFFFFF)
    value = tl.where(hi < 0, hi ^ 0x7FFFFFFF, hi).to(tl.int32).to(tl.float32, bitcast=True)

    temp = tl.load(table_ptr + row)
    top_k = tl.load(table_ptr + stride_t + row)
    top_p = tl.load(table_ptr + 2 * stride_t + row)
    min_p = tl.load(table_ptr + 3 * stride_t + row)
    x = tl.math.div_rn(value, temp)
    x = tl.where((j < K) & (j < n_real) & (j.to(tl.float32) < top_k), x, float("-inf"))
    p = _softmax(x)
    x = tl.where(tl.cumsum(p, axis=0) - p >= top_p, float("-inf"), x)  # top_p 2.0 (off) never cuts
    probs = _softmax(x)
    probs = tl.where(probs < min_p * tl.max(probs, axis=0), 0.0, probs)

    q = tl.full([BLOCK], 1.0, tl.float32)
    if HAS_NOISE:
        q = tl.load(noise_ptr + r * stride_n + j, mask=j < K, other=1.0)
    if HAS_SEEDS:
        seeded = tl.load(seeds_ptr + r)
        seed = tl.load(seeds_ptr + stride_s + r)
        step = tl.load(seeds_ptr + 2 * stride_s + r)
        h = _mix64(_mix64(seed + (step + 1) * _GOLDEN_I64) + (tok + 1) * _TOKEN_MUL_I64)
        u = (_srl(h, 64 - _UBITS).to(tl.float32) + 0.5) * _U_SCALE
        if LIBDEVICE_LOG:
            log_u = libdevice.log(u)
        else:
            log_u = tl.log(u)
        q = tl.where(seeded != 0, -log_u, q)
    ratio = tl.where(j < K, tl.math.div_rn(probs, q), -1.0)
    first = tl.min(tl.where(ratio == tl.max(ratio, axis=0), j, BLOCK), axis=0)  # argmax's first maximum
    tl.store(out_ptr + row, tl.sum(tl.where(j == first, tok, 0), axis=0))


def launch_config(S: int) -> tuple[int, int]:
    """(BLOCK, num_warps) for rows of S candidates: its own function so that the offline audit
    (scripts/t4_compile_audit.py) compiles the launch a step gets."""
    block = max(16, next_pow2(S))
    return block, 4 if block <= 256 else 8


def candidate_race(logits: torch.Tensor, ids: torch.Tensor, k: int, table: torch.Tensor,
                   noise: torch.Tensor | None, seeds: torch.Tensor | None = None, rows: torch.Tensor | None = None,
                   out: torch.Tensor | None = None, pdl: bool | None = None,
                   seen: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The reference's ``candidate_race`` in one launch. ``logits`` [B, V] (the penalised logits, fp32, or the
    model's 16-bit ones where nothing changed them; last dim contiguous), ``ids`` [R, S] int64 (each row's
    candidates, S >= k, any order; -1: an unused slot), ``table`` [>= 4, B] fp32, ``noise`` [R, k] fp32 or None
    (every row seeded), ``seeds`` [3, R] int64 or None, ``rows`` [R] int64 or None. The token of candidate row r is
    written to ``out[rows[r]]`` (``out[r]`` without rows; ``out`` [B] int64, a new one if None), which is
    returned. ``seen``: None, or (words, penalty) as ``topk_candidates``' (the race over ``reference.apply_seen(logits,
    *seen)``). ``pdl``: see ``_util.use_pdl``, except that any row count may use it, as the argmax's (``_util``: a PDL
    launch between two decode graph replays)."""
    check("logits", logits, ndim=2, dtype=KERNEL_DTYPES)
    words, rep = check_seen(seen, logits)
    check("ids", ids, ndim=2, dtype=torch.int64)
    check("table", table, ndim=2, dtype=torch.float32)
    R, S = ids.shape
    if not 0 < k <= S:
        raise ValueError(f"candidate_race: k {k} outside 1..{S} candidates")
    if noise is None and seeds is None:
        raise ValueError("candidate_race: unseeded rows need noise")
    if noise is not None:
        check("noise", noise, shape=(R, k), dtype=torch.float32)
        if k > 1 and noise.stride(1) != 1:
            raise ValueError("candidate_race: noise needs a contiguous last dimension")
    if seeds is not None:
        check("seeds", seeds, shape=(3, R), dtype=torch.int64)
    if rows is not None:
        check("rows", rows, shape=(R,), dtype=torch.int64)
    check_device(logits=logits, ids=ids, table=table, **{n: t for n, t in
                 (("noise", noise), ("seeds", seeds), ("rows", rows), ("out", out), ("words", words),
                  ("penalty", rep)) if t is not None})
    for name, t in (("logits", logits), ("ids", ids), ("table", table)):
        if t.shape[1] > 1 and t.stride(1) != 1:  # a dimension of one may have any stride (a [7, 1] table)
            raise ValueError(f"candidate_race: {name} needs a contiguous last dimension")
    if out is None:
        out = torch.empty(logits.shape[0] if rows is not None else R, dtype=torch.int64, device=logits.device)
    if R:
        block, warps = launch_config(S)
        dummy = ids  # a pointer for the inputs a launch does not read
        _candidate_race_kernel[(R,)](
            logits, logits.stride(0), ids, ids.stride(0), S, dummy if rows is None else rows, table, table.stride(0),
            dummy if noise is None else noise, 0 if noise is None else noise.stride(0),
            dummy if seeds is None else seeds, 0 if seeds is None else seeds.stride(0), out, k,
            *((dummy, 0, table) if seen is None else (words, words.stride(0), rep)),
            BLOCK=block, HAS_ROWS=rows is not None, HAS_NOISE=noise is not None, HAS_SEEDS=seeds is not None,
            HAS_SEEN=seen is not None, LIBDEVICE_LOG=not interpreting(), num_warps=warps, **pdl_args(logits, 1, pdl))
    return out
