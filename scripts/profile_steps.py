"""Where a decode step's and a prefill step's GPU time goes, phase by phase, against the floor
(issue 14's table; the same for the deterministic and int8 modes, issues 15 and 12).

    python scripts/profile_steps.py --out DIR [--modes default,deterministic,int8]
        [--batches 1,64,256] [--context 512] [--prefill-prompts 16] [--prefill-len 512]

For each mode, one engine (Qwen2.5-3B shape, bf16, random weights):
- decode at each batch size: the engine's step time (``decode_bench.decode_step_ms``) and the
  kernels of one replay of the batch's CUDA graph (``lab.profiling.profile_kernels``), summed
  per phase; the step's floor is (weights + KV) / the read bandwidth measured in this run;
- prefill: ``--prefill-prompts`` fresh prompts of ``--prefill-len`` tokens in one step, one
  output token each; its kernels per phase, with the linear and attention FLOPs over the bf16
  matmul TFLOP/s measured in this run as their floors.
Writes DIR/profile_steps.json (with the commit) after each mode and prints a table per step.
GPU only; the arithmetic it relies on is tested on the CPU (tests/test_profiling.py).
"""
from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch

from pageserve.engine.llm import LLM
from pageserve.lab import bench
from pageserve.lab.decode_bench import decode_step_ms
from pageserve.lab.kernel_bench.ceilings import measure_ceilings
from pageserve.lab.peers import measure_read_gbps
from pageserve.lab.profiling import (by_category, decode_bytes, linear_flops, phase_rows, prefill_attention_flops,
                                     profile_kernels)
from pageserve.lab.results import provenance

MODES = {"default": {}, "deterministic": {"deterministic": True}, "int8": {"quantization": "int8"}}


def _table(title: str, rows: list[dict], total_us: float, floor_us: float | None) -> str:
    lines = [f"\n== {title}: kernels {total_us:.0f} us" + (f", floor {floor_us:.0f} us ({floor_us / total_us:.2f})"
                                                         if floor_us and total_us else "")]
    for r in rows:
        frac = f"{r['fraction']:.2f}" if r["fraction"] else "-"
        floor = f"{r['floor_us']:.0f}" if r["floor_us"] else "-"
        lines.append(f"  {r['phase']:<10} {r['measured_us']:9.1f} us   floor {floor:>7}   {frac}")
    return "\n".join(lines)


def profile_decode(llm, batch: int, context: int, read_gbps: float, weights: float | None, steps: int = 32) -> dict:
    runner = llm.engine.runner
    step_ms = decode_step_ms(llm, batch, context, steps, vocab_size=512, repeats=3 if steps >= 8 else 1)
    rec: dict = {"step_ms": step_ms}
    graphs = runner.graphs
    buckets = [b for b in (graphs.buckets if graphs is not None and graphs.graphs else []) if b >= batch]
    if not buckets:
        rec["note"] = "no CUDA graph for this batch: step time only"
        return rec
    graph = graphs.graphs[min(buckets)]
    rows = profile_kernels(graph.replay, repeats=20)
    cats = by_category(rows)
    floor_us = 1e6 * decode_bytes(llm.engine.model_config, batch, context, weights=weights) / (read_gbps * 1e9)
    rec.update(kernel_us=sum(cats.values()), categories_us=cats, floor_us=floor_us,
               phases=phase_rows(cats, {}),
               kernels=[{"name": r.name, "us": r.us, "launches": r.launches, "category": r.category} for r in rows[:40]])
    print(_table(f"decode batch {batch} x {context}: engine step {step_ms:.3f} ms", rec["phases"],
                 rec["kernel_us"], floor_us), flush=True)
    return rec


def profile_prefill(llm, num_prompts: int, prompt_len: int, tflops: float) -> dict:
    vocab = bench.prompt_vocab_size(llm)
    gen = torch.Generator().manual_seed(1234)
    walls: list[float] = []

    def step():  # fresh ids every call: a prefix-cache hit would skip the work being measured
        ids = torch.randint(0, vocab, (num_prompts, prompt_len), generator=gen).tolist()
        bench.synchronize()
        t0 = time.perf_counter()
        llm.generate(ids, bench.greedy_params(1), use_tqdm=False)
        bench.synchronize()
        walls.append(time.perf_counter() - t0)

    rows = profile_kernels(step, repeats=3)
    cats = by_category(rows)
    cfg = llm.engine.model_config
    tokens = num_prompts * prompt_len
    floors = {"gemm": 1e6 * linear_flops(cfg, tokens, sampled_rows=num_prompts) / (tflops * 1e12),
              "attention": 1e6 * prefill_attention_flops(cfg, prompt_len, num_prompts) / (tflops * 1e12)}
    rec = {"tokens": tokens, "wall_ms": 1e3 * min(walls[1:] or walls), "kernel_us": sum(cats.values()),
           "categories_us": cats, "floors_us": floors, "phases": phase_rows(cats, floors),
           "kernels": [{"name": r.name, "us": r.us, "launches": r.launches, "category": r.category} for r in rows[:40]]}
    print(_table(f"prefill {num_prompts} x {prompt_len} tokens: wall {rec['wall_ms']:.1f} ms", rec["phases"],
                 rec["kernel_us"], sum(floors.values())), flush=True)
    return rec


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="qwen2.5-3b")
    ap.add_argument("--modes", default="default,deterministic,int8")
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--prefill-prompts", type=int, default=16)
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--device", default="cuda", help="cuda; cpu only smoke-tests the script (no kernels to count)")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--decode-steps", type=int, default=32, help="engine steps per timed decode run")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("profile_steps profiles CUDA kernels: it needs a GPU (--device cpu smoke-tests it)")
    out = Path(args.out) / "profile_steps.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    ceilings = measure_ceilings() if args.device == "cuda" else {**measure_read_gbps("cpu"), "matmul_bf16_tflops": 1.0}
    print({k: round(v) for k, v in ceilings.items()}, flush=True)
    record: dict = {**provenance(), "model": args.model, "ceilings": ceilings, "modes": {}}
    batches = [int(b) for b in args.batches.split(",")]
    for mode in args.modes.split(","):
        llm = LLM(args.model, dtype="bfloat16" if args.device == "cuda" else "float32", device=args.device, seed=0,
                  max_num_seqs=max(max(batches), args.prefill_prompts), max_model_len=args.max_model_len,
                  **MODES[mode])
        bench.warmup(llm, bench.prompt_vocab_size(llm))
        weights = None
        if mode == "int8":  # int8 linears read a byte a weight (+ scales); embeddings and head stay bf16
            from pageserve.lab.peers import weight_bytes

            cfg = llm.engine.model_config
            head = 2 * cfg.vocab_size * cfg.hidden_size
            weights = (weight_bytes(cfg) - head) / 2 + head
        rec: dict = {"decode": {}, "prefill": None}
        for b in batches:
            rec["decode"][str(b)] = profile_decode(llm, b, args.context, ceilings["read_gbps"], weights,
                                                   args.decode_steps)
        if args.prefill_prompts:
            rec["prefill"] = profile_prefill(llm, args.prefill_prompts, args.prefill_len, ceilings["matmul_bf16_tflops"])
        record["modes"][mode] = rec
        out.write_text(json.dumps(record, indent=1, default=str))
        llm.shutdown()
        del llm
        gc.collect()
        bench.free_device_memory()


if __name__ == "__main__":
    main()
