"""Read a GGUF file (llama.cpp's format): config, dequantized weights, tokenizer.

Every tensor is dequantized to fp32 with ``gguf.quants.dequantize`` (Q4_1, Q8_0, … all
work); pageserve then computes in its own dtype. llama.cpp names are mapped to Hugging
Face names so ``Decoder.load_weights`` takes them unchanged.

One subtlety: llama.cpp's converter reorders the rows of Llama's Q and K projections so
that each head's two RoPE halves are interleaved (it applies RoPE to adjacent pairs);
pageserve uses rotate-half RoPE like HF, so the reorder is undone here
(``unpermute_qk``). Qwen2 GGUFs are not reordered.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .config import ModelConfig

# llama.cpp tensor name (after "blk.N.") -> HF name (after "model.layers.N.")
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",  # Qwen3
    "attn_k_norm": "self_attn.k_norm",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


@dataclass
class GGUFContents:
    config: ModelConfig
    hf_config: dict[str, Any]  # an HF-style config.json equivalent of ``config``
    weights: dict[str, torch.Tensor]  # HF names -> fp32 tensors
    metadata: dict[str, Any]  # scalar and short-list metadata fields (no token lists)


def hf_tensor_name(gguf_name: str) -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; None if unknown."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


def unpermute_qk(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order. Within each head llama.cpp stores rows as pairs
    (r0, r_{D/2}, r1, r_{D/2+1}, …); rotate-half wants the first half then the second.
    w: [num_heads * D, ...] (weight or bias)."""
    rows = w.shape[0]
    half = rows // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def permute_qk(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """The inverse of ``unpermute_qk`` (what llama.cpp's converter applies); for tests."""
    rows = w.shape[0]
    half = rows // num_heads // 2
    return w.reshape(num_heads, 2, half, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _field_value(field) -> Any:
    """A GGUF metadata field as a Python value (str, number, or list)."""
    import gguf

    types = field.types
    if not types:
        return None
    if types[0] == gguf.GGUFValueType.ARRAY:
        if types[-1] == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    if types[0] == gguf.GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
    return field.parts[field.data[0]].tolist()[0]


def read_metadata(reader, path: str | Path) -> dict[str, Any]:
    """All metadata except the (long) token, merge and score lists, which are read on demand."""
    skip = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.scores", "tokenizer.ggml.token_type")
    return {k: _field_value(f) for k, f in reader.fields.items() if k not in skip and not k.startswith("GGUF.")}


def config_from_metadata(meta: dict[str, Any], vocab_size: int, path: str | Path) -> dict[str, Any]:
    """An HF-style config dict from GGUF metadata (``<arch>.embedding_length`` …)."""
    arch = meta.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(
            f"{path}: unsupported GGUF architecture {arch!r}; pageserve reads {sorted(_ARCHITECTURES)}"
        )

    def need(key: str):
        full = f"{arch}.{key}"
        if full not in meta:
            raise ValueError(f"{path}: GGUF metadata lacks {full!r}")
        return meta[full]

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    d: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": int(meta.get(f"{arch}.vocab_size", vocab_size)),
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(meta.get(f"{arch}.attention.key_length", hidden // heads)),
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(meta.get(f"{arch}.context_length", 4096)),
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    # float32 metadata (9.999999747e-06) back to the decimal it was written as (1e-05)
    d["rms_norm_eps"] = float(np.format_float_positional(np.float32(d["rms_norm_eps"]), unique=True, trim="-"))
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling and scaling != "none":
        d["rope_scaling"] = {"rope_type": scaling, "factor": float(meta.get(f"{arch}.rope.scaling.factor", 1.0))}
        if f"{arch}.rope.scaling.original_context_length" in meta:
            d["rope_scaling"]["original_max_position_embeddings"] = int(
                meta[f"{arch}.rope.scaling.original_context_length"]
            )
    if "tokenizer.ggml.bos_token_id" in meta:
        d["bos_token_id"] = int(meta["tokenizer.ggml.bos_token_id"])
    if "tokenizer.ggml.eos_token_id" in meta:
        d["eos_token_id"] = int(meta["tokenizer.ggml.eos_token_id"])
    return d


def _open(path: Path):
    import gguf

    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # the gguf package raises ValueError/struct errors on junk
        raise ValueError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def _hf_config(reader, meta: dict[str, Any], path: Path) -> dict[str, Any]:
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    hf_config = config_from_metadata(meta, len(tokens.data) if tokens is not None else 0, path)
    if not hf_config["vocab_size"]:
        raise ValueError(f"{path}: cannot tell the vocabulary size (no token list, no vocab_size)")
    hf_config["tie_word_embeddings"] = "output.weight" not in {t.name for t in reader.tensors}
    return hf_config


def load_gguf_config(path: str | Path) -> ModelConfig:
    """Only the model config of a GGUF (no tensors are dequantized)."""
    path = Path(path)
    reader = _open(path)
    return ModelConfig.from_hf_dict(_hf_config(reader, read_metadata(reader, path), path), source=str(path))


def load_gguf(path: str | Path) -> GGUFContents:
    """Read ``path``: the config, every tensor dequantized to fp32 under its HF name."""
    import gguf

    path = Path(path)
    reader = _open(path)
    meta = read_metadata(reader, path)
    hf_config = _hf_config(reader, meta, path)
    config = ModelConfig.from_hf_dict(hf_config, source=str(path))

    weights: dict[str, torch.Tensor] = {}
    permute = config.architecture == "llama"
    for t in reader.tensors:
        name = hf_tensor_name(t.name)
        if name is None:
            if t.name.startswith("rope_freqs"):
                continue  # llama3 rope factors: pageserve computes these from the config
            raise ValueError(f"{path}: unknown GGUF tensor {t.name!r}")
        array = gguf.quants.dequantize(t.data, t.tensor_type)
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))  # GGUF lists dims fastest-first
        tensor = torch.from_numpy(np.array(array, dtype=np.float32, copy=True).reshape(shape))
        if permute and name.endswith(("q_proj.weight", "q_proj.bias")):
            tensor = unpermute_qk(tensor, config.num_heads)
        elif permute and name.endswith(("k_proj.weight", "k_proj.bias")):
            tensor = unpermute_qk(tensor, config.num_kv_heads)
        weights[name] = tensor
    return GGUFContents(config=config, hf_config=hf_config, weights=weights, metadata=meta)


def load_gguf_tokenizer(path: str | Path):
    """A transformers fast tokenizer (with the chat template) built from the GGUF metadata,
    offline. Returns None when the file carries no tokenizer."""
    from transformers import AutoTokenizer

    path = Path(path)
    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    except Exception as e:
        import gguf

        reader = gguf.GGUFReader(str(path))
        if "tokenizer.ggml.tokens" not in reader.fields:
            return None
        raise ValueError(f"{path}: could not build a tokenizer from the GGUF metadata ({e})") from e
    pin_special_tokens(tok, read_metadata(_open(path), path))
    return tok


def pin_special_tokens(tok, meta: dict[str, Any]) -> None:
    """Set the tokenizer's bos / eos to the GGUF's own ``tokenizer.ggml.{bos,eos}_token_id`` where the
    conversion named others: transformers 5.17's Llama-3-mode converter swapped SmolLM2's (eos
    ``<|im_start|>``, found on the H200 host in session 43), so generation would also stop at a turn's
    start and the saved cache would keep the wrong pair."""
    for name in ("bos", "eos"):
        want = meta.get(f"tokenizer.ggml.{name}_token_id")
        if want is None or not 0 <= int(want) < len(tok) or getattr(tok, f"{name}_token_id") == int(want):
            continue
        setattr(tok, f"{name}_token", tok.convert_ids_to_tokens(int(want)))
