"""The benchmark harness: workloads, tok/s accounting, and the Hugging Face peers (CPU, fast)."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from pageserve.lab import bench
from pageserve.lab.bench import make_result, mixed_workload, random_workload, request_row, shared_prefix_workload


# ------------------------------------------------------------------ workloads


def test_random_workload_has_requested_shape_and_range():
    w = random_workload(7, 33, 5, vocab_size=100, seed=3, low=10)
    assert len(w) == 7
    assert all(len(p) == 33 for p in w.prompts)
    assert all(r.max_tokens == 5 for r in w.requests)
    assert all(10 <= t < 100 for p in w.prompts for t in p)
    assert w.prompt_tokens == 7 * 33 and w.requested_output_tokens == 7 * 5


def test_random_workload_is_deterministic_by_seed():
    a = random_workload(4, 16, 2, vocab_size=1000, seed=1)
    b = random_workload(4, 16, 2, vocab_size=1000, seed=1)
    c = random_workload(4, 16, 2, vocab_size=1000, seed=2)
    assert a.prompts == b.prompts
    assert a.prompts != c.prompts
    assert len({tuple(p) for p in a.prompts}) == 4  # requests differ from each other


def test_head_takes_the_first_k_requests_of_the_same_workload():
    w = random_workload(10, 8, 2, vocab_size=50, seed=0)
    h = w.head(3)
    assert h.prompts == w.prompts[:3]
    assert w.head(None) is w and w.head(99) is w


def test_shared_prefix_workload_shares_exactly_the_prefix():
    w = shared_prefix_workload(6, prefix_len=32, suffix_len=8, output_len=4, vocab_size=500, num_prefixes=2, seed=5)
    assert all(len(p) == 40 for p in w.prompts)
    assert w.prompts[0][:32] == w.prompts[2][:32] == w.prompts[4][:32]
    assert w.prompts[1][:32] == w.prompts[3][:32]
    assert w.prompts[0][:32] != w.prompts[1][:32]
    assert w.prompts[0][32:] != w.prompts[2][32:]  # own suffixes
    assert shared_prefix_workload(6, 32, 8, 4, 500, 2, seed=5).prompts == w.prompts


def test_mixed_workload_staggers_long_arrivals_after_the_shorts():
    w = mixed_workload(4, 8, 20, 3, 64, 2, vocab_size=300, long_first_step=2, long_every_steps=5, seed=0)
    shorts, longs = w.tagged("short"), w.tagged("long")
    assert len(shorts) == 4 and len(longs) == 3
    assert all(r.arrival_step == 0 and len(r.prompt_token_ids) == 8 for r in shorts.requests)
    assert [r.arrival_step for r in longs.requests] == [2, 7, 12]
    assert all(len(r.prompt_token_ids) == 64 and r.max_tokens == 2 for r in longs.requests)


# ------------------------------------------------------------------ accounting


def test_tok_s_counts_prompt_plus_output_over_wall_time():
    r = make_result("x", prompt_tokens=300, output_tokens=100, wall_s=2.0, per_request=[])
    assert r.total_tok_s == pytest.approx(200.0)
    assert r.output_tok_s == pytest.approx(50.0)
    s = r.summary()
    assert s["total_tok_s"] == pytest.approx(200.0) and s["wall_s"] == 2.0


def test_latencies_from_timestamps():
    ttft, itl = bench.latencies_from_timestamps(1.0, [1.5, 1.75, 2.25])
    assert ttft == pytest.approx(0.5)
    assert itl == pytest.approx([0.25, 0.5])
    assert bench.latencies_from_timestamps(1.0, []) == (None, [])


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class FakeLLM:
    """``generate`` advances a fake clock by 1 ms per token and returns vLLM-shaped outputs."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.config = SimpleNamespace(device="cpu")

    def generate(self, prompts, params, use_tqdm=True):
        params = params if isinstance(params, list) else [params] * len(prompts)
        outs = []
        for i, (p, sp) in enumerate(zip(prompts, params)):
            arrival = self.clock.t
            self.clock.t += 1e-3 * len(p)  # prefill
            times = []
            for _ in range(sp.max_tokens):
                self.clock.t += 2e-3
                times.append(self.clock.t)
            metrics = SimpleNamespace(
                arrival_time=arrival,
                first_token_time=times[0],
                finish_time=times[-1],
                inter_token_latencies=[b - a for a, b in zip(times[:-1], times[1:])],
                num_cached_tokens=0,
            )
            comp = SimpleNamespace(index=0, token_ids=[1] * sp.max_tokens, finish_reason="length", text="")
            outs.append(SimpleNamespace(request_id=str(i), prompt_token_ids=p, outputs=[comp], metrics=metrics))
        return outs


def test_run_pageserve_accounts_tokens_and_latencies_on_a_fake_clock():
    clock = FakeClock()
    w = random_workload(4, 10, 5, vocab_size=100, seed=0)
    r = bench.run_pageserve(FakeLLM(clock), w, clock=clock)
    # per request: 10 ms prefill + 5 tokens x 2 ms = 20 ms; 4 requests back to back = 80 ms
    assert r.wall_s == pytest.approx(0.080)
    assert r.prompt_tokens == 40 and r.output_tokens == 20
    assert r.total_tok_s == pytest.approx(60 / 0.080)
    assert r.output_tok_s == pytest.approx(20 / 0.080)
    assert r.ttft_s == pytest.approx([0.012] * 4)
    assert len(r.itl_s) == 4 * 4 and r.itl_s == pytest.approx([0.002] * 16)
    s = r.summary()
    assert s["ttft_p50_ms"] == pytest.approx(12.0) and s["itl_p90_ms"] == pytest.approx(2.0)


def test_request_row_derives_ttft_from_arrival_and_first_token():
    out = SimpleNamespace(metrics=SimpleNamespace(arrival_time=1.0, first_token_time=1.25))
    assert request_row(out, "long")["ttft_s"] == pytest.approx(0.25)


# ------------------------------------------------------------------ HF peers


@pytest.fixture(scope="module")
def tiny_hf_model():
    transformers = pytest.importorskip("transformers")
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)
    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def test_hf_generate_serial_emits_exactly_max_tokens(tiny_hf_model):
    from pageserve.lab.hf_baselines import hf_generate_serial

    w = random_workload(3, 12, 7, vocab_size=256, seed=1)
    r = hf_generate_serial(tiny_hf_model, w)
    assert r.num_requests == 3 and r.prompt_tokens == 36 and r.output_tokens == 21
    assert r.total_tok_s > 0


def test_hf_generate_batch_matches_serial_greedy_tokens(tiny_hf_model):
    from pageserve.lab.hf_baselines import hf_generate_batch, hf_generate_serial

    w = random_workload(4, 12, 6, vocab_size=256, seed=2)
    serial = hf_generate_serial(tiny_hf_model, w)
    batch = hf_generate_batch(tiny_hf_model, w, num_blocks=32, page_size=16, max_batch_tokens=128)
    assert batch.output_tokens == 24
    assert [r["token_ids"] for r in batch.per_request] == [r["token_ids"] for r in serial.per_request]
    assert len(batch.ttft_s) == 4 and len(batch.itl_s) == 4 * 5


# ------------------------------------------------------------------ on the real engine (tiny model)


@pytest.fixture(scope="module")
def tiny_model(tiny_qwen2_config):
    from pageserve.model.decoder import Decoder

    model = Decoder(tiny_qwen2_config)
    model.init_dummy_weights(seed=1, std=0.3)
    return model.eval()


def _llm(model, **kw):
    from pageserve.engine.llm import LLM

    return LLM.from_model(model, device="cpu", dtype="float32", num_blocks=128, **kw)


def test_stats_delta_counts_only_this_runs_tokens():
    before = {"prompt_tokens": 10, "prefill_tokens_computed": 10, "prefix_cache_queried_tokens": 0,
              "prefix_cache_hit_tokens": 0, "num_free_blocks": 5}
    after = {"prompt_tokens": 110, "prefill_tokens_computed": 50, "prefix_cache_queried_tokens": 100,
             "prefix_cache_hit_tokens": 60, "num_free_blocks": 7}
    d = bench.stats_delta(before, after)
    assert d["prompt_tokens"] == 100 and d["prefill_tokens_computed"] == 40
    assert d["prefix_hit_rate"] == pytest.approx(0.6)
    assert d["prefill_tokens_saved_frac"] == pytest.approx(0.6)
    assert "num_free_blocks" not in d  # a gauge, not a counter


def test_run_pageserve_on_the_engine_generates_exactly_max_tokens(tiny_model):
    llm = _llm(tiny_model)
    w = random_workload(5, 20, 6, vocab_size=256, seed=3)
    r = bench.run_pageserve(llm, w)
    assert r.output_tokens == 30 and r.prompt_tokens == 100
    assert len(r.ttft_s) == 5 and all(t > 0 for t in r.ttft_s)
    assert len(r.itl_s) == 5 * 5
    assert r.extra["prompt_tokens"] == 100 and r.extra["generated_tokens"] == 30


def test_online_run_adds_requests_at_their_step_and_matches_offline_tokens(tiny_model):
    w = mixed_workload(3, 8, 10, 2, 48, 3, vocab_size=256, long_first_step=2, long_every_steps=3, seed=4)
    online = bench.run_pageserve_online(_llm(tiny_model, max_num_batched_tokens=16), w)
    offline = bench.run_pageserve(_llm(tiny_model), w)
    assert online.output_tokens == 3 * 10 + 2 * 3
    assert [r["token_ids"] for r in online.per_request] == [r["token_ids"] for r in offline.per_request]
    # budget 16 with 3 decodes in flight: a 48-token prompt needs several steps before its first token
    assert online.extra["num_steps"] > offline.extra["num_steps"]
    assert len(online.subset("long").ttft_s) == 2 and len(online.subset("short").itl_s) == 3 * 9


def test_prefix_cache_hits_are_counted_for_a_warm_shared_prompt(tiny_model):
    llm = _llm(tiny_model, enable_prefix_caching=True)
    w = shared_prefix_workload(4, prefix_len=64, suffix_len=8, output_len=2, vocab_size=256, seed=6)
    bench.prime(llm, [w.prompts[0][:64]])
    r = bench.run_pageserve(llm, w)
    assert r.extra["prefix_hit_rate"] == pytest.approx(4 * 64 / (4 * 72))
    assert r.extra["prefill_tokens_saved_frac"] == pytest.approx(4 * 64 / (4 * 72))
