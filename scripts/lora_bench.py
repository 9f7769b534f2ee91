"""LoRA adapters on the GPU: are the adapters' rows right inside graphed, mixed batches, and what does serving
them cost (``EngineConfig.enable_lora``)?

    python scripts/lora_bench.py --out DIR [--model qwen2.5-3b] [--device cuda] [--dtype bfloat16]
        [--batches 1,16,64] [--context 256] [--rank 16] [--max-loras 4] [--rounds 2]

Rows: PROMPTS token-id prompts with adapter 1, adapter 2 and none, in one batch of the LoRA engine (CUDA graphs
and Triton kernels as the defaults run them), scored token by token (prompt logprobs) against plain engines over
copies of the weights with each adapter merged in (W + s B A). Beside it: the LoRA engine's rows of no adapter
against a plain engine over the base weights, and the adapter's whole effect (``adapter_effect``: merged vs base).
On the H100 (session 47) the first was exactly 0 (a row of no adapter keeps plain's bits), so it is no yardstick;
adapter rows were 0.19 from the merged model's against an effect of 3.19, most likely the merged reference's own rounding of
W + s B A into bf16 (the delta is ~2^-8 of W). A wrong slot, scale or part would be off by the whole effect. The
fp32 check is ``tests/test_lora.py``'s GPU test.

Cost: the decode step (ms, ``lab.decode_bench.decode_step_ms``) at each batch for: ``plain`` (enable_lora off),
``lora_none`` (on, no request uses an adapter), ``lora_one`` (every request the same adapter) and ``lora_mixed``
(the requests take ``max_loras`` adapters in turn), the engines alternating over ``rounds``. These run the fused
kernel path (``LoRASlots.USE_KERNELS`` on, whatever the shipped default). ``lora_none_ref`` and ``lora_mixed_ref``:
a third engine whose slots run the reference products (``USE_KERNELS`` off, the default since session 48: both
products through ``ops.linear``, a select and an add: four launches a projection against the kernels' two), the
A/B of ``kernels/lora.py`` (``--no-ref`` leaves it out). The rows check runs on the kernel path's engine.

Writes DIR/lora_bench.json (commit and hardware from ``pageserve.lab.results``) and prints one line a figure.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from pageserve.engine.llm import LLM
from pageserve.engine.lora import LoRARequest
from pageserve.engine.sampling_params import SamplingParams
from pageserve.lab.decode_bench import decode_step_ms
from pageserve.lab.lora_reference import merged_model, write_peft_adapter
from pageserve.lab.results import hardware_name, provenance
from pageserve.model.lora import LoRAAdapter, LoRASlots
from pageserve.model.loader import load_model

PROMPTS = 4
PROMPT_LEN = 96


def prompt_scores(out) -> list[float]:
    return [next(iter(d.values())) for d in out.prompt_logprobs[1:]]


def max_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="qwen2.5-3b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--max-loras", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--num-blocks", type=int, default=2048)
    ap.add_argument("--no-ref", action="store_true", help="no engine with the reference LoRA products")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    batches = [int(b) for b in args.batches.split(",")]

    loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    cfg = loaded.config
    folder = Path(tempfile.mkdtemp(prefix="lora_bench_"))
    requests = []
    for i in range(args.max_loras):
        write_peft_adapter(folder / f"a{i}", cfg, rank=args.rank, alpha=2 * args.rank, seed=100 + i, std=0.02)
        requests.append(LoRARequest(f"a{i}", i + 1, str(folder / f"a{i}")))
    common = dict(device=args.device, num_blocks=args.num_blocks, max_num_seqs=max(batches))
    plain = LLM.from_model(loaded.model, **common)

    def lora_engine(use_kernels: bool) -> LLM:
        shipped = LoRASlots.USE_KERNELS
        LoRASlots.USE_KERNELS = use_kernels  # read when the engine builds its slots, before its graphs are captured
        try:
            return LLM.from_model(_copy(loaded.model), enable_lora=True, max_loras=args.max_loras,
                                  max_lora_rank=args.rank, **common)
        finally:
            LoRASlots.USE_KERNELS = shipped

    lora = lora_engine(True)  # the kernel path (where the ops have it), whatever the shipped default
    lora_ref = None if args.no_ref else lora_engine(False)
    record = {"script": "lora_bench", "hardware": hardware_name(), **provenance(), "date": time.strftime("%Y-%m-%d"),
              "model": args.model, "dtype": args.dtype, "rank": args.rank, "max_loras": args.max_loras,
              "context": args.context}

    # ---- rows against merged weights, in one mixed batch of the LoRA engine
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, cfg.vocab_size, (PROMPT_LEN,), generator=gen).tolist() for _ in range(PROMPTS)]
    score = SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=0, ignore_eos=True)
    kinds = [requests[0], requests[1], None]
    batch = [(p, k) for p in prompts for k in kinds]
    got = lora.generate([p for p, _ in batch], score, use_tqdm=False, lora_request=[k for _, k in batch])
    base = plain.generate(prompts, score, use_tqdm=False)
    rows = {"a0": [], "a1": [], "none": [], "adapter_effect": []}
    for j, kind in enumerate(kinds[:2]):
        adapter = LoRAAdapter.load(kind.lora_path, cfg, args.rank)
        ref_llm = LLM.from_model(merged_model(loaded.model, adapter), device=args.device, num_blocks=256)
        ref = ref_llm.generate(prompts, score, use_tqdm=False)
        for i in range(PROMPTS):
            rows[f"a{j}"].append(max_diff(prompt_scores(got[3 * i + j]), prompt_scores(ref[i])))
            rows["adapter_effect"].append(max_diff(prompt_scores(ref[i]), prompt_scores(base[i])))
        del ref_llm
        torch.cuda.empty_cache() if args.device == "cuda" else None
    for i in range(PROMPTS):
        rows["none"].append(max_diff(prompt_scores(got[3 * i + 2]), prompt_scores(base[i])))
    record["rows_max_abs_logprob_diff"] = {k: max(v) for k, v in rows.items()}
    for k, v in record["rows_max_abs_logprob_diff"].items():
        print(f"rows {k}: max |logprob diff| {v:.4f}", flush=True)
    save(out, record)  # again after each round: a run cut by its time limit keeps what it measured

    # ---- cost
    variants = {"plain": (plain, None), "lora_none": (lora, None), "lora_one": (lora, requests[:1]),
                "lora_mixed": (lora, requests)}
    if lora_ref is not None:
        variants.update({"lora_none_ref": (lora_ref, None), "lora_mixed_ref": (lora_ref, requests)})
    times: dict[str, dict[int, list[float]]] = {v: {b: [] for b in batches} for v in variants}
    for r in range(args.rounds):
        for b in batches:
            for name, (llm, loras) in variants.items():
                times[name][b].append(decode_step_ms(llm, b, args.context, lora_requests=loras))
                print(f"round {r} b{b} {name}: {times[name][b][-1]:.3f} ms", flush=True)
        record["rounds_done"] = r + 1
        record["decode_step_ms"] = {v: {str(b): statistics.median(t) for b, t in bt.items() if t}
                                    for v, bt in times.items()}
        record["decode_step_ratio_vs_plain"] = {
            v: {str(b): statistics.median(t) / statistics.median(times["plain"][b]) for b, t in bt.items() if t}
            for v, bt in times.items() if v != "plain"}
        save(out, record)
    for v, bt in record["decode_step_ms"].items():
        print(f"{v}: " + ", ".join(f"b{b} {ms:.3f} ms" for b, ms in bt.items()), flush=True)
    for v, bt in record["decode_step_ratio_vs_plain"].items():
        print(f"{v}_ratio: " + ", ".join(f"b{b} {r:.3f}" for b, r in bt.items()), flush=True)
    record["lora_loads"] = lora.engine.runner.lora.num_loads
    save(out, record)


def save(out: Path, record: dict) -> None:
    (out / "lora_bench.json").write_text(json.dumps(record, indent=2) + "\n")


def _copy(model):
    import copy

    return copy.deepcopy(model)


if __name__ == "__main__":
    main()
