"""What the sampling a user gets by default costs: the same token-id requests through one engine, greedy with no
penalty, greedy with Qwen2.5-Instruct's repetition penalty (1.05), sampled with its temperature / top_p / top_k
(0.7 / 0.8 / 20), and both at once, which is what every server request to Qwen2.5-3B-Instruct gets from its
``generation_config.json`` (unseeded, as most requests are; ``sampled_seeded``: each request its own seed, whose
rows draw hashed noise instead of the generator's); each mode ``--rounds`` times in alternation, in one process, after a warm-up round.

    python scripts/sampling_bench.py --out DIR [--model qwen2.5-3b] [--device cuda] [--requests 256]
        [--prompt-len 512] [--max-tokens 128] [--rounds 2] [--modes plain,penalised,sampled,qwen_default]

Token-id prompts (random ids, one seed), so a random-weight shape needs no tokenizer. Every request ignores
eos and yields ``--max-tokens`` tokens, so every mode runs the same steps at the same batch sizes.

Per mode and round: output tok/s, the engine's host split of a step (``structured_bench.run``), and the CUDA
caching allocator's counters over the run (``num_alloc_retries``: a miss that freed cached blocks, i.e. a
``cudaFree``, which waits for the device; ``num_device_alloc`` / ``num_device_free``: ``cudaMalloc`` /
``cudaFree`` calls). Then, per mode, the first ``--profile-calls`` sampler calls under ``torch.profiler``: each
op's host and device time a call, and the CUDA runtime calls among them (a ``cudaStreamSynchronize``,
``cudaMalloc``, ``cudaFree`` or ``cudaHostAlloc`` shows there). Session 47 (H100, 3B shape, 256 rows) saw a
penalised step's sample launch take 3.4-4.4 ms of host time against plain's 0.5; this says where.

A mode with a top-k runs twice: as the engine samples (each row's top-k candidates, ``Sampler._candidates``) and
as ``<mode>/whole``, the whole-row sort the sampler used before session 51 (``Sampler.candidates = False``); a
mode with a repetition penalty also as ``<mode>/heavy``, with the sampler's host work before session 51
(``Sampler.lean_host = False``: the parameter table rebuilt and copied up every call, the output counts always
found); a mode with a top-k also as ``<mode>/fine``, its candidates picked by ``topk`` over the fp32 logits as
before session 52 (``Sampler.coarse_select = False``) instead of over them rounded to the model's dtype; and as
``<mode>/torchrace``, its candidates ordered, filtered and raced by ~25 torch launches as before session 53
(``Sampler.candidate_race = None``) instead of the candidate race kernel's one, and as ``<mode>/torchtopk``, its
candidates picked by ``topk`` (``Sampler.topk_select = None``) instead of ``kernels/topk_select.py``; a mode with a
repetition penalty also as ``<mode>/torchpen``, the penalty applied by ~14 torch launches as before session 53
(``Sampler.repetition_kernel = None``) instead of one kernel launch, and as ``<mode>/copypen``, the penalty kernel
writing into an fp32 copy of the logits as before session 55 (``Sampler.seen_words = None``) instead of the pick and
race applying it as they read the model's logits.

Writes DIR/sampling_bench.json (with the commit) and prints one line per run.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from structured_bench import run  # noqa: E402  (the engine's host split of a mode's run)

from pageserve.engine.llm import LLM  # noqa: E402
from pageserve.engine.sampling_params import SamplingParams  # noqa: E402
from pageserve.lab.profiling import sampler_op_profile  # noqa: E402
from pageserve.lab.results import provenance  # noqa: E402

MODES = {  # Qwen2.5-3B-Instruct's generation_config.json: temperature 0.7, top_p 0.8, top_k 20, repetition 1.05
    "plain": {},
    "penalised": {"repetition_penalty": 1.05},
    "sampled": {"temperature": 0.7, "top_p": 0.8, "top_k": 20},
    "qwen_default": {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05},
    "sampled_seeded": {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "seed": 0},  # each request its own seed
}
ALLOC_KEYS = ("num_alloc_retries", "num_sync_all_streams", "num_device_alloc", "num_device_free", "num_ooms")


def requests(n: int, prompt_len: int, max_tokens: int, vocab: int, mode: str, seed: int = 0):
    rng = np.random.default_rng(seed)
    prompts = [{"prompt_token_ids": rng.integers(0, vocab, prompt_len).tolist()} for _ in range(n)]
    kw = {"temperature": 0.0, **MODES[mode]}
    seeded = kw.pop("seed", None) is not None  # seeded rows draw hashed noise; the rest the engine's generator
    params = [SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=i if seeded else None, **kw)
              for i in range(n)]
    return prompts, params


def alloc_counters(device: torch.device) -> dict:
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    return {k: stats.get(k, 0) for k in ALLOC_KEYS}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="qwen2.5-3b")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--profile-calls", type=int, default=8)
    ap.add_argument("--no-whole", dest="whole", action="store_false",
                    help="skip the whole-row-sort runs of the modes with a top-k")
    ap.add_argument("--no-fine", dest="fine", action="store_false",
                    help="no <mode>/fine runs (topk over the fp32 logits, before session 52)")
    ap.add_argument("--no-torchrace", dest="torchrace", action="store_false",
                    help="no <mode>/torchrace runs (the candidates raced by torch ops, before session 53)")
    ap.add_argument("--no-torchtopk", dest="torchtopk", action="store_false",
                    help="no <mode>/torchtopk runs (the candidates picked by torch.topk, before session 53)")
    ap.add_argument("--no-torchpen", dest="torchpen", action="store_false",
                    help="no <mode>/torchpen runs (the repetition penalty by torch ops, before session 53)")
    ap.add_argument("--no-copypen", dest="copypen", action="store_false",
                    help="no <mode>/copypen runs (the repetition penalty into an fp32 copy, before session 55)")
    ap.add_argument("--no-heavy", dest="heavy", action="store_false",
                    help="skip the runs of the penalised modes with the host work before session 51")
    ap.add_argument("--num-blocks", type=int, default=None)
    args = ap.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        raise SystemExit(f"unknown modes {unknown}; choose from {list(MODES)}")

    kw = {"num_blocks": args.num_blocks} if args.num_blocks else {}
    # the same prompts in every mode: without the prefix cache each run does its own prefills, as a first run
    llm = LLM(args.model, device=args.device, dtype=args.dtype, enable_prefix_caching=False, **kw)
    dev = llm.engine.runner.device
    vocab = llm.engine.model_config.vocab_size
    rows = []
    sampler = llm.engine.runner.sampler
    # a mode with a top-k also runs as "<mode>/whole" (the sampler's whole-row sort in place of its candidates) and
    # "<mode>/fine" (its candidates picked by topk over the fp32 logits) and "<mode>/torchrace" (raced by torch
    # ops) and "<mode>/torchtopk" (picked by topk); one with a repetition penalty as "<mode>/torchpen" (the
    # penalty by torch ops), "<mode>/copypen" (the penalty kernel into an fp32 copy) and "<mode>/heavy" (the table
    # rebuilt every call and the output counts always found)
    runs = [m for mode in modes for m in [mode] + ([f"{mode}/whole"] if args.whole and "top_k" in MODES[mode] else [])
            + ([f"{mode}/fine"] if args.fine and "top_k" in MODES[mode] else [])
            + ([f"{mode}/torchrace"] if args.torchrace and "top_k" in MODES[mode] else [])
            + ([f"{mode}/torchtopk"] if args.torchtopk and "top_k" in MODES[mode] else [])
            + ([f"{mode}/torchpen"] if args.torchpen and "repetition_penalty" in MODES[mode] else [])
            + ([f"{mode}/copypen"] if args.copypen and "repetition_penalty" in MODES[mode] else [])
            + ([f"{mode}/heavy"] if args.heavy and "repetition_penalty" in MODES[mode] else [])]
    coarse_default, race_default, pen_default = sampler.coarse_select, sampler.candidate_race, sampler.repetition_kernel
    select_default, seen_default = sampler.topk_select, sampler.seen_words

    def variant_flags(variant: str) -> None:
        sampler.candidates, sampler.lean_host = variant != "whole", variant != "heavy"
        sampler.coarse_select = coarse_default and variant != "fine"
        sampler.candidate_race = None if variant == "torchrace" else race_default
        sampler.topk_select = None if variant == "torchtopk" else select_default
        sampler.repetition_kernel = None if variant == "torchpen" else pen_default
        sampler.seen_words = None if variant in ("torchpen", "copypen") else seen_default

    for rnd in range(args.rounds + 1):  # round 0 warms up (compiles, captures) and is not kept
        for name in (runs if rnd % 2 else runs[::-1]):
            mode, _, variant = name.partition("/")
            variant_flags(variant)
            before = alloc_counters(dev)
            row = {"mode": name, "round": rnd,
                   **run(llm, *requests(args.requests, args.prompt_len, args.max_tokens, vocab, mode))}
            after = alloc_counters(dev)
            row["allocator"] = {k: after[k] - before[k] for k in after}
            if rnd:
                rows.append(row)
            print(json.dumps(row), flush=True)
    variant_flags("")
    median = {m: statistics.median(r["output_tok_s"] for r in rows if r["mode"] == m) for m in runs}
    profiles = {}
    for name in runs:
        mode, _, variant = name.partition("/")
        variant_flags(variant)
        try:
            profiles[name] = sampler_op_profile(
                llm, *requests(args.requests, args.prompt_len, min(args.max_tokens, 32), vocab, mode),
                calls=args.profile_calls)
        except Exception as e:  # the runs above stand; the record says why the profile is missing
            profiles[name] = {"error": repr(e)[:300]}
        print(json.dumps({"profile": name, **profiles[name]}), flush=True)
    variant_flags("")
    record = {**provenance(), "args": vars(args), "device_name": (torch.cuda.get_device_name(dev)
                                                                   if dev.type == "cuda" else "cpu"),
              "runs": rows, "median_output_tok_s": median,
              "ratio_to_plain": ({m: median[m] / median["plain"] for m in runs} if "plain" in median else {}),
              "sampler_profiles": profiles}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sampling_bench.json").write_text(json.dumps(record, indent=1))
    print(json.dumps(record["ratio_to_plain"]))


if __name__ == "__main__":
    main()
