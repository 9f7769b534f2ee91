"""Random inputs and kernel-vs-reference checks, shared by the kernel tests and ``lab.kernel_bench.checks``.

Every check draws fresh random inputs, poisons the kernel's output with NaN, runs the
kernel and its plain-PyTorch reference (in float64 on upcast inputs), and returns the
relative error ||out - ref|| / ||ref|| (inf if any element is NaN, i.e. unwritten).
"""
from __future__ import annotations

import math

import torch

from ..model.attention import AttentionMetadata

from ..kernels.reference import paged_attention as paged_attention_reference, write_kv as write_kv_reference
from ..model.ops import TorchOps, rope_cos_sin
from ..kernels.activation import silu_and_mul
from ..kernels.gemv import GemvConfig, gemv, silu_mul_gemv
from ..kernels.kv_write import write_kv
from ..kernels.norm import add_rms_norm, rms_norm
from ..kernels.paged_decode import paged_decode_attention, rope_decode_attention
from ..kernels.paged_invariant import paged_attention_invariant
from ..kernels.paged_prefill import paged_prefill_attention
from ..kernels.rope_kv import rotary_write_kv
from ..kernels.rotary import rotary
from ..kernels._util import cdiv

# ||out - ref|| / ||ref|| limits against the float64 reference: fp32 arithmetic lands far under 1e-4; half types
# carry one rounding of the output and of the softmax probabilities (~4e-3)
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 1e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if torch.isnan(out).any() or torch.isinf(out).any():
        return math.inf
    denom = ref.norm().item()
    diff = (out - ref).norm().item()
    return diff / denom if denom > 0 else diff


def _rand(shape, dtype, device, gen, scale=1.0):
    return (torch.randn(shape, generator=gen, device="cpu", dtype=torch.float32) * scale).to(device=device, dtype=dtype)


def random_paged_batch(
    q_lens: list[int], ctx_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
    dtype: torch.dtype, device, gen: torch.Generator, pad_tokens: int = 0, spare_blocks: int = 3,
    extra_table_cols: int = 1,
):
    """A flattened batch over a random paged KV cache.

    Sequence i has ``ctx_lens[i]`` tokens of context after this step, the last ``q_lens[i]``
    of them new. Blocks are a random permutation of the pool (so tables jump around), the
    table has spare columns holding valid ids, ``pad_tokens`` query rows at the end belong to
    no sequence (slot -1). Returns (q, k_new, v_new, k_cache, v_cache, meta)."""
    assert len(q_lens) == len(ctx_lens) and all(0 <= q <= c for q, c in zip(q_lens, ctx_lens))
    B = len(ctx_lens)
    need = [cdiv(c, block_size) for c in ctx_lens]
    width = max(need + [1]) + extra_table_cols
    num_blocks = sum(need) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.randint(0, num_blocks, (B, width), generator=gen, dtype=torch.int32)
    used = 0
    for i, n in enumerate(need):
        table[i, :n] = perm[used:used + n].int()
        used += n
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    T = qsl[-1] + pad_tokens
    slots = []
    for i, (q, c) in enumerate(zip(q_lens, ctx_lens)):
        for pos in range(c - q, c):
            slots.append(int(table[i, pos // block_size]) * block_size + pos % block_size)
    slots += [-1] * pad_tokens
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = _rand(cache_shape, dtype, device, gen)
    v_cache = _rand(cache_shape, dtype, device, gen)
    q = _rand((T, num_heads, head_dim), dtype, device, gen)
    k_new = _rand((T, num_kv_heads, head_dim), dtype, device, gen)
    v_new = _rand((T, num_kv_heads, head_dim), dtype, device, gen)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(ctx_lens, dtype=torch.int32, device=device),
        block_tables=table.to(device),
        max_query_len=max(q_lens + [0]),
        max_seq_len=max(ctx_lens + [0]),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=list(ctx_lens),
    )
    return q, k_new, v_new, k_cache, v_cache, meta


def attention_reference(q, k_cache, v_cache, meta, scale) -> torch.Tensor:
    return paged_attention_reference(q.double(), k_cache.double(), v_cache.double(), meta, scale)


# ------------------------------------------------------------------------------ checks
def check_decode(ctx_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, device, gen,
                 num_splits=None, extra_table_cols=1, schedule="split") -> float:
    B = len(ctx_lens)
    q_lens = [1 if c > 0 else 0 for c in ctx_lens]
    q, _, _, kc, vc, meta = random_paged_batch(q_lens, ctx_lens, num_heads, num_kv_heads, head_dim, block_size,
                                               dtype, device, gen, extra_table_cols=extra_table_cols)
    # decode: one query row per sequence, padding rows (seq_len 0) included
    q = _rand((B, num_heads, head_dim), dtype, device, gen)
    meta.query_start_loc = torch.arange(B + 1, dtype=torch.int32, device=device)
    meta.query_start_loc_cpu = list(range(B + 1))
    meta.max_query_len = 1
    scale = head_dim ** -0.5
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, kc, vc, meta.seq_lens, meta.block_tables, scale, out=out,
                           num_splits=num_splits, schedule=schedule)
    return rel_err(out, attention_reference(q, kc, vc, meta, scale))


def check_prefill(q_lens, ctx_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, device, gen,
                  pad_tokens=0, **config) -> float:
    """``config``: the kernel's tuning keywords (block_m, block_n, num_warps, num_stages)."""
    q, _, _, kc, vc, meta = random_paged_batch(q_lens, ctx_lens, num_heads, num_kv_heads, head_dim, block_size,
                                               dtype, device, gen, pad_tokens=pad_tokens)
    scale = head_dim ** -0.5
    out = torch.full_like(q, float("nan"))
    paged_prefill_attention(q, kc, vc, meta, scale, out=out, **config)
    return rel_err(out, attention_reference(q, kc, vc, meta, scale))


def check_write_kv(q_lens, ctx_lens, num_kv_heads, head_dim, block_size, dtype, device, gen, pad_tokens=2) -> float:
    """0.0 when the kernel's cache equals the reference's bit for bit (untouched slots included)."""
    _, k, v, kc, vc, meta = random_paged_batch(q_lens, ctx_lens, 1, num_kv_heads, head_dim, block_size,
                                               dtype, device, gen, pad_tokens=pad_tokens)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    write_kv(k, v, kc, vc, meta.slot_mapping)
    write_kv_reference(k, v, kc_ref, vc_ref, meta.slot_mapping)
    return max(rel_err(kc, kc_ref), rel_err(vc, vc_ref))


def check_rms_norm(T, H, dtype, device, gen) -> float:
    x = _rand((T, H), dtype, device, gen)
    w = _rand((H,), dtype, device, gen, 0.5) + 1
    out = torch.full_like(x, float("nan"))
    rms_norm(x, w, 1e-6, out=out)
    return rel_err(out, TorchOps().rms_norm(x.double(), w.double(), 1e-6))


def check_add_rms_norm(T, H, dtype, device, gen) -> float:
    x, r = _rand((T, H), dtype, device, gen), _rand((T, H), dtype, device, gen)
    w = _rand((H,), dtype, device, gen, 0.5) + 1
    out, res_out = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
    add_rms_norm(x, r, w, 1e-6, out=out, residual_out=res_out)
    ref_out, ref_res = TorchOps().add_rms_norm(x.double(), r.double(), w.double(), 1e-6)
    return max(rel_err(out, ref_out), rel_err(res_out, ref_res))


def check_silu_and_mul(T, I, dtype, device, gen) -> float:
    gu = _rand((T, 2 * I), dtype, device, gen, 2.0)
    out = torch.full((T, I), float("nan"), dtype=dtype, device=device)
    silu_and_mul(gu, out=out)
    return rel_err(out, TorchOps().silu_and_mul(gu.double()))


def check_rotary(T, num_heads, num_kv_heads, head_dim, dtype, device, gen, inplace=False, max_pos=4096) -> float:
    # q, k as strided views of a fused qkv row, as the model produces them
    qkv = _rand((T, (num_heads + 2 * num_kv_heads) * head_dim), dtype, device, gen)
    q = qkv[:, : num_heads * head_dim].view(T, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim: (num_heads + num_kv_heads) * head_dim].view(T, num_kv_heads, head_dim)
    pos = torch.randint(0, max_pos, (T,), generator=gen).to(device)
    cs = rope_cos_sin(head_dim, max_pos, 1_000_000.0, None).to(device)
    ref_q, ref_k = TorchOps().rotary(q.double(), k.double(), pos, cs.double())
    if inplace:
        qo, ko = rotary(q, k, pos, cs, inplace=True)
        assert qo.data_ptr() == q.data_ptr()
    else:
        qo, ko = rotary(q, k, pos, cs)
    return max(rel_err(qo, ref_q), rel_err(ko, ref_k))


def check_rotary_write_kv(q_lens, ctx_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, device, gen,
                          pad_tokens=2, max_pos=4096) -> float:
    """The fused RoPE + KV write vs ``kernels.reference.rotary_write_kv`` in float64, on strided q/k/v
    views of one qkv row: max relative error of q_rot, k_rot and the written cache slots.
    Cache slots nobody writes (padding rows have slot -1) must keep their old bits: inf if not."""
    _, _, _, kc, vc, meta = random_paged_batch(q_lens, ctx_lens, 1, num_kv_heads, head_dim, block_size,
                                               dtype, device, gen, pad_tokens=pad_tokens)
    T = meta.slot_mapping.shape[0]
    qs, ks = num_heads * head_dim, num_kv_heads * head_dim
    qkv = _rand((T, qs + 2 * ks), dtype, device, gen)
    q = qkv[:, :qs].view(T, num_heads, head_dim)
    k = qkv[:, qs:qs + ks].view(T, num_kv_heads, head_dim)
    v = qkv[:, qs + ks:].view(T, num_kv_heads, head_dim)
    pos = torch.randint(0, max_pos, (T,), generator=gen).to(device)
    cs = rope_cos_sin(head_dim, max_pos, 1_000_000.0, None).to(device)
    kc_ref, vc_ref = kc.double(), vc.double()
    ref_q, ref_k = TorchOps().rotary_write_kv(q.double(), k.double(), v.double(), pos, cs.double(),
                                              kc_ref, vc_ref, meta.slot_mapping)
    kc_old, vc_old = kc.clone(), vc.clone()
    qo, ko = rotary_write_kv(q, k, v, pos, cs, kc, vc, meta.slot_mapping)
    slots = meta.slot_mapping[meta.slot_mapping >= 0]
    written = torch.zeros(kc[..., 0, 0].numel(), dtype=torch.bool, device=device)
    written[slots] = True
    untouched = ~written.view(kc.shape[:2])
    if not (torch.equal(kc[untouched], kc_old[untouched]) and torch.equal(vc[untouched], vc_old[untouched])):
        return math.inf

    def rows(c):  # [num_slots, Hkv, D] at the written slots
        return c.reshape(-1, *c.shape[2:])[slots]

    return max(rel_err(qo, ref_q), rel_err(ko, ref_k), rel_err(rows(kc), rows(kc_ref)), rel_err(rows(vc), rows(vc_ref)))


def rope_decode_batch(ctx_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, device, gen, max_pos=4096):
    """One decode row per sequence for the RoPE-in-attention checks: (q, k, v, positions, cos_sin, k_cache,
    v_cache, meta, slot_mapping). q, k and v are strided views of one qkv row before RoPE; the caches hold
    every position but each row's newest (random values there); context 0 is a padding row (slot -1);
    ``meta`` is a decode batch (query_start_loc 0..B, max_query_len 1)."""
    B = len(ctx_lens)
    _, _, _, kc, vc, meta = random_paged_batch([0] * B, ctx_lens, num_heads, num_kv_heads, head_dim, block_size,
                                               dtype, device, gen)
    table = meta.block_tables.cpu()
    slots = [int(table[i, (c - 1) // block_size]) * block_size + (c - 1) % block_size if c else -1
             for i, c in enumerate(ctx_lens)]
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=device)
    qs, ks = num_heads * head_dim, num_kv_heads * head_dim
    qkv = _rand((B, qs + 2 * ks), dtype, device, gen)
    q = qkv[:, :qs].view(B, num_heads, head_dim)
    k = qkv[:, qs:qs + ks].view(B, num_kv_heads, head_dim)
    v = qkv[:, qs + ks:].view(B, num_kv_heads, head_dim)
    pos = torch.tensor([max(c - 1, 0) for c in ctx_lens], device=device)
    cs = rope_cos_sin(head_dim, max_pos, 1_000_000.0, None).to(device)
    meta.query_start_loc = torch.arange(B + 1, dtype=torch.int32, device=device)
    meta.query_start_loc_cpu, meta.max_query_len = list(range(B + 1)), 1
    return q, k, v, pos, cs, kc, vc, meta, slot_mapping


def check_rope_decode(ctx_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, device, gen,
                      max_pos=4096, **launch) -> tuple[float, bool]:
    """``rope_decode_attention`` on one decode row per sequence (context 0: a padding row, slot -1), q, k
    and v strided views of one qkv row before RoPE, the cache holding every position but each row's
    newest. Returns (relative error of the output against ``reference.rotary_write_kv`` followed by the
    attention reference in float64, whether the cache it leaves has every bit of the one
    ``rope_kv.rotary_write_kv`` leaves: written slots and untouched ones). ``launch``: the wrapper's keywords."""
    q, k, v, pos, cs, kc, vc, meta, slot_mapping = rope_decode_batch(ctx_lens, num_heads, num_kv_heads, head_dim,
                                                                     block_size, dtype, device, gen, max_pos)
    B = len(ctx_lens)
    kc_two, vc_two = kc.clone(), vc.clone()  # the two-launch path's cache
    q_rot, _ = rotary_write_kv(q, k, v, pos, cs, kc_two, vc_two, slot_mapping)
    out = torch.full((B, num_heads, head_dim), float("nan"), dtype=dtype, device=device)
    rope_decode_attention(q, k, v, pos, cs, kc, vc, slot_mapping, meta.seq_lens, meta.block_tables,
                          head_dim ** -0.5, out=out, **launch)
    same_cache = torch.equal(kc, kc_two) and torch.equal(vc, vc_two)
    kc_ref, vc_ref = kc.double(), vc.double()  # the reference's own RoPE and write, in float64
    ref_q, _ = TorchOps().rotary_write_kv(q.double(), k.double(), v.double(), pos, cs.double(), kc_ref, vc_ref,
                                          slot_mapping)
    ref = paged_attention_reference(ref_q, kc_ref, vc_ref, meta, head_dim ** -0.5)
    return rel_err(out, ref), same_cache


def check_invariant_rope_decode(ctx_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, device, gen,
                                max_pos=4096, **launch) -> tuple[bool, bool]:
    """The batch-invariant attention with RoPE and the K/V write inside its decode launch
    (``paged_attention_invariant(rope=...)``) against ``rope_kv.rotary_write_kv`` followed by the
    same attention, on one decode row per sequence (context 0: a padding row, slot -1) whose q, k and
    v are strided views of one qkv row. Returns (the outputs bit for bit equal, the caches bit for bit
    equal). ``launch``: the attention's keywords (kv_split, block_n, split_programs, flat, ...)."""
    q, k, v, pos, cs, kc, vc, meta, slot_mapping = rope_decode_batch(ctx_lens, num_heads, num_kv_heads, head_dim,
                                                                     block_size, dtype, device, gen, max_pos)
    kc_two, vc_two = kc.clone(), vc.clone()  # the two-launch path's cache
    q_rot, _ = rotary_write_kv(q, k, v, pos, cs, kc_two, vc_two, slot_mapping)
    two = paged_attention_invariant(q_rot, kc_two, vc_two, meta, head_dim ** -0.5, **launch)
    one = paged_attention_invariant(q, kc, vc, meta, head_dim ** -0.5, rope=(k, v, pos, cs, slot_mapping), **launch)
    return torch.equal(one, two), torch.equal(kc, kc_two) and torch.equal(vc, vc_two)


def rope_decode_err(*args, **kw) -> float:
    """``check_rope_decode``'s error, or inf where the cache it leaves is not bit for bit rope_kv's (the
    sweeps' one-number form)."""
    err, same_cache = check_rope_decode(*args, **kw)
    return err if same_cache else math.inf


def check_gemv(M, N, K, dtype, device, gen, bias=True, config=None, split_k="auto") -> float:
    x = _rand((M, K), dtype, device, gen)
    w = _rand((N, K), dtype, device, gen, K ** -0.5)
    b = _rand((N,), dtype, device, gen) if bias else None
    out = torch.full((M, N), float("nan"), dtype=dtype, device=device)
    gemv(x, w, b, config=config, out=out, split_k=split_k)
    ref = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    return rel_err(out, ref)


def check_silu_mul_gemv(M, N, I, dtype, device, gen, config=None, split_k="auto") -> float:
    """The down projection fused with SiLU(gate) * up vs ``kernels.reference.silu_mul_linear`` in float64."""
    gate_up = _rand((M, 2 * I), dtype, device, gen, 2.0)
    w = _rand((N, I), dtype, device, gen, I ** -0.5)
    out = torch.full((M, N), float("nan"), dtype=dtype, device=device)
    silu_mul_gemv(gate_up, w, config=config, out=out, split_k=split_k)
    return rel_err(out, TorchOps().silu_mul_linear(gate_up.double(), w.double()))


def full_size_checks(dtype, device, gen) -> dict:
    """The GPU checks at the 3B shapes, one name -> thunk returning a relative error."""
    Hq, Hkv, D, bs = 16, 2, 128, 16
    return {
        "paged_decode_attn": lambda: check_decode([2048] * 60 + [1, 17, 0, 4000], Hq, Hkv, D, bs, dtype, device, gen),
        "paged_decode_attn_gqa1": lambda: check_decode([33, 500, 0, 1], 8, 8, 64, 32, dtype, device, gen),
        "paged_prefill_attn": lambda: check_prefill([512, 1, 77, 1, 300], [512, 900, 1077, 1, 4000],
                                                    Hq, Hkv, D, bs, dtype, device, gen, pad_tokens=3),
        "write_kv": lambda: check_write_kv([512, 1, 77], [512, 900, 1077], Hkv, D, bs, dtype, device, gen),
        "rms_norm": lambda: check_rms_norm(64, 2048, dtype, device, gen),
        "add_rms_norm": lambda: check_add_rms_norm(64, 2048, dtype, device, gen),
        "silu_and_mul": lambda: check_silu_and_mul(64, 11008, dtype, device, gen),
        "rotary": lambda: check_rotary(64, Hq, Hkv, D, dtype, device, gen),
        "gemv_m1": lambda: check_gemv(1, 2560, 2048, dtype, device, gen),
        "gemv_m1_down": lambda: check_gemv(1, 2048, 11008, dtype, device, gen, bias=False),
        "gemv_m4": lambda: check_gemv(4, 2560, 2048, dtype, device, gen),
        "gemv_m8": lambda: check_gemv(8, 2048, 11008, dtype, device, gen, bias=False),
        "gemv_nosplit_m1": lambda: check_gemv(1, 2560, 2048, dtype, device, gen, split_k="never"),
        "gemv_nosplit_m1_down": lambda: check_gemv(1, 2048, 11008, dtype, device, gen, bias=False, split_k="never"),
        "gemv_nosplit_m8": lambda: check_gemv(8, 2048, 11008, dtype, device, gen, bias=False, split_k="never"),
        "silu_mul_gemv_m1": lambda: check_silu_mul_gemv(1, 2048, 11008, dtype, device, gen),
        "silu_mul_gemv_nosplit_m1": lambda: check_silu_mul_gemv(1, 2048, 11008, dtype, device, gen, split_k="never"),
        "silu_mul_gemv_m8": lambda: check_silu_mul_gemv(8, 2048, 11008, dtype, device, gen),
        "rotary_write_kv": lambda: check_rotary_write_kv([512, 1, 77], [512, 900, 1077], Hq, Hkv, D, bs, dtype,
                                                         device, gen),
        # RoPE and the K/V write inside the decode attention (inf if its cache is not rope_kv's bits)
        "rope_decode_attn": lambda: rope_decode_err([2048] * 60 + [1, 17, 0, 4000], Hq, Hkv, D, bs, dtype, device,
                                                    gen),
    }


# ---------------------------------------------------------------------------- int8 weight-only (phase 06b)
def _int8_weight(N, K, dtype, device, gen):
    from ..kernels.reference import quantize_int8

    q, s = quantize_int8(_rand((N, K), torch.float32, "cpu", gen, K ** -0.5), scale_dtype=dtype)
    return q.to(device), s.to(device)


def _int8_reference(x, q, s, b):
    """(x @ q^T) * scale + b in float64: the math the int8 kernels compute in fp32."""
    out = (x.double() @ q.double().T) * s.double()
    return out + b.double() if b is not None else out


def check_gemv_int8(M, N, K, dtype, device, gen, bias=True, config=None, split_k="auto", magic=True) -> float:
    from ..kernels.gemv_int8 import gemv_int8

    x = _rand((M, K), dtype, device, gen)
    q, s = _int8_weight(N, K, dtype, device, gen)
    b = _rand((N,), dtype, device, gen) if bias else None
    out = torch.full((M, N), float("nan"), dtype=dtype, device=device)
    gemv_int8(x, q, s, b, config=config, out=out, split_k=split_k, magic=magic)
    return rel_err(out, _int8_reference(x, q, s, b))


def check_silu_mul_gemv_int8(M, N, I, dtype, device, gen, config=None, split_k="auto") -> float:
    from ..kernels.gemv_int8 import silu_mul_gemv_int8
    from ..kernels.reference import silu_and_mul

    gate_up = _rand((M, 2 * I), dtype, device, gen, 2.0)
    q, s = _int8_weight(N, I, dtype, device, gen)
    out = torch.full((M, N), float("nan"), dtype=dtype, device=device)
    silu_mul_gemv_int8(gate_up, q, s, config=config, out=out, split_k=split_k)
    return rel_err(out, _int8_reference(silu_and_mul(gate_up.double()), q, s, None))


def check_gemm_int8(M, N, K, dtype, device, gen, bias=True, config=None) -> float:
    from ..kernels.gemv_int8 import gemm_int8

    x = _rand((M, K), dtype, device, gen)
    q, s = _int8_weight(N, K, dtype, device, gen)
    b = _rand((N,), dtype, device, gen) if bias else None
    out = torch.full((M, N), float("nan"), dtype=dtype, device=device)
    gemm_int8(x, q, s, b, config=config, out=out)
    return rel_err(out, _int8_reference(x, q, s, b))


def check_dequant_linear_int8(M, N, K, dtype, device, gen, bias=True) -> float:
    """The prefill path: ``dequantize_int8`` then torch's linear (cuBLAS on the GPU)."""
    from ..kernels.gemv_int8 import dequantize_int8

    x = _rand((M, K), dtype, device, gen)
    q, s = _int8_weight(N, K, dtype, device, gen)
    b = _rand((N,), dtype, device, gen) if bias else None
    out = torch.nn.functional.linear(x, dequantize_int8(q, s), b)
    return rel_err(out, _int8_reference(x, q, s, b))


def check_gemv_int8_planes(M, N, K, dtype, device, gen, bias=True, config=None, silu_mul=False) -> float:
    """``int8_planes``' kernel (digit planes of x on the integer MMAs), plain or with SiLU·mul."""
    from ..kernels.int8_planes import gemv_int8_planes, silu_mul_gemv_int8_planes
    from ..kernels.reference import silu_and_mul

    q, s = _int8_weight(N, K, dtype, device, gen)
    out = torch.full((M, N), float("nan"), dtype=dtype, device=device)
    if silu_mul:
        gate_up = _rand((M, 2 * K), dtype, device, gen, 2.0)
        silu_mul_gemv_int8_planes(gate_up, q, s, config=config, out=out)
        return rel_err(out, _int8_reference(silu_and_mul(gate_up.double()), q, s, None))
    x = _rand((M, K), dtype, device, gen)
    b = _rand((N,), dtype, device, gen) if bias else None
    gemv_int8_planes(x, q, s, b, config=config, out=out)
    return rel_err(out, _int8_reference(x, q, s, b))


def _split_gemm():
    from ..kernels.gemv_int8 import Int8GemmConfig

    return Int8GemmConfig(16, 32, 64, group_m=2, split_k=3)  # 3 K slices of 200: partials + the reduce


def int8_checks(dtype, device, gen, full: bool = False) -> dict:
    """The int8 kernels against float64, one name -> thunk returning a relative error. ``full``:
    the 3B shapes (qkv 2560x2048 with bias, down 2048x11008, gate_up 22016x2048) on the GPU; else
    small odd shapes the CPU interpreter runs in seconds."""
    from ..kernels.int8_planes import supported as planes_supported

    if full:
        qkv, o, gu, down = (2560, 2048), (2048, 2048), (22016, 2048), (2048, 11008)
        return {
            "gemv_int8_m1_qkv": lambda: check_gemv_int8(1, *qkv, dtype, device, gen),
            "gemv_int8_m1_o": lambda: check_gemv_int8(1, *o, dtype, device, gen, bias=False),
            "gemv_int8_m1_gate_up": lambda: check_gemv_int8(1, *gu, dtype, device, gen, bias=False),
            "gemv_int8_m1_down": lambda: check_gemv_int8(1, *down, dtype, device, gen, bias=False),
            "gemv_int8_m4_qkv": lambda: check_gemv_int8(4, *qkv, dtype, device, gen),
            "gemv_int8_m8_down": lambda: check_gemv_int8(8, *down, dtype, device, gen, bias=False),
            "silu_mul_gemv_int8_m1": lambda: check_silu_mul_gemv_int8(1, *down, dtype, device, gen),
            "silu_mul_gemv_int8_m8": lambda: check_silu_mul_gemv_int8(8, *down, dtype, device, gen),
            "gemv_int8_m64_down": lambda: check_gemv_int8(64, *down, dtype, device, gen, bias=False),
            "gemv_int8_m16_qkv": lambda: check_gemv_int8(16, *qkv, dtype, device, gen),
            "gemm_int8_m64_qkv": lambda: check_gemm_int8(64, *qkv, dtype, device, gen),
            "gemm_int8_m64_down": lambda: check_gemm_int8(64, *down, dtype, device, gen, bias=False),
            "gemm_int8_m512_gate_up": lambda: check_gemm_int8(512, *gu, dtype, device, gen, bias=False),
            "dequant_linear_int8_m2048_qkv": lambda: check_dequant_linear_int8(2048, *qkv, dtype, device, gen),
        } | ({} if dtype == torch.float32 or not planes_supported(torch.device(device)) else {  # 16-bit x, sm_80+
            "planes_int8_m1_qkv": lambda: check_gemv_int8_planes(1, *qkv, dtype, device, gen),
            "planes_int8_m1_gate_up": lambda: check_gemv_int8_planes(1, *gu, dtype, device, gen, bias=False),
            "planes_int8_m1_silu_down": lambda: check_gemv_int8_planes(1, *down, dtype, device, gen, silu_mul=True),
            "planes_int8_m8_o": lambda: check_gemv_int8_planes(8, *o, dtype, device, gen, bias=False),
            "planes_int8_m8_silu_down": lambda: check_gemv_int8_planes(8, *down, dtype, device, gen, silu_mul=True),
        })
    return {
        "gemv_int8_m1": lambda: check_gemv_int8(1, 45, 200, dtype, device, gen),
        "gemv_int8_m1_split": lambda: check_gemv_int8(1, 45, 200, dtype, device, gen, config=GemvConfig(2, 64, 3)),
        "gemv_int8_m5": lambda: check_gemv_int8(5, 45, 200, dtype, device, gen),
        "gemv_int8_m8_split": lambda: check_gemv_int8(8, 45, 200, dtype, device, gen, bias=False),
        "silu_mul_gemv_int8_m1": lambda: check_silu_mul_gemv_int8(1, 33, 150, dtype, device, gen),
        "silu_mul_gemv_int8_m3": lambda: check_silu_mul_gemv_int8(3, 33, 150, dtype, device, gen),
        "gemv_int8_m40_split": lambda: check_gemv_int8(40, 45, 600, dtype, device, gen),
        "gemm_int8_m40": lambda: check_gemm_int8(40, 45, 200, dtype, device, gen),
        "gemm_int8_m40_split": lambda: check_gemm_int8(40, 45, 600, dtype, device, gen, config=_split_gemm()),
        "dequant_linear_int8_m40": lambda: check_dequant_linear_int8(40, 45, 200, dtype, device, gen),
    }
