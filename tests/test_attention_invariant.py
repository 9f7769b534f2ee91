"""Batch-invariant paged attention (pageserve.kernels.paged_invariant, issue 15).

Against the reference on random mixed batches, then bit for bit: one sequence's rows computed
alone, in batches, in chunks, from a cached prefix, at other tile-row offsets, decoded alone
and in padded or mixed batches (pageserve.lab.attention_invariance). The checks are shown able
to fail: another kv_split, and the engine's paged_decode / paged_prefill dispatch, break them.
CPU: Triton's interpreter on tiny shapes with small tiles; CUDA: the Qwen2.5-3B attention shape.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pageserve.lab import attention_invariance as inv  # noqa: E402
from pageserve.lab import kernel_checks as checks  # noqa: E402
from pageserve.kernels import paged_attention_invariant  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16] if CUDA else [torch.float32, torch.bfloat16]
# the interpreter is slow: 16-key tiles and 32-key splits keep a few splits in ~100 tokens
LAUNCH = {} if CUDA else {"kv_split": 32, "block_n": 16}
KS = 256 if CUDA else 32
GQA = [(3, 3), (6, 2), (8, 1)]  # (Hq, Hkv): groups 1, 3, 8
SMALL = (16, 8)  # head_dim, page on the CPU


def _shape(hq, hkv):
    return (hq, hkv, 64, 16) if CUDA else (hq, hkv) + SMALL


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv", GQA)
def test_matches_reference_on_mixed_batches_of_decodes_and_chunks_over_cached_prefixes(hq, hkv, dtype):
    gen = torch.Generator().manual_seed(hq * 10 + hkv)
    Hq, Hkv, D, bs = _shape(hq, hkv)
    # decodes (one just past a split boundary), a fresh prompt, chunks over prefixes ending mid-block
    # and spanning several splits, an empty sequence, two padding tokens
    q_lens = [1, 20, 1, 0, 37, 1]
    ctx = [KS + 1, 20, 1, 0, 2 * KS + 26, 45]
    q, _, _, kc, vc, meta = checks.random_paged_batch(q_lens, ctx, Hq, Hkv, D, bs, dtype, DEVICE, gen, pad_tokens=2)
    out = torch.full_like(q, float("nan"))
    paged_attention_invariant(q, kc, vc, meta, D**-0.5, out=out, **LAUNCH)
    err = checks.rel_err(out, checks.attention_reference(q, kc, vc, meta, D**-0.5))
    assert err <= checks.TOLERANCE[dtype], f"relative error {err:.3g} ({dtype})"


@pytest.mark.parametrize("walk", [{}, {"split_programs": 1, "flat": True}, {"split_programs": 1, "flat": False}])
def test_decode_batch_matches_reference_with_padding_rows_and_a_wide_table(walk):
    gen = torch.Generator().manual_seed(1)
    Hq, Hkv, D, bs = _shape(8, 2)
    ctx = [0, 1, bs, 3 * KS + 1, 2 * bs + 3, 0]
    q, _, _, kc, vc, meta = checks.random_paged_batch([1 if c else 0 for c in ctx], ctx, Hq, Hkv, D, bs,
                                                      torch.float32, DEVICE, gen, extra_table_cols=9)
    q = torch.randn(len(ctx), Hq, D, generator=gen).to(DEVICE)  # as a CUDA-graph batch: one row per sequence
    meta.query_start_loc = torch.arange(len(ctx) + 1, dtype=torch.int32, device=DEVICE)
    meta.query_start_loc_cpu, meta.max_query_len = list(range(len(ctx) + 1)), 1
    out = torch.full_like(q, float("nan"))
    paged_attention_invariant(q, kc, vc, meta, D**-0.5, out=out, **walk, **LAUNCH)
    assert checks.rel_err(out, checks.attention_reference(q, kc, vc, meta, D**-0.5)) <= checks.TOLERANCE[torch.float32]
    assert not out[0].any() and not out[-1].any()  # padding rows: zeros


def _checks(hq, hkv, dtype, cases, **kw):
    Hq, Hkv, D, bs = (hq, hkv, 128, 16) if CUDA else (hq, hkv) + SMALL
    main_len = 3000 if CUDA else 70  # CUDA: the company reaches 4,201 tokens; CPU: 3 splits of 32
    return inv.invariance_checks(Hq, Hkv, D, bs, dtype, DEVICE, main_len=main_len, cases=cases,
                                 **{**LAUNCH, **kw})


@pytest.mark.parametrize("case", inv.CASES)
@pytest.mark.parametrize("hq,hkv,dtype", [(3, 1, torch.float32), (8, 1, torch.bfloat16)] if not CUDA else
                         [(16, 2, torch.bfloat16), (16, 2, torch.float16)])
def test_a_rows_bits_depend_only_on_its_sequence_and_position(case, hq, hkv, dtype):
    # CUDA: the Qwen2.5-3B attention shape (16 q heads, 2 KV heads, head_dim 128, page 16)
    assert _checks(hq, hkv, dtype, [case]) == {case: True}


TALL = 128 if CUDA else 64  # prefill_block_m: 16 (CUDA) / 8 (CPU) query tokens of a group of 8 per tile


@pytest.mark.parametrize("case", inv.CASES)
def test_taller_prefill_tiles_with_mma_row_sums_keep_every_rows_bits(case):
    # prefill_block_m: chunks in TALL-row tiles, decodes in 16-row ones; the MMA row sums are what
    # should make the tile's height invisible in a row's bits (on the GPU: the H200 decides)
    hq, hkv, dtype = (16, 2, torch.bfloat16) if CUDA else (8, 1, torch.bfloat16)
    assert _checks(hq, hkv, dtype, [case], prefill_block_m=TALL) == {case: True}


@pytest.mark.parametrize("dtype", DTYPES)
def test_taller_prefill_tiles_match_the_reference(dtype):
    gen = torch.Generator().manual_seed(7)
    Hq, Hkv, D, bs = _shape(8, 1)
    q, _, _, kc, vc, meta = checks.random_paged_batch([1, 20, 37, 1], [KS + 1, 20, 2 * KS + 26, 45], Hq, Hkv, D,
                                                      bs, dtype, DEVICE, gen, pad_tokens=2)
    out = torch.full_like(q, float("nan"))
    paged_attention_invariant(q, kc, vc, meta, D**-0.5, out=out, prefill_block_m=TALL, **LAUNCH)
    err = checks.rel_err(out, checks.attention_reference(q, kc, vc, meta, D**-0.5))
    assert err <= checks.TOLERANCE[dtype], f"relative error {err:.3g} ({dtype})"


def test_the_invariance_checks_see_a_change_of_kv_split():
    # the same kernel with other split sizes on the two sides: rows past the first split must differ
    other = inv.invariant_attention(**{**LAUNCH, "kv_split": 2 * KS})
    got = _checks(3, 1, torch.float32, ["decode_alone", "chunks_of_16"], baseline=other)
    assert got == {"decode_alone": False, "chunks_of_16": False}


def test_the_engines_decode_and_prefill_kernels_are_not_batch_invariant():
    # what TritonOps runs today: a decode (split-K, split count from the batch) differs from the
    # same position's prefill row, so the invariance checks do fail on a kernel that lacks it
    got = _checks(8, 1 if not CUDA else 2, torch.bfloat16, ["decode_alone", "decode_in_padded_batch"],
                  attn=inv.legacy_attention)
    assert not all(got.values()), got


def test_rejects_a_kv_split_that_is_not_a_multiple_of_the_key_tile():
    gen = torch.Generator().manual_seed(0)
    q, _, _, kc, vc, meta = checks.random_paged_batch([1], [5], 2, 1, 16, 8, torch.float32, DEVICE, gen)
    with pytest.raises(ValueError, match="kv_split"):
        paged_attention_invariant(q, kc, vc, meta, 0.25, kv_split=40, block_n=16)
    with pytest.raises(ValueError, match="block_m"):
        paged_attention_invariant(q, kc, vc, meta, 0.25, block_m=24)


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_decode_replays_in_a_cuda_graph_with_the_eager_bits():
    pool = inv.PagedPool([700, 100, 2000, 1], 16, 2, 128, 16, torch.bfloat16, DEVICE)
    q, meta = pool.batch([(0, 600, 601), (1, 40, 41), (None, 0, 1), (2, 1500, 1501)], extra_cols=8)
    out = torch.empty_like(q)
    run = lambda: paged_attention_invariant(q, pool.k_cache, pool.v_cache, meta, pool.scale, out=out)  # noqa: E731
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    q2, meta2 = pool.batch([(0, 699, 700), (None, 0, 1), (1, 99, 100), (2, 1999, 2000)], extra_cols=8)
    q.copy_(q2)
    meta.seq_lens.copy_(meta2.seq_lens)
    meta.block_tables.copy_(meta2.block_tables)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    eager = paged_attention_invariant(q2, pool.k_cache, pool.v_cache, meta2, pool.scale)
    assert torch.equal(out, eager)
    ref = checks.attention_reference(q2, pool.k_cache, pool.v_cache, meta2, pool.scale)
    assert checks.rel_err(out, ref) <= checks.TOLERANCE[torch.bfloat16]


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_a_decode_tile_map_made_inside_a_capture_never_serves_an_eager_call():
    # a decode batch's tile map created during a graph capture holds its values only once the
    # graph replays: an eager call of the same batch size before any replay must build its own
    pool = inv.PagedPool([300, 40, 9, 70, 5], 16, 2, 128, 16, torch.bfloat16, DEVICE)
    q2, meta2 = pool.batch([(0, 200, 201), (1, 30, 31)])
    paged_attention_invariant(q2, pool.k_cache, pool.v_cache, meta2, pool.scale)  # compiles, outside the capture
    torch.cuda.synchronize()
    rows = [(0, 250, 251), (1, 35, 36), (2, 7, 8), (3, 60, 61), (4, 3, 4)]  # 5: a batch size no other test uses
    q, meta = pool.batch(rows)
    out = torch.empty_like(q)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_attention_invariant(q, pool.k_cache, pool.v_cache, meta, pool.scale, out=out)
    _, fresh = pool.batch(rows)
    eager = paged_attention_invariant(q, pool.k_cache, pool.v_cache, fresh, pool.scale)  # before any replay
    ref = checks.attention_reference(q, pool.k_cache, pool.v_cache, fresh, pool.scale)
    assert checks.rel_err(eager, ref) <= checks.TOLERANCE[torch.bfloat16]
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16] if CUDA else [torch.bfloat16])
@pytest.mark.parametrize("tall", [None, TALL])
def test_programs_walking_several_splits_give_the_one_program_per_split_bits(tall, dtype):
    # the grid's split programs (split_programs) follow the batch and max_model_len; the bits must not
    # (fp16 too: a T4 has no bf16)
    gen = torch.Generator().manual_seed(11)
    Hq, Hkv, D, bs = _shape(8, 1)
    for q_lens, ctx in (([1, 1, 1], [3 * KS + 5, KS - 3, 2 * KS]),  # a decode batch
                        ([1, 20, 37, 1], [KS + 1, 20, 2 * KS + 26, 45])):  # a mixed step
        q, _, _, kc, vc, meta = checks.random_paged_batch(q_lens, ctx, Hq, Hkv, D, bs, dtype, DEVICE, gen)
        # P = 1 walks a tile's splits as one loop over key tiles (flat) unless told not to; a deeper
        # software pipeline changes no arithmetic either
        walks = [{"split_programs": None, "phased": False}] + [{"split_programs": p} for p in (None, 1, 2, 64)] + [
            {"split_programs": 1, "flat": False}, {"split_programs": 1, "flat": True, "split_stages": 3},
            {"split_programs": 2, "split_stages": 3},
            # a split's key tiles in phases (K loads, scores, maxes, V loads, p @ V, folds) instead of one by one
            {"split_programs": 2, "phased": True}, {"split_programs": 1, "flat": False, "phased": True},
            {"split_programs": 64, "phased": False}]
        if tall is not None:  # with MMA row sums the warps move no bit (a tl.sum tree would follow them)
            walks += [{"split_warps": 4}, {"split_warps": 8, "split_programs": 1, "flat": False},
                      {"split_warps": 8, "split_programs": 64, "phased": True}]
        outs = [paged_attention_invariant(q, kc, vc, meta, D**-0.5, prefill_block_m=tall, **w, **LAUNCH) for w in walks]
        for w, other in zip(walks[1:], outs[1:]):
            assert torch.equal(outs[0], other), w
        if not CUDA:  # the interpreter's 32-key splits hold two tiles: four in phases too (the GPU's case)
            four = [paged_attention_invariant(q, kc, vc, meta, D**-0.5, prefill_block_m=tall, split_programs=2,
                                              phased=p, kv_split=64, block_n=16) for p in (False, True)]
            assert torch.equal(*four)
    with pytest.raises(ValueError, match="split_programs must be 1"):
        paged_attention_invariant(q, kc, vc, meta, D**-0.5, split_programs=2, flat=True, **LAUNCH)
    with pytest.raises(ValueError, match="phased walks a split of two or four"):
        paged_attention_invariant(q, kc, vc, meta, D**-0.5, split_programs=1, flat=True, phased=True, **LAUNCH)
    with pytest.raises(ValueError, match="phased walks a split of two or four"):
        paged_attention_invariant(q, kc, vc, meta, D**-0.5, phased=True, kv_split=8 * KS, block_n=KS)


def test_the_phased_policy_takes_small_decode_launches_only_and_keeps_their_bits(monkeypatch):
    # PHASED_MAX_TILES: on for the 8-warp decode launches (adopted after the H200 A/B at ac249bd);
    # lab.profiling's attn_unphased patch turns it off for A/Bs
    from pageserve.kernels import paged_invariant
    from pageserve.lab.profiling import PATCHES

    gen = torch.Generator().manual_seed(12)
    Hq, Hkv, D, bs = _shape(8, 2)
    q, _, _, kc, vc, meta = checks.random_paged_batch([1, 1], [3 * KS + 5, KS - 3], Hq, Hkv, D, bs, torch.bfloat16,
                                                      DEVICE, gen)
    calls = []
    if not CUDA:  # the interpreter resolves the helper at call time: count the launches' phased splits
        phased_split = paged_invariant._phased_split

        def spy(*args, **kwargs):
            calls.append(1)
            return phased_split.fn(*args, **kwargs)
        monkeypatch.setattr(paged_invariant, "_phased_split", spy)
    assert paged_invariant.PHASED_MAX_TILES == paged_invariant.WIDE_WARPS_MAX_TILES
    auto = paged_attention_invariant(q, kc, vc, meta, D**-0.5, prefill_block_m=TALL, **LAUNCH)
    assert CUDA or calls
    calls.clear()  # no MMA row sums (a T4): the launch keeps the loop
    paged_attention_invariant(q, kc, vc, meta, D**-0.5, **LAUNCH)
    assert not calls
    with PATCHES["attn_unphased"]():
        assert paged_invariant.PHASED_MAX_TILES == 0
        loop = paged_attention_invariant(q, kc, vc, meta, D**-0.5, prefill_block_m=TALL, **LAUNCH)
        assert not calls
    assert paged_invariant.PHASED_MAX_TILES == paged_invariant.WIDE_WARPS_MAX_TILES
    assert torch.equal(loop, auto)
    # a launch of more tiles than the bound keeps the loop
    q9, _, _, kc9, vc9, meta9 = checks.random_paged_batch([1] * 5, [3 * KS + 5] * 5, Hq, Hkv, D, bs, torch.bfloat16,
                                                          DEVICE, gen)
    paged_attention_invariant(q9, kc9, vc9, meta9, D**-0.5, prefill_block_m=TALL, **LAUNCH)
    assert not calls


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16] if CUDA else [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("walk", [{}, {"split_programs": 1, "flat": True}, {"split_programs": 1, "flat": False},
                                  {"split_programs": 2}, {"split_programs": 2, "phased": True}])
def test_rope_inside_the_decode_launch_gives_the_bits_of_rope_kv_then_the_kernel(walk, dtype):
    # the newest position at a split's first slot (KS + 1), its last (KS), a block's first (bs + 1), one key,
    # several splits, padding rows (context 0: slot -1, no write); every walk of the splits over programs
    gen = torch.Generator().manual_seed(5)
    Hq, Hkv, D, bs = _shape(8, 2)
    ctx = [0, 1, KS, KS + 1, bs + 1, 3 * KS + 7, 2 * KS - 1, 0]
    same_out, same_cache = checks.check_invariant_rope_decode(ctx, Hq, Hkv, D, bs, dtype, DEVICE, gen,
                                                              **walk, **LAUNCH)
    assert same_out and same_cache


def test_rope_inside_the_launch_refuses_a_step_with_prompt_chunks():
    gen = torch.Generator().manual_seed(6)
    Hq, Hkv, D, bs = _shape(8, 2)
    q, k, v, kc, vc, meta = checks.random_paged_batch([3, 1], [10, 5], Hq, Hkv, D, bs, torch.float32, DEVICE, gen)
    rope = (k, v, torch.zeros(4, dtype=torch.int64, device=DEVICE), torch.zeros(64, D, device=DEVICE),
            torch.zeros(4, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="decode batches only"):
        paged_attention_invariant(q, kc, vc, meta, D**-0.5, rope=rope, **LAUNCH)
