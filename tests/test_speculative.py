"""Speculative decoding (n-gram drafts, ``engine/speculative.py``) on the CPU (fp32).

The draft lookup on its own; then the engine with an oracle drafter (the plain run's own next tokens,
some spoiled on purpose), so every acceptance count is known in advance, under the token budget, the
prefix cache and preemption; then SmolLM2's real weights with the n-gram drafter, where greedy and
seeded text must be plain decoding's; then the server."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pageserve.engine.config import EngineConfig
from pageserve.engine.llm import LLM
from pageserve.engine.sampling_params import SamplingParams
from pageserve.engine.speculative import SpeculativeConfig, accepted_prefix, can_draft, propose_ngram

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest: one intra-op thread for this module


# ----------------------------------------------------------------------------- the lookup
def t(*xs):
    return np.asarray(xs, dtype=np.int64)


def test_the_longest_recurring_suffix_proposes_what_followed_it():
    #               0  1  2  3  4  5  6  7  8  9
    tokens = t(1, 2, 3, 9, 2, 3, 4, 5, 1, 2, 3)
    # "1 2 3" occurred at 0 (followed by 9 2 3); "2 3" also at 4 (followed by 4 5 1): the longer match wins
    assert propose_ngram(tokens, 3, 2, 3).tolist() == [9, 2, 3]
    assert propose_ngram(tokens, 3, 2, 2).tolist() == [4, 5, 1]  # the most recent "2 3" with 3 tokens after it
    assert propose_ngram(tokens, 3, 4, 4).tolist() == []  # no 4-token suffix recurs


def test_the_suffix_itself_is_never_a_match_and_short_continuations_fall_back_to_the_earliest():
    assert propose_ngram(t(7, 8, 9), 2, 1, 2).tolist() == []
    run = t(5, 5, 5, 5, 5)  # "5 5" recurs at 0, 1, 2: only the one at 0 has 3 tokens after it in the history
    assert propose_ngram(run, 3, 2, 2).tolist() == [5, 5, 5]
    assert propose_ngram(t(4, 6, 4), 3, 1, 1).tolist() == [6, 4]  # fewer than k tokens follow: what there is
    assert propose_ngram(t(3), 3, 1, 4).tolist() == []


def test_accepted_prefix():
    assert accepted_prefix([1, 2, 3, 4], [1, 2, 9]) == 2
    assert accepted_prefix([8, 2], [1]) == 0
    assert accepted_prefix([1, 2, 3, 4], [1, 2, 3]) == 3
    assert accepted_prefix([5], []) == 0


@pytest.mark.parametrize("spec, why", [
    ({"num_speculative_tokens": 2}, "needs a method"),
    ({"method": "eagle"}, "not supported"),
    ({"method": "ngram", "lookahead": 2}, "unknown keys"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 3}, "more than"),
    ({"method": "ngram", "disable_by_batch_size": 0}, "disable_by_batch_size"),
    ("ngram", "must be a dict"),
])
def test_a_malformed_speculative_config_is_refused(spec, why):
    with pytest.raises(ValueError, match=why):
        EngineConfig(device="cpu", speculative_config=spec)


def test_speculation_turns_async_scheduling_off_and_refuses_tensor_parallelism():
    assert EngineConfig(device="cpu", speculative_config=NGRAM).async_scheduling is False
    assert EngineConfig(device="cpu").async_scheduling is True
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(device="cpu", speculative_config=NGRAM, tensor_parallel_size=2)
    from pageserve.engine.llm_engine import LLMEngine

    cfg = EngineConfig(device="cpu", speculative_config=NGRAM)
    cfg.async_scheduling = True  # set again after the config checked itself: the engine refuses before loading
    with pytest.raises(ValueError, match="async_scheduling=False"):
        LLMEngine(cfg, loaded=object())


# ----------------------------------------------------------------------------- the engine, an oracle drafter
@pytest.fixture(scope="module")
def tiny(tiny_qwen2_config):
    from pageserve.model.decoder import Decoder

    model = Decoder(tiny_qwen2_config)
    model.init_dummy_weights(seed=1, std=0.3)
    return model.eval()


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(1, 256, (n,), generator=g).tolist() for n in [1, 3, 15, 16, 17, 31, 33, 40, 47, 59]]


GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def expected(tiny, prompts):
    llm = LLM.from_model(tiny, device="cpu", dtype="float32", num_blocks=256)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def oracle(llm: LLM, prompts, expected, spoil_at: int | None):
    """Make ``llm``'s drafter propose each sequence's true next tokens (from the plain run), with the one at
    index ``spoil_at`` of every draft changed (None: all true)."""
    engine = llm.engine
    truth = {tuple(p): e for p, e in zip(prompts, expected)}
    k = engine.proposer.cfg.num_speculative_tokens

    def propose(running, max_model_len):
        for seq in running:
            room = min(can_draft(seq, max_model_len), k)
            m = seq.num_output_tokens
            drafts = list(truth[tuple(seq.prompt_token_ids)][m:m + room]) if room > 0 else []
            if spoil_at is not None and spoil_at < len(drafts):
                drafts[spoil_at] = (drafts[spoil_at] + 1) % 256
            seq.spec_token_ids = drafts

    engine.proposer.propose = propose


@pytest.mark.parametrize("spoil_at, accepted_per_step", [(None, 3), (2, 2), (0, 0)])
@pytest.mark.parametrize("kw", [{}, {"max_num_batched_tokens": 8}, {"enable_prefix_caching": False}])
def test_oracle_drafts_are_accepted_as_far_as_they_are_right_and_the_text_is_plain_decodings(
        tiny, prompts, expected, spoil_at, accepted_per_step, kw):
    llm = LLM.from_model(tiny, device="cpu", dtype="float32", num_blocks=256, speculative_config=NGRAM, **kw)
    oracle(llm, prompts, expected, spoil_at)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    st = llm.get_stats()
    assert st["spec_draft_tokens"] > 0
    if spoil_at is None:
        assert st["spec_accepted_tokens"] == st["spec_draft_tokens"]
    else:  # every draft is spoiled at spoil_at, or shorter than that near max_tokens (then all true)
        assert st["spec_accepted_tokens"] < st["spec_draft_tokens"]
    if "max_num_batched_tokens" not in kw:  # budget enough for every draft: steps are as few as predicted
        # a sequence's first token comes from its prompt's step; then each step emits accepted + 1, up to 20
        per_seq = 1 + -(-(GREEDY.max_tokens - 1) // (accepted_per_step + 1))
        assert st["num_steps"] <= per_seq + 1
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_cnt == 0 for b in bm.blocks)


def test_blocks_published_through_accepted_drafts_hold_the_right_keys_and_values(tiny):
    # prompts of 12 / 28 / 44 tokens and 21 outputs: the last step's accepted draft completes a block (position
    # 16k - 1), as the sequence finishes
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 256, (n,), generator=g).tolist() for n in (12, 28, 44)]
    params = SamplingParams(temperature=0, max_tokens=21, ignore_eos=True)
    plain = LLM.from_model(tiny, device="cpu", dtype="float32", num_blocks=256, enable_prefix_caching=False)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    llm = LLM.from_model(tiny, device="cpu", dtype="float32", num_blocks=256, speculative_config=NGRAM)
    oracle(llm, prompts, expected, spoil_at=2)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
    # a prompt that is an earlier prompt and its whole output hits every block the first run computed
    longer = [p + e for p, e in zip(prompts, expected)]
    want = [o.outputs[0].token_ids for o in plain.generate(longer, GREEDY, use_tqdm=False)]
    hits = llm.get_stats()["prefix_cache_hit_tokens"]
    llm.engine.proposer.propose = lambda running, max_model_len: None  # no drafts: a plain decode over the hits
    got = [o.outputs[0].token_ids for o in llm.generate(longer, GREEDY, use_tqdm=False)]
    assert llm.get_stats()["prefix_cache_hit_tokens"] - hits == sum(len(p) - 1 for p in longer)  # 32 + 48 + 64
    assert got == want


def test_speculation_under_preemption_gives_the_same_tokens(tiny, prompts, expected):
    llm = LLM.from_model(tiny, device="cpu", dtype="float32", num_blocks=14, max_num_seqs=6,
                         speculative_config=NGRAM)
    oracle(llm, prompts, expected, spoil_at=1)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.engine.scheduler.num_preemptions > 0 and llm.get_stats()["spec_accepted_tokens"] > 0


def test_stop_tokens_and_max_tokens_cut_inside_an_accepted_run(tiny, prompts, expected):
    i = next(i for i, e in enumerate(expected) if len(set(e[6:12])) == 6 and e[9] not in e[:9])
    stop = expected[i][9]  # a token first drawn as the 10th output
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, stop_token_ids=[stop])
    plain = LLM.from_model(tiny, device="cpu", dtype="float32", num_blocks=256)
    want = plain.generate(prompts, params, use_tqdm=False)
    llm = LLM.from_model(tiny, device="cpu", dtype="float32", num_blocks=256, speculative_config=NGRAM)
    oracle(llm, prompts, expected, spoil_at=None)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert got[i].outputs[0].token_ids == expected[i][:10] and got[i].outputs[0].finish_reason == "stop"
    assert all(len(o.outputs[0].token_ids) <= 14 for o in got)


def test_drafting_rows_sample_as_plain_decoding_would_with_logprobs_and_seeds(tiny, prompts):
    params = SamplingParams(temperature=0.9, top_k=40, max_tokens=16, ignore_eos=True, seed=11, logprobs=2)
    plain = LLM.from_model(tiny, device="cpu", dtype="float32", num_blocks=256)
    want = plain.generate(prompts, params, use_tqdm=False)
    truth = [o.outputs[0].token_ids for o in want]
    llm = LLM.from_model(tiny, device="cpu", dtype="float32", num_blocks=256, speculative_config=NGRAM)
    oracle(llm, prompts, truth, spoil_at=2)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == truth  # row j draws with output step num_outputs + j's seed
    assert llm.get_stats()["spec_accepted_tokens"] > 0
    for a, b in zip(want, got):
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.keys() == lb.keys()
            assert np.allclose(list(la.values()), list(lb.values()), atol=1e-4)


def test_which_rows_draft_and_how_many():
    from types import SimpleNamespace

    seq = SimpleNamespace(matcher=None, num_pending=0, num_tokens=10, num_computed_tokens=9, output_token_ids=[1],
                          num_output_tokens=1, params=SamplingParams(max_tokens=8))
    assert can_draft(seq, 100) == 6  # room for 6 drafts and the token after them under max_tokens
    assert can_draft(seq, 12) == 1  # and under max_model_len
    seq.params = SamplingParams(max_tokens=8, repetition_penalty=1.1)
    assert can_draft(seq, 100) == 6  # penalised rows draft (DraftHistory)
    seq.num_computed_tokens = 5  # a prompt chunk, not a decode
    assert can_draft(seq, 100) == 0
    seq.num_computed_tokens, seq.num_pending = 9, 1  # its newest token still on the device
    assert can_draft(seq, 100) == 0


def test_a_guided_rows_drafts_stop_where_its_grammar_would_reject_one():
    from pageserve.engine.sequence import Sequence
    from pageserve.engine.speculative import NgramProposer

    seq = Sequence("g", [1, 2, 3, 4, 1, 2], SamplingParams(max_tokens=20))
    seq.output_token_ids.append(3)
    seq.num_computed_tokens = seq.num_tokens - 1  # decoding: the newest token not yet computed
    proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=3))
    proposer.propose([seq], 100)
    assert seq.spec_token_ids == [4, 1, 2]  # "1 2 3" recurs: what followed it
    seq.matcher = type("Grammar", (), {"validate_tokens": lambda self, tokens: 1})()  # accepts only the first
    proposer.propose([seq], 100)
    assert seq.spec_token_ids == [4]


@pytest.mark.parametrize("pen", [dict(repetition_penalty=1.3), dict(frequency_penalty=0.7, presence_penalty=0.4)])
def test_penalised_drafting_rows_count_the_drafts_before_them(tiny, prompts, pen):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, **pen)
    plain = LLM.from_model(tiny, device="cpu", dtype="float32", num_blocks=256, async_scheduling=False)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    assert want != [o.outputs[0].token_ids for o in plain.generate(prompts, GREEDY, use_tqdm=False)]  # they bite
    llm = LLM.from_model(tiny, device="cpu", dtype="float32", num_blocks=256, speculative_config=NGRAM)
    oracle(llm, prompts, want, spoil_at=None)  # all true: rows 1..d see drafts the penalties must count
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
    st = llm.get_stats()
    assert st["spec_accepted_tokens"] == st["spec_draft_tokens"] > 0


# ----------------------------------------------------------------------------- SmolLM2, the n-gram drafter
CODE = ("def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
        "def factorial(n):\n    result = 1\n    for i in range(2, n + 1):\n        result *= i\n    return result\n")
COPY_TASKS = [
    [{"role": "user", "content": "Rewrite this code with type hints, and keep everything else the same:\n\n" + CODE}],
    [{"role": "user", "content": "Repeat the following text exactly, word for word:\n\nThe quick brown fox jumps "
                                 "over the lazy dog. Paged attention stores the key and value cache in fixed-size "
                                 "blocks, so memory is not wasted on padding."}],
]


@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_tokens=64),
                                    SamplingParams(temperature=0.8, top_p=0.95, max_tokens=64, seed=7),
                                    SamplingParams(temperature=0, max_tokens=64, repetition_penalty=1.05)],
                         ids=["greedy", "seeded", "penalised"])
def test_ngram_drafts_on_real_weights_keep_plain_decodings_text(smollm2, params):
    plain = LLM(loaded=smollm2, device="cpu", dtype="float32", num_blocks=256)
    want = plain.chat(COPY_TASKS, params, use_tqdm=False)
    llm = LLM(loaded=smollm2, device="cpu", dtype="float32", num_blocks=256,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    got = llm.chat(COPY_TASKS, params, use_tqdm=False)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
    st = llm.get_stats()
    assert st["spec_acceptance_rate"] > 0.3 and st["spec_tokens_per_drafting_step"] > 1.8
    assert st["num_steps"] < plain.get_stats()["num_steps"]


def test_guided_rows_draft_only_what_their_grammar_accepts_and_keep_plain_decodings_text(smollm2):
    from pageserve.engine.sampling_params import StructuredOutputsParams

    person = {"type": "object", "properties": {"name": {"type": "string"}, "city": {"type": "string"},
                                               "pets": {"type": "array", "items": {"type": "string"}}},
              "required": ["name", "city", "pets"], "additionalProperties": False}
    ask = [[{"role": "user", "content": "Give this as JSON with keys name, city, pets: Tom Smith lives in New York "
                                        "City and has pets Rex the dog, Tom Smith's cat Luna and a parrot."}]]
    params = SamplingParams(temperature=0, max_tokens=60, structured_outputs=StructuredOutputsParams(json=person))
    plain = LLM(loaded=smollm2, device="cpu", dtype="float32", num_blocks=256)
    want = plain.chat(ask * 2, params, use_tqdm=False)
    llm = LLM(loaded=smollm2, device="cpu", dtype="float32", num_blocks=256,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1})
    got = llm.chat(ask * 2, params, use_tqdm=False)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
    import json

    json.loads(got[0].outputs[0].text)  # the grammar held through every accepted draft
    st = llm.get_stats()
    assert st["spec_accepted_tokens"] > 0 and st["num_steps"] < plain.get_stats()["num_steps"]


def test_a_speculating_server_reports_its_drafts(start_server):
    import httpx
    from openai import OpenAI

    srv = start_server(speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    try:
        c = OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=120)
        r = c.chat.completions.create(model="smollm2-135m-instruct", messages=COPY_TASKS[1], max_tokens=40,
                                      temperature=0, stream=True)
        text = "".join(ch.choices[0].delta.content or "" for ch in r if ch.choices)
        assert "quick brown fox" in text
        metrics = httpx.get(srv.url + "/metrics").text
        drafts = [l for l in metrics.splitlines() if l.startswith("pageserve_spec_decode_num_accepted_tokens_total{")]
        assert drafts and float(drafts[0].rsplit(" ", 1)[1]) > 0
    finally:
        srv.stop()


def test_the_speculative_config_is_a_serve_flag():
    import argparse

    from pageserve.serve.cli import add_engine_config_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_config_args(parser)
    args = parser.parse_args(["--device", "cpu", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 5}'])
    cfg = engine_config_from_args(args)
    assert SpeculativeConfig.parse(cfg.speculative_config).num_speculative_tokens == 5 and not cfg.async_scheduling
