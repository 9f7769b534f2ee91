"""Phase 01: the contiguous KV cache and the greedy loop."""
from __future__ import annotations

import pytest
import torch

from pageserve.model.config import ModelConfig
from pageserve.model.loader import build_decoder
from pageserve.lab.naive import ContiguousKVCache, forward_tokens, naive_generate, prompt_logits


@pytest.fixture(scope="module")
def tiny():
    cfg = ModelConfig.from_hf_dict({
        "architectures": ["Qwen2ForCausalLM"], "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
    })
    model = build_decoder(cfg, torch.device("cpu"), torch.float32, 64)
    model.init_dummy_weights(seed=0, std=0.2)
    return model


def test_token_by_token_decode_gives_the_prefill_logits(tiny):
    ids = [3, 14, 15, 92, 65, 35, 89, 79]
    full = prompt_logits(tiny, ids)
    cache = ContiguousKVCache.for_model(tiny, len(ids))
    rows = [tiny.compute_logits(forward_tokens(tiny, cache, [t])) for t in ids]
    assert cache.length == len(ids)
    torch.testing.assert_close(torch.cat(rows), full, atol=1e-5, rtol=1e-5)


def test_chunked_prefill_gives_the_same_logits(tiny):
    ids = list(range(1, 21))
    cache = ContiguousKVCache.for_model(tiny, len(ids))
    parts = [tiny.compute_logits(forward_tokens(tiny, cache, ids[a:b])) for a, b in ((0, 7), (7, 8), (8, 20))]
    torch.testing.assert_close(torch.cat(parts), prompt_logits(tiny, ids), atol=1e-5, rtol=1e-5)


def test_greedy_is_the_argmax_of_the_full_sequence_logits(tiny):
    prompt = [5, 6, 7]
    out = naive_generate(tiny, prompt, 10, ignore_eos=True)
    assert len(out.token_ids) == 10 and len(out.step_s) == 9 and out.prefill_s > 0
    logits = prompt_logits(tiny, prompt + out.token_ids[:-1])
    assert logits[len(prompt) - 1:].argmax(-1).tolist() == out.token_ids


def test_stops_at_eos_and_keeps_it(tiny):
    full = naive_generate(tiny, [1, 2, 3], 12, ignore_eos=True).token_ids
    eos = full[4]
    stopped = naive_generate(tiny, [1, 2, 3], 12, eos_token_ids=[eos])
    assert stopped.token_ids == full[: full.index(eos) + 1]
    ignored = naive_generate(tiny, [1, 2, 3], 12, eos_token_ids=[eos], ignore_eos=True)
    assert ignored.token_ids == full


def test_on_token_streams_every_id(tiny):
    seen = []
    out = naive_generate(tiny, [9, 9], 5, on_token=seen.append, ignore_eos=True)
    assert seen == out.token_ids


def test_cache_overflow_is_an_error(tiny):
    cache = ContiguousKVCache.for_model(tiny, 4)
    forward_tokens(tiny, cache, [1, 2, 3])
    with pytest.raises(ValueError, match="KV cache full"):
        forward_tokens(tiny, cache, [4, 5])


def test_empty_prompt_is_an_error(tiny):
    with pytest.raises(ValueError, match="at least one prompt token"):
        naive_generate(tiny, [], 4)
