"""Does a GEMM's first call at a new row count cost the host (cuBLAS choosing and loading a kernel)?

For each of the Qwen2.5-3B shape's linears (qkv with bias, o, gate_up, down, the LM head), time
``torch.nn.functional.linear`` at row counts M never seen in this process: the first call's host time
and GPU time, then the same M again (warm). An eager engine step meets a new M whenever its token
count is new (every chat step), so a first-call cost shows up as eager steps that get faster the
longer a process runs (session 16, NOTES.md). GPU only.
    python scripts/gemm_first_call.py --out DIR [--ms 1000,1003,2047,4001,6007] [--host-loop 640,2176]
Writes DIR/gemm_first_call.json (with the commit) and prints a line a shape and M.
``--host-loop``: also, at those (warm) row counts, the host's µs a call over 200 calls launched back to
back (no sync between), under each BLAS backend torch offers (``preferred_blas_library``): what an eager
step's ~145 linears cost the host, under ``host_loop`` (session 17: ~85 µs a call under cProfile inside
the engine, 15-20 µs in this loop on the H200).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from pageserve.lab.results import provenance

SHAPES = {"qkv": (2560, 2048, True), "o": (2048, 2048, False), "gate_up": (22016, 2048, False),
          "down": (2048, 11008, False), "lm_head": (151936, 2048, False)}


def timed(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> tuple[float, float]:
    """(host ms of the call, GPU ms from before it to after it) of one linear."""
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    t0 = time.perf_counter()
    torch.nn.functional.linear(x, w, b)
    host = (time.perf_counter() - t0) * 1e3
    e.record()
    torch.cuda.synchronize()
    return host, s.elapsed_time(e)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", default="1000,1003,2047,4001,6007")
    ap.add_argument("--host-loop", default="", help="row counts for host_loop, e.g. 640,2176 (none: skipped)")
    args = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    rows = []
    for name, (n, k, bias) in SHAPES.items():
        w = torch.randn(n, k, device=dev, dtype=dt) * 0.02
        b = torch.randn(n, device=dev, dtype=dt) if bias else None
        timed(torch.randn(64, k, device=dev, dtype=dt), w, b)  # the shape's first call at all, not counted
        for i, m in enumerate(int(v) for v in args.ms.split(",")):
            if name == "lm_head":
                m = m // 8 + i  # sampled rows, a few hundred at most: distinct, none seen before
            x = torch.randn(m, k, device=dev, dtype=dt)
            first = timed(x, w, b)
            again = timed(x, w, b)
            rows.append({"shape": name, "m": m, "first_host_ms": first[0], "first_gpu_ms": first[1],
                         "warm_host_ms": again[0], "warm_gpu_ms": again[1]})
            print(f"{name:8s} M={m:5d}: first host {first[0]:7.3f} ms GPU {first[1]:7.3f} ms | "
                  f"warm host {again[0]:7.3f} ms GPU {again[1]:7.3f} ms", flush=True)
        del w, b
    loops = host_loop([int(v) for v in args.host_loop.split(",")]) if args.host_loop else None
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "gemm_first_call.json").write_text(json.dumps({**provenance(), "rows": rows, "host_loop": loops},
                                                                    indent=1))


def host_loop(ms: list[int], calls: int = 200) -> list[dict]:
    """Per backend, shape and M: host µs a call of ``calls`` linears launched back to back (after a
    warm-up at that M), and the GPU µs a call over the same loop."""
    dev, dt = torch.device("cuda"), torch.bfloat16
    out = []
    for backend in ("cublas", "cublaslt"):
        try:
            torch.backends.cuda.preferred_blas_library(backend)
        except Exception as e:  # noqa: BLE001 (a torch without the choice)
            print(f"backend {backend}: {e}", flush=True)
            continue
        for name, (n, k, bias) in SHAPES.items():
            w = torch.randn(n, k, device=dev, dtype=dt) * 0.02
            b = torch.randn(n, device=dev, dtype=dt) if bias else None
            for m in ms:
                x = torch.randn(m if name != "lm_head" else max(m // 8, 2), k, device=dev, dtype=dt)
                for _ in range(3):
                    torch.nn.functional.linear(x, w, b)
                torch.cuda.synchronize()
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                t0 = time.perf_counter()
                for _ in range(calls):
                    torch.nn.functional.linear(x, w, b)
                host_us = (time.perf_counter() - t0) * 1e6 / calls
                e.record()
                torch.cuda.synchronize()
                gpu_us = s.elapsed_time(e) * 1e3 / calls
                out.append({"backend": backend, "shape": name, "m": x.shape[0], "host_us": host_us, "gpu_us": gpu_us})
                print(f"{backend:8s} {name:8s} M={x.shape[0]:5d}: host {host_us:6.1f} us a call, GPU {gpu_us:7.1f} us",
                      flush=True)
            del w, b
    torch.backends.cuda.preferred_blas_library("cublas")
    return out


if __name__ == "__main__":
    main()
