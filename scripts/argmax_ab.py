"""The sampler's argmax, Triton kernel against torch.argmax, in one engine (session 14).

At 39690c1 ``det_b1_switches`` saw the default engine (Triton argmax) 16-20 µs faster at batch 1
than the same engine built with torch.argmax, as predicted, but also ~110-140 µs faster at batches
2 and 8 *in its graph's replay time*, where nothing in the graph differs. Separate engines were built
per variant, so this script keeps one engine and alternates only ``sampler._argmax``, and checks
that both give the same greedy tokens (a wrong token stream could change the step's cost through
the data it feeds the GPU).

Each batch's timings also log the SM clock (``ClockLog``, session 15): whether a variant that runs
faster runs at another clock.

    python scripts/argmax_ab.py --out DIR [--batches 1,2,8] [--rounds 2]

Writes DIR/argmax_ab.json (with the commit). Qwen2.5-3B shape, random weights, bf16, graphs.

    python scripts/argmax_ab.py --out DIR --kernel [--batches 1,64,200,256,512] [--blocks 2048,8192,16384]

times the kernel alone instead (session 35: at 200-256 rows the sampler's share of a step was ~70 µs,
against ~15 µs of reading the logits): µs a call (``graph_us``, 20 calls a graph) of ``argmax_rows``
at each first-stage width and of ``torch.argmax``, on bf16 [B, 151,936] logits, each checked equal
to torch. Writes DIR/argmax_kernel.json.
"""
from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import torch

from pageserve.engine import sampler as sampler_mod
from pageserve.engine.llm import LLM
from pageserve.kernels.argmax import argmax_rows
from pageserve.kernels.step_inputs import stage_decode_inputs
from pageserve.lab import bench
from pageserve.lab.decode_bench import decode_step_ms, graph_replay_ms
from pageserve.lab.kernel_bench.timing import graph_us
from pageserve.lab.profiling import ClockLog
from pageserve.lab.results import provenance

# "triton" launches under PDL at any row count since b694991; at c6f794a it stopped at 8 rows like every
# decode kernel, and the record's "triton_pdl_any_rows" variant (a copy of the wrapper's launch, removed
# once it became the default) is today's "triton"
ARGMAX = {"triton": argmax_rows, "torch": sampler_mod._torch_argmax,
          "triton_no_pdl": functools.partial(argmax_rows, pdl=False),  # is the batch-2/8 effect PDL's?
          "triton_stage_pdl": argmax_rows}  # and the copy-in before the replay under PDL too (session 15)


def kernel_times(batches: list[int], blocks: list[int], vocab: int = 151936, rounds: int = 2, device: str = "cuda") -> dict:
    """µs a call of argmax_rows per first-stage width, and torch.argmax's, per batch (bf16 logits)."""
    gen = torch.Generator(device=device).manual_seed(0)
    rec: dict = {"vocab": vocab, "dtype": "bfloat16", "rows": {}}
    for b in batches:
        x = torch.randn(b, vocab, device=device, generator=gen).to(torch.bfloat16)
        want = x.argmax(dim=-1)
        row = {"read_mb": x.numel() * x.element_size() / 1e6, "equal": {}}
        fns = {f"block{k}": functools.partial(argmax_rows, x, block=k) for k in blocks}
        fns["torch"] = functools.partial(torch.argmax, x, dim=-1)
        for name, fn in fns.items():
            row["equal"][name] = bool(torch.equal(fn(), want))
        for r in range(rounds):  # alternating, so the clock's drift falls on every variant
            for name, fn in fns.items():
                row.setdefault(name, []).append(graph_us(lambda i, fn=fn: fn(), 20))
        rec["rows"][f"b{b}"] = row
        print(f"b{b}: " + ", ".join(f"{n} {min(row[n]):.1f} us" for n in fns) + f"; equal {row['equal']}", flush=True)
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", default="1,2,8")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variants", default=",".join(ARGMAX))
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--kernel", action="store_true", help="time the argmax kernel alone (no engine)")
    ap.add_argument("--blocks", default="2048,4096,8192,16384", help="with --kernel: first-stage widths")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("argmax_ab times CUDA-graphed engine steps: it needs a GPU")
    batches = [int(b) for b in args.batches.split(",")]
    if args.kernel:
        rec = {**provenance(), **kernel_times(batches, [int(k) for k in args.blocks.split(",")], rounds=args.rounds)}
        Path(args.out, "argmax_kernel.json").write_text(json.dumps(rec, indent=1))
        return
    out = Path(args.out) / "argmax_ab.json"
    llm = LLM("dummy:qwen2.5-3b", device="cuda", dtype="bfloat16", seed=0, max_model_len=2048,
              max_num_seqs=max(64, *batches), cuda_graph_max_bs=max(batches))
    vocab = bench.prompt_vocab_size(llm)
    bench.warmup(llm, vocab)
    sampler = llm.engine.runner.sampler
    rec = {**provenance(), "model": "qwen2.5-3b", "context": args.context, "rounds": [], "tokens_equal": {}}
    prompts = bench.random_workload(8, 64, 1, vocab, seed=7).prompts
    for b in batches:  # same prompts, greedy, 48 tokens: both argmaxes must produce the same text
        toks = {}
        for name, fn in ARGMAX.items():
            sampler._argmax = fn
            outs = llm.generate(prompts[:b], bench.greedy_params(48), use_tqdm=False)
            toks[name] = [o.outputs[0].token_ids for o in outs]
        rec["tokens_equal"][f"b{b}"] = all(t == toks["torch"] for t in toks.values())
    for r in range(args.rounds):
        for name in args.variants.split(","):
            sampler._argmax = ARGMAX[name]
            graphs = llm.engine.runner.graphs
            graphs._stage = functools.partial(stage_decode_inputs, pdl=None if name.endswith("stage_pdl") else False)
            row = {"round": r, "argmax": name}
            for b in batches:
                with ClockLog() as clocks:
                    row[f"b{b}_step_ms"] = decode_step_ms(llm, b, args.context, args.steps)
                    row[f"b{b}_graph_ms"] = graph_replay_ms(llm.engine.runner, b)
                row[f"b{b}_sm_clock"] = clocks.summary()
            rec["rounds"].append(row)
            print(row, flush=True)
            out.write_text(json.dumps(rec, indent=1))
    print("tokens equal:", rec["tokens_equal"], flush=True)
    out.write_text(json.dumps(rec, indent=1))


if __name__ == "__main__":
    main()
