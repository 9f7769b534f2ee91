"""LoRA adapters: read from a PEFT folder, applied to a batch where each row may use its own.

An adapter changes a linear ``y = x W^T`` into ``y = x W^T + s (x A^T) B^T`` (A: [r, in], B: [out, r],
s = lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA). The decoder stores q|k|v and gate|up fused, so an
adapter's q/k/v (gate/up) pairs are placed side by side in one low-rank product of the fused projection.

``LoRASlots`` holds ``max_loras`` adapters on the device at once and applies them to a mixed batch in two
products per projection, whatever the mix: every slot's A stacked [S * P * R, in] (S slots, P parts of the
fused projection, R = max rank, smaller ranks padded with zeros), the rows' products with all of them
masked to the columns of each row's own slot, then every slot's B stacked [out, S * P * R], the scale folded
in. A row with no adapter (slot -1) gets an exact zero. The shapes never change, and the row -> slot map is a
device buffer written before each forward, so the same code runs eagerly and inside a captured CUDA graph
(vLLM's punica kernels gather per-row adapters instead; this costs S times the rank's flops, small at the
ranks adapters use). By default the layers run unfused and both products go through the ops' ``linear`` (the
tuned GEMVs at decode sizes; in the deterministic mode its invariant products, so each row's bits stay
independent of the batch here too). With ``LoRASlots.USE_KERNELS`` on, the Triton ops keep their fused projections
(the norms inside qkv's and gate_up's, SiLU·mul inside down's): the masked first product is one launch that
applies the same norm or SiLU·mul to its input itself (``kernels/lora.py``; the reference below sm_80), and the
second adds itself into the projection's output (``addmm_``). Off since session 48: slower with adapters in use
on the H100 (1.70x plain at batch 1 against the unfused path's 1.54x).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from ..kernels.lora import COUNTERS as LORA_COUNTERS
from .config import ModelConfig

# PEFT module name -> (fused projection, part index)
MODULE_PARTS = {
    "q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0),
}
PROJ_PARTS = {"qkv": 3, "o": 1, "gate_up": 2, "down": 1}
ADAPTER_FILES = ("adapter_model.safetensors", "adapter_model.bin")


def module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of each adapted module of one layer."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    return {
        "q_proj": (h, cfg.q_size), "k_proj": (h, cfg.kv_size), "v_proj": (h, cfg.kv_size), "o_proj": (cfg.q_size, h),
        "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h),
    }


def proj_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of each fused projection of one layer."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    return {"qkv": (h, cfg.q_size + 2 * cfg.kv_size), "o": (cfg.q_size, h), "gate_up": (h, 2 * i), "down": (i, h)}


@dataclass
class LoRAAdapter:
    """One adapter on the host: ``weights[(layer, module)] = (A [r, in], B [out, r])`` in fp32, and its scale."""

    path: str
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @classmethod
    def load(cls, path: str | Path, cfg: ModelConfig, max_rank: int) -> "LoRAAdapter":
        """Read a PEFT adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``) for a model of
        shape ``cfg``. ValueError, naming the file and the tensor, for anything this engine cannot apply
        exactly: a rank over ``max_rank``, per-module ranks or alphas, adapted biases, embeddings or output
        head, DoRA, a layer or shape the model does not have."""
        folder, conf = read_adapter_config(path)
        conf_file = folder / "adapter_config.json"
        if str(conf.get("peft_type", "LORA")).upper() != "LORA":
            raise ValueError(f"{conf_file}: peft_type {conf.get('peft_type')!r} is not LORA")
        rank, alpha = conf.get("r"), conf.get("lora_alpha", conf.get("r"))
        if not isinstance(rank, int) or rank <= 0 or not isinstance(alpha, (int, float)):
            raise ValueError(f"{conf_file}: r must be a positive integer and lora_alpha a number, got "
                             f"r={rank!r}, lora_alpha={alpha!r}")
        if rank > max_rank:
            raise ValueError(f"LoRA adapter {str(path)!r}: rank {rank} is over max_lora_rank {max_rank}; start the "
                             f"engine with max_lora_rank >= {rank} (--max-lora-rank)")
        unsupported = {
            "rank_pattern": "per-module ranks", "alpha_pattern": "per-module alphas",
            "modules_to_save": "fully trained modules", "use_dora": "DoRA", "fan_in_fan_out": "fan_in_fan_out",
        }
        for key, what in unsupported.items():
            if conf.get(key):
                raise ValueError(f"{conf_file}: {what} ({key}) are not supported")
        if conf.get("bias", "none") != "none":
            raise ValueError(f"{conf_file}: adapted biases (bias={conf['bias']!r}) are not supported")
        scaling = alpha / math.sqrt(rank) if conf.get("use_rslora") else alpha / rank
        tensors = _read_tensors(folder)
        shapes = module_shapes(cfg)
        pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        for name, t in tensors.items():
            parts = name.split(".")
            try:
                at = parts.index("layers")
                layer, module, which = int(parts[at + 1]), parts[-3], parts[-2]
            except (ValueError, IndexError):
                raise ValueError(f"LoRA adapter {str(path)!r}: tensor {name!r} is not a decoder layer's "
                                 "(only the attention and MLP projections can be adapted)") from None
            if module not in MODULE_PARTS or which not in ("lora_A", "lora_B") or parts[-1] != "weight":
                raise ValueError(f"LoRA adapter {str(path)!r}: tensor {name!r} is not supported (the adapted "
                                 f"modules must be among {sorted(MODULE_PARTS)}, with lora_A / lora_B weights)")
            if not 0 <= layer < cfg.num_layers:
                raise ValueError(f"LoRA adapter {str(path)!r}: tensor {name!r} names layer {layer}; the model has "
                                 f"{cfg.num_layers}")
            pairs.setdefault((layer, module), {})[which] = t
        weights = {}
        for (layer, module), ab in pairs.items():
            if set(ab) != {"lora_A", "lora_B"}:
                raise ValueError(f"LoRA adapter {str(path)!r}: layer {layer} {module} has only {sorted(ab)}")
            a, b = ab["lora_A"].float(), ab["lora_B"].float()
            d_in, d_out = shapes[module]
            if tuple(a.shape) != (rank, d_in) or tuple(b.shape) != (d_out, rank):
                raise ValueError(f"LoRA adapter {str(path)!r}: layer {layer} {module} has A {tuple(a.shape)} and B "
                                 f"{tuple(b.shape)}; this model needs A {(rank, d_in)} and B {(d_out, rank)}")
            weights[(layer, module)] = (a, b)
        if not weights:
            raise ValueError(f"LoRA adapter {str(path)!r}: it holds no lora_A / lora_B weights")
        return cls(str(folder), rank, float(scaling), weights)

    def merged_into(self, weight: torch.Tensor, layer: int, module: str) -> torch.Tensor:
        """``weight`` [out, in] of (layer, module) with this adapter merged: W + s B A (the reference)."""
        if (layer, module) not in self.weights:
            return weight
        a, b = (t.to(weight.device) for t in self.weights[(layer, module)])
        return (weight.float() + self.scaling * (b @ a)).to(weight.dtype)


def read_adapter_config(path: str | Path) -> tuple[Path, dict]:
    """(the adapter's local folder, its ``adapter_config.json``): a folder, or a hub id fetched first."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        from .loader import _looks_like_hub_id

        if not _looks_like_hub_id(str(path)):
            raise ValueError(f"LoRA adapter {str(path)!r}: no such folder (a PEFT adapter folder holding "
                             "adapter_config.json and adapter_model.safetensors, or a hub id)")
        folder = _download_adapter(str(path))
    conf_file = folder / "adapter_config.json"
    try:
        return folder, json.loads(conf_file.read_text())
    except FileNotFoundError:
        raise ValueError(f"LoRA adapter {str(path)!r}: no adapter_config.json") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{conf_file}: not valid JSON ({e})") from None


def _download_adapter(repo_id: str) -> Path:
    """A hub adapter's folder (``huggingface_hub``'s cache), as vLLM takes ``lora_path`` hub ids."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=["adapter_config.json", *ADAPTER_FILES]))
    except Exception as e:  # noqa: BLE001 - offline, unknown repo, no access: one message
        why = " ".join(str(e).split())[:300]
        raise ValueError(f"LoRA adapter {repo_id!r}: not a local folder, and the hub did not give it "
                         f"({type(e).__name__}: {why})") from None


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    st, binary = folder / ADAPTER_FILES[0], folder / ADAPTER_FILES[1]
    if st.is_file():
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(str(st))
        except SafetensorError as e:
            raise ValueError(f"{st}: not a readable safetensors file ({e})") from None
    if binary.is_file():
        try:
            return torch.load(binary, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any unreadable file is the adapter's fault
            raise ValueError(f"{binary}: not a readable PyTorch file ({type(e).__name__}: {e})") from None
    raise ValueError(f"LoRA adapter {str(folder)!r}: no {' or '.join(ADAPTER_FILES)}")


class LoRASlots:
    """``max_loras`` adapters on the device and the row -> slot map of the current forward (module docstring).

    ``token_slots`` [max_tokens] int64: the slot of each of a forward's rows (-1: none), written by the engine
    before the forward (``set_token_slots``); rows past the step's real ones (graph padding) hold stale values,
    which only change those rows."""

    # new slots' ``use_kernels``: the fused layer path with ``kernels/lora.py`` on the Triton ops. Off by default:
    # on the H100 (session 48, ``scripts/lora_bench.py``) it cost 1.70x plain at batch 1 with adapters in use
    # against the reference path's 1.54x (1.66 / 1.63 at 16, 1.63 / 1.66 at 64); it wins only when no row uses an
    # adapter (1.35x). The reference's products run the engine's tuned GEMVs, which one masked kernel launch with
    # its prologue and split-K tickets does not beat at decode sizes.
    USE_KERNELS = False

    def __init__(self, cfg: ModelConfig, max_loras: int, max_rank: int, max_tokens: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        if max_loras < 1 or max_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be positive, got {max_loras} and {max_rank}")
        self.cfg, self.max_loras, self.max_rank = cfg, max_loras, max_rank
        self.dtype, self.device = dtype, device
        shapes = proj_shapes(cfg)
        # per layer, per fused projection: A [S * P * R, in], B [out, S * P * R]
        self.a: list[dict[str, torch.Tensor]] = []
        self.b: list[dict[str, torch.Tensor]] = []
        for _ in range(cfg.num_layers):
            self.a.append({p: torch.zeros(max_loras * PROJ_PARTS[p] * max_rank, shapes[p][0], dtype=dtype,
                                          device=device) for p in shapes})
            self.b.append({p: torch.zeros(shapes[p][1], max_loras * PROJ_PARTS[p] * max_rank, dtype=dtype,
                                          device=device) for p in shapes})
        self.token_slots = torch.full((max_tokens,), -1, dtype=torch.int64, device=device)
        # the slot each stacked rank column belongs to, per parts count
        self.column_slots = {n: torch.arange(max_loras * n * max_rank, device=device) // (n * max_rank)
                             for n in set(PROJ_PARTS.values())}
        self._masks: dict[int, torch.Tensor] = {}
        self.use_kernels = LoRASlots.USE_KERNELS
        # the shrink kernel's split-K tickets (zeros at rest), made here, before any graph is captured
        self.counters = torch.zeros(LORA_COUNTERS, dtype=torch.int32, device=device)

    @property
    def max_tokens(self) -> int:
        return self.token_slots.shape[0]

    def set_token_slots(self, slots: torch.Tensor) -> None:
        """Write the slots of a forward's first ``len(slots)`` rows (a device copy: stream-ordered)."""
        if slots.shape[0] > self.max_tokens:
            raise RuntimeError(f"a step of {slots.shape[0]} rows is over the LoRA row buffer ({self.max_tokens})")
        self.token_slots[: slots.shape[0]].copy_(slots, non_blocking=True)

    @torch.no_grad()
    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Put ``adapter`` in ``slot`` (in place: captured graphs read the same buffers)."""
        self.clear(slot)
        shapes = module_shapes(self.cfg)
        R = self.max_rank
        for (layer, module), (a, b) in adapter.weights.items():
            proj, part = MODULE_PARTS[module]
            width = PROJ_PARTS[proj] * R
            col = slot * width + part * R  # this module's rank columns in the stack
            out0 = _out_offset(self.cfg, module)
            r = a.shape[0]
            self.a[layer][proj][col:col + r].copy_(a.to(self.device, self.dtype))
            self.b[layer][proj][out0:out0 + shapes[module][1], col:col + r].copy_(
                (b * adapter.scaling).to(self.device, self.dtype))

    @torch.no_grad()
    def clear(self, slot: int) -> None:
        for layer in range(self.cfg.num_layers):
            for proj, n in PROJ_PARTS.items():
                width = n * self.max_rank
                self.a[layer][proj][slot * width:(slot + 1) * width].zero_()
                self.b[layer][proj][:, slot * width:(slot + 1) * width].zero_()

    def begin(self, num_rows: int, ops=None) -> None:
        """A forward of ``num_rows`` rows starts: build each row's column mask from ``token_slots`` (not on the
        fused path, ``fused_for(ops)``, whose kernel reads the slots itself)."""
        if num_rows > self.max_tokens:
            raise RuntimeError(f"a forward of {num_rows} rows is over the LoRA row buffer ({self.max_tokens})")
        if ops is not None and self.fused_for(ops):
            return
        rows = self.token_slots[:num_rows, None]
        self._masks = {n: cols[None, :] == rows for n, cols in self.column_slots.items()}

    def fused_for(self, ops) -> bool:
        """Whether a layer may keep its fused projections (``DecoderLayer._forward_lora_fused``): the Triton ops,
        unless ``use_kernels`` is off. Otherwise (the reference and the deterministic ops) every product goes through
        ``ops.linear`` on unfused inputs."""
        return self.use_kernels and ops.lora_kernels

    def add(self, ops, layer: int, proj: str, x: torch.Tensor, y: torch.Tensor, norm=None,
            silu_mul: bool = False) -> torch.Tensor:
        """``y`` (the base projection of ``x``) plus each row's adapter: y + ((x A^T) masked) B^T (a select, not a
        product with the mask: another slot's inf times 0 would be NaN). With ``fused_for(ops)`` the masked product
        is one launch (``ops.lora_shrink``) and the second adds itself into ``y`` (``addmm_``: a row of zeros adds
        exactly 0); there ``norm`` (an ``RMSNorm``: x is its input) or ``silu_mul`` (x is gate|up) is applied to x
        inside that launch. Otherwise both go through ``ops.linear`` (the reference, the deterministic ops'
        invariant products), and x is the product's input as it is."""
        a, b = self.a[layer][proj], self.b[layer][proj]
        if self.fused_for(ops):
            low = ops.lora_shrink(x, a, self.token_slots, PROJ_PARTS[proj] * self.max_rank,
                                  None if norm is None else norm.weight, 0.0 if norm is None else norm.eps, silu_mul,
                                  counters=self.counters)
            return y.addmm_(low, b.t())  # [T, S*P*R] @ [S*P*R, out] into y
        if norm is not None or silu_mul:
            raise RuntimeError("LoRASlots.add: a prologue needs the fused path (fused_for)")
        low = torch.where(self._masks[PROJ_PARTS[proj]], ops.linear(x, a, None), 0.0)  # [T, S*P*R]
        return y + ops.linear(low, b, None)


def _out_offset(cfg: ModelConfig, module: str) -> int:
    """Where a module's output rows start in its fused projection."""
    return {"k_proj": cfg.q_size, "v_proj": cfg.q_size + cfg.kv_size, "up_proj": cfg.intermediate_size}.get(module, 0)
