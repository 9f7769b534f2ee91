"""Does cuBLAS, at some row counts, compute the deterministic mode's bits? (issue 15, W1's cost)

The deterministic mode runs every linear through ``kernels/matmul_invariant.py``: each output
element one chain of MMA k-steps over K in K order, no split-K. On the H200 that chain gave the
same bits for every tile, BLOCK_K, warp count and load path the sweeps tried. cuBLAS, where its
heuristic picks a kernel without split-K (or stream-K), multiplies with the same wgmma chain and
might therefore give the very same bits; at ~500 rows it is ~1.25x faster than the invariant
kernel (profile_steps at 33a95d3b: 4.71 vs 5.96 ms a decode step), which is most of the mode's W1
cost. This probe measures the premise before anything is built on it: for each Qwen2.5-3B linear
(qkv with its bias), dtype and row count M, the rows of ``F.linear`` bitwise equal to
``matmul_invariant``'s on random inputs of mixed magnitudes, and both timed (graph replay,
weights rotated out of L2).

    python scripts/cublas_bits_probe.py --out DIR [--ms 1,2,...] [--dtypes bf16,fp16] [--time-ms 64,256,512]

Writes DIR/cublas_bits_probe.json (with the commit). On the H200: stage ``cublasbits`` of
scripts/h200_run.sh.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from pageserve.kernels.matmul_invariant import matmul_invariant
from pageserve.lab.kernel_bench.shapes import DTYPE_NAMES, GEMV_SHAPES
from pageserve.lab.kernel_bench.timing import graph_ms, weight_copies
from pageserve.lab.results import provenance

MS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 128, 160, 192, 256, 320, 384, 448, 512, 640, 768, 1024, 2048,
      4096, 8192)
DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}


def equal_rows(a: torch.Tensor, b: torch.Tensor) -> int:
    """Rows of a and b equal bit for bit (a NaN-free comparison of the raw bits)."""
    bits = torch.int16 if a.element_size() == 2 else torch.int32
    return int((a.view(bits) == b.view(bits)).all(dim=1).sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--dtypes", default="bf16,fp16")
    ap.add_argument("--shapes", default=",".join(GEMV_SHAPES))
    ap.add_argument("--time-ms", default="64,128,256,512,1024", help="row counts also timed (both paths)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("cublas_bits_probe compares cuBLAS with the GPU kernel: it needs a GPU")
    ms = [int(m) for m in args.ms.split(",")]
    time_ms = {int(m) for m in args.time_ms.split(",") if m}
    rec = {**provenance(), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "equal_rows": {}, "ms": {}}
    out = Path(args.out) / "cublas_bits_probe.json"
    gen = torch.Generator(device="cuda").manual_seed(0)
    for dname in args.dtypes.split(","):
        dtype = DTYPES[dname]
        for name in args.shapes.split(","):
            N, K = GEMV_SHAPES[name]
            w = torch.randn(N, K, device="cuda", dtype=dtype, generator=gen) * K**-0.5
            b = torch.randn(N, device="cuda", dtype=dtype, generator=gen) if name == "qkv" else None
            row = {}
            for M in ms:
                scale = torch.rand(M, 1, device="cuda", generator=gen) * 8
                x = (torch.randn(M, K, device="cuda", generator=gen) * scale).to(dtype)
                row[M] = equal_rows(F.linear(x, w, b), matmul_invariant(x, w, b)) / M
            rec["equal_rows"][f"{dname}/{name}"] = row
            print(dname, name, " ".join(f"{m}:{f:.2f}" for m, f in row.items()), flush=True)
            if dname == "bf16":
                ws = weight_copies(N, K, dtype, gen, min_bytes=200e6)
                for M in sorted(time_ms):
                    x = torch.randn(M, K, device="cuda", dtype=dtype, generator=gen)
                    y = torch.empty(M, N, device="cuda", dtype=dtype)
                    for impl, fn in (("cublas", lambda i: torch.matmul(x, ws[i % len(ws)].T, out=y)),
                                     ("invariant", lambda i: matmul_invariant(x, ws[i % len(ws)], out=y))):
                        rec["ms"][f"{dname}/{name}/M={M}/{impl}"] = graph_ms(fn, calls=len(ws))
                print(dname, name, {k.split("/", 2)[2]: round(v * 1e3, 1) for k, v in rec["ms"].items()
                                    if k.startswith(f"{dname}/{name}/")}, flush=True)
                del ws
            del w
            out.write_text(json.dumps(rec, indent=1))


if __name__ == "__main__":
    main()
