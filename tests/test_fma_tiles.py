"""Launches on a GPU whose Triton dots run on FMAs (below sm_80: a Colab T4): the tiles each kernel
takes there (``_util.mma_dot_for`` False), that they leave the sm_80+ choices untouched, and that the
kernels on those tiles still match their references (CPU: Triton's interpreter, with the device
reported as FMA-only). scripts/t4_compile_audit.py compiles the same tiles for sm_75 (tests/test_t4_compile.py)."""
import importlib
import os
import zlib

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pageserve.kernels import paged_decode, paged_invariant, paged_prefill  # noqa: E402
from pageserve.kernels._util import mma_dot_for  # noqa: E402
from pageserve.kernels.gemv_int8 import dequantize_int8  # noqa: E402
from pageserve.kernels.paged_decode import DecodeSchedule, decode_num_splits, decode_schedule  # noqa: E402
from pageserve.kernels.reference import quantize_int8  # noqa: E402
from pageserve.lab import kernel_checks as checks  # noqa: E402
from pageserve.lab.kernel_checks import TOLERANCE  # noqa: E402
from pageserve.model import triton_ops  # noqa: E402
from pageserve.model.quant import QuantizedWeight  # noqa: E402

mi = importlib.import_module("pageserve.kernels.matmul_invariant")  # the package exports its function by that name
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture
def gen(request):
    return torch.Generator().manual_seed(zlib.crc32(request.node.name.encode()))


@pytest.fixture
def fma_device(monkeypatch):
    """Every launch below sees a device whose dots run on FMAs."""
    for module in (paged_decode, paged_prefill, paged_invariant, mi, triton_ops):
        monkeypatch.setattr(module, "mma_dot_for", lambda t: False)


def test_the_cpu_and_the_interpreter_count_as_mma_devices():
    # so every CPU test elsewhere runs the tiles the H200 runs
    assert mma_dot_for(torch.empty(1))


def test_fma_devices_get_their_own_tiles_and_mma_devices_keep_theirs():
    def sched(batch, mma):  # 40 SMs (a T4), Qwen2.5-3B heads, a 1,024-token table
        return decode_schedule(batch, 2, 128, 2, 64, 16, 40, False, mma)

    for batch in (1, 16, 64, 256):
        assert sched(batch, False) == DecodeSchedule(decode_num_splits(batch, 2, 64, 16, 40), 16, 8, 2, True)
    assert sched(1, True).block_n == 32 and sched(64, True).block_n == 64  # the split rule as before
    assert paged_prefill.prefill_config(8, mma=False) == (64, 16, 8, 2)
    assert paged_prefill.prefill_config(8) == (64, 64, 4, 2)
    # the mixed-step graphs build their tile maps with prefill_block_m: FMA tiles keep that height
    assert paged_prefill.prefill_config(8, mma=False)[0] == paged_prefill.prefill_block_m(8)
    for M in (1, 16, 17, 512, 4096):
        cfg = mi.invariant_config(M, 2048, torch.float16, 40, K=2048, mma=False)
        assert cfg == mi.FMA_CONFIG[16 if M <= 16 else 32] and not cfg.tma and not cfg.persistent
    assert mi.invariant_config(17, 2048, torch.float16, 40, block_m=64, mma=False).block_m == 64  # an override wins


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_and_prefill_attention_on_fma_tiles_match_the_reference(fma_device, dtype, gen):
    err = checks.check_decode([0, 1, 17, 33, 70], 8, 2, 64, 16, dtype, DEVICE, gen)
    assert err < TOLERANCE[dtype], err
    q, _, _, kc, vc, meta = checks.random_paged_batch([5, 1, 40], [5, 30, 72], 8, 2, 64, 16, dtype, DEVICE, gen)
    out = paged_prefill.paged_prefill_attention(q, kc, vc, meta, 64 ** -0.5)
    # the launch took the FMA tiles: bit for bit the same call with them spelled out
    assert torch.equal(out, paged_prefill.paged_prefill_attention(q, kc, vc, meta, 64 ** -0.5, block_m=64,
                                                                  block_n=16, num_warps=8))
    err = checks.rel_err(out, checks.attention_reference(q, kc, vc, meta, 64 ** -0.5))
    assert err < TOLERANCE[dtype], err


@pytest.mark.parametrize("dtype", DTYPES)
def test_invariant_matmul_and_attention_on_fma_tiles_match_the_reference(fma_device, dtype, gen):
    x = torch.randn(20, 96, generator=gen).to(DEVICE, dtype)
    w = torch.randn(72, 96, generator=gen).to(DEVICE, dtype)
    out = mi.matmul_invariant(x, w)
    assert torch.equal(out, mi.matmul_invariant(x, w, config=mi.FMA_CONFIG[32]))
    ref = x.double() @ w.double().t()
    assert checks.rel_err(out, ref) < TOLERANCE[dtype]
    q, _, _, kc, vc, meta = checks.random_paged_batch([1, 1, 1], [3, 40, 300], 8, 2, 64, 16, dtype, DEVICE, gen)
    out = paged_invariant.paged_attention_invariant(q, kc, vc, meta, 64 ** -0.5)
    assert torch.equal(out, paged_invariant.paged_attention_invariant(q, kc, vc, meta, 64 ** -0.5,
                                                                      block_n=paged_invariant.FMA_BLOCK_N))
    assert checks.rel_err(out, checks.attention_reference(q, kc, vc, meta, 64 ** -0.5)) < TOLERANCE[dtype]


def test_int8_rows_above_one_take_dequantize_and_the_dense_product_on_fma_devices(fma_device, gen):
    ops = triton_ops.TritonOps()
    q, s = quantize_int8(torch.randn(48, 64, generator=gen))
    w = QuantizedWeight(q.to(DEVICE), s.to(DEVICE))
    x = torch.randn(4, 64, generator=gen).to(DEVICE)
    assert torch.equal(ops.linear(x, w, None), torch.nn.functional.linear(x, dequantize_int8(w.qweight, w.scale)))
    # one row still runs the int8 GEMV (no dot there): not the dense product's bits in general, but close
    one = ops.linear(x[:1], w, None)
    assert checks.rel_err(one, x[:1].double() @ (q.double() * s.double()[:, None]).t().to(DEVICE)) < 1e-5
