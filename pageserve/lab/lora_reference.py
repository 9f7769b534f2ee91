"""LoRA's plain reference and test adapters: an adapter merged into a copy of the model's weights
(W + s B A, what every row of that adapter must compute), and PEFT-format adapter folders of random
weights for any model shape (no PEFT install, no hub)."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from ..model.lora import LoRAAdapter, module_shapes

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_peft_adapter(folder: str | Path, cfg, rank: int = 8, alpha: float = 16, seed: int = 0,
                       modules: tuple[str, ...] = ALL_MODULES, std: float = 0.05, layers=None,
                       config_extra: dict | None = None) -> Path:
    """A PEFT LoRA folder (``adapter_config.json`` + ``adapter_model.safetensors``, PEFT's tensor names) with
    normal(0, std) A and B for ``modules`` of ``layers`` (default all) of a model of shape ``cfg``."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    shapes = module_shapes(cfg)
    tensors = {}
    for layer in range(cfg.num_layers) if layers is None else layers:
        for m in modules:
            d_in, d_out = shapes[m]
            block = "self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            name = f"base_model.model.model.layers.{layer}.{block}.{m}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, d_in, generator=gen) * std
            tensors[f"{name}.lora_B.weight"] = torch.randn(d_out, rank, generator=gen) * std
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    conf = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(modules), "bias": "none",
            "task_type": "CAUSAL_LM"} | (config_extra or {})
    (folder / "adapter_config.json").write_text(json.dumps(conf))
    return folder


@torch.no_grad()
def merged_model(model, adapter: LoRAAdapter):
    """A copy of ``model`` (a ``Decoder``) with ``adapter`` merged into its float weights."""
    cfg = model.cfg
    merged = copy.deepcopy(model)
    merged.set_lora(None)
    qs, ks, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    for i, layer in enumerate(merged.layers):
        at, mlp = layer.self_attn, layer.mlp
        parts = [
            (at.qkv_proj.weight, "q_proj", 0, qs), (at.qkv_proj.weight, "k_proj", qs, ks),
            (at.qkv_proj.weight, "v_proj", qs + ks, ks), (at.o_proj.weight, "o_proj", 0, cfg.hidden_size),
            (mlp.gate_up_proj.weight, "gate_proj", 0, inter), (mlp.gate_up_proj.weight, "up_proj", inter, inter),
            (mlp.down_proj.weight, "down_proj", 0, cfg.hidden_size),
        ]
        for weight, module, start, rows in parts:
            rows_view = weight.narrow(0, start, rows)
            rows_view.copy_(adapter.merged_into(rows_view.clone(), i, module))
    return merged
