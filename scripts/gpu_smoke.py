"""A quick engine check on the GPU, before the full notebook run: W1 throughput at the 3B
shape and single-step decode timings, eager and graphed. Prints a table; writes JSON.

    python scripts/gpu_smoke.py --out /tmp/out [--num-requests 500]
"""
from __future__ import annotations

import argparse
import json
import time
import traceback

import torch

from pageserve import LLM
from pageserve.lab.bench import random_workload, run_pageserve, warmup


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/out")
    ap.add_argument("--model", default="qwen2.5-3b")
    ap.add_argument("--num-requests", type=int, default=500)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--eager", action="store_true")
    args = ap.parse_args()
    figures: dict = {}
    try:
        t0 = time.perf_counter()
        llm = LLM(model=args.model, dtype="bfloat16", max_num_seqs=512, max_num_batched_tokens=8192,
                  max_model_len=2048, enforce_eager=args.eager)
        figures["load_s"] = time.perf_counter() - t0
        vocab = llm.engine.model_config.vocab_size if hasattr(llm.engine, "model_config") else 151936
        warmup(llm, vocab)
        w = random_workload(args.num_requests, args.prompt_len, args.output_len, vocab, seed=0)
        res = run_pageserve(llm, w)
        figures.update({f"w1_{k}": v for k, v in res.__dict__.items() if isinstance(v, (int, float))})
        print("W1", {k: v for k, v in res.__dict__.items() if isinstance(v, (int, float))})
    except Exception:
        traceback.print_exc()
    print(json.dumps(figures, indent=1, default=str))
    import os

    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_smoke.json"), "w") as f:
        json.dump(figures, f, indent=1, default=str)
    print("max mem GiB", torch.cuda.max_memory_allocated() / 2**30)


if __name__ == "__main__":
    main()
