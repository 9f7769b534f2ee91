"""Phase 06b: int8 weight-only linears (W8A16) — kernels, the quantized decoder, the engine, accuracy.

CPU: the kernels run on Triton's interpreter (tests/conftest.py) at small odd shapes in fp32,
bf16 and fp16; on CUDA the same tests, plus the 3B shapes.
"""
import zlib

import pytest
import torch

from pageserve.kernels import reference
from pageserve.kernels.gemv import GemvConfig
from pageserve.kernels.gemv_int8 import (Int8GemmConfig, dequantize_int8, gemm_int8_config, gemv_int8_config,
                                         int8_config_key, parse_int8_configs)
from pageserve.lab import kernel_checks as checks
from pageserve.lab.kernel_checks import TOLERANCE
from pageserve.model.decoder import Decoder
from pageserve.model.quant import QuantizedLinear, QuantizedWeight, is_quantized, quantize_model
from pageserve.model.triton_ops import TritonOps

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture
def gen(request):
    return torch.Generator().manual_seed(zlib.crc32(request.node.name.encode()))


def _ok(err, dtype):
    assert err <= TOLERANCE[dtype], f"relative error {err:.3g} > {TOLERANCE[dtype]:.0e} ({dtype})"


# ------------------------------------------------------------------------------------------ kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(checks.int8_checks(torch.float32, "cpu", None)))
def test_int8_kernels_match_the_float64_reference_on_odd_shapes(name, dtype, gen):
    _ok(checks.int8_checks(dtype, DEVICE, gen)[name](), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_gemv_is_right_at_every_decode_batch_size_one_to_eight(dtype, gen):
    # N = 33, K = 70: neither a multiple of any tile; M = 1 (deferred reduction), 2..8 (tl.dot, split-K)
    for M in range(1, 9):
        _ok(checks.check_gemv_int8(M, 33, 70, dtype, DEVICE, gen, bias=M % 2 == 1), dtype)
    _ok(checks.check_gemv_int8(1, 33, 70, dtype, DEVICE, gen, config=GemvConfig(4, 32, 2)), dtype)  # split, no defer
    _ok(checks.check_gemv_int8(4, 33, 70, dtype, DEVICE, gen, config=GemvConfig(4, 32, 1)), dtype)  # CUDA-core path
    _ok(checks.check_silu_mul_gemv_int8(8, 33, 70, dtype, DEVICE, gen, split_k="never"), dtype)


@pytest.mark.parametrize("config", [GemvConfig(2, 16, 1, defer_reduce=True), GemvConfig(4, 16, 1),
                                    GemvConfig(2, 16, 2, defer_reduce=True)], ids=["defer", "sum", "split"])
@pytest.mark.parametrize("magic", [True, "ops", False], ids=["magic", "ops", "cvt"])
def test_int8_gemv_converts_every_byte_value_exactly(config, magic):
    # row n of the weight holds q = n - 128 (all 256 int8 values) at column 3, zeros elsewhere; x
    # picks column 3 with weight 1 and the scale is 1, so out[0, n] must be n - 128 exactly: the
    # exponent trick (magic: in PTX where compiled, ops: in Triton ops) and the plain conversion on
    # the CUDA-core paths alike
    from pageserve.kernels.gemv_int8 import gemv_int8

    q = torch.zeros(256, 37, dtype=torch.int8)
    q[:, 3] = torch.arange(-128, 128, dtype=torch.int16).to(torch.int8)
    x = torch.zeros(1, 37)
    x[0, 3] = 1.0
    out = gemv_int8(x.to(DEVICE), q.to(DEVICE), torch.ones(256, device=DEVICE), config=config, magic=magic)
    assert torch.equal(out.cpu()[0], torch.arange(-128, 128, dtype=torch.float32))


def test_int8_conversion_modes_are_validated():
    from pageserve.kernels._util import interpreting
    from pageserve.kernels.gemv import magic_code

    assert magic_code(False) == magic_code("cvt") == 0 and magic_code("ops") == 1
    assert magic_code(True) == (1 if interpreting() else 2)  # PTX wherever kernels are compiled
    with pytest.raises(ValueError, match="magic"):
        magic_code("fast")
    if interpreting():
        with pytest.raises(ValueError, match="interpreter"):
            magic_code("ptx")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("magic", [True, "ops", False], ids=["magic", "ops", "cvt"])
def test_int8_tensor_core_paths_convert_every_byte_value_exactly(dtype, magic):
    # as above on the tl.dot paths (the GEMV's 16-column tiles at M = 2, the GEMM): fp16 has its
    # own exponent trick, bf16 goes through fp32's; every value -128..127 exactly representable
    from pageserve.kernels.gemv_int8 import gemm_int8, gemv_int8

    q = torch.zeros(256, 32, dtype=torch.int8)
    q[:, 3] = torch.arange(-128, 128, dtype=torch.int16).to(torch.int8)
    x = torch.zeros(2, 32)
    x[:, 3] = 1.0
    args = (x.to(DEVICE, dtype), q.to(DEVICE), torch.ones(256, device=DEVICE, dtype=dtype))
    want = torch.arange(-128, 128, dtype=torch.float32).expand(2, 256)
    got = gemv_int8(*args, config=GemvConfig(16, 16, 1), magic=magic)
    assert torch.equal(got.float().cpu(), want)
    got = gemm_int8(*args, config=Int8GemmConfig(16, 16, 16), magic=magic)
    assert torch.equal(got.float().cpu(), want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_gemv_serves_decode_batches_of_9_to_64_rows_with_split_k(dtype, gen):
    # K = 600 on the interpreter's 4 "SMs": the heuristic splits K in two at every M here
    for M in (9, 16, 17, 64):
        assert gemv_int8_config(M, 45, 600, sms=4).split_k == 2
        _ok(checks.check_gemv_int8(M, 45, 600, dtype, DEVICE, gen, bias=M % 2 == 1), dtype)


def test_int8_small_m_heuristics_fill_the_h200_and_keep_partials_small():
    for N, K in ((2560, 2048), (2048, 2048), (22016, 2048), (2048, 11008)):  # qkv, o, gate_up, down
        for M in (16, 32, 64):
            g = gemv_int8_config(M, N, K, sms=132)
            assert -(-N // g.block_n) * g.split_k >= 2 * 132 or g.split_k == K // (2 * g.block_k), (M, N, K, g)
            assert g.block_n >= 32 and (g.split_k == 1 or -(-N // g.block_n) < 2 * 132)
        for M in (64, 128, 256):
            c = gemm_int8_config(M, N, K, sms=132)
            tiles = -(-M // c.block_m) * -(-N // c.block_n)
            assert c.block_m <= max(16, M) and (tiles * c.split_k >= 2 * 132 or c.split_k == K // (4 * c.block_k))
    assert gemm_int8_config(2048, 2560, 2048, sms=132).split_k == 1  # prefill: enough tiles already


@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_gemm_is_right_for_larger_m_and_every_tile_config(dtype, gen):
    for M, cfg in [(9, None), (33, None), (70, Int8GemmConfig(32, 16, 32, group_m=2)),
                   (20, Int8GemmConfig(16, 16, 32, group_m=2, split_k=2))]:
        _ok(checks.check_gemm_int8(M, 45, 90, dtype, DEVICE, gen, config=cfg), dtype)


@pytest.mark.skipif(not CUDA, reason="the full 3B shapes: GPU only")
@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_kernels_at_the_3b_shapes(dtype, gen):
    for name, fn in checks.int8_checks(dtype, DEVICE, gen, full=True).items():
        _ok(fn(), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantize_kernel_equals_the_reference_bit_for_bit(dtype, gen):
    q, s = reference.quantize_int8(torch.randn(37, 300, generator=gen), scale_dtype=dtype)
    q, s = q.to(DEVICE), s.to(DEVICE)
    out, ref = dequantize_int8(q, s), reference.dequantize_int8(q, s)
    if dtype == torch.bfloat16 and not CUDA:
        # the interpreter rounds fp32 -> bf16 by truncation (the GPU: to nearest): within one bf16 ulp
        assert ((out.float() - ref.float()).abs() <= ref.float().abs() * 2**-7).all()
    else:
        assert torch.equal(out, ref)


def test_quantize_int8_is_symmetric_per_row_and_within_half_a_step(gen):
    w = torch.randn(20, 64, generator=gen)
    w[3] = 0.0  # an all-zero row
    q, s = reference.quantize_int8(w)
    assert q.dtype == torch.int8 and s.shape == (20,) and q.abs().max() <= 127
    assert (q.abs().amax(1)[torch.arange(20) != 3] == 127).all()  # each row's largest weight maps to +-127
    assert s[3] == 1 and (q[3] == 0).all()
    assert ((reference.dequantize_int8(q, s) - w).abs() <= s[:, None] / 2 + 1e-7).all()


def test_int8_configs_parse_from_their_json_form_and_the_tuned_entry_wins():
    tuned = {int8_config_key(1, 64, 128): GemvConfig(4, 64, 1, 2, 3, True),
             int8_config_key(64, 64, 128, "gemm"): Int8GemmConfig(64, 32, 64)}
    as_json = {"int8_tuned_configs": {str(k): repr(v) for k, v in tuned.items()}}
    assert parse_int8_configs(as_json) == tuned
    assert gemv_int8_config(1, 64, 128, sms=4, configs=tuned) == GemvConfig(4, 64, 1, 2, 3, True)
    assert gemv_int8_config(1, 64, 128, sms=4, configs={}) != GemvConfig(4, 64, 1, 2, 3, True)
    with pytest.raises(ValueError):
        parse_int8_configs({"(1, 2, 3, 'int8')": "__import__('os')"})


# ------------------------------------------------------------------------------------------ the decoder
def _tiny_pair(cfg, seed=3):
    """A float decoder whose linears hold the dequantized int8 weights, and its int8 twin (on
    DEVICE: on a GPU machine the Triton ops want CUDA tensors)."""
    qmodel = Decoder(cfg)
    qmodel.init_dummy_weights(seed=seed, std=0.3)
    quantize_model(qmodel.eval(), "int8")
    fmodel = Decoder(cfg)
    fmodel.load_state_dict({k: v for k, v in qmodel.state_dict().items()
                            if not k.endswith(("qweight", "scale"))}, strict=False)
    with torch.no_grad():
        for (name, m) in qmodel.named_modules():
            if isinstance(m, QuantizedLinear):
                fmodel.get_submodule(name).weight.copy_(m.weight.dequantize())
    return fmodel.eval().requires_grad_(False).to(DEVICE), qmodel.requires_grad_(False).to(DEVICE)


def test_quantize_model_replaces_exactly_the_four_projections_of_every_layer(tiny_qwen2_config):
    model = Decoder(tiny_qwen2_config)
    model.init_dummy_weights()
    quantize_model(model, "int8")
    quantize_model(model, "int8")  # twice is harmless
    for layer in model.layers:
        for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert isinstance(proj, QuantizedLinear) and proj.qweight.dtype == torch.int8
            assert proj.scale.dtype == torch.float32 and isinstance(proj.weight, QuantizedWeight)
    assert isinstance(model.layers[0].self_attn.qkv_proj.bias, torch.nn.Parameter)  # qwen2's qkv bias kept in float
    assert model.embed_tokens.weight.dtype == torch.float32 and is_quantized(model)
    with pytest.raises(ValueError, match="quantization"):
        quantize_model(model, "int4")


@pytest.mark.parametrize("ops", ["torch", "triton-triton", "triton-dequant", "triton-auto"])
def test_int8_decoder_logits_equal_the_float_decoder_on_the_dequantized_weights(tiny_qwen2_config, ops):
    from pageserve.lab.naive import ContiguousKVCache, forward_tokens

    fmodel, qmodel = _tiny_pair(tiny_qwen2_config)
    if ops != "torch":
        qmodel.set_ops(TritonOps(int8_gemm=ops.split("-")[1]))
    ids = torch.randint(0, tiny_qwen2_config.vocab_size, (14,), generator=torch.Generator().manual_seed(0)).tolist()
    logits = {}
    for name, model in (("float", fmodel), ("int8", qmodel)):
        cache = ContiguousKVCache.for_model(model, 32)
        prefill = model.compute_logits(forward_tokens(model, cache, ids[:12]))  # M = 12: the GEMM / dequant path
        decode = [model.compute_logits(forward_tokens(model, cache, [t])) for t in ids[12:]]  # M = 1: the GEMV
        logits[name] = torch.cat([prefill, *decode])
    err = ((logits["int8"] - logits["float"]).norm() / logits["float"].norm()).item()
    assert err < 1e-5, err


# ------------------------------------------------------------------------------------------ launches per decode step
# The int8 GEMV stack measured 1.19 ms against bf16's 1.59 on the H200, yet the int8 batch-1 step was
# 0.35 ms slower: whatever int8 adds outside its GEMVs shows up in the launches of one decode layer.
# These tests record every kernel launch of a one-layer 3B-shape decode step on the CPU without running
# it (Triton's interpreter is stubbed), with the H200's SM count and tuned configs, and PDL allowed as
# on sm_90: a launch-for-launch picture of the GPU's graph.
H200_INT8_TUNED_06B = {  # the configs the 06b run (cceced8) tuned and ran its int8 engine with
    "(1, 2560, 2048, 'int8')": "GemvConfig(block_n=2, block_k=2048, split_k=1, num_warps=2, num_stages=3, defer_reduce=False)",
    "(1, 2048, 2048, 'int8')": "GemvConfig(block_n=1, block_k=512, split_k=1, num_warps=4, num_stages=3, defer_reduce=True)",
    "(1, 22016, 2048, 'int8')": "GemvConfig(block_n=2, block_k=2048, split_k=1, num_warps=2, num_stages=3, defer_reduce=False)",
    "(1, 2048, 11008, 'int8')": "GemvConfig(block_n=1, block_k=512, split_k=1, num_warps=4, num_stages=3, defer_reduce=True)",
}


def _decode_step_launches(monkeypatch, model, ops, T=1):
    """(kernel name, grid, constexpr kwargs) of each launch of one decode step of T sequences."""
    import importlib

    from triton.runtime.interpreter import InterpretedFunction

    from pageserve.model.attention import AttentionMetadata, PagedAttention

    launches = []

    def record(self, *args, grid, warmup, **kwargs):
        launches.append((self.fn.__name__, tuple(grid), {k: v for k, v in kwargs.items() if k.isupper()}))

    monkeypatch.setattr(InterpretedFunction, "run", record)
    for name in ("gemv", "gemv_int8", "paged_decode"):  # (the package's ``gemv`` is the function)
        monkeypatch.setattr(importlib.import_module(f"pageserve.kernels.{name}"), "sm_count_for", lambda t: 132)
    util = importlib.import_module("pageserve.kernels._util")
    monkeypatch.setattr(util, "use_pdl", lambda t, tokens, pdl=None: pdl is not False and tokens <= util.PDL_MAX_TOKENS)
    model.set_ops(ops)
    cfg = model.cfg
    kv = torch.zeros(cfg.num_layers, 2, 4 * T, 16, cfg.num_kv_heads, cfg.head_dim, dtype=torch.bfloat16)
    meta = AttentionMetadata(slot_mapping=torch.arange(T) * 64 + 5, query_start_loc=torch.arange(T + 1, dtype=torch.int32),
                             seq_lens=torch.full((T,), 6, dtype=torch.int32),
                             block_tables=torch.arange(4 * T, dtype=torch.int32).view(T, 4), max_query_len=1,
                             max_seq_len=64)
    with torch.inference_mode():
        model(torch.zeros(T, dtype=torch.long), torch.full((T,), 5), PagedAttention(kv, meta, ops))
    return launches


@pytest.fixture(scope="module")
def one_layer_3b():
    """A one-layer qwen2.5-3b-shape decoder in bf16 (vocab cut to 256) and its int8 twin."""
    import copy
    import dataclasses

    from pageserve.model.config import ModelConfig

    cfg = dataclasses.replace(ModelConfig.shipped("qwen2.5-3b"), num_layers=1, vocab_size=256)
    torch.manual_seed(0)
    model = Decoder(cfg).to(torch.bfloat16).eval()
    return model, quantize_model(copy.deepcopy(model), "int8")


@pytest.mark.skipif(CUDA, reason="records launches through Triton's CPU interpreter")
@pytest.mark.parametrize("int8_configs", ["heuristic", "tuned_06b"])
def test_int8_decode_step_at_batch_1_launches_no_more_kernels_than_bf16_all_with_pdl(
        monkeypatch, one_layer_3b, int8_configs):
    from pageserve.kernels import load_device_configs

    fmodel, qmodel = one_layer_3b
    bf16_configs = load_device_configs("NVIDIA H200")
    tuned = parse_int8_configs(H200_INT8_TUNED_06B) if int8_configs == "tuned_06b" else {}
    bf16 = _decode_step_launches(monkeypatch, fmodel, TritonOps(tuned_configs=bf16_configs))
    int8 = _decode_step_launches(monkeypatch, qmodel, TritonOps(tuned_configs=bf16_configs, int8_tuned_configs=tuned))
    names = [n for n, _, _ in int8]
    assert len(int8) <= len(bf16), (names, [n for n, _, _ in bf16])
    assert not any("dequant" in n or "gemm" in n for n in names)  # M = 1: the GEMVs only
    for name, _, kw in bf16 + int8:  # PDL on every decode-path launch: none pays its launch in full
        assert kw.get("USE_PDL") is True, name
    # the fused SiLU·mul + down GEMV applies SiLU to gate|up in every row tile: as few tiles as bf16's
    (fused,) = [grid for n, grid, kw in int8 if kw.get("SILU_MUL")]
    (fused_bf16,) = [grid for n, grid, kw in bf16 if kw.get("SILU_MUL")]
    assert fused[0] <= 2048 // 16 and fused[0] <= fused_bf16[0], fused


# ------------------------------------------------------------------------------------------ the engine
def test_engine_quantization_int8_generates_greedily_with_graph_bookkeeping(tiny_qwen2_config, one_torch_thread):
    from pageserve.engine.llm import LLM
    from pageserve.lab.decode_bench import graph_vs_eager, staggered_decode_workload

    fmodel, _ = _tiny_pair(tiny_qwen2_config)
    kw = dict(device=DEVICE, dtype="float32", block_size=8, num_blocks=256, max_num_seqs=8, max_model_len=128,
              enforce_eager=True, quantization="int8")
    llm = LLM.from_model(fmodel.to(DEVICE), use_triton=True, **kw)  # quantized in place by the engine
    assert is_quantized(llm.engine.model)
    llm.engine.runner.enable_graphs(capture=CUDA)  # on the CPU: the runner's buffers and padding, run eagerly
    w = staggered_decode_workload(4, vocab_size=256, max_prompt=20, min_output=4, max_output=8, seed=2)
    check = graph_vs_eager(llm, w)
    assert check.graphed_steps > 3 and check.identical, f"{check.identical_requests}/{check.num_requests}"
    assert check.max_logit_rel_err < 1e-5 and check.max_unpadded_logit_rel_err < 1e-5
    # the reference ops on the same int8 weights produce the same greedy tokens
    ref, _ = _tiny_pair(tiny_qwen2_config)
    ref_llm = LLM.from_model(ref.to(DEVICE), use_triton=False, **kw)
    from pageserve.engine.sampling_params import SamplingParams

    prompts = [r.prompt_token_ids for r in w.requests[:3]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in ref_llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_quantization_is_validated_and_reaches_the_server_and_generate_flags():
    from pageserve.cli import build_parser
    from pageserve.engine.config import EngineConfig
    from pageserve.serve.cli import engine_config_from_args

    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(device="cpu", quantization="int4")
    assert EngineConfig(device="cpu", quantization="int8").quantization == "int8"
    args = build_parser().parse_args(["serve", "--device", "cpu", "--quantization", "int8"])
    assert engine_config_from_args(args).quantization == "int8"
    assert build_parser().parse_args(["generate", "hi", "--quantization", "int8"]).quantization == "int8"
    assert build_parser().parse_args(["generate", "hi"]).quantization is None


# ------------------------------------------------------------------------------------------ accuracy
def test_int8_keeps_the_real_default_model_close_on_2048_positions_of_english(smollm2):
    from pageserve.lab.quant_eval import eval_token_ids, int8_accuracy

    prev = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        ids = eval_token_ids(smollm2.tokenizer)
        assert len(ids) >= 2049
        acc = int8_accuracy(smollm2.model, ids[:2049])
    finally:
        torch.set_num_threads(prev)
    assert acc.positions == 2048
    assert not is_quantized(smollm2.model)  # the shared fixture was left unquantized
    # measured (CPU fp32, absmax per-channel scales): top-1 0.953, ppl ratio 1.012. The issue's
    # 0.97 top-1 target is not met by per-channel int8 on this 135M model (kernels/NOTES.md, 06b)
    assert acc.top1_agreement >= 0.94, acc
    assert abs(acc.ppl_ratio - 1) <= 0.03, acc


# ------------------------------------------------------------------ the digit-plane kernel (int8_planes)
PLANE_DTYPES = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", PLANE_DTYPES)
def test_int8_planes_match_the_float64_reference_at_decode_batches_and_odd_shapes(dtype, gen):
    from pageserve.kernels.int8_planes import planes_config

    for M in (1, 3, 4, 5, 8):
        _ok(checks.check_gemv_int8_planes(M, 45, 200, dtype, DEVICE, gen, bias=M % 2 == 1), dtype)
    _ok(checks.check_gemv_int8_planes(2, 45, 200, dtype, DEVICE, gen, config=GemvConfig(16, 32, 3)), dtype)  # split
    for M in (1, 7):  # the weights as the MMA's M side
        _ok(checks.check_gemv_int8_planes(M, 45, 200, dtype, DEVICE, gen, config=GemvConfig(32, 64, 2, swap_ab=True)),
            dtype)
    _ok(checks.check_gemv_int8_planes(1, 33, 150, dtype, DEVICE, gen, silu_mul=True), dtype)
    _ok(checks.check_gemv_int8_planes(6, 33, 150, dtype, DEVICE, gen, silu_mul=True,
                                      config=GemvConfig(32, 64, 2)), dtype)
    assert planes_config(1, 2048, 11008, 132).split_k > 1  # a skinny N gets its programs from K


@pytest.mark.parametrize("dtype", PLANE_DTYPES)
def test_int8_planes_carry_every_activation_within_the_tiles_range_exactly(dtype):
    """Each x element meets one weight of 1 (q = identity, scale 1): the output is x itself, so
    every digit split and recombination must be exact, for exponents down to 14 below the tile's
    largest (bf16; 11 for fp16's longer mantissa: the 22 bits of the digits), both signs, and
    an all-zero row."""
    from pageserve.kernels.int8_planes import gemv_int8_planes

    K = 64
    span = 14 if dtype == torch.bfloat16 else 11
    g = torch.Generator().manual_seed(7)
    mant = 1 + torch.rand(3, K, generator=g)  # [1, 2): the exponent is expo's
    expo = torch.randint(5 - span, 6, (3, K), generator=g).float()
    sign = torch.where(torch.rand(3, K, generator=g) < 0.5, -1.0, 1.0)
    x = (sign * mant * 2.0 ** expo).to(dtype)
    x[:, 0] = -1.75 * 2.0 ** 5  # every row's largest |x| has exponent 5
    x = torch.cat([x, torch.zeros(1, K, dtype=dtype)])
    q = torch.eye(K, dtype=torch.int8)
    for cfg in (GemvConfig(16, 32, 1), GemvConfig(64, 32, 1, swap_ab=True)):
        out = gemv_int8_planes(x.to(DEVICE), q.to(DEVICE), torch.ones(K, dtype=dtype, device=DEVICE), config=cfg)
        assert torch.equal(out.cpu(), x), cfg


@pytest.mark.parametrize("dtype", PLANE_DTYPES)
def test_int8_planes_multiply_every_weight_value_exactly(dtype):
    """One x element of 1 (the rest 0) against every int8 value from -127 to 127: out = q exactly."""
    from pageserve.kernels.int8_planes import gemv_int8_planes

    q = torch.arange(-127, 129, dtype=torch.int32).clamp(max=127).to(torch.int8)[:, None].repeat(1, 32)
    x = torch.zeros(1, 32, dtype=dtype)
    x[0, 5] = 1
    out = gemv_int8_planes(x.to(DEVICE), q.to(DEVICE), torch.ones(256, dtype=dtype, device=DEVICE),
                           config=GemvConfig(64, 32, 1))
    assert torch.equal(out.cpu()[0], q[:, 0].to(dtype))


def test_int8_planes_refuse_fp32_and_oversized_batches_with_clear_errors():
    from pageserve.kernels.int8_planes import gemv_int8_planes

    q = torch.zeros(16, 32, dtype=torch.int8, device=DEVICE)
    with pytest.raises(ValueError, match="bf16/fp16"):
        gemv_int8_planes(torch.zeros(1, 32, device=DEVICE), q, torch.ones(16, device=DEVICE))
    x = torch.zeros(9, 32, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="M <= 8"):
        gemv_int8_planes(x, q, torch.ones(16, dtype=torch.bfloat16, device=DEVICE))
    with pytest.raises(ValueError, match="block_k <= 1024"):
        gemv_int8_planes(x[:1], q, torch.ones(16, dtype=torch.bfloat16, device=DEVICE), config=GemvConfig(16, 2048, 1))


def test_int8_planes_serve_the_decoders_decode_rows_and_agree_with_the_gemv_path(tiny_qwen2_config, monkeypatch):
    """bf16 decoder, int8 weights: with ``int8_planes_rows`` the decode step's linears (the fused
    SiLU·down too) go through the digit-plane kernels, and the logits stay within bf16 noise of the
    int8 GEMV path's."""
    from pageserve.kernels import int8_planes
    from pageserve.lab.naive import ContiguousKVCache, forward_tokens
    from pageserve.model import triton_ops

    _, qmodel = _tiny_pair(tiny_qwen2_config)
    qmodel = qmodel.to(torch.bfloat16)
    calls = []
    for name in ("gemv_int8_planes", "silu_mul_gemv_int8_planes"):
        real = getattr(int8_planes, name)
        monkeypatch.setattr(triton_ops, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    ids = torch.randint(0, tiny_qwen2_config.vocab_size, (10,), generator=torch.Generator().manual_seed(1)).tolist()
    logits = {}
    for planes in (None, (1, 8)):
        qmodel.set_ops(TritonOps(int8_planes_rows=planes, int8_silu_down_rows=8))  # the planes' fused SiLU·down too
        cache = ContiguousKVCache.for_model(qmodel, 32)
        forward_tokens(qmodel, cache, ids[:8])  # M = 8: planes when on
        logits[planes] = torch.cat([qmodel.compute_logits(forward_tokens(qmodel, cache, [t])) for t in ids[8:]]).float()
    layers = tiny_qwen2_config.num_layers
    assert calls.count("silu_mul_gemv_int8_planes") == 3 * layers  # the prompt's 8 rows and two single rows
    assert calls.count("gemv_int8_planes") == 3 * 3 * layers  # qkv, o, gate_up
    err = ((logits[(1, 8)] - logits[None]).norm() / logits[None].norm()).item()
    assert err < 2e-2, err
    for bad in ((1, 9), (3, 2), (0, 4), 8):
        with pytest.raises(ValueError, match="int8_planes_rows"):
            TritonOps(int8_planes_rows=bad)
    hopper = CUDA and torch.cuda.get_device_capability()[0] >= 9
    assert TritonOps().int8_planes_rows == (triton_ops.INT8_PLANES_ROWS if hopper else None)  # "auto": measured on Hopper
    for bad in (-1, 9, 2.0):
        with pytest.raises(ValueError, match="int8_silu_down_rows"):
            TritonOps(int8_silu_down_rows=bad)


def test_int8_silu_down_is_fused_at_one_row_only_and_5_to_8_rows_take_the_16_row_tiles(tiny_qwen2_config,
                                                                                      monkeypatch):
    """The int8 defaults measured on the H200 in session 25: SiLU·mul inside the down product at one row only
    (above, the SiLU·mul kernel, then the product), and 5-8-row GEMVs on the tuned 16-row tiles."""
    from pageserve.model import triton_ops

    ops = TritonOps(int8_planes_rows=None)
    calls = []
    for name in ("silu_mul_gemv_int8", "gemv_int8"):
        real = getattr(triton_ops, name)
        monkeypatch.setattr(triton_ops, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    q, s = reference.quantize_int8(torch.randn(24, 40))
    w = QuantizedWeight(q.to(DEVICE), s.to(DEVICE))
    for rows, want in ((1, ["silu_mul_gemv_int8"]), (3, ["gemv_int8"]), (8, ["gemv_int8"])):
        calls.clear()
        ops.silu_mul_linear(torch.randn(rows, 80, device=DEVICE), w)
        assert calls == want, rows
    tile16 = GemvConfig(block_n=64, block_k=64, split_k=1)
    tuned = {int8_config_key(16, 24, 40): tile16}
    for M in (5, 8):
        assert gemv_int8_config(M, 24, 40, 132, configs=tuned) == tile16
    assert gemv_int8_config(4, 24, 40, 132, configs=tuned) != tile16
