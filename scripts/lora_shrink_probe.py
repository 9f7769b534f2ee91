"""LoRA's first product at the Qwen2.5-3B shape's four projections, each way it can run, GPU time per call from
CUDA-graph replays (A rotated out of L2):

- ``ref``: what the reference path runs for it (``reference.lora_shrink``: the product of every slot's A, then the
  select), on an input already normed / activated (so without its prologue's own launch);
- ``k<block_k>_s<stages>_m<max_splits>``: ``kernels.lora.lora_shrink`` with that tile, pipeline depth and split
  cap, its prologue inside (qkv and gate_up: the RMSNorm; down: SiLU·mul of gate|up).

Every row of the batch uses an adapter (the slots in turn), so every tile walks its K. The kernel's output is
compared with the reference's (largest difference). On the H100 in session 48 the unsplit kernel made a 3B decode
step with adapters 4.5-5.2x the plain one: one program walked all of K.

    python scripts/lora_shrink_probe.py --out DIR [--rows 1,16,64] [--rank 16] [--max-loras 4]

Writes DIR/lora_shrink_probe.json (with the commit). Stage ``shrinkprobe`` of scripts/h200_run.sh.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from pageserve.kernels.lora import lora_shrink
from pageserve.kernels.reference import lora_shrink as reference
from pageserve.kernels.reference import rms_norm, silu_and_mul
from pageserve.lab.kernel_bench.timing import graph_ms
from pageserve.lab.results import hardware_name, provenance

VARIANTS = {  # name: (block_k, num_stages, max_splits); the first is the shipped default
    "k64_sdef_m32": (64, None, 32),
    "k64_s4_m32": (64, 4, 32),
    "k128_s3_m32": (128, 3, 32),
    "k128_s3_m64": (128, 3, 64),
    "k256_s2_m32": (256, 2, 32),
    "k64_sdef_m1": (64, None, 1),  # the session-47 kernel: K whole in one program
}
# (K, parts, prologue) of the 3B shape's fused projections
PROJS = {"qkv": (2048, 3, "norm"), "o": (2048, 1, None), "gate_up": (2048, 2, "norm"), "down": (11008, 1, "silu")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--max-loras", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dtype = getattr(torch, args.dtype)
    dev = torch.device(args.device)
    gen = torch.Generator(device=dev).manual_seed(0)
    record = {"script": "lora_shrink_probe", "hardware": hardware_name(), **provenance(),
              "date": time.strftime("%Y-%m-%d"), "dtype": args.dtype, "rank": args.rank, "max_loras": args.max_loras,
              "variants": {k: list(v) for k, v in VARIANTS.items()}, "us": {}, "max_abs_diff": {}}
    for proj, (K, parts, prologue) in PROJS.items():
        width = parts * args.rank
        C = args.max_loras * width
        n_copies = max(2, min(16, int(64e6 // (C * K * dtype.itemsize))))  # A out of L2 between calls
        a = [torch.randn(C, K, device=dev, dtype=dtype, generator=gen) * K ** -0.5 for _ in range(n_copies)]
        w = 1 + 0.1 * torch.randn(K, device=dev, dtype=dtype, generator=gen)
        for T in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(T, 2 * K if prologue == "silu" else K, device=dev, dtype=dtype, generator=gen)
            slots = torch.arange(T, device=dev, dtype=torch.int64) % args.max_loras
            counters = torch.zeros(1024, dtype=torch.int32, device=dev)
            kw = {"norm_weight": w, "eps": 1e-6} if prologue == "norm" else {"silu_mul": True} if prologue else {}
            x_in = rms_norm(x, w, 1e-6) if prologue == "norm" else silu_and_mul(x) if prologue else x
            want = reference(x_in, a[0], slots, width)
            key = f"{proj}_T{T}"
            r = {"ref": graph_ms(lambda i: reference(x_in, a[i % n_copies], slots, width), calls=20) * 1e3}
            diffs = {}
            for name, (bk, st, ms) in VARIANTS.items():
                def call(i, bk=bk, st=st, ms=ms):
                    return lora_shrink(x, a[i % n_copies], slots, width, counters=counters, block_k=bk,
                                       max_splits=ms, num_stages=st, **kw)
                try:
                    r[name] = graph_ms(call, calls=20) * 1e3
                    diffs[name] = float((call(0).float() - want.float()).abs().max())
                except Exception as e:  # a config that does not compile here is a result, not the end of the run
                    r[name] = None
                    diffs[name] = f"{type(e).__name__}: {str(e)[:200]}"
            record["us"][key], record["max_abs_diff"][key] = r, diffs
            print(key, " ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} -" for k, v in r.items()),
                  flush=True)
            (out / "lora_shrink_probe.json").write_text(json.dumps(record, indent=1))
    # the four projections x 36 layers, per row count and variant: a decode step's shrinks
    layers = 36
    for T in [int(r) for r in args.rows.split(",")]:
        step = {}
        for name in ["ref", *VARIANTS]:
            vals = [record["us"][f"{p}_T{T}"].get(name) for p in PROJS]
            step[name] = None if any(v is None for v in vals) else round(sum(vals) * layers / 1e3, 3)
        record.setdefault("step_ms", {})[f"T{T}"] = step
        print(f"step_ms T{T}", step, flush=True)
    (out / "lora_shrink_probe.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
