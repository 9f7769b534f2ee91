"""The transformers twin of a pageserve Decoder, for tests and notebooks.

``build_hf_model`` makes a LlamaForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM holding exactly the same
weights (the fused qkv / gate_up matrices split back out); ``hf_generate`` is transformers'
greedy ``generate`` with every generation_config default neutralized; ``compare_logits``
and ``greedy_parity`` measure how far pageserve is from it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from ..model.config import ModelConfig
from ..model.decoder import Decoder
from .naive import naive_generate, prompt_logits


def hf_config_dict(cfg: ModelConfig) -> dict[str, Any]:
    """An HF ``config.json`` dict describing the same model as ``cfg``."""
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[cfg.architecture]
    d: dict[str, Any] = {
        "architectures": [arch],
        "model_type": cfg.architecture,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_ids[0] if len(cfg.eos_token_ids) == 1 else (cfg.eos_token_ids or None),
        "torch_dtype": cfg.torch_dtype,
    }
    if cfg.architecture in ("llama", "qwen3"):
        d["attention_bias"] = cfg.attention_bias
    if cfg.architecture == "llama":
        d["mlp_bias"] = False
    if cfg.rope_scaling:
        d["rope_scaling"] = dict(cfg.rope_scaling)
    return d


def hf_state_dict(model: Decoder) -> dict[str, torch.Tensor]:
    """pageserve's parameters under HF names, fused matrices split (views, no copies)."""
    cfg = model.cfg
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        t = p.detach()
        if "qkv_proj" in name:
            for shard, part in zip(("q_proj", "k_proj", "v_proj"), t.split([cfg.q_size, cfg.kv_size, cfg.kv_size])):
                out["model." + name.replace("qkv_proj", shard)] = part
        elif "gate_up_proj" in name:
            for shard, part in zip(("gate_proj", "up_proj"), t.split(cfg.intermediate_size)):
                out["model." + name.replace("gate_up_proj", shard)] = part
        elif name.startswith("lm_head"):
            out[name] = t
        else:
            out["model." + name] = t
    if model.lm_head is None:
        out["lm_head.weight"] = model.embed_tokens.weight.detach()
    return out


def build_hf_model(model: Decoder, device: torch.device | str | None = None,
                   dtype: torch.dtype | None = None):
    """A transformers causal LM with the same weights as ``model``, built directly on
    ``device`` in ``dtype`` (default: the Decoder's), in eval mode, sdpa attention."""
    import transformers

    w = model.embed_tokens.weight
    device = torch.device(device) if device is not None else w.device
    dtype = dtype or w.dtype
    d = hf_config_dict(model.cfg)
    config_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
                  "qwen3": transformers.Qwen3Config}[model.cfg.architecture]
    model_cls = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
                 "qwen3": transformers.Qwen3ForCausalLM}[model.cfg.architecture]
    hf_cfg = config_cls(**{k: v for k, v in d.items() if k not in ("architectures", "model_type", "torch_dtype")})
    hf_cfg._attn_implementation = "sdpa"
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            hf = model_cls(hf_cfg)
    finally:
        torch.set_default_dtype(prev)
    state = hf_state_dict(model)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    missing = [m for m in missing if "rotary_emb" not in m]
    if missing or unexpected:
        raise RuntimeError(f"HF twin does not match: missing {missing[:5]}, unexpected {unexpected[:5]}")
    if model.cfg.tie_word_embeddings:
        hf.tie_weights()
    return hf.eval()


def _greedy_config(max_new_tokens: int, eos_token_ids: Sequence[int] | None, pad_token_id: int | None):
    from transformers import GenerationConfig

    # Every knob stated, so no checkpoint default (repetition penalty, top-k…) sneaks in.
    return GenerationConfig(
        do_sample=False, num_beams=1, max_new_tokens=max_new_tokens, min_new_tokens=0,
        temperature=None, top_k=None, top_p=None, repetition_penalty=1.0, no_repeat_ngram_size=0,
        eos_token_id=list(eos_token_ids) if eos_token_ids else None, pad_token_id=pad_token_id,
        use_cache=True,
    )


@torch.inference_mode()
def hf_generate(hf_model, prompt_ids: Sequence[int], max_new_tokens: int,
                eos_token_ids: Sequence[int] | None = None) -> list[int]:
    """Greedy ``generate`` of one prompt; returns only the new ids (eos included if hit).
    ``eos_token_ids=None`` never stops early."""
    device = next(hf_model.parameters()).device
    pad = eos_token_ids[0] if eos_token_ids else 0
    gen_cfg = _greedy_config(max_new_tokens, eos_token_ids, pad)
    hf_model.generation_config = gen_cfg  # generate() merges the model's config into the one passed
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
    out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen_cfg)
    return out[0, ids.shape[1]:].tolist()


@torch.inference_mode()
def hf_logits(hf_model, prompt_ids: Sequence[int]) -> torch.Tensor:
    """fp32 logits [T, V] of one prompt from the transformers model."""
    device = next(hf_model.parameters()).device
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
    return hf_model(ids, use_cache=False).logits[0].float()


@dataclass
class LogitComparison:
    positions: int
    max_abs_diff: float  # max over positions and vocab of |pageserve - ref|
    rel_err: float  # ||pageserve - ref|| / ||ref|| (Frobenius, over all positions)
    top1_agreement: float  # fraction of positions whose argmax agrees
    _diff_sq: float = field(default=0.0, repr=False)
    _ref_sq: float = field(default=0.0, repr=False)


def compare_logit_sets(ours: Sequence[torch.Tensor], ref: Sequence[torch.Tensor]) -> LogitComparison:
    """Compare two lists of per-prompt logits [T_i, V] (any devices) position by position."""
    max_abs, diff_sq, ref_sq, agree, n = 0.0, 0.0, 0.0, 0, 0
    for a, b in zip(ours, ref, strict=True):
        b = b.to(a.device)
        d = (a.double() - b.double())
        max_abs = max(max_abs, d.abs().max().item())
        diff_sq += d.pow(2).sum().item()
        ref_sq += b.double().pow(2).sum().item()
        agree += (a.argmax(-1) == b.argmax(-1)).sum().item()
        n += b.shape[0]
    return LogitComparison(n, max_abs, (diff_sq / ref_sq) ** 0.5 if ref_sq else float("nan"), agree / max(n, 1),
                           diff_sq, ref_sq)


def compare_logits(model: Decoder, hf_model, prompts: Sequence[Sequence[int]],
                   reference: Sequence[torch.Tensor] | None = None) -> LogitComparison:
    """Prefill every prompt on both models and compare the logits at every position.
    ``reference``: precomputed reference logits per prompt (e.g. an fp32 run) instead of
    ``hf_model``'s."""
    result = None
    for i, ids in enumerate(prompts):  # one prompt at a time: [T, V] logits can be large
        ours = prompt_logits(model, list(ids))
        ref = reference[i] if reference is not None else hf_logits(hf_model, ids)
        one = compare_logit_sets([ours], [ref])
        result = one if result is None else _merge(result, one)
    return result


def _merge(a: LogitComparison, b: LogitComparison) -> LogitComparison:
    # rel_err over the union needs the squared norms, which the objects carry
    return LogitComparison(
        a.positions + b.positions, max(a.max_abs_diff, b.max_abs_diff),
        ((a._diff_sq + b._diff_sq) / (a._ref_sq + b._ref_sq)) ** 0.5,
        (a.top1_agreement * a.positions + b.top1_agreement * b.positions) / (a.positions + b.positions),
        a._diff_sq + b._diff_sq, a._ref_sq + b._ref_sq,
    )


@dataclass
class GreedyParity:
    identical: int  # prompts whose generations match token for token
    total: int
    first_divergence: list[int | None]  # per prompt: first differing step, None if identical
    pageserve_ids: list[list[int]] = field(default_factory=list)
    hf_ids: list[list[int]] = field(default_factory=list)
    pageserve_s: float = 0.0  # wall time of all pageserve generations
    hf_s: float = 0.0
    pageserve_tokens: int = 0
    hf_tokens: int = 0

    @property
    def pageserve_tok_s(self) -> float:
        return self.pageserve_tokens / self.pageserve_s if self.pageserve_s else float("nan")

    @property
    def hf_tok_s(self) -> float:
        return self.hf_tokens / self.hf_s if self.hf_s else float("nan")


def _first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def greedy_parity(model: Decoder, hf_model, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                  eos_token_ids: Sequence[int] | None = None, ignore_eos: bool = True) -> GreedyParity:
    """Greedy-generate every prompt with pageserve's naive loop and with HF ``generate``,
    one prompt at a time; count identical generations and time both sides."""
    device = model.embed_tokens.weight.device
    eos = None if ignore_eos else list(eos_token_ids or [])
    res = GreedyParity(identical=0, total=len(prompts), first_divergence=[])
    for ids in prompts:
        _sync(device)
        t0 = time.perf_counter()
        ours = naive_generate(model, list(ids), max_new_tokens, eos_token_ids=eos, ignore_eos=ignore_eos).token_ids
        _sync(device)
        t1 = time.perf_counter()
        ref = hf_generate(hf_model, ids, max_new_tokens, eos_token_ids=eos)
        _sync(device)
        t2 = time.perf_counter()
        res.pageserve_s += t1 - t0
        res.hf_s += t2 - t1
        res.pageserve_tokens += len(ours)
        res.hf_tokens += len(ref)
        res.pageserve_ids.append(ours)
        res.hf_ids.append(ref)
        div = _first_divergence(ours, ref)
        res.first_divergence.append(div)
        res.identical += div is None
    return res


PARITY_CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers greater than 10.",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 7?",
    "Give me a tip for learning to cook.",
    "Why is the sky blue?",
]


def chat_prompt_ids(tokenizer, texts: Sequence[str], vocab_size: int, random_len: int = 32,
                    seed: int = 0) -> list[list[int]]:
    """Each text as a one-turn chat (generation prompt added); with no tokenizer (random
    weights), deterministic random ids of ``random_len`` tokens instead, one per text."""
    if tokenizer is None:
        return random_prompts(len(texts), random_len, vocab_size, seed)
    if tokenizer.has_chat_template:
        return [tokenizer.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
    return [tokenizer.encode(t) for t in texts]


def random_prompts(num_prompts: int, prompt_len: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Deterministic random token-id prompts (for models without a tokenizer)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (num_prompts, prompt_len), generator=gen).tolist()


@dataclass
class Bf16Floor:
    """bf16 logits of pageserve and of transformers, each against the fp32 transformers run
    of the same checkpoint: the second number is the floor any bf16 implementation sits on."""

    positions: int
    pageserve_vs_fp32: LogitComparison
    hf_vs_fp32: LogitComparison
    pageserve_vs_hf_bf16: LogitComparison


def bf16_floor(model_name: str, texts: Sequence[str], device: str | torch.device = "cpu") -> Bf16Floor:
    """Load ``model_name`` (a real checkpoint with a tokenizer) in fp32 and in bf16, prefill
    each chat prompt on pageserve-bf16, HF-bf16 and HF-fp32, and compare the logits."""
    from ..model.loader import load_model

    loaded = load_model(model_name, device=device, dtype="float32")
    tok = loaded.tokenizer
    if tok is None:
        raise ValueError(f"{model_name}: bf16_floor needs a checkpoint with a tokenizer")
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
    hf32 = build_hf_model(loaded.model)
    ref = [hf_logits(hf32, p) for p in prompts]
    del hf32
    model16 = loaded.model.to(torch.bfloat16)  # the same weights, rounded to bf16 once
    hf16 = build_hf_model(model16)
    ours = [prompt_logits(model16, list(p)) for p in prompts]
    theirs = [hf_logits(hf16, p) for p in prompts]
    return Bf16Floor(
        sum(len(p) for p in prompts),
        compare_logit_sets(ours, ref), compare_logit_sets(theirs, ref), compare_logit_sets(ours, theirs),
    )
