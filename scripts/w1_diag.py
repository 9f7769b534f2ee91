"""Why did 08's pageserve W1 (52.5k total tok/s at 3eef1891) fall below 02's (74.7k at 99698f8)?
At 65f7a342 this ran caching on first (60.9k) then off (76.6k): confounded with first-sight
compilation in the first runner. Now the order is a flag (default off first) and a W1-shaped
warm-up (other ids) precedes the timed runs.
The two differ in the runner (08: a `peers` subprocess, lab.workloads.w1_workload over the whole
vocabulary) and in prefix caching (08: on). This runs W1 through the 08 runner with caching on
and off, twice each (the first run right after the runner's warm-up, as in 08), and prints the
total tok/s and the engine's step counts. Usage (GPU): python scripts/w1_diag.py [--out DIR]"""
from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

from pageserve.lab import bench
from pageserve.lab.peers import PageserveRunner, WorkloadSpec, warmup_workload, workload_vocab
from pageserve.lab.results import provenance
from pageserve.lab.workloads import w1_workload


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-3b")
    ap.add_argument("--out", default=None)
    ap.add_argument("--order", default="off,on", help="caching settings in run order (the first runner also compiles)")
    ap.add_argument("--warmup-requests", type=int, default=32, help="untimed W1-shaped requests first (0: none)")
    args = ap.parse_args()
    rows = []
    for caching in [c == "on" for c in args.order.split(",")]:
        t0 = time.perf_counter()
        runner = PageserveRunner(args.model, device="cuda", dtype="bfloat16", max_num_seqs=512,
                                 enable_prefix_caching=caching)
        up = time.perf_counter() - t0
        w = w1_workload(workload_vocab(args.model))
        if args.warmup_requests:
            runner.offline(warmup_workload(WorkloadSpec("w1", {}), workload_vocab(args.model),
                                           num_requests=args.warmup_requests))
        for rep in range(2):
            r = runner.offline(w)
            stats = bench.engine_stats(runner.llm)
            row = {"prefix_caching": caching, "rep": rep, "total_tok_s": r.total_tok_s, "wall_s": r.wall_s,
                   "startup_s": up, **{k: v for k, v in stats.items() if "step" in k or "preempt" in k}}
            rows.append(row)
            print(json.dumps(row), flush=True)
        runner.llm.shutdown()
        del runner
        gc.collect()
        bench.free_device_memory()
    if args.out:
        Path(args.out, "w1_diag.json").write_text(json.dumps({**provenance(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
