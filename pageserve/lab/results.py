"""The verification record: every notebook's last cell writes what it measured here.

Format: notebook, hardware, torch, git_commit, git_dirty, git_commit_source, date,
parameters, figures. ``figures`` holds plain numbers written by the code that measured
them. ``provenance()`` gives the git fields alone, for scripts that write their own JSON.
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


def _git(*args: str) -> str:
    root = Path(__file__).resolve().parents[2]
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True, timeout=30).stdout


def provenance() -> dict:
    """Which code produced a result, read from git, not declared:

    ``git_commit`` (``git rev-parse HEAD``), ``git_dirty`` (``git status --porcelain`` shows
    changes: the result may come from code no commit holds) and ``git_commit_source``.

    On the GPU machine the working tree is a copy whose ``.git`` (if any) is not the
    repository's: there the run is handed ``$PAGESERVE_GIT_COMMIT`` and
    ``$PAGESERVE_GIT_DIRTY`` (0/1), both computed by ``git`` on the machine that sent the
    tree, and they win (``git_commit_source: "env"``). Otherwise the local repository
    answers (``"git"``); with neither, ``git_commit: "unknown"``."""
    env = os.environ.get("PAGESERVE_GIT_COMMIT")
    if env:
        dirty = os.environ.get("PAGESERVE_GIT_DIRTY")
        return {"git_commit": env, "git_dirty": None if dirty is None else dirty.strip() not in ("", "0"),
                "git_commit_source": "env"}
    try:
        commit = _git("rev-parse", "HEAD").strip()
        dirty = bool(_git("status", "--porcelain").strip())
        return {"git_commit": commit, "git_dirty": dirty, "git_commit_source": "git"}
    except (OSError, subprocess.SubprocessError):
        pass
    return {"git_commit": "unknown", "git_dirty": None, "git_commit_source": "none"}


def git_commit() -> str:
    """The commit of ``provenance()``."""
    return provenance()["git_commit"]


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
    default = Path(__file__).resolve().parents[2] / "results" / "local"  # the repo's results/, not pageserve/
    out_dir = Path(out_dir or os.environ.get("PAGESERVE_RESULTS_DIR") or default)
    out_dir.mkdir(parents=True, exist_ok=True)
    record = {
        "notebook": notebook,
        "hardware": hardware_name(),
        "torch": torch.__version__,
        **provenance(),
        "date": datetime.date.today().isoformat(),
        "parameters": {k: _plain(v) if not isinstance(v, (list, dict, tuple)) else v for k, v in parameters.items()},
        "figures": {k: _plain(v) for k, v in figures.items()},
    }
    path = out_dir / f"{notebook}.json"
    path.write_text(json.dumps(record, indent=2, default=str) + "\n")
    return path
