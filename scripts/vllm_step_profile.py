"""vLLM 0.26's decode step, kernel by kernel, beside pageserve's (issue 14's batch-64 bar): which of its
kernels are faster or slower than ours at the same shape.

    python scripts/vllm_step_profile.py --out DIR [--batches 64] [--context 512] [--steps 32]

vLLM runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the profiler sees its kernels, graph replays
included), Qwen2.5-3B shape, bf16, dummy weights, its defaults otherwise (``gpu_memory_utilization`` 0.85,
``max_model_len`` 4096, as 08's). A step cannot be profiled alone through ``LLM.generate``, so for each batch
the script profiles ``generate`` of ``batch`` random ``context``-token prompts to 1 token and to 1 + ``steps``
tokens (the same prompts each time: after the first call vLLM's prefix cache serves them in both, so their
prefill cancels all the more), and keeps what the extra steps add (``lab.profiling.difference_per_step``): per kernel, device µs and
launches a step. The wall time a step (``decode_ms``, by the same subtraction, unprofiled: 08's figure) comes
with it. Writes ``vllm_step_profile.json`` (``batches.<b>.kernels``: name, category, us, launches;
``categories_us``; ``kernel_us``; ``decode_ms``) and prints the top kernels. pageserve's side is
``scripts/profile_steps.py`` (its per-layer chain shares) in the same call.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process: its kernels profiled
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from pageserve.lab.peers import VllmRunner, workload_vocab  # noqa: E402
from pageserve.lab.profiling import by_category, difference_per_step, profile_kernels  # noqa: E402
from pageserve.lab.results import provenance  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="qwen2.5-3b")
    ap.add_argument("--batches", default="64")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--top", type=int, default=16)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("vllm_step_profile profiles CUDA kernels: it needs a GPU")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rec = {**provenance(), "model": a.model, "context": a.context, "steps": a.steps, "batches": {}}
    t0 = time.perf_counter()
    runner = VllmRunner(a.model, dtype="bfloat16", gpu_memory_utilization=0.85, max_model_len=4096)
    rec["startup_s"] = time.perf_counter() - t0
    vocab = workload_vocab(a.model)
    gen = torch.Generator().manual_seed(0)
    for b in (int(x) for x in a.batches.split(",")):
        prompts = torch.randint(0, vocab, (b, a.context), generator=gen).tolist()
        rec["batches"][b] = row = runner.decode(b, a.context, a.steps, vocab, seed=1)
        base = profile_kernels(lambda: runner.generate_ids(prompts, 1), repeats=2)
        full = profile_kernels(lambda: runner.generate_ids(prompts, 1 + a.steps), repeats=2)
        rows = difference_per_step(full, base, a.steps)
        row["kernel_us"] = sum(r.us for r in rows)
        row["categories_us"] = by_category(rows)
        row["kernels"] = [{"name": r.name, "category": r.category, "us": r.us, "launches": r.launches} for r in rows]
        print(f"== vLLM decode batch {b} x {a.context}: {row['decode_ms']:.3f} ms a step (subtraction), kernels "
              f"{row['kernel_us']:.0f} us a step", flush=True)
        for r in rows[:a.top]:
            print(f"  {r.us:9.1f} us {r.launches:5d} launches  {r.category:10s} {r.name[:110]}", flush=True)
        (out / "vllm_step_profile.json").write_text(json.dumps(rec, indent=1))


if __name__ == "__main__":
    main()
