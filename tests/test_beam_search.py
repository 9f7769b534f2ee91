"""Beam search (``engine/beam_search.py``): its rules against a whole-vocabulary reference written apart, the
engine's beams against transformers' ``num_beams`` search on the default model, and the server's
``use_beam_search``."""
from __future__ import annotations

import itertools
import math
import random

import httpx
import pytest
import torch
from openai import BadRequestError, OpenAI

from pageserve import LLM, BeamSearchParams
from pageserve.engine.beam_search import BeamSearch

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---------------------------------------------------------------- the rules, on toy distributions
def toy_logprobs(ids: list[int], vocab: int, seed: int, eos_bias: float) -> list[float]:
    """A fixed random next-token distribution for each token sequence (EOS ids 0 and 1 pushed by eos_bias)."""
    rng = random.Random(hash((seed, tuple(ids))))
    logits = [rng.gauss(0.0, 2.0) for _ in range(vocab)]
    logits[0] += eos_bias
    logits[1] += eos_bias / 2
    top = max(logits)
    z = top + math.log(sum(math.exp(x - top) for x in logits))
    return [x - z for x in logits]


def reference_beams(prompt, width, max_new, eos, penalty, logprobs):
    """Hugging Face's num_beams rules, written apart: every beam's whole vocabulary ranked each round, no early
    stop (so a search that stops early must end with these very beams)."""
    keep = max(2, 1 + len(eos)) * width
    running, finished = [([], 0.0)], []
    for length in range(1, max_new + 1):
        cands = sorted(((cum + lp, b, t) for b, (toks, cum) in enumerate(running)
                        for t, lp in enumerate(logprobs(prompt + toks))), key=lambda c: (-c[0], c[1], c[2]))[:keep]
        last = length == max_new
        finished += [(cum / length ** penalty, running[b][0] + [t]) for cum, b, t in cands[:width] if last or t in eos]
        finished = sorted(finished, key=lambda f: -f[0])[:width]
        running = [(running[b][0] + [t], cum) for cum, b, t in cands if not (last or t in eos)][:width]
        if not running:
            break
    return [toks for _, toks in finished]


def run_search(search: BeamSearch, logprobs) -> None:
    """Drive a search as the engine does: each live beam's top log-probabilities, num_candidates of them."""
    while not search.done:
        tops = []
        for ids in search.requests():
            ranked = sorted(enumerate(logprobs(ids)), key=lambda kv: -kv[1])[:search.num_candidates]
            tops.append(dict(ranked))
        search.advance(tops)


def test_beam_search_equals_a_whole_vocabulary_reference_and_its_early_stop_changes_no_beam():
    vocab, prompt, max_new = 7, [5, 3], 7
    stopped_early = 0
    cases = itertools.product(range(6), (1, 2, 3, 4), (-1.0, 0.0, 0.5, 1.0, 2.0), ((), (0,), (0, 1)), (0.0, 2.5))
    for seed, width, penalty, eos, eos_bias in cases:
        def logprobs(ids):
            return toy_logprobs(ids, vocab, seed, eos_bias)

        params = BeamSearchParams(beam_width=width, max_tokens=max_new, ignore_eos=not eos, length_penalty=penalty)
        search = BeamSearch(prompt, params, eos or (0,), max_model_len=64)
        run_search(search, logprobs)
        got = [f.beam.token_ids for f in search.results()]
        want = reference_beams(prompt, width, max_new, set(eos), penalty, logprobs)
        assert got == want, (seed, width, penalty, eos, eos_bias)
        for f in search.results():
            assert math.isclose(f.beam.cumulative_logprob,
                                sum(toy_logprobs(prompt + f.beam.token_ids[:j], vocab, seed, eos_bias)[t]
                                    for j, t in enumerate(f.beam.token_ids)), abs_tol=1e-9)
            assert f.finish_reason == ("stop" if f.beam.token_ids[-1] in eos else "length")
        stopped_early += search.rounds < max_new and all(f.beam.token_ids[-1] in eos for f in search.results())
    assert stopped_early > 0  # the bound was exercised, not only the run to max_tokens


def test_beam_search_params_and_prompts_are_checked():
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0)
    with pytest.raises(ValueError, match="max_tokens"):
        BeamSearchParams(beam_width=2, max_tokens=0)
    with pytest.raises(ValueError, match="length_penalty"):
        BeamSearchParams(beam_width=2, length_penalty=float("nan"))
    with pytest.raises(ValueError, match="max_model_len"):
        BeamSearch(list(range(8)), BeamSearchParams(beam_width=2), (0,), max_model_len=8)
    search = BeamSearch([1, 2], BeamSearchParams(beam_width=2, max_tokens=None), (0,), max_model_len=5)
    assert search.max_new == 3  # None: up to the context's end
    with pytest.raises(ValueError, match="one top-logprob map"):
        search.advance([])


# ---------------------------------------------------------------- the engine, against transformers
@pytest.fixture(scope="module")
def llm(smollm2):
    return LLM.from_model(smollm2.model, tokenizer=smollm2.tokenizer, device="cpu", dtype="float32", num_blocks=256,
                          max_model_len=1024)


QUESTIONS = ["What is 2+2?", "Name a colour."]


def chat_prompts(tokenizer) -> list[str]:
    return [tokenizer.render_chat([{"role": "user", "content": q}]) for q in QUESTIONS]


@pytest.mark.parametrize("width, max_new, ignore_eos, penalty", [(3, 6, True, 1.0), (3, 20, False, 1.0),
                                                                  (2, 20, False, -1.0)])
def test_beam_search_gives_transformers_beams_on_the_default_model(llm, smollm2_hf, width, max_new, ignore_eos,
                                                                   penalty):
    eos = sorted(llm.engine.eos_token_ids)
    prompts = chat_prompts(llm.tokenizer)
    outs = llm.beam_search(prompts, BeamSearchParams(beam_width=width, max_tokens=max_new, ignore_eos=ignore_eos,
                                                     length_penalty=penalty), use_tqdm=False)
    assert llm.engine.requests == {}  # every round's requests finished and left
    saw_eos = False
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([llm.tokenizer.encode(prompt)])
        # ignore_eos: transformers has no such switch, so an EOS id the model never ranks high stands in
        hf_eos = [smollm2_hf.config.vocab_size - 1] if ignore_eos else eos
        g = smollm2_hf.generate(ids, num_beams=width, num_return_sequences=width, max_new_tokens=max_new,
                                do_sample=False, early_stopping="never", length_penalty=penalty, eos_token_id=hf_eos,
                                pad_token_id=hf_eos[0], output_scores=True, return_dict_in_generate=True,
                                temperature=None, top_p=None, top_k=None)
        want = []
        for row in g.sequences[:, ids.shape[1]:].tolist():
            cut = next((j + 1 for j, t in enumerate(row) if t in hf_eos), len(row))
            want.append(row[:cut])
        assert [c.token_ids for c in out.outputs] == want
        assert out.prompt_token_ids == ids[0].tolist()
        for c, score in zip(out.outputs, g.sequences_scores.tolist()):
            assert math.isclose(c.cumulative_logprob / len(c.token_ids) ** penalty, score, rel_tol=1e-4)
            ended_on_eos = c.token_ids[-1] in eos and not ignore_eos
            saw_eos |= ended_on_eos
            assert c.finish_reason == ("stop" if ended_on_eos else "length")
            shown = c.token_ids[:-1] if ended_on_eos else c.token_ids
            assert c.text == llm.tokenizer.decode(shown)
    if not ignore_eos:
        assert saw_eos  # the EOS rules were exercised


def test_beam_search_refuses_a_too_long_prompt_and_queues_nothing(llm):
    with pytest.raises(ValueError, match="max_model_len"):
        llm.beam_search([[5] * 2000], BeamSearchParams(beam_width=2))
    with pytest.raises(ValueError, match="BeamSearchParams"):
        llm.beam_search(["hi"], {"beam_width": 2})
    assert llm.engine.requests == {}


# ---------------------------------------------------------------- the server's use_beam_search
@pytest.fixture(scope="module")
def server(start_server):
    srv = start_server()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)


def test_completions_use_beam_search_returns_the_offline_beams(client, llm):
    prompts = chat_prompts(llm.tokenizer)
    want = llm.beam_search(prompts, BeamSearchParams(beam_width=3, max_tokens=12), use_tqdm=False)
    r = client.completions.create(model="smollm2-135m-instruct", prompt=prompts, n=3, max_tokens=12,
                                  extra_body={"use_beam_search": True})
    assert [c.index for c in r.choices] == list(range(6))
    assert [c.text for c in r.choices] == [c.text for out in want for c in out.outputs]
    assert [c.finish_reason for c in r.choices] == [c.finish_reason for out in want for c in out.outputs]
    assert r.usage.prompt_tokens == sum(len(out.prompt_token_ids) for out in want)
    assert r.usage.completion_tokens == sum(len(c.token_ids) for out in want for c in out.outputs)


def test_chat_use_beam_search_streams_the_same_beams(client):
    kw = dict(model="smollm2-135m-instruct", messages=[{"role": "user", "content": QUESTIONS[0]}], n=2, max_tokens=12,
              extra_body={"use_beam_search": True, "length_penalty": 0.5})
    whole = client.chat.completions.create(**kw)
    texts, finish = ["", ""], [None, None]
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            finish[c.index] = c.finish_reason or finish[c.index]
        usage = chunk.usage or None
    assert texts == [c.message.content for c in whole.choices]
    assert finish == [c.finish_reason for c in whole.choices]
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens


@pytest.mark.parametrize("extra, named", [({"temperature": 0.7}, "temperature"), ({"top_k": 5}, "top_k"),
                                          ({"logprobs": True}, "logprobs"), ({"seed": 1}, "seed"),
                                          ({"response_format": {"type": "json_object"}}, "output constraint")])
def test_use_beam_search_refuses_what_it_cannot_honour_by_name(client, server, extra, named):
    with pytest.raises(BadRequestError, match=named):
        client.chat.completions.create(model="smollm2-135m-instruct", messages=[{"role": "user", "content": "hi"}],
                                       n=2, max_tokens=4, extra_body={"use_beam_search": True, **extra})
    # a neutral value is no conflict, and the server still answers
    r = httpx.post(server.base_url + "/chat/completions", timeout=300, json={
        "model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 4,
        "use_beam_search": True, "temperature": 0})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2
