"""vLLM 0.26's price for batch invariance on its own, in fresh processes on an idle GPU: the W1 and
decode timings of notebook 09's comparison (``determinism.vllm_batch_invariant_cost``), one vLLM
process with ``VLLM_BATCH_INVARIANT=0`` and one with ``=1``. 09 runs the same after its own engines,
in the notebook's process, where vLLM's start-up memory check can fail; this runs it alone.

    python scripts/vllm_cost.py --out DIR [--model qwen2.5-3b] [--gpu-memory-utilization 0.85]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pageserve.lab import determinism  # noqa: E402
from pageserve.lab.peers import run_peer  # noqa: E402
from pageserve.lab.results import provenance  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="qwen2.5-3b")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    a = p.parse_args()
    w1 = {"w1": {"num_requests": 500, "prompt_len": 512, "output_len": 256}}  # 09's W1 on the GPU
    decode = {"batches": [1, 64], "context_len": 512, "steps": 32}  # 09's decode timings on the GPU
    args = {"gpu_memory_utilization": a.gpu_memory_utilization, "max_model_len": 4096}
    runs = Path(a.out) / "vllm_cost_runs"  # each process's own record, kept if the stage's time runs out
    runs.mkdir(parents=True, exist_ok=True)
    figures = determinism.vllm_batch_invariant_cost(
        run_peer, a.model, w1, decode, str(runs), args,
        log=lambda s: print(s, flush=True), device="cuda", dtype="bfloat16", seed=0, timeout_s=900)
    record = {**provenance(), "script": "scripts/vllm_cost.py", "model": a.model, "workloads": w1, "decode": decode,
              "engine_args": args, "figures": figures}
    Path(a.out).mkdir(parents=True, exist_ok=True)
    path = Path(a.out) / "vllm_batch_invariant_cost.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(figures, indent=1))
    print("wrote", path)


if __name__ == "__main__":
    main()
