"""What n-gram speculative decoding buys (``EngineConfig.speculative_config``): the same chat requests
through a plain engine and through engines that draft ``k`` tokens a step, in alternation, in one process.

    python scripts/spec_bench.py --out DIR [--model smollm2-135m-instruct | PATH.gguf] [--device cuda]
        [--dtype bfloat16] [--ks 2,4] [--batches 1,8] [--max-tokens 128] [--rounds 2]

Two workloads, greedy: ``copy`` (rewrite code keeping most of it, repeat a text: what prompt lookup is
for) and ``open`` (questions whose answers copy little: what drafting costs when it mostly fails). Each
request in a batch of B is one of the workload's prompts in turn. Per (workload, batch, engine, round):
wall seconds, engine steps, output tokens, and for the drafting engines the drafts, the accepted ones
and tokens per drafting step; per (workload, batch, k) the median speedup over plain and whether every
text equals plain decoding's (greedy: it must, up to the rounding of a k+1-token chunk against one-token
steps). The plain engine runs with async scheduling as the default does; a drafting engine runs steps
synchronously, so ``plain_sync`` (the default engine without it) is also timed: the part of any
difference that is the overlap lost, not the drafting.

``--oracle`` (any model, random weights included: the 3B shape): token-id prompts, and each drafting engine's
drafts are the plain run's own next tokens, so every draft is accepted (up to bf16 near-ties) and a step emits
k + 1 tokens: the speedup is the ceiling of k drafts at that batch, what the verify step costs against a decode
step, whatever a real model's acceptance will be. "Up to bf16 near-ties" was too hopeful: at the 3B shape with
random weights the verify step's several-row products flip a near-tie at once, and on the H100 (session 47) 2
of 247 drafts were accepted, after which the plain run's tokens no longer follow. ``--deterministic`` runs every
engine in the batch-invariant mode, whose verify rows are plain decoding's bits (tests/test_deterministic.py):
there the oracle holds, and the ratios are the deterministic mode's.

Writes DIR/spec_bench.json (commit and hardware from ``pageserve.lab.results``) and prints one line a run.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from pageserve.engine.llm import LLM
from pageserve.engine.sampling_params import SamplingParams
from pageserve.lab.results import hardware_name, provenance
from pageserve.model.loader import load_model

CODE = ("def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
        "def factorial(n):\n    result = 1\n    for i in range(2, n + 1):\n        result *= i\n    return result\n\n"
        "def is_prime(n):\n    if n < 2:\n        return False\n    for d in range(2, int(n ** 0.5) + 1):\n"
        "        if n % d == 0:\n            return False\n    return True\n")
TEXT = ("Paged attention stores the key and value cache in fixed-size blocks, so memory is not wasted on "
        "padding, and a block table maps each sequence's positions to the blocks that hold them. Continuous "
        "batching lets a new request join the running batch at any step instead of waiting for a whole batch "
        "to finish.")
WORKLOADS = {
    "copy": [
        "Rewrite this code with type hints, and keep everything else the same:\n\n" + CODE,
        "Repeat the following text exactly, word for word:\n\n" + TEXT,
        "Rename the function fibonacci to fib in this code and show the whole code:\n\n" + CODE,
        "Fix the spelling and repeat the rest unchanged: " + TEXT.replace("blocks", "blokcs").replace("batch", "bacth"),
    ],
    "open": [
        "Write a short poem about the sea.",
        "Give three tips for learning a new language.",
        "Explain why the sky is blue to a child.",
        "What are the pros and cons of electric cars?",
    ],
}


def oracle_drafts(llm: LLM, truth: dict[tuple, list[int]]) -> None:
    """``llm``'s drafter proposes each sequence's next tokens from ``truth`` (prompt ids -> the plain run's output)."""
    from pageserve.engine.speculative import can_draft

    k = llm.engine.proposer.cfg.num_speculative_tokens

    def propose(running, max_model_len):
        for seq in running:
            m, room = seq.num_output_tokens, min(can_draft(seq, max_model_len), k)
            seq.spec_token_ids = list(truth[tuple(seq.prompt_token_ids)][m:m + room]) if room > 0 else []

    llm.engine.proposer.propose = propose


def run(llm: LLM, prompts: list, params: SamplingParams) -> dict:
    before = llm.get_stats()
    t0 = time.perf_counter()
    if prompts and isinstance(prompts[0], list):  # token ids (--oracle)
        outs = llm.generate(prompts, params, use_tqdm=False)
    else:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    after = llm.get_stats()
    d = {k: after[k] - before[k] for k in ("num_steps", "generated_tokens", "spec_draft_tokens", "spec_accepted_tokens")}
    return {"wall_s": wall, "steps": d["num_steps"], "tokens": d["generated_tokens"],
            "drafts": d["spec_draft_tokens"], "accepted": d["spec_accepted_tokens"],
            "texts": [o.outputs[0].text or o.outputs[0].token_ids for o in outs],
            "token_ids": [o.outputs[0].token_ids for o in outs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--ks", default="2,4", help="num_speculative_tokens values, comma-separated")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--workloads", default="copy,open")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--oracle", action="store_true", help="token-id prompts, drafts from the plain run (see above)")
    ap.add_argument("--prompt-len", type=int, default=128, help="--oracle: prompt tokens")
    ap.add_argument("--num-blocks", type=int, default=2048,
                    help="KV blocks per engine: several engines share the GPU, so none may size itself from memory")
    ap.add_argument("--deterministic", action="store_true", help="every engine in the batch-invariant mode")
    ap.add_argument("--det-mixed-graphs", action="store_true",
                    help="with --deterministic: the deterministic ops' mixed-step graphs on (DeterministicOps."
                         "mixed_graphs, off by default until checked on a GPU): verify steps replayed, not eager")
    args = ap.parse_args()
    if args.det_mixed_graphs:
        from pageserve.model.deterministic_ops import DeterministicOps

        DeterministicOps.mixed_graphs = True  # read when each engine starts, before its graphs are captured
    ks = [int(x) for x in args.ks.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    base = dict(loaded=loaded, device=args.device, dtype=args.dtype, enable_prefix_caching=False,
                num_blocks=args.num_blocks, deterministic=args.deterministic)
    engines = {"plain": LLM(**base), "plain_sync": LLM(**base, async_scheduling=False)}
    for k in ks:
        engines[f"ngram{k}"] = LLM(**base, speculative_config={"method": "ngram", "num_speculative_tokens": k})
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=args.oracle)
    workloads = ["oracle"] if args.oracle else args.workloads.split(",")
    if args.oracle:
        import torch

        g = torch.Generator().manual_seed(0)
        vocab = loaded.config.vocab_size
        ids = [torch.randint(1, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(max(batches))]
        truth = {tuple(p): t for p, t in zip(ids, run(engines["plain"], ids, params)["token_ids"])}
        for name, llm in engines.items():
            if name.startswith("ngram"):
                oracle_drafts(llm, truth)
    warm = [ids[0]] if args.oracle else WORKLOADS["copy"][:1]
    for llm in engines.values():  # warm-up: first calls, graphs' first replays
        run(llm, warm, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))

    runs, summary = [], {}
    for wl in workloads:
        for B in batches:
            prompts = ids[:B] if args.oracle else [WORKLOADS[wl][i % len(WORKLOADS[wl])] for i in range(B)]
            for rnd in range(args.rounds):
                order = list(engines) if rnd % 2 == 0 else list(engines)[::-1]
                for name in order:
                    r = run(engines[name], prompts, params)
                    r.update(workload=wl, batch=B, engine=name, round=rnd)
                    runs.append(r)
                    acc = f" accepted {r['accepted']}/{r['drafts']}" if r["drafts"] else ""
                    print(f"{wl} b{B} {name} round {rnd}: {r['wall_s']:.3f} s, {r['steps']} steps, "
                          f"{r['tokens']} tokens{acc}", flush=True)
            plain = [r for r in runs if r["workload"] == wl and r["batch"] == B and r["engine"] == "plain"]
            t_plain = statistics.median(r["wall_s"] for r in plain)
            for name in engines:
                if name == "plain":
                    continue
                mine = [r for r in runs if r["workload"] == wl and r["batch"] == B and r["engine"] == name]
                key = f"{wl}_b{B}_{name}"
                summary[f"{key}_speedup"] = t_plain / statistics.median(r["wall_s"] for r in mine)
                summary[f"{key}_texts_equal_plain"] = all(r["texts"] == plain[0]["texts"] for r in mine)
                drafts = sum(r["drafts"] for r in mine)
                if drafts:
                    summary[f"{key}_acceptance"] = sum(r["accepted"] for r in mine) / drafts
                    summary[f"{key}_tokens_per_step"] = sum(r["tokens"] for r in mine) / sum(r["steps"] for r in mine)
            summary[f"{wl}_b{B}_plain_tokens_per_step"] = sum(r["tokens"] for r in plain) / sum(r["steps"] for r in plain)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"script": "spec_bench", "hardware": hardware_name(), **provenance(), "date": time.strftime("%Y-%m-%d"),
              "parameters": vars(args), "figures": summary,
              "runs": [{k: v for k, v in r.items() if k not in ("texts", "token_ids")} for r in runs]}
    (out / "spec_bench.json").write_text(json.dumps(record, indent=2) + "\n")
    for k, v in summary.items():
        print(f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}")


if __name__ == "__main__":
    main()
