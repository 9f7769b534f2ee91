"""Would PyTorch's TunableOp pick faster cuBLAS(Lt) algorithms than cuBLAS's own heuristic for the
decode-step GEMMs? (Issue 14: at 64 rows the small qkv and o products run at ~1.5 TB/s, and the
batch-64 step is 0.90x vLLM's fast level; at 200-500 rows the GEMMs run at ~75% of the bf16 peak.)

For each of the Qwen2.5-3B shape's linears at each row count M: the graph-free time of
``torch.nn.functional.linear`` as cuBLAS picks it, then with TunableOp on (tuning each shape once,
``torch.cuda.tunable``), then which implementation won. Whether TunableOp has more than cuBLAS's
default candidate on CUDA depends on the torch build (cuBLASLt candidates on CUDA landed in mid-2026,
pytorch/pytorch#186270): the record says what this torch offered. GPU only.

    python scripts/tunableop_probe.py --out DIR [--ms 64,200,492] [--iters 200]

Writes DIR/tunableop_probe.json (with the commit) and DIR/tunableop_results.csv (TunableOp's own file).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from pageserve.lab.results import provenance

SHAPES = {"qkv": (2560, 2048, True), "o": (2048, 2048, False), "gate_up": (22016, 2048, False),
          "down": (2048, 11008, False), "lm_head": (151936, 2048, False)}


def linear_us(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, iters: int) -> float:
    """Mean µs of one linear over ``iters`` calls launched back to back (after 10 warm-up calls)."""
    f = torch.nn.functional.linear
    for _ in range(10):
        f(x, w, b)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(iters):
        f(x, w, b)
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) * 1e3 / iters


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", default="64,200,492")
    ap.add_argument("--iters", type=int, default=200)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("tunableop_probe times cuBLAS: it needs a GPU")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tunable = torch.cuda.tunable
    tunable.set_filename(str(out / "tunableop_results.csv"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for m in (int(v) for v in args.ms.split(",")):
        for name, (n, k, bias) in SHAPES.items():
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * k ** -0.5
            b = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=gen) if bias else None
            tunable.enable(False)
            plain = linear_us(x, w, b, args.iters)
            want = torch.nn.functional.linear(x, w, b).float()
            tunable.enable(True)
            tunable.tuning_enable(True)
            torch.nn.functional.linear(x, w, b)  # tunes this shape (once)
            torch.cuda.synchronize()
            tunable.tuning_enable(False)
            tuned = linear_us(x, w, b, args.iters)
            err = ((torch.nn.functional.linear(x, w, b).float() - want).abs().max() / want.abs().max()).item()
            tunable.enable(False)
            gbytes = (n * k + m * k + m * n) * 2 / 1e9
            row = {"m": m, "shape": name, "n": n, "k": k, "bias": bias, "cublas_us": plain, "tunableop_us": tuned,
                   "speedup": plain / tuned, "cublas_tbps": gbytes / plain * 1e3,
                   "max_rel_err_vs_cublas": err}
            rows.append(row)
            print(f"M={m:4d} {name:8s} cuBLAS {plain:8.2f} us, TunableOp {tuned:8.2f} us ({plain / tuned:.3f}x), "
                  f"rel err {err:.1e}", flush=True)
    results = [list(map(str, r)) if not isinstance(r, str) else r for r in tunable.get_results()]
    rec = {**provenance(), "torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "rows": rows,
           "tunableop_results": results, "validators": [list(map(str, v)) for v in tunable.get_validators()]}
    (out / "tunableop_probe.json").write_text(json.dumps(rec, indent=1))
    print("winners:", *results, sep="\n  ")


if __name__ == "__main__":
    main()
