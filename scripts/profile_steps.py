"""Where a decode step's, a mixed step's and a prefill step's GPU time goes, phase by phase,
against the floor (issue 14's table; the same for the deterministic and int8 modes, issues 15
and 12), and how much of each step no kernel covers.

    python scripts/profile_steps.py --out DIR [--modes default,deterministic,int8]
        [--batches 1,64,256,512] [--context 512] [--prefill-prompts 16] [--prefill-len 512]
        [--mixed | --no-mixed] [--mixed-decodes 256] [--mixed-prefill-tokens 8192]
        [--mixed-prompt-len 512] [--mixed-steps 3] [--mixed-host-steps 0]

For each mode, one engine (Qwen2.5-3B shape, bf16, random weights, max_num_seqs 512 with
the defaults, its KV pool sized from memory and checked to hold every decode batch):

- decode at each batch size (``modes.<mode>.decode.<batch>``):
  ``step_ms``: the engine's steady step time (``decode_bench.decode_step_ms``: consecutive
  ``engine.step()`` calls, async scheduling on, as served);
  ``host``: ``lab.profiling.mean_step_timing`` of those same timed calls, read from the
  engine's own ``StepTiming`` (``engine.last_step``) after each call (the engine is not
  changed): ``total_us``, ``sched_us``, ``launch_us`` (input preparation + host->device copy
  + graph/kernel and sampler launches; it may include waiting for the previous step's
  input copy to leave the pinned staging buffer), ``wait_us`` (blocked on the device), ``post_us``
  (token appends, stop checks, outputs), ``host_busy_us`` = total - wait, ``steps``. The
  host is hidden behind the device while ``wait_us`` stays well above zero (the GPU's own
  idle time between steps is scripts/step_timeline.py's: a torch.profiler trace of whole
  engine steps missed the graphs' kernels at 0afd934b..c20c22f2, so it is not taken here);
  with a CUDA graph for the batch: ``graph_replay_ms`` (``decode_bench.graph_replay_ms``,
  the bucket's graph replayed back to back), ``kernel_us`` / ``categories_us`` /
  ``phases`` / ``kernels``: the kernels of one replay (``lab.profiling.profile_kernels``),
  ``floor_us`` = (weights + KV) / the read bandwidth measured in this run, and
  (``lab.profiling.decode_gaps``) ``in_graph_gap_us`` = replay - kernel sum, clamped at 0,
  with ``kernels_overlap`` true when the sum exceeds the replay (programmatic dependent
  launch overlaps kernels, e.g. at batch 1: the gap is then unknown);
  ``outside_graph_us`` = step - replay (signed: sampling, input copies, unhidden host work). Without a graph
  ``note`` says so and the graph keys are absent.
- mixed (``modes.<mode>.mixed``, on unless ``--no-mixed``): ``--mixed-decodes`` sequences
  decoding at ``--context`` plus ``prefill_tokens`` = min(``--mixed-prefill-tokens``,
  max_num_batched_tokens - decodes) prompt tokens in every step: fresh ``--mixed-prompt-len``
  prompts (one output token each) kept queued, the last one of a step chunked, as in W1's
  first steps (500 prompts of 512 tokens, 8192-token budget); eager (no graph runs a prompt).
  Keys: ``decodes``, ``context``, ``prompt_len``, ``prefill_tokens``, ``steps``;
  ``scheduled_tokens``: the mean tokens of the timed steps (decodes + prefill_tokens when
  the scheduler did what was asked); ``step_ms``: wall time per step over ``steps``
  consecutive steps; ``host`` as above over those steps; ``kernel_us`` / ``categories_us``
  / ``phases`` / ``kernels``: one step's kernels under torch.profiler; ``floors_us``: the
  linear FLOPs over the bf16 matmul TFLOP/s measured here; ``idle_us`` and
  ``kernels_overlap`` (``lab.profiling.idle_us``) and ``gpu_idle_fraction`` = 1 -
  kernel_us / step_ms (the three null on the CPU); ``execute_segments_ms``: ``segment_times``
  over as many more steps (the host's ms a step in input preparation, the copy, the forward's
  launches, the head, the sampler); ``host_profile``: with ``--mixed-host-steps N``, N more steps
  under cProfile with CUDA sync warnings (``host_profile``), else null.
- prefill (``modes.<mode>.prefill``): ``--prefill-prompts`` fresh prompts of
  ``--prefill-len`` tokens in one step, one output token each; its kernels per phase, with
  the linear and attention FLOPs over the bf16 matmul TFLOP/s measured in this run as their
  floors (``tokens``, ``wall_ms``, ``kernel_us``, ``categories_us``, ``floors_us``,
  ``phases``, ``kernels``).
Writes DIR/profile_steps.json (with the commit and the ``ceilings`` measured) after each mode
and prints a table per step. GPU only (``--device cpu`` smoke-tests the script: no kernels);
the arithmetic it relies on is tested on the CPU (tests/test_profiling.py).
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
from pageserve.lab.decode_bench import decode_step_ms, graph_replay_ms, mixed_batch, record_step_timings
from pageserve.lab.kernel_bench.ceilings import measure_ceilings
from pageserve.lab.peers import measure_read_gbps
from pageserve.lab.profiling import (by_category, chain_profile, decode_bytes, decode_gaps, engine_mode,
                                     gpu_idle_fraction, idle_us, linear_flops, mean_step_timing, phase_rows,
                                     prefill_attention_flops, profile_kernels)
from pageserve.lab.results import provenance

def _table(title: str, rows: list[dict], total_us: float, floor_us: float | None) -> str:
    lines = [f"\n== {title}: kernels {total_us:.0f} us" + (f", floor {floor_us:.0f} us ({floor_us / total_us:.2f})"
                                                         if floor_us and total_us else "")]
    for r in rows:
        frac = f"{r['fraction']:.2f}" if r["fraction"] else "-"
        floor = f"{r['floor_us']:.0f}" if r["floor_us"] else "-"
        lines.append(f"  {r['phase']:<10} {r['measured_us']:9.1f} us   floor {floor:>7}   {frac}")
    return "\n".join(lines)


def _host_line(host: dict) -> str:
    if not host.get("steps"):
        return "  host: no steps recorded"
    return (f"  host per step ({host['steps']} steps): busy {host['host_busy_us']:.0f} us (schedule "
            f"{host['sched_us']:.0f}, launch {host['launch_us']:.0f}, postprocess {host['post_us']:.0f}), "
            f"waiting on the device {host['wait_us']:.0f} us")


def _kernel_list(rows) -> list[dict]:
    return [{"name": r.name, "us": r.us, "launches": r.launches, "category": r.category} for r in rows[:40]]


def profile_decode(llm, batch: int, context: int, read_gbps: float, weights: float | None, steps: int = 32) -> dict:
    engine, runner = llm.engine, llm.engine.runner
    with record_step_timings(engine) as timed:
        step_ms = decode_step_ms(llm, batch, context, steps, vocab_size=512, repeats=3 if steps >= 8 else 1)
    # the timed calls: a decode-only step launched, a decode step landed (setup and drain excluded)
    steady = [t for t in timed.steps if t.kind == "decode" and t.num_seqs == batch and t.num_tokens == batch]
    rec: dict = {"step_ms": step_ms, "host": mean_step_timing(steady)}

    graphs = runner.graphs
    buckets = [b for b in (graphs.buckets if graphs is not None and graphs.graphs else []) if b >= batch]
    if not buckets:
        rec["note"] = "no CUDA graph for this batch: step time and host timings only"
        print(f"\n== decode batch {batch} x {context}: engine step {step_ms:.3f} ms (no graph)\n"
              + _host_line(rec["host"]), flush=True)
        return rec
    graph = graphs.graph_for(batch)  # the context class of the steps just run
    # the replays read the static inputs the last step left: contexts grown by the timed steps (880 -> ~980
    # after 96 steps), so the floor and the title use the replayed context, not the starting one
    replayed_ctx = float(graphs.seq_lens[:batch].float().mean())
    replay_ms = graph_replay_ms(runner, batch)
    rows = profile_kernels(graph.replay, repeats=20)
    chain = chain_profile(graph.replay, repeats=20, layers=llm.engine.model_config.num_layers)
    cats = by_category(rows)
    floor_us = 1e6 * decode_bytes(llm.engine.model_config, batch, replayed_ctx, weights=weights) / (read_gbps * 1e9)
    rec.update(graph_replay_ms=replay_ms, replayed_context=replayed_ctx, kernel_us=sum(cats.values()),
               categories_us=cats, floor_us=floor_us, phases=phase_rows(cats, {}), kernels=_kernel_list(rows))
    rec.update(decode_gaps(step_ms, replay_ms, rec["kernel_us"]))
    overlap = " (kernels overlap)" if rec["kernels_overlap"] else ""
    title = (f"decode batch {batch} x {context} (graph replayed at {replayed_ctx:.0f}): engine step {step_ms:.3f} ms, "
             f"graph replay {replay_ms:.3f} ms, "
             f"in-graph gap {rec['in_graph_gap_us']:.0f} us{overlap}, outside graph {rec['outside_graph_us']:.0f} us")
    lines = [_table(title, rec["phases"], rec["kernel_us"], floor_us), _host_line(rec["host"])]
    if chain is not None:
        rec["chain"] = chain
        lines.append(_chain_table(chain, replay_ms))
    print("\n".join(lines), flush=True)
    return rec


def _chain_table(chain: dict, replay_ms: float) -> str:
    """Each kernel's share of one profiled replay (``chain_shares``), largest first."""
    lines = [f"   chain of one replay under the profiler: span {chain['span_us']:.0f} us (unprofiled replay "
             f"{1e3 * replay_ms:.0f}), kernels' shares {chain['busy_us']:.0f}, idle {chain['idle_us']:.0f}",
             f"   {'share us':>9} {'a launch':>9} {'duration':>9} {'idle before':>11}  kernel"]
    for name, r in list(chain["kernels"].items())[:24]:
        per = r["share_us"] / max(r["launches"], 1)
        lines.append(f"   {r['share_us']:9.1f} {per:9.2f} {r['duration_us']:9.1f} {r['idle_before_us']:11.1f}  "
                     f"{name[:70]}")
    return "\n".join(lines)


def host_profile(step, steps: int, top: int = 30) -> dict:
    """``steps`` calls of ``step`` under cProfile with torch's CUDA sync debug mode on "warn": the
    host's hot spots in a step (own time, and cumulative), and the operations that made the host
    wait for the device (each warning's message and the line that raised it; a pageable copy or an
    ``.item()`` inside a step stops the host from running ahead)."""
    import cProfile
    import io
    import pstats
    import warnings

    prof = cProfile.Profile()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            prof.enable()
            for _ in range(steps):
                step()
            bench.synchronize()
            prof.disable()
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode(0)
    syncs: dict[str, int] = {}
    for w in caught:
        where = f"{w.filename}:{w.lineno}: {str(w.message)[:120]}"
        syncs[where] = syncs.get(where, 0) + 1
    rows = {}
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(top)
        rows[key] = buf.getvalue().splitlines()
    return {"steps": steps, "syncs": syncs, "top": rows}


def segment_times(step, runner, steps: int) -> dict:
    """Mean wall ms a step of ``runner.execute``'s parts over ``steps`` calls of ``step`` (no
    profiler): input preparation, the host->device copy (``to_device``, which may wait for the
    previous copy), the model's forward launch, the output head and the sampler's launch. A part
    that waits for the device shows ms near the kernels' time; launch work alone stays flat
    with the step's tokens."""
    parts = {"prepare_inputs": (runner, "prepare_inputs"), "to_device": (runner, "to_device"),
             "forward": (runner.model, "forward"), "compute_logits": (runner.model, "compute_logits"),
             "sample": (runner.sampler, "sample")}
    totals = {k: 0.0 for k in parts}

    def timed(name, fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                totals[name] += time.perf_counter() - t0
        return wrapper

    for name, (obj, attr) in parts.items():
        setattr(obj, attr, timed(name, getattr(obj, attr)))
    try:
        for _ in range(steps):
            step()
        bench.synchronize()
    finally:
        for obj, attr in parts.values():
            obj.__dict__.pop(attr, None)
    return {k: 1e3 * v / steps for k, v in totals.items()}


def profile_mixed(llm, decodes: int, context: int, prefill_tokens: int, prompt_len: int, steps: int,
                  tflops: float, host_steps: int = 0) -> dict:
    """Steps of ``decodes`` decoding sequences plus ``prefill_tokens`` prompt tokens each (see
    the module docstring: ``modes.<mode>.mixed``). ``host_steps``: that many more under
    ``host_profile`` (``mixed.host_profile``)."""
    engine = llm.engine
    try:
        batch = mixed_batch(llm, decodes, context, prefill_tokens, prompt_len, max_steps=3 * steps + host_steps + 2,
                            vocab_size=bench.prompt_vocab_size(llm))
    except ValueError as e:
        raise SystemExit(f"--mixed-decodes: {e}")
    prefill = batch.prefill
    with batch:
        rows = profile_kernels(batch.step, repeats=steps)
        batch.step()  # the timing starts with a step in flight, as in a run
        with record_step_timings(engine) as timed:
            bench.synchronize()
            t0 = time.perf_counter()
            for _ in range(steps):
                batch.step()
            bench.synchronize()
            wall_ms = 1e3 * (time.perf_counter() - t0) / steps
        hosted = host_profile(batch.step, host_steps) if host_steps else None
        segments = segment_times(batch.step, engine.runner, steps)
    cats = by_category(rows)
    kernel_us = sum(cats.values())
    cfg = llm.engine.model_config
    sampled = decodes + -(-prefill // prompt_len)  # rows whose logits the step computes, at most
    floors = {"gemm": 1e6 * linear_flops(cfg, decodes + prefill, sampled_rows=sampled) / (tflops * 1e12)}
    idle, overlap = idle_us(1e3 * wall_ms, kernel_us) if rows else (None, None)  # no kernels on the CPU
    rec = {"decodes": decodes, "context": context, "prompt_len": prompt_len, "prefill_tokens": prefill,
           "steps": steps, "scheduled_tokens": sum(t.num_tokens for t in timed.steps) / max(len(timed.steps), 1),
           "step_ms": wall_ms, "host": mean_step_timing(timed.steps), "kernel_us": kernel_us, "categories_us": cats,
           "floors_us": floors, "phases": phase_rows(cats, floors), "idle_us": idle, "kernels_overlap": overlap,
           "gpu_idle_fraction": gpu_idle_fraction(kernel_us, wall_ms) if rows else None,
           "kernels": _kernel_list(rows), "host_profile": hosted, "execute_segments_ms": segments}
    idle_text = (f", GPU idle {rec['gpu_idle_fraction']:.2f}" + (" (kernels overlap)" if overlap else "")) if rows else ""
    title = (f"mixed step: {decodes} decodes x {context} + {prefill} prompt tokens ({prompt_len}-token prompts, "
             f"{rec['scheduled_tokens']:.0f} tokens scheduled): wall {wall_ms:.2f} ms{idle_text}")
    print(_table(title, rec["phases"], kernel_us, sum(floors.values())) + "\n" + _host_line(rec["host"]), flush=True)
    print("execute's parts, ms a step: " + ", ".join(f"{k} {v:.2f}" for k, v in segments.items()), flush=True)
    if hosted:
        print(f"host profile of {host_steps} more steps: syncs {hosted['syncs']}", flush=True)
        print("\n".join(hosted["top"]["tottime"][:40]), flush=True)
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
           "kernels": _kernel_list(rows)}
    print(_table(f"prefill {num_prompts} x {prompt_len} tokens: wall {rec['wall_ms']:.1f} ms", rec["phases"],
                 rec["kernel_us"], sum(floors.values())), flush=True)
    return rec


def _check_capacity(llm, args, max_batch: int) -> None:
    """Every sequence a run holds at once fits the engine: its length under max_model_len
    (a capped sequence would leave its batch early) and all their blocks in the KV pool."""
    engine = llm.engine
    bs, pool, max_len = engine.block_manager.block_size, engine.block_manager.num_blocks, engine.max_model_len
    decode_len = args.context + (3 if args.decode_steps >= 8 else 1) * args.decode_steps + 8  # decode_step_ms's
    runs = [("decode", max_batch * -(-decode_len // bs), decode_len)]
    if args.mixed:
        mixed_len = args.context + 2 * args.mixed_steps + 8
        prompts = 2 * (-(-args.mixed_prefill_tokens // args.mixed_prompt_len) + 1)  # this step's and the last's
        runs.append(("mixed", args.mixed_decodes * -(-mixed_len // bs) + prompts * -(-args.mixed_prompt_len // bs),
                     mixed_len))
    for what, blocks, length in runs:
        if length > max_len:
            raise SystemExit(f"{what}: sequences reach {length} tokens; raise --max-model-len ({max_len})")
        if blocks > pool:
            raise SystemExit(f"{what}: needs {blocks} KV blocks of {bs} tokens; the pool has {pool}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="qwen2.5-3b")
    ap.add_argument("--modes", default="default,deterministic,int8", help="of lab.profiling.ENGINE_MODES")
    ap.add_argument("--batches", default="1,64,256,512", help="decode batch sizes (W1 decodes at about 500)")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--prefill-prompts", type=int, default=16)
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--device", default="cuda", help="cuda; cpu only smoke-tests the script (no kernels to count)")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--decode-steps", type=int, default=32, help="engine steps per timed decode run")
    ap.add_argument("--mixed", action=argparse.BooleanOptionalAction, default=True,
                    help="profile mixed steps (decodes + a prefill chunk, eager), as in W1's first ~32 steps")
    ap.add_argument("--mixed-decodes", type=int, default=256, help="decoding sequences in a mixed step")
    ap.add_argument("--mixed-prefill-tokens", type=int, default=8192,
                    help="prompt tokens in a mixed step, capped at max_num_batched_tokens - decodes")
    ap.add_argument("--mixed-prompt-len", type=int, default=512, help="tokens of each prompt in a mixed step (W1's)")
    ap.add_argument("--mixed-steps", type=int, default=3, help="mixed steps profiled, and as many timed")
    ap.add_argument("--mixed-host-steps", type=int, default=0, help="that many more mixed steps under cProfile "
                    "with CUDA sync warnings (host_profile)")
    args = ap.parse_args(argv)
    if args.mixed and args.mixed_prompt_len >= args.max_model_len:
        raise SystemExit(f"--mixed-prompt-len {args.mixed_prompt_len} needs --max-model-len above it")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("profile_steps profiles CUDA kernels: it needs a GPU (--device cpu smoke-tests it)")
    out = Path(args.out) / "profile_steps.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    ceilings = measure_ceilings() if args.device == "cuda" else {**measure_read_gbps("cpu"), "matmul_bf16_tflops": 1.0}
    print({k: round(v) for k, v in ceilings.items()}, flush=True)
    record: dict = {**provenance(), "model": args.model, "ceilings": ceilings, "modes": {}}
    batches = [int(b) for b in args.batches.split(",")]
    # a mixed step's running list: the decodes, the last step's prompts (landing) and this step's
    mixed_prompts = -(-args.mixed_prefill_tokens // args.mixed_prompt_len) + 1
    mixed_seqs = args.mixed_decodes + 2 * mixed_prompts + 1 if args.mixed else 0
    for n, mode in enumerate(args.modes.split(",")):  # a mode may repeat (A/B/A/B): "default#3"
        name = mode if mode not in record["modes"] else f"{mode}#{n + 1}"
        mode_kw, patch = engine_mode(mode)
        patch.__enter__()
        llm = LLM(args.model, dtype="bfloat16" if args.device == "cuda" else "float32", device=args.device, seed=0,
                  max_num_seqs=max(max(batches), args.prefill_prompts, mixed_seqs), max_model_len=args.max_model_len,
                  **mode_kw)
        _check_capacity(llm, args, max(batches))
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
        if args.mixed:
            rec["mixed"] = profile_mixed(llm, args.mixed_decodes, args.context, args.mixed_prefill_tokens,
                                         args.mixed_prompt_len, args.mixed_steps, ceilings["matmul_bf16_tflops"],
                                         args.mixed_host_steps)
        record["modes"][name] = rec
        out.write_text(json.dumps(record, indent=1, default=str))
        llm.shutdown()
        del llm
        patch.__exit__(None, None, None)
        gc.collect()
        bench.free_device_memory()


if __name__ == "__main__":
    main()
