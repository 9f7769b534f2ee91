"""Where W1's wall time goes on the GPU's clock and on the host's: two passes of W1 through one
engine (after a W1-shaped warm-up), the engine's defaults.

1. CUDA events around every ``runner.execute`` (its input copies, forward, sampler): per step
   its GPU time and the GPU's idle time before it (no engine work queued: the host was late),
   split by step kind (graphed decode / eager mixed or prefill), and the graphed decode steps by
   their number of rows (with their mean context). W1's wall time = the steps' GPU time + the idle.
   (Counting a step's rows and context costs the host ~10-40 µs a step, inside the timed pass.)
2. cProfile over the whole W1 (host hot spots; the profiler slows the host, so this pass's
   wall time is not W1's): the functions with the most own time and the most cumulative time.
   A host sync inside a launch shows up as a C function (``synchronize``, ``item``, ``tolist``,
   a copy) with wall time near the GPU's.
Each events pass also records the CUDA caching allocator's retries and cudaMalloc/cudaFree calls
during it and the SM clock over it (``lab.profiling.ClockLog``), and lists the Triton kernels
compiled during it (a compile stalls the host mid-step; the GPU's wait shows inside that step's events).

    python scripts/w1_profile.py --out DIR [--workload w1|nanovllm|chat] [--requests N] [--top 40]
                                 [--modes default,deterministic] [--no-cprofile] [--kernels]

3. ``--kernels`` (session 38): one more pass under ``torch.profiler``, every device event's time summed by
   kind and set against the workload's floor (``kernel_pass``), and the GPU's idle time between events.

``--workload``: another of the benchmark workloads through the same two passes (issue 14's nano-vllm
convention, the chat-like one), with its own default size unless ``--requests`` is given; the record is
then DIR/<workload>_profile.json.

Writes DIR/w1_profile.json (with the commit; with --modes, the events pass of each mode, one
engine at a time, under ``modes``, a list of passes) and prints a summary. GPU only.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time
from pathlib import Path

import torch

from pageserve.engine.llm import LLM
from pageserve.lab import bench
from pageserve.lab.peers import WorkloadSpec, warmup_workload, workload_floor, workload_vocab
from pageserve.lab.profiling import (ClockLog, CompileLog, KernelRow, by_category, device_events, engine_mode,
                                     gpu_gaps, workload_bound)
from pageserve.lab.results import provenance


def idle_split(marks: list[tuple]) -> dict:
    """``marks``: per step (start event, end event, graphed, rows, context, host ms, tokens) in launch
    order, completed (the last three optional). Returns per kind ("decode" graphed, "eager"
    otherwise): steps, GPU ms of the steps, idle ms before them (the first step's idle is not
    counted) and, where the marks have it, the host's ms inside ``execute``. That time includes
    ``to_device``'s wait for the previous step's input copy (async scheduling), so a GPU-bound step
    also shows host ms near its GPU ms: it bounds the launch work from above, it does not measure it."""
    out = {k: {"steps": 0, "gpu_ms": 0.0, "idle_before_ms": 0.0} for k in ("decode", "eager")}
    for i, (s, e, graphed, *rest) in enumerate(marks):
        row = out["decode" if graphed else "eager"]
        row["steps"] += 1
        row["gpu_ms"] += s.elapsed_time(e)
        if i:
            row["idle_before_ms"] += marks[i - 1][1].elapsed_time(s)
        if len(rest) > 2:
            row["host_ms"] = row.get("host_ms", 0.0) + rest[2]
    return out


DECODE_BANDS = (1, 8, 32, 64, 128, 256, 512, 1 << 30)


def decode_bands(marks: list[tuple]) -> list[dict]:
    """The graphed decode steps grouped by their number of sequences (``DECODE_BANDS``: rows in
    (lo, hi]): per band steps, GPU ms in all, ms a step, and the mean context a sequence (the KV
    each row's attention reads), so a workload's decode time can be set against where it goes."""
    rows = []
    for lo, hi in zip((0,) + DECODE_BANDS[:-1], DECODE_BANDS):
        sel = [(s.elapsed_time(e), b, ctx) for s, e, graphed, b, ctx, *_ in marks if graphed and lo < b <= hi]
        if sel:
            ms = sum(t for t, _, _ in sel)
            label = (f"{hi}" if hi == lo + 1 else f"{lo + 1}-{hi}") if hi < 1 << 30 else f">{lo}"
            rows.append({"rows": label, "steps": len(sel),
                         "gpu_ms": ms, "ms_per_step": ms / len(sel),
                         "mean_rows": sum(b for _, b, _ in sel) / len(sel),
                         "mean_context": sum(c for _, _, c in sel) / len(sel)})
    return rows


ALLOCATOR_COUNTS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")


def allocator_counts() -> dict:
    """PyTorch's CUDA caching allocator's counters that mean a sync or a driver call inside a step:
    allocation retries (cached blocks freed to make room: a device sync), cudaMalloc / cudaFree calls."""
    stats = torch.cuda.memory_stats() if torch.cuda.is_available() else {}
    return {k: int(stats.get(k, 0)) for k in ALLOCATOR_COUNTS}


def events_pass(llm, workload, sync_steps: bool = False) -> dict:
    """``sync_steps``: the device is idle when each step starts and finished when the next is
    prepared (no overlap: this pass's wall time is not the workload's), so a step's host ms is the
    launch work alone and its GPU ms the kernels alone, or the launch where that is longer
    (host-bound). ``eager_steps`` lists per eager step [tokens, rows, GPU ms, host ms]."""
    runner = llm.engine.runner
    execute, graphs = runner.execute, runner.graphs
    marks: list[list] = []
    graphed = [False]

    def ev():
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def timed_execute(batch, *a, **k):
        graphed[0] = False
        rows = len(batch)
        ctx = sum(s.num_computed_tokens for s in batch.seqs) / max(rows, 1)
        if sync_steps:
            torch.cuda.synchronize()
        start = ev()
        t0 = time.perf_counter()
        out = execute(batch, *a, **k)
        host_ms = (time.perf_counter() - t0) * 1e3
        marks.append([start, ev(), graphed[0], rows, ctx, host_ms, sum(batch.num_new_tokens)])
        if sync_steps:
            torch.cuda.synchronize()
        return out

    run = graphs.run if graphs is not None else None

    def timed_run(*a, **k):
        graphed[0] = True
        return run(*a, **k)

    runner.execute = timed_execute
    if graphs is not None:
        graphs.run = timed_run
    try:
        bench.synchronize()
        mem0 = allocator_counts()
        with CompileLog() as compiles, ClockLog() as clocks:
            t0 = time.perf_counter()
            r = bench.run_pageserve(llm, workload)
            bench.synchronize()
            wall = time.perf_counter() - t0
    finally:
        del runner.execute
        if graphs is not None:
            del graphs.run
    mem = {k: v - mem0.get(k, 0) for k, v in allocator_counts().items()}
    split = idle_split(marks)
    return {"wall_s": wall, "total_tok_s": (workload.prompt_tokens + r.output_tokens) / wall, "kinds": split,
            "allocator": mem, "sm_clock": clocks.summary(), "gpu_s": sum(v["gpu_ms"] for v in split.values()) / 1e3,
            "idle_s": sum(v["idle_before_ms"] for v in split.values()) / 1e3, "jit": compiles.summary(),
            "decode_by_rows": decode_bands(marks), "sync_steps": sync_steps,
            "eager_steps": [[m[6], m[3], m[0].elapsed_time(m[1]), m[5]] for m in marks if not m[2]]}


def cprofile_pass(llm, workload, top: int) -> dict:
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    bench.run_pageserve(llm, workload)
    bench.synchronize()
    prof.disable()
    wall = time.perf_counter() - t0
    rows = {}
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(top)
        rows[key] = buf.getvalue().splitlines()
    return {"wall_s_under_profiler": wall, "top": rows}


def kernel_seconds(events: list[tuple[int, int, str]]) -> dict[str, tuple[float, int]]:
    """{kernel name: (device seconds, launches)} of ``device_events``."""
    total: dict[str, list] = {}
    for start, end, name in events:
        row = total.setdefault(name, [0.0, 0])
        row[0] += (end - start) / 1e9
        row[1] += 1
    return {k: (v[0], v[1]) for k, v in total.items()}


def kernel_pass(llm, workload, model: str, ceilings: dict) -> dict:
    """The workload once under ``torch.profiler`` (CUDA activity): every kernel's device time,
    summed by category (``lab.profiling.kernel_category``), set against the workload's floor on
    this run's measured ceilings (``lab.profiling.workload_bound``). The profiler slows the host,
    so this pass's wall time is not the workload's; its kernel times are the engine's. ``gaps``: the
    GPU's idle time between device events (``lab.profiling.gpu_gaps``), an upper bound for the same reason."""
    from torch.profiler import ProfilerActivity, profile

    bench.synchronize()
    t0 = time.perf_counter()
    activity = ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU  # CPU: nothing counted
    with profile(activities=[activity]) as prof:
        r = bench.run_pageserve(llm, workload)
        bench.synchronize()
    wall = time.perf_counter() - t0
    t1 = time.perf_counter()
    events = device_events(prof)
    del prof
    kernels = kernel_seconds(events)
    gaps = gpu_gaps(events)
    del events
    rows = [KernelRow(name, sec * 1e6, n) for name, (sec, n) in kernels.items()]
    cats = {c: us / 1e6 for c, us in by_category(rows).items()}  # seconds
    lengths = [(len(q.prompt_token_ids), q.max_tokens) for q in workload.requests]
    floor = workload_floor(model, lengths, ceilings["read_gbps"], ceilings["matmul_bf16_tflops"])
    return {"wall_s_under_profiler": wall, "parse_s": time.perf_counter() - t1,
            "output_tokens": r.output_tokens, "requested_output_tokens": workload.requested_output_tokens,
            "prompt_tokens": workload.prompt_tokens, "kernel_s": cats, "kernel_total_s": sum(cats.values()),
            "floor": floor, "bound": workload_bound(cats, floor, ceilings["read_gbps"], ceilings["matmul_bf16_tflops"]),
            "gaps": gaps,
            "top_kernels": [[k.name, k.us / 1e6, k.launches, k.category]  # seconds
                            for k in sorted(rows, key=lambda k: -k.us)[:40]]}


def gemm_sweep(max_rows: int) -> float:
    """Calls ``F.linear`` at every row count 1..max_rows for the qkv (with bias), o, gate_up and down
    shapes of Qwen2.5-3B in bf16, and the LM head at 1..max_rows // 8: every cuBLAS heuristic query
    and kernel load an eager step could meet, paid before the engine exists. Returns its seconds."""
    t0 = time.perf_counter()
    dev, dt = torch.device("cuda"), torch.bfloat16
    for n, k, bias, top in ((2560, 2048, True, max_rows), (2048, 2048, False, max_rows),
                            (22016, 2048, False, max_rows), (2048, 11008, False, max_rows),
                            (151936, 2048, False, max_rows // 8)):
        w = torch.zeros(n, k, device=dev, dtype=dt)
        b = torch.zeros(n, device=dev, dtype=dt) if bias else None
        x = torch.zeros(top, k, device=dev, dtype=dt)
        for m in range(1, top + 1):
            torch.nn.functional.linear(x[:m], w, b)
        torch.cuda.synchronize()
        del w, b, x
    torch.cuda.empty_cache()
    print(f"GEMM sweep to {max_rows} rows: {time.perf_counter() - t0:.1f} s", flush=True)
    return time.perf_counter() - t0


def build_workload(name: str, vocab: int, requests: int | None, seed: int = 0):
    """The benchmark workload ``name`` (``lab.workloads.WORKLOADS``), ``requests`` long if given."""
    kwargs = {"seed": seed} if requests is None else {"seed": seed, "num_requests": requests}
    return WorkloadSpec(name, kwargs).build(vocab)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="qwen2.5-3b")
    ap.add_argument("--workload", default="w1", choices=["w1", "nanovllm", "chat"])
    ap.add_argument("--requests", type=int, default=None, help="default: the workload's own (W1 500)")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--modes", default=None, help="of lab.profiling.ENGINE_MODES, e.g. default,deterministic: the "
                    "events pass of each, one engine at a time in this order (a mode may repeat: A/B/A/B; no cProfile)")
    ap.add_argument("--cprofile", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--kernels", action="store_true", help="after the events pass, one more pass under "
                    "torch.profiler: the workload's kernel time by category against its floor (kernel_pass)")
    ap.add_argument("--passes", type=int, default=1, help="with --modes: W1 passes per engine (other prompts each; "
                    "a later pass shows what the first paid for compiling kernels)")
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--same-prompts", action="store_true", help="with --passes: every pass runs the seed-0 workload "
                    "(a later pass meets exactly the token counts the first did)")
    ap.add_argument("--sync-steps", action="store_true", help="diagnostic: the device idle before each step and "
                    "done after it (events_pass): per eager step, launch work and kernel time apart")
    ap.add_argument("--gemm-sweep", type=int, default=0, help="diagnostic: before any engine, call each decoder "
                    "linear of the Qwen2.5-3B shape at every row count 1..N and the LM head at 1..N/8 (cuBLAS's "
                    "per-row-count first-call cost paid up front; NOTES.md, session 17)")
    args = ap.parse_args(argv)
    vocab = workload_vocab(args.model)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    path = Path(args.out) / f"{args.workload}_profile.json"
    sweep_s = gemm_sweep(args.gemm_sweep) if args.gemm_sweep else None
    if args.modes:
        rec = {**provenance(), "model": args.model, "workload": args.workload, "requests": args.requests, "modes": {}}
        rec["max_model_len"] = args.max_model_len
        rec["gemm_sweep"] = {"rows": args.gemm_sweep, "seconds": sweep_s}
        for n, mode in enumerate(args.modes.split(",")):
            name = mode if mode not in rec["modes"] else f"{mode}#{n + 1}"
            kw = {} if args.max_model_len is None else {"max_model_len": args.max_model_len}
            mode_kw, patch = engine_mode(mode)
            patch.__enter__()
            llm = LLM(args.model, dtype="bfloat16", device="cuda", seed=0, **mode_kw, **kw)
            bench.run_pageserve(llm, warmup_workload(WorkloadSpec(args.workload, {}), vocab, num_requests=32))
            rec["modes"][name] = []
            rec.setdefault("eager_warm_s", {})[name] = llm.engine.runner.eager_warm_s
            rec.setdefault("graphs", {})[name] = graphs_summary(llm)
            print(f"{name}: graphs {rec['graphs'][name]}", flush=True)
            print(f"{name}: eager row buckets {llm.engine.runner.eager_row_buckets}, "
                  f"GEMMs warmed in {llm.engine.runner.eager_warm_s} s", flush=True)
            for i in range(args.passes):
                seed = 0 if args.same_prompts else i
                e = events_pass(llm, build_workload(args.workload, vocab, args.requests, seed=seed), args.sync_steps)
                rec["modes"][name].append(e)
                _print(f"{name} pass {i + 1}", e)
                path.write_text(json.dumps(rec, indent=1))
            llm.shutdown()
            del llm
            patch.__exit__(None, None, None)
            torch.cuda.empty_cache()
        return
    llm = LLM(args.model, dtype="bfloat16", device="cuda", seed=0)
    bench.run_pageserve(llm, warmup_workload(WorkloadSpec(args.workload, {}), vocab, num_requests=32))
    w = build_workload(args.workload, vocab, args.requests)
    rec = {**provenance(), "model": args.model, "workload": args.workload, "requests": len(w.requests),
           "max_num_seqs": llm.engine.config.max_num_seqs, "events": events_pass(llm, w)}
    _print("default", rec["events"])
    path.write_text(json.dumps(rec, indent=1))
    if args.kernels:
        from pageserve.lab.kernel_bench.ceilings import measure_ceilings

        rec["ceilings"] = measure_ceilings()
        rec["kernels"] = kernel_pass(llm, build_workload(args.workload, vocab, args.requests, seed=2), args.model,
                                     rec["ceilings"])
        _print_kernels(rec["kernels"], rec["events"]["wall_s"])
        path.write_text(json.dumps(rec, indent=1))
    if args.cprofile:
        rec["cprofile"] = cprofile_pass(llm, build_workload(args.workload, vocab, args.requests, seed=1), args.top)
        print("\n".join(rec["cprofile"]["top"]["tottime"][:45]), flush=True)
        path.write_text(json.dumps(rec, indent=1))


def graphs_summary(llm) -> dict:
    """The decode and mixed-step graphs' size and capture cost (None where none were captured).
    A function, so that no name in main() keeps a runner, and with it the engine's KV pool,
    alive after its engine."""
    runner = llm.engine.runner

    def summary(g, size: str) -> dict | None:
        return None if g is None or g.capture_s is None else {
            "buckets": len(g.buckets), size: getattr(g, size), "capture_s": g.capture_s,
            "capture_mib": g.capture_bytes / 2**20}

    return {"decode": summary(runner.graphs, "max_bs"), "mixed": summary(runner.mixed_graphs, "max_tokens")}


def _print_kernels(k: dict, wall_s: float) -> None:
    b = k["bound"]
    print(f"kernels over the workload ({k['parse_s']:.0f} s to read the trace): "
          + ", ".join(f"{c} {s:.3f} s" for c, s in k["kernel_s"].items() if s), flush=True)
    print(f"  GEMMs {b['gemm_s']:.3f} s at {b['gemm_tflops']:.0f} TFLOP/s ({b['gemm_ceiling_fraction']:.2f} of the "
          f"ceiling; floor {b['gemm_floor_s']:.3f} s); attention {b['attention_s']:.3f} s (floor "
          f"{b['attention_floor_s']:.3f} s); the rest {b['other_s']:.3f} s; bound {b['bound_s']:.3f} s against "
          f"the events pass's wall {wall_s:.3f} s", flush=True)
    g = k["gaps"]
    print(f"  GPU idle between device events (under the profiler, which slows the host): {g['idle_s']:.3f} s of a "
          f"{g['span_s']:.3f} s span; by gap length {({a: round(v, 3) for a, v in g['by_length_s'].items()})}; "
          f"after {[(n[:40], round(v, 3)) for n, v in g['after'][:6]]}", flush=True)


def _print(mode: str, e: dict) -> None:
    print(f"{mode}: W1 {e['total_tok_s']:.0f} tok/s, wall {e['wall_s']:.3f} s = GPU {e['gpu_s']:.3f} + idle "
          f"{e['idle_s']:.3f} s", flush=True)
    for kind, v in e["kinds"].items():
        host = f", host in execute {v['host_ms']:.0f} ms" if "host_ms" in v else ""
        print(f"  {kind}: {v['steps']} steps, GPU {v['gpu_ms']:.0f} ms, idle before them {v['idle_before_ms']:.0f} ms{host}",
              flush=True)
    for b in e.get("decode_by_rows", []):
        print(f"  decode {b['rows']:>8} rows: {b['steps']:4d} steps, GPU {b['gpu_ms']:7.0f} ms, "
              f"{b['ms_per_step']:.3f} ms a step"
              f" (mean {b['mean_rows']:.0f} rows, context {b['mean_context']:.0f})", flush=True)
    print(f"  Triton compiles inside the pass: {e['jit']}; CUDA allocator during it: {e.get('allocator')}; "
          f"SM clock: {e.get('sm_clock')}", flush=True)


if __name__ == "__main__":
    main()
