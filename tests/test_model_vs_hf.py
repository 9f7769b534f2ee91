"""pageserve's decoder against transformers on the same weights (CPU, fp32)."""
from __future__ import annotations

import pytest
import torch

from pageserve.model.config import ModelConfig
from pageserve.lab.hf_reference import PARITY_CHAT_PROMPTS, build_hf_model, compare_logits, greedy_parity, hf_state_dict, random_prompts
from pageserve.model.loader import build_decoder

CHAT_PROMPTS = PARITY_CHAT_PROMPTS


def small_qwen2_config() -> ModelConfig:
    return ModelConfig.from_hf_dict({
        "architectures": ["Qwen2ForCausalLM"], "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    })


def test_smollm2_logits_match_transformers_on_chat_prompts(smollm2, smollm2_hf):
    tok = smollm2.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in CHAT_PROMPTS[:3]]
    cmp = compare_logits(smollm2.model, smollm2_hf, prompts)
    assert cmp.max_abs_diff < 1e-4, cmp
    assert cmp.top1_agreement == 1.0


def test_smollm2_logits_match_transformers_on_random_tokens(smollm2, smollm2_hf):
    # Random ids drive larger activations; over 30 layers fp32 rounding (fused vs split
    # matmuls) reaches ~1.3e-4 absolute on logits of magnitude ~40, i.e. ~1e-6 relative.
    cmp = compare_logits(smollm2.model, smollm2_hf, random_prompts(1, 96, smollm2.config.vocab_size, seed=1))
    assert cmp.rel_err < 1e-5, cmp
    assert cmp.max_abs_diff < 5e-4, cmp
    assert cmp.top1_agreement == 1.0


def test_random_qwen2_with_qkv_bias_logits_match_transformers():
    cfg = small_qwen2_config()
    assert cfg.attention_bias
    model = build_decoder(cfg, torch.device("cpu"), torch.float32, 256)
    model.init_dummy_weights(seed=3, std=0.1)
    with torch.no_grad():  # non-trivial biases and norms, so a dropped bias would show
        for layer in model.layers:
            layer.self_attn.qkv_proj.bias.normal_(0, 0.5)
            layer.input_layernorm.weight.uniform_(0.5, 1.5)
    hf = build_hf_model(model)
    assert torch.equal(hf.model.layers[0].self_attn.k_proj.bias, hf_state_dict(model)["model.layers.0.self_attn.k_proj.bias"])
    cmp = compare_logits(model, hf, random_prompts(3, 40, cfg.vocab_size))
    assert cmp.max_abs_diff < 1e-4, cmp


def small_qwen3_model():
    """A random Qwen3 shape (q/k norms, no qkv bias, head_dim 32 != hidden / heads) with non-trivial norms."""
    cfg = ModelConfig.from_hf_dict({
        "architectures": ["Qwen3ForCausalLM"], "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "max_position_embeddings": 256, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
    })
    assert cfg.qk_norm and not cfg.attention_bias and cfg.q_size == 128
    model = build_decoder(cfg, torch.device("cpu"), torch.float32, 256)
    model.init_dummy_weights(seed=4, std=0.1)
    with torch.no_grad():  # a dropped q/k norm would show
        for layer in model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.2, 2.0)
            layer.self_attn.k_norm.weight.uniform_(0.2, 2.0)
    return model


def test_random_qwen3_logits_match_transformers():
    model = small_qwen3_model()
    hf = build_hf_model(model)
    assert type(hf).__name__ == "Qwen3ForCausalLM"
    cmp = compare_logits(model, hf, random_prompts(3, 40, model.cfg.vocab_size))
    assert cmp.max_abs_diff < 1e-4, cmp


def test_random_qwen3_through_the_engine_on_the_triton_kernels_matches_hf_generate():
    from pageserve.engine.llm import LLM
    from pageserve.engine.sampling_params import SamplingParams
    from pageserve.lab.hf_reference import hf_generate

    model = small_qwen3_model()
    hf = build_hf_model(model)
    prompts = random_prompts(2, 12, model.cfg.vocab_size, seed=5)
    llm = LLM.from_model(model, device="cpu", dtype="float32", use_triton=True, num_blocks=32)
    assert type(llm.engine.runner.ops).__name__ == "TritonOps"  # the kernels, on the interpreter here
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_generate(hf, p, 6) for p in prompts]


@pytest.mark.slow
def test_smollm2_greedy_64_tokens_identical_to_hf_generate(smollm2, smollm2_hf):
    tok = smollm2.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in CHAT_PROMPTS]
    res = greedy_parity(smollm2.model, smollm2_hf, prompts, 64, ignore_eos=True)
    assert res.identical == len(CHAT_PROMPTS), res.first_divergence
    assert all(len(ids) == 64 for ids in res.pageserve_ids)


def test_smollm2_answers_sensibly(smollm2):
    """Catches a wrong GGUF Q/K row order, which parity with HF (same weights) cannot."""
    from pageserve.lab.naive import naive_generate

    tok = smollm2.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": CHAT_PROMPTS[0]}])
    out = naive_generate(smollm2.model, ids, 24, eos_token_ids=tok.eos_token_ids)
    assert "Paris" in tok.decode(out.token_ids)
    assert out.token_ids[-1] in tok.eos_token_ids  # a short answer that ends its turn


@pytest.mark.parametrize("arch,scaling", [
    ("llama", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}),
    ("llama", {"rope_type": "linear", "factor": 4.0}),
    ("qwen2", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
])
def test_rope_scaling_variants_match_transformers(arch, scaling):
    cfg = ModelConfig.from_hf_dict({
        "architectures": ["LlamaForCausalLM" if arch == "llama" else "Qwen2ForCausalLM"], "vocab_size": 256,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 256, "rope_theta": 10000.0,
        "rope_scaling": scaling,
    })
    assert cfg.rope_scaling["rope_type"] == scaling["rope_type"]
    model = build_decoder(cfg, torch.device("cpu"), torch.float32, 256)
    model.init_dummy_weights(seed=5, std=0.2)
    hf = build_hf_model(model)
    # 200 positions: well past original_max_position_embeddings, where the variants differ most
    cmp = compare_logits(model, hf, random_prompts(1, 200, cfg.vocab_size, seed=2))
    assert cmp.max_abs_diff < 1e-4, cmp
