"""Batch invariance of paged attention (deterministic mode, issue 15): the checks and the timings.

``invariance_checks`` computes the rows of one "main" sequence many ways — prefilled in one
chunk alone, the same chunk inside batches of other sequences, in chunks of 16 or 33 tokens,
from a cached prefix, chunks starting at each tile-row offset, decoded alone, decoded inside
a padded decode batch, decoded inside a mixed batch — and says, per case, whether every row
is bit-identical (``torch.equal``) to the one-chunk prefill. The main sequence spans several
``kv_split``s and its cache slots past its length hold NaN, so a kernel that lets unwritten
slots leak fails. ``attn`` picks the attention under test: ``invariant_attention`` (default)
or ``legacy_attention`` (the engine's paged_decode / paged_prefill dispatch, which is not
invariant); ``baseline`` computes the one-chunk rows instead, to show that a change of
launch constants (e.g. another ``kv_split``) is seen.

``attention_timings`` times ``paged_attention_invariant`` against ``paged_decode_attention``
(batch 1 and 64 at context 512) and ``paged_prefill_attention`` (a 512-token prefill) with
CUDA events, on the GPU. A notebook calls both; tests call only the checks.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch

from ..kernels._util import cdiv
from ..kernels.paged_decode import paged_decode_attention
from ..kernels.paged_invariant import KV_SPLIT, invariant_block_m, paged_attention_invariant
from ..kernels.paged_prefill import paged_prefill_attention
from ..model.attention import AttentionMetadata
from .kernel_bench.timing import graph_ms

Attention = Callable[..., torch.Tensor]  # (q, k_cache, v_cache, meta, scale) -> out

CASES = ("prefill_in_batches", "chunks_of_16", "chunks_of_33_in_batches", "prefix_cached", "tile_row_offsets",
         "decode_alone", "decode_in_padded_batch", "decode_in_mixed_batch")


def invariant_attention(**launch) -> Attention:
    """``paged_attention_invariant`` with fixed launch constants (kv_split, block_m, block_n,
    prefill_block_m)."""
    return functools.partial(paged_attention_invariant, **launch)


def legacy_attention(q, k_cache, v_cache, meta, scale) -> torch.Tensor:
    """What ``TritonOps.paged_attention`` runs: the split-K decode kernel for pure decode
    batches, the prefill kernel otherwise."""
    if meta.max_query_len == 1 and q.shape[0] == meta.seq_lens.shape[0]:
        return paged_decode_attention(q, k_cache, v_cache, meta.seq_lens, meta.block_tables, scale)
    return paged_prefill_attention(q, k_cache, v_cache, meta, scale)


class PagedPool:
    """Sequences over one random paged KV cache: ``lengths[i]`` tokens each, blocks in random
    order, slots past a sequence's length left NaN; one fixed q row per (sequence, position)."""

    def __init__(self, lengths: list[int], num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                 dtype: torch.dtype, device, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.lengths, self.block_size, self.device = list(lengths), block_size, device
        need = [cdiv(n, block_size) for n in lengths]
        perm = torch.randperm(sum(need) + 2, generator=gen).tolist()
        self.blocks, used = [], 0
        for n in need:
            self.blocks.append(perm[used:used + n])
            used += n
        shape = (len(perm), block_size, num_kv_heads, head_dim)
        self.k_cache = torch.full(shape, float("nan"), dtype=dtype)
        self.v_cache = torch.full(shape, float("nan"), dtype=dtype)
        for blocks, n in zip(self.blocks, lengths):
            slots = torch.tensor([blocks[p // block_size] * block_size + p % block_size for p in range(n)], dtype=torch.long)
            self.k_cache.view(-1, num_kv_heads, head_dim)[slots] = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
            self.v_cache.view(-1, num_kv_heads, head_dim)[slots] = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        self.k_cache, self.v_cache = self.k_cache.to(device), self.v_cache.to(device)
        self.q = [torch.randn(n, num_heads, head_dim, generator=gen).to(device=device, dtype=dtype) for n in lengths]
        self.scale = head_dim ** -0.5

    def batch(self, entries: list[tuple[int | None, int, int]], extra_cols: int = 0):
        """One step's (q, meta): entry (i, start, end) = sequence i's positions start..end-1 as
        new tokens over a cached prefix 0..start-1; (None, 0, 1) = a padding row (seq_len 0)."""
        qs, qsl, lens, rows = [], [0], [], []
        for i, start, end in entries:
            if i is None:
                qs.append(torch.zeros_like(self.q[0][:1]))
                lens.append(0)
                rows.append([0])
            else:
                qs.append(self.q[i][start:end])
                lens.append(end)
                rows.append(self.blocks[i])
            qsl.append(qsl[-1] + qs[-1].shape[0])
        width = max(len(r) for r in rows) + extra_cols
        table = torch.zeros(len(entries), width, dtype=torch.int32)
        for b, r in enumerate(rows):
            table[b, :len(r)] = torch.tensor(r, dtype=torch.int32)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.full((qsl[-1],), -1, dtype=torch.int64, device=dev),  # nothing written: K/V are in place
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
            block_tables=table.to(dev), max_query_len=max(qsl[j + 1] - qsl[j] for j in range(len(entries))),
            max_seq_len=max(lens), query_start_loc_cpu=qsl, seq_lens_cpu=lens)
        return torch.cat(qs), meta

    def run(self, attn: Attention, entries, extra_cols: int = 0) -> list[torch.Tensor]:
        """Each entry's output rows [end - start, Hq, D], from one call of ``attn``."""
        q, meta = self.batch(entries, extra_cols)
        out = attn(q, self.k_cache, self.v_cache, meta, self.scale)
        return [out[meta.query_start_loc_cpu[j]:meta.query_start_loc_cpu[j + 1]] for j in range(len(entries))]


def _case_rows(pool: PagedPool, attn: Attention, case: str, kv_split: int, q_tok: int) -> tuple[list[int], torch.Tensor]:
    """(positions, rows [len(positions), Hq, D]) of sequence 0 computed the way ``case`` says.
    Sequences 1..3 of the pool are the company: shorter, longer, and a one-block one."""
    N = pool.lengths[0]
    o1, o2, o3 = pool.lengths[1], pool.lengths[2], pool.lengths[3]
    if case == "prefill_in_batches":  # company before and after, a wide table
        a = pool.run(attn, [(1, o1 // 2, o1), (0, 0, N), (None, 0, 1), (2, o2 - 1, o2)], extra_cols=5)[1]
        b = pool.run(attn, [(3, 0, o3), (2, o2 - 20, o2), (0, 0, N)])[2]
        return list(range(N)) * 2, torch.cat([a, b])
    if case in ("chunks_of_16", "chunks_of_33_in_batches"):
        size = 16 if case == "chunks_of_16" else 33
        rows = []
        for start in range(0, N, size):
            end = min(N, start + size)
            if case == "chunks_of_16":
                rows += pool.run(attn, [(0, start, end)])
            else:  # with a decode of another sequence before it, a chunk after it
                p2 = o2 // 2 + start
                rows.append(pool.run(attn, [(2, p2, p2 + 1), (0, start, end), (1, o1 - 5, o1)])[1])
        return list(range(N)), torch.cat(rows)
    if case == "prefix_cached":  # one chunk starting mid-sequence (mid-block and mid-split)
        start = min(N - 1, kv_split + 5)
        return list(range(start, N)), pool.run(attn, [(0, start, N)])[0]
    if case == "tile_row_offsets":  # the same tokens at every row offset of a tile
        pos, rows = [], []
        for shift in range(1, max(2, q_tok)):
            start = N - 2 * q_tok - shift
            pos += list(range(start, N))
            rows += pool.run(attn, [(0, start, N)])
        return pos, torch.cat(rows)
    positions = sorted({min(N - 1, p) for p in (0, 1, q_tok, kv_split - 1, kv_split, 2 * kv_split + 3, N - 1)})
    if case == "decode_alone":
        return positions, torch.cat([pool.run(attn, [(0, p, p + 1)])[0] for p in positions])
    if case == "decode_in_padded_batch":  # a CUDA-graph-style batch: other decodes, padding rows, a wide table
        rows = [pool.run(attn, [(1, o1 - 1, o1), (None, 0, 1), (0, p, p + 1), (3, o3 - 1, o3), (None, 0, 1)],
                         extra_cols=7)[2] for p in positions]
        return positions, torch.cat(rows)
    if case == "decode_in_mixed_batch":  # the decode beside prefill chunks: the general path
        rows = [pool.run(attn, [(2, o2 - 7, o2), (0, p, p + 1), (1, o1 - 9, o1)])[1] for p in positions]
        return positions, torch.cat(rows)
    raise ValueError(f"unknown case {case!r}; known: {CASES}")


def invariance_checks(
    num_heads: int = 16, num_kv_heads: int = 2, head_dim: int = 128, block_size: int = 16,
    dtype: torch.dtype = torch.bfloat16, device="cuda", *, main_len: int = 1100, kv_split: int | None = None,
    block_m: int | None = None, block_n: int | None = None, prefill_block_m: int | None = None, cases=CASES,
    attn: Attention | None = None, baseline: Attention | None = None, seed: int = 0,
) -> dict[str, bool]:
    """{case: every row of the main sequence bit-identical to its one-chunk prefill}.

    ``attn`` defaults to ``paged_attention_invariant`` with the given launch constants (None:
    the module defaults); ``baseline`` (default ``attn``) computes the one-chunk rows. The
    company sequences are about 0.6x, 1.4x and 0.1x ``main_len`` long."""
    launch = {k: v for k, v in (("kv_split", kv_split), ("block_m", block_m), ("block_n", block_n),
                                ("prefill_block_m", prefill_block_m)) if v}
    attn = attn or invariant_attention(**launch)
    baseline = baseline or attn
    ks = kv_split or KV_SPLIT
    q_tok = (block_m or invariant_block_m(num_heads // num_kv_heads)) // (num_heads // num_kv_heads)
    lengths = [main_len, max(2, int(main_len * 0.6)), int(main_len * 1.4) + 1, max(2, main_len // 10)]
    pool = PagedPool(lengths, num_heads, num_kv_heads, head_dim, block_size, dtype, device, seed)
    full = pool.run(baseline, [(0, 0, main_len)])[0]
    result = {}
    for case in cases:
        positions, rows = _case_rows(pool, attn, case, ks, q_tok)
        result[case] = bool(torch.equal(rows, full[positions]))
    return result


# ------------------------------------------------------------------------------ timings (GPU)
def _time_us(fn, iters: int = 20) -> float:
    """Microseconds per call of ``fn``, replayed from a CUDA graph (``kernel_bench.timing.graph_ms``),
    so that host launch overhead (tens of µs per eager call here) is not what gets measured."""
    return 1e3 * graph_ms(lambda i: fn(), calls=iters)


def attention_timings(
    num_heads: int = 16, num_kv_heads: int = 2, head_dim: int = 128, block_size: int = 16,
    dtype: torch.dtype = torch.bfloat16, context: int = 512, batches=(1, 64), prefill_len: int = 512,
    iters: int = 20, **launch,
) -> dict[str, float]:
    """Microseconds per call (CUDA events over CUDA-graph replays) of paged_attention_invariant vs
    paged_decode_attention (decode at ``batches``, every sequence at ``context``) and vs
    paged_prefill_attention (one ``prefill_len``-token prompt). ``launch``: kv_split, block_m, block_n."""
    attn = invariant_attention(**launch)
    times = {}
    for bs in batches:
        pool = PagedPool([context] * bs, num_heads, num_kv_heads, head_dim, block_size, dtype, "cuda")
        q, meta = pool.batch([(i, context - 1, context) for i in range(bs)])
        kc, vc, sc = pool.k_cache, pool.v_cache, pool.scale
        times[f"decode_b{bs}_invariant_us"] = _time_us(lambda: attn(q, kc, vc, meta, sc), iters)
        times[f"decode_b{bs}_split_k_us"] = _time_us(
            lambda: paged_decode_attention(q, kc, vc, meta.seq_lens, meta.block_tables, sc), iters)
    pool = PagedPool([prefill_len], num_heads, num_kv_heads, head_dim, block_size, dtype, "cuda")
    q, meta = pool.batch([(0, 0, prefill_len)])
    kc, vc, sc = pool.k_cache, pool.v_cache, pool.scale
    times[f"prefill_{prefill_len}_invariant_us"] = _time_us(lambda: attn(q, kc, vc, meta, sc), iters)
    times[f"prefill_{prefill_len}_prefill_us"] = _time_us(lambda: paged_prefill_attention(q, kc, vc, meta, sc), iters)
    return times
