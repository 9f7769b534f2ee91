"""Beam search against transformers' (``LLM.beam_search`` vs ``generate(num_beams=W)``), the same chat prompts,
the same model and device, in alternation, in one process.

    python scripts/beam_bench.py --out DIR [--model smollm2-135m-instruct | PATH.gguf] [--device cuda]
        [--dtype float32] [--widths 2,4] [--batches 1,4] [--max-tokens 32] [--rounds 2]

Both run the same search (transformers with ``early_stopping="never"``, the rules ``engine/beam_search.py``
follows), so they do the same work and should return the same beams: each run records whether every beam's
tokens are equal. pageserve runs all prompts of a batch at once (their rounds share engine steps);
transformers runs them one ``generate`` call each (its beam search takes one prompt length a batch without
padding). Per (batch, width, round): wall seconds of each and their ratio; the median ratio per (batch, width).
pageserve's engine keeps prefix caching on, as by default: a round recomputes each beam's tail only.

Writes DIR/beam_bench.json (commit and hardware from ``pageserve.lab.results``) and prints one line a run.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from pageserve import BeamSearchParams
from pageserve.engine.llm import LLM
from pageserve.lab.hf_reference import build_hf_model
from pageserve.lab.results import hardware_name, provenance
from pageserve.model.loader import load_model

QUESTIONS = [
    "What is the capital of France?", "Give three tips for learning a new language.",
    "Explain why the sky is blue to a child.", "Write a short poem about the sea.",
    "What are the pros and cons of electric cars?", "How do I boil an egg?",
    "Name three prime numbers.", "What is paged attention?",
]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--device", default="cpu")  # on a CPU box hardware_name() names the CPU
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--widths", default="2,4")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    batches = [int(b) for b in args.batches.split(",")]

    loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    hf = build_hf_model(loaded.model, device=args.device)
    llm = LLM.from_model(loaded.model, tokenizer=loaded.tokenizer, device=args.device, dtype=args.dtype,
                         max_model_len=2048)
    tok = llm.tokenizer
    eos = sorted(llm.engine.eos_token_ids)
    prompts = [tok.render_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    runs, summary = [], {}
    for batch in batches:
        for width in widths:
            batch_prompts = [prompts[i % len(prompts)] for i in range(batch)]
            params = BeamSearchParams(beam_width=width, max_tokens=args.max_tokens)
            llm.beam_search(batch_prompts[:1], BeamSearchParams(beam_width=width, max_tokens=2), use_tqdm=False)
            ratios = []
            for r in range(args.rounds):
                sync(args.device)
                t = time.perf_counter()
                outs = llm.beam_search(batch_prompts, params, use_tqdm=False)
                sync(args.device)
                ours = time.perf_counter() - t
                llm.reset_prefix_cache()  # the next round starts as cold as transformers' does
                t = time.perf_counter()
                theirs_beams = []
                for p in batch_prompts:
                    ids = torch.tensor([tok.encode(p)], device=args.device)
                    g = hf.generate(ids, num_beams=width, num_return_sequences=width, max_new_tokens=args.max_tokens,
                                    do_sample=False, early_stopping="never", eos_token_id=eos, pad_token_id=eos[0],
                                    temperature=None, top_p=None, top_k=None)
                    for row in g[:, ids.shape[1]:].tolist():
                        cut = next((j + 1 for j, x in enumerate(row) if x in eos), len(row))
                        theirs_beams.append(row[:cut])
                sync(args.device)
                theirs = time.perf_counter() - t
                equal = theirs_beams == [c.token_ids for out in outs for c in out.outputs]
                tokens = sum(len(c.token_ids) for out in outs for c in out.outputs)
                run = {"batch": batch, "width": width, "round": r, "pageserve_s": ours, "transformers_s": theirs,
                       "time_ratio": ours / theirs, "beams_equal": equal, "beam_tokens": tokens}
                runs.append(run)
                ratios.append(ours / theirs)
                print(json.dumps(run), flush=True)
            summary[f"b{batch}_w{width}_time_ratio"] = statistics.median(ratios)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {**provenance(), "hardware": hardware_name(), "parameters": vars(args),
              "figures": {**summary, "all_beams_equal": all(r["beams_equal"] for r in runs)}, "runs": runs}
    (out / "beam_bench.json").write_text(json.dumps(record, indent=1))
    print(json.dumps(record["figures"]))


if __name__ == "__main__":
    main()
