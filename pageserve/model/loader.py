"""``load_model``: one entry point for every way of naming a model.

``model`` may be
  * a local HF model directory (config.json + model.safetensors, or shards listed in
    model.safetensors.index.json); the tokenizer comes from the same directory;
  * an HF hub id (``Qwen/Qwen2.5-3B-Instruct``) that is not a local path, fetched with
    ``huggingface_hub.snapshot_download`` (config, json, safetensors, tokenizer files);
  * a ``.gguf`` file (weights dequantized, tokenizer and chat template from its metadata);
  * ``dummy:<shipped config>`` or ``dummy:/path/config.json``: random weights, no tokenizer;
  * ``smollm2-135m-instruct`` (the default): real SmolLM2 weights, see default_model.py;
  * the aliases ``qwen2.5-3b``, ``qwen2.5-0.5b``, ``smollm2-135m``: random weights of the
    shipped config (same as ``dummy:<name>``), for benchmarks at a real model's shape.

An HF directory's ``generation_config.json`` also gives the model's sampling defaults
(``LoadedModel.sampling_defaults``, see ``sampling_defaults``); GGUF files and random weights
have none.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch

from .config import SHIPPED_CONFIGS, ModelConfig, resolve_dtype
from .default_model import DEFAULT_MODEL, default_model_dir
from .decoder import Decoder
from .quant import check_quantization, quantize_model
from .tokenizer import Tokenizer

DUMMY_ALIASES = ("qwen2.5-3b", "qwen2.5-0.5b", "smollm2-135m")
DEFAULT_MAX_MODEL_LEN = 32768
HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt", "*.jinja"]
# generation_config.json's sampling fields -> their SamplingParams names, the ones vLLM reads
# (do_sample is not: a file with temperature 0.7 and do_sample false still samples at 0.7)
GENERATION_CONFIG_SAMPLING_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                                     "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                                     "max_new_tokens": "max_tokens"}


class ModelLoadError(ValueError):
    """The model, as named, cannot be loaded here (unknown name, hub unreachable, default
    model not fetchable); the message says why and what to pass instead."""


@dataclass
class LoadedModel:
    model: Decoder  # eval mode, on its device and dtype
    config: ModelConfig
    tokenizer: Tokenizer | None  # None for dummy weights
    source: str  # where the weights came from (a path, a hub id, or "dummy:<config>")
    # SamplingParams keywords from the directory's generation_config.json (``sampling_defaults``);
    # empty for GGUF files, random weights and a directory whose file sets none
    sampling_defaults: dict[str, Any] = field(default_factory=dict)

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def eos_token_ids(self) -> list[int]:
        return self.tokenizer.eos_token_ids if self.tokenizer else list(self.config.eos_token_ids)


def resolve_device(device: str | torch.device) -> torch.device:
    """``auto`` is cuda when available, else cpu. Raises ValueError for a device this torch
    cannot use (a malformed name, or cuda on a CPU-only build or a machine with no GPU)."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {str(device)!r}; use auto, cpu, cuda or cuda:<index>") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch was built without CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise ValueError(f"device {str(device)!r} asked for, but {why} (torch {torch.__version__}); use device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {str(device)!r} asked for, but only {torch.cuda.device_count()} GPU(s) are visible")
    elif dev.type not in ("cpu", "meta"):
        raise ValueError(f"device {str(device)!r} is not supported; use auto, cpu, cuda or cuda:<index>")
    return dev


def build_decoder(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, max_model_len: int) -> Decoder:
    """An (uninitialised-weights) Decoder allocated directly on ``device`` in ``dtype``,
    so a large model never exists in fp32 on the CPU."""
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Decoder(cfg, max_positions=max_model_len)
    finally:
        torch.set_default_dtype(prev)
    return model.eval().requires_grad_(False)


def load_model(model: str = DEFAULT_MODEL, device: str | torch.device = "auto", dtype: str | torch.dtype = "auto",
               seed: int = 0, max_model_len: int | None = None, quantization: str | None = None) -> LoadedModel:
    """Load ``model`` (see the module docstring for the accepted forms) on ``device`` in
    ``dtype``; RoPE tables cover ``max_model_len`` positions (default: the config's
    max_position_embeddings, capped at 32768). ``quantization="int8"``: the decoder's linears
    become int8 weight-only (``model.quant.quantize_model``) once the float weights are loaded,
    whatever the checkpoint format, one projection at a time."""
    check_quantization(quantization)
    loaded = _load_float(model, device, dtype, seed, max_model_len)
    quantize_model(loaded.model, quantization)
    return loaded


def _load_float(model, device, dtype, seed, max_model_len) -> LoadedModel:
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    name = str(model)

    if name.startswith("dummy:"):
        return _load_dummy(name.removeprefix("dummy:"), device, dtype, seed, max_model_len)
    if name.lower() in DUMMY_ALIASES:
        return _load_dummy(name.lower(), device, dtype, seed, max_model_len)
    if name.lower() == DEFAULT_MODEL:
        try:
            model_dir = default_model_dir()
        except RuntimeError as e:
            raise ModelLoadError(str(e)) from None
        loaded = _load_hf_dir(model_dir, device, dtype, max_model_len)
        loaded.source = DEFAULT_MODEL
        return loaded

    path = Path(name).expanduser()
    if path.is_dir():
        return _load_hf_dir(path, device, dtype, max_model_len)
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return _load_gguf(path, device, dtype, max_model_len)
        raise ValueError(f"{path}: not a model; pass an HF model directory or a .gguf file")
    if name.lower().endswith((".gguf", ".json", ".safetensors")) or name.startswith(("/", ".", "~")):
        raise FileNotFoundError(f"model path not found: {path}; pass an existing .gguf file or HF model directory")
    if _looks_like_hub_id(name):
        return _load_hf_dir(_download(name), device, dtype, max_model_len, source=name)
    raise ModelLoadError(
        f"unknown model {name!r}: not a local path, not a hub id (org/name); known names: "
        f"{[DEFAULT_MODEL, *DUMMY_ALIASES]} and 'dummy:<config>' with configs "
        f"{sorted(p.stem for p in SHIPPED_CONFIGS.glob('*.json'))}"
    )


def _max_len(cfg: ModelConfig, max_model_len: int | None) -> int:
    return max_model_len or min(cfg.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)


def _load_dummy(spec: str, device, dtype, seed, max_model_len) -> LoadedModel:
    if spec.endswith(".json") or "/" in spec:
        cfg = ModelConfig.from_json(Path(spec).expanduser())
    else:
        cfg = ModelConfig.shipped(spec)
    model = build_decoder(cfg, device, dtype, _max_len(cfg, max_model_len))
    model.init_dummy_weights(seed)
    return LoadedModel(model, cfg, None, f"dummy:{spec}")


def _looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not any(c.isspace() for c in name)


def _download(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_PATTERNS))
    except Exception as e:
        why = " ".join(str(e).split())  # hub errors span lines; this message is one
        if len(why) > 300:
            why = why[:300] + "…"
        raise ModelLoadError(
            f"could not fetch {repo_id!r} from the Hugging Face hub ({type(e).__name__}: {why}); "
            "pass a local model directory or .gguf file instead"
        ) from None


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{index}: not a valid safetensors index ({e})") from None
        files = [path / f for f in dict.fromkeys(weight_map.values())]
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"{index} lists {f.name}, which is missing from {path}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        other = [p.name for p in path.glob("*.bin")] + [p.name for p in path.glob("*.gguf")]
        hint = f" (found {other[:3]}; only safetensors are read from a directory, pass a .gguf file directly)" if other else ""
        raise FileNotFoundError(f"{path}: no .safetensors weights{hint}")
    return files


def _iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                yield key, st.get_tensor(key)


def _read_generation_config(folder: Path) -> dict[str, Any]:
    """``folder/generation_config.json`` as a dict ({} when there is none)."""
    path = Path(folder).expanduser() / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        gen = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(gen, dict):
        raise ValueError(f"{path}: must hold a JSON object, got {type(gen).__name__}")
    return gen


def sampling_defaults(folder: str | Path) -> dict[str, Any]:
    """The sampling defaults in ``folder/generation_config.json``, as ``SamplingParams`` keywords:
    every one of temperature, top_p, top_k, min_p, repetition_penalty that the file sets (not
    null), and max_new_tokens as ``max_tokens``. {} when the folder has no such file."""
    return _sampling_fields(_read_generation_config(Path(folder)))


def _sampling_fields(gen: dict[str, Any]) -> dict[str, Any]:
    return {name: gen[key] for key, name in GENERATION_CONFIG_SAMPLING_FIELDS.items() if gen.get(key) is not None}


def _load_hf_dir(path: Path, device, dtype, max_model_len, source: str | None = None) -> LoadedModel:
    config_path = path / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{path}: no config.json (not an HF model directory)")
    cfg = ModelConfig.from_json(config_path)
    eos = list(cfg.eos_token_ids)
    gen = _read_generation_config(path)
    gen_eos = gen.get("eos_token_id")
    eos += [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
    files = _safetensors_files(path)
    model = build_decoder(cfg, device, dtype, _max_len(cfg, max_model_len))
    model.load_weights(_iter_safetensors(files), source=str(files[0] if len(files) == 1 else path))
    tokenizer = None
    if any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")):
        from transformers import AutoTokenizer

        tokenizer = Tokenizer(AutoTokenizer.from_pretrained(str(path)), eos_token_ids=eos)
    return LoadedModel(model, cfg, tokenizer, source or str(path), _sampling_fields(gen))


def _load_gguf(path: Path, device, dtype, max_model_len) -> LoadedModel:
    from .gguf_loader import load_gguf, load_gguf_tokenizer

    contents = load_gguf(path)
    cfg = contents.config
    model = build_decoder(cfg, device, dtype, _max_len(cfg, max_model_len))
    model.load_weights(contents.weights.items(), source=str(path))
    hf_tok = load_gguf_tokenizer(path)
    tokenizer = Tokenizer(hf_tok, eos_token_ids=cfg.eos_token_ids) if hf_tok is not None else None
    return LoadedModel(model, cfg, tokenizer, str(path))
