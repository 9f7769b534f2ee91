"""Deterministic mode (EngineConfig.deterministic): a sequence's output does not depend on the batch.

CPU: the PyTorch path (``DeterministicTorchOps``) on the default model's real weights, and the
Triton path (``DeterministicOps``, interpreter) on a tiny random Qwen2 shape. GPU: both dtypes
the users run (bf16, fp16) through the Triton path, graphs included.
"""
from __future__ import annotations

import pytest
import torch

from pageserve.engine.config import EngineConfig
from pageserve.engine.llm import LLM
from pageserve.engine.sampling_params import SamplingParams
from pageserve.lab import determinism as D

ON_GPU = torch.cuda.is_available()


def test_deterministic_refuses_int8_and_tensor_parallel_with_a_clear_error():
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(deterministic=True, quantization="int8", device="cpu")
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(deterministic=True, tensor_parallel_size=2, device="cpu")


def test_count_identical_sees_one_changed_logprob_and_one_changed_token():
    a = [([1, 2], [{1: -0.5}, {2: -0.25}]), ([3], [{3: -1.0}])]
    assert D.count_identical(a, a) == 2
    assert D.count_identical(a, [([1, 2], [{1: -0.5}, {2: -0.25000001}]), ([3], [{3: -1.0}])]) == 1
    assert D.count_identical(a, [([1, 2], [{1: -0.5}, {2: -0.25}]), ([4], [{3: -1.0}])]) == 1


def test_deterministic_torch_linear_rows_do_not_depend_on_the_batch():
    from pageserve.model.deterministic_ops import DeterministicTorchOps

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(37, 301, generator=g), torch.randn(129, 301, generator=g)
    ops = DeterministicTorchOps()
    full = ops.linear(x, w, None)
    for i in (0, 5, 36):
        assert torch.equal(ops.linear(x[i:i + 1], w, None), full[i:i + 1])
    assert torch.equal(ops.linear(x[[5, 0, 36]], w, None), full[[5, 0, 36]])


@pytest.mark.skipif(ON_GPU, reason="the CPU reference path; the GPU runs the Triton path below")
def test_deterministic_cpu_path_same_logprobs_alone_batched_chunked_and_from_the_prefix_cache(smollm2):
    def make(**kw):
        cfg = dict(device="cpu", dtype="float32", num_blocks=512, max_model_len=1024, deterministic=True) | kw
        return LLM.from_model(smollm2.model, smollm2.tokenizer, **cfg)

    prompts = D.DEFAULT_PROMPTS[:4]
    ops = smollm2.model.ops  # the engines set the shared model's ops: put them back for the tests after this one
    try:
        r = D.invariance_suite(make, prompts, max_tokens=6, graphs=False)
    finally:
        smollm2.model.set_ops(ops)
    assert r["prefix_hit_rate"] > 0  # the prefix comparison really hit the cache
    assert {k: r[k] for k in ("alone", "chunk_16", "chunk_33", "prefix", "sync")} == \
        {"alone": 4, "chunk_16": 4, "chunk_33": 4, "prefix": 4, "sync": 4}


def _tiny_model(cfg, dtype, device):
    from pageserve.model.loader import build_decoder

    torch.manual_seed(0)
    model = build_decoder(cfg, torch.device(device), dtype, max_model_len=256)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16] if not ON_GPU else [torch.bfloat16, torch.float16])
def test_deterministic_triton_path_same_logprobs_alone_batched_chunked_and_prefix(tiny_qwen2_config, dtype):
    device = "cuda" if ON_GPU else "cpu"
    model = _tiny_model(tiny_qwen2_config, dtype, device)

    def make(**kw):
        cfg = dict(device=device, num_blocks=128, max_model_len=256, deterministic=True, use_triton=True,
                   enforce_eager=not ON_GPU) | kw
        return LLM.from_model(model, None, **cfg)

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 256, (n,), generator=g).tolist() for n in (5, 23, 40)]
    r = D.invariance_suite(make, prompts, max_tokens=4, logprobs=3, chunk_budgets=(7, 16), graphs=ON_GPU)
    want = {k: 3 for k in ("alone", "chunk_7", "chunk_16", "prefix", "sync") + (("eager",) if ON_GPU else ())}
    assert {k: r[k] for k in want} == want


def test_deterministic_engine_with_the_paired_gate_up_kernel_from_one_row_stays_invariant(tiny_qwen2_config):
    # the default mode's paired gate_up + SiLU·mul kernel tried at every row count (on a GPU: Hopper, 2,048 rows
    # up): wherever its probe takes it, alone = batched = chunked = from the prefix cache; on the interpreter it
    # is taken at this shape (K = 64: one K tile, the invariant product's), so the engine really runs it
    device = "cuda" if ON_GPU else "cpu"
    model = _tiny_model(tiny_qwen2_config, torch.bfloat16, device)
    engines = []

    def make(**kw):
        cfg = dict(device=device, num_blocks=128, max_model_len=256, deterministic=True, use_triton=True,
                   enforce_eager=not ON_GPU, triton_options={"paired_rows": (1, 64)}) | kw
        llm = LLM.from_model(model, None, **cfg)
        engines.append(llm.engine.runner.ops)
        return llm

    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(1, 256, (n,), generator=g).tolist() for n in (5, 23, 40)]
    r = D.invariance_suite(make, prompts, max_tokens=4, logprobs=3, chunk_budgets=(7, 16), graphs=ON_GPU)
    want = {k: 3 for k in ("alone", "chunk_7", "chunk_16", "prefix", "sync") + (("eager",) if ON_GPU else ())}
    assert {k: r[k] for k in want} == want
    taken = {key[1] for ops in engines for key, ok in ops.paired_checked.items() if ok}
    assert ON_GPU or {1, 3} <= taken  # decode rows and chunks went through the paired kernel


def test_the_paired_kernel_is_refused_where_its_bits_differ_on_the_interpreter():
    # at K = 320 the paired kernel sums K in other tiles than the invariant product on the interpreter (a tile's
    # product is a separate sum there): the bf16 rounding hides most of it, but 3 of this probe's 16,384 outputs
    # differ (seeds fixed), and the probe must see them and keep this mode's own path
    import os

    from pageserve.kernels import matmul_invariant
    from pageserve.model.deterministic_ops import DeterministicOps

    if ON_GPU or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the interpreter's tiling (on a GPU every tile is the same MMA chain)")
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(512, 320, generator=g) * 320**-0.5).to(torch.bfloat16)
    x = torch.randn(64, 320, generator=g).to(torch.bfloat16)
    ops = DeterministicOps(cublas_rows=None, paired_rows=(1, 64))
    want = ops.silu_and_mul(matmul_invariant(x, w))
    assert torch.equal(ops.gate_up_silu_mul(x, w), want)
    assert ops.paired_checked == {((512, 320), 64, x.dtype, x.device): False}  # refused by its probe
    assert torch.equal(ops.gate_up_silu_mul(x[:16], w), want[:16])  # other row counts: probed on their own
    assert ((512, 320), 16, x.dtype, x.device) in ops.paired_checked


@pytest.mark.parametrize("mixed", [False, True], ids=["eager_verify", "mixed_graph_verify"])
@pytest.mark.parametrize("dtype", [torch.bfloat16] if not ON_GPU else [torch.bfloat16, torch.float16])
def test_deterministic_speculative_decoding_gives_plain_decodings_logprobs_bit_for_bit(tiny_qwen2_config, dtype,
                                                                                     mixed, monkeypatch):
    """A draft-verifying step computes a sequence's newest token and its drafts as one chunk; in the
    deterministic mode that chunk's logits are bitwise the one-token steps' (engine/speculative.py), also when
    the verify steps go through the mixed-step graph runner (``DeterministicOps.mixed_graphs``; its static
    buffers run eagerly on the CPU)."""
    from pageserve.engine.speculative import can_draft
    from pageserve.model.deterministic_ops import DeterministicOps

    device = "cuda" if ON_GPU else "cpu"
    model = _tiny_model(tiny_qwen2_config, dtype, device)
    cfg = dict(device=device, num_blocks=128, max_model_len=256, deterministic=True, use_triton=True,
               enforce_eager=not ON_GPU)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 256, (n,), generator=g).tolist() for n in (5, 23, 40)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    want = LLM.from_model(model, None, **cfg).generate(prompts, params, use_tqdm=False)
    llm = LLM.from_model(model, None, **cfg, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    truth = {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, want)}

    def propose(running, max_model_len):  # the plain run's next tokens, the third of each draft spoiled
        for seq in running:
            m, room = seq.num_output_tokens, min(can_draft(seq, max_model_len), 3)
            seq.spec_token_ids = list(truth[tuple(seq.prompt_token_ids)][m:m + room]) if room > 0 else []
            if len(seq.spec_token_ids) == 3:
                seq.spec_token_ids[2] = (seq.spec_token_ids[2] + 1) % 256

    llm.engine.proposer.propose = propose
    used = []
    if mixed:
        monkeypatch.setattr(DeterministicOps, "mixed_graphs", True)
        runner = llm.engine.runner
        runner.enable_mixed_graphs(capture=ON_GPU)
        real_run = runner.mixed_graphs.run
        runner.mixed_graphs.run = lambda x, d, ids: used.append(x.num_tokens) or real_run(x, d, ids)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert llm.get_stats()["spec_accepted_tokens"] > 0 and (len(used) >= 2) == mixed  # the prompts, then verifies
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert [o.outputs[0].logprobs for o in got] == [o.outputs[0].logprobs for o in want]  # every float equal


def test_deterministic_ops_pass_attention_launch_options_and_refuse_bit_changing_ones(monkeypatch):
    from pageserve.model import deterministic_ops as DO

    with pytest.raises(ValueError, match="unknown options"):
        DO.DeterministicOps(attention_launch={"kv_split": 64})  # a bit-changing choice is not a launch option
    seen = {}
    monkeypatch.setattr("pageserve.kernels.paged_attention_invariant", lambda *a, **kw: seen.update(kw))
    DO.DeterministicOps(attention_launch={"split_warps": 8}, kv_split=128).paged_attention(
        torch.zeros(1, 2, 16), None, None, None, 0.25)
    assert seen["split_warps"] == 8 and seen["kv_split"] == 128


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
def test_deterministic_seeded_sampling_is_the_same_alone_and_batched(tiny_qwen2_config):
    model = _tiny_model(tiny_qwen2_config, torch.bfloat16, "cuda")

    def make(**kw):
        return LLM.from_model(model, None, **(dict(num_blocks=128, max_model_len=256, deterministic=True) | kw))

    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, 256, (n,), generator=g).tolist() for n in (3, 17, 29, 60)]
    assert D.seeded_sampling_identical(make, prompts, max_tokens=8) == 4


def test_silu_mul_moves_out_of_the_gate_up_product_above_its_row_limit_with_the_same_bits():
    # decode-sized batches get SiLU·mul in the gate_up epilogue, chunks the separate kernel: a row's
    # bits must not see which (a chunk's rows are decoded later in small batches)
    from pageserve.model.deterministic_ops import DeterministicOps

    ops = DeterministicOps()
    dev = "cuda" if ON_GPU else "cpu"
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 96, generator=gen).to(dev, torch.bfloat16)
    w = (torch.randn(2 * 40, 96, generator=gen) * 0.1).to(dev, torch.bfloat16)
    fused = ops.gate_up_silu_mul(x, w)
    separate = DeterministicOps(silu_in_gate_up_max_rows=4).gate_up_silu_mul(x, w)
    assert torch.equal(separate, ops.silu_and_mul(ops.linear(x, w, None)))
    assert torch.equal(separate, fused)
    assert torch.equal(ops.gate_up_silu_mul(x[2:5], w), fused[2:5])  # 3 rows: fused, under PDL too on sm_90+


def test_silu_mul_epilogue_under_programmatic_dependent_launch_lets_down_in_after_its_k_loop(monkeypatch):
    # the fused product released at its top under PDL cost a graphed batch-1 step ~0.35 ms on the H200; released
    # after its K loop it beats the separate kernel (det_b1_switches_release_points_e11de29). So: the epilogue at
    # every decode batch, launched with PDL where the batch uses it and releasing down after its loop; the
    # separate kernel where silu_in_gate_up_pdl is off and PDL is on; other linears keep the top release
    import pageserve.kernels as K
    from pageserve.model import deterministic_ops as DO

    real, launches = K.matmul_invariant, []

    def spy(*args, **kw):
        launches.append((kw.get("silu_mul", False), kw.get("pdl"), kw.get("pdl_release", "top")))
        return real(*args, **kw)

    monkeypatch.setattr(K, "matmul_invariant", spy)
    # as on a GPU with PDL (the interpreter never launches with it)
    monkeypatch.setattr(DO, "use_pdl", lambda t, rows, pdl: pdl is not False and rows <= 8)
    dev = "cuda" if ON_GPU else "cpu"
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(12, 64, generator=gen).to(dev, torch.bfloat16)
    w = (torch.randn(2 * 32, 64, generator=gen) * 0.1).to(dev, torch.bfloat16)
    ops, one_row = DO.DeterministicOps(), DO.DeterministicOps(pdl_max_rows=1)
    unfused, top = DO.DeterministicOps(silu_in_gate_up_pdl=False), DO.DeterministicOps(gate_up_pdl_release="top")
    for o, rows, fused, pdl, release in [(ops, 2, True, ops.pdl_for(2), "after_loop"), (ops, 12, True, False, "after_loop"),
                                        (DO.DeterministicOps(pdl=False), 2, True, False, "after_loop"),
                                        (one_row, 2, True, False, "after_loop"),
                                        (one_row, 1, True, one_row.pdl_for(1), "after_loop"),
                                        (unfused, 2, False, unfused.pdl_for(2), "top"), (unfused, 12, True, False, "after_loop"),
                                        (top, 2, True, top.pdl_for(2), "top")]:
        launches.clear()
        o.gate_up_silu_mul(x[:rows], w)
        assert launches[0] == (fused, pdl, release), (o.pdl, o.pdl_max_rows, o.silu_in_gate_up_pdl, rows, launches)
    launches.clear()
    ops.linear(x[:2], w, None)  # the other linears release at their top
    assert launches == [(False, ops.pdl_for(2), "top")]
    with pytest.raises(ValueError, match="gate_up_pdl_release"):
        DO.DeterministicOps(gate_up_pdl_release="late")


def test_deterministic_flag_reaches_the_ops(tiny_qwen2_config):
    from pageserve.model.deterministic_ops import DeterministicOps, DeterministicTorchOps

    model = _tiny_model(tiny_qwen2_config, torch.float32, "cpu")
    llm = LLM.from_model(model, None, device="cpu", num_blocks=32, max_model_len=64, deterministic=True)
    assert isinstance(llm.engine.runner.ops, DeterministicTorchOps) and not llm.engine.runner.ops.graph_safe
    if ON_GPU:
        model = _tiny_model(tiny_qwen2_config, torch.float32, "cuda")
    llm = LLM.from_model(model, None, device="cuda" if ON_GPU else "cpu", num_blocks=32, max_model_len=64,
                         deterministic=True, use_triton=True, enforce_eager=True)
    assert isinstance(llm.engine.runner.ops, DeterministicOps)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


def test_deterministic_mixed_graphs_are_on_unless_the_environment_turns_them_off():
    # PAGESERVE_DET_MIXED_GRAPHS is read once, when the ops' module is imported: a fresh interpreter per setting
    import os
    import subprocess
    import sys

    code = "from pageserve.model.deterministic_ops import DeterministicOps as O; print(O.mixed_graphs)"
    seen = {}
    for value in (None, "0", "1"):
        env = {k: v for k, v in os.environ.items() if k != "PAGESERVE_DET_MIXED_GRAPHS"}
        if value is not None:
            env["PAGESERVE_DET_MIXED_GRAPHS"] = value
        seen[value] = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                     check=True).stdout.strip()
    assert seen == {None: "True", "0": "False", "1": "True"}


def test_taller_prefill_tiles_are_on_by_default_only_where_the_h200_measured_them():
    from pageserve.model.deterministic_ops import DeterministicOps

    ops = DeterministicOps()
    assert ops.prefill_block_m_for(torch.device("cpu")) is None  # the interpreter: 16-row tiles
    if ON_GPU:
        hopper = torch.cuda.get_device_capability()[0] >= 9
        assert ops.prefill_block_m_for(torch.device("cuda")) == (128 if hopper else None)
    assert DeterministicOps(attention_prefill_block_m=64).prefill_block_m_for(torch.device("cpu")) == 64
    assert DeterministicOps(attention_prefill_block_m=None).prefill_block_m_for(torch.device("cuda")) is None
    with pytest.raises(ValueError, match="attention_prefill_block_m"):
        DeterministicOps(attention_prefill_block_m="tall")


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
def test_deterministic_mode_captures_cuda_graphs(tiny_qwen2_config):
    # 09 at 0afd934b ran the deterministic engines eagerly: graphs were gated on ops.name == "triton"
    model = _tiny_model(tiny_qwen2_config, torch.bfloat16, "cuda")
    llm = LLM.from_model(model, None, num_blocks=64, max_model_len=128, max_num_seqs=8, deterministic=True)
    assert llm.engine.runner.graphs is not None


@pytest.mark.skipif(ON_GPU, reason="on the GPU the engine captures real graphs (test above and the 09 notebook)")
def test_deterministic_triton_path_same_logprobs_through_the_graph_runners_padded_buckets(tiny_qwen2_config):
    # on the CPU the graph runner keeps its static buffers and pads each decode batch to its
    # bucket (slot -1, seq_len 0), running eagerly: what changes under graphs but the replay
    model = _tiny_model(tiny_qwen2_config, torch.float32, "cpu")

    def make(graphs: bool):
        llm = LLM.from_model(model, None, device="cpu", num_blocks=128, max_model_len=256, deterministic=True,
                             use_triton=True, enforce_eager=True, max_num_seqs=8)
        if graphs:
            runner = llm.engine.runner
            runner.enable_graphs(capture=False)
            run = runner.graphs.run

            def counting_run(*args, **kwargs):
                replays.append(1)
                return run(*args, **kwargs)

            runner.graphs.run = counting_run
        return llm

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 256, (n,), generator=g).tolist() for n in (4, 9, 13)]  # 3 rows: a bucket of 4
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=3)
    replays: list[int] = []
    graphed, eager = (D.outputs_of(make(gr), prompts, params) for gr in (True, False))
    assert replays  # the decode steps did go through the graph runner
    assert D.count_identical(graphed, eager) == 3


def _split_k_linear(x, w, b=None):
    """A product with another order of the sums (K in two halves, each rounded): what a split-K kernel does."""
    from pageserve.kernels import matmul_invariant

    h = w.shape[1] // 2
    y = matmul_invariant(x[:, :h].contiguous(), w[:, :h].contiguous()).float()
    return (y + matmul_invariant(x[:, h:].contiguous(), w[:, h:].contiguous(), b).float()).to(x.dtype)


def test_cublas_runs_a_linear_only_where_its_bits_equal_the_invariant_kernels():
    # cuBLAS gave the invariant kernel's bits on the H200 for most 3B shapes and row counts, not for down
    # below 448 rows (split-K): the ops check per (shape, rows) and keep the invariant kernel where not equal
    from pageserve.kernels import matmul_invariant
    from pageserve.model.deterministic_ops import DeterministicOps

    dev = "cuda" if ON_GPU else "cpu"
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(9, 128, generator=gen).to(dev, torch.bfloat16)
    w = (torch.randn(48, 128, generator=gen) * 0.1).to(dev, torch.bfloat16)
    b = torch.randn(48, generator=gen).to(dev, torch.bfloat16)
    want = matmul_invariant(x, w, b)
    calls = []

    def same_bits(x, w, b):  # a "cuBLAS" whose kernel is the invariant one: taken
        calls.append(x.shape[0])
        return matmul_invariant(x, w, b)

    ops = DeterministicOps(cublas_rows=(2, 8))
    ops.fast_linear = same_bits
    assert torch.equal(ops.linear(x[:8], w, b), want[:8])
    assert calls == [8, 8]  # the probe, then the product
    ops.linear(x[:8], w, b)
    assert calls == [8, 8, 8]  # checked once per (shape, rows): no second probe
    assert torch.equal(ops.linear(x, w, b), want) and calls == [8, 8, 8]  # 9 rows: outside (2, 8), never tried
    assert ops.cublas_checked == {((48, 128), 8, torch.bfloat16, True, x.device): True}

    ops = DeterministicOps(cublas_rows=(2, 8))
    ops.fast_linear = _split_k_linear  # other bits: refused, the invariant kernel's rows come back
    assert torch.equal(ops.linear(x[:8], w, b), want[:8])
    assert torch.equal(ops.gate_up_silu_mul(x[:4], w), ops.silu_and_mul(matmul_invariant(x[:4], w)))  # gate_up too
    assert set(ops.cublas_checked.values()) == {False}


def test_the_paired_gate_up_kernel_runs_only_where_its_bits_equal_this_modes_path():
    # kernels.gate_up_silu (the default mode's gate_up + SiLU·mul for prefill-sized steps) is taken per (shape,
    # rows) only where a probe gives the bits of this mode's own path: the invariant product, then SiLU·mul
    from pageserve.kernels import matmul_invariant
    from pageserve.model.deterministic_ops import DeterministicOps

    dev = "cuda" if ON_GPU else "cpu"
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(9, 64, generator=gen).to(dev, torch.bfloat16)
    w = (torch.randn(96, 64, generator=gen) * 0.2).to(dev, torch.bfloat16)  # gate|up: 2 x 48 rows
    calls = []

    def same_bits(x, w, config=None, pdl=None):  # a paired kernel that computes this mode's very bits: taken
        calls.append(x.shape[0])
        return ops.silu_and_mul(matmul_invariant(x, w))

    ops = DeterministicOps(cublas_rows=None, paired_rows=(2, 8))
    ops.fast_gate_up_silu = same_bits
    want = ops.silu_and_mul(matmul_invariant(x, w))
    assert torch.equal(ops.gate_up_silu_mul(x[:8], w), want[:8])
    assert calls == [8, 8]  # the probe, then the product
    assert torch.equal(ops.gate_up_silu_mul(x[:8], w), want[:8]) and calls == [8, 8, 8]  # probed once
    assert torch.equal(ops.gate_up_silu_mul(x, w), want) and calls == [8, 8, 8]  # 9 rows: outside (2, 8)
    assert ops.paired_checked == {((96, 64), 8, torch.bfloat16, x.device): True}

    def other_bits(x, w, config=None, pdl=None):  # the products summed in two K halves: other bits, refused
        return ops.silu_and_mul(_split_k_linear(x, w, None))

    ops = DeterministicOps(cublas_rows=None, paired_rows=(2, 8))
    ops.fast_gate_up_silu = other_bits
    assert not torch.equal(other_bits(x[:8], w), want[:8])  # the fake really differs
    assert torch.equal(ops.gate_up_silu_mul(x[:8], w), want[:8])
    assert set(ops.paired_checked.values()) == {False}
    assert DeterministicOps().paired_rows is None or ON_GPU  # "auto": Hopper GPUs only, never the interpreter
    with pytest.raises(ValueError, match="paired_rows"):
        DeterministicOps(paired_rows=(8, 2))


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_paired_gate_up_kernel_where_taken_gives_this_modes_bits_on_fresh_inputs_at_the_3b_shape(dtype):
    # the real kernel (not a fake): whatever the probe decided per row count, fresh inputs come out with the
    # bits of the invariant product followed by SiLU·mul
    from pageserve.kernels import matmul_invariant
    from pageserve.lab.kernel_bench.shapes import GEMV_SHAPES
    from pageserve.model.deterministic_ops import DeterministicOps

    ops = DeterministicOps(paired_rows=(1, 4096))
    gen = torch.Generator(device="cuda").manual_seed(10)
    N, K = GEMV_SHAPES["gate_up"]
    w = torch.randn(N, K, device="cuda", dtype=dtype, generator=gen) * K**-0.5
    for M in (3, 300, 2048, 2100, 4096):
        x = (torch.randn(M, K, device="cuda", generator=gen) * 4).to(dtype)
        want = ops.silu_and_mul(matmul_invariant(x, w))
        assert torch.equal(ops.gate_up_silu_mul(x, w).view(torch.int16), want.view(torch.int16))
    print("paired kernel taken at", sorted(k[1] for k, ok in ops.paired_checked.items() if ok))


def test_cublas_rows_default_to_the_gpu_only_and_refuse_a_malformed_range():
    from pageserve.model.deterministic_ops import DeterministicOps

    ops = DeterministicOps()
    assert ops.cublas_rows_for(torch.device("cpu")) is None  # the interpreter: the invariant kernel only
    assert ops.cublas_rows_for(torch.device("cuda")) == DeterministicOps.CUBLAS_ROWS
    assert DeterministicOps(cublas_rows=None).cublas_rows_for(torch.device("cuda")) is None
    with pytest.raises(ValueError, match="cublas_rows"):
        DeterministicOps(cublas_rows=128)
    with pytest.raises(ValueError, match="cublas_rows"):
        DeterministicOps(cublas_rows=(256, 128))
    assert DeterministicOps(cublas_rows=[64, 512]).cublas_rows_for(torch.device("cuda")) == (64, 512)  # JSON
    # eager row buckets (EngineConfig.eager_row_buckets None): on where probes can happen, so that start-up
    # probes every bucket an eager step can meet; the default mode keeps them off
    from pageserve.model.ops import TorchOps
    from pageserve.model.triton_ops import TritonOps
    assert ops.eager_row_buckets_for(torch.device("cuda")) and not ops.eager_row_buckets_for(torch.device("cpu"))
    assert not DeterministicOps(cublas_rows=None).eager_row_buckets_for(torch.device("cuda"))
    assert not TritonOps().eager_row_buckets_for(torch.device("cuda"))
    assert not TorchOps().eager_row_buckets_for(torch.device("cuda"))


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cublas_where_taken_gives_the_invariant_bits_on_fresh_inputs_at_the_3b_shapes(dtype):
    # the check is one probe a (shape, rows): other inputs at those rows must come out with the same bits
    from pageserve.kernels import matmul_invariant
    from pageserve.lab.kernel_bench.shapes import GEMV_SHAPES
    from pageserve.model.deterministic_ops import DeterministicOps

    ops = DeterministicOps(cublas_rows=(1, 2048))
    gen = torch.Generator(device="cuda").manual_seed(6)
    for name in ("qkv", "o", "gate_up", "down"):
        N, K = GEMV_SHAPES[name]
        w = torch.randn(N, K, device="cuda", dtype=dtype, generator=gen) * K**-0.5
        b = torch.randn(N, device="cuda", dtype=dtype, generator=gen) if name == "qkv" else None
        for M in (1, 7, 128, 300, 512, 1024):
            x = (torch.randn(M, K, device="cuda", generator=gen) * 4).to(dtype)
            assert torch.equal(ops.linear(x, w, b).view(torch.int16), matmul_invariant(x, w, b).view(torch.int16))
    taken = {(k[0], k[1]) for k, ok in ops.cublas_checked.items() if ok}
    if torch.cuda.get_device_capability()[0] == 9:  # what the H200 probe found (cublas_bits_probe_aaeaaed)
        assert {(GEMV_SHAPES["gate_up"], 512), (GEMV_SHAPES["qkv"], 128), (GEMV_SHAPES["down"], 1024)} <= taken


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
def test_a_serving_step_queues_its_cublas_probe_instead_of_waiting_for_it(tiny_qwen2_config):
    # once the engine's graphs are captured, a step meeting a new (shape, rows) must not sync the host on the
    # probe: it runs the invariant kernel while the answer comes back, and takes cuBLAS later where equal
    from pageserve.kernels import matmul_invariant
    from pageserve.lab.kernel_bench.shapes import GEMV_SHAPES
    from pageserve.model.deterministic_ops import DeterministicOps

    llm = LLM.from_model(_tiny_model(tiny_qwen2_config, torch.bfloat16, "cuda"), None, num_blocks=64,
                         max_model_len=128, deterministic=True)
    assert llm.engine.runner.ops.probe_blocking is False  # set once the start-up captures are done
    ops = DeterministicOps(cublas_rows=(1, 2048))
    ops.probe_blocking = False
    gen = torch.Generator(device="cuda").manual_seed(8)
    N, K = GEMV_SHAPES["qkv"]
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=gen) * K**-0.5
    b = torch.randn(N, device="cuda", dtype=torch.bfloat16, generator=gen)
    x = (torch.randn(300, K, device="cuda", generator=gen) * 4).to(torch.bfloat16)
    want = matmul_invariant(x, w, b).view(torch.int16)
    key = ((N, K), 300, torch.bfloat16, True, x.device)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host sync inside the call raises
    try:
        first = ops.linear(x, w, b)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert key in ops.cublas_pending and key not in ops.cublas_checked
    assert torch.equal(first.view(torch.int16), want)
    torch.cuda.synchronize()
    second = ops.linear(x, w, b)  # the answer is back: decided, cuBLAS if its bits were equal
    assert key in ops.cublas_checked and not ops.cublas_pending
    assert torch.equal(second.view(torch.int16), want)
    if torch.cuda.get_device_capability()[0] == 9:  # the H200 probe found qkv equal at every row count
        assert ops.cublas_checked[key] is True
    llm.shutdown()


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
def test_deterministic_engine_with_cublas_at_every_row_count_stays_invariant(tiny_qwen2_config):
    # cuBLAS and the paired gate_up kernel tried from one row (the defaults: 128-8,192 and, on Hopper, 2,048
    # up): wherever they are taken, alone = batched = chunked
    model = _tiny_model(tiny_qwen2_config, torch.bfloat16, "cuda")

    def make(**kw):
        cfg = dict(num_blocks=128, max_model_len=256, deterministic=True,
                   triton_options={"cublas_rows": (1, 2048), "paired_rows": (1, 2048)})
        return LLM.from_model(model, None, **(cfg | kw))

    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(1, 256, (n,), generator=g).tolist() for n in (5, 23, 40)]
    r = D.invariance_suite(make, prompts, max_tokens=4, logprobs=3, chunk_budgets=(7, 16), graphs=True)
    want = {k: 3 for k in ("alone", "chunk_7", "chunk_16", "prefix", "sync", "eager")}
    assert {k: r[k] for k in want} == want


def test_decode_rope_runs_inside_the_attention_launch_only_up_to_its_row_limit():
    from types import SimpleNamespace as NS

    from pageserve.model.deterministic_ops import DeterministicOps

    def step(rows, max_query_len=1):
        return torch.zeros(rows, 8, 64), NS(max_query_len=max_query_len, seq_lens=torch.ones(rows))

    ops = DeterministicOps()  # the default: up to 4 rows (H200, 02b5869)
    assert [ops.rope_in_decode_attention(*step(n)) for n in (1, 4, 5, 64)] == [True, True, False, False]
    assert not ops.rope_in_decode_attention(*step(3, max_query_len=2))  # a step with a prompt chunk
    assert not DeterministicOps(rope_in_attention=0).rope_in_decode_attention(*step(1))
    assert DeterministicOps(rope_in_attention=1 << 30).rope_in_decode_attention(*step(512))
    for bad in (-1, True, 2.0):
        with pytest.raises(ValueError, match="rope_in_attention"):
            DeterministicOps(rope_in_attention=bad)
