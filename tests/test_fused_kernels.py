"""The decode-path fusions (each behind a TritonOps switch) against their references.

- ``silu_mul_gemv``: down projection reading gate|up (``reference.silu_mul_linear``)
- ``gemv(split_k="never")``: the GEMV as one kernel (``reference.linear``)
- ``rotary_write_kv``: RoPE fused with the paged KV write (``reference.rotary_write_kv``)
- ``gate_up_silu``: the gate|up product with SiLU·mul in its epilogue (``reference.gate_up_silu_reference``)

and a tiny decoder that must give the same logits with every switch on or off. CPU: the
Triton interpreter on tiny shapes; CUDA: the same tests on the GPU.
"""
import os
import zlib

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pageserve.model.triton_ops as triton_ops  # noqa: E402
from pageserve.model.triton_ops import TritonOps  # noqa: E402
from pageserve.lab import kernel_checks as checks  # noqa: E402
from pageserve.lab.kernel_checks import TOLERANCE  # noqa: E402
from pageserve.kernels.gemv import GemvConfig, gemv_config  # noqa: E402
from pageserve.lab.kernel_bench.shapes import GEMV_SHAPES as SHAPES_3B  # noqa: E402
from pageserve.model.ops import TorchOps, rope_cos_sin  # noqa: E402
from pageserve.kernels import matmul_invariant, silu_and_mul  # noqa: E402
from pageserve.kernels.gate_up_silu import gate_up_silu, gate_up_silu_reference  # noqa: E402
from pageserve.kernels.matmul_invariant import InvariantMatmulConfig  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture
def gen(request):
    # seeded from the test's name, the same in every process (hash() of a str is salted per process)
    return torch.Generator().manual_seed(zlib.crc32(request.node.name.encode()))


def _ok(err, dtype):
    assert err <= TOLERANCE[dtype], f"relative error {err:.3g} > {TOLERANCE[dtype]:.0e} ({dtype})"


CONFIGS = {"auto": None, "never": None, "split3": GemvConfig(block_n=16, block_k=64, split_k=3)}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 3, 8])
@pytest.mark.parametrize("mode", list(CONFIGS))
def test_silu_mul_gemv_matches_silu_and_mul_then_linear(M, mode, dtype, gen):
    split_k = "never" if mode == "never" else "auto"
    _ok(checks.check_silu_mul_gemv(M, 40, 300, dtype, DEVICE, gen, config=CONFIGS[mode], split_k=split_k), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,N,K", [(1, 33, 1000), (3, 50, 300), (8, 17, 64)])
def test_gemv_without_split_k_matches_linear(M, N, K, dtype, gen):
    _ok(checks.check_gemv(M, N, K, dtype, DEVICE, gen, bias=(N % 2 == 0), split_k="never"), dtype)


@pytest.mark.parametrize("M", [1, 8])
def test_gemv_never_splits_the_3b_decode_shapes_and_still_fills_an_h200(M):
    for name, (N, K) in SHAPES_3B.items():
        cfg = gemv_config(M, N, K, sms=132, split_k="never")
        assert cfg.split_k == 1, name
        assert -(-N // cfg.block_n) >= 2 * 132, f"{name}: {cfg} leaves SMs idle"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d,bs", [(16, 2, 128, 16), (4, 4, 64, 32)])
def test_rotary_write_kv_matches_rotary_then_write_kv_and_skips_padding_slots(hq, hkv, d, bs, dtype, gen):
    # a prompt chunk, a decode, a chunk over a prefix ending mid-block; two padding rows (slot -1)
    _ok(checks.check_rotary_write_kv([3, 1, bs + 2], [3, bs + 4, 2 * bs + 1], hq, hkv, d, bs, dtype, DEVICE, gen), dtype)


def test_fused_rope_kv_writes_the_same_cache_bits_as_the_two_kernels(gen):
    _, k, v, kc, vc, meta = checks.random_paged_batch([4, 1], [4, 20], 1, 2, 64, 16, torch.bfloat16, DEVICE, gen,
                                                      pad_tokens=1)
    q = torch.randn(k.shape[0], 8, 64, generator=gen).to(DEVICE, torch.bfloat16)
    pos = torch.randint(0, 64, (k.shape[0],), generator=gen).to(DEVICE)
    cs = rope_cos_sin(64, 64, 10_000.0, None).to(DEVICE)
    caches = [(kc.clone(), vc.clone()) for _ in range(2)]
    outs = [TritonOps(fuse_rope_kv=fuse).rotary_write_kv(q, k, v, pos, cs, *c, meta.slot_mapping)
            for fuse, c in zip((False, True), caches)]
    for a, b in zip(outs[0] + caches[0], outs[1] + caches[1]):
        assert torch.equal(a, b)


def test_switches_route_to_the_fused_kernels_only_when_on_and_within_gemv_max_m(monkeypatch, gen):
    calls = []
    for name in ("silu_mul_gemv", "rotary_write_kv"):  # the names TritonOps calls
        real = getattr(triton_ops, name)
        monkeypatch.setattr(triton_ops, name, lambda *a, _n=name, _f=real, **kw: calls.append(_n) or _f(*a, **kw))
    w = torch.randn(24, 32, generator=gen).to(DEVICE)
    _, k, v, kc, vc, meta = checks.random_paged_batch([2], [2], 1, 2, 32, 16, torch.float32, DEVICE, gen)
    q, pos = torch.randn(2, 4, 32, generator=gen).to(DEVICE), torch.arange(2, device=DEVICE)
    cs = rope_cos_sin(32, 16, 10_000.0, None).to(DEVICE)
    for ops in (TritonOps(fuse_silu_down=False, fuse_rope_kv=False),
                TritonOps(fuse_silu_down=True, fuse_rope_kv=True, gemv_max_m=4)):
        for M in (2, 6):  # 6 > gemv_max_m: the two-kernel fallback
            gu = torch.randn(M, 64, generator=gen).to(DEVICE)
            torch.testing.assert_close(ops.silu_mul_linear(gu, w), TorchOps().silu_mul_linear(gu, w))
        ops.rotary_write_kv(q, k, v, pos, cs, kc, vc, meta.slot_mapping)
    assert calls == ["silu_mul_gemv", "rotary_write_kv"]
    # on by default (measured, kernels/NOTES.md)
    assert TritonOps().fuse_silu_down and TritonOps().fuse_rope_kv
    assert TritonOps().rope_attention_rows == (9, 128)  # above the PDL steps, to 128 rows (H200 A/Bs, triton_ops)


def test_the_gemv_serves_one_row_and_cublas_two_or_more_by_default(monkeypatch, gen):
    # H200, graphed 3B decode step: GEMV up to 8 rows 4.51 ms at batch 2, cuBLAS from 2 rows 2.73
    # (results/h200/diagnostics/det_b1_switches_6bad32f.*); int8 weights keep their GEMV to 8 rows
    calls = []
    real = triton_ops.gemv
    monkeypatch.setattr(triton_ops, "gemv", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    ops, w = TritonOps(), torch.randn(24, 32, generator=gen).to(DEVICE)
    for M in (1, 2, 8):
        x = torch.randn(M, 32, generator=gen).to(DEVICE)
        torch.testing.assert_close(ops.linear(x, w, None), TorchOps().linear(x, w, None))
    assert ops.gemv_max_m == 1 and calls == [1]


FUSED = {"silu_mul_gemv", "rotary_write_kv", "rope_decode_attention"}  # the kernels the fusion switches turn on
OFF = {"fuse_silu_down": False, "fuse_rope_kv": False, "fuse_rope_attention": False}
SWITCHES = {  # TritonOps keywords -> the fused kernels the steps must run (the defaults: all on)
    "all_off": (OFF, set()),
    "fuse_silu_down": ({**OFF, "fuse_silu_down": True}, {"silu_mul_gemv"}),
    "fuse_rope_kv": ({**OFF, "fuse_rope_kv": True}, {"rotary_write_kv"}),
    # the decode step's RoPE and K/V write in its attention; the prefill's stay two kernels
    "fuse_rope_attention": ({**OFF, "fuse_rope_attention": True}, {"rope_decode_attention"}),
    "defaults": ({}, FUSED - {"rope_decode_attention"}),  # the 2-row decode: under 9 rows, rope_kv's launch
    "all_on_never_split": ({"gemv_split_k": "never", "fuse_rope_attention": True}, FUSED),
}


def test_decoder_logits_are_the_same_with_each_switch_on_and_off(gen, monkeypatch):
    """Prefill (T > gemv_max_m: cuBLAS + fused RoPE/KV) then a 2-row decode (GEMV, fused MLP, RoPE in
    the attention) through PagedAttention, and a prompt through phase 01's contiguous cache (no attend_rope).
    Each setting runs exactly the fused kernels it switches on; off, the separate ones instead."""
    from pageserve.model.attention import PagedAttention
    from pageserve.model.config import ModelConfig
    from pageserve.model.decoder import Decoder
    from pageserve.lab.naive import prompt_logits

    cfg = ModelConfig(architecture="qwen2", vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=1,
                      num_heads=4, num_kv_heads=2, head_dim=16, attention_bias=True, tie_word_embeddings=True,
                      max_position_embeddings=128)
    model = Decoder(cfg).to(DEVICE)
    model.init_dummy_weights(seed=2, std=0.2)
    bs, lens = 8, [9, 3]
    _, _, _, _, _, meta = checks.random_paged_batch(lens, lens, 1, cfg.num_kv_heads, cfg.head_dim, bs,
                                                    torch.float32, DEVICE, gen, spare_blocks=6)
    num_blocks = int(meta.block_tables.max()) + 1
    ids = torch.randint(0, cfg.vocab_size, (sum(lens),), generator=gen).to(DEVICE)
    pos = torch.cat([torch.arange(n) for n in lens]).to(DEVICE)
    dmeta = checks.random_paged_batch([1] * 2, [n + 1 for n in lens], 1, cfg.num_kv_heads, cfg.head_dim, bs,
                                      torch.float32, DEVICE, gen)[-1]
    dmeta.block_tables = meta.block_tables.clone()
    dmeta.slot_mapping = torch.tensor([int(meta.block_tables[i, p // bs]) * bs + p % bs for i, p in enumerate(lens)],
                                      device=DEVICE)
    d_ids = torch.randint(0, cfg.vocab_size, (2,), generator=gen).to(DEVICE)
    d_pos = torch.tensor(lens, device=DEVICE)

    def run(ops):
        model.set_ops(ops)
        cache = torch.randn(cfg.num_layers, 2, num_blocks, bs, cfg.num_kv_heads, cfg.head_dim, generator=gen).to(DEVICE)
        model(ids, pos, PagedAttention(cache, meta, ops))
        decode = model.compute_logits(model(d_ids, d_pos, PagedAttention(cache, dmeta, ops)))
        return decode, prompt_logits(model, ids[:5].tolist())

    ref = run(TorchOps())
    called: set = set()
    for kernel in FUSED | {"silu_and_mul", "rotary", "write_kv"}:  # the names TritonOps calls
        real = getattr(triton_ops, kernel)
        monkeypatch.setattr(triton_ops, kernel, lambda *a, _n=kernel, _f=real, **kw: called.add(_n) or _f(*a, **kw))
    for name, (switches, fused) in SWITCHES.items():
        called.clear()
        # the GEMV (and with it the fused MLP) up to the 2-row decode: by default it stops at 1 row
        # (and SiLU·mul stays out of the gate_up product, which would take the fused MLP's place at 2 rows)
        for got, want in zip(run(TritonOps(gemv_max_m=2, gate_up_silu_rows=None, **switches)), ref):
            assert checks.rel_err(got, want) < 1e-5, name
        assert called & FUSED == fused, (name, called)
        if "silu_mul_gemv" not in fused:  # the 2-row decode's MLP: SiLU·mul kernel, then the GEMV
            assert "silu_and_mul" in called, name
        if "rotary_write_kv" not in fused:
            assert {"rotary", "write_kv"} <= called, name
        else:
            assert "write_kv" not in called, name


def _small_decoder(seed: int):
    """A 2-layer Qwen2-style decoder with random weights on DEVICE: (its config, the model)."""
    from pageserve.model.config import ModelConfig
    from pageserve.model.decoder import Decoder

    cfg = ModelConfig(architecture="qwen2", vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, attention_bias=True, tie_word_embeddings=True,
                      max_position_embeddings=128)
    model = Decoder(cfg)
    model.init_dummy_weights(seed=seed, std=0.2)
    return cfg, model.to(DEVICE)


def _decode_logits(m, cfg, ops, rows: int, cache_seed: int) -> torch.Tensor:
    """Logits of one decode step of ``rows`` sequences (contexts 5, 6, ...) over a random paged cache, with ``ops``."""
    from pageserve.model.attention import PagedAttention

    m.set_ops(ops)
    lens = [5 + r for r in range(rows)]
    meta = checks.random_paged_batch([1] * rows, lens, 1, cfg.num_kv_heads, cfg.head_dim, 8, torch.float32,
                                     DEVICE, torch.Generator().manual_seed(rows))[-1]
    cache = torch.randn(cfg.num_layers, 2, int(meta.block_tables.max()) + 1, 8, cfg.num_kv_heads, cfg.head_dim,
                        generator=torch.Generator().manual_seed(cache_seed)).to(DEVICE)
    with torch.no_grad():
        return m.compute_logits(m(torch.arange(rows, device=DEVICE) + 3, torch.tensor(lens, device=DEVICE) - 1,
                                  PagedAttention(cache, meta, ops)))


def test_gate_up_silu_rows_puts_silu_mul_in_the_gate_up_product_for_those_batches_only(monkeypatch):
    # TritonOps(gate_up_silu_rows=(2, 4)): 2-4 row steps run gate_up with SiLU·mul in its epilogue
    # (matmul_invariant(silu_mul=True)) and down as a plain linear; 1 row (the fused SiLU·down GEMV)
    # and 5+ rows (cuBLAS + the SiLU·mul kernel) as before; logits as the reference's throughout
    import copy

    from pageserve.model.quant import quantize_model

    cfg, model = _small_decoder(seed=6)
    epilogues = []
    real = triton_ops.matmul_invariant
    monkeypatch.setattr(triton_ops, "matmul_invariant", lambda *a, **kw: epilogues.append(
        (a[0].shape[0], kw.get("silu_mul"))) or real(*a, **kw))

    def run(m, ops, rows):
        return _decode_logits(m, cfg, ops, rows, cache_seed=7)

    ops = TritonOps(gate_up_silu_rows=(2, 4), tuned_configs=False)
    for rows in (1, 3, 6):
        epilogues.clear()
        assert checks.rel_err(run(model, ops, rows), run(model, TorchOps(), rows)) < 1e-5, rows
        assert epilogues == ([(rows, True)] * cfg.num_layers if rows == 3 else []), (rows, epilogues)
    # int8 weights keep their own kernels at every row count
    qmodel = quantize_model(copy.deepcopy(model), "int8")
    epilogues.clear()
    assert checks.rel_err(run(qmodel, ops, 3), run(qmodel, TorchOps(), 3)) < 1e-5
    assert epilogues == []
    for bad in ((0, 4), (5, 4), (3,), "always", "ab", (2.0, 4)):
        with pytest.raises(ValueError, match="gate_up_silu_rows"):
            TritonOps(gate_up_silu_rows=bad)
    # the default: on Hopper only (where it was measured), off on other GPUs and on the interpreter
    hopper = CUDA and torch.cuda.get_device_capability()[0] >= 9
    assert TritonOps(tuned_configs=False).gate_up_silu_rows == (triton_ops.GATE_UP_SILU_ROWS if hopper else None)


# ---------------------------------------------------------------- gate_up with SiLU·mul in one MMA chain
GUS_CONFIGS = {  # block_n = the tile's weight rows (half gate, half up)
    "pointer": InvariantMatmulConfig(16, 32, 32, 4, 2), "tma": InvariantMatmulConfig(32, 16, 64, 4, 2, tma=True),
    "persistent": InvariantMatmulConfig(16, 32, 32, 4, 2, tma=True, persistent=True), "default": None,
}
GUS_DTYPES = DTYPES + ([torch.float16] if CUDA else [])


@pytest.mark.parametrize("dtype", GUS_DTYPES)
@pytest.mark.parametrize("M,I,K", [(1, 16, 32), (37, 40, 96), (70, 72, 200)])
@pytest.mark.parametrize("path", list(GUS_CONFIGS))
def test_gate_up_silu_matches_its_reference(M, I, K, path, dtype, gen):
    # odd row counts, I not a multiple of the tile's columns, K not a multiple of BLOCK_K; against the exact
    # (float64) value. Three roundings to the dtype (gate, up, the output): on the GPU they round to
    # nearest, within the dtype's tolerance; Triton's CPU interpreter truncates fp32 -> bf16 (toward zero,
    # NOTES.md session 32), three truncations a value: twice the tolerance there
    x = torch.randn(M, K, generator=gen).to(dtype)
    w = (torch.randn(2 * I, K, generator=gen) / K ** 0.5).to(dtype)
    out = gate_up_silu(x.to(DEVICE), w.to(DEVICE), config=GUS_CONFIGS[path])
    assert out.shape == (M, I) and out.dtype == dtype
    err = checks.rel_err(out.cpu(), gate_up_silu_reference(x.double(), w.double()))
    _ok(err / 2 if dtype == torch.bfloat16 and not CUDA else err, dtype)


@pytest.mark.skipif(not CUDA, reason="the MMA's bits are tile-independent on the GPU; the interpreter's numpy dot is not")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M", [65, 300, 2048])
def test_gate_up_silu_gives_the_bits_of_the_product_then_the_silu_mul_kernel_on_the_3b_shape(M, dtype, gen):
    # each output is the same chain of k16 MMAs over K as the invariant matmul's (no split-K), each half
    # rounded to the dtype before silu_mul_f32: bitwise the two-launch path, whichever load path
    N2, K = SHAPES_3B["gate_up"]
    x = torch.randn(M, K, generator=gen).to(dtype).to(DEVICE)
    w = (torch.randn(N2, K, generator=gen) / K ** 0.5).to(dtype).to(DEVICE)
    want = silu_and_mul(matmul_invariant(x, w))
    for cfg in (None, InvariantMatmulConfig(128, 256, 64, 8, 3), InvariantMatmulConfig(64, 128, 64, 4, 4, tma=True),
                InvariantMatmulConfig(128, 256, 64, 8, 3, tma=True, persistent=True)):
        assert torch.equal(gate_up_silu(x, w, config=cfg), want), cfg


def test_gate_up_silu_refuses_bad_arguments_clearly():
    x = torch.randn(3, 32).to(DEVICE)
    with pytest.raises(ValueError, match="even row count"):
        gate_up_silu(x, torch.randn(33, 32).to(DEVICE))
    with pytest.raises(ValueError, match="w"):
        gate_up_silu(x, torch.randn(32, 16).to(DEVICE))
    with pytest.raises(ValueError, match="out"):
        gate_up_silu(x, torch.randn(32, 32).to(DEVICE), out=torch.empty(3, 15).to(DEVICE))
    with pytest.raises(ValueError, match="persistent"):  # no descriptors without tma
        gate_up_silu(x, torch.randn(32, 32).to(DEVICE), config=InvariantMatmulConfig(16, 32, 32, persistent=True))
    assert gate_up_silu(x[:0], torch.randn(32, 32).to(DEVICE)).shape == (0, 16)


def test_paired_silu_rows_routes_those_steps_gate_up_through_gate_up_silu(monkeypatch):
    # TritonOps(paired_silu_rows=(5, 8)): 5-8 row steps run gate_up_silu, then down as a plain linear;
    # other steps and int8 weights as before; logits as the reference's throughout
    import copy

    from pageserve.model.quant import quantize_model

    cfg, model = _small_decoder(seed=8)
    calls = []
    real = triton_ops.gate_up_silu
    monkeypatch.setattr(triton_ops, "gate_up_silu", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))

    def run(m, ops, rows):
        return _decode_logits(m, cfg, ops, rows, cache_seed=9)

    ops = TritonOps(paired_silu_rows=(5, 8), gate_up_silu_rows=(2, 3), tuned_configs=False)
    for rows in (1, 3, 6, 9):
        calls.clear()
        assert checks.rel_err(run(model, ops, rows), run(model, TorchOps(), rows)) < 1e-5, rows
        assert calls == ([rows] * cfg.num_layers if rows == 6 else []), (rows, calls)
    qmodel = quantize_model(copy.deepcopy(model), "int8")  # int8 weights keep their own kernels
    calls.clear()
    assert checks.rel_err(run(qmodel, ops, 6), run(qmodel, TorchOps(), 6)) < 1e-5
    assert calls == []
    for bad in ((0, 4), (5, 4), (3,), "always", (2.0, 4)):
        with pytest.raises(ValueError, match="paired_silu_rows"):
            TritonOps(paired_silu_rows=bad)
    hopper = CUDA and torch.cuda.get_device_capability()[0] >= 9
    assert TritonOps(tuned_configs=False).paired_silu_rows == (triton_ops.PAIRED_SILU_ROWS if hopper else None)
    # the start-up compile: float weights with rows set, else nothing; it launches exactly what a step of the
    # range's first row counts launches (the same rows, config and PDL setting: PDL is a compile-time constant)
    w = model.layers[0].mlp.gate_up_proj.weight
    launches = []
    monkeypatch.setattr(triton_ops, "gate_up_silu", lambda *a, **kw: launches.append(
        (a[0].shape[0], kw.get("config"), kw.get("pdl"))) or real(*a, **kw))
    assert ops.warm_gate_up_silu(w) == 2
    assert launches == [(m, None, ops.pdl_for(m)) for m in (5, 6)]
    launches.clear()
    run(model, ops, 6)
    assert launches[0] == (6, None, ops.pdl_for(6))
    assert TritonOps(paired_silu_rows=None).warm_gate_up_silu(w) == 0 and TorchOps().warm_gate_up_silu(w) == 0
    assert ops.warm_gate_up_silu(qmodel.layers[0].mlp.gate_up_proj.weight) == 0


def test_rope_in_decode_attention_follows_each_modes_switch(gen):
    # the default decode kernel's fusion follows fuse_rope_attention's row range; the deterministic mode's
    # attention is the batch-invariant kernel, which takes RoPE itself up to rope_in_attention rows (4), and
    # asking it for the default kernel's fusion is an error, not a silent switch
    from pageserve.model.deterministic_ops import DeterministicOps

    with pytest.raises(ValueError, match="fuse_rope_attention"):
        DeterministicOps(fuse_rope_attention=True)
    meta = checks.random_paged_batch([1, 1], [5, 9], 4, 2, 16, 16, torch.float32, DEVICE, gen)[-1]
    meta.max_query_len = 1
    q = torch.zeros(2, 4, 16, device=DEVICE)
    assert not TritonOps().rope_in_decode_attention(q, meta)  # 2 rows: rope_kv's launch by default
    assert TritonOps(fuse_rope_attention=True).rope_in_decode_attention(q, meta)
    assert TritonOps(fuse_rope_attention=(1, 2)).rope_in_decode_attention(q, meta)
    assert not TritonOps(fuse_rope_attention=(3, 64)).rope_in_decode_attention(q, meta)  # 2 rows: outside
    assert not TritonOps(fuse_rope_attention=False).rope_in_decode_attention(q, meta)
    with pytest.raises(ValueError, match="fuse_rope_attention"):
        TritonOps(fuse_rope_attention=(0, 4))
    assert DeterministicOps().rope_in_decode_attention(q, meta)  # 2 rows: inside the invariant launch
    assert not DeterministicOps(rope_in_attention=1).rope_in_decode_attention(q, meta)
    assert not TorchOps().rope_in_decode_attention(q, meta)


# ---------------------------------------------------------------- o / down as K slices, summed by the next norm
SPLIT_DTYPES = DTYPES + [torch.float16]


@pytest.mark.parametrize("dtype", SPLIT_DTYPES)
@pytest.mark.parametrize("slices", [1, 2, 3])
@pytest.mark.parametrize("residual", [True, False])
def test_the_norms_sum_a_split_sum_in_slice_order_and_round_once_before_the_residual_add(slices, residual, dtype, gen):
    from pageserve.kernels import add_rms_norm, reference, rms_norm
    from pageserve.kernels.norm import SplitSum

    T, H = 5, 96
    # slices of very different magnitudes: another summing order or a missing rounding shows in the bits
    scale = torch.logspace(-3, 3, slices)[:, None, None]
    parts = (torch.randn(slices, T, H, generator=gen) * scale).to(DEVICE)
    r = torch.randn(T, H, generator=gen).to(DEVICE, dtype)
    w = (1 + 0.1 * torch.randn(H, generator=gen)).to(DEVICE, dtype)
    summed = reference.split_sum(parts, dtype)  # in slice order, rounded once to dtype
    if dtype == torch.bfloat16 and not CUDA:
        pytest.skip("the interpreter converts fp32 to bf16 by truncation, torch rounds: bits only on the GPU "
                    "(fp16 and fp32 check them here)")
    if residual:
        got, got_res = add_rms_norm(SplitSum(parts, dtype), r, w, 1e-6)
        want, want_res = add_rms_norm(summed, r, w, 1e-6)
        assert torch.equal(got_res, want_res)
        ref = reference.add_rms_norm(summed, r, w, 1e-6)[0]
    else:
        got, want = rms_norm(SplitSum(parts, dtype), w, 1e-6), rms_norm(summed, w, 1e-6)
        ref = reference.rms_norm(summed, w, 1e-6)
    assert got.dtype == dtype and got.shape == (T, H)
    assert torch.equal(got, want)
    _ok(checks.rel_err(got, ref), dtype)


def test_a_split_sum_the_norm_cannot_read_is_refused_clearly():
    from pageserve.kernels import add_rms_norm
    from pageserve.kernels.norm import SplitSum

    parts = torch.randn(2, 3, 16).to(DEVICE)
    w, r = torch.ones(16).to(DEVICE), torch.zeros(3, 16).to(DEVICE)
    with pytest.raises(ValueError, match="contiguous"):
        add_rms_norm(SplitSum(parts.transpose(1, 2).contiguous().transpose(1, 2), torch.float32), r, w, 1e-6)
    with pytest.raises(ValueError, match="x.parts"):
        add_rms_norm(SplitSum(parts.to(torch.bfloat16), torch.float32), r, w, 1e-6)
    with pytest.raises(ValueError, match="x.dtype"):
        add_rms_norm(SplitSum(parts, torch.int32), r, w, 1e-6)
    with pytest.raises(ValueError, match="residual"):
        add_rms_norm(SplitSum(parts, torch.float32), r[:2], w, 1e-6)


@pytest.mark.parametrize("dtype", SPLIT_DTYPES)
@pytest.mark.parametrize("slices", [2, 3])
def test_split_products_are_each_k_slices_product_in_fp32(slices, dtype, gen):
    from pageserve.kernels import reference

    x = torch.randn(5, 48, generator=gen).to(DEVICE, dtype)
    w = torch.randn(20, 48, generator=gen).to(DEVICE, dtype)
    parts = triton_ops.split_products(x, w, slices)
    assert parts.dtype == dtype and parts.shape == (5, 20) and parts.parts.dtype == torch.float32
    assert parts.parts.shape == (slices, 5, 20) and parts.parts.is_contiguous()
    ks = 48 // slices
    for s in range(slices):
        want = x[:, s * ks:(s + 1) * ks].double() @ w[:, s * ks:(s + 1) * ks].double().T
        assert checks.rel_err(parts.parts[s], want) < 1e-5, s
    # summed, the slices are the product, at the dtype's rounding
    _ok(checks.rel_err(reference.split_sum(parts.parts, dtype), reference.linear(x, w, None)), dtype)
    # a weight whose rows are not contiguous (a transposed view) gives the same slices
    w_view = w.T.contiguous().T
    assert w_view.stride(-1) != 1
    assert torch.equal(triton_ops.split_products(x, w_view, slices).parts, parts.parts)


def test_split_to_norm_leaves_o_and_down_as_k_slices_for_the_norms_after_them(monkeypatch):
    # TritonOps(split_to_norm_rows=(2, 4), split_to_norm={"o": 2, "down": 3}): in 2-4 row steps o's and down's
    # products come back as K slices (one batched call each) and the norms after them (this layer's, the next
    # layer's, the final one) sum the slices; 1 row (the GEMV) and 5+ rows as before; int8 weights and the
    # deterministic ops never; logits as the reference's throughout
    import copy

    from pageserve.model.deterministic_ops import DeterministicOps
    from pageserve.model.quant import quantize_model

    cfg, model = _small_decoder(seed=10)
    calls = []
    real = triton_ops.split_products
    monkeypatch.setattr(triton_ops, "split_products",
                        lambda x, w, s: calls.append((x.shape[0], w.shape[1], s)) or real(x, w, s))

    def run(m, ops, rows):
        return _decode_logits(m, cfg, ops, rows, cache_seed=11)

    ops = TritonOps(split_to_norm_rows=(2, 4), split_to_norm={"o": 2, "down": 3}, gate_up_silu_rows=(2, 4),
                    tuned_configs=False)
    o_k, down_k = cfg.num_heads * cfg.head_dim, cfg.intermediate_size
    for rows in (1, 3, 6):
        calls.clear()
        assert checks.rel_err(run(model, ops, rows), run(model, TorchOps(), rows)) < 1e-5, rows
        assert calls == ([(rows, o_k, 2), (rows, down_k, 3)] * cfg.num_layers if rows == 3 else []), (rows, calls)
    # beyond the gate_up epilogue's rows down takes the SiLU·mul kernel first, and still goes to the norm in slices
    wide = TritonOps(split_to_norm_rows=(2, 8), split_to_norm={"o": 2, "down": 3}, gate_up_silu_rows=(2, 4),
                     tuned_configs=False)
    calls.clear()
    assert checks.rel_err(run(model, wide, 6), run(model, TorchOps(), 6)) < 1e-5
    assert calls == [(6, o_k, 2), (6, down_k, 3)] * cfg.num_layers, calls
    # a slice count that does not divide K leaves that product whole
    calls.clear()
    run(model, TritonOps(split_to_norm_rows=(2, 4), split_to_norm={"o": 5, "down": 3}, gate_up_silu_rows=(2, 4),
                         tuned_configs=False), 3)
    assert calls == [(3, down_k, 3)] * cfg.num_layers
    qmodel = quantize_model(copy.deepcopy(model), "int8")  # int8 weights keep their own kernels
    calls.clear()
    assert checks.rel_err(run(qmodel, ops, 3), run(qmodel, TorchOps(), 3)) < 1e-5
    assert calls == []
    det = DeterministicOps()  # whatever its split settings say, its products stay whole (and invariant)
    det.split_to_norm_rows, det.split_to_norm = (1, 64), {"o": 2, "down": 2}
    x = torch.randn(3, 64).to(DEVICE)
    assert isinstance(det.linear_to_norm(x, torch.randn(8, 64).to(DEVICE), "down"), torch.Tensor)
    assert isinstance(TorchOps().linear_to_norm(x, torch.randn(8, 64).to(DEVICE), "down"), torch.Tensor)
    for bad in ({"q": 2}, {"down": 0}, {"down": 2.0}):
        with pytest.raises(ValueError, match="split_to_norm"):
            TritonOps(split_to_norm=bad)
    with pytest.raises(ValueError, match="split_to_norm_rows"):
        TritonOps(split_to_norm_rows=(0, 4))
    hopper = CUDA and torch.cuda.get_device_capability()[0] >= 9
    assert TritonOps(tuned_configs=False).split_to_norm_rows == (triton_ops.SPLIT_TO_NORM_ROWS if hopper else None)
