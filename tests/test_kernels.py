"""Every Triton kernel against its plain-PyTorch reference on fresh random inputs.

CPU: the kernels run on Triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py and
below before triton is imported; pageserve.kernels never sets it) on small shapes in fp32 and bf16.
CUDA: the same tests on larger shapes in fp32, fp16 and bf16, plus CUDA-graph capture.
Outputs are poisoned with NaN first; a NaN left anywhere fails the check (rel_err = inf).
"""
import os
import subprocess
import sys
import types
import zlib

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pageserve.model.triton_ops import TritonOps

from pageserve.lab import kernel_checks as checks  # noqa: E402
from pageserve.lab.kernel_checks import TOLERANCE  # noqa: E402
from pageserve.kernels.gemv import GemvConfig  # noqa: E402
from pageserve.kernels.paged_decode import (MAX_SPLITS, MIN_SPLIT_TOKENS, DecodeSchedule,  # noqa: E402
                                             decode_num_splits, decode_schedule, paged_decode_attention)

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16] if CUDA else [torch.float32, torch.bfloat16]
BIG = 8 if CUDA else 1  # context-length multiplier on the GPU


@pytest.fixture
def gen(request):
    # a fresh, distinct stream per test case, seeded from its name, the same in every process (hash() of a str is salted per process)
    return torch.Generator().manual_seed(zlib.crc32(request.node.name.encode()))


def _ok(err, dtype):
    assert err <= TOLERANCE[dtype], f"relative error {err:.3g} > {TOLERANCE[dtype]:.0e} ({dtype})"


# (Hq, Hkv, head_dim, block_size): GQA ratios 1, 2, 8 and Qwen2.5-0.5B's 7; head_dim 64, 128
ATTN_SHAPES = [(4, 4, 64, 16), (8, 4, 128, 16), (16, 2, 128, 16), (14, 2, 64, 32)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ATTN_SHAPES, ids=lambda s: "hq%d-hkv%d-d%d-bs%d" % s)
@pytest.mark.parametrize("num_splits", [None, 1, 3])  # 1: the split kernel writes the output itself
def test_decode_attention_matches_reference_across_block_boundaries_and_padding_rows(shape, dtype, num_splits, gen):
    Hq, Hkv, D, bs = shape
    # 0 = padding row (must come out zero), 1 token, exactly one/two blocks, partial last block
    ctx = [0, 1, bs, 2 * bs + 1, 3 * bs - 1 + 40 * (BIG - 1)]
    err = checks.check_decode(ctx, Hq, Hkv, D, bs, dtype, DEVICE, gen, num_splits=num_splits)
    _ok(err, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("schedule", ["pipelined", "split"])
# (batch, KV heads): on the interpreter's 4 "SMs" the pipelined rule's split branch, then its one-split
# 128-, 64- and 32-key tiles and the 2-stage tile (on a GPU, the branches its SM count gives)
@pytest.mark.parametrize("batch,hkv", [(1, 1), (1, 2), (3, 2), (6, 2), (9, 2)])
def test_decode_attention_schedules_match_reference(schedule, batch, hkv, dtype, gen):
    # each schedule's launch (splits, key tile, warps, stages, prefetch) over a padded batch
    ctx = [0, 1, 17, 2 * 16 + 1, 70 * BIG, 33, 16, 5, 129][:batch] if batch > 1 else [70 * BIG]
    err = checks.check_decode(ctx, 8, hkv, 64, 16, dtype, DEVICE, gen, schedule=schedule)
    _ok(err, dtype)


def test_decode_schedule_pipelined_rule_and_its_fallbacks():
    # the H200 (132 SMs), Qwen2.5-3B heads (2 KV heads, head_dim 128), bf16, a 2,048-token table
    def h200(batch, elem=2, pipelined=True, head_dim=128):
        return decode_schedule(batch, 2, head_dim, elem, 128, 16, 132, pipelined)

    assert h200(1) == DecodeSchedule(16, 32, 4, 3, True)  # few pairs: the split rule's count, 32-key tiles
    assert h200(32) == DecodeSchedule(decode_num_splits(32, 2, 128, 16, 132), 32, 4, 3, True)
    assert h200(33) == DecodeSchedule(1, 128, 8, 3, True)  # from half an SM's worth of pairs: one split
    assert h200(64) == DecodeSchedule(1, 128, 8, 3, True)
    assert h200(128) == DecodeSchedule(1, 64, 4, 3, True)
    assert h200(256) == DecodeSchedule(1, 32, 4, 3, True)
    assert h200(512) == DecodeSchedule(1, 64, 4, 2, True)  # above four pairs an SM: the split rule's launch
    split_rule = [DecodeSchedule(decode_num_splits(b, 2, 128, 16, 132), 32 if 8 * b <= 132 else 64, 4, 2, True)
                  for b in (1, 16, 64, 512)]
    for kw in ({"pipelined": False}, {"elem": 4}, {"head_dim": 256}):  # other GPUs, fp32, wide heads
        assert [h200(b, **kw) for b in (1, 16, 64, 512)] == split_rule


def test_decode_attention_ignores_spare_block_table_columns(gen):
    # a wide table (as an engine sized for long contexts allocates) changes only the split count
    err = checks.check_decode([5, 40], 8, 2, 64, 16, torch.float32, DEVICE, gen, extra_table_cols=20)
    _ok(err, torch.float32)


@pytest.mark.parametrize("num_stages", [1, 3])
def test_decode_attention_num_stages_keyword_gives_the_default_result(num_stages, gen):
    # a tuning knob of the bench sweep: it may change the schedule, never the answer
    ctx = [0, 1, 17, 70]
    q, _, _, kc, vc, meta = checks.random_paged_batch([1 if c else 0 for c in ctx], ctx, 8, 2, 64, 16,
                                                      torch.float32, DEVICE, gen)
    q = torch.randn(len(ctx), 8, 64, generator=gen).to(DEVICE)  # one query row per sequence, padding included
    meta.query_start_loc = torch.arange(len(ctx) + 1, dtype=torch.int32, device=DEVICE)
    meta.query_start_loc_cpu, meta.max_query_len = list(range(len(ctx) + 1)), 1
    args = (q, kc, vc, meta.seq_lens, meta.block_tables, 64**-0.5)
    default = paged_decode_attention(*args, num_splits=2, block_n=16)
    staged = paged_decode_attention(*args, num_splits=2, block_n=16, num_stages=num_stages)
    torch.testing.assert_close(staged, default, rtol=1e-5, atol=1e-5)
    _ok(checks.rel_err(staged, checks.attention_reference(q, kc, vc, meta, 64**-0.5)), torch.float32)


def _decode_batch(ctx, dtype, gen):
    """One query row per sequence of contexts ``ctx`` (0: a padding row), 8 query / 2 KV heads of 64,
    16-token blocks: (q, k_cache, v_cache, meta, the positional args of paged_decode_attention)."""
    q, _, _, kc, vc, meta = checks.random_paged_batch([1 if c else 0 for c in ctx], ctx, 8, 2, 64, 16,
                                                      dtype, DEVICE, gen)
    q = torch.randn(len(ctx), 8, 64, generator=gen).to(DEVICE, dtype)
    return q, kc, vc, meta, (q, kc, vc, meta.seq_lens, meta.block_tables, 64**-0.5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention_one_split_written_directly_equals_the_merged_path_bitwise(dtype, gen):
    # one split: the merge multiplies by exp2(0) / 1, so skipping it must change no bit; padding row -> zeros
    ctx = [0, 1, 17, 70 * BIG]
    q, kc, vc, meta, args = _decode_batch(ctx, dtype, gen)
    poisoned = torch.full_like(q, float("nan"))
    direct = paged_decode_attention(*args, num_splits=1, out=poisoned.clone())
    merged = paged_decode_attention(*args, num_splits=1, direct=False, out=poisoned.clone())
    assert torch.equal(direct, merged)
    assert torch.equal(direct[0], torch.zeros_like(direct[0]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [1, 2])
def test_decode_attention_prefetched_block_table_gives_the_default_bits(dtype, num_splits, gen):
    # prefetch moves loads (q before seq_len, each tile's blocks one iteration ahead), not arithmetic:
    # the same bits, over several 16-token tiles per split, partial last tiles and a padding row
    ctx = [0, 1, 17, 70 * BIG, 33]
    q, kc, vc, meta, args = _decode_batch(ctx, dtype, gen)
    poisoned = torch.full_like(q, float("nan"))
    default = paged_decode_attention(*args, num_splits=num_splits, block_n=16, out=poisoned.clone())
    ahead = paged_decode_attention(*args, num_splits=num_splits, block_n=16, prefetch=True, out=poisoned.clone())
    assert torch.equal(ahead, default)
    meta.query_start_loc = torch.arange(len(ctx) + 1, dtype=torch.int32, device=DEVICE)
    meta.query_start_loc_cpu, meta.max_query_len = list(range(len(ctx) + 1)), 1
    _ok(checks.rel_err(ahead, checks.attention_reference(q, kc, vc, meta, 64**-0.5)), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ATTN_SHAPES, ids=lambda s: "hq%d-hkv%d-d%d-bs%d" % s)
@pytest.mark.parametrize("schedule,num_splits", [("split", None), ("split", 1), ("split", 3), ("pipelined", None)])
def test_rope_decode_attention_matches_rope_then_attention_and_writes_the_rope_kv_cache_bits(shape, dtype, schedule,
                                                                                            num_splits, gen):
    # RoPE, the K/V write and the attention in one launch: the newest position (read from the step, not
    # the cache) alone in a split, at a block's first / last slot, a padding row (zeros, no write)
    Hq, Hkv, D, bs = shape
    ctx = [0, 1, bs, bs + 1, 2 * bs + 1, 3 * bs - 1 + 40 * (BIG - 1), 7]
    err, same_cache = checks.check_rope_decode(ctx, Hq, Hkv, D, bs, dtype, DEVICE, gen, schedule=schedule,
                                               num_splits=num_splits)
    _ok(err, dtype)
    assert same_cache  # rope_kv's own expression, rounded once: the bits the two-launch path stores


def test_rope_decode_attention_refuses_head_sizes_it_cannot_pair(gen):
    from pageserve.kernels.paged_decode import rope_decode_attention, rope_supported

    assert rope_supported(64) and rope_supported(128) and not rope_supported(96) and not rope_supported(8)
    q, k, kc, vc = (torch.zeros(1, 2, 96, device=DEVICE), torch.zeros(1, 1, 96, device=DEVICE),
                    torch.zeros(2, 16, 1, 96, device=DEVICE), torch.zeros(2, 16, 1, 96, device=DEVICE))
    with pytest.raises(ValueError, match="power of two"):
        rope_decode_attention(q, k, k, torch.zeros(1, dtype=torch.int64, device=DEVICE),
                              torch.zeros(8, 96, device=DEVICE), kc, vc, torch.zeros(1, dtype=torch.int64, device=DEVICE),
                              torch.ones(1, dtype=torch.int32, device=DEVICE),
                              torch.zeros(1, 1, dtype=torch.int32, device=DEVICE), 0.1)


def test_decode_split_count_is_the_fewest_that_fill_the_gpu_three_times_without_short_pieces():
    sms, bs = 132, 16
    # the H200 case the sweep measured: batch 64, 2 KV heads, a 2,048-token table -> 4 splits (4 beat 5)
    assert decode_num_splits(64, 2, 128, bs, sms) == 4
    for batch, hkv, blocks in [(1, 2, 128), (8, 2, 128), (64, 2, 128), (200, 8, 128), (1, 2, 4096)]:
        s = decode_num_splits(batch, hkv, blocks, bs, sms)
        filled = batch * hkv * s >= 3 * sms
        capped = s == MAX_SPLITS or s == -(-blocks * bs // MIN_SPLIT_TOKENS)
        assert filled or capped, (batch, hkv, blocks, s)
        assert s == 1 or batch * hkv * (s - 1) < 3 * sms, (batch, hkv, blocks, s)  # no more than needed
    assert decode_num_splits(1, 2, 1, bs, sms) == 1  # one block of context: nothing to split
    assert decode_num_splits(1, 2, 8, bs, sms) == 1  # 128 tokens: no piece shorter than MIN_SPLIT_TOKENS
    assert decode_num_splits(1, 2, 4096, bs, sms) == MAX_SPLITS


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ATTN_SHAPES, ids=lambda s: "hq%d-hkv%d-d%d-bs%d" % s)
def test_prefill_attention_chunks_over_cached_prefixes_mixed_with_decodes(shape, dtype, gen):
    Hq, Hkv, D, bs = shape
    # a fresh prompt, a chunk over a prefix ending mid-block, decodes, an empty sequence
    q_lens = [3 + 20 * (BIG - 1), 1, 2 * bs + 3, 1, 0]
    ctx = [3 + 20 * (BIG - 1), bs + 4, 2 * bs + 3 + bs - 5, 1, 0]
    err = checks.check_prefill(q_lens, ctx, Hq, Hkv, D, bs, dtype, DEVICE, gen, pad_tokens=2)
    _ok(err, dtype)


def test_prefill_attention_long_chunk_spans_several_query_blocks(gen):
    # q_len over one program's query tokens (BLOCK_M // group) with a prefix
    err = checks.check_prefill([70, 9], [100, 9], 8, 2, 64, 16, torch.float32, DEVICE, gen)
    _ok(err, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_attention_masks_only_the_key_tiles_that_cross_the_diagonal(dtype, gen):
    # key tiles wholly before a block's first position skip the causal mask (diag_mask, the default):
    # several such tiles over a long prefix, a fresh prompt, decodes deep in their context, padding rows;
    # the same answer as masking every tile, and as the reference
    from pageserve.kernels.paged_prefill import paged_prefill_attention

    Hq, Hkv, D, bs = 16, 2, 64, 16
    q_lens, ctx = [150, 1, 97, 1, 0], [300, 200, 97, 64, 0]
    q, _, _, kc, vc, meta = checks.random_paged_batch(q_lens, ctx, Hq, Hkv, D, bs, dtype, DEVICE, gen, pad_tokens=2)
    scale = D ** -0.5
    ref = checks.attention_reference(q, kc, vc, meta, scale)
    for block_n in (32, 64):
        diag = paged_prefill_attention(q, kc, vc, meta, scale, block_n=block_n)
        full = paged_prefill_attention(q, kc, vc, meta, scale, block_n=block_n, diag_mask=False)
        _ok(checks.rel_err(diag, ref), dtype)
        _ok(checks.rel_err(full, ref), dtype)
        assert checks.rel_err(diag, full) <= (1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("config", [dict(block_m=128, block_n=32, num_warps=8, num_stages=3),
                                    dict(block_m=256, block_n=64, num_warps=8), dict(block_m=64, block_n=128)],
                         ids=["m128-n32-w8-s3", "m256-n64-w8", "m64-n128"])
def test_prefill_attention_tuning_keywords_change_the_schedule_not_the_answer(config, gen):
    # the configs scripts/prefill_attn_sweep.py tries: a chunk over a prefix, several query blocks, a decode
    dtype = torch.bfloat16 if CUDA else torch.float32
    err = checks.check_prefill([70, 1, 33], [100, 20, 33], 16, 2, 128, 16, dtype, DEVICE, gen, pad_tokens=1, **config)
    _ok(err, dtype)


def test_query_tile_map_heavy_first_orders_the_same_tiles_by_the_keys_each_walks():
    from types import SimpleNamespace

    import numpy as np

    from pageserve.kernels._util import query_tile_map

    # q_tok 4: a 10-token chunk over a 30-token prefix (3 tiles: 34, 38, 40 keys), decodes at 50 and 7,
    # an empty sequence, a 4-token prompt (4 keys)
    q_lens, ctx = [10, 1, 1, 0, 4], [40, 50, 7, 0, 4]
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).tolist()
    meta = SimpleNamespace(max_query_len=10, query_start_loc_cpu=qsl, seq_lens_cpu=ctx, scratch={})
    plain = query_tile_map(meta, 4, 5, torch.device("cpu"))
    heavy = query_tile_map(meta, 4, 5, torch.device("cpu"), heavy_first=True)
    assert plain.tolist() == [[0, 0, 0, 1, 2, 4], [0, 1, 2, 0, 0, 0]]
    assert heavy.tolist() == [[1, 0, 0, 0, 2, 4], [0, 2, 1, 0, 0, 0]]  # 50, 40, 38, 34, 7, 4 keys
    assert len(meta.scratch) == 2, "each order is kept for the step's other layers under its own key"


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_attention_from_the_tile_map_gives_the_full_grids_bits(dtype, gen):
    # the engine's launch (one program per real query tile, from query_tile_map) against the grid
    # over max_query_len's tiles for every sequence: decodes beside chunks that span several query
    # blocks, an empty sequence, padding rows; every row written, the same bits
    from pageserve.kernels.paged_prefill import paged_prefill_attention

    Hq, Hkv, D, bs = 16, 2, 64, 16
    q_lens, ctx = [1, 70, 1, 0, 17, 1, 9], [40, 100, 3, 0, 17, 90, 30]
    q, _, _, kc, vc, meta = checks.random_paged_batch(q_lens, ctx, Hq, Hkv, D, bs, dtype, DEVICE, gen, pad_tokens=3)
    scale = D ** -0.5
    outs = []
    for tile_map, heavy_first in ((True, True), (False, True), (True, False)):
        out = torch.full_like(q, float("nan"))
        paged_prefill_attention(q, kc, vc, meta, scale, out=out, tile_map=tile_map, heavy_first=heavy_first)
        outs.append(out)
    assert not outs[0].isnan().any()
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    assert meta.scratch, "the map is kept for the step's other layers"
    meta.scratch.clear()  # the default launch on the engine's path (host copy of query_start_loc) takes the map
    assert torch.equal(paged_prefill_attention(q, kc, vc, meta, scale), outs[0]) and meta.scratch
    _ok(checks.rel_err(outs[0], checks.attention_reference(q, kc, vc, meta, scale)), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", [dict(), dict(block_m=32, block_n=32, num_warps=4, num_stages=2),
                                    dict(block_m=128, block_n=64, num_warps=8, num_stages=3)],
                         ids=["default", "m32-n32", "m128-n64-w8"])
def test_chunk_attention_matches_the_reference_and_leaves_short_rows_to_the_paged_kernel(config, dtype, gen):
    # the engine's split of an eager step: chunks of >= CHUNK_MIN_TOKENS new tokens through the chunk
    # launch (own keys from the step's k/v, a cached prefix through the table), the rest through the
    # paged kernel's "short" part. Cases: fresh prompts over several query tiles, chunks whose prefix
    # ends mid key tile and on a tile boundary, a chunk of exactly the minimum, a shorter chunk over a
    # prefix, decodes, an empty sequence, padding rows
    from pageserve.kernels import write_kv
    from pageserve.kernels.paged_prefill import CHUNK_MIN_TOKENS, chunk_prefill_attention, paged_prefill_attention

    Hq, Hkv, D, bs = (16, 2, 128, 16) if CUDA else (8, 2, 64, 16)
    n = CHUNK_MIN_TOKENS
    q_lens = [150 * BIG, 1, 97, n, 1, 0, n - 1, 70]
    ctx = [150 * BIG, 200, 97 + 37, n + 64, 64, 0, n + 24, 70 + 128]
    q, k, v, kc, vc, meta = checks.random_paged_batch(q_lens, ctx, Hq, Hkv, D, bs, dtype, DEVICE, gen, pad_tokens=2)
    write_kv(k, v, kc, vc, meta.slot_mapping)  # the step's k/v are what the cache holds at its slots
    v = torch.cat([torch.zeros_like(v), v], dim=-1)[..., D:]  # a strided view, as the qkv projection's v is
    scale = D ** -0.5
    out = torch.full_like(q, float("nan"))
    chunk_prefill_attention(q, k, v, kc, vc, meta, scale, out=out, **config)
    long_rows = torch.cat([torch.arange(meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1])
                           for i, L in enumerate(q_lens) if L >= n])
    assert not out[long_rows].isnan().any() and out.isnan().sum() == (q.shape[0] - long_rows.numel()) * Hq * D
    paged_prefill_attention(q, kc, vc, meta, scale, out=out, part="short", short_len=n - 1)
    _ok(checks.rel_err(out, checks.attention_reference(q, kc, vc, meta, scale)), dtype)
    # the paged kernel's key tiles in its order, but other tile heights: equal to rounding, not bit for bit
    # (on the H200 some shapes match exactly and some do not, NOTES.md session 31)
    assert checks.rel_err(out, paged_prefill_attention(q, kc, vc, meta, scale)) <= (1e-5 if dtype == torch.float32 else 2e-2)
    # the tiles as the launch's fastest axis instead of the heads: the same programs in another order, the same bits
    other = torch.full_like(q, float("nan"))
    chunk_prefill_attention(q, k, v, kc, vc, meta, scale, out=other, heads_inner=False, **config)
    assert torch.equal(other[long_rows], out[long_rows])


def test_chunk_attention_warms_both_tile_configs_without_touching_the_cache(gen):
    # the engine compiles the chunk launch at start-up (ModelRunner), so no request pays for it
    from pageserve.kernels.paged_prefill import CHUNK_CONFIGS
    from pageserve.model.deterministic_ops import DeterministicOps

    kc = torch.randn(6, 16, 2, 64, generator=gen).to(DEVICE)
    vc = torch.randn(6, 16, 2, 64, generator=gen).to(DEVICE)
    k0, v0 = kc.clone(), vc.clone()
    assert TritonOps(chunk_attention=True).warm_chunk_attention(kc, vc, num_heads=8) == len(CHUNK_CONFIGS)
    assert torch.equal(kc, k0) and torch.equal(vc, v0)
    assert TritonOps(chunk_attention=False).warm_chunk_attention(kc, vc, num_heads=8) == 0
    assert DeterministicOps().warm_chunk_attention(kc, vc, num_heads=8) == 0


def test_chunk_attention_refuses_a_step_without_the_host_copy_of_its_layout(gen):
    from pageserve.kernels.paged_prefill import chunk_prefill_attention

    q, k, v, kc, vc, meta = checks.random_paged_batch([70], [70], 4, 2, 32, 16, torch.float32, DEVICE, gen)
    meta.query_start_loc_cpu = None
    with pytest.raises(ValueError, match="query_start_loc_cpu"):
        chunk_prefill_attention(q, k, v, kc, vc, meta, 0.1)
    meta.query_start_loc_cpu = [0, 70]
    with pytest.raises(ValueError, match="k: expected shape"):
        chunk_prefill_attention(q, k[:10], v, kc, vc, meta, 0.1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hkv,d,bs", [(2, 128, 16), (1, 64, 32), (4, 64, 16)])
def test_write_kv_stores_every_token_and_skips_padding_slots(hkv, d, bs, dtype, gen):
    assert checks.check_write_kv([5, 1, 2 * bs + 1], [5, bs + 3, 2 * bs + 1], hkv, d, bs, dtype, DEVICE, gen) == 0.0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H", [(1, 64), (5, 200), (3, 2048)])
def test_rms_norm_matches_reference(T, H, dtype, gen):
    _ok(checks.check_rms_norm(T, H, dtype, DEVICE, gen), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H", [(1, 64), (5, 200), (3, 2048)])
def test_add_rms_norm_matches_reference_and_returns_the_sum(T, H, dtype, gen):
    _ok(checks.check_add_rms_norm(T, H, dtype, DEVICE, gen), dtype)


def test_add_rms_norm_in_place_on_the_residual(gen):
    from pageserve.kernels import add_rms_norm
    from pageserve.model.ops import TorchOps

    x, r = (torch.randn(4, 96, generator=gen).to(DEVICE) for _ in range(2))
    w = torch.rand(96, generator=gen).to(DEVICE) + 0.5
    ref_out, ref_res = TorchOps().add_rms_norm(x, r.clone(), w, 1e-6)
    out, res = add_rms_norm(x, r, w, 1e-6, residual_out=r)
    assert res.data_ptr() == r.data_ptr()
    torch.testing.assert_close(res, ref_res)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,I", [(1, 64), (4, 300), (2, 11008 if CUDA else 1500)])
def test_silu_and_mul_matches_reference(T, I, dtype, gen):
    _ok(checks.check_silu_and_mul(T, I, dtype, DEVICE, gen), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d", [(16, 2, 128), (14, 2, 64), (4, 4, 64)])
@pytest.mark.parametrize("inplace", [False, True])
def test_rotary_on_strided_qkv_views_matches_reference(hq, hkv, d, dtype, inplace, gen):
    _ok(checks.check_rotary(5, hq, hkv, d, dtype, DEVICE, gen, inplace=inplace), dtype)


GEMV_SHAPES = [(1, 40, 96), (1, 33, 1000), (3, 50, 300), (8, 17, 64)]
if CUDA:
    GEMV_SHAPES += [(1, 2560, 2048), (1, 2048, 11008), (2, 22016, 2048), (8, 2048, 2048)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,N,K", GEMV_SHAPES)
@pytest.mark.parametrize("config", [None, GemvConfig(block_n=16, block_k=64, split_k=3)], ids=["auto", "split3"])
def test_gemv_matches_linear_with_and_without_split_k(M, N, K, dtype, config, gen):
    _ok(checks.check_gemv(M, N, K, dtype, DEVICE, gen, bias=(N % 2 == 0), config=config), dtype)


@pytest.mark.parametrize("M", [33, 64])
@pytest.mark.parametrize("config", [GemvConfig(block_n=128, block_k=64, split_k=2, num_warps=8, num_stages=4),
                                    GemvConfig(block_n=256, block_k=128, split_k=1, num_warps=8),
                                    GemvConfig(block_n=128, block_k=64, split_k=2, swap_ab=True),
                                    GemvConfig(block_n=128, block_k=64, split_k=2, num_stages=1)],
                         ids=["n128-k64-split2-s4", "n256-k128", "n128-k64-split2-swap", "n128-k64-split2-s1"])
def test_gemv_skinny_tiles_the_bench_sweeps_above_8_rows_match_linear(M, config, gen):
    # gemv_candidates' wide weight tiles for M = 9..64 (the skinny GEMM against cuBLAS): odd N, K not a tile
    # multiple; int8 with both conversions the bench times there
    dtype = torch.bfloat16 if CUDA else torch.float32
    _ok(checks.check_gemv(M, 300, 200, dtype, DEVICE, gen, bias=True, config=config), dtype)
    for magic in (True, "cvt"):
        _ok(checks.check_gemv_int8(M, 300, 200, dtype, DEVICE, gen, bias=True, config=config, magic=magic), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,V", [(1, 151936 if CUDA else 5000), (3, 2048), (5, 2049), (2, 7), (4, 4097)])
def test_argmax_rows_matches_torch_argmax_first_maximum_included(B, V, dtype, gen):
    from pageserve.kernels.argmax import argmax_rows

    x = torch.randn(B, V, generator=gen).to(DEVICE, dtype)
    torch.testing.assert_close(argmax_rows(x), x.argmax(dim=-1), rtol=0, atol=0)
    # ties: the row's maximum planted twice, in two different blocks and inside one block; torch
    # (and the sampler) take the first
    x[:, V // 3] = x[:, -1] = x[:, max(V // 3 - 1, 0)] = 100.0
    torch.testing.assert_close(argmax_rows(x), x.argmax(dim=-1), rtol=0, atol=0)
    # -inf everywhere but one column (a vocabulary mask), NaN counts as the largest, rows strided
    x.fill_(float("-inf"))
    x[0, V - 1] = 0.0
    if B > 1:
        x[1, V // 2] = float("nan")
        x[1, V - 1] = 1.0
    torch.testing.assert_close(argmax_rows(x), x.argmax(dim=-1), rtol=0, atol=0)
    wide = torch.randn(B, V + 40, generator=gen).to(DEVICE, dtype)
    torch.testing.assert_close(argmax_rows(wide[:, :V]), wide[:, :V].argmax(dim=-1), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,rows,V", [(6, [0, 2, 5], 151936 if CUDA else 4100), (3, [1], 33), (4, [3, 0], 2048),
                                      (2, [0, 1], 1)])
def test_apply_token_bitmask_matches_the_unpack_and_fill_reference(B, rows, V, dtype, gen):
    # random words (the sign bit included), a row with every bit set and one with none, masks wider than V
    # (their extra bits ignored), logits wider than V and strided (the columns past V untouched), NaN logits
    # kept where allowed; the rows not guided keep their bits
    from pageserve.kernels.reference import apply_token_bitmask as reference
    from pageserve.kernels.token_bitmask import apply_token_bitmask

    W = (V + 31) // 32 + 1
    bits = torch.randint(-2**31, 2**31 - 1, (len(rows), W), generator=gen, dtype=torch.int64).to(torch.int32)
    bits[0, : W // 2] = -1
    if len(rows) > 1:
        bits[1] = 0
    wide = torch.randn(B, V + 40, generator=gen).to(dtype)
    wide[0, :: 7] = float("nan")
    x = wide[:, :V]
    want = reference(x.clone(), torch.tensor(rows), bits, V)
    got_wide = wide.clone().to(DEVICE)
    got = apply_token_bitmask(got_wide[:, :V], torch.tensor(rows, device=DEVICE), bits.to(DEVICE), V)
    assert got.data_ptr() == got_wide.data_ptr()  # in place
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(got_wide[:, V:].cpu(), wide[:, V:], rtol=0, atol=0, equal_nan=True)
    if len(rows) > 1:
        assert torch.isneginf(got[rows[1]]).all()  # the row whose words are all clear: everything banned
    with pytest.raises(ValueError, match="masks"):
        apply_token_bitmask(got_wide[:, :V], torch.tensor(rows, device=DEVICE), bits[:, :0].to(DEVICE), V)


@pytest.mark.parametrize("block", [16, 64, 8192])
def test_argmax_rows_any_block_gives_torch_first_maximum(block, gen):
    # the first-stage width argmax_ab times: ties across and inside blocks, a block wider than the row
    from pageserve.kernels.argmax import argmax_rows

    x = torch.randn(3, 1000, generator=gen).to(DEVICE)
    x[0, 17] = x[0, 900] = x[1, 5] = x[1, 6] = x[2, 999] = 50.0
    torch.testing.assert_close(argmax_rows(x, block=block), x.argmax(dim=-1), rtol=0, atol=0)
    with pytest.raises(ValueError, match="power of two"):
        argmax_rows(x, block=100)


def test_argmax_rows_takes_the_wide_blocks_from_their_row_count_with_torch_first_maximum(gen, monkeypatch):
    # the default width switches at WIDE_ROWS; both sides of the switch give torch's first maximum
    from pageserve.kernels import argmax

    widths = []
    launch = argmax._argmax_partial_kernel

    class Spy:
        def __getitem__(self, grid):
            def run(*a, BLOCK, **k):
                widths.append(BLOCK)
                return launch[grid](*a, BLOCK=BLOCK, **k)
            return run

    monkeypatch.setattr(argmax, "_argmax_partial_kernel", Spy())
    for rows in (argmax.WIDE_ROWS - 1, argmax.WIDE_ROWS):
        x = torch.randn(rows, 5000, generator=gen).to(DEVICE)
        x[:, 4000] = x[:, 4200] = 80.0  # a tie across the wide block's edge (column 4,096)
        torch.testing.assert_close(argmax.argmax_rows(x), x.argmax(dim=-1), rtol=0, atol=0)
    assert widths == [argmax.BLOCK, argmax.WIDE_BLOCK]


def test_argmax_rows_rejects_what_it_cannot_reduce():
    from pageserve.kernels.argmax import argmax_rows

    with pytest.raises(ValueError, match="at least one column"):
        argmax_rows(torch.zeros(2, 0, device=DEVICE))
    with pytest.raises(ValueError, match="x"):
        argmax_rows(torch.zeros(4, device=DEVICE))
    assert argmax_rows(torch.zeros(0, 8, device=DEVICE)).shape == (0,)


def test_wrappers_reject_bad_arguments_with_named_errors():
    from pageserve.kernels import gemv, rms_norm, write_kv

    x = torch.randn(2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.ones(32, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="dtype"):
        gemv(x, torch.randn(8, 64, device=DEVICE, dtype=torch.float16))
    with pytest.raises(ValueError, match="contiguous"):
        rms_norm(torch.randn(64, 2, device=DEVICE).t(), torch.ones(64, device=DEVICE), 1e-6)
    k = torch.randn(3, 2, 64, device=DEVICE)
    cache = torch.zeros(4, 16, 2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv(k, k, cache, cache, torch.zeros(2, dtype=torch.int64, device=DEVICE))


def test_pdl_is_chosen_per_call_and_only_for_launches_over_few_rows(monkeypatch):
    from pageserve.kernels import _util

    monkeypatch.setattr(_util, "pdl_supported", lambda device_index: True)  # as on an sm_90 GPU
    cuda_like = types.SimpleNamespace(is_cuda=True, device=types.SimpleNamespace(index=0))
    assert _util.pdl_args(cuda_like, 1) == {"USE_PDL": True, "launch_pdl": True}  # None: on where supported
    assert _util.pdl_args(cuda_like, 1, pdl=False) == {"USE_PDL": False}
    assert _util.use_pdl(cuda_like, 1)  # the call above left nothing behind
    assert _util.use_pdl(cuda_like, _util.PDL_MAX_TOKENS, pdl=True)
    assert not _util.use_pdl(cuda_like, _util.PDL_MAX_TOKENS + 1, pdl=True)  # batch 64 measured slower with it
    assert not _util.use_pdl(torch.zeros(1), 1, pdl=True)  # a CPU tensor (the interpreter) never
    # "wait_first": on, with every kernel's wait at its top (the A/B reference for step inputs before the wait)
    assert _util.pdl_args(cuda_like, 1, pdl="wait_first") == {"USE_PDL": _util.PDL_WAIT_FIRST, "launch_pdl": True}
    assert _util.pdl_args(cuda_like, _util.PDL_MAX_TOKENS + 1, pdl="wait_first") == {"USE_PDL": False}
    with pytest.raises(ValueError, match="pdl must be one of"):
        _util.use_pdl(cuda_like, 1, pdl="late")
    with pytest.raises(ValueError, match="pdl must be one of"):
        TritonOps(pdl="late", tuned_configs=False)


def test_the_argmax_launches_under_pdl_at_any_row_count_unless_told_not_to(monkeypatch):
    # the one kernel exempt from PDL_MAX_TOKENS: under PDL after a graph replay it made the 2-64-row
    # replays 0.14-0.16 ms faster (H200, diagnostics/argmax_ab_c6f794a.*)
    from pageserve.kernels import _util, argmax as am

    monkeypatch.setattr(_util, "pdl_supported", lambda device_index: True)  # as on an sm_90 GPU
    seen = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kw: seen.append(kw.get("launch_pdl", False))

    monkeypatch.setattr(am, "_argmax_partial_kernel", Kernel())
    monkeypatch.setattr(am, "_argmax_reduce_kernel", Kernel())
    monkeypatch.setattr(am, "check_device", lambda **t: None)
    monkeypatch.setattr(am, "pdl_args", lambda t, tokens, pdl=None: _util.pdl_args(
        types.SimpleNamespace(is_cuda=True, device=types.SimpleNamespace(index=0)), tokens, pdl))
    am.argmax_rows(torch.zeros(64, 4096))
    am.argmax_rows(torch.zeros(64, 4096), pdl=False)
    assert seen == [True, True, False, False]


def test_two_triton_ops_keep_their_own_gemv_configs_and_pdl(monkeypatch, gen):
    """Each TritonOps passes its own tuned GEMV configs and PDL setting to every call: building
    or using one changes nothing for another, and the GEMV takes the tuned entry for its shape."""
    import importlib

    import pageserve.model.triton_ops as triton_ops
    from pageserve.kernels import reference
    from pageserve.kernels.gemv import config_key

    gemv_mod = importlib.import_module("pageserve.kernels.gemv")  # the package exports a function of that name
    M, N, K = 1, 40, 96
    tuned_cfg = GemvConfig(block_n=8, block_k=32, split_k=3)
    heuristic = gemv_mod.gemv_config(M, N, K, gemv_mod.sm_count_for(torch.empty(0, device=DEVICE)))
    assert heuristic != tuned_cfg
    chosen, pdl_seen = [], []
    real_config, real_norm = gemv_mod.gemv_config, triton_ops.rms_norm
    monkeypatch.setattr(gemv_mod, "gemv_config", lambda *a, **kw: chosen.append(real_config(*a, **kw)) or chosen[-1])
    monkeypatch.setattr(triton_ops, "rms_norm", lambda *a, **kw: pdl_seen.append(kw["pdl"]) or real_norm(*a, **kw))
    tuned = TritonOps(tuned_configs={config_key(M, N, K): tuned_cfg}, pdl=False)
    plain = TritonOps(tuned_configs=False, pdl=True)
    assert tuned.gemv_configs == {config_key(M, N, K): tuned_cfg} and plain.gemv_configs == {}
    x, w, b = (torch.randn(*s, generator=gen).to(DEVICE) for s in ((M, K), (N, K), (N,)))
    nw = torch.rand(K, generator=gen).to(DEVICE) + 0.5
    for ops in (tuned, plain, tuned):
        torch.testing.assert_close(ops.linear(x, w, b), reference.linear(x, w, b), rtol=1e-4, atol=1e-4)
        ops.rms_norm(x, nw, 1e-6)
    assert chosen == [tuned_cfg, heuristic, tuned_cfg]
    assert pdl_seen == [False, True, False]


def test_importing_the_kernels_sets_no_environment_variable():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import os; before = dict(os.environ); import pageserve.kernels, pageserve.model.triton_ops; "
            "changed = sorted(set(os.environ.items()) ^ set(before.items())); assert not changed, changed")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]


def _tiny_decoder(ops):
    from pageserve.model.config import ModelConfig
    from pageserve.model.decoder import Decoder

    cfg = ModelConfig(architecture="qwen2", vocab_size=97, hidden_size=128, intermediate_size=192, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=32, attention_bias=True, tie_word_embeddings=True,
                      max_position_embeddings=256)
    model = Decoder(cfg, ops=ops).to(DEVICE)
    model.init_dummy_weights(seed=1, std=0.1)
    return model, cfg


def test_triton_ops_drive_the_decoder_like_torch_ops_through_prefill_and_decode(gen):
    from pageserve.model.attention import PagedAttention
    from pageserve.model.ops import TorchOps

    model, cfg = _tiny_decoder(TorchOps())
    bs, nb = 16, 8
    prompt_lens = [7, 20, 70]  # the 70-token prompt takes the chunk launch under chunk_attention=True
    q, _, _, _, _, meta = checks.random_paged_batch(prompt_lens, prompt_lens, 1, cfg.num_kv_heads, cfg.head_dim,
                                                    bs, torch.float32, DEVICE, gen, spare_blocks=nb)
    num_blocks = int(meta.block_tables.max()) + 1
    ids = torch.randint(0, cfg.vocab_size, (sum(prompt_lens),), generator=gen).to(DEVICE)
    pos = torch.cat([torch.arange(n) for n in prompt_lens]).to(DEVICE)
    # decode step: one more token each
    dmeta = checks.random_paged_batch([1, 1, 1], [8, 21, 71], 1, cfg.num_kv_heads, cfg.head_dim, bs, torch.float32,
                                      DEVICE, gen)[-1]
    dmeta.block_tables = meta.block_tables.clone()
    dmeta.slot_mapping = torch.tensor([int(meta.block_tables[i, p // bs]) * bs + p % bs
                                       for i, p in enumerate([7, 20, 70])], device=DEVICE)
    d_ids = torch.randint(0, cfg.vocab_size, (3,), generator=gen).to(DEVICE)
    d_pos = torch.tensor([7, 20, 70], device=DEVICE)
    assert TritonOps(chunk_attention=True).chunk_attention_for(meta)
    assert not TritonOps(chunk_attention=True).chunk_attention_for(dmeta) and not TorchOps().chunk_attention_for(meta)
    results = []
    for ops in (TorchOps(), TritonOps(chunk_attention=False), TritonOps(chunk_attention=True)):
        model.set_ops(ops)
        cache = torch.zeros(cfg.num_layers, 2, num_blocks, bs, cfg.num_kv_heads, cfg.head_dim, device=DEVICE)
        h1 = model(ids, pos, PagedAttention(cache, meta, ops))
        h2 = model(d_ids, d_pos, PagedAttention(cache, dmeta, ops))
        results.append((h1, h2, model.compute_logits(h2)))
    for triton_results in results[1:]:
        for got, ref in zip(triton_results, results[0]):
            assert checks.rel_err(got, ref) < 1e-4


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_decode_attention_replays_in_a_cuda_graph_with_new_lengths(gen):
    Hq, Hkv, D, bs = 16, 2, 128, 16
    ctx = [100, 700, 1, 0]
    q, _, _, kc, vc, meta = checks.random_paged_batch([1, 1, 1, 0], ctx, Hq, Hkv, D, bs, torch.bfloat16, DEVICE, gen,
                                                      extra_table_cols=4)
    q = q.new_empty(4, Hq, D).normal_()
    out = torch.empty_like(q)
    paged_decode_attention(q, kc, vc, meta.seq_lens, meta.block_tables, D**-0.5, out=out)  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_attention(q, kc, vc, meta.seq_lens, meta.block_tables, D**-0.5, out=out)
    new_lens = [101, 700 + 3 * bs, 0, 5]  # grows past the blocks used at capture, padding row moves
    meta.seq_lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
    meta.seq_lens_cpu = new_lens
    meta.query_start_loc = torch.arange(5, dtype=torch.int32, device=DEVICE)
    meta.query_start_loc_cpu = list(range(5))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    _ok(checks.rel_err(out, checks.attention_reference(q, kc, vc, meta, D**-0.5)), torch.bfloat16)


@pytest.mark.parametrize("splits", [None, 1, 3], ids=["auto", "whole_k", "three_slices"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,K,slots,rank,parts", [(1, 96, 4, 16, 1), (5, 200, 4, 16, 3), (37, 64, 2, 8, 2),
                                                  (70, 330, 3, 16, 1)])
def test_lora_shrink_keeps_each_rows_slot_columns_of_the_reference_product(T, K, slots, rank, parts, dtype, splits,
                                                                           gen):
    # rows of every slot, of none (-1) and of a slot past the stack (no columns: zeros); K and the column count
    # not multiples of the tiles; another slot's A holding inf must not reach a row (the select, not a product);
    # a batch of no adapter at all takes the tiles' skip and gives exact zeros; K whole in one program or in
    # slices summed by the tile's last one (the counters it was given are left zeros)
    from pageserve.kernels.lora import lora_shrink
    from pageserve.kernels.reference import lora_shrink as reference

    width = parts * rank
    C = slots * width
    x = torch.randn(T, K, generator=gen).to(dtype)
    a = (torch.randn(C, K, generator=gen) / K ** 0.5).to(dtype)
    token_slots = torch.randint(-1, slots + 1, (T + 3,), generator=gen)  # longer than T: the tail is not read
    token_slots[0] = slots - 1
    a[0] = float("inf") if slots > 1 else a[0]  # slot 0's first column; row 0 (the last slot) must stay finite
    want = reference(x, a, token_slots, width)
    counters = torch.zeros(64, dtype=torch.int32, device=DEVICE)
    got = lora_shrink(x.to(DEVICE), a.to(DEVICE), token_slots.to(DEVICE), width, counters=counters, splits=splits)
    assert got.shape == (T, C) and got.dtype == dtype
    assert torch.equal(counters.cpu(), torch.zeros(64, dtype=torch.int32))
    again = lora_shrink(x.to(DEVICE), a.to(DEVICE), token_slots.to(DEVICE), width, counters=counters, splits=splits)
    # the slices are summed in one order, whichever finished last (a row of slot 0 holds inf / NaN: equal_nan)
    torch.testing.assert_close(again.cpu(), got.cpu(), rtol=0, atol=0, equal_nan=True)
    own = (torch.arange(C)[None, :] // width) == token_slots[:T, None]
    assert torch.equal(got.cpu()[~own], torch.zeros_like(got.cpu()[~own]))  # exact zeros off a row's slot
    finite = torch.isfinite(want).all(dim=1)
    _ok(checks.rel_err(got.cpu()[finite].float(), want[finite].float()), dtype)
    none = lora_shrink(x.to(DEVICE), a.to(DEVICE), torch.full((T,), -1, device=DEVICE), width, splits=splits)
    assert torch.equal(none.cpu(), torch.zeros(T, C, dtype=dtype))
    if splits == 3 and K > 128:  # a split launch needs a counter for each of its tiles
        with pytest.raises(ValueError, match="counters"):
            lora_shrink(x.to(DEVICE), a.to(DEVICE), token_slots.to(DEVICE), width, splits=splits,
                        counters=counters[:0])
    with pytest.raises(ValueError, match="slots"):
        lora_shrink(x.to(DEVICE), a.to(DEVICE), token_slots[: T - 1].to(DEVICE) if T > 1 else token_slots[:0].to(DEVICE), width)


@pytest.mark.parametrize("splits", [None, 3], ids=["auto", "three_slices"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("prologue", ["norm", "silu_mul"])
@pytest.mark.parametrize("T,K", [(1, 96), (19, 200), (70, 300)])
def test_lora_shrink_prologues_match_the_reference_norm_and_silu_mul_first(T, K, prologue, dtype, splits, gen):
    # the fused layer path's shrinks: the RMSNorm of the projection's input (two passes: the rows' statistics,
    # then the normed tile, rounded where reference.rms_norm rounds) or SiLU(gate) * up of gate|up [T, 2K]
    from pageserve.kernels.lora import lora_shrink
    from pageserve.kernels.reference import lora_shrink as reference

    slots, width = 3, 32
    C = slots * width
    x = (torch.randn(T, 2 * K if prologue == "silu_mul" else K, generator=gen) * 3).to(dtype)
    a = (torch.randn(C, K, generator=gen) / K ** 0.5).to(dtype)
    w = (1 + 0.5 * torch.randn(K, generator=gen)).to(dtype) if prologue == "norm" else None
    token_slots = torch.randint(-1, slots, (T,), generator=gen)
    token_slots[0] = 1
    kw = dict(norm_weight=w, eps=1e-6) if prologue == "norm" else dict(silu_mul=True)
    # the reference in float64 from the same inputs (the kernel rounds its prologue once, the reference twice)
    want = reference(x.double(), a.double(), token_slots, width,
                     **{k: (v.double() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()})
    got = lora_shrink(x.to(DEVICE), a.to(DEVICE), token_slots.to(DEVICE), width, splits=splits,
                      **{k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()})
    _ok(checks.rel_err(got.cpu().double(), want), dtype)
    plain = reference(x, a, token_slots, width) if prologue == "norm" else None
    if plain is not None:  # the prologue matters: without it the product is another one
        assert checks.rel_err(got.cpu().double(), plain.double()) > 10 * TOLERANCE[dtype]
    with pytest.raises(ValueError, match="columns"):
        lora_shrink(x.to(DEVICE), a[:, :-1].contiguous().to(DEVICE), token_slots.to(DEVICE), width, **{
            k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()})
