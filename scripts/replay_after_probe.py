"""Does what runs between two decode graph replays change how long the next replay takes?

Session 54 (``step_timeline.py --modes``, H100): a sampled step's graph replay took ~0.13 ms longer than a greedy
step's on the same graph and shapes at 4 and 16 rows, whatever the tokens and at the same SM clock, and only
when the sampler's Triton candidate kernels ran (``sampled/torchall``, the same sampling by ``topk`` and torch ops,
replayed at greedy's speed). This replays one batch's decode graph ``--steps`` times with each ``VARIANTS`` entry
launched after every replay, and times each replay alone with CUDA events around it:

- ``none``: replays back to back;
- ``greedy``: the sampler's greedy call (the argmax kernel);
- ``sampled``: the sampler with Qwen2.5-Instruct's temperature / top_p / top_k (the pick and race kernels);
- ``sampled/torchtopk``, ``sampled/torchrace``, ``sampled/torchall``: the same with the pick, the race or both by
  torch ops instead;
- ``select``: the pick kernel alone (``Sampler.topk_select``), ``sleep``: a kernel that only spins ~20 us (one
  thread; ``sleepN``: ~N us), ``fill``: every SM streaming 64 MiB (~20-40 us);
- ``<variant>+tiny``: the variant, then one 16-element torch op (is it the last kernel before the replay that
  counts?); ``+pdl`` / ``+nopdl``: then a one-row argmax (``kernels/argmax.py``) launched with / without
  programmatic dependent launch (the greedy path's argmax launches with it at any row count).

    python scripts/replay_after_probe.py --out DIR [--batches 4] [--context 512] [--steps 64] [--variants ...]
        [--targets graph,eager]

``--targets eager``: the same step run eagerly instead of replayed (W1's mixed steps run eager: does the PDL state
speed them too?).

Writes DIR/replay_after_probe.json (with the commit): per variant the replays' median / min / max in us and the
whole iteration's median (replay + what follows). GPU only.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from pageserve.engine.llm import LLM
from pageserve.engine.sampling_params import SamplingParams
from pageserve.kernels.argmax import argmax_rows
from pageserve.lab import bench
from pageserve.lab.decode_bench import decoding_batch
from pageserve.lab.results import provenance

VARIANTS = ("none", "greedy", "sampled", "sampled/torchtopk", "sampled/torchrace", "sampled/torchall", "select",
            "sleep")
SAMPLED = SamplingParams(temperature=0.7, top_p=0.8, top_k=20)
GREEDY = SamplingParams(temperature=0.0)


def after_replay(sampler, variant: str, logits: torch.Tensor):
    launch, kernels = _after_replay(sampler, variant, logits)
    tail = variant.partition("+")[2]
    if not tail:
        return launch, kernels
    tiny = torch.zeros(1, 16, device=logits.device)
    then = {"tiny": lambda: tiny.add_(1.0),
            "pdl": lambda: argmax_rows(tiny, pdl=True),  # a one-row argmax launched with PDL (sm_90)
            "nopdl": lambda: argmax_rows(tiny, pdl=False)}[tail]

    def launch_then():
        launch()
        then()
    return launch_then, kernels


def _after_replay(sampler, variant: str, logits: torch.Tensor):
    """A function launching ``variant``'s work on ``logits`` (the replay's output), and the sampler's kernels to put
    back afterwards."""
    kernels = sampler.topk_select, sampler.candidate_race
    variant, plus, tail = variant.partition("+")  # "<variant>+tiny": then one 16-element torch op
    if plus and tail not in ("tiny", "pdl", "nopdl"):
        raise ValueError(f"unknown suffix +{tail}; known: +tiny, +pdl, +nopdl")
    base, _, torch_part = variant.partition("/")
    if torch_part in ("torchtopk", "torchall"):
        sampler.topk_select = None
    if torch_part in ("torchrace", "torchall"):
        sampler.candidate_race = None
    B = logits.shape[0]
    empty = [[] for _ in range(B)]
    if base == "none":
        return (lambda: None), kernels
    if base in ("greedy", "sampled"):
        params = [GREEDY if base == "greedy" else SAMPLED] * B
        return (lambda: sampler.sample(logits, params, empty, empty, [None] * B)), kernels
    if base == "select":
        return (lambda: sampler.topk_select(logits[:, : sampler.vocab_size], 20)), kernels
    if base.startswith("sleep"):  # "sleep" ~20 us, "sleepN" ~N us: one thread spinning
        us = float(base[5:] or 20)
        cycles = int(us * 1e-6 * torch.cuda.get_device_properties(0).clock_rate * 1e3)  # at the rated clock
        return (lambda: torch.cuda._sleep(cycles)), kernels
    if base == "fill":  # every SM streaming memory for ~20 us (64 MiB read and written)
        buf = torch.zeros(16 << 20, dtype=torch.float32, device=logits.device)
        return (lambda: buf.add_(1.0)), kernels
    raise ValueError(f"unknown variant {variant!r}; known: {VARIANTS}")


def probe(llm, batch: int, context: int, steps: int, variants: list[str], target: str = "graph") -> dict:
    """Per variant, the timed ``target`` ("graph": the batch's decode graph replayed; "eager": the same step run
    eagerly on the graph's static inputs, ``CUDAGraphRunner.eager_logits``) and what follows it."""
    runner = llm.engine.runner
    graphs, sampler = runner.graphs, runner.sampler
    if graphs is None or not graphs.graphs:
        raise RuntimeError("no CUDA graphs captured: nothing to replay")
    out = {}
    with decoding_batch(llm, batch, context, max_tokens=16, vocab_size=bench.prompt_vocab_size(llm), seed=batch):
        llm.engine.step()
        torch.cuda.synchronize()
        g = graphs.graph_for(batch)
        key = (graphs.key_for(batch)[0], graphs.last_key[1])  # graph_for's: the bucket, the last step's class
        logits = graphs.logits[key][:batch]
        forward = g.replay if target == "graph" else (lambda: graphs.eager_logits(batch))
        for variant in variants:
            launch, kernels = after_replay(sampler, variant, logits)
            try:
                marks = []
                for i in range(steps + 4):
                    e = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
                    e[0].record()
                    forward()
                    e[1].record()
                    launch()
                    e[2].record()
                    if i >= 4:  # the first few: warm-up (a kernel's first launch compiles it)
                        marks.append(e)
                torch.cuda.synchronize()
            finally:
                sampler.topk_select, sampler.candidate_race = kernels
            replay = [1e3 * a.elapsed_time(b) for a, b, _ in marks]
            after = [1e3 * b.elapsed_time(c) for _, b, c in marks]
            # the replay following each launch (the first replay follows the warm-up's)
            out[variant] = {"replay_us_median": statistics.median(replay), "replay_us_min": min(replay),
                            "replay_us_max": max(replay), "after_us_median": statistics.median(after),
                            "iteration_us_median": statistics.median(r + a for r, a in zip(replay, after)),
                            "replay_us": replay}
            print(f"b{batch} {target} {variant}: replay {out[variant]['replay_us_median']:.0f} us (min "
                  f"{out[variant]['replay_us_min']:.0f}), what follows {out[variant]['after_us_median']:.0f} us",
                  flush=True)
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="qwen2.5-3b")
    ap.add_argument("--batches", default="4")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--targets", default="graph", help="graph, eager or both (comma-separated): what is timed")
    args = ap.parse_args(argv)
    targets = args.targets.split(",")
    if not set(targets) <= {"graph", "eager"}:
        ap.error(f"--targets: graph and/or eager, not {args.targets!r}")
    batches = [int(b) for b in args.batches.split(",")]
    variants = args.variants.split(",")
    llm = LLM(args.model, dtype="bfloat16", device="cuda", seed=0, max_num_seqs=max(batches), max_model_len=2048)
    bench.warmup(llm, bench.prompt_vocab_size(llm))
    record = {**provenance(), "model": args.model, "context": args.context, "batches": {}}
    for b in batches:
        # each variant twice, the second pass in reverse order: a drift over the run shows as a pass-to-pass change
        for target in targets:  # the graph's record under the batch, as before; the eager one beside it
            key = str(b) if target == "graph" else f"{b}/eager"
            record["batches"][key] = {"pass1": probe(llm, b, args.context, args.steps, variants, target),
                                      "pass2": probe(llm, b, args.context, args.steps, variants[::-1], target)}
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "replay_after_probe.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
