"""Where a graphed decode step's GPU time goes, kernel by kernel (torch.profiler over graph
replays), and the decode-attention sweep's best configs. A GPU-session diagnostic:

    python scripts/profile_decode.py --out /tmp/out      # qwen2.5-3b, bf16, batch 1 and 64, context 512

Prints the kernels of one replay with their µs per step, and writes <out>/profile_decode.json.
"""
from __future__ import annotations

import argparse
import json
import os

import torch

from pageserve.lab.decode_bench import decode_step_ms
from pageserve.lab.kernel_bench.sweeps import bench_decode_attention
from pageserve.engine.llm import LLM
from pageserve.lab.profiling import profile_kernels


def kernel_breakdown(graph: torch.cuda.CUDAGraph, replays: int = 20) -> list[tuple[str, float, int]]:
    """(kernel name, µs per replay, launches per replay), largest first."""
    return [(r.name, r.us, r.launches) for r in profile_kernels(graph.replay, repeats=replays)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    ap.add_argument("--model", default="qwen2.5-3b")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--context", type=int, default=512)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    record: dict = {}
    llm = LLM(args.model, dtype="bfloat16", seed=0, max_num_seqs=max(batches), max_model_len=2048)
    runner = llm.engine.runner
    for bs in batches:
        ms = decode_step_ms(llm, bs, args.context, 32, vocab_size=512)
        graph = runner.graphs.graph_for(bs)  # the context class of the steps just run
        rows = kernel_breakdown(graph)
        gpu_us = sum(r[1] for r in rows)
        print(f"\n== batch {bs}: engine step {ms:.3f} ms; kernels of one replay {gpu_us / 1e3:.3f} ms "
              f"(sum of kernel times, gaps excluded), {sum(r[2] for r in rows)} launches")
        for name, us, n in rows[:25]:
            print(f"  {us:8.1f} µs  {n:4d}x  {name[:110]}")
        record[f"batch{bs}"] = {"step_ms": ms, "kernel_us_sum": gpu_us,
                                "kernels": [{"name": n, "us": us, "launches": c} for n, us, c in rows]}
    del llm, runner
    torch.cuda.empty_cache()
    r = bench_decode_attention()
    print("\n== decode attention, batch 64 x 2048:", {k: v for k, v in r.items() if not k.startswith("paged_decode_attn_sweep_error")})
    record["decode_attention"] = r
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "profile_decode.json"), "w") as f:
        json.dump(record, f, indent=1, default=str)


if __name__ == "__main__":
    main()
