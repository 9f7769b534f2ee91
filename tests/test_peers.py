"""Phase 08 harness on the CPU: workloads, runners' result shape, serving metrics, the vLLM pieces."""
import json
import statistics

import numpy as np
import pytest

from pageserve.lab import peers, serving, workloads
from pageserve.serve.bench_client import LoadResult, RequestResult


# ------------------------------------------------------------------ workloads


def test_random_len_workload_lengths_stay_within_the_range_ratio_and_repeat_by_seed():
    w = workloads.random_len_workload(200, 100, 50, vocab_size=1000, range_ratio=0.5, seed=3)
    ins = [len(p) for p in w.prompts]
    outs = [r.max_tokens for r in w.requests]
    assert min(ins) >= 50 and max(ins) <= 150 and len(set(ins)) > 20
    assert min(outs) >= 25 and max(outs) <= 75
    assert workloads.random_len_workload(200, 100, 50, 1000, 0.5, seed=3).prompts == w.prompts
    assert workloads.random_len_workload(200, 100, 50, 1000, 0.5, seed=4).prompts != w.prompts
    fixed = workloads.random_len_workload(5, 16, 4, 1000, 0.0)
    assert {len(p) for p in fixed.prompts} == {16} and {r.max_tokens for r in fixed.requests} == {4}


def test_w1_and_nanovllm_follow_their_conventions():
    w1 = workloads.w1_workload(vocab_size=500)
    assert len(w1) == 500 and {len(p) for p in w1.prompts} == {512} and {r.max_tokens for r in w1.requests} == {256}
    nv = workloads.nanovllm_workload(vocab_size=500, seed=1)
    ins, outs = [len(p) for p in nv.prompts], [r.max_tokens for r in nv.requests]
    assert len(nv) == 256 and min(ins + outs) >= 100 and max(ins + outs) <= 1024
    assert all(0 <= t < 500 for p in nv.prompts for t in p)


def test_chat_lengths_are_lognormal_around_the_medians_with_long_tails_and_fit_the_context():
    w = workloads.chat_workload(vocab_size=1000, num_requests=2000, max_model_len=2048, seed=0)
    ins = np.array([len(p) for p in w.prompts])
    outs = np.array([r.max_tokens for r in w.requests])
    assert 180 <= np.median(ins) <= 220 and 135 <= np.median(outs) <= 165
    assert np.percentile(ins, 99) > 4 * np.median(ins)  # a long tail
    assert np.all(ins + outs <= 2048) and ins.min() >= 1
    assert workloads.make_workload("chat", 1000, num_requests=2000, max_model_len=2048).prompts == w.prompts


def test_shared_prefix_and_unknown_names():
    w = workloads.make_workload("shared_prefix", 1000, num_requests=8, prefix_len=32, suffix_len=4, num_prefixes=2)
    assert w.prompts[0][:32] == w.prompts[2][:32] != w.prompts[1][:32]
    with pytest.raises(ValueError, match="unknown workload"):
        workloads.make_workload("nope", 10)


# ------------------------------------------------------------------ the vLLM pieces without vllm


def test_vllm_runner_says_clearly_that_vllm_is_missing():
    pytest.importorskip("torch")
    try:
        import vllm  # noqa: F401
        pytest.skip("vllm is installed here")
    except ImportError:
        pass
    with pytest.raises(peers.VllmMissingError, match="vllm-pack.sh"):
        peers.VllmRunner("smollm2-135m")
    with pytest.raises(peers.VllmMissingError):
        serving.start_vllm_server("/nonexistent")


def test_model_dir_for_vllm_is_a_qwen2_config_transformers_loads(tmp_path):
    transformers = pytest.importorskip("transformers")
    d = peers.write_model_dir("qwen2.5-3b", tmp_path / "m", dtype="bfloat16")
    raw = json.loads((d / "config.json").read_text())
    assert raw["architectures"] == ["Qwen2ForCausalLM"] and raw["torch_dtype"] == "bfloat16"
    cfg = transformers.AutoConfig.from_pretrained(str(d))
    assert cfg.model_type == "qwen2" and cfg.num_hidden_layers == 36 and cfg.num_key_value_heads == 2
    assert cfg.vocab_size == 151936 and cfg.tie_word_embeddings and not cfg.use_sliding_window
    from pageserve.model.config import ModelConfig

    assert ModelConfig.from_json(d / "config.json") == ModelConfig.shipped("qwen2.5-3b")


def test_vllm_serve_command_uses_dummy_weights_and_no_tokenizer():
    cmd = serving.vllm_serve_command("/m", 8001)
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert {"--load-format", "dummy", "--skip-tokenizer-init"} <= set(cmd)


# ------------------------------------------------------------------ decode timing and the floor


def test_subtraction_decode_ms_removes_the_prefill_and_divides_by_steps():
    t = [0.0]
    calls = []

    def clock():
        return t[0]

    def generate(prompts, max_tokens):  # prefill 0.5 s + 0.01 s per decode step
        calls.append((len(prompts), len(prompts[0]), max_tokens))
        t[0] += 0.5 + 0.01 * (max_tokens - 1)

    out = peers.subtraction_decode_ms(generate, 4, 32, 10, vocab_size=100, repeats=3, clock=clock)
    assert out["decode_ms"] == pytest.approx(10.0)
    assert calls[0] == (4, 32, 11) and len(calls) == 7


def test_floor_is_weight_plus_kv_bytes_over_bandwidth():
    from pageserve.model.config import ModelConfig

    c = ModelConfig.shipped("qwen2.5-3b")
    wb = peers.weight_bytes(c, 2)
    assert 5.5e9 < wb < 6.5e9  # ~3.1B parameters, bf16, embeddings read as the LM head once
    assert peers.kv_bytes(c, 512, 2) == 2 * 36 * 256 * 512 * 2
    assert peers.floor_batch1_ms(c, 4000.0, 512) == pytest.approx(1e3 * (wb + peers.kv_bytes(c, 512)) / 4e12)


def test_workload_floor_is_the_larger_of_its_flops_and_its_bytes():
    from pageserve.model.config import ModelConfig

    c = ModelConfig.shipped("qwen2.5-3b")
    # one request, 4 prompt tokens -> 3 output: forwards see 4 + 2 tokens, the head samples 3
    per_token = 2 * 36 * (2560 * 2048 + 2048 * 2048 + 2 * 11008 * 2048 + 2048 * 11008)
    flops = 6 * per_token + 3 * 2 * 151936 * 2048 + 4 * (1 + 2 + 3 + 4 + 5 + 6) * 128 * 16 * 36
    nbytes = 2 * peers.weight_bytes(c) + (5 + 6) * peers.kv_bytes(c, 1)  # two decode steps over 5, then 6 tokens
    f = peers.workload_floor(c, [(4, 3)], read_gbps=1000.0, matmul_tflops=1.0)
    assert f["flops"] == pytest.approx(flops) and f["bytes"] == nbytes
    assert f["compute_s"] == pytest.approx(flops / 1e12) and f["memory_s"] == pytest.approx(nbytes / 1e12)
    assert f["floor_s"] == max(f["compute_s"], f["memory_s"])
    # W1 at the 3B shape on an H200's measured ceilings: compute-bound, ~3.2 s (pageserve's W1 ran ~4.9 s)
    w1 = peers.workload_floor(c, [(512, 256)] * 500, read_gbps=4480.0, matmul_tflops=700.0)
    assert w1["floor_s"] == w1["compute_s"] and 3.0 < w1["compute_s"] < 3.5 and 0.8 < w1["memory_s"] < 1.3
    # a longer output adds decode steps, each of which must read every weight again
    one, two = (peers.workload_floor(c, [(8, n)], 1000.0, 1e9)["bytes"] for n in (2, 3))
    assert two - one == peers.weight_bytes(c) + 10 * peers.kv_bytes(c, 1)


# ------------------------------------------------------------------ runners on the CPU (tiny)


@pytest.fixture(scope="module")
def tiny_json(tmp_path_factory, tiny_qwen2_config):
    from pageserve.lab.hf_reference import hf_config_dict

    path = tmp_path_factory.mktemp("cfg") / "tiny.json"
    path.write_text(json.dumps(hf_config_dict(tiny_qwen2_config)))
    return str(path)


KEYS = {"engine", "workload", "num_requests", "prompt_tokens", "output_tokens", "wall_s", "extra", "total_tok_s",
        "output_tok_s"}


@pytest.mark.parametrize("engine", ["pageserve", "hf_generate", "hf_generate_batch"])
def test_each_runner_returns_the_same_result_shape(engine, tiny_json):
    if engine.startswith("hf"):
        pytest.importorskip("transformers")
    args = {"num_blocks": 64} if engine == "pageserve" else {"batch_size": 2} if engine == "hf_generate" else {}
    rec = peers.run_engine(engine, tiny_json, {"w1": {"num_requests": 3, "prompt_len": 8, "output_len": 3},
                                               "chat": {"num_requests": 2, "prompt_median": 6, "output_median": 3,
                                                        "max_output_len": 4, "max_prompt_len": 16}},
                           device="cpu", dtype="float32", engine_args=args)
    assert rec["errors"] == {}
    w1 = rec["offline"]["w1"]
    assert set(w1) == KEYS and w1["engine"] == engine
    assert w1["num_requests"] == 3 and w1["prompt_tokens"] == 24 and w1["output_tokens"] == 9
    assert w1["total_tok_s"] == pytest.approx(33 / w1["wall_s"])
    chat = peers.OfflineResult.from_dict(rec["offline"]["chat"])
    assert chat.output_tokens == sum(workloads.make_workload("chat", 256, num_requests=2, prompt_median=6,
                                     output_median=3, max_output_len=4, max_prompt_len=16).requests[i].max_tokens
                                     for i in range(2))
    assert rec["versions"]["torch"]
    # each workload was preceded by an untimed one of its shape
    assert rec["warmup"]["w1"]["num_requests"] == 3 and rec["warmup"]["w1"]["prompt_tokens"] == 24
    # and the host's conditions while each ran are kept beside it (what moves a peer from run to run)
    assert rec["host"]["cpu_count"] >= 1
    assert set(rec["conditions"]) == {"w1", "chat"}
    assert rec["conditions"]["w1"]["load_1m_before"] >= 0 and rec["conditions"]["w1"]["load_1m_after"] >= 0


def test_warmup_workload_has_the_shape_but_none_of_the_measured_prompts():
    spec = peers.WorkloadSpec("w1", {"num_requests": 40, "prompt_len": 8, "output_len": 3})
    measured, warm = spec.build(1000), peers.warmup_workload(spec, 1000, num_requests=32)
    assert len(warm) == 32 and {len(p) for p in warm.prompts} == {8}
    assert [r.max_tokens for r in warm.requests] == [r.max_tokens for r in measured.requests[:32]]
    assert not set(map(tuple, warm.prompts)) & set(map(tuple, measured.prompts))
    chat = peers.WorkloadSpec("chat", {"num_requests": 8, "seed": 3})
    assert [len(p) for p in peers.warmup_workload(chat, 1000, num_requests=8).prompts] != \
        [len(p) for p in chat.build(1000).prompts]  # other lengths too: the same distribution, not the same draws


def test_pageserve_decode_timing_and_floor_on_the_cpu(tiny_json):
    rec = peers.run_engine("pageserve", tiny_json, {}, {"batches": [1, 2], "context_len": 8, "steps": 2, "repeats": 1},
                           device="cpu", dtype="float32", engine_args={"num_blocks": 64}, floor=True)
    assert rec["errors"] == {} and set(rec["decode"]) == {"1", "2"}
    assert rec["decode"]["1"]["engine_step_ms"] > 0 and "decode_ms" in rec["decode"]["2"]
    assert rec["floor"]["floor_batch1_ms"] > 0 and rec["floor"]["read_gbps"] > 0


def test_passes_keep_the_median_pass_and_the_floor_fraction_reads_it(tiny_json):
    w1 = {"num_requests": 3, "prompt_len": 8, "output_len": 3}
    rec = peers.run_engine("pageserve", tiny_json, {"w1": w1}, device="cpu", dtype="float32",
                           engine_args={"num_blocks": 64}, floor=True, warmup_requests=0, passes=3)
    assert rec["errors"] == {}
    walls = sorted(p["wall_s"] for p in rec["passes"]["w1"])
    assert len(walls) == 3 and rec["offline"]["w1"]["wall_s"] == walls[1]
    assert all(p["output_tokens"] == 9 for p in rec["passes"]["w1"])
    f = rec["floor"]["workloads"]["w1"]
    assert f == {**peers.workload_floor(tiny_json, [(8, 3)] * 3, rec["floor"]["read_gbps"],
                                        rec["floor"]["matmul_fp32_tflops"], 4),
                 "fraction": f["floor_s"] / walls[1]}
    with pytest.raises(ValueError, match="passes"):
        peers.run_engine("pageserve", tiny_json, {"w1": w1}, device="cpu", passes=0)


# ------------------------------------------------------------------ serving metrics


def _load():
    rs = [RequestResult(ok=True, ttft_s=0.1, e2e_s=1.1, itl_s=[0.25] * 4, output_tokens=5, prompt_tokens=10),
          RequestResult(ok=True, ttft_s=0.3, e2e_s=0.7, itl_s=[0.2, 0.2], output_tokens=3, prompt_tokens=10),
          RequestResult(ok=True, ttft_s=0.2, e2e_s=0.2, itl_s=[], output_tokens=1, prompt_tokens=10),
          RequestResult(ok=False, error="HTTP 500")]
    return LoadResult(rs, duration_s=2.0)


def test_serving_metrics_follow_vllm_bench_serve_definitions():
    m = serving.serving_metrics(_load())
    assert m["completed"] == 3 and m["errors"] == 1
    assert m["request_throughput"] == pytest.approx(1.5)  # completed / duration
    assert m["output_throughput"] == pytest.approx(4.5) and m["total_token_throughput"] == pytest.approx(19.5)
    assert m["ttft_mean_ms"] == pytest.approx(200) and m["ttft_median_ms"] == pytest.approx(200)
    assert m["ttft_p90_ms"] == pytest.approx(280) and m["ttft_p99_ms"] == pytest.approx(298)
    # TPOT = (e2e - ttft) / (output_tokens - 1), only for requests with more than one token
    assert m["tpot_mean_ms"] == pytest.approx(statistics.mean([250, 200]))
    assert m["itl_p50_ms"] == pytest.approx(250) and m["itl_mean_ms"] == pytest.approx(1400 / 6)
    assert m["e2e_p50_ms"] == pytest.approx(700)
    figs = serving.sweep_figures("pageserve", {4.0: m})
    assert figs["serve.pageserve.4.ttft_p50_ms"] == pytest.approx(200) and len(figs) == 4


def test_poisson_offsets_match_the_clients_schedule_and_mean_rate():
    xs = serving.poisson_offsets(2001, 10.0, seed=0)
    assert xs[0] == 0.0 and xs == sorted(xs) and 180 < xs[-1] < 220
    assert serving.poisson_offsets(3, float("inf")) == [0.0, 0.0, 0.0]
