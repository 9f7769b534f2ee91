"""The deterministic mode's batch-1 decode step, one switch at a time (issue 15): at 97c30a6 notebook 09
measured 3.11 ms (1.40x the default mode), where a3812625 had 2.69 and each matmul of the step, timed
alone, is no slower now (results/h200/diagnostics/det_m1_bench_*). Each variant is an engine of its own
at the Qwen2.5-3B shape (random weights, bf16): the default mode, the deterministic mode as it ships,
then with programmatic dependent launch off, with SiLU·mul back in its own kernel at decode sizes, with
the matmul's generic compile in the graphs too, and all three. Per variant: the step's wall time over
consecutive ``engine.step()`` calls (what 09 reports) and its graph's GPU time alone (replays).

    python scripts/det_b1_switches.py --out DIR [--batches 1,8] [--variants name,...]

Writes DIR/det_b1_switches.json (with the commit) after every variant. On the H200: stage ``detb1``
of scripts/h200_run.sh.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from pageserve.engine.llm import LLM
from pageserve.lab import bench
from pageserve.lab.decode_bench import decode_step_ms, graph_replay_ms
from pageserve.lab.results import provenance

VARIANTS = {
    "default": (False, {}),
    "det": (True, {}),
    "det_no_pdl": (True, {"pdl": False}),
    "det_silu_kernel": (True, {"silu_in_gate_up_max_rows": 0}),
    "det_generic_in_graphs": (True, {"matmul_specialize": False}),
    "det_all_three_off": (True, {"pdl": False, "silu_in_gate_up_max_rows": 0, "matmul_specialize": False}),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("det_b1_switches times CUDA-graphed engine steps: it needs a GPU")
    out = Path(args.out) / "det_b1_switches.json"
    batches = [int(b) for b in args.batches.split(",")]
    rec = {**provenance(), "model": "qwen2.5-3b", "context": args.context, "variants": {}}
    for name in args.variants.split(","):
        det, options = VARIANTS[name]
        llm = LLM("dummy:qwen2.5-3b", device="cuda", dtype="bfloat16", seed=0, max_model_len=2048, max_num_seqs=64,
                  cuda_graph_max_bs=max(batches), deterministic=det, triton_options=options)
        bench.warmup(llm, bench.prompt_vocab_size(llm))
        row = {"options": options}
        for b in batches:
            row[f"b{b}_step_ms"] = decode_step_ms(llm, b, args.context, args.steps)
            row[f"b{b}_graph_ms"] = graph_replay_ms(llm.engine.runner, b)
        rec["variants"][name] = row
        print(name, {k: round(v, 3) for k, v in row.items() if k != "options" and v is not None}, flush=True)
        out.write_text(json.dumps(rec, indent=1))
        llm.shutdown()
        del llm
        bench.free_device_memory()


if __name__ == "__main__":
    main()
