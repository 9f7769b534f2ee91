"""The plain-PyTorch math every kernel here is checked against.

One function per operation, written for clarity, not speed; ``pageserve.model.ops.TorchOps``
runs these same functions, so the model's reference path and the kernels' references are
one piece of code. Shapes: T tokens, H hidden, Hq / Hkv query / KV heads, D head_dim.
"""
from __future__ import annotations

import torch


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # x: [T, K], weight: [N, K] -> [T, N]
    return torch.nn.functional.linear(x, weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [T, H]; statistics in fp32 whatever the storage dtype (as HF does)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual' = x + residual; returns (rms_norm(residual'), residual')."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def split_products(x: torch.Tensor, weight: torch.Tensor, slices: int) -> torch.Tensor:
    """x [T, K] @ weight [N, K]^T over ``slices`` equal K slices, each product kept in fp32 ->
    [slices, T, N] (slice s: columns [s K / slices, (s + 1) K / slices)). In fp32 here; on the GPU one
    batched cuBLAS call with fp32 outputs (``model.triton_ops.split_products``)."""
    T, K = x.shape
    ks = K // slices
    xs = x.float().reshape(T, slices, ks).transpose(0, 1)  # [slices, T, ks]
    ws = weight.float().reshape(weight.shape[0], slices, ks).permute(1, 2, 0)  # [slices, ks, N]
    return torch.bmm(xs, ws)


def split_sum(parts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A product from its K slices' fp32 partials [slices, T, N]: added in slice order, rounded once
    to ``dtype`` -> [T, N] (what ``norm``'s kernels do with a ``SplitSum`` before the residual add)."""
    acc = parts[0]
    for p in parts[1:]:
        acc = acc + p
    return acc.to(dtype)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    # gate_up: [T, 2I] -> [T, I]
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def silu_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The MLP's down projection of its gate|up output: linear(silu_and_mul(gate_up), weight).
    gate_up: [T, 2I], weight: [N, I] -> [T, N]."""
    return linear(silu_and_mul(gate_up), weight, None)


def rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE. q: [T, Hq, D], k: [T, Hkv, D], cos_sin: [max_pos, D] fp32
    (cos in the first half, sin in the second)."""
    cs = cos_sin[positions]  # [T, D]
    cos, sin = cs.chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [T, 1, D/2]

    def rot(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rot(q), rot(k)


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """k, v: [T, Hkv, D] into caches [N, block_size, Hkv, D] at slot_mapping [T] (-1 skipped)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[keep]
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[keep]


def rotary_write_kv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on q and k, then the rotated k and v into the paged cache (slot -1 skipped).
    Returns (q_rot, k_rot)."""
    q, k = rotary(q, k, positions, cos_sin)
    write_kv(k, v, k_cache, v_cache, slot_mapping)
    return q, k


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta, scale: float
) -> torch.Tensor:
    """q: [T, Hq, D] -> [T, Hq, D]. One sequence at a time: slow and plainly right.
    ``meta``: an ``AttentionMetadata`` (query_start_loc, seq_lens, block_tables; the host
    copies ``query_start_loc_cpu`` / ``seq_lens_cpu`` when set, to avoid syncs)."""
    T, Hq, D = q.shape
    block_size, Hkv = k_cache.shape[1], k_cache.shape[2]
    group = Hq // Hkv
    out = torch.zeros_like(q)
    qsl = meta.query_start_loc_cpu or meta.query_start_loc.tolist()
    lens = meta.seq_lens_cpu or meta.seq_lens.tolist()
    for i, ctx in enumerate(lens):
        start, end = qsl[i], qsl[i + 1]
        q_len = end - start
        if q_len == 0 or ctx == 0:
            continue
        n_blocks = (ctx + block_size - 1) // block_size
        blocks = meta.block_tables[i, :n_blocks].long()
        kk = k_cache[blocks].reshape(-1, Hkv, D)[:ctx]  # [ctx, Hkv, D]
        vv = v_cache[blocks].reshape(-1, Hkv, D)[:ctx]
        qi = q[start:end].float().transpose(0, 1)  # [Hq, q_len, D]
        kk = kk.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, ctx, D]
        vv = vv.float().repeat_interleave(group, dim=1).transpose(0, 1)
        scores = torch.matmul(qi, kk.transpose(1, 2)) * scale  # [Hq, q_len, ctx]
        q_pos = torch.arange(ctx - q_len, ctx, device=q.device)
        k_pos = torch.arange(ctx, device=q.device)
        scores.masked_fill_(k_pos[None, :] > q_pos[:, None], float("-inf"))
        out[start:end] = torch.matmul(scores.softmax(-1), vv).transpose(0, 1).to(q.dtype)
    return out


# ---------------------------------------------------------------------------- int8 weight-only (W8A16)
def quantize_int8(weight: torch.Tensor, scale_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8: weight [N, K] -> (qweight [N, K] int8, scale [N]).

    scale = max|w_row| / 127, stored in ``scale_dtype`` (default: the weight's); q = round(w / scale)
    with the *stored* scale, clamped to [-127, 127], so that q * scale is the closest grid to w
    that the kernels will see. An all-zero row gets scale 1 and q = 0."""
    scale_dtype = scale_dtype or weight.dtype
    w = weight.float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax)).to(scale_dtype)
    q = torch.round(w / scale.float()[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # qweight: [N, K] int8, scale: [N] -> [N, K] in scale's dtype (one rounding of q * scale)
    return qweight.to(scale.dtype) * scale[:, None]


def linear_int8(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """linear(x, dequantize_int8(qweight, scale), bias): x [T, K], qweight [N, K] int8, scale [N] -> [T, N].
    (The kernels compute (x @ q^T) * scale in fp32 instead: the same value up to where they round.)"""
    return linear(x, dequantize_int8(qweight, scale).to(x.dtype), bias)


def silu_mul_linear_int8(gate_up: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The MLP's down projection with an int8 weight: linear_int8(silu_and_mul(gate_up), qweight, scale, None)."""
    return linear_int8(silu_and_mul(gate_up), qweight, scale, None)


# ---------------------------------------------------------------------------- batch-invariant matmul (deterministic mode)
def matmul_invariant_reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w^T + bias with ``matmul_invariant``'s rounding points: the products summed in at
    least fp32, the bias added to the unrounded sum, one rounding to x's dtype. x: [T, K],
    w: [N, K], bias: [N] -> [T, N]. Given float64 tensors it is the exact value to check against."""
    acc_dtype = torch.promote_types(x.dtype, torch.float32)
    acc = x.to(acc_dtype) @ w.to(acc_dtype).T
    if bias is not None:
        acc = acc + bias.to(acc_dtype)
    return acc.to(x.dtype)


def gate_up_silu_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """SiLU(x @ gate^T) * (x @ up^T) with ``kernels.gate_up_silu``'s rounding points: the gate|up
    product summed in at least fp32 and rounded to x's dtype, then SiLU·mul in fp32, rounded once.
    x: [T, K], w: the gate|up matrix [2I, K] (gate rows first) -> [T, I]."""
    gate_up = matmul_invariant_reference(x, w)
    acc_dtype = torch.promote_types(x.dtype, torch.float32)
    gate, up = gate_up.to(acc_dtype).chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


def all_reduce_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """The one-shot all-reduce's result: every rank's tensor summed in rank order in fp32,
    rounded once to the storage dtype (so every rank gets the same bits)."""
    acc = torch.zeros_like(parts[0], dtype=torch.float32)
    for p in parts:
        acc += p.float()
    return acc.to(parts[0].dtype)


def stage_decode_inputs(
    input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor, seq_lens: torch.Tensor,
    block_tables: torch.Tensor, dst: tuple[torch.Tensor, ...], padded: int,
) -> None:
    """A decode step's [bs] / [bs, nb] inputs into static [max_bs] / [max_bs, max_blocks]
    buffers (converting dtypes); rows bs..padded-1 become padding: id 0, position 0, slot -1
    (no KV write), length 0 (no attention). Table columns past nb are left alone."""
    ids, pos, slots, lens, tables = dst
    bs, nb = block_tables.shape
    ids[:bs].copy_(input_ids)
    pos[:bs].copy_(positions)
    slots[:bs].copy_(slot_mapping)
    lens[:bs].copy_(seq_lens)
    tables[:bs, :nb].copy_(block_tables)
    ids[bs:padded].zero_()
    pos[bs:padded].zero_()
    slots[bs:padded].fill_(-1)
    lens[bs:padded].zero_()


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x: [B, V] -> [B] int64: each row's first maximal index (NaN counts as the largest)."""
    return x.argmax(dim=-1)


def unpack_token_bits(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[G, W] int32 words, token t at bit ``t % 32`` of word ``t // 32`` -> [G, vocab_size] bool."""
    shifts = torch.arange(32, device=bits.device, dtype=torch.int32)
    return ((bits[:, :, None] >> shifts) & 1).view(bits.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """In place: row ``rows[i]``'s tokens whose bit is clear in ``bits[i]`` ([G, W] int32 words, token t at bit
    ``t % 32`` of word ``t // 32``) become -inf, within the first ``vocab_size`` columns. Returns ``logits``."""
    allowed = unpack_token_bits(bits, vocab_size)
    sub = logits[:, :vocab_size]
    sub[rows] = sub[rows].masked_fill(~allowed, float("-inf"))
    return logits


def lora_shrink(x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor, width: int,
                norm_weight: torch.Tensor | None = None, eps: float = 0.0, silu_mul: bool = False) -> torch.Tensor:
    """LoRA's first product for rows of different adapters: ``x`` [T, K] @ ``a`` [C, K]^T, each row keeping only
    the columns of its slot ``token_slots[t]`` (column c: slot ``c // width``; -1: none, a row of zeros). A select,
    not a product with a mask: another slot's inf times 0 would be NaN. ``norm_weight``: x is
    ``rms_norm(x, norm_weight, eps)`` first; ``silu_mul``: x is gate|up and the input ``silu_and_mul(x)``."""
    if norm_weight is not None:
        x = rms_norm(x, norm_weight, eps)
    elif silu_mul:
        x = silu_and_mul(x)
    T = x.shape[0]
    cols = torch.arange(a.shape[0], device=x.device) // width
    own = cols[None, :] == token_slots[:T, None]
    return torch.where(own, linear(x, a, None), 0.0).to(x.dtype)


# ---- sampling: the seeded noise's hash and the candidate race (``engine/sampler.py``; ``kernels/candidate_race.py``)
MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15  # odd constants: the step and token multipliers of the hash
TOKEN_MUL = 0xD6E8FEB86659FD93
UNIFORM_BITS = 23  # u = (k + 0.5) / 2**23 is exact in fp32 and strictly inside (0, 1)
# the sampler's [7, B] parameter table: the rows the candidate race reads
TABLE_TEMP, TABLE_TOP_K, TABLE_TOP_P, TABLE_MIN_P = range(4)


def signed64(x: int) -> int:
    """A uint64 value as the int64 with the same bits."""
    x &= MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


def _srl(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of an int64 tensor (torch's ``>>`` is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def mix64_tensor(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser on int64 tensors; multiplication wraps like uint64."""
    x = (x ^ _srl(x, 30)) * signed64(0xBF58476D1CE4E5B9)
    x = (x ^ _srl(x, 27)) * signed64(0x94D049BB133111EB)
    return x ^ _srl(x, 31)


def seeded_uniform_at(seeds: torch.Tensor, steps: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """The sampler's ``seeded_uniform`` at the given ids: seeds, steps int64 [S] (a seed as ``signed64``),
    token_ids int64 [S, k] -> fp32 [S, k]. The hash is integer arithmetic and the conversion exact, so every
    implementation gives the same bits."""
    row = mix64_tensor(seeds + steps.add(1).mul(signed64(GOLDEN)))  # [S]
    h = mix64_tensor(row[:, None] + token_ids.add(1).mul(signed64(TOKEN_MUL)))  # [S, k]
    return (_srl(h, 64 - UNIFORM_BITS).float() + 0.5) * (2.0 ** -UNIFORM_BITS)


def ordered_keys(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """int64 keys, one per (fp32 value, token id), ordered as the values with ties broken toward the lower id (the
    order a stable descending sort of the whole row gives): the value's bits mapped to a signed int that orders as
    the floats do (negatives' magnitude bits flipped), then the id below them, reversed so a lower id ranks higher."""
    bits = values.contiguous().view(torch.int32).to(torch.int64)
    bits = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return bits * (1 << 32) + (0xFFFFFFFF - ids)


def candidate_filter(values: torch.Tensor, ids: torch.Tensor, k: int, table: torch.Tensor,
                     top_p: bool = True, min_p: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature, top-k, top-p and min-p over each row's candidates: ``values`` / ``ids`` [R, S] (S >= k: a row's
    k + slack highest penalised fp32 logits and their ids, in any order), ``table`` [>= 4, R] (temperature, top_k,
    top_p, min_p: the sampler's parameter table, a disabled top_p stored as 2.0) -> (ids [R, k] best first, ties
    toward the lower id; probs [R, k] unnormalised, 0 where filtered). ``top_p`` / ``min_p`` False: skip the step
    (exact where every row has it off: the mask it would apply is empty)."""
    order = ordered_keys(values, ids).argsort(dim=-1, descending=True)[:, :k]  # unique keys: one order
    ids, values = ids.gather(1, order), values.gather(1, order)  # [R, k], best first
    probs = filter_sorted(values / table[TABLE_TEMP][:, None], table, top_k=True, top_p=top_p).softmax(dim=-1)
    return ids, min_p_filter(probs, table) if min_p else probs


def filter_sorted(x: torch.Tensor, table: torch.Tensor, top_k: bool = True, top_p: bool = True) -> torch.Tensor:
    """``x`` [R, W]: each row's temperature-scaled logits, best first; ``table`` [>= 4, R] (the sampler's) -> ``x``
    with the values past a row's top-k, then past its top-p mass, set to -inf. ``top_k`` / ``top_p`` False: skip
    that step (exact where every row has it off). The candidates' filter and the sampler's whole-row one."""
    if top_k:
        rank = torch.arange(x.shape[1], device=x.device)
        x = x.masked_fill(rank[None, :] >= table[TABLE_TOP_K][:, None], float("-inf"))
    if top_p:
        p_sorted = x.softmax(dim=-1)
        mass_before = p_sorted.cumsum(dim=-1) - p_sorted
        x = x.masked_fill(mass_before >= table[TABLE_TOP_P][:, None], float("-inf"))
    return x


def min_p_filter(probs: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``probs`` [R, W] (any order) with the values under a row's min_p times its largest set to 0."""
    threshold = table[TABLE_MIN_P][:, None] * probs.amax(dim=-1, keepdim=True)
    return probs.masked_fill(probs < threshold, 0.0)


INVALID_ID = 2**31 - 1  # an unused candidate slot's id once gathered: ranked after every real id


def gather_candidates(logits: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 values, ids) of candidate ``ids`` [R, S] in ``logits`` [R, V] (any float dtype): -1 (an unused slot,
    ``topk_candidates``) becomes -inf at ``INVALID_ID``, which the filters rank after every real candidate and give
    probability 0."""
    valid = ids >= 0
    values = logits.gather(1, ids.clamp_min(0)).float().masked_fill(~valid, float("-inf"))
    return values, torch.where(valid, ids, INVALID_ID)


def candidate_race(logits: torch.Tensor, ids: torch.Tensor, k: int, table: torch.Tensor,
                   noise: torch.Tensor | None, seeds: torch.Tensor | None = None,
                   rows: torch.Tensor | None = None) -> torch.Tensor:
    """One token per candidate row: ``candidate_filter`` over ``logits`` [B, V] at ``ids`` [R, S] (-1: an unused
    slot), then the exponential race argmax(probs / q) (its first maximum). ``rows`` [R] int64: each candidate row's
    batch row in ``logits`` and ``table`` [>= 4, B] (None: row r is row r). q: ``noise`` [R, k] (Exp(1) draws in rank order) for
    unseeded rows; for a row with ``seeds[0, r]`` != 0 (``seeds`` [3, R] int64: seeded flag, seed as ``signed64``,
    step), -log of ``seeded_uniform_at`` at the candidate's id. -> [R] int64 token ids."""
    if rows is not None:
        logits, table = logits.index_select(0, rows), table.index_select(1, rows)
    ids, probs = candidate_filter(*gather_candidates(logits, ids), k, table)
    q = noise if noise is not None else torch.ones_like(probs)
    if seeds is not None:
        seeded_q = seeded_uniform_at(seeds[1], seeds[2], ids).log_().neg_()
        q = torch.where(seeds[0][:, None] != 0, seeded_q, q)
    return ids.gather(1, (probs / q).argmax(dim=-1, keepdim=True)).squeeze(1)


def repetition_penalty(logits: torch.Tensor, rows: torch.Tensor, starts: torch.Tensor, ids: torch.Tensor,
                       penalty: torch.Tensor, pending: torch.Tensor | None = None,
                       pending_src: torch.Tensor | None = None) -> torch.Tensor:
    """In place: each token row ``rows[j]`` of ``logits`` [B, V] fp32 has seen (``ids[starts[j]:starts[j + 1]]``,
    and ``pending[pending_src[j]]`` where that index is not -1) is divided by ``penalty[rows[j]]`` where positive,
    multiplied by it where not (a token seen twice is penalised once). Returns ``logits``."""
    for j, row in enumerate(rows.tolist()):
        seen = ids[starts[j]:starts[j + 1]].long()
        if pending_src is not None and int(pending_src[j]) >= 0:
            seen = torch.cat([seen, pending[int(pending_src[j])].view(1).long()])
        seen = seen.unique()
        x = logits[row, seen]
        logits[row, seen] = torch.where(x > 0, x / penalty[row], x * penalty[row])
    return logits


def seen_words(batch: int, vocab_size: int, rows: torch.Tensor, starts: torch.Tensor, ids: torch.Tensor,
               pending: torch.Tensor | None = None, pending_src: torch.Tensor | None = None) -> torch.Tensor:
    """The tokens each row has seen as bits: [batch, ceil(vocab_size / 32)] int32 words, token t of row ``rows[j]``
    at bit ``t % 32`` of word ``t // 32`` for every id in ``ids[starts[j]:starts[j + 1]]`` and ``pending[
    pending_src[j]]`` where that index is not -1 (``repetition_penalty``'s arguments); every other bit clear."""
    seen = torch.zeros(batch, (vocab_size + 31) // 32 * 32, dtype=torch.bool, device=ids.device)
    for j, row in enumerate(rows.tolist()):
        t = ids[starts[j]:starts[j + 1]].long()
        if pending_src is not None and int(pending_src[j]) >= 0:
            t = torch.cat([t, pending[int(pending_src[j])].view(1).long()])
        seen[row, t[(t >= 0) & (t < seen.shape[1])]] = True  # (past the row's words: dropped)
    shifts = torch.arange(32, device=ids.device, dtype=torch.int64)
    words = (seen.view(batch, -1, 32).long() << shifts).sum(-1)  # 0 .. 2**32 - 1
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def apply_seen(logits: torch.Tensor, words: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """``repetition_penalty`` from ``seen_words``'s bits: ``logits`` [B, V] (any float dtype) -> a new fp32 [B, V],
    each row's seen tokens divided by ``penalty`` [B] where positive, multiplied by it where not, the rest as they
    are (the same IEEE operations on the same fp32 values: the same bits)."""
    x = logits.float()
    seen = unpack_token_bits(words, x.shape[1])
    rep = penalty[:, None]
    return torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)


def topk_candidates(x: torch.Tensor, k: int, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's k highest finite values' ids by ``ordered_keys`` (value, then the lower id), best first: ``x``
    [B, V] float, ``rows`` [R] int64 or None -> [R, k] int64, -1 where a row has fewer than k values above -inf."""
    if rows is not None:
        x = x.index_select(0, rows)
    x = x.float()
    ids = torch.arange(x.shape[1], device=x.device).expand_as(x)
    keys = ordered_keys(x, ids).masked_fill(x == float("-inf"), torch.iinfo(torch.int64).min)
    top = keys.topk(min(k, x.shape[1]), dim=-1).indices
    top = top.masked_fill(x.gather(1, top) == float("-inf"), -1)
    return torch.nn.functional.pad(top, (0, k - top.shape[1]), value=-1)
