"""matmul_invariant: the reference on random inputs, and each row's bits independent of the batch.

CPU: Triton's interpreter (TRITON_INTERPRET=1, set by conftest.py and below) on small odd shapes;
there tl.dot is numpy's matmul on fixed tile shapes, so invariance holds there too, and a BLOCK_K
change shows (the interpreter adds each K tile's product to the accumulator, as a separate sum).
CUDA: the Qwen2.5-3B shapes in bf16 and fp16, and CUDA-graph capture. Timings live in
``pageserve.lab.determinism_checks.invariance_report``, not here.
"""
import dataclasses
import os
import zlib

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pageserve.kernels import matmul_invariant  # noqa: E402
from pageserve.kernels._util import interpreting  # noqa: E402
from pageserve.kernels.matmul_invariant import (BLOCK_K, BLOCK_M, InvariantMatmulConfig,  # noqa: E402
                                                invariant_config, matmul_invariant_reference)
from pageserve.lab.determinism_checks import (BLOCK_M_POLICIES, invariance_mismatches, invariance_report,  # noqa: E402
                                              split_k_by_m)
from pageserve.lab.kernel_bench.shapes import GEMV_SHAPES  # noqa: E402
from pageserve.lab.kernel_checks import TOLERANCE, rel_err  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
N_ODD, K_ODD = (1001, 2049) if CUDA else (37, 301)
# fp32 against float64: a K-long fp32 sum lands ~1e-7 relative; half types: one output rounding
TIGHT = {torch.float32: 2e-6, torch.float16: TOLERANCE[torch.float16], torch.bfloat16: TOLERANCE[torch.bfloat16]}


@pytest.fixture
def gen(request):
    return torch.Generator().manual_seed(zlib.crc32(request.node.name.encode()))


def _rand(gen, *shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(device=DEVICE, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 3, 17, 70])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_the_float64_reference_on_odd_shapes(dtype, M, with_bias, gen):
    x, w = _rand(gen, M, K_ODD, dtype=dtype), _rand(gen, N_ODD, K_ODD, dtype=dtype, scale=K_ODD**-0.5)
    bias = _rand(gen, N_ODD, dtype=dtype) if with_bias else None
    out = torch.full((M, N_ODD), float("nan"), device=DEVICE, dtype=dtype)
    got = matmul_invariant(x, w, bias, out=out)
    assert got is out and got.dtype == dtype
    ref = matmul_invariant_reference(x.double(), w.double(), None if bias is None else bias.double())
    err = rel_err(got, ref)
    assert err <= TIGHT[dtype], f"relative error {err:.3g} > {TIGHT[dtype]:.0e} ({dtype})"


def test_writes_into_a_strided_out_buffer_and_handles_empty_batches(gen):
    x, w = _rand(gen, 5, 64), _rand(gen, 20, 64)
    wide = torch.zeros(5, 32, device=DEVICE)
    matmul_invariant(x, w, out=wide[:, 4:24])
    assert torch.equal(wide[:, 4:24], matmul_invariant(x, w))
    assert not wide[:, :4].any() and not wide[:, 24:].any()
    assert matmul_invariant(x[:0], w).shape == (0, 20)


def test_rejects_bad_arguments(gen):
    x, w = _rand(gen, 2, 64), _rand(gen, 20, 64)
    with pytest.raises(ValueError, match="w"):
        matmul_invariant(x, w[:, :32])
    with pytest.raises(ValueError, match="bias"):
        matmul_invariant(x, w, _rand(gen, 19))
    with pytest.raises(ValueError, match="out"):
        matmul_invariant(x, w, out=torch.empty(2, 20, device=DEVICE, dtype=torch.float16))
    with pytest.raises(ValueError, match="block_m"):
        matmul_invariant(x, w, block_m=48)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_interpreter_and_fp32_keep_one_block_k_and_block_m_for_every_batch_size(dtype):
    # where a tile's product is a separate sum (the interpreter) or the dot is an fma chain (fp32),
    # the config keeps one BLOCK_K and BLOCK_M (and there is no split-K: the config has no such
    # field, the grid is one program per output tile); bf16/fp16 on the GPU: the next tests
    if not (interpreting() or dtype == torch.float32):
        pytest.skip("bf16/fp16 on the GPU follow measured_config")
    Ms = (1, 2, 7, 8, 16, 17, 32, 33, 64, 255, 256, 1024, 4096, 16384)
    for N in (37, 2048, 2560, 22016, 151936):
        cfgs = [invariant_config(M, N, dtype, sms=132) for M in Ms]
        assert {c.block_k for c in cfgs} == {BLOCK_K[dtype]}
        assert {c.block_m for c in cfgs} == {BLOCK_M[dtype]}
    assert invariant_config(1, 2048, dtype, sms=132).block_n == 16  # the narrowest tile at N = 2048
    if interpreting():  # numpy's tile matmul rounds by the tile's width: BLOCK_N follows N alone
        assert {invariant_config(M, 2048, dtype, sms=132).block_n for M in (1, 64, 16384)} == {16}


def test_the_gpu_policy_follows_the_h200_sweep_and_fits_a_t4(monkeypatch):
    # the branch the CPU run cannot take: bf16/fp16 tiles by row count (measured_config), shrunk
    # to the shared memory at hand; BLOCK_K and the TMA choice survive the shrinking
    import sys

    mi = sys.modules["pageserve.kernels.matmul_invariant"]
    monkeypatch.setattr(mi, "interpreting", lambda: False)
    big = mi.invariant_config(8192, 22016, torch.bfloat16, sms=132, K=2048)
    assert (big.block_m, big.block_n, big.block_k, big.tma) == (256, 128, 64, True)
    assert mi.invariant_config(1, 2048, torch.bfloat16, sms=132, K=11008).block_m == 16
    assert not mi.invariant_config(1, 2048, torch.bfloat16, sms=132, K=11008).tma
    t4 = 64 << 10
    for M in (1, 40, 500, 8192):
        for N, K in GEMV_SHAPES.values():
            full = mi.invariant_config(M, N, torch.float16, sms=40, K=K)
            cfg = mi.invariant_config(M, N, torch.float16, sms=40, K=K, smem_bytes=t4)
            assert (cfg.block_m + cfg.block_n) * cfg.block_k * 2 * cfg.num_stages <= t4, cfg
            assert cfg.num_stages >= 2 and (cfg.block_k, cfg.tma) == (full.block_k, full.tma)
    # an override (the lab's BLOCK_M policies and sweeps) goes through the occupancy rule
    assert mi.invariant_config(4096, 2048, torch.bfloat16, sms=132, block_m=64).block_m == 64


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_each_row_has_the_same_bits_alone_in_any_batch_and_at_any_position(dtype, with_bias, gen):
    w = _rand(gen, N_ODD, K_ODD, dtype=dtype, scale=K_ODD**-0.5)
    bias = _rand(gen, N_ODD, dtype=dtype) if with_bias else None
    probe = _rand(gen, 4, K_ODD, dtype=dtype)
    sizes = (2, 7, 33, 70) if not CUDA else (2, 7, 64, 257, 1024, 2048)
    mism = invariance_mismatches(lambda x: matmul_invariant(x, w, bias), probe, sizes, gen)
    assert not any(mism.values()), f"rows whose bits changed with the batch: {mism}"


def test_the_invariance_check_catches_a_split_k_that_follows_the_batch_size(gen):
    # the checker itself must be able to fail: a batch splits K in two halves, alone it does not
    w = _rand(gen, N_ODD, K_ODD, scale=K_ODD**-0.5)
    probe = _rand(gen, 4, K_ODD)
    mism = invariance_mismatches(split_k_by_m(w), probe, (2, 7), gen)
    assert all(mism.values()), mism


def test_a_block_k_that_follows_the_batch_size_changes_rows(gen):
    # BLOCK_K sets where the sum is cut on the interpreter (and, if Triton does not feed the
    # accumulator to the MMA, on the GPU): a variant whose BLOCK_K follows M is not invariant
    w = _rand(gen, N_ODD, K_ODD, scale=K_ODD**-0.5)
    probe = _rand(gen, 4, K_ODD)

    def variant(x):
        cfg = invariant_config(x.shape[0], N_ODD, torch.float32, sms=4)
        if x.shape[0] > 1:
            # twice the K tile with half the stages: the same shared memory (at 8 stages the H200
            # refused the launch, 258 KB > 227 KB, at c099ba1b)
            cfg = InvariantMatmulConfig(cfg.block_m, cfg.block_n, 2 * cfg.block_k, cfg.num_warps,
                                        max(2, cfg.num_stages // 2))
        return matmul_invariant(x, w, config=cfg)

    mism = invariance_mismatches(variant, probe, (2, 7), gen)
    if CUDA:  # an fp32 "ieee" dot is an fma chain through the accumulator: BLOCK_K may not show
        print(f"fp32 BLOCK_K 32 alone vs 64 in a batch, rows that differ: {mism}")
    else:
        assert any(mism.values()), mism


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 17, 70])
def test_tma_loads_give_the_pointer_loads_bits(dtype, M, gen):
    # the same MMAs over the same K slices, the tiles fetched by TMA descriptors (zeros past M and K
    # from the descriptor's bounds, as the masked loads give): bitwise the pointer kernel's rows
    from pageserve.kernels.matmul_invariant import _tma_ok
    K = 2056 if CUDA else 264  # K * 2 bytes a multiple of 16, not of BLOCK_K: the last tile is partial
    x, w = _rand(gen, M, K, dtype=dtype), _rand(gen, N_ODD, K, dtype=dtype, scale=K**-0.5)
    bias = _rand(gen, N_ODD, dtype=dtype)
    if not _tma_ok(x, w):
        pytest.skip("no TMA descriptors here (Triton < 3.4 or a GPU before Hopper)")
    cfg = invariant_config(M, N_ODD, dtype, sms=132)
    ptr = matmul_invariant(x, w, bias, config=cfg)
    tma = matmul_invariant(x, w, bias, config=dataclasses.replace(cfg, tma=True))
    assert torch.equal(tma, ptr)
    # the persistent variant: fewer programs than tiles, each walking several (sm_count_for on the
    # CPU is num_sms(0); on the GPU the SM count) -- the same tiles, so the same bits
    small = dataclasses.replace(cfg, block_n=16, tma=True, persistent=True)
    assert torch.equal(matmul_invariant(x, w, bias, config=small), ptr)
    if CUDA:  # and it replays in a CUDA graph (the descriptors are launch parameters)
        out = torch.empty_like(ptr)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            matmul_invariant(x, w, bias, out=out, config=dataclasses.replace(cfg, tma=True))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ptr)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 17, 70])
def test_silu_mul_in_the_epilogue_gives_the_separate_kernels_bits(dtype, M, gen):
    # the gate_up product with SiLU(gate) * up in its epilogue (deterministic mode's MLP) must be
    # bitwise silu_and_mul(the product), for the pointer, TMA and persistent tiles, and row by row
    from pageserve.kernels import silu_and_mul
    from pageserve.kernels.matmul_invariant import _tma_ok
    from pageserve.kernels.reference import silu_and_mul as silu_and_mul_reference
    I, K = N_ODD, 2056 if CUDA else 264  # an odd intermediate width: a last column tile past the gate rows
    x, w = _rand(gen, M, K, dtype=dtype), _rand(gen, 2 * I, K, dtype=dtype, scale=K**-0.5)
    separate = silu_and_mul(matmul_invariant(x, w))
    out = torch.full((M, I), float("nan"), device=DEVICE, dtype=dtype)
    assert matmul_invariant(x, w, silu_mul=True, out=out) is out
    assert torch.equal(out, separate)
    assert all(torch.equal(matmul_invariant(x[i:i + 1].clone(), w, silu_mul=True)[0], out[i]) for i in range(M))
    ref = silu_and_mul_reference(matmul_invariant_reference(x.double(), w.double()))
    assert rel_err(out, ref) <= 4 * TIGHT[dtype]  # two roundings (gate, up) before the product's
    if _tma_ok(x, w):
        cfg = invariant_config(M, 2 * I, dtype, sms=132, K=K)
        for tile in (dataclasses.replace(cfg, tma=True), dataclasses.replace(cfg, block_n=32, tma=True, persistent=True)):
            assert torch.equal(matmul_invariant(x, w, silu_mul=True, config=tile), separate), tile


def test_the_pdl_release_point_changes_no_bit_and_is_checked(gen):
    # pdl_release only moves where a program lets the next kernel launch (under PDL, on sm_90+): the same
    # values either way, on every path (pointer, TMA, SiLU·mul epilogue); an unknown point is refused
    x, w = _rand(gen, 5, 96, dtype=torch.bfloat16), _rand(gen, 2 * 48, 96, dtype=torch.bfloat16)
    for silu in (False, True):
        for tma in (False, True):
            cfg = InvariantMatmulConfig(16, 16, BLOCK_K[torch.bfloat16], tma=tma)
            top = matmul_invariant(x, w, silu_mul=silu, config=cfg, pdl=True)
            late = matmul_invariant(x, w, silu_mul=silu, config=cfg, pdl=True, pdl_release="after_loop")
            assert torch.equal(top, late), (silu, tma)
    for bad in ("late", 0, True):
        with pytest.raises(ValueError, match="pdl_release"):
            matmul_invariant(x, w, pdl_release=bad)


def test_silu_mul_refuses_a_bias_and_an_odd_gate_up_width(gen):
    x, w = _rand(gen, 3, 64), _rand(gen, 20, 64)
    with pytest.raises(ValueError, match="no bias"):
        matmul_invariant(x, w, _rand(gen, 20), silu_mul=True)
    with pytest.raises(ValueError, match="even row count"):
        matmul_invariant(x, w[:19], silu_mul=True)
    with pytest.raises(ValueError, match="out"):
        matmul_invariant(x, w, silu_mul=True, out=torch.empty(3, 20, device=DEVICE))


def test_tma_is_refused_where_descriptors_cannot_address_the_operands(gen):
    from pageserve.kernels.matmul_invariant import TensorDescriptor, _tma_ok
    x, w = _rand(gen, 4, 72), _rand(gen, 8, 72)
    assert _tma_ok(x, w) == (TensorDescriptor is not None and (not CUDA or torch.cuda.get_device_capability()[0] >= 9))
    assert not _tma_ok(x[:, 1:], w[:, 1:])  # bases 4 bytes past a 16-byte boundary
    assert not _tma_ok(_rand(gen, 4, 70), _rand(gen, 8, 70))  # rows of 280 bytes: not a multiple of 16
    assert not _tma_ok(x.t(), w)  # the inner stride is not 1


@pytest.mark.skipif(CUDA, reason="the CPU smoke run of the notebook helper (on the GPU: the notebook)")
def test_invariance_report_names_every_case_and_finds_the_default_invariant():
    r = invariance_report(shapes={"tiny": (37, 301)}, dtypes=(torch.bfloat16,), batch_sizes=(2, 7), probe_rows=2,
                          device=DEVICE)
    assert set(r["invariant"]) == {f"bf16/tiny/block_m:{p}" for p in BLOCK_M_POLICIES} | {"bf16/tiny/cublas"}
    assert r["invariant"]["bf16/tiny/block_m:default"] is True
    assert set(r["mismatches"]["bf16/tiny/cublas"]) == {"M=2", "M=7", "shuffled"}


# ---------------------------------------------------------------------------- GPU: the Qwen2.5-3B shapes
@pytest.mark.skipif(not CUDA, reason="the 3B shapes need a GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", list(GEMV_SHAPES), ids=list(GEMV_SHAPES))
def test_qwen3b_shapes_rows_are_batch_invariant(shape, dtype, gen):
    N, K = GEMV_SHAPES[shape]
    w = _rand(gen, N, K, dtype=dtype, scale=K**-0.5)
    probe = _rand(gen, 8, K, dtype=dtype)
    sizes = (2, 7, 64, 257, 1024, 2048)  # every row class of measured_config
    mism = invariance_mismatches(lambda x: matmul_invariant(x, w), probe, sizes, gen)
    assert not any(mism.values()), f"{shape}: rows whose bits changed with the batch: {mism}"
    # recorded, not asserted: does a BLOCK_M that follows M stay invariant (mma.sync vs wgmma)?
    for name, policy in BLOCK_M_POLICIES.items():
        if name != "default":
            m = invariance_mismatches(lambda x: matmul_invariant(x, w, block_m=policy(x.shape[0])), probe, sizes, gen)
            print(f"{shape} {dtype} block_m policy {name}: invariant={not any(m.values())} {m}")
    ref = matmul_invariant_reference(probe.double(), w.double())
    assert rel_err(matmul_invariant(probe, w), ref) <= TOLERANCE[dtype]


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_captures_in_a_cuda_graph_and_replays_the_eager_bits(gen):
    x, w, b = _rand(gen, 3, 2048, dtype=torch.bfloat16), _rand(gen, 2560, 2048, dtype=torch.bfloat16), None
    out = torch.empty(3, 2560, device=DEVICE, dtype=torch.bfloat16)
    eager = matmul_invariant(x, w, b)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        matmul_invariant(x, w, b, out=out)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@pytest.mark.skipif(not CUDA, reason="the interpreter does not specialize (both compiles are one function there)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_the_m_specialized_and_generic_compiles_give_the_same_bits(dtype, gen):
    # graph captures run the M-specialized compile, eager calls the generic one (_two_compiles):
    # a row must not see which, at the row counts where the specialization differs (1, multiples
    # of 16, others), on every 3B shape, with and without SiLU·mul
    for shape, (N, K) in GEMV_SHAPES.items():
        w = _rand(gen, N, K, dtype=dtype, scale=K**-0.5)
        for M in (1, 7, 16, 64, 100, 512):
            x = _rand(gen, M, K, dtype=dtype)
            for silu in ((False, True) if shape == "gate_up" else (False,)):
                spec = matmul_invariant(x, w, silu_mul=silu, specialize=True)
                assert torch.equal(matmul_invariant(x, w, silu_mul=silu, specialize=False), spec), (shape, M, silu)
                graphed = torch.empty_like(spec)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):  # None: the specialized compile inside a capture
                    matmul_invariant(x, w, silu_mul=silu, out=graphed)
                graph.replay()
                torch.cuda.synchronize()
                assert torch.equal(graphed, spec), (shape, M, silu)


@pytest.mark.skipif(not CUDA, reason="the 3B gate_up shape needs a GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_qwen3b_gate_up_with_silu_mul_is_the_separate_kernels_bits_and_batch_invariant(dtype, gen):
    from pageserve.kernels import silu_and_mul
    N, K = GEMV_SHAPES["gate_up"]
    w = _rand(gen, N, K, dtype=dtype, scale=K**-0.5)
    for M in (1, 16, 33, 64, 300, 512, 1024, 4096):  # every row class of measured_config
        x = _rand(gen, M, K, dtype=dtype)
        assert torch.equal(matmul_invariant(x, w, silu_mul=True), silu_and_mul(matmul_invariant(x, w))), M
    probe = _rand(gen, 8, K, dtype=dtype)
    mism = invariance_mismatches(lambda x: matmul_invariant(x, w, silu_mul=True), probe, (2, 7, 64, 257, 1024, 2048), gen)
    assert not any(mism.values()), mism


def test_the_gpu_block_m_policy_as_it_would_run_on_the_gpu(monkeypatch):
    # the branch the CPU run of the test above cannot take
    import sys

    mi = sys.modules["pageserve.kernels.matmul_invariant"]  # the package re-exports the function under this name

    monkeypatch.setattr(mi, "interpreting", lambda: False)
    assert [mi.default_block_m(M, torch.bfloat16) for M in (1, 16, 17, 32, 33, 255, 256)] == [16, 16, 32, 32, 64, 64, 128]
    assert mi.default_block_m(1024, torch.float32) == BLOCK_M[torch.float32]


@pytest.mark.skipif(not CUDA, reason="the interpreter compiles nothing")
def test_row_counts_of_one_config_share_one_compiled_kernel(gen):
    # the first W1 on an engine paid ~0.8 s of compiles for odd row counts (80ed5d6e): M is not
    # specialized on, so M = 47 reuses what M = 48 compiled under the same tile config
    from pageserve.lab.profiling import CompileLog

    if not CompileLog().available:
        pytest.skip("this Triton has no compile hook")
    w = _rand(gen, 2560, 2048, dtype=torch.bfloat16)
    cfg = invariant_config(48, 2560, torch.bfloat16, 132, K=2048)
    assert cfg == invariant_config(47, 2560, torch.bfloat16, 132, K=2048)
    matmul_invariant(_rand(gen, 48, 2048, dtype=torch.bfloat16), w, config=cfg)
    with CompileLog() as log:
        for M in (47, 33, 40):  # one tile config (M in 33..64), no PDL (that is a constexpr: M <= 8)
            matmul_invariant(_rand(gen, M, 2048, dtype=torch.bfloat16), w, config=cfg)
        torch.cuda.synchronize()
    assert log.names == []


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 3, 16, 17])
def test_the_swapped_operand_order_gives_the_same_bits(dtype, M, gen):
    # out^T = w @ x^T (the weight tile as the MMA's A side): each element the same products over the same K
    # slices. With a bias, with SiLU·mul in the epilogue, a last partial column tile, 16- to 128-column tiles,
    # row by row alone; a TMA tile cannot be swapped. On the GPU this is the question itself: does the MMA round
    # a k-step alike whichever operand is A
    K = 2056 if CUDA else 264
    x, w = _rand(gen, M, K, dtype=dtype), _rand(gen, N_ODD, K, dtype=dtype, scale=K**-0.5)
    bias = _rand(gen, N_ODD, dtype=dtype)
    gu = _rand(gen, 2 * N_ODD, K, dtype=dtype, scale=K**-0.5)
    block_m = 16 if dtype == torch.float32 or not CUDA else None
    base = invariant_config(M, N_ODD, dtype, sms=132, K=K, block_m=block_m, block_n=16)
    want, want_silu = matmul_invariant(x, w, bias, config=base), matmul_invariant(x, gu, silu_mul=True, config=base)
    for bn in (16, 64, 128):
        cfg = dataclasses.replace(base, block_n=bn, swap_ab=True)
        assert torch.equal(matmul_invariant(x, w, bias, config=cfg), want), cfg
        assert torch.equal(matmul_invariant(x, gu, silu_mul=True, config=cfg), want_silu), cfg
    alone = dataclasses.replace(base, block_n=64, swap_ab=True)
    assert all(torch.equal(matmul_invariant(x[i:i + 1].clone(), w, bias, config=alone)[0], want[i]) for i in range(M))
    with pytest.raises(ValueError, match="swap_ab"):
        dataclasses.replace(base, tma=True, swap_ab=True)
