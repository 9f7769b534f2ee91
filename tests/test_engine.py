"""The engine end to end on the CPU (fp32).

A tiny random-weight Qwen2 checks the engine against a naive one-sequence-at-a-time loop
in a second; the real SmolLM2-135M-Instruct checks batched greedy generation against
Hugging Face ``generate`` run one prompt at a time, under every scheduling regime.
"""
from __future__ import annotations

import pytest
import torch

from pageserve.model.attention import AttentionMetadata, PagedAttention
from pageserve.engine.config import EngineConfig
from pageserve.model.config import ModelConfig
from pageserve.engine.llm_engine import LLMEngine
from pageserve.engine.llm import LLM
from pageserve.model.decoder import Decoder
from pageserve.engine.sampling_params import SamplingParams

GEN_LEN = 24


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest: one intra-op thread for this module


# ----------------------------------------------------------------------------- helpers
def pool_is_free(engine: LLMEngine) -> bool:
    bm = engine.block_manager
    return bm.num_free_blocks == bm.num_blocks and all(b.ref_cnt == 0 for b in bm.blocks)


def run_engine(engine: LLMEngine, prompts, params) -> list[list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[f"r{i}"].outputs[0].token_ids for i in range(len(prompts))]


# ----------------------------------------------------------------------------- tiny model
@pytest.fixture(scope="module")
def tiny() -> Decoder:
    cfg = ModelConfig(
        architecture="qwen2", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512, attention_bias=True,
        eos_token_ids=[0],
    )
    model = Decoder(cfg)
    model.init_dummy_weights(seed=1, std=0.3)  # large std: peaked logits, distinct continuations
    return model.eval()


def naive_greedy(model: Decoder, prompt: list[int], n: int) -> list[int]:
    """Full recompute of the whole sequence for every token: no KV reuse, one sequence."""
    cfg, toks = model.cfg, list(prompt)
    with torch.no_grad():
        for _ in range(n):
            T, bs = len(toks), 16
            nb = -(-T // bs)
            kv = torch.zeros(cfg.num_layers, 2, nb, bs, cfg.num_kv_heads, cfg.head_dim)
            meta = AttentionMetadata(
                torch.arange(T), torch.tensor([0, T], dtype=torch.int32), torch.tensor([T], dtype=torch.int32),
                torch.arange(nb, dtype=torch.int32)[None], T, T, [0, T], [T],
            )
            h = model(torch.tensor(toks), torch.arange(T), PagedAttention(kv, meta, model.ops))
            toks.append(int(model.compute_logits(h[-1:]).argmax()))
    return toks[len(prompt):]


@pytest.fixture(scope="module")
def tiny_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    lengths = [1, 3, 15, 16, 17, 31, 33, 40, 47, 59, 5, 64]
    return [torch.randint(1, 256, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def tiny_expected(tiny, tiny_prompts) -> list[list[int]]:
    return [naive_greedy(tiny, p, 20) for p in tiny_prompts]


def tiny_engine(model, **kw) -> LLMEngine:
    kw.setdefault("num_blocks", 256)
    return LLMEngine.from_model(model, EngineConfig(model="tiny", device="cpu", dtype="float32", **kw))


GREEDY20 = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"max_num_batched_tokens": 16},
        {"max_num_batched_tokens": 7, "max_num_seqs": 3},
        {"num_blocks": 9},
        {"enable_prefix_caching": True, "num_blocks": 12, "max_num_batched_tokens": 20},
        {"enable_chunked_prefill": False, "max_num_batched_tokens": 64, "num_blocks": 8},
    ],
    ids=["plain", "chunk16", "chunk7-seqs3", "tiny-pool", "prefix-cache-tiny-pool", "no-chunking"],
)
def test_tiny_model_batched_matches_naive_loop(tiny, tiny_prompts, tiny_expected, kw):
    engine = tiny_engine(tiny, **kw)
    assert run_engine(engine, tiny_prompts, GREEDY20) == tiny_expected
    assert pool_is_free(engine)
    if "num_blocks" in kw:
        assert engine.get_stats()["num_preemptions"] > 0


def test_step_inputs_on_the_device_start_16_byte_aligned_and_hold_the_host_arrays(tiny, tiny_prompts, tiny_expected):
    # odd token counts, odd batch sizes and a tight chunk budget: packed back to back, the parts
    # would start wherever the previous ones ended, and Triton compiles a variant per alignment
    import numpy as np

    engine = tiny_engine(tiny, max_num_batched_tokens=13, max_num_seqs=5)
    runner, seen = engine.runner, []
    to_device = runner.to_device

    def checked(x):
        d = to_device(x)
        parts = {"input_ids": x.input_ids, "positions": x.positions, "slot_mapping": x.slot_mapping,
                 "query_start_loc": x.query_start_loc, "seq_lens": x.seq_lens, "logits_indices": x.logits_indices,
                 "block_tables": x.block_tables}
        for name, want in parts.items():
            got = getattr(d, name)
            assert got.data_ptr() % 16 == 0 or got.numel() == 0, name
            assert np.array_equal(got.cpu().numpy(), want), name
        if x.fill_rows is not None:
            assert np.array_equal(d.fill_rows.cpu().numpy(), x.fill_rows)
            assert np.array_equal(d.fill_src.cpu().numpy(), x.fill_src)
        seen.append((x.num_tokens, len(x.seq_lens)))
        return d

    runner.to_device = checked
    assert run_engine(engine, tiny_prompts, GREEDY20) == tiny_expected
    assert {t % 2 for t, _ in seen} == {0, 1} and {b % 2 for _, b in seen} == {0, 1}


def test_bad_requests_are_rejected_and_engine_goes_on(tiny, tiny_prompts, tiny_expected):
    engine = tiny_engine(tiny, num_blocks=8)  # 128 token slots: max_model_len is capped to 128
    assert engine.max_model_len == 128
    engine.add_request("ok", tiny_prompts[2], GREEDY20)
    bad = [
        ("empty", [], GREEDY20, "empty"),
        ("long", [5] * 200, GREEDY20, "max_model_len"),
        ("ok", [5, 6], GREEDY20, "already in use"),
        ("vocab", [5, 999], GREEDY20, "outside the vocabulary"),
        ("params", [5], {"temperature": 0}, "SamplingParams"),
        ("text", "hello", GREEDY20, "no tokenizer"),
    ]
    for rid, prompt, params, msg in bad:
        with pytest.raises(ValueError, match=msg):
            engine.add_request(rid, prompt, params)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    assert engine.num_unfinished_requests == 1
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert [o.request_id for o in outs if o.finished] == ["ok"]
    assert outs[-1].outputs[0].token_ids == tiny_expected[2]
    assert pool_is_free(engine)


def test_a_text_prompt_the_tokenizer_spells_outside_the_models_vocabulary_is_rejected(tiny, smollm2, tiny_prompts,
                                                                                     tiny_expected):
    # a tokenizer wider than the model (SmolLM2's 49k ids lent to a 256-id model): a clear error, not an
    # embedding lookup out of range, and the engine goes on
    engine = tiny_engine(tiny)
    engine.tokenizer = smollm2.tokenizer
    with pytest.raises(ValueError, match=r"outside the model's vocabulary \[0, 256\)"):
        engine.add_request("text", "a sentence with ordinary words", GREEDY20)
    engine.add_request("ok", tiny_prompts[2], GREEDY20)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].outputs[0].token_ids == tiny_expected[2] and pool_is_free(engine)


def test_prompt_longer_than_budget_rejected_without_chunked_prefill(tiny):
    engine = tiny_engine(tiny, enable_chunked_prefill=False, max_num_batched_tokens=32)
    with pytest.raises(ValueError, match="chunked prefill is off"):
        engine.add_request("a", list(range(1, 40)), GREEDY20)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_abort_frees_blocks_and_reports_abort(tiny, tiny_prompts, async_scheduling):
    engine = tiny_engine(tiny, async_scheduling=async_scheduling)
    engine.add_request("a", tiny_prompts[7], GREEDY20)
    engine.add_request("b", tiny_prompts[8], GREEDY20)
    engine.step()
    engine.step()
    (out,) = engine.abort_request("a")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    # two steps ran; async, the second one's token is still in flight and is dropped
    assert len(out.outputs[0].token_ids) == (1 if async_scheduling else 2)
    while engine.has_unfinished_requests():
        engine.step()
    assert pool_is_free(engine)


def _mixed_workload(prompts) -> list[tuple[list[int], SamplingParams]]:
    """Every postprocessing path async scheduling must keep: greedy, seeded sampling, n > 1,
    penalties (which need the landed tokens), min_tokens, eos and stop ids found one step
    late, length stops known at launch, logprobs."""
    P = SamplingParams
    kinds = [
        P(temperature=0, max_tokens=20, ignore_eos=True),
        P(temperature=0.9, top_p=0.9, seed=7, max_tokens=17, ignore_eos=True),
        P(n=2, temperature=1.0, seed=3, max_tokens=9, ignore_eos=True),
        P(temperature=0, max_tokens=15, repetition_penalty=1.3, presence_penalty=0.5, ignore_eos=True),
        P(temperature=0.8, seed=11, max_tokens=30, min_tokens=5),  # eos (token 0) may stop it
        P(temperature=1.0, seed=5, max_tokens=25, stop_token_ids=[7, 19, 33, 101], ignore_eos=True),
        P(temperature=0, max_tokens=12, logprobs=3, ignore_eos=True),
        P(temperature=0, max_tokens=1, ignore_eos=True),
    ]
    return [(p, kinds[i % len(kinds)]) for i, p in enumerate(prompts)]


def _run_collect(engine: LLMEngine, work) -> dict:
    for i, (p, sp) in enumerate(work):
        engine.add_request(f"r{i}", p, sp)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [(o.token_ids, o.finish_reason, o.stop_reason, o.logprobs) for o in out.outputs]
    return done


@pytest.mark.parametrize(
    "kw",
    [{"enable_prefix_caching": False}, {"enable_prefix_caching": False, "num_blocks": 9, "max_num_batched_tokens": 16},
     {"enable_prefix_caching": True, "num_blocks": 14}],
    ids=["plain", "preempting-chunked", "prefix-cache"],
)
def test_async_scheduling_gives_the_same_results_as_sync(tiny, tiny_prompts, kw):
    work = _mixed_workload(tiny_prompts + tiny_prompts[:4])
    sync = _run_collect(tiny_engine(tiny, async_scheduling=False, **kw), work)
    engine = tiny_engine(tiny, async_scheduling=True, **kw)
    got = _run_collect(engine, work)
    assert pool_is_free(engine)
    # tokens, reasons and the top-logprob ids exactly; logprob values up to fp32 noise (the
    # two runs batch differently: async runs a stopped sequence one step longer)
    strip = {k: [(t, r, sr, lp and [sorted(d) for d in lp]) for t, r, sr, lp in v] for k, v in sync.items()}
    assert {k: [(t, r, sr, lp and [sorted(d) for d in lp]) for t, r, sr, lp in v] for k, v in got.items()} == strip
    for k, outs in sync.items():
        for (_, _, _, lp), (_, _, _, lp2) in zip(outs, got[k]):
            for d, d2 in zip(lp or [], lp2 or []):
                assert d2 == pytest.approx(d, abs=1e-5)
    reasons = {r for outs in sync.values() for _, r, _, _ in outs}
    assert reasons == {"length", "stop"}  # the workload really exercises late value stops
    if "num_blocks" in kw and not kw.get("enable_prefix_caching"):
        assert engine.scheduler.num_preemptions > 0


def test_async_scheduling_overlaps_one_step(tiny, tiny_prompts):
    """Each call launches a step before landing the previous one: after k calls k - 1
    steps' tokens are on the host, and the last call only lands."""
    engine = tiny_engine(tiny)
    engine.add_request("a", tiny_prompts[2], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    seq = engine.requests["a"].seqs[0]
    engine.step()  # prefill + first token launched
    assert seq.num_pending == 1 and seq.output_token_ids == []
    engine.step()
    assert seq.num_pending == 1 and len(seq.output_token_ids) == 1
    engine.step()  # the third token is launched; the seq is capped at max_tokens
    assert seq.length_capped and len(seq.output_token_ids) == 2
    (out,) = engine.step()  # nothing to schedule: lands the last token
    assert out.finished and len(out.outputs[0].token_ids) == 3 and engine._inflight is None
    assert pool_is_free(engine) and not engine.has_unfinished_requests()


def _land_before_sampling(monkeypatch) -> None:
    """Every row's sampling reads its landed outputs on the host (as bad words do, or a grammar's mask)."""
    monkeypatch.setattr(SamplingParams, "needs_landed_outputs", property(lambda self: True))


@pytest.mark.parametrize("kind", ["plain", "penalised", "host_state"])
def test_a_step_that_samples_from_host_state_lands_the_previous_one_after_its_forward_launch(
        tiny, tiny_prompts, monkeypatch, kind):
    """Bad words and grammars read the newest output on the host, so such a row's sampling waits for the
    previous step's tokens; its forward does not: within a call the forward is launched, then the previous step
    lands, then the sampling. A plain step lands the previous one after its whole launch, and so does a penalised
    one (the penalties read the newest token from the device)."""
    engine = tiny_engine(tiny)
    runner, log = engine.runner, []

    def spy(obj, name):
        real = getattr(obj, name)
        monkeypatch.setattr(obj, name, lambda *a, **k: (log.append(name), real(*a, **k))[1])

    spy(runner, "run_step")
    spy(runner.sampler, "sample")
    spy(engine, "_postprocess")
    if kind == "host_state":
        _land_before_sampling(monkeypatch)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                            repetition_penalty=1.3 if kind == "penalised" else 1.0)
    engine.add_request("a", tiny_prompts[2], params)
    for _ in range(3):
        log.append("|")
        engine.step()
    overlap = ["run_step", "_postprocess", "sample"] if kind == "host_state" else ["run_step", "sample", "_postprocess"]
    assert log == ["|", "run_step", "sample"] + ["|", *overlap] * 2


@pytest.mark.parametrize("landing", [False, True], ids=["penalties", "landing"])
def test_a_penalised_sequence_that_stops_while_its_next_step_is_in_flight_with_prefix_caching(
        tiny, tiny_prompts, monkeypatch, landing):
    """A step landing the previous one before its sampling lands it before the step is recorded as run
    (``update_after_step``): a sequence that stopped there is already freed when its in-flight row is recorded.
    Without the landing, the penalties count the newest token from the device: the same tokens either way."""
    if landing:
        _land_before_sampling(monkeypatch)
    params = SamplingParams(temperature=0, max_tokens=40, repetition_penalty=1.2, ignore_eos=True)
    probe = tiny_engine(tiny, async_scheduling=False)
    probe.add_request("p", tiny_prompts[3], params)
    while probe.has_unfinished_requests():
        (out,) = probe.step() or [None]
    stop_at = out.outputs[0].token_ids[20]  # long enough to fill a block of 16
    stopping = SamplingParams(temperature=0, max_tokens=40, repetition_penalty=1.2, ignore_eos=True,
                              stop_token_ids=[stop_at])
    results = {}
    for async_scheduling in (False, True):
        engine = tiny_engine(tiny, async_scheduling=async_scheduling, enable_prefix_caching=True, num_blocks=32)
        results[async_scheduling] = _run_collect(engine, [(tiny_prompts[3], stopping), (tiny_prompts[4], params)])
        assert pool_is_free(engine)
    assert results[True] == results[False]
    (tokens, reason, stop_reason, _), = results[True]["r0"]
    assert reason == "stop" and stop_reason == stop_at and len(tokens) > 16


def test_async_penalties_count_the_token_still_on_the_device(tiny, tiny_prompts, monkeypatch):
    """Async scheduling with penalties only: every penalised sampling after the first sees exactly one token
    still pending, reads it from the device, and every row's tokens equal the synchronous engine's, which
    penalises landed ids only. Strong penalties over a 256-token vocabulary make a missed or doubled count
    change the greedy tokens."""
    P = SamplingParams
    kinds = [P(temperature=0, max_tokens=24, repetition_penalty=1.8, ignore_eos=True),
             P(temperature=0, max_tokens=24, frequency_penalty=1.5, ignore_eos=True),
             P(temperature=0, max_tokens=24, presence_penalty=2.0, ignore_eos=True),
             P(temperature=0.9, seed=4, max_tokens=24, repetition_penalty=1.4, frequency_penalty=0.7,
               ignore_eos=True),
             P(temperature=0, max_tokens=24, ignore_eos=True)]
    work = [(p, kinds[i % len(kinds)]) for i, p in enumerate(tiny_prompts)]
    want = _run_collect(tiny_engine(tiny, async_scheduling=False), work)
    engine = tiny_engine(tiny, async_scheduling=True)
    pendings = []
    real = engine.runner.sampler.sample

    def spy(*a, **k):
        pend = a[8] if len(a) > 8 else k.get("pending")
        pendings.append(None if pend is None else sum(r >= 0 for r in pend[1]))
        return real(*a, **k)

    monkeypatch.setattr(engine.runner.sampler, "sample", spy)
    assert _run_collect(engine, work) == want
    assert pool_is_free(engine)
    # the first step prefills (nothing pending); in every later one each row decodes from a pending token
    assert pendings[0] is None and set(pendings[1:]) == {len(work)}

    # and the penalties really bite here: without the pending token the tokens differ
    monkeypatch.setattr(engine.runner.sampler, "sample", lambda *a, **k: real(*a[:8]))
    assert _run_collect(engine, [(p, sp) for p, sp in work]) != want


def test_failing_request_finishes_with_error_and_others_complete(tiny, tiny_prompts, tiny_expected, monkeypatch):
    engine = tiny_engine(tiny)
    original = engine._append_token

    def flaky(seq, tok, now, lp, top):
        if seq.request_id == "r1" and seq.num_output_tokens == 3:
            raise RuntimeError("boom")
        return original(seq, tok, now, lp, top)

    monkeypatch.setattr(engine, "_append_token", flaky)
    for i, p in enumerate(tiny_prompts[:4]):
        engine.add_request(f"r{i}", p, GREEDY20)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out
    assert done["r1"].outputs[0].finish_reason == "error"
    for i in (0, 2, 3):
        assert done[f"r{i}"].outputs[0].token_ids == tiny_expected[i]
        assert done[f"r{i}"].outputs[0].finish_reason == "length"
    assert pool_is_free(engine)


def test_stop_token_ids_eos_and_max_tokens_finish_reasons(tiny, tiny_prompts, tiny_expected):
    expected = tiny_expected[9]
    stop_tok = expected[5]
    first = expected.index(stop_tok)
    engine = tiny_engine(tiny)
    engine.add_request("stop", tiny_prompts[9], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_tok], ignore_eos=True))
    engine.add_request("len", tiny_prompts[9], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out.outputs[0]
    assert done["stop"].finish_reason == "stop" and done["stop"].stop_reason == stop_tok
    assert done["stop"].token_ids == expected[: first + 1]  # the stop token is kept in the ids
    assert done["len"].finish_reason == "length" and done["len"].token_ids == expected[:4]


def test_eos_stops_unless_ignored_and_min_tokens_delays_it(tiny, tiny_prompts, tiny_expected):
    prompt, expected = tiny_prompts[9], tiny_expected[9]
    eos = expected[3]
    tiny.cfg.eos_token_ids = [eos]  # engines read the model config's eos at construction
    try:
        engine = tiny_engine(tiny)
        params = SamplingParams(temperature=0, max_tokens=20)
        (ids,) = run_engine(engine, [prompt], params)
        assert ids == expected[: expected.index(eos) + 1]
        (ids,) = run_engine(tiny_engine(tiny), [prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
        assert ids == expected
        (ids,) = run_engine(tiny_engine(tiny), [prompt], SamplingParams(temperature=0, max_tokens=20, min_tokens=10))
        assert len(ids) >= 10 and eos not in ids[:10]
    finally:
        tiny.cfg.eos_token_ids = [0]


def test_n_completions_use_child_seeds(tiny, tiny_prompts):
    p = tiny_prompts[4]
    llm = LLM.from_model(tiny, device="cpu", dtype="float32", num_blocks=256)
    sp = SamplingParams(n=3, temperature=1.0, seed=123, max_tokens=12, ignore_eos=True)
    (out,) = llm.generate([p], sp, use_tqdm=False)
    assert [o.index for o in out.outputs] == [0, 1, 2]
    ids = [tuple(o.token_ids) for o in out.outputs]
    assert len(set(ids)) == 3 and all(len(t) == 12 for t in ids)
    (single,) = llm.generate([p], SamplingParams(temperature=1.0, seed=123, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert tuple(single.outputs[0].token_ids) == ids[0]  # child_seed(s, 0) == s
    (again,) = llm.generate([p], sp, use_tqdm=False)
    assert [tuple(o.token_ids) for o in again.outputs] == ids


def test_generate_keeps_input_order_and_has_empty_text_without_tokenizer(tiny, tiny_prompts, tiny_expected):
    llm = LLM.from_model(tiny, device="cpu", dtype="float32", num_blocks=256, max_num_batched_tokens=32)
    outs = llm.generate(tiny_prompts, GREEDY20, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == tiny_prompts
    assert [o.outputs[0].token_ids for o in outs] == tiny_expected
    assert all(o.outputs[0].text == "" and o.finished for o in outs)
    with pytest.raises(ValueError, match="3 prompts but 2"):
        llm.generate(tiny_prompts[:3], [GREEDY20, GREEDY20], use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([tiny_prompts[0], []], GREEDY20, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests() and pool_is_free(llm.engine)


def test_metrics_and_logprobs_are_reported(tiny, tiny_prompts):
    llm = LLM.from_model(tiny, device="cpu", dtype="float32", num_blocks=256)
    (out,) = llm.generate([tiny_prompts[6]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2), use_tqdm=False)
    c, m = out.outputs[0], out.metrics
    assert m.ttft is not None and m.ttft >= 0 and m.finish_time >= m.first_token_time
    assert len(m.inter_token_latencies) == 5
    assert len(c.logprobs) == 6 and all(t in lp and len(lp) >= 2 for t, lp in zip(c.token_ids, c.logprobs))
    assert c.cumulative_logprob == pytest.approx(sum(lp[t] for t, lp in zip(c.token_ids, c.logprobs)))
    stats = llm.get_stats()
    assert stats["prompt_tokens"] == len(tiny_prompts[6]) and stats["generated_tokens"] == 6


def test_prefix_cache_stats_count_hits_and_skip_prefill(tiny, tiny_prompts, tiny_expected):
    llm = LLM.from_model(tiny, device="cpu", dtype="float32", num_blocks=256, enable_prefix_caching=True)
    first = llm.generate(tiny_prompts, GREEDY20, use_tqdm=False)
    computed_once = llm.get_stats()["prefill_tokens_computed"]
    second = llm.generate(tiny_prompts, GREEDY20, use_tqdm=False)
    stats = llm.get_stats()
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in second] == tiny_expected
    assert stats["prefix_cache_hit_tokens"] > 0 and 0 < stats["prefix_cache_hit_rate"] < 1
    assert stats["prefill_tokens_computed"] - computed_once < computed_once
    assert sum(o.metrics.num_cached_tokens for o in second) == stats["prefix_cache_hit_tokens"]


def test_the_priority_policy_runs_urgent_requests_first_with_the_same_tokens(tiny, tiny_prompts, tiny_expected):
    llm = LLM.from_model(tiny, device="cpu", dtype="float32", num_blocks=256, scheduling_policy="priority",
                         max_num_seqs=2)
    prio = [3, 0, 2, 1, 0, 3, -1, 2, 1, 0, 2, 1]
    outs = llm.generate(tiny_prompts, GREEDY20, use_tqdm=False, priority=prio)
    assert [o.outputs[0].token_ids for o in outs] == tiny_expected
    first = [o.metrics.first_token_time for o in outs]
    order = sorted(range(len(prio)), key=lambda i: (prio[i], i))  # urgency, then arrival
    assert all(first[a] <= first[b] for a, b in zip(order, order[1:]))
    assert order != list(range(len(prio))) and first != sorted(first)  # so input order would have failed


def test_a_priority_without_the_priority_policy_is_refused_and_changes_nothing(tiny, tiny_prompts, tiny_expected):
    llm = LLM.from_model(tiny, device="cpu", dtype="float32", num_blocks=256)
    with pytest.raises(ValueError, match="priority scheduling policy"):
        llm.generate(tiny_prompts[:3], GREEDY20, use_tqdm=False, priority=[0, 1, 0])
    with pytest.raises(ValueError, match="3 prompts but 2 priorities"):
        llm.generate(tiny_prompts[:3], GREEDY20, use_tqdm=False, priority=[0, 0])
    with pytest.raises(ValueError, match="priority must be an integer"):
        llm.engine.add_request("x", tiny_prompts[0], GREEDY20, priority=1.5)
    assert not llm.engine.requests and not llm.engine.scheduler.has_unfinished()
    outs = llm.generate(tiny_prompts[:3], GREEDY20, use_tqdm=False, priority=[0, 0, 0])
    assert [o.outputs[0].token_ids for o in outs] == tiny_expected[:3]
    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineConfig(scheduling_policy="lifo")


# ----------------------------------------------------------------------------- SmolLM2 vs HF
@pytest.fixture(scope="module")
def smol(request):
    try:
        return request.getfixturevalue("smollm2")
    except pytest.FixtureLookupError:
        from pageserve.model.loader import load_model

        return load_model("smollm2-135m-instruct", device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def hf_twin(request, smol):
    try:
        return request.getfixturevalue("smollm2_hf")
    except pytest.FixtureLookupError:
        from pageserve.lab.hf_reference import build_hf_model

        return build_hf_model(smol.model)


SYSTEM = (
    "You are a careful assistant for a small bakery. Answer briefly and politely, and always "
    "mention the opening hours: Monday to Saturday, seven in the morning to six in the evening."
)
QUESTIONS = [
    "What time do you open?", "Do you sell sourdough bread?", "Can I order a birthday cake for Friday?",
    "Are your croissants made with butter?", "Is there parking nearby?", "Do you have gluten free options?",
    "What is your most popular pastry?", "Can I pay by card?",
]
RAW = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a village at the edge of a great forest, there lived a",
    "1, 2, 3, 4,",
    "The three primary colors are",
    "Photosynthesis is the process by which green plants and some other organisms use sunlight to "
    "synthesize foods from carbon dioxide and water. Photosynthesis in plants generally involves",
    "Q: What is the boiling point of water at sea level?\nA:",
    "Translate to French: good morning, my friend. ->",
]


@pytest.fixture(scope="module")
def smol_prompts(smol) -> list[list[int]]:
    tok = smol.tokenizer
    chats = [tok.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]) for q in QUESTIONS]
    raw = [tok.encode(t) for t in RAW]
    prompts = [p for pair in zip(chats, raw) for p in pair]  # mixed lengths, shared prefixes interleaved
    assert len(prompts) == 16
    return prompts


@pytest.fixture(scope="module")
def hf_expected(smol, hf_twin, smol_prompts) -> list[list[int]]:
    from pageserve.lab.hf_reference import hf_generate

    return [hf_generate(hf_twin, p, GEN_LEN, smol.eos_token_ids) for p in smol_prompts]


def smol_llm(smol, **kw) -> LLM:
    kw.setdefault("num_blocks", 256)
    return LLM("smollm2-135m-instruct", loaded=smol, device="cpu", dtype="float32", **kw)


GREEDY = SamplingParams(temperature=0, max_tokens=GEN_LEN)


@pytest.mark.parametrize(
    "kw",
    [{"enable_prefix_caching": False}, {"enable_prefix_caching": False, "max_num_batched_tokens": 16},
     {"enable_prefix_caching": False, "num_blocks": 20}, {"enable_prefix_caching": True, "max_num_batched_tokens": 128}],
    ids=["normal-budget", "16-token-chunks", "preempting-pool", "prefix-caching"],
)
def test_smollm2_batched_greedy_matches_hf_one_at_a_time(smol, smol_prompts, hf_expected, kw):
    llm = smol_llm(smol, **kw)
    outs = llm.generate(smol_prompts, GREEDY, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    for i, (g, e) in enumerate(zip(got, hf_expected)):
        assert g == e, f"prompt {i} ({len(smol_prompts[i])} tokens) diverges from HF"
    stats = llm.get_stats()
    if kw.get("num_blocks") == 20:
        assert stats["num_preemptions"] > 0
        assert stats["prefill_tokens_computed"] > stats["prompt_tokens"]  # recomputation happened
    if kw.get("enable_prefix_caching"):
        assert stats["prefix_cache_hit_tokens"] > 0
        assert stats["prefill_tokens_computed"] < stats["prompt_tokens"]
    assert pool_is_free(llm.engine)


def test_smollm2_stop_string_is_cut_from_text(smol, smol_prompts, hf_expected):
    llm = smol_llm(smol)
    prompt = smol_prompts[1]
    (full,) = llm.generate([prompt], GREEDY, use_tqdm=False)
    text = full.outputs[0].text
    assert text == smol.tokenizer.decode(hf_expected[1])
    words = text.split()
    stop = " ".join(words[2:4])
    assert stop and stop in text
    (cut,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=GEN_LEN, stop=[stop]), use_tqdm=False)
    c = cut.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == text[: text.index(stop)]
    assert pool_is_free(llm.engine)


def test_smollm2_chat_and_streaming_text_match_a_whole_decode(smol):
    llm = smol_llm(smol)
    msgs = [{"role": "user", "content": "Name a fruit."}]
    (out,) = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    c = out.outputs[0]
    assert c.text and c.text == smol.tokenizer.decode(c.token_ids)
    # the streaming engine returns growing stable text whose last value is the same text
    engine = LLMEngine(llm.config, smol, stream_outputs=True)
    engine.add_request("s", smol.tokenizer.apply_chat_template(msgs), SamplingParams(temperature=0, max_tokens=12))
    texts = []
    while engine.has_unfinished_requests():
        texts += [o.outputs[0].text for o in engine.step()]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert texts[-1] == c.text


def test_smollm2_chat_continues_a_prefilled_reply_and_hands_tools_to_the_template(smol):
    llm = smol_llm(smol)
    prefill = [{"role": "user", "content": "What is the capital of France?"},
               {"role": "assistant", "content": "The capital of France is"}]
    greedy = SamplingParams(temperature=0, max_tokens=4)
    (out,) = llm.chat(prefill, greedy, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)
    assert out.outputs[0].text == " Paris."
    assert out.prompt_token_ids == smol.tokenizer.encode(
        smol.tokenizer.hf.apply_chat_template(prefill, tokenize=False, continue_final_message=True),
        add_special_tokens=False)
    with pytest.raises(ValueError, match="add_generation_prompt"):
        llm.chat(prefill, greedy, continue_final_message=True)
    template = "{% for t in tools %}{{ t.function.name }};{% endfor %}{{ flag }}|{{ messages[-1].content }}"
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
    (out,) = llm.chat([{"role": "user", "content": "hi"}], greedy, use_tqdm=False, tools=[tool], chat_template=template,
                      chat_template_kwargs={"flag": "F"})
    assert smol.tokenizer.decode(out.prompt_token_ids) == "get_weather;F|hi"


def test_smollm2_bad_words_allowed_token_ids_and_prompt_truncation(smol):
    llm = smol_llm(smol)
    tok = smol.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    greedy = dict(temperature=0, max_tokens=12)
    (plain,) = llm.generate([prompt], SamplingParams(**greedy), use_tqdm=False)
    assert "Paris" in plain.outputs[0].text
    (banned,) = llm.generate([prompt], SamplingParams(bad_words=["Paris"], **greedy), use_tqdm=False)
    assert "Paris" not in banned.outputs[0].text and banned.outputs[0].text != plain.outputs[0].text
    allowed = sorted(set(plain.outputs[0].token_ids[:3]))
    (kept,) = llm.generate([prompt], SamplingParams(allowed_token_ids=allowed, temperature=0.9, seed=1, max_tokens=6,
                                                    ignore_eos=True), use_tqdm=False)
    assert set(kept.outputs[0].token_ids) <= set(allowed)
    (cut,) = llm.generate([prompt], SamplingParams(truncate_prompt_tokens=9, **greedy), use_tqdm=False)
    (tail,) = llm.generate([prompt[-9:]], SamplingParams(**greedy), use_tqdm=False)
    assert cut.prompt_token_ids == prompt[-9:] and cut.outputs[0].token_ids == tail.outputs[0].token_ids
    with pytest.raises(ValueError, match="allowed_token_ids"):
        llm.generate([prompt], SamplingParams(allowed_token_ids=[10**7]), use_tqdm=False)


def test_auto_max_num_seqs_is_the_power_of_two_that_gives_each_sequence_512_tokens_within_32_to_512():
    from pageserve.engine.config import auto_max_num_seqs

    assert auto_max_num_seqs(3_000_000) == 512  # an H200's pool at the 3B shape: the cap
    assert auto_max_num_seqs(136_000) == 256  # a T4's (16 GB, fp16 3B weights): 265 fit -> 256
    assert auto_max_num_seqs(128 * 512) == 128
    assert auto_max_num_seqs(128 * 512 - 1) == 64
    assert auto_max_num_seqs(1000) == 32  # a tiny pool still runs a batch (it preempts at long contexts)
    with pytest.raises(ValueError):
        auto_max_num_seqs(-1)


def test_max_num_seqs_left_none_is_sized_from_the_pool_and_an_explicit_one_is_kept(tiny):
    auto = tiny_engine(tiny, num_blocks=2048)  # 16-token blocks: 32,768 tokens -> 64 sequences of 512
    assert auto.config.max_num_seqs == 64 and auto.scheduler.max_num_seqs == 64
    big = tiny_engine(tiny, num_blocks=2048 * 16)  # 524,288 tokens -> 1,024 fit -> the cap, 512
    assert big.scheduler.max_num_seqs == 512
    kept = tiny_engine(tiny, num_blocks=2048 * 16, max_num_seqs=3)
    assert kept.scheduler.max_num_seqs == 3
    with pytest.raises(ValueError, match="positive"):
        EngineConfig(model="tiny", device="cpu", max_num_seqs=0)
