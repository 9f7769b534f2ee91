"""Where a large decode batch's step goes on the GPU's own clock: profile_steps measured the
engine's b512 step at 9.19 ms against 6.86 ms of back-to-back replays of the same graph
(results/h200/diagnostics/profile_steps_host_c20c22f2.json). This puts CUDA events around each
step's parts in the running engine and reads, per step:

- ``copy_us``: the step's input copies (start of ``runner.execute`` to the graph's replay);
- ``replay_us``: the graph replay as the engine runs it;
- ``sample_us``: the sampler and the token copy (replay end to the end of ``execute``);
- ``idle_us``: from the end of one step's work to the start of the next one's on the GPU — time
  in which no work of the engine was queued (the host had not launched the next step yet).

    python scripts/step_timeline.py --out DIR [--batches 64,256,512] [--context 512] [--steps 32]
        [--modes plain,sampled,qwen_default]

``--modes``: how every sequence samples (``MODES``: greedy; Qwen2.5-Instruct's temperature / top_p / top_k; those
and its repetition penalty), each batch run in every mode in turn. A sampled step measured 0.12-0.17 ms slower than
a greedy one at 4-256 rows on an H100 while the sampler's own kernels took ~25 us (session 54): this says which part
of the step holds the rest.

Writes DIR/step_timeline.json (with the commit): per batch (``batches``: the first mode's, ``modes``: each mode's)
the medians of the four, their per-step lists, and ``engine_step_ms`` (wall) for the same steps. GPU only.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from pageserve.engine.llm import LLM
from pageserve.lab import bench
from pageserve.lab.decode_bench import decoding_batch
from pageserve.lab.profiling import ClockLog
from pageserve.lab.results import provenance


def gpu_parts(marks: list[tuple]) -> dict:
    """``marks``: per step (start, replay_start, replay_end, end) CUDA events, completed.
    Returns per-part lists in us; idle is between one step's end and the next one's start."""
    parts: dict[str, list[float]] = {"copy_us": [], "replay_us": [], "sample_us": [], "idle_us": []}
    for i, (s, r0, r1, e) in enumerate(marks):
        parts["copy_us"].append(1e3 * s.elapsed_time(r0))
        parts["replay_us"].append(1e3 * r0.elapsed_time(r1))
        parts["sample_us"].append(1e3 * r1.elapsed_time(e))
        if i:
            parts["idle_us"].append(1e3 * marks[i - 1][3].elapsed_time(s))
    return parts


MODES = {  # as scripts/sampling_bench.py's (Qwen2.5-3B-Instruct's generation_config.json)
    "plain": {},
    "sampled": {"temperature": 0.7, "top_p": 0.8, "top_k": 20},
    "qwen_default": {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05},
    # greedy whose tokens cannot settle into a repeat: each token seen is penalised out of the next picks (random
    # weights' greedy output falls into one; is a step's replay time the tokens' doing?)
    "greedy_no_repeat": {"repetition_penalty": 4.0},
    "temperature_only": {"temperature": 0.7},  # the dense path: noise over each row's whole vocabulary, no candidates
}
# "<mode>/torchall": the mode with the sampler's candidate kernels off (``Sampler.topk_select`` and
# ``candidate_race`` None: ``topk`` and torch ops pick, order, filter and race), to tell a kernel's doing from sampling's
VARIANTS = ("torchall",)


def timeline(llm, batch: int, context: int, steps: int, sampling: dict | None = None) -> dict:
    runner = llm.engine.runner
    graphs = runner.graphs
    if graphs is None or not graphs.graphs:
        raise RuntimeError("no CUDA graphs captured: nothing to time")
    marks: list[list] = []
    run, execute = graphs.run, runner.execute

    def ev():
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def timed_execute(*a, **k):
        mark = [ev(), None, None, None]
        marks.append(mark)
        out = execute(*a, **k)
        mark[3] = ev()
        return out

    def timed_run(*a, **k):
        marks[-1][1] = ev()
        out = run(*a, **k)
        marks[-1][2] = ev()
        return out

    with decoding_batch(llm, batch, context, max_tokens=steps + 16, vocab_size=bench.prompt_vocab_size(llm),
                        seed=batch, sampling=sampling) as d:
        llm.engine.step()
        runner.execute, graphs.run = timed_execute, timed_run
        try:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with ClockLog() as clock:
                for _ in range(steps):
                    llm.engine.step()
                torch.cuda.synchronize()
            wall_ms = 1e3 * (time.perf_counter() - t0) / steps
        finally:
            del runner.execute, graphs.run  # back to the class's methods
        seqs = [s for rid in d.ids if rid in llm.engine.requests for s in llm.engine.requests[rid].seqs]
        last = [t for s in seqs for t in s.output_token_ids[-16:]]  # how varied the tokens the steps ran on were
    while llm.engine.has_unfinished_requests():  # land the aborted batch's step in flight
        llm.engine.step()
    complete = [m for m in marks if all(x is not None for x in m)]
    parts = gpu_parts(complete)
    return {"engine_step_ms": wall_ms, "steps": len(complete), "sm_clock": clock.summary(),
            "distinct_last_tokens": len(set(last)), "last_tokens": len(last),
            **{k + "_median": statistics.median(v) for k, v in parts.items() if v}, "per_step": parts}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="qwen2.5-3b")
    ap.add_argument("--batches", default="64,256,512")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--modes", default="plain", help=f"comma-separated, of {','.join(MODES)} (or <mode>/torchall)")
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    modes = args.modes.split(",")
    unknown = [m for m in modes if m.partition("/")[0] not in MODES or m.partition("/")[2] not in ("", *VARIANTS)]
    if unknown:
        ap.error(f"unknown modes {unknown}; known: {list(MODES)}, each also as <mode>/{'|'.join(VARIANTS)}")
    llm = LLM(args.model, dtype="bfloat16", device="cuda", seed=0, max_num_seqs=max(batches), max_model_len=2048)
    bench.warmup(llm, bench.prompt_vocab_size(llm))
    record = {**provenance(), "model": args.model, "context": args.context, "batches": {},
              "modes": {m: {} for m in modes}}
    sampler = llm.engine.runner.sampler
    kernels = sampler.topk_select, sampler.candidate_race
    for b, mode in ((b, m) for b in batches for m in modes):
        base, _, variant = mode.partition("/")
        sampler.topk_select, sampler.candidate_race = (None, None) if variant == "torchall" else kernels
        rec = timeline(llm, b, args.context, args.steps, MODES[base])
        sampler.topk_select, sampler.candidate_race = kernels
        record["modes"][mode][str(b)] = rec
        if mode == modes[0]:
            record["batches"][str(b)] = rec
        print(f"{mode} b{b}: engine step {rec['engine_step_ms']:.3f} ms; GPU per step (median us): copy "
              f"{rec.get('copy_us_median', 0):.0f}, replay {rec.get('replay_us_median', 0):.0f}, sample "
              f"{rec.get('sample_us_median', 0):.0f}, idle before the next {rec.get('idle_us_median', 0):.0f}; SM clock "
              f"mean {rec['sm_clock']['mean_mhz'] or 0:.0f} MHz; {rec['distinct_last_tokens']} distinct of the last "
              f"{rec['last_tokens']} tokens",
              flush=True)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "step_timeline.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
