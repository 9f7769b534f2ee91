"""The verification record: every notebook's last cell writes what it measured here.

Format (../shared/RESULTS.md): notebook, hardware, torch, git_commit, date, parameters,
figures. ``figures`` holds plain numbers written by the code that measured them.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import subprocess
from pathlib import Path

import torch


def hardware_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    import platform

    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def git_commit() -> str:
    """$PAGESERVE_GIT_COMMIT when set (a copied working tree's .git can be stale), else HEAD."""
    if os.environ.get("PAGESERVE_GIT_COMMIT"):
        return os.environ["PAGESERVE_GIT_COMMIT"]
    try:
        root = Path(__file__).resolve().parent.parent
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
    except Exception:
        return "unknown"


def _plain(x):
    if isinstance(x, torch.Tensor):
        x = x.item()
    if isinstance(x, bool):
        return int(x)
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def write_figures(
    notebook: str, parameters: dict, figures: dict, out_dir: str | os.PathLike | None = None
) -> Path:
    """Write ``<out_dir>/<notebook>.json`` and return its path.

    ``out_dir`` defaults to ``$PAGESERVE_RESULTS_DIR`` or ``results/<hardware>``-style
    ``results/local`` so CPU smoke runs never overwrite the committed GPU record.
    """
    default = Path(__file__).resolve().parent.parent / "results" / "local"
    out_dir = Path(out_dir or os.environ.get("PAGESERVE_RESULTS_DIR") or default)
    out_dir.mkdir(parents=True, exist_ok=True)
    record = {
        "notebook": notebook,
        "hardware": hardware_name(),
        "torch": torch.__version__,
        "git_commit": git_commit(),
        "date": datetime.date.today().isoformat(),
        "parameters": {k: _plain(v) if not isinstance(v, (list, dict, tuple)) else v for k, v in parameters.items()},
        "figures": {k: _plain(v) for k, v in figures.items()},
    }
    path = out_dir / f"{notebook}.json"
    path.write_text(json.dumps(record, indent=2, default=str) + "\n")
    return path
