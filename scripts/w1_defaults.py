"""Which scheduler defaults serve issue 14's workloads best on this GPU: W1, nano-vllm and chat
through pageserve at each point of a small grid of ``max_num_seqs`` x ``max_num_batched_tokens``
(each point its own process, as in 08, after the same per-workload warm-up), the auto-sized
default (``max_num_seqs`` None) among them.

    python scripts/w1_defaults.py --out DIR [--seqs auto,256,512] [--tokens auto,8192,16384]
        [--workloads w1,nanovllm,chat] [--model qwen2.5-3b] [--prefix-caching off,on] [--repeats 2]

Writes DIR/w1_defaults.json (with the commit): per point the engine arguments, each workload's
total tok/s, and the engine's startup time; prints one line per point. GPU only (a point is ~20 s
on the H200).
"""
from __future__ import annotations

import argparse
import itertools
import json
import tempfile
from pathlib import Path

from pageserve.lab.peers import run_peer
from pageserve.lab.results import provenance


def grid(seqs: str, tokens: str, prefix_caching: str = "off", repeats: int = 1) -> list[dict]:
    """``"auto,256"`` x ``"8192"`` x ``"off,on"`` -> engine-argument dicts, the whole grid ``repeats`` times
    over (alternating, so drift reaches every point alike); ``auto`` leaves max_num_seqs (or, for tokens,
    max_num_batched_tokens) to the engine."""
    points = []
    for _ in range(repeats):
        for s, t, pc in itertools.product(seqs.split(","), tokens.split(","), prefix_caching.split(",")):
            args = {} if t == "auto" else {"max_num_batched_tokens": int(t)}
            if s != "auto":
                args["max_num_seqs"] = int(s)
            if pc not in ("off", "on"):
                raise ValueError(f"--prefix-caching takes off / on, got {pc!r}")
            args["enable_prefix_caching"] = pc == "on"
            points.append(args)
    return points


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="qwen2.5-3b")
    ap.add_argument("--seqs", default="auto,256,1024")
    ap.add_argument("--tokens", default="8192,16384")
    ap.add_argument("--workloads", default="w1,nanovllm,chat")
    ap.add_argument("--warmup-requests", type=int, default=16)
    ap.add_argument("--prefix-caching", default="off",
                    help="off, on or off,on: the prefix cache's host cost (fresh prompts: no hits)")
    ap.add_argument("--repeats", type=int, default=1, help="the grid this many times over, alternating")
    args = ap.parse_args()
    workloads = {w: {} for w in args.workloads.split(",")}
    rows = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for point in grid(args.seqs, args.tokens, args.prefix_caching, args.repeats):
        with tempfile.TemporaryDirectory() as tmp:
            try:
                rec = run_peer("pageserve", args.model, workloads, Path(tmp) / "rec.json", device="cuda",
                               dtype="bfloat16", engine_args=point, warmup_requests=args.warmup_requests)
            except RuntimeError as e:  # one point's failure (out of memory) is a data point
                rows.append({"engine_args": point, "error": str(e)[-500:]})
                print(json.dumps(rows[-1]), flush=True)
                continue
        row = {"engine_args": point, "startup_s": rec.get("startup_s"), "errors": rec.get("errors"),
               **{f"{w}_total_tok_s": r["total_tok_s"] for w, r in rec["offline"].items()}}
        rows.append(row)
        print(json.dumps(row), flush=True)
        (out / "w1_defaults.json").write_text(json.dumps({**provenance(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
