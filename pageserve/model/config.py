"""The model's shape (from an HF config.json or a shipped config) and the dtype rule.

A dataclass that validates itself; ``ModelConfig.shipped(name)`` reads ``configs/<name>.json``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
SHIPPED_CONFIGS = Path(__file__).parent / "configs"


@dataclass
class ModelConfig:
    """The shape of a Llama-, Qwen2- or Qwen3-family decoder, read from an HF ``config.json``."""

    architecture: str  # "llama", "qwen2" or "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v bias (Qwen2 always has it)
    qk_norm: bool = False  # RMSNorm over each head's q and k before RoPE (Qwen3)
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    torch_dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model config: {name} must be positive, got {getattr(self, name)}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        archs = d.get("architectures") or []
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            arch = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}.get(d.get("model_type", ""))
        if arch is None:
            raise ValueError(
                f"{source}: unsupported architecture {archs or d.get('model_type')!r}; "
                f"pageserve supports {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        try:
            hidden = d["hidden_size"]
            num_heads = d["num_attention_heads"]
            eos = d.get("eos_token_id")
            return cls(
                architecture=arch,
                vocab_size=d["vocab_size"],
                hidden_size=hidden,
                intermediate_size=d["intermediate_size"],
                num_layers=d["num_hidden_layers"],
                num_heads=num_heads,
                num_kv_heads=d.get("num_key_value_heads") or num_heads,
                head_dim=d.get("head_dim") or hidden // num_heads,
                rope_theta=float(d.get("rope_theta", (d.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
                rope_scaling=_rope_scaling(d),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                attention_bias=True if arch == "qwen2" else bool(d.get("attention_bias", False)),
                qk_norm=arch == "qwen3",
                max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
                bos_token_id=d.get("bos_token_id"),
                eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
                torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "bfloat16"),
            )
        except KeyError as e:
            raise ValueError(f"{source}: missing required key {e.args[0]!r}") from None

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"model config not found: {path}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        return cls.from_hf_dict(d, source=str(path))

    @classmethod
    def shipped(cls, name: str) -> "ModelConfig":
        """A config shipped with the package: ``qwen2.5-3b``, ``qwen2.5-0.5b``, ``smollm2-135m``…"""
        path = SHIPPED_CONFIGS / f"{name}.json"
        if not path.exists():
            known = sorted(p.stem for p in SHIPPED_CONFIGS.glob("*.json"))
            raise ValueError(f"no shipped config named {name!r}; known: {known}")
        return cls.from_json(path)


def _rope_scaling(d: dict[str, Any]) -> dict | None:
    rs = d.get("rope_scaling") or d.get("rope_parameters")
    if not rs:
        return None
    kind = rs.get("rope_type") or rs.get("type") or "default"
    if kind == "default":
        return None
    return dict(rs, rope_type=kind)


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device) -> torch.dtype:
    """``auto`` is bf16 where the device supports it (CPU, Ampere and newer), else fp16 (T4)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {
        "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
        "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
        "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    }
    if dtype in names:
        return names[dtype]
    if dtype != "auto":
        raise ValueError(f"unknown dtype {dtype!r}; use auto, float32, bfloat16 or float16")
    device = torch.device(device)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16
    return torch.float32 if device.type == "cpu" else torch.bfloat16
