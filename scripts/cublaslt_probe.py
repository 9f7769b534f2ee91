"""Does cuBLASLt hold faster algorithms for the decode band's GEMMs than the one cuBLAS's heuristic
picks? (Issue 14: at 129-256 rows the four 3B linears lose ~1 ms a step against max(read, compute),
results/h200/diagnostics/kernels_cublas_band_c7894dc.*; a split-K Triton GEMM lost to cuBLAS there,
splitk_probe_c56c29b.*. TunableOp on torch 2.11 offers only cuBLAS's default: tunableop_probe_794c194.*.)

For each 3B linear and row count M: the GPU time per call of ``torch.matmul`` (the cuBLAS call the
engine's linears make) and of each algorithm cuBLASLt's heuristic returns (up to ``--limit``, through
nvmath-python's ``linalg.advanced.Matmul``, a lab-only dependency carried as wheels), each call on the
next of several weight copies, captured back to back in a CUDA graph (``timing.timed_ms``; where a
capture fails the row says ``algo_timing: "eager"``, and that time is not comparable: the eager
fallback's events sit on torch's stream, and nvmath's work need not). Every algorithm's output is checked against torch's.

    python scripts/cublaslt_probe.py --out DIR [--ms 64,128,160,200,256] [--limit 24]

Writes DIR/cublaslt_probe.json (``provenance``) after every M. Stage ``cublaslt`` of scripts/h200_run.sh.
"""
from __future__ import annotations

import argparse
import json
import time
import traceback
from pathlib import Path

import torch

from pageserve.lab.kernel_bench.shapes import GEMV_SHAPES, LAYERS
from pageserve.lab.kernel_bench.timing import timed_ms, weight_copies
from pageserve.lab.results import provenance


def algo_info(a) -> dict:
    out = {}
    for name in ("algorithm_id", "tile", "stages", "split_k", "reduction_scheme", "cta_swizzling"):
        try:
            v = getattr(a, name)
            out[name] = v if isinstance(v, (int, float, bool, str)) else str(v)
        except Exception:  # noqa: BLE001 - not every attribute exists in every CUDA toolkit
            pass
    return out


def probe_shape(name: str, N: int, K: int, M: int, limit: int, gen: torch.Generator) -> dict:
    from nvmath.linalg.advanced import Matmul, MatmulPlanPreferences

    dtype, dev = torch.bfloat16, gen.device
    ws = weight_copies(N, K, dtype, gen, min_bytes=200e6)
    x = torch.randn(M, K, device=dev, dtype=dtype, generator=gen)
    y = torch.empty(M, N, device=dev, dtype=dtype)
    ref = torch.nn.functional.linear(x, ws[0]).float()
    rec: dict = {}
    rec["torch_us"] = 1e3 * timed_ms(rec, "torch", lambda i: torch.matmul(x, ws[i % len(ws)].T, out=y), calls=len(ws))
    stream = torch.cuda.current_stream()
    mms = [Matmul(x, w.T, c=y, beta=0.0, options={"inplace": True}, stream=stream) for w in ws]
    algos = mms[0].plan(preferences=MatmulPlanPreferences(limit=limit), stream=stream)
    for mm in mms[1:]:
        mm.plan(algorithms=algos, stream=stream)
    rec["rows"] = []
    for j, a in enumerate(algos):
        row = {"rank": j, **algo_info(a)}
        try:
            mms[0].execute(algorithm=a, stream=stream)
            torch.cuda.synchronize()
            row["rel_err"] = float((y.float() - ref).norm() / ref.norm())
            # the stream at call time: inside the capture that is the capture's stream (session 37's first run passed
            # the creation-time stream, so nothing was captured and every time read ~0.8 us)
            row["us"] = 1e3 * timed_ms(row, "algo", lambda i, a=a: mms[i % len(mms)].execute(
                algorithm=a, stream=torch.cuda.current_stream()), calls=len(mms))
        except Exception as e:  # noqa: BLE001 - an algorithm the problem refuses: recorded, skipped
            row["error"] = f"{type(e).__name__}: {e}"[:240]
        rec["rows"].append(row)
    for mm in mms:
        try:  # its last compute event was recorded inside a capture: waiting on it is refused (session 37)
            mm.free()
        except Exception:  # noqa: BLE001 - the process ends soon; the workspace goes with it
            pass
    ok = [r for r in rec["rows"] if "us" in r and r["rel_err"] < 1e-2]
    rec["best"] = min(ok, key=lambda r: r["us"]) if ok else None
    rec["heuristic_first"] = rec["rows"][0] if rec["rows"] else None
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", default="160,200,128,256,64")
    ap.add_argument("--shapes", default="qkv,o,gate_up,down")
    ap.add_argument("--limit", type=int, default=24, help="algorithms asked of cuBLASLt's heuristic")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("cublaslt_probe times CUDA graphs: it needs a GPU")
    path = Path(args.out) / "cublaslt_probe.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    rec = {**provenance(), "device": torch.cuda.get_device_name(), "by_m": {}}
    try:
        import nvmath

        rec["nvmath_version"] = nvmath.__version__
    except Exception as e:  # noqa: BLE001
        raise SystemExit(f"nvmath-python is not importable: {e}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for M in (int(m) for m in args.ms.split(",")):
        t0 = time.time()
        per = {}
        for name in args.shapes.split(","):
            try:
                per[name] = probe_shape(name, *GEMV_SHAPES[name], M, args.limit, gen)
            except Exception as e:  # noqa: BLE001 - one shape's failure is a data point
                per[name] = {"error": f"{type(e).__name__}: {e}"[:400]}
                traceback.print_exc()
            torch.cuda.empty_cache()
        good = {n: r for n, r in per.items() if r.get("best")}
        tot_t = LAYERS * sum(r["torch_us"] for r in good.values())
        tot_b = LAYERS * sum(min(r["torch_us"], r["best"]["us"]) for r in good.values())
        rec["by_m"][str(M)] = {"shapes": per, "stack_torch_us": tot_t, "stack_best_us": tot_b, "elapsed_s": time.time() - t0}
        path.write_text(json.dumps(rec, indent=1, default=str))
        print(f"M={M}: {LAYERS} x {list(good)}: torch {tot_t:.0f} us, best of both {tot_b:.0f} us ({time.time() - t0:.0f} s)",
              flush=True)
        for n, r in per.items():
            if "error" in r:
                print(f"  {n}: error {r['error']}", flush=True)
                continue
            b, h = r["best"] or {}, r["heuristic_first"] or {}
            print(f"  {n}: torch {r['torch_us']:.1f} (timing {r.get('torch_timing', 'graph')}) lt-first {h.get('us', float('nan')):.1f} "
                  f"best {b.get('us', float('nan')):.1f} of {len(r['rows'])} {b} ", flush=True)


if __name__ == "__main__":
    main()
