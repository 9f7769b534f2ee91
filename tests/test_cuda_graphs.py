"""The decode graph runner's bookkeeping, over a real decode loop.

On the CPU the runner keeps the same static buffers, bucket padding (slot -1, seq_len 0)
and copy-in as on the GPU, but runs the model eagerly on them instead of replaying a graph;
on CUDA the same tests capture and replay real graphs.
"""
import bisect
import dataclasses

import pytest
import torch

from pageserve.engine.cuda_graphs import bucket_sizes
from pageserve.lab.bench import run_pageserve_online
from pageserve.lab.decode_bench import capture_logits, graph_vs_eager, staggered_decode_workload
from pageserve.engine.llm import LLM
from pageserve.engine.sampling_params import SamplingParams
from pageserve.model.decoder import Decoder

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest: one intra-op thread for this module


def _staggered_llm(cfg, **overrides):
    """The tiny decoder (seed 3) behind an engine sized for ``staggered_decode_workload(24, ...)``:
    fp32, 8-token blocks, 24 sequences, 256 tokens, eager unless ``overrides`` say otherwise."""
    model = Decoder(cfg).to(DEVICE)
    model.init_dummy_weights(seed=3, std=0.3)
    kw = dict(device=DEVICE, dtype="float32", block_size=8, num_blocks=512, max_num_seqs=24, max_model_len=256,
              enforce_eager=True)
    return model, LLM.from_model(model.eval(), **{**kw, **overrides})


@pytest.fixture(scope="module")
def tiny_llm(tiny_qwen2_config):
    _, llm = _staggered_llm(tiny_qwen2_config)
    llm.engine.runner.enable_graphs(capture=DEVICE == "cuda")
    return llm


def test_buckets_cover_every_batch_size_up_to_the_maximum():
    for max_bs in (1, 7, 64, 100, 512):
        b = bucket_sizes(max_bs)
        assert b[0] == 1 and b[-1] == max_bs and b == sorted(set(b))
        assert all(any(s >= n for s in b) for n in range(1, max_bs + 1))


def test_graphed_decode_loop_matches_eager_token_for_token(tiny_llm):
    # 24 sequences joining one per step, prompts of 5..40 tokens (block size 8: many
    # boundary crossings), 16..64 new tokens each: the batch grows, shrinks and pads.
    w = staggered_decode_workload(24, vocab_size=256, seed=1)
    check = graph_vs_eager(tiny_llm, w)
    assert check.graphed_steps > 20  # the second run really went through the graph runner
    assert check.identical, f"{check.identical_requests}/{check.num_requests} requests identical"
    assert check.max_logit_rel_err < 1e-5 and check.max_unpadded_logit_rel_err < 1e-5
    assert all(len(t) == r.max_tokens for t, r in zip(check.graph_tokens, w.requests))
    bm = tiny_llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_graph_vs_eager_computes_both_runs_prompts_with_the_prefix_cache_on(tiny_qwen2_config):
    # prefix caching is on by default: without emptying it, the graphed run's prompts would hit the eager run's
    # blocks and start from other chunk boundaries than the eager run's (their bits may differ in bf16)
    _, llm = _staggered_llm(tiny_qwen2_config)
    assert llm.engine.config.enable_prefix_caching
    llm.engine.runner.enable_graphs(capture=DEVICE == "cuda")
    bm = llm.engine.block_manager
    check = graph_vs_eager(llm, staggered_decode_workload(8, vocab_size=256, seed=2))
    assert check.identical and bm.num_queried_tokens > 0 and bm.num_hit_tokens == 0
    run_pageserve_online(llm, staggered_decode_workload(8, vocab_size=256, seed=2))
    assert bm.num_hit_tokens > 0  # the cache was on all along: a third run, not emptied, hits


def test_capture_logits_sees_every_sampling_step_and_unwraps(tiny_llm):
    from pageserve.engine.sampling_params import SamplingParams

    sampler = tiny_llm.engine.runner.sampler
    with capture_logits(tiny_llm.engine.runner) as steps:
        out = tiny_llm.generate([[1, 2, 3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert "sample" not in vars(sampler)  # the sampler's own method again
    assert len(steps.logits) == 6 and all(t.shape[0] == 1 for t in steps.logits)
    assert [int(t[0].argmax()) for t in steps.logits] == out[0].outputs[0].token_ids


def test_padding_rows_write_no_kv(tiny_llm):
    runner = tiny_llm.engine.runner
    g = runner.graphs
    kv_before = runner.kv_cache.clone()
    # 3 sequences padded to bucket 4: only 3 slots may change
    slots = torch.tensor([8, 17, 26], device=runner.device)
    bt = torch.arange(4 * 4, dtype=torch.int32, device=runner.device).view(4, 4)[:3]
    g.run(torch.tensor([1, 2, 3], device=runner.device), torch.tensor([0, 1, 2], device=runner.device), slots,
          torch.tensor([1, 2, 3], dtype=torch.int32, device=runner.device), bt)
    changed = (runner.kv_cache != kv_before).flatten(4).any(-1)  # [L, 2, num_blocks, block_size]
    flat = changed.flatten(2).any(0).any(0).nonzero().flatten().tolist()
    assert flat == [8, 17, 26]


def _static_buffers(max_bs: int, max_blocks: int, fill: int = 7):
    i32, i64 = torch.int32, torch.int64
    return (torch.full((max_bs,), fill, dtype=i64, device=DEVICE), torch.full((max_bs,), fill, dtype=i64, device=DEVICE),
            torch.full((max_bs,), fill, dtype=i64, device=DEVICE), torch.full((max_bs,), fill, dtype=i32, device=DEVICE),
            torch.full((max_bs, max_blocks), fill, dtype=i32, device=DEVICE))


@pytest.mark.parametrize("bs,padded,nb", [(1, 1, 1), (3, 4, 5), (5, 8, 300), (8, 8, 2), (2, 16, 129)])
def test_staging_kernel_fills_the_static_buffers_like_the_torch_copies(bs, padded, nb):
    # the sources are int64 views at odd offsets of one packed buffer, as to_device makes them;
    # rows past bs become padding, table columns past nb keep what they held
    from pageserve.kernels.step_inputs import stage_decode_inputs, stage_decode_inputs_reference

    g = torch.Generator().manual_seed(bs * 1000 + nb)
    packed = torch.randint(0, 1 << 30, (1 + 4 * bs + bs * nb,), generator=g).to(DEVICE)
    _, ids, pos, slots, lens, bt = torch.split(packed, [1, bs, bs, bs, bs, bs * nb])
    got, want = _static_buffers(16, 300), _static_buffers(16, 300)
    stage_decode_inputs(ids, pos, slots, lens, bt.view(bs, nb), got, padded)
    stage_decode_inputs_reference(ids, pos, slots, lens, bt.view(bs, nb), want, padded)
    for name, a, b in zip(("ids", "positions", "slots", "seq_lens", "block_tables"), got, want):
        assert torch.equal(a, b), name
    assert (got[2][bs:padded] == -1).all() and (got[3][bs:padded] == 0).all()
    assert (got[4][:, nb:] == 7).all() and (got[0][padded:] == 7).all()  # nothing past the step's reach


def test_staging_kernel_rejects_a_batch_its_buffers_cannot_hold():
    from pageserve.kernels.step_inputs import stage_decode_inputs

    one = torch.zeros(4, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="do not fit"):
        stage_decode_inputs(one, one, one, one, one.view(4, 1), _static_buffers(2, 4), 4)
    with pytest.raises(ValueError, match="do not fit"):
        stage_decode_inputs(one[:1], one[:1], one[:1], one[:1], torch.zeros(1, 9, dtype=torch.int64, device=DEVICE),
                            _static_buffers(2, 4), 1)


def test_graph_runner_with_the_staging_kernel_decodes_like_eager(tiny_qwen2_config):
    # the Triton copy-in (the GPU default; on the CPU the interpreter) behind the same decode
    # loop as test_graphed_decode_loop_matches_eager_token_for_token: same tokens and logits
    from pageserve.engine.cuda_graphs import CUDAGraphRunner

    _, llm = _staggered_llm(tiny_qwen2_config)
    runner = llm.engine.runner
    runner.graphs = CUDAGraphRunner(runner.model, runner.kv_cache, 24, runner.max_blocks_per_seq(),
                                    capture=DEVICE == "cuda", stage_kernel=True)
    runner.graphs.capture()
    check = graph_vs_eager(llm, staggered_decode_workload(24, vocab_size=256, seed=1))
    assert check.graphed_steps > 20
    assert check.identical, f"{check.identical_requests}/{check.num_requests} requests identical"
    assert check.max_logit_rel_err < 1e-5


def test_the_engine_samples_the_heads_bf16_logits_as_they_are_with_the_tokens_of_fp32_logits(tiny_qwen2_config):
    # since session 29 the sampler reads the head's product in the model's dtype (no fp32 copy of
    # [rows, V] after the head): greedy, seeded and logprob rows must see the very values the fp32
    # copy held before (lab.profiling.fp32_logits puts the old path back)
    import contextlib

    from pageserve.lab.profiling import fp32_logits

    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11]]
    params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=1.0, top_k=5, seed=4, max_tokens=6, ignore_eos=True, logprobs=1)]
    runs = {}
    for old in (False, True):
        with fp32_logits() if old else contextlib.nullcontext():
            model = Decoder(tiny_qwen2_config).to(DEVICE)
            model.init_dummy_weights(seed=3, std=0.3)
            llm = LLM.from_model(model.to(torch.bfloat16).eval(), device=DEVICE, dtype="bfloat16", block_size=8,
                                 num_blocks=64, max_num_seqs=4, max_model_len=64, enforce_eager=True)
            llm.engine.runner.enable_graphs(capture=DEVICE == "cuda")
            with capture_logits(llm.engine.runner) as steps:
                out = llm.generate(prompts, params, use_tqdm=False)
            runs[old] = ([o.outputs[0].token_ids for o in out], [o.outputs[0].logprobs for o in out], steps.logits,
                         llm.engine.runner.graphs.logits_out.dtype)
            llm.shutdown()
    (tokens, logprobs, logits, dtype), (tokens32, logprobs32, logits32, dtype32) = runs[False], runs[True]
    assert (dtype, dtype32) == (torch.bfloat16, torch.float32)
    assert all(t.dtype == torch.bfloat16 for t in logits) and all(t.dtype == torch.float32 for t in logits32)
    assert len(logits) == len(logits32) > 1
    assert all(torch.equal(a.float(), b) for a, b in zip(logits, logits32))
    assert tokens == tokens32 and logprobs == logprobs32


def test_the_heads_product_into_a_given_buffer_is_the_linears_bits():
    # TritonOps.head: above the GEMV's rows cuBLAS (here the CPU's BLAS) writes into ``out`` itself
    from pageserve.model.triton_ops import TritonOps

    ops, g = TritonOps(), torch.Generator().manual_seed(0)
    w = torch.randn(300, 64, generator=g).to(DEVICE, torch.bfloat16)
    for rows in (1, 70):
        x = torch.randn(rows, 64, generator=g).to(DEVICE, torch.bfloat16)
        out = torch.full((rows + 2, 300), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        assert ops.head(x, w, out[:rows]).data_ptr() == out.data_ptr()
        assert torch.equal(out[:rows], ops.linear(x, w, None)) and out[rows:].isnan().all()


def test_every_bucket_writes_its_logits_into_one_shared_buffer(tiny_llm):
    # the graphs (and, on the CPU, the same code run eagerly) return views of one [max_bs, V]
    # buffer, not an output per bucket; the values are the eager forward's
    from pageserve.engine.sampling_params import SamplingParams

    graphs = tiny_llm.engine.runner.graphs
    assert graphs.logits_out.shape == (graphs.max_bs, tiny_llm.engine.runner.model.cfg.vocab_size)
    seen = []
    orig = graphs.run

    def run(*args):
        logits = orig(*args)
        seen.append((logits.data_ptr(), logits.shape[0], torch.equal(logits, graphs.eager_logits(logits.shape[0]))))
        return logits

    graphs.run = run
    try:
        tiny_llm.generate([[1, 2, 3]] * 3 + [[4, 5]] * 9, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    finally:
        del graphs.run
    assert {n for _, n, _ in seen} == {12}
    assert all(ptr == graphs.logits_out.data_ptr() for ptr, _, _ in seen)
    assert all(same for _, _, same in seen)
    if graphs.graphs:  # captured: every bucket's output is a view of the shared buffer
        assert all(t.untyped_storage().data_ptr() == graphs.logits_out.untyped_storage().data_ptr()
                   for t in graphs.logits.values())


def test_triton_options_reach_the_kernels_and_bad_ones_are_rejected():
    from pageserve.engine.model_runner import select_ops

    ops = select_ops(True, torch.device("cpu"), {"fuse_rope_kv": True, "gemv_split_k": "never"})
    assert ops.name == "triton" and ops.fuse_rope_kv and ops.gemv_split_k == "never"
    assert ops.prefill_tile_map
    assert not select_ops(True, torch.device("cpu"), {"prefill_tile_map": False}).prefill_tile_map
    assert ops.prefill_tile_order == "heavy_first"
    with pytest.raises(ValueError, match="prefill_tile_order"):
        select_ops(True, torch.device("cpu"), {"prefill_tile_order": "random"})
    with pytest.raises(ValueError, match="triton_options"):
        select_ops(True, torch.device("cpu"), {"no_such_switch": 1})


def test_int8_engines_keep_pdl_to_one_row_unless_told_otherwise():
    from pageserve.engine.model_runner import INT8_PDL_MAX_ROWS, select_ops
    from pageserve.kernels._util import PDL_MAX_TOKENS

    cpu = torch.device("cpu")
    assert select_ops(True, cpu).pdl_max_rows == PDL_MAX_TOKENS  # float weights: up to 8 rows
    assert select_ops(True, cpu, quantization="int8").pdl_max_rows == INT8_PDL_MAX_ROWS == 1
    assert select_ops(True, cpu, {"pdl_max_rows": 8}, quantization="int8").pdl_max_rows == 8  # asked: kept


def test_programmatic_dependent_launch_is_off_where_unsupported():
    from pageserve.kernels._util import use_pdl

    assert not use_pdl(torch.zeros(1), 1, pdl=True)  # asked for, but a CPU tensor (interpreter) never launches with PDL
    assert not use_pdl(torch.zeros(1, device=DEVICE), 1, pdl=False)


def test_pdl_max_rows_turns_pdl_off_above_it_and_rejects_what_pdl_never_covers():
    from pageserve.kernels._util import PDL_MAX_TOKENS
    from pageserve.model.triton_ops import TritonOps

    ops = TritonOps(pdl_max_rows=2, tuned_configs=False)
    assert [ops.pdl_for(r) for r in (1, 2, 3)] == [None, None, False]
    assert TritonOps(pdl=False, tuned_configs=False).pdl_for(1) is False
    assert TritonOps(tuned_configs=False).pdl_max_rows == PDL_MAX_TOKENS
    with pytest.raises(ValueError, match="pdl_max_rows"):
        TritonOps(pdl_max_rows=PDL_MAX_TOKENS + 1)


def _graphed_logits(cfg, pdl: bool | str, deterministic: bool = False, **options) -> tuple[list, list]:
    from pageserve.lab.bench import run_pageserve_online

    model = Decoder(cfg).to(DEVICE)
    model.init_dummy_weights(seed=3, std=0.3)
    llm = LLM.from_model(model.eval(), device=DEVICE, dtype="float32", block_size=8, num_blocks=512,
                         max_num_seqs=24, max_model_len=256, triton_options={"pdl": pdl, **options},
                         deterministic=deterministic)
    runner = llm.engine.runner
    assert runner.graphs is not None and runner.graphs.graphs  # captured with these launches
    with capture_logits(runner) as steps:
        res = run_pageserve_online(llm, staggered_decode_workload(24, vocab_size=256, seed=1))
    return [list(r["token_ids"]) for r in res.per_request], steps.logits


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs and PDL need a GPU")
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("pdl", [True, "wait_first"])
def test_pdl_launches_change_no_logit_of_a_graphed_decode_loop(tiny_qwen2_config, pdl, deterministic):
    # PDL only changes when each kernel starts: every logit of every step (batches of 1-24,
    # PDL on up to 8 rows) must be bit-identical to plain launches, with the step inputs loaded
    # before each kernel's wait (the default) or after it ("wait_first"), in both modes.
    from pageserve.kernels._util import pdl_supported

    if not pdl_supported(0):
        pytest.skip("PDL needs sm_90+")
    plain_tokens, plain = _graphed_logits(tiny_qwen2_config, pdl=False, deterministic=deterministic)
    tokens, logits = _graphed_logits(tiny_qwen2_config, pdl=pdl, deterministic=deterministic)
    assert tokens == plain_tokens
    assert len(logits) == len(plain) and all(torch.equal(a, b) for a, b in zip(logits, plain))


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs and PDL need a GPU")
@pytest.mark.parametrize("gate_up_release", ["after_loop", "top"])
def test_the_deterministic_silu_epilogue_under_pdl_changes_no_logit(tiny_qwen2_config, gate_up_release):
    # DeterministicOps' SiLU·mul epilogue under PDL, letting down launch after its K loop (the default) or at its
    # top. Only when kernels start moves, so every logit equals plain launches'; a kernel reading its input
    # before the one that writes it had finished would show here.
    from pageserve.kernels._util import pdl_supported

    if not pdl_supported(0):
        pytest.skip("PDL needs sm_90+")
    plain_tokens, plain = _graphed_logits(tiny_qwen2_config, pdl=False, deterministic=True, silu_in_gate_up_pdl=False)
    tokens, logits = _graphed_logits(tiny_qwen2_config, pdl=True, deterministic=True,
                                     gate_up_pdl_release=gate_up_release)
    assert tokens == plain_tokens
    assert len(logits) == len(plain) and all(torch.equal(a, b) for a, b in zip(logits, plain))


def test_a_one_token_prompt_chunk_that_does_not_sample_keeps_the_step_off_the_graph(tiny_qwen2_config):
    # budget 2: step 1 runs prompt A's only token (samples) and prompt B's first token (does
    # not): one token per sequence but only one sampling row. The graph computes logits for
    # every row, so it must not run such a step: with temperature sampling the sampler would
    # get 2 logits rows for 1 request (seen on the H200 in 09 at 65f7a342).
    from pageserve.engine.sampling_params import SamplingParams

    model = Decoder(tiny_qwen2_config).to(DEVICE)
    model.init_dummy_weights(seed=5, std=0.3)
    llm = LLM.from_model(model.eval(), device=DEVICE, dtype="float32", block_size=8, num_blocks=64,
                         max_num_seqs=4, max_num_batched_tokens=2, max_model_len=64, enforce_eager=True)
    llm.engine.runner.enable_graphs(capture=DEVICE == "cuda")
    runner, shapes = llm.engine.runner, []
    run_step = runner.run_step

    def recording_run_step(x, prev_tokens=None):
        logits = run_step(x, prev_tokens)
        shapes.append((x.seq_lens.shape[0], x.logits_indices.shape[0], None if logits is None else logits.shape[0]))
        return logits

    runner.run_step = recording_run_step
    params = [SamplingParams(temperature=0.8, seed=s, max_tokens=3, ignore_eos=True) for s in (1, 2)]
    outs = llm.generate([[7], [3, 4, 5]], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 3]
    assert (2, 1, 1) in shapes  # the step in question ran: 2 sequences, 1 sampling
    assert all(rows == samplers for _, samplers, rows in shapes), shapes  # one logits row per sampling sequence


@pytest.mark.skipif(DEVICE != "cuda", reason="Triton's JIT compiles only on the GPU (the CPU interpreter compiles nothing)")
def test_new_prompt_lengths_compile_no_attention_or_rope_variant_after_a_warm_up(tiny_qwen2_config):
    # Triton specialises a launch on each pointer's 16-byte alignment and on integer arguments
    # equal to 1 or divisible by 16; a step's inputs at offsets that follow its token count, or
    # the block-table width as a specialised stride, made the nano-vllm workload compile
    # `_rope_kv_kernel` and `_prefill_kernel` again mid-run on the H200 (c9b266a), ~1 s of stall
    from pageserve.lab.profiling import CompileLog

    if not CompileLog().available:
        pytest.skip("this Triton has no jit_post_compile_hook")
    cfg = dataclasses.replace(tiny_qwen2_config, head_dim=32, hidden_size=128)  # variants of its own
    model = Decoder(cfg).to(DEVICE)
    model.init_dummy_weights(seed=5, std=0.3)
    llm = LLM.from_model(model.eval(), device=DEVICE, dtype="bfloat16", block_size=8, num_blocks=512,
                         max_num_seqs=8, max_model_len=256, max_num_batched_tokens=48)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate([[5] * 16], params, use_tqdm=False)  # one 16-token chunk: an even count, a 2-block table
    with CompileLog() as log:  # odd and even chunks, tables 1 to 25 blocks wide (16 among them), decodes mixed in
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(1, 256, (n,), generator=g).tolist() for n in (3, 7, 9, 121, 17, 128, 200, 1, 45)]
        llm.generate(prompts, params, use_tqdm=False)
    compiled = log.names
    assert not [n for n in compiled if n in ("_prefill_kernel", "_rope_kv_kernel")], compiled


@pytest.mark.skipif(DEVICE != "cuda", reason="Triton's JIT compiles only on the GPU (the CPU interpreter compiles nothing)")
def test_long_prompts_compile_no_chunk_attention_variant_after_start_up(tiny_qwen2_config):
    # the engine compiles the chunk launch's two tile configs at start-up (TritonOps.warm_chunk_attention):
    # eager steps whose chunks take the 64-token tiles (two 1,100-token prompts) and the 128-token ones
    # (a 2,100-token prompt) then compile nothing; on the H200 chat's first long chunk compiled mid-run
    from pageserve.lab.profiling import CompileLog

    if not CompileLog().available:
        pytest.skip("this Triton has no jit_post_compile_hook")
    cfg = dataclasses.replace(tiny_qwen2_config, max_position_embeddings=4096)
    model = Decoder(cfg).to(DEVICE)
    model.init_dummy_weights(seed=5, std=0.3)
    llm = LLM.from_model(model.eval(), device=DEVICE, dtype="bfloat16", block_size=16, num_blocks=1024,
                         max_num_seqs=8, max_model_len=4096, max_num_batched_tokens=4096)
    ops = llm.engine.runner.ops
    if not ops.chunk_attention:
        pytest.skip("the chunk launch runs on sm_90 only")
    calls = []
    chunk = ops.chunk_kv_attention
    ops.chunk_kv_attention = lambda q, *a: calls.append(q.shape[0]) or chunk(q, *a)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    with CompileLog() as log:
        llm.generate([torch.randint(1, 256, (n,), generator=g).tolist() for n in (1100, 1100)], params, use_tqdm=False)
        llm.generate([torch.randint(1, 256, (2100,), generator=g).tolist()], params, use_tqdm=False)
    assert calls, "no step took the chunk launch"
    assert "_chunk_kernel" not in log.names, log.names
    # the same for the gate_up + SiLU·mul kernel of steps of 2,048+ rows (TritonOps.warm_gate_up_silu;
    # both prompts' steps here are 2,100-2,200 rows)
    if ops.paired_silu_rows is not None:
        assert not [n for n in log.names if "gate_up_silu" in n], log.names


# ---------------------------------------------------------------- eager steps' row buckets
def test_eager_row_buckets_keep_small_counts_and_pad_larger_ones_by_at_most_one_sixteenth():
    from pageserve.engine.model_runner import EAGER_ROWS_EXACT, eager_rows_bucket, eager_rows_buckets

    assert [eager_rows_bucket(n) for n in (1, 2, 63, 64)] == [1, 2, 63, 64]
    assert [eager_rows_bucket(n) for n in (65, 68, 69, 128, 129, 8191, 8192, 8193)] == \
        [68, 68, 72, 128, 136, 8192, 8192, 8704]
    prev = 0
    for n in range(1, 20000):
        b = eager_rows_bucket(n)
        assert n <= b <= max(n, EAGER_ROWS_EXACT) * 17 / 16 and b >= prev  # monotone, ≤ 6.25% padding
        assert eager_rows_bucket(b) == b  # a bucket is its own bucket
        prev = b
    buckets = eager_rows_buckets(8192)
    assert len(buckets) == 64 + 7 * 16 and buckets[-1] == 8192
    assert set(buckets) == {eager_rows_bucket(n) for n in range(1, 8193)}


@pytest.mark.parametrize("use_triton", [False, True], ids=["torch", "triton"])
def test_padded_eager_steps_give_the_logits_and_tokens_of_unpadded_ones(tiny_qwen2_config, monkeypatch, use_triton):
    # 90 prompts of 3..40 tokens through a budget of 97 tokens: chunked-prefill steps of 65..97
    # tokens beside decodes, row counts that pad (to 68..100), sampling rows past 64 that pad too;
    # the padded run must see the same logits in every step and write the same KV (later steps read it)
    from pageserve.engine import model_runner
    from pageserve.lab.decode_bench import capture_logits

    if use_triton and DEVICE == "cpu":
        pytest.importorskip("triton")
    model = Decoder(tiny_qwen2_config).to(DEVICE)
    model.init_dummy_weights(seed=5, std=0.3)
    # Triton's CPU interpreter takes ~5 min over that workload: there 5 prompts of 60..110 tokens
    # pad the token rows (the kernels' padding: attention's zeroed rows, no KV write), not the sampling rows
    small = use_triton and DEVICE == "cpu"
    g = torch.Generator().manual_seed(2)
    lengths = torch.randint(60, 110, (5,), generator=g) if small else torch.randint(3, 40, (90,), generator=g)
    prompts = [torch.randint(0, 256, (int(n),), generator=g).tolist() for n in lengths]
    params = SamplingParams(temperature=0.0, max_tokens=3 if small else 24, ignore_eos=True)
    padded_counts = []
    real_pad = model_runner.pad_step_rows

    def counting_pad(x):
        out = real_pad(x)
        padded_counts.append((x.num_tokens, out.num_tokens, x.logits_indices.shape[0], out.logits_indices.shape[0]))
        return out

    monkeypatch.setattr(model_runner, "pad_step_rows", counting_pad)
    runs = {}
    for buckets in (False, True):
        llm = LLM.from_model(model.eval(), device=DEVICE, dtype="float32", block_size=8, num_blocks=512,
                             max_num_seqs=90, max_num_batched_tokens=97, max_model_len=256, enforce_eager=True,
                             use_triton=use_triton, eager_row_buckets=buckets)
        assert llm.engine.runner.eager_row_buckets is buckets
        with capture_logits(llm.engine.runner) as steps:
            out = llm.generate(prompts, params)
        runs[buckets] = ([o.outputs[0].token_ids for o in out], steps.logits)
    assert any(t != pt for t, pt, _, _ in padded_counts)  # some steps really were padded
    assert small or any(s != ps for _, _, s, ps in padded_counts)  # and some sampling-row counts
    (tokens, logits), (tokens_p, logits_p) = runs[False], runs[True]
    assert tokens == tokens_p
    assert len(logits) == len(logits_p)
    for a, b in zip(logits, logits_p):
        assert a.shape == b.shape
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_warming_the_eager_gemms_calls_every_bucket_of_every_linear(tiny_qwen2_config, monkeypatch, quantization):
    from pageserve.engine.model_runner import eager_rows_buckets

    model = Decoder(tiny_qwen2_config).to(DEVICE)
    model.init_dummy_weights(seed=5, std=0.3)
    llm = LLM.from_model(model.eval(), device=DEVICE, dtype="float32", block_size=8, num_blocks=64, max_num_seqs=70,
                         max_num_batched_tokens=150, max_model_len=128, enforce_eager=True, quantization=quantization,
                         eager_row_buckets=True)
    runner = llm.engine.runner
    calls = []
    real_linear = runner.ops.linear
    monkeypatch.setattr(runner.ops, "linear", lambda x, w, b: calls.append((x.shape[0], tuple(w.shape))) or real_linear(x, w, b))
    assert runner.warm_eager_gemms() >= 0
    cfg = tiny_qwen2_config
    rows, head_rows = eager_rows_buckets(150), eager_rows_buckets(70)
    assert rows[-1] == 152 and head_rows[-1] == 72
    shapes = [(cfg.q_size + 2 * cfg.kv_size, cfg.hidden_size), (cfg.hidden_size, cfg.q_size),
              (2 * cfg.intermediate_size, cfg.hidden_size), (cfg.hidden_size, cfg.intermediate_size)]
    assert calls == [(m, s) for s in shapes for m in rows] + [(m, (cfg.vocab_size, cfg.hidden_size)) for m in head_rows]


# ---------------------------------------------------------------- mixed steps from CUDA graphs
def test_mixed_buckets_cover_every_token_count_with_at_most_an_eighth_of_padding_past_128():
    from pageserve.engine.mixed_graphs import mixed_bucket_sizes

    for cap in (16, 100, 128, 2048, 2000):
        b = mixed_bucket_sizes(cap)
        assert b[-1] == cap and b == sorted(set(b)) and b[0] == min(16, cap)
        for n in range(1, cap + 1):
            t = b[bisect.bisect_left(b, n)]
            assert n <= t <= max(n + 15, n * 9 / 8 + 1)
    assert len(mixed_bucket_sizes(2048)) == 8 + 4 * 8


@pytest.mark.parametrize("use_triton, quantization", [(False, None), (True, None), (True, "int8")],
                         ids=["torch", "triton", "triton_int8"])
def test_mixed_steps_through_the_graph_runner_match_eager_ones(tiny_qwen2_config, use_triton, quantization):
    # the same chunked workload as the padding test, eager and through the mixed-step runner's
    # static buffers (graphs on CUDA, the same buffers run eagerly on the CPU): the same logits in
    # every sampling step and the same tokens; the runner must really have run the mixed steps.
    # int8 weights too: their mixed steps take every int8 path (GEMV rows, dequantize + cuBLAS above 64)
    from pageserve.lab.decode_bench import capture_logits

    small = use_triton and DEVICE == "cpu"
    model = Decoder(tiny_qwen2_config).to(DEVICE)
    model.init_dummy_weights(seed=5, std=0.3)
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(20, 70, (4,), generator=g) if small else torch.randint(3, 40, (40,), generator=g)
    prompts = [torch.randint(0, 256, (int(n),), generator=g).tolist() for n in lengths]
    params = SamplingParams(temperature=0.0, max_tokens=3 if small else 16, ignore_eos=True)
    runs = {}
    for mixed in (False, True):
        llm = LLM.from_model(model.eval(), device=DEVICE, dtype="float32", block_size=8, num_blocks=512,
                             max_num_seqs=40, max_num_batched_tokens=61, max_model_len=256, enforce_eager=True,
                             use_triton=use_triton, quantization=quantization)  # int8: quantized in place, once
        runner = llm.engine.runner
        used = []
        if mixed:
            assert runner.mixed_graphs_supported() == use_triton
            # the reference ops read host copies of lengths (a sync): captured only with the kernels
            runner.enable_mixed_graphs(capture=DEVICE == "cuda" and use_triton)
            real_run = runner.mixed_graphs.run
            runner.mixed_graphs.run = lambda x, d, ids: used.append(x.num_tokens) or real_run(x, d, ids)
        with capture_logits(runner) as steps:
            out = llm.generate(prompts, params)
        runs[mixed] = ([o.outputs[0].token_ids for o in out], steps.logits, used)
    (tokens, logits, _), (tokens_m, logits_m, used) = runs[False], runs[True]
    assert len(used) >= 3 and any(n not in (16, 32, 48, 61) for n in used)  # steps off the buckets, padded
    assert tokens == tokens_m and len(logits) == len(logits_m)
    for a, b in zip(logits, logits_m):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


def test_deterministic_mixed_steps_through_the_graph_runner_keep_the_eager_steps_bits(tiny_qwen2_config, monkeypatch):
    # the deterministic ops' mixed steps from the runner's static tile maps (graphs on CUDA, the same buffers run
    # eagerly on the CPU) against their eager steps: the same bits in every sampling step (the mode's promise:
    # the bucket's padding and the static maps' sentinel tiles change no real row), the runner really used, and
    # off when DeterministicOps.mixed_graphs is (on by default). With tall prefill tiles (Hopper's "auto", forced here on
    # the CPU) the attention reads three maps: small tiles for decodes, tall ones for chunks, and the merge's
    from pageserve.lab.decode_bench import capture_logits
    from pageserve.model.deterministic_ops import DeterministicOps

    model = Decoder(tiny_qwen2_config).to(DEVICE)
    model.init_dummy_weights(seed=5, std=0.3)
    g = torch.Generator().manual_seed(3)
    small = DEVICE == "cpu"
    lengths = torch.randint(20, 70, (4,), generator=g) if small else torch.randint(3, 40, (40,), generator=g)
    prompts = [torch.randint(0, 256, (int(n),), generator=g).tolist() for n in lengths]
    params = SamplingParams(temperature=0.0, max_tokens=3 if small else 16, ignore_eos=True)
    runs = {}
    monkeypatch.setattr(DeterministicOps, "mixed_graphs", False)  # the eager side first (the switch off)
    for mixed, tall in ((False, 64), (True, 64), (True, None)):
        llm = LLM.from_model(model.eval(), device=DEVICE, dtype="float32", block_size=8, num_blocks=512,
                             max_num_seqs=40, max_num_batched_tokens=61, max_model_len=256, enforce_eager=True,
                             use_triton=True, deterministic=True,
                             triton_options={"attention_prefill_block_m": tall} if small else {})
        runner = llm.engine.runner
        assert runner.ops.name == "deterministic" and not runner.mixed_graphs_supported()
        used = []
        if mixed:
            monkeypatch.setattr(DeterministicOps, "mixed_graphs", True)
            assert runner.mixed_graphs_supported()
            runner.enable_mixed_graphs(capture=DEVICE == "cuda")
            assert len(runner.mixed_graphs.maps) == (3 if runner.ops.prefill_block_m_for(runner.device) else 1)
            real_run = runner.mixed_graphs.run
            runner.mixed_graphs.run = lambda x, d, ids: used.append(x.num_tokens) or real_run(x, d, ids)
            monkeypatch.setattr(DeterministicOps, "mixed_graphs", False)
        with capture_logits(runner) as steps:
            out = llm.generate(prompts, params)
        runs[mixed, tall] = ([o.outputs[0].token_ids for o in out], steps.logits, used)
    tokens, logits, _ = runs[False, 64]
    for key in ((True, 64), (True, None)) if small else ((True, 64),):
        tokens_m, logits_m, used = runs[key]
        assert len(used) >= 3 and any(n not in (16, 32, 48, 61) for n in used)  # steps off the buckets, padded
        assert tokens == tokens_m and len(logits) == len(logits_m)
        if key[1] == 64 or not small:  # the same tiles: the same bits (other tile heights give other bits)
            for a, b in zip(logits, logits_m):
                assert torch.equal(a, b)


def test_mixed_graph_options_are_validated_and_their_defaults_are_the_measured_ones():
    from pageserve.engine.config import EngineConfig

    c = EngineConfig(device="cpu")
    assert c.mixed_cuda_graphs is True and c.eager_row_buckets is None  # None: the ops decide (off by default)
    with pytest.raises(ValueError, match="mixed_graph_max_tokens"):
        EngineConfig(device="cpu", mixed_graph_max_tokens=0)


def test_explicit_graph_sizes_replace_the_default_buckets_and_are_checked():
    from pageserve.engine.config import EngineConfig
    from pageserve.serve.cli import _int_list

    assert bucket_sizes(64, [48, 8, 8, 1, 200]) == [1, 8, 48]  # sorted, deduplicated, capped at max_bs
    with pytest.raises(ValueError, match="no CUDA graph size"):
        bucket_sizes(4, [8, 16])
    assert EngineConfig(cuda_graph_sizes=[16, 4, 4]).cuda_graph_sizes == [4, 16]
    for bad in ([], [0, 4], [2.5], "8,16", [True]):
        with pytest.raises(ValueError, match="cuda_graph_sizes"):
            EngineConfig(cuda_graph_sizes=bad)
    assert _int_list("1,2, 8") == [1, 2, 8] and _int_list("[4,16]") == [4, 16]


def test_graph_runner_captures_the_configured_sizes(tiny_qwen2_config):
    _, llm = _staggered_llm(tiny_qwen2_config, cuda_graph_sizes=[3, 6, 12])
    runner = llm.engine.runner
    runner.enable_graphs(capture=DEVICE == "cuda")
    assert runner.graphs.buckets == [3, 6, 12] and runner.graphs.max_bs == 12
    assert runner.graphs.can_run(12, True) and not runner.graphs.can_run(13, True)  # 13-24 rows: eager
    check = graph_vs_eager(llm, staggered_decode_workload(24, vocab_size=256, seed=1))
    assert check.graphed_steps > 10
    assert check.identical and check.max_logit_rel_err < 1e-5


class _TwoClassOps:
    """Wraps an ops object: decode steps in two context classes (up to ``limit`` tokens, then
    any), and a log of each decode attention call's (rows, max_seq_len, longest real context)."""

    def __init__(self, ops, limit: int) -> None:
        self._ops, self.limit, self.calls = ops, limit, []

    def __getattr__(self, name):
        return getattr(self._ops, name)

    def decode_context_limits(self):
        return (self.limit, None)

    def paged_attention(self, q, k_cache, v_cache, meta, scale):
        if meta.max_query_len == 1 and not (q.is_cuda and torch.cuda.is_current_stream_capturing()):
            self.calls.append((q.shape[0], meta.max_seq_len, int(meta.seq_lens.max())))  # (a host sync)
        return self._ops.paged_attention(q, k_cache, v_cache, meta, scale)


def test_decode_graphs_replay_the_context_class_of_the_step(tiny_qwen2_config):
    # one graph per (bucket, context class): a step replays the first class that holds its longest
    # context, so every class sees only contexts within its limit; the tokens and logits are eager's
    from pageserve.engine.cuda_graphs import CUDAGraphRunner

    model, llm = _staggered_llm(tiny_qwen2_config)
    runner = llm.engine.runner
    ops = _TwoClassOps(runner.ops, limit=48)
    model.set_ops(ops)
    try:
        runner.graphs = CUDAGraphRunner(model, runner.kv_cache, 24, runner.max_blocks_per_seq(),
                                        capture=DEVICE == "cuda")
        runner.graphs.capture()
        assert runner.graphs.context_limits == (48, None)
        assert len(runner.graphs.keys()) == 2 * len(runner.graphs.buckets)
        assert runner.graphs.key_for(3, 48) == (4, 0) and runner.graphs.key_for(3, 49) == (4, 1)
        assert runner.graphs.key_for(3) == (4, 1)
        short_table = CUDAGraphRunner(model, runner.kv_cache, 4, 6, capture=False)  # 48 tokens: one class
        assert short_table.context_limits == (None,) and short_table.key_for(3, 40) == (4, 0)
        keys = []
        run = runner.graphs.run

        def logged(*args):
            out = run(*args)
            keys.append(runner.graphs.last_key)
            return out

        runner.graphs.run = logged
        ops.calls.clear()
        # short prompts: the first graphed steps' contexts are within 48 tokens, the later ones past it
        check = graph_vs_eager(llm, staggered_decode_workload(24, vocab_size=256, max_prompt=12, seed=1))
    finally:
        model.set_ops(ops._ops)
    assert check.identical and check.max_logit_rel_err < 1e-5 and check.max_unpadded_logit_rel_err < 1e-5
    assert {c for _, c in keys} == {0, 1}  # both classes replayed
    if DEVICE == "cpu":  # run eagerly on the static buffers: each call shows its class's limit
        graphed = [(m, real) for _, m, real in ops.calls if m in (48, runner.graphs.max_seq_len)]
        assert any(m == 48 for m, _ in graphed) and all(real <= m for m, real in graphed)


def test_decode_schedule_by_context_picks_the_launch_from_the_longest_context():
    from pageserve.kernels.paged_decode import pipelined_device
    from pageserve.model.triton_ops import DECODE_SHORT_CONTEXT, TritonOps

    auto = TritonOps(tuned_configs=False)  # "auto": by context where the pipelined launch runs (sm_90)
    assert auto.decode_schedule == ("by_context" if pipelined_device() else "split")
    ops = TritonOps(tuned_configs=False, decode_schedule="by_context", decode_short_context=100)
    assert ops.decode_context_limits() == (100, None)
    assert [ops.decode_schedule_for(n) for n in (1, 100, 101, None)] == ["pipelined", "pipelined", "split", "split"]
    split = TritonOps(tuned_configs=False, decode_schedule="split")
    assert split.decode_context_limits() == (None,) and split.decode_schedule_for(10) == "split"
    assert TritonOps(tuned_configs=False, decode_schedule="by_context").decode_short_context == DECODE_SHORT_CONTEXT
    for bad in (0, -5, 1.5):
        with pytest.raises(ValueError, match="decode_short_context"):
            TritonOps(tuned_configs=False, decode_short_context=bad)
    with pytest.raises(ValueError, match="decode_schedule"):
        TritonOps(tuned_configs=False, decode_schedule="fast")


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs of both context classes need a GPU")
def test_graphed_decode_loop_by_context_matches_eager(tiny_qwen2_config):
    # the real thing on the GPU: TritonOps by context (short limit 48), both classes captured and replayed,
    # in bf16 (the pipelined launch needs 2-byte K/V: in fp32 both classes would run the split rule)
    _, llm = _staggered_llm(tiny_qwen2_config, dtype="bfloat16", enforce_eager=False,
                            triton_options={"decode_schedule": "by_context", "decode_short_context": 48})
    graphs = llm.engine.runner.graphs
    assert graphs.context_limits == (48, None) and len(graphs.graphs) == 2 * len(graphs.buckets)
    seen = set()
    run = graphs.run

    def logged(*args):
        out = run(*args)
        seen.add(graphs.last_key[1])
        return out

    graphs.run = logged
    check = graph_vs_eager(llm, staggered_decode_workload(24, vocab_size=256, max_prompt=12, seed=1))
    assert seen == {0, 1} and check.graphed_steps > 20
    # a replay equals the same step recomputed eagerly on its buffers and class; the unpadded batch differs by
    # batch-dependent launches (GEMM algorithms, attention splits), at bf16's rounding
    assert check.max_logit_rel_err < 1e-5 and check.max_unpadded_logit_rel_err < 3e-2


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs on the GPU")
@pytest.mark.parametrize("gate_up_silu_rows", [(2, 64), (2, 8)])
def test_graphed_decode_loop_with_split_to_norm_matches_eager(tiny_qwen2_config, gate_up_silu_rows):
    # TritonOps(split_to_norm=): o and down as K slices (one batched cuBLAS call each, fp32 outputs) summed by the
    # add + RMSNorm after them in 2-24 row steps, captured and replayed in bf16: a replay equals the same step
    # recomputed eagerly on its buffers. With the gate_up epilogue at 2-8 rows only, the 9-24 row steps take the
    # SiLU·mul kernel before down's slices (the default's path at 65-256 rows on Hopper)
    _, llm = _staggered_llm(tiny_qwen2_config, dtype="bfloat16", enforce_eager=False,
                            triton_options={"split_to_norm_rows": (2, 64), "split_to_norm": {"o": 2, "down": 4},
                                            "gate_up_silu_rows": gate_up_silu_rows})
    check = graph_vs_eager(llm, staggered_decode_workload(24, vocab_size=256, seed=1))
    assert check.graphed_steps > 20
    assert check.max_logit_rel_err < 1e-5 and check.max_unpadded_logit_rel_err < 3e-2
