"""The decode-path fusions (each behind a TritonOps switch) against their references.

- ``silu_mul_gemv``: down projection reading gate|up (``TorchOps.silu_mul_linear``)
- ``gemv(split_k="never")``: the GEMV as one kernel (``TorchOps.linear``)
- ``rotary_write_kv``: RoPE fused with the paged KV write (``TorchOps.rotary_write_kv``)
- ``add_rms_norm_gemv``: residual add + RMSNorm folded into the next projection
  (``TorchOps.add_rms_norm_linear``)

and a tiny decoder that must give the same logits with every switch on or off. CPU: the
Triton interpreter on tiny shapes; CUDA: the same tests on the GPU.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pageserve.kernels as kernels  # noqa: E402
from pageserve.model.triton_ops import TritonOps
from pageserve.lab import kernel_checks as checks  # noqa: E402
from pageserve.lab.kernel_checks import TOLERANCE  # noqa: E402
from pageserve.kernels.gemv import GEMV_CONFIGS, GemvConfig, add_rms_norm_gemv, config_key, gemv_config  # noqa: E402
from pageserve.kernels.norm import add_rms_norm, rms_norm  # noqa: E402
from pageserve.lab.kernel_bench import GEMV_SHAPES as SHAPES_3B  # noqa: E402
from pageserve.model.ops import TorchOps, rope_cos_sin  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture
def gen(request):
    return torch.Generator().manual_seed(hash(request.node.name) % (2**31))


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
    for name in ("silu_mul_gemv", "rotary_write_kv"):
        real = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, _n=name, _f=real, **kw: calls.append(_n) or _f(*a, **kw))
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
    assert TritonOps().fuse_silu_down and TritonOps().fuse_rope_kv  # on by default (measured, kernels/NOTES.md)


NORM_CONFIGS = {"auto": None, "never": None, "split3": GemvConfig(block_n=16, block_k=32, split_k=3)}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 3, 8])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("mode", list(NORM_CONFIGS))
def test_add_rms_norm_gemv_matches_add_rms_norm_then_linear(M, residual, bias, mode, dtype, gen):
    # split3: three K splits of 96 columns, each must normalise with the statistics of all 200
    N, K = (24, 64) if mode == "auto" else (40, 200) if mode == "split3" else (96, 256)
    split_k = "never" if mode == "never" else "auto"
    err = checks.check_add_rms_norm_gemv(M, N, K, dtype, DEVICE, gen, residual=residual, bias=bias,
                                         config=NORM_CONFIGS[mode], split_k=split_k)
    if dtype == torch.bfloat16 and not CUDA:
        # On the CPU interpreter the norm + GEMV kernels' bf16 stores round more coarsely than
        # torch's (the separate kernels and the fused one alike: 1.0e-2 vs torch's 4.2e-3 against
        # float64, worst of 30 draws at 96 x 256); the fused-vs-separate identity is checked
        # tightly below. On the GPU the usual bound holds.
        assert err <= 2 * TOLERANCE[dtype], f"relative error {err:.3g} (interpreter, bf16)"
    else:
        _ok(err, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", [None, NORM_CONFIGS["split3"], GemvConfig(block_n=4, block_k=64, split_k=1)])
def test_add_rms_norm_gemv_writes_the_residual_of_add_rms_norm_bit_for_bit_and_the_same_activation(config, dtype,
                                                                                                   gen):
    """residual_out is the norm kernel's, bit for bit (one program writes it, from a separate
    buffer), and out is the GEMV of the norm kernel's output: the activation is rounded the same way."""
    M, N, K = 3, 40, 200
    x, r = (torch.randn(M, K, generator=gen).to(DEVICE, dtype) for _ in range(2))
    nw = (torch.randn(K, generator=gen) * 0.5 + 1).to(DEVICE, dtype)
    w = (torch.randn(N, K, generator=gen) * K**-0.5).to(DEVICE, dtype)
    r_before = r.clone()
    out, res_out = add_rms_norm_gemv(x, r, nw, 1e-6, w, None, config=config)
    normed, want_res = add_rms_norm(x, r, nw, 1e-6)
    assert torch.equal(res_out, want_res) and res_out.data_ptr() != r.data_ptr()
    assert torch.equal(r, r_before)  # never in place
    if dtype == torch.float32:
        assert torch.equal(res_out, TorchOps().add_rms_norm(x, r, nw, 1e-6)[1])
    ref = kernels.gemv(normed, w, None, config=config)
    torch.testing.assert_close(out, ref, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-5)
    out_none, x_out = add_rms_norm_gemv(x, None, nw, 1e-6, w, None, config=config)
    assert x_out is x
    torch.testing.assert_close(out_none, kernels.gemv(rms_norm(x, nw, 1e-6), w, None, config=config),
                               rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-5)
    with pytest.raises(ValueError, match="alias"):
        add_rms_norm_gemv(x, r, nw, 1e-6, w, None, residual_out=r)


def test_fused_norm_gemv_has_its_own_tuned_key_and_wide_tiles():
    """The plain GEMV's tuned 2-row tiles would make every program re-read the activation row:
    the fused variant takes only its own entry, else its own heuristic with wider tiles."""
    saved = dict(GEMV_CONFIGS)
    try:
        GEMV_CONFIGS.clear()
        narrow = GemvConfig(block_n=2, block_k=1024, split_k=1, defer_reduce=True)
        N, K = SHAPES_3B["gate_up"]
        GEMV_CONFIGS[config_key(1, N, K)] = narrow
        assert config_key(1, N, K, norm=True) == (1, N, K, "norm")
        assert gemv_config(1, N, K, sms=132) == narrow
        fused = gemv_config(1, N, K, sms=132, norm=True)
        assert fused != narrow and fused.block_n == 16 and fused.split_k == 1
        own = GemvConfig(block_n=8, block_k=512, split_k=1)
        GEMV_CONFIGS[config_key(1, N, K, norm=True)] = own
        assert gemv_config(1, N, K, sms=132, norm=True) == own
        GEMV_CONFIGS.clear()
        for M in (1, 8):
            for split_k in ("auto", "never"):
                for name in ("qkv", "gate_up"):
                    N, K = SHAPES_3B[name]
                    cfg = gemv_config(M, N, K, sms=132, split_k=split_k, norm=True)
                    if M == 1:  # one kernel (no reduce launch), >= 2 programs per SM, >= 8 rows
                        assert cfg.split_k == 1 and cfg.block_n >= 8 and -(-N // cfg.block_n) >= 2 * 132, cfg
                    else:
                        assert cfg.block_n >= 16, (name, split_k, cfg)
                    assert split_k == "auto" or cfg.split_k == 1
    finally:
        GEMV_CONFIGS.clear()
        GEMV_CONFIGS.update(saved)


def test_fuse_norm_gemv_routes_to_the_fused_gemv_only_when_on_and_within_gemv_max_m(monkeypatch, gen):
    calls = []
    real = kernels.add_rms_norm_gemv
    monkeypatch.setattr(kernels, "add_rms_norm_gemv", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    K, N = 64, 24
    nw = torch.randn(K, generator=gen).to(DEVICE) * 0.5 + 1
    w, b = torch.randn(N, K, generator=gen).to(DEVICE) * K**-0.5, torch.randn(N, generator=gen).to(DEVICE)
    for ops in (TritonOps(), TritonOps(fuse_norm_gemv=True, gemv_max_m=4), TritonOps(fuse_norm_gemv=True, gemv=False)):
        for M in (2, 6):  # 6 > gemv_max_m: the norm kernel, then cuBLAS
            x, r = (torch.randn(M, K, generator=gen).to(DEVICE) for _ in range(2))
            for res in (None, r):
                got = ops.add_rms_norm_linear(x, res, nw, 1e-6, w, b)
                want = TorchOps().add_rms_norm_linear(x, res, nw, 1e-6, w, b)
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert calls == [2, 2]  # only the switched-on ops, only M = 2, with and without a residual
    assert not TritonOps().fuse_norm_gemv  # off by default until the H200 has measured it


def test_greedy_tokens_are_the_same_with_fuse_norm_gemv_on_and_off():
    """A tiny Decoder generating greedily (prefill of 5 and decode rows: the fused GEMV at every
    norm of every step when on), fp32: the same tokens as the separate kernels and as TorchOps."""
    from pageserve.model.config import ModelConfig
    from pageserve.model.decoder import Decoder
    from pageserve.lab.naive import naive_generate

    cfg = ModelConfig(architecture="qwen2", vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, attention_bias=True, tie_word_embeddings=True,
                      max_position_embeddings=128)
    model = Decoder(cfg).to(DEVICE)
    model.init_dummy_weights(seed=3, std=0.3)
    with torch.no_grad():
        for layer in model.layers:  # norm weights away from 1, so a wrongly applied weight shows
            layer.input_layernorm.weight.uniform_(0.5, 1.5)
            layer.post_attention_layernorm.weight.uniform_(0.5, 1.5)
    tokens = {}
    for name, ops in {"torch": TorchOps(), "off": TritonOps(fuse_norm_gemv=False),
                      "on": TritonOps(fuse_norm_gemv=True)}.items():
        model.set_ops(ops)
        tokens[name] = naive_generate(model, [5, 17, 3, 88, 41], 6, ignore_eos=True).token_ids
    assert tokens["on"] == tokens["off"] == tokens["torch"]


SWITCHES = {
    "all_off": {},
    "fuse_silu_down": {"fuse_silu_down": True},
    "fuse_rope_kv": {"fuse_rope_kv": True},
    "gemv_never_split": {"gemv_split_k": "never"},
    "fuse_norm_gemv": {"fuse_norm_gemv": True},
    "all_on": {"fuse_silu_down": True, "fuse_rope_kv": True, "gemv_split_k": "never", "fuse_norm_gemv": True},
}


def test_decoder_logits_are_the_same_with_each_switch_on_and_off(gen):
    """Prefill (T > gemv_max_m: cuBLAS + fused RoPE/KV) then a 2-row decode (GEMV, fused MLP)
    through PagedAttention, and a prompt through phase 01's contiguous cache (no attend_rope)."""
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
    for name, switches in SWITCHES.items():
        for got, want in zip(run(TritonOps(**switches)), ref):
            assert checks.rel_err(got, want) < 1e-5, name
