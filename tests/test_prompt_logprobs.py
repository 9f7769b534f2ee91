"""``SamplingParams.prompt_logprobs``: each prompt token's logprob given the tokens before it, as one
full prefill's logits give them, whatever the chunk budget, the batch or the prefix cache."""
import pytest
import torch

from pageserve.engine.llm import LLM
from pageserve.engine.sampling_params import SamplingParams
from pageserve.engine import model_runner
from pageserve.lab.naive import prompt_logits
from pageserve.model.config import ModelConfig
from pageserve.model.decoder import Decoder


@pytest.fixture(scope="module")
def tiny() -> Decoder:
    cfg = ModelConfig(architecture="qwen2", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512, attention_bias=True,
                      eos_token_ids=[0])
    model = Decoder(cfg)
    model.init_dummy_weights(seed=3, std=0.3)
    return model.eval()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(1, 256, (n,), generator=g).tolist() for n in (1, 2, 17, 40, 70)]


def expected(model: Decoder, prompt: list[int], k: int) -> list[dict[int, float] | None]:
    lp = torch.log_softmax(prompt_logits(model, prompt).double(), dim=-1)
    out: list[dict[int, float] | None] = [None]
    for i in range(1, len(prompt)):
        entry = {prompt[i]: lp[i - 1, prompt[i]].item()}
        top = lp[i - 1].topk(k)
        for t, v in zip(top.indices.tolist(), top.values.tolist()):
            entry.setdefault(t, v)
        out.append(entry)
    return out


def assert_close(got, want):
    assert len(got) == len(want) and got[0] is None
    for g, w in zip(got[1:], want[1:]):
        assert list(g) == list(w)  # the prompt token first, then the top ids in order
        assert all(abs(g[t] - w[t]) < 1e-4 for t in w), (g, w)


@pytest.mark.parametrize("budget,caching", [(512, False), (7, False), (16, True)],
                         ids=["one-chunk", "chunks-of-7", "prefix-cache"])
def test_prompt_logprobs_match_one_full_prefill(tiny, prompts, budget, caching, monkeypatch):
    monkeypatch.setattr(model_runner, "PROMPT_LOGPROBS_ROWS", 5)  # a step's rows scored in several slices
    llm = LLM.from_model(tiny, device="cpu", dtype="float32", num_blocks=256, max_num_batched_tokens=budget,
                         enable_prefix_caching=caching)
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3)
    if caching:  # the same prompts once without: their blocks are cached, and must not be reused for scoring
        llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert_close(out.prompt_logprobs, expected(tiny, prompt, 3))
    # a request that does not ask gets none, beside one that does (the same step)
    mixed = llm.generate(prompts[3:], [SamplingParams(max_tokens=1), params], use_tqdm=False)
    assert mixed[0].prompt_logprobs is None
    assert_close(mixed[1].prompt_logprobs, expected(tiny, prompts[4], 3))


def test_prompt_logprobs_zero_gives_the_prompt_tokens_alone_and_generation_is_unchanged(tiny, prompts):
    llm = LLM.from_model(tiny, device="cpu", dtype="float32", num_blocks=256)
    plain = llm.generate(prompts, SamplingParams(max_tokens=5, temperature=0), use_tqdm=False)
    scored = llm.generate(prompts, SamplingParams(max_tokens=5, temperature=0, prompt_logprobs=0), use_tqdm=False)
    for a, b, prompt in zip(plain, scored, prompts):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [list(e) for e in b.prompt_logprobs[1:]] == [[t] for t in prompt[1:]]


def test_prompt_logprobs_are_validated():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=True)
