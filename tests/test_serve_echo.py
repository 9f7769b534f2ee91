"""/v1/completions with ``echo`` and vLLM's ``prompt_logprobs``, live on 127.0.0.1: what a
loglikelihood evaluation (lm-evaluation-harness's ``local-completions``) sends — the prompt echoed with
its tokens' logprobs — scored as one full prefill of the same model scores it."""
import pytest
import torch
from openai import OpenAI

from pageserve.lab.naive import prompt_logits

MODEL = "smollm2-135m-instruct"
TEXT = "The capital of France is Paris, and the capital of Italy is"


@pytest.fixture(scope="module")
def server(start_server):
    srv = start_server(enable_prefix_caching=True)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(smollm2):
    """Each prompt token's logprob given the ones before it (fp64 log-softmax of one full prefill)."""
    ids = smollm2.tokenizer.encode(TEXT)
    lp = torch.log_softmax(prompt_logits(smollm2.model, ids).double(), dim=-1)
    return ids, [None] + [lp[i - 1, ids[i]].item() for i in range(1, len(ids))], lp


def test_echo_with_logprobs_scores_every_prompt_token_as_one_prefill(client, reference, smollm2):
    ids, want, lp = reference
    # twice: the second request's prompt is in the prefix cache, and must still be scored, not skipped
    for _ in range(2):
        r = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=1, temperature=0, echo=True, logprobs=1)
        c = r.choices[0]
        assert c.text.startswith(TEXT) and len(c.text) > len(TEXT)
        got = c.logprobs
        assert len(got.tokens) == len(ids) + 1  # the prompt's tokens, then the generated one
        assert got.tokens[:len(ids)] == [smollm2.tokenizer.hf.convert_tokens_to_string([t])
                                         for t in smollm2.tokenizer.hf.convert_ids_to_tokens(ids)]
        assert got.token_logprobs[0] is None and got.top_logprobs[0] is None
        for g, w in zip(got.token_logprobs[1:len(ids)], want[1:]):
            assert abs(g - w) < 1e-3, (g, w)
        # top_logprobs: the most likely token at each position, as the reference ranks it
        for pos, top in enumerate(got.top_logprobs[1:len(ids)], start=1):
            best = lp[pos - 1].argmax().item()
            assert list(top.values())[0] == pytest.approx(lp[pos - 1, best].item(), abs=1e-3)
        assert got.text_offset[:3] == [0, len(got.tokens[0]), len(got.tokens[0]) + len(got.tokens[1])]
        assert r.usage.prompt_tokens == len(ids)


def test_echo_without_logprobs_and_streamed_echo_give_the_same_text(client):
    plain = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=4, temperature=0)
    echoed = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == TEXT + plain.choices[0].text and echoed.choices[0].logprobs is None
    chunks = list(client.completions.create(model=MODEL, prompt=TEXT, max_tokens=4, temperature=0, echo=True,
                                            stream=True))
    assert chunks[0].choices[0].text.startswith(TEXT)
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == echoed.choices[0].text


def test_prompt_logprobs_ride_beside_the_choice_keyed_by_token_id(client, reference):
    ids, want, _ = reference
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0,
                                  extra_body={"prompt_logprobs": 2})
    plp = r.choices[0].model_extra["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    for pos in range(1, len(ids)):
        entry = plp[pos]
        assert list(entry)[0] == str(ids[pos])  # the prompt token first, then the top 2
        assert 2 <= len(entry) <= 3
        assert abs(entry[str(ids[pos])]["logprob"] - want[pos]) < 1e-3
    assert r.choices[0].text  # generation goes on as usual


def test_echo_of_token_ids_decodes_them(client, smollm2):
    ids = smollm2.tokenizer.encode(TEXT)
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0, echo=True)
    assert r.choices[0].text.startswith(TEXT)


def test_a_batch_of_token_id_prompts_gets_each_prompts_scores_at_its_choice_index(client, smollm2):
    # lm-evaluation-harness batches its loglikelihood requests as lists of token ids, then zips the choices,
    # sorted by index, with its own contexts
    tok = smollm2.tokenizer
    batch = [tok.encode(TEXT), tok.encode("Two plus two equals four.")]
    r = client.completions.create(model=MODEL, prompt=batch, max_tokens=1, temperature=0, echo=True, logprobs=1)
    for choice in sorted(r.choices, key=lambda c: c.index):
        ids = batch[choice.index]
        lp = torch.log_softmax(prompt_logits(smollm2.model, ids).double(), dim=-1)
        got = choice.logprobs.token_logprobs
        assert len(got) == len(ids) + 1 and got[0] is None
        assert all(abs(got[i] - lp[i - 1, ids[i]].item()) < 1e-3 for i in range(1, len(ids)))
