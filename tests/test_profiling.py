"""lab.profiling: kernel names land in the right phase, and the floors' arithmetic."""
import os
import pytest

from pageserve.lab.peers import kv_bytes, weight_bytes
from pageserve.engine.llm_engine import StepTiming
from pageserve.lab.profiling import (CATEGORIES, KernelRow, by_category, decode_bytes, decode_gaps, gpu_idle_fraction,
                                     idle_us, kernel_category, linear_flops, mean_step_timing, phase_rows,
                                     prefill_attention_flops)
from pageserve.model.config import ModelConfig


def _script(name: str):
    """A module of scripts/ (not a package), imported by name."""
    import importlib
    import sys
    from pathlib import Path

    path = str(Path(__file__).resolve().parents[1] / "scripts")
    if path not in sys.path:
        sys.path.insert(0, path)
    return importlib.import_module(name)


@pytest.mark.parametrize("name, category", [
    ("nvjet_sm90_tst_168x64_64x7_2x1_v_bz_TNN", "gemm"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>", "gemm"),
    ("_gemv_kernel", "gemm"), ("_matmul_invariant_kernel", "gemm"), ("_gemm_int8_kernel", "gemm"),
    ("_decode_split_kernel", "attention"), ("_decode_merge_kernel", "attention"),
    ("_paged_prefill_kernel", "attention"), ("_paged_invariant_kernel", "attention"),
    ("_prefill_kernel", "attention"), ("_chunk_kernel", "attention"), ("_split_kernel", "attention"), ("_merge_kernel", "attention"),
    ("_rms_norm_kernel", "norm"), ("_add_rms_norm_kernel", "norm"),
    ("_rope_kv_kernel", "rope_kv"), ("_kv_write_kernel", "rope_kv"), ("_write_kv_kernel", "rope_kv"),
    ("_dequant_kernel", "gemm"),
    ("_silu_and_mul_kernel", "activation"),
    ("_gate_up_silu_tma_kernel", "gemm"), ("_gate_up_silu_persistent_kernel", "gemm"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float>", "sampling"),
    ("void at::native::reduce_kernel<512, 1, ArgMaxOps<float>>", "sampling"),
    ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda>", "copy"),
    ("memcpy32_post", "copy"), ("Memset (Unknown)", "copy"),
    ("some_new_kernel", "other"),
])

def test_kernel_names_fall_into_their_phase(name, category):
    assert kernel_category(name) == category


def test_by_category_sums_per_phase_and_lists_every_phase():
    rows = [KernelRow("_gemv_kernel", 10.0, 4), KernelRow("nvjet_x", 5.0, 1), KernelRow("_rms_norm_kernel", 2.0, 2)]
    cats = by_category(rows)
    assert set(cats) == set(CATEGORIES)
    assert cats["gemm"] == 15.0 and cats["norm"] == 2.0 and cats["attention"] == 0.0
    table = phase_rows(cats, {"gemm": 7.5})
    assert [r["phase"] for r in table] == ["gemm", "norm"]  # phases that ran, largest first
    assert table[0]["fraction"] == pytest.approx(0.5) and table[1]["fraction"] is None


def test_flops_and_bytes_of_the_qwen3b_shape():
    c = ModelConfig.shipped("qwen2.5-3b")
    # qkv 2560x2048 + o 2048x2048 + gate_up 22016x2048 + down 2048x11008 per layer, 36 layers
    per_token = 36 * (2560 * 2048 + 2048 * 2048 + 22016 * 2048 + 2048 * 11008)
    assert linear_flops(c, 1) == 2 * per_token
    assert linear_flops(c, 10, sampled_rows=2) == 2 * (10 * per_token + 2 * 151936 * 2048)
    # causal attention of one 4-token prompt: 10 visible (query, key) pairs, QK^T and PV
    assert prefill_attention_flops(c, 4) == 2 * 2 * 10 * 128 * 16 * 36
    assert decode_bytes(c, 3, 100) == weight_bytes(c) + 3 * kv_bytes(c, 100)
    assert decode_bytes(c, 1, 0, weights=1.0) == 1.0
    assert 6.0e9 < weight_bytes(c) < 6.4e9  # the 6.17 GB a bf16 step reads


def test_idle_time_is_wall_minus_kernels_clamped_and_flagged_when_kernels_overlap():
    assert idle_us(3300.0, 3182.0) == (pytest.approx(118.0), False)
    # batch 1 on the H200: the graph's kernels sum past the replay (PDL overlaps them)
    assert idle_us(2100.0, 3093.0) == (0.0, True)


def test_decode_gaps_split_a_step_into_graph_kernels_gaps_and_the_outside_in_microseconds():
    # step 3.4 ms, replay 3.3 ms (both ms), graph kernels 3182 us, all of a step's kernels 3232 us
    g = decode_gaps(3.4, 3.3, 3182.0, step_kernel_us=3232.0)
    assert g["in_graph_gap_us"] == pytest.approx(118.0) and g["kernels_overlap"] is False
    assert g["outside_graph_us"] == pytest.approx(100.0)
    assert g["outside_graph_kernel_us"] == pytest.approx(50.0) and g["outside_graph_idle_us"] == pytest.approx(50.0)
    # the pieces add back up to the step
    assert 3182.0 + g["in_graph_gap_us"] + g["outside_graph_kernel_us"] + g["outside_graph_idle_us"] == \
        pytest.approx(3400.0)
    g = decode_gaps(2.2, 2.1, 3093.0)  # overlapping kernels: no gap to report; no step profile: no split
    assert g["in_graph_gap_us"] == 0.0 and g["kernels_overlap"] is True
    assert g["outside_graph_us"] == pytest.approx(100.0) and "outside_graph_idle_us" not in g
    assert decode_gaps(2.0, 2.1, 1500.0)["outside_graph_us"] == pytest.approx(-100.0)  # signed: noise shows


def test_gpu_idle_fraction_compares_kernel_microseconds_with_a_millisecond_wall():
    assert gpu_idle_fraction(30_000.0, 40.0) == pytest.approx(0.25)
    assert gpu_idle_fraction(50_000.0, 40.0) == 0.0  # overlapping kernels: clamped


def test_mean_step_timing_averages_the_engines_step_timings_in_microseconds():
    steps = [StepTiming(total_s=4e-3, sched_s=1e-4, launch_s=3e-4, wait_s=3e-3, post_s=2e-4),
             StepTiming(total_s=6e-3, sched_s=3e-4, launch_s=5e-4, wait_s=4e-3, post_s=4e-4)]
    m = mean_step_timing(steps)
    assert m["steps"] == 2
    assert m["total_us"] == pytest.approx(5000.0) and m["wait_us"] == pytest.approx(3500.0)
    assert m["sched_us"] == pytest.approx(200.0) and m["launch_us"] == pytest.approx(400.0)
    assert m["post_us"] == pytest.approx(300.0)
    assert m["host_busy_us"] == pytest.approx(1500.0)  # total - wait
    assert mean_step_timing([]) == {"steps": 0}


def test_the_gpu_profile_script_runs_end_to_end_on_the_cpu(tmp_path):
    # the CPU has no kernels to count: this catches the script's own mistakes before a GPU session
    import json

    profile_steps = _script("profile_steps")

    profile_steps.main(["--out", str(tmp_path), "--device", "cpu", "--model", "smollm2-135m", "--modes",
                        "default,int8,deterministic,default", "--batches", "1", "--context", "4", "--prefill-prompts", "1",
                        "--prefill-len", "4", "--max-model-len", "32", "--decode-steps", "2",
                        "--mixed-decodes", "2", "--mixed-prefill-tokens", "12", "--mixed-prompt-len", "8",
                        "--mixed-steps", "2", "--mixed-host-steps", "1"])
    rec = json.loads((tmp_path / "profile_steps.json").read_text())
    # a repeated mode (an A/B/A/B) keeps both records
    assert set(rec["modes"]) == {"default", "int8", "deterministic", "default#4"} and "git_commit" in rec
    for mode in rec["modes"].values():
        decode = mode["decode"]["1"]
        assert decode["step_ms"] > 0 and decode["host"]["steps"] == 2 and decode["host"]["host_busy_us"] > 0
        assert mode["prefill"]["tokens"] == 4 and mode["prefill"]["floors_us"]["gemm"] > 0
        mixed = mode["mixed"]
        assert set(mixed["execute_segments_ms"]) == {"prepare_inputs", "to_device", "forward", "compute_logits", "sample"}
        assert mixed["execute_segments_ms"]["forward"] > 0
        assert mixed["host_profile"]["steps"] == 1 and any("execute" in line for line in mixed["host_profile"]["top"]["cumulative"])
        # 2 decodes + 12 prompt tokens (an 8-token prompt and a chunk of the next) in every timed step
        assert mixed["prefill_tokens"] == 12 and mixed["scheduled_tokens"] == 14
        assert mixed["step_ms"] > 0 and mixed["host"]["steps"] == 2


class Ev:
    """A completed CUDA event at time t (ms), for the scripts' GPU-clock arithmetic."""

    def __init__(self, t):
        self.t = t

    def elapsed_time(self, later):
        return later.t - self.t


def test_step_timeline_splits_each_step_and_the_idle_between_steps_on_the_gpu_clock():
    step_timeline = _script("step_timeline")

    # step 1: copies 0.1 ms, replay 6.8, sampler 0.1; the GPU then waits 2.2 ms for step 2
    marks = [(Ev(0.0), Ev(0.1), Ev(6.9), Ev(7.0)), (Ev(9.2), Ev(9.25), Ev(16.05), Ev(16.1))]
    parts = step_timeline.gpu_parts(marks)
    assert parts["copy_us"] == pytest.approx([100, 50]) and parts["replay_us"] == pytest.approx([6800, 6800])
    assert parts["sample_us"] == pytest.approx([100, 50]) and parts["idle_us"] == pytest.approx([2200])


def test_step_timeline_refuses_an_unknown_mode_before_it_loads_a_model():
    step_timeline = _script("step_timeline")
    for bad in ("greedy", "sampled/torchnone"):  # not a mode; not a variant
        with pytest.raises(SystemExit):
            step_timeline.main(["--out", "unused", "--modes", f"plain,{bad}"])


def test_decoding_batch_samples_as_asked():
    from pageserve.engine.llm import LLM
    from pageserve.lab.decode_bench import decoding_batch

    llm = LLM("smollm2-135m", dtype="float32", device="cpu", seed=0, max_num_seqs=2, max_model_len=128)
    asked = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
    for sampling, want in ((None, (0.0, 1.0)), (asked, (0.7, 1.05))):
        with decoding_batch(llm, 2, 8, 4, sampling=sampling) as d:
            seqs = [s for rid in d.ids for s in llm.engine.requests[rid].seqs]
            assert len(seqs) == 2
            assert all((s.params.temperature, s.params.repetition_penalty) == want for s in seqs)
            assert all(s.params.ignore_eos for s in seqs)
        while llm.engine.has_unfinished_requests():
            llm.engine.step()


def test_replay_probe_variants_launch_on_the_logits_and_give_the_sampler_its_kernels_back():
    import torch

    from pageserve.engine.sampler import Sampler

    probe = _script("replay_after_probe")
    sampler = Sampler(64, torch.device("cpu"))
    sampler.topk_select, sampler.candidate_race = "pick", "race"  # stand-ins: the variants must put them back
    logits = torch.randn(3, 64)
    for variant in ("none", "greedy", "sampled/torchall", "greedy+tiny", "sampled/torchall+nopdl"):
        launch, kernels = probe.after_replay(sampler, variant, logits)
        assert kernels == ("pick", "race")
        if "/torchall" in variant:
            assert sampler.topk_select is None and sampler.candidate_race is None
        sampler.topk_select, sampler.candidate_race = kernels
        if variant.startswith("sampled"):
            sampler.topk_select = sampler.candidate_race = None
            launch()  # the CPU sampler's torch path, on the probe's logits
            sampler.topk_select, sampler.candidate_race = kernels
        else:
            launch()
    for bad in ("bogus", "greedy+huge"):
        with pytest.raises(ValueError):
            probe.after_replay(sampler, bad, logits)
    with pytest.raises(SystemExit):  # refused before a model is loaded
        probe.main(["--out", "unused", "--targets", "graph,prefill"])


def test_w1_profile_splits_gpu_time_and_idle_by_step_kind():
    w1_profile = _script("w1_profile")

    # an eager mixed step (80 ms), the GPU idle 6 ms, a graphed decode (9 ms), idle 0, another decode
    marks = [(Ev(0), Ev(80), False), (Ev(86), Ev(95), True), (Ev(95), Ev(104), True)]
    split = w1_profile.idle_split(marks)
    assert split["eager"] == {"steps": 1, "gpu_ms": 80, "idle_before_ms": 0.0}
    assert split["decode"] == {"steps": 2, "gpu_ms": 18, "idle_before_ms": 6}
    # with (rows, context, host ms): the host's time inside execute, summed per kind
    marks = [(Ev(0), Ev(80), False, 300, 500, 75.0), (Ev(86), Ev(95), True, 300, 501, 0.5),
             (Ev(95), Ev(104), True, 300, 502, 0.25)]
    split = w1_profile.idle_split(marks)
    assert split["eager"]["host_ms"] == 75 and split["decode"]["host_ms"] == 0.75
    assert w1_profile.decode_bands(marks)[0]["steps"] == 2


def test_w1_profile_groups_decode_steps_by_rows():
    w1_profile = _script("w1_profile")

    # (start, end, graphed, rows, mean context): one row, two steps of 60/64 rows, an eager step that is not counted
    marks = [(Ev(0), Ev(2), True, 1, 500), (Ev(2), Ev(5), True, 64, 700), (Ev(5), Ev(20), False, 100, 300),
             (Ev(20), Ev(25), True, 60, 900)]
    bands = w1_profile.decode_bands(marks)
    assert [b["rows"] for b in bands] == ["1", "33-64"]
    assert bands[1]["steps"] == 2 and bands[1]["gpu_ms"] == 8 and bands[1]["ms_per_step"] == 4
    assert bands[1]["mean_rows"] == 62 and bands[1]["mean_context"] == 800


def test_workload_bound_adds_the_gemms_as_measured_to_the_attentions_floor():
    from pageserve.lab.profiling import workload_bound

    floor = {"linear_flops": 700e12, "kv_read_bytes": 4.0e12, "prompt_attention_flops": 70e12}
    kernel_s = {"gemm": 2.0, "attention": 1.5, "norm": 0.25, "other": 0.25}
    b = workload_bound(kernel_s, floor, read_gbps=4000.0, matmul_tflops=700.0)
    assert b["gemm_tflops"] == pytest.approx(350.0) and b["gemm_ceiling_fraction"] == pytest.approx(0.5)
    assert b["gemm_floor_s"] == pytest.approx(1.0)
    assert b["attention_floor_s"] == pytest.approx(1.0 + 0.1)  # 4 TB at 4 TB/s, 70 TFLOP at 700 TFLOP/s
    assert b["other_s"] == pytest.approx(0.5) and b["bound_s"] == pytest.approx(2.0 + 1.1)
    none = workload_bound({"gemm": 0.0}, floor, 4000.0, 700.0)  # a CPU run: no kernels counted
    assert none["gemm_tflops"] is None and none["gemm_ceiling_fraction"] is None
    assert none["bound_s"] == none["attention_floor_s"]


def test_gpu_gaps_sum_the_idle_time_between_kernels_and_name_their_neighbours():
    from pageserve.lab.profiling import gpu_gaps

    us = 1000  # ns
    # a [0, 10) b [5, 12) overlapping; idle 3 us; c [15, 20); idle 500 us; d [520, 530); idle 1 us; e [531, 532)
    ev = [(15 * us, 20 * us, "c"), (0, 10 * us, "a"), (5 * us, 12 * us, "b"), (520 * us, 530 * us, "d"),
          (531 * us, 532 * us, "e")]
    g = gpu_gaps(ev)
    assert g["span_s"] == pytest.approx(532e-6) and g["busy_s"] == pytest.approx((12 + 5 + 10 + 1) * 1e-6)
    assert g["idle_s"] == pytest.approx(504e-6)
    assert g["by_length_s"]["<2us"] == pytest.approx(1e-6) and g["by_length_s"]["2-10us"] == pytest.approx(3e-6)
    assert g["by_length_s"]["100-1000us"] == pytest.approx(500e-6) and g["by_length_s"][">1000us"] == 0.0
    assert g["after"][0] == ["c", pytest.approx(500e-6)] and ["b", pytest.approx(3e-6)] in g["after"]
    assert g["before"][0] == ["d", pytest.approx(500e-6)]
    assert gpu_gaps([])["idle_s"] == 0.0


def test_w1_profile_kernel_pass_runs_a_workload_under_the_profiler(tmp_path, tiny_qwen2_config):
    import json

    from pageserve.engine.llm import LLM
    from pageserve.lab.hf_reference import hf_config_dict
    from pageserve.lab.peers import WorkloadSpec

    w1_profile = _script("w1_profile")
    tiny_model_json = str(tmp_path / "tiny.json")
    (tmp_path / "tiny.json").write_text(json.dumps(hf_config_dict(tiny_qwen2_config)))
    llm = LLM(f"dummy:{tiny_model_json}", dtype="float32", device="cpu", seed=0, num_blocks=64)
    spec = WorkloadSpec("w1", {"num_requests": 3, "prompt_len": 8, "output_len": 3})
    w = spec.build(llm.engine.model_config.vocab_size)
    k = w1_profile.kernel_pass(llm, w, tiny_model_json, {"read_gbps": 100.0, "matmul_bf16_tflops": 1.0})
    llm.shutdown()
    assert k["output_tokens"] == k["requested_output_tokens"] == 9 and k["prompt_tokens"] == 24
    assert set(k["kernel_s"]) == set(CATEGORIES) and k["kernel_total_s"] == 0.0  # the CPU launches no CUDA kernel
    assert k["floor"]["kv_read_bytes"] > 0 and k["bound"]["bound_s"] == k["bound"]["attention_floor_s"] > 0
    assert k["gaps"]["idle_s"] == 0.0  # no device events on the CPU


def test_compile_log_records_triton_compiles_while_active_and_restores_the_hook():
    from types import SimpleNamespace

    from pageserve.lab.profiling import CompileLog

    log = CompileLog()
    if not log.available:
        pytest.skip("this Triton has no jit_post_compile_hook")
    import triton

    knobs = triton.knobs.runtime
    before = knobs.jit_post_compile_hook
    with log:  # what Triton's JIT calls after compiling a kernel
        knobs.jit_post_compile_hook(fn=SimpleNamespace(name="_prefill_kernel"), key="k", repr="r")
        knobs.jit_post_compile_hook(fn=SimpleNamespace(name="_prefill_kernel"))
    assert knobs.jit_post_compile_hook is before
    assert log.summary() == {"available": True, "compiles": 2, "by_kernel": {"_prefill_kernel": 2}}


def test_clock_log_summarises_the_polled_clock():
    from pageserve.lab.profiling import ClockLog

    log = ClockLog.__new__(ClockLog)  # no polling: the summary of given samples
    log.mhz = [1980, 1700, 1230, 1850, 1980, 1980, 1900, 1660, 1980, 1980]
    s = log.summary()
    assert s["samples"] == 10 and s["min_mhz"] == 1230 and s["max_mhz"] == 1980 and s["p10_mhz"] == 1660
    assert s["mean_mhz"] == sum(log.mhz) / 10
    log.mhz = []
    assert log.summary()["mean_mhz"] is None


def test_mixed_batch_schedules_every_decode_and_exactly_the_prompt_tokens_asked():
    from pageserve.engine.llm import LLM
    from pageserve.lab.decode_bench import mixed_batch, mixed_step_ms, record_step_timings

    llm = LLM("smollm2-135m", device="cpu", dtype="float32", seed=0, num_blocks=128, max_model_len=64,
              max_num_batched_tokens=48, max_num_seqs=16)
    engine = llm.engine
    with mixed_batch(llm, 3, 6, 10, prompt_len=4, max_steps=4, vocab_size=256) as batch:
        assert engine.scheduler.max_num_batched_tokens == 13
        with record_step_timings(engine) as rec:
            for _ in range(4):
                batch.step()
    # 3 decodes + 10 prompt tokens (4-token prompts: two whole and a chunk of a third) in every step
    assert [t.num_tokens for t in rec.steps] == [13] * 4
    assert engine.scheduler.max_num_batched_tokens == 48 and not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert mixed_step_ms(llm, 2, 5, 6, prompt_len=4, steps=2, vocab_size=256, repeats=1) > 0
    with pytest.raises(ValueError, match="no prompt tokens"):
        mixed_batch(llm, 48, 5, 6)


def test_w1_profile_summarises_both_graph_runners_and_none_where_nothing_was_captured():
    from types import SimpleNamespace as NS

    w1_profile = _script("w1_profile")
    decode = NS(buckets=[1, 2, 4], max_bs=4, capture_s=1.5, capture_bytes=3 * 2**20)
    mixed = NS(buckets=[16, 32], max_tokens=32, capture_s=None, capture_bytes=None)  # built, not captured (CPU)
    llm = NS(engine=NS(runner=NS(graphs=decode, mixed_graphs=mixed)))
    assert w1_profile.graphs_summary(llm) == {
        "decode": {"buckets": 3, "max_bs": 4, "capture_s": 1.5, "capture_mib": 3.0}, "mixed": None}
    llm.engine.runner.graphs = None  # enforce_eager
    assert w1_profile.graphs_summary(llm)["decode"] is None


def test_decode_attn_sweep_spreads_a_case_over_a_large_pool_keeping_every_block_distinct():
    """``--pool-gib``: the case's blocks land at distinct random places of a larger pool, the table
    keeps which block each (sequence, position) reads, and every cache copy has the pool's size."""
    import torch

    from pageserve.lab import kernel_checks as checks

    sweep = _script("decode_attn_sweep")
    gen = torch.Generator().manual_seed(0)
    _, _, _, kc, _, meta = checks.random_paged_batch([1] * 3, [40, 17, 33], 16, 2, 128, 16, torch.bfloat16, "cpu", gen)
    bt = meta.block_tables
    table, caches = sweep.spread_caches(bt, kc.shape[0], 16, 0.01, 2, gen)
    pool = int(0.01 * 2**30) // (16 * 2 * 128 * 2)
    assert len(caches) == 2 and all(c.shape == (pool, 16, 2, 128) for kv in caches for c in kv)
    assert table.shape == bt.shape and int(table.max()) < pool
    # the same old block maps to the same new one, different ones to different ones
    old, new = bt.flatten().tolist(), table.flatten().tolist()
    assert len({(o, n) for o, n in zip(old, new)}) == len(set(old)) == len(set(new))
    assert max(new) >= kc.shape[0]  # spread beyond the case's own blocks (p of failing ~ (11/1310)^12)


def test_decode_attn_sweep_head_major_caches_hold_the_same_values_and_give_the_kernels_the_same_output():
    """``--layouts head_major``: each KV head's rows of a block contiguous underneath, the logical cache unchanged;
    the decode kernels read it through its strides, so their output is the token-major cache's, bit for bit."""
    import torch

    from pageserve.kernels import paged_attention_invariant, paged_decode_attention
    from pageserve.lab import kernel_checks as checks

    sweep = _script("decode_attn_sweep")
    gen = torch.Generator().manual_seed(0)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    q, _, _, kc, vc, meta = checks.random_paged_batch([1] * 3, [40, 17, 33], 4, 2, 16, 8, torch.float32, dev, gen)
    hk, hv = sweep.head_major(kc), sweep.head_major(vc)
    assert torch.equal(hk, kc) and hk.shape == kc.shape
    nb, page, hkv, d = kc.shape
    assert hk.stride() == (hkv * page * d, d, page * d, 1)  # a head's page is one run of page * d elements
    scale = d ** -0.5
    assert torch.equal(paged_decode_attention(q, hk, hv, meta.seq_lens, meta.block_tables, scale),
                       paged_decode_attention(q, kc, vc, meta.seq_lens, meta.block_tables, scale))
    assert torch.equal(paged_attention_invariant(q, hk, hv, meta, scale, kv_split=32, block_n=16),
                       paged_attention_invariant(q, kc, vc, meta, scale, kv_split=32, block_n=16))


def test_overlap_probe_splits_the_step_into_halves_that_compute_the_whole_batch(tmp_path, monkeypatch):
    # the CPU smoke run of scripts/overlap_probe.py: every split variant runs the two halves (no streams
    # here), and their output must be the full batch's to fp32 rounding: a wrong row slice would not be
    import json

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    probe = _script("overlap_probe")
    probe.main(["--out", str(tmp_path), "--shape", "tiny", "--cases", "4x40", "--layers", "2", "--device", "cpu",
                "--rounds", "1"])
    rec = json.loads((tmp_path / "overlap_probe.json").read_text())["cases"]["4x40"]
    assert set(rec["best_ms"]) == set(probe.VARIANTS)
    assert all(rec["same_bits"].values()) and rec["same_bits"]
    assert 0 <= rec["max_rel_diff_vs_one"] < 1e-5
    with pytest.raises(SystemExit, match="two equal halves"):
        probe.main(["--out", str(tmp_path), "--shape", "tiny", "--cases", "3x40", "--device", "cpu"])


def test_host_info_names_the_cpu_and_times_the_python_loop():
    from pageserve.lab.profiling import host_info

    info = host_info()
    assert info["cpu_count"] == os.cpu_count()
    assert info["cpu_mhz"] is None or info["cpu_mhz"] > 0
    assert 0 < info["py_loop_ms"] < 10_000


def test_chain_shares_give_each_kernel_what_it_adds_to_the_span_even_when_kernels_overlap():
    from pageserve.lab.profiling import chain_shares

    us = 1000  # ns
    # a [0, 10); b starts early under PDL [2, 14): adds 4; c ends inside b [3, 9): adds 0;
    # idle 6 us; d [20, 25): adds 5; a again [24, 30): adds 5
    ev = [(20 * us, 25 * us, "d"), (0, 10 * us, "a"), (2 * us, 14 * us, "b"), (3 * us, 9 * us, "c"),
          (24 * us, 30 * us, "a")]
    c = chain_shares(ev)
    k = c["kernels"]
    assert c["span_us"] == pytest.approx(30.0)
    assert c["busy_us"] + c["idle_us"] == pytest.approx(c["span_us"])
    assert k["a"]["share_us"] == pytest.approx(15.0) and k["a"]["launches"] == 2
    assert k["b"]["share_us"] == pytest.approx(4.0) and k["b"]["duration_us"] == pytest.approx(12.0)
    assert k["c"]["share_us"] == 0.0 and k["d"]["idle_before_us"] == pytest.approx(6.0)
    assert list(k)[0] == "a"  # largest share first
    assert chain_shares([])["span_us"] == 0.0


def test_kernels_are_named_by_their_place_after_the_layers_attention_kernel():
    from pageserve.lab.profiling import average_chain_shares, by_layer_position, chain_shares

    # two layers: mm (qkv), attention, mm (o), mm (down); then the head's mm
    names = ["embed", "mm", "_split_kernel", "mm", "mm", "mm", "_split_kernel", "mm", "mm", "mm"]
    ev = [(10 * i, 10 * i + 10, n) for i, n in enumerate(names)]
    labelled = [n for _, _, n in by_layer_position(ev, layers=2)]
    assert labelled == ["embed @pre", "mm @pre", "_split_kernel @0", "mm @1", "mm @2", "mm @3", "_split_kernel @0",
                        "mm @1", "mm @2", "mm @3"]
    assert by_layer_position(ev, layers=3) == sorted(ev)  # no attention kernel launched once a layer
    one = chain_shares(by_layer_position(ev, layers=2))
    avg = average_chain_shares([one, one])
    assert avg["span_us"] == pytest.approx(one["span_us"])
    assert avg["kernels"]["mm @3"]["share_us"] == pytest.approx(0.02) and avg["kernels"]["mm @3"]["launches"] == 2


def test_difference_per_step_keeps_what_the_extra_steps_add():
    from pageserve.lab.profiling import KernelRow, difference_per_step
    base = [KernelRow("prefill_gemm", 900.0, 36), KernelRow("attn", 40.0, 36), KernelRow("argmax", 5.0, 1)]
    full = [KernelRow("prefill_gemm", 900.0, 36), KernelRow("attn", 40.0 + 32 * 20.0, 36 + 32 * 36),
            KernelRow("decode_gemm", 32 * 100.0, 32 * 72), KernelRow("argmax", 5.0 + 32 * 3.0, 33)]
    rows = difference_per_step(full, base, 32)
    assert [(r.name, r.us, r.launches) for r in rows] == [("decode_gemm", 100.0, 72), ("attn", 20.0, 36),
                                                          ("argmax", 3.0, 1)]
    with pytest.raises(ValueError, match="steps"):
        difference_per_step(full, base, 0)
