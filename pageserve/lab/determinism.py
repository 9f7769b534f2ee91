"""Is a sequence's output the same whatever else the engine runs with it? (issue 15)

``invariance_suite`` runs the same prompts through engines that differ only in what should not
matter — each prompt alone or all in one batch, prefill chunk budgets that cut the prompts at
different places, CUDA graphs or eager, a prefix-cache hit or a miss, async or sync
scheduling — and counts, per comparison, the prompts whose generated token ids *and* per-token
logprobs (the sampled token's and the top ``logprobs`` alternatives', computed from the fp32
logits) are bitwise equal. Equal logprobs for every token is what "the logits are bitwise
equal" looks like from outside the engine. ``seeded_sampling_identical`` does the same for
temperature sampling with per-request seeds, alone vs batched.

``make_llm(**overrides)`` builds an engine (``LLM``) with the given ``EngineConfig`` overrides;
each comparison builds its own and drops it (one engine lives at a time).
"""
from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from typing import Any

from ..engine.sampling_params import SamplingParams

# 16 prompts of different lengths (20-130 tokens with SmolLM2's tokenizer), so the 16- and
# 33-token chunk budgets cut most of them, and at different places
DEFAULT_PROMPTS = [
    "Explain in two sentences why the sky is blue.",
    "Write a haiku about a lighthouse keeper who has never seen the sea in daylight, and explain its imagery.",
    "List three prime numbers greater than one hundred.",
    "What is the capital of Australia, and why is it not Sydney? Give the history briefly, "
    "mentioning the rivalry between Sydney and Melbourne and the compromise that followed.",
    "Translate 'good morning, how are you?' into French and Spanish.",
    "A train leaves at 3 pm travelling 80 km/h; another leaves the same station at 4 pm travelling "
    "100 km/h on the same track. When does the second train catch up with the first? Show the steps.",
    "Summarise the plot of Romeo and Juliet for a ten-year-old.",
    "Give me a recipe for pancakes that uses no eggs.",
    "Why do cats purr? Answer as a veterinarian would, citing what is known and what is still debated "
    "among researchers, and keep it under one hundred words.",
    "Write a Python function that reverses a linked list.",
    "Describe the water cycle, step by step, starting from the ocean and ending with rain falling on a "
    "mountain, then flowing back to the sea through rivers and groundwater.",
    "What are the three laws of thermodynamics?",
    "Suggest five names for a bakery that specialises in sourdough bread.",
    "You are a travel guide in Kyoto. A visitor has one rainy afternoon and likes gardens, tea and "
    "quiet places. Plan the afternoon hour by hour, with how to get between the places.",
    "Is a tomato a fruit or a vegetable? Explain both the botanical and the culinary answer.",
    "Tell me a short story about a robot learning to paint, in exactly five sentences, with a twist "
    "at the end that changes how the reader sees the first sentence.",
]


def outputs_of(llm, prompts: Sequence, params: SamplingParams | list[SamplingParams]) -> list[tuple[list[int], Any]]:
    """(token ids, per-token logprob dicts) of each prompt's first completion, in order."""
    results = llm.generate(list(prompts), params, use_tqdm=False)
    return [(list(r.outputs[0].token_ids), r.outputs[0].logprobs) for r in results]


def count_identical(a: list[tuple], b: list[tuple]) -> int:
    """Prompts whose token ids and logprobs are equal in both runs (floats compared exactly)."""
    return sum(1 for x, y in zip(a, b, strict=True) if x[0] == y[0] and x[1] == y[1])


def _release(llm) -> None:
    llm.shutdown()
    del llm
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:
        pass


# the engines the comparisons build other than ``prefix``'s: no prefix hits (the cache is on by default)
NO_PREFIX_CACHE = {"enable_prefix_caching": False}


def invariance_suite(make_llm: Callable[..., Any], prompts: Sequence = DEFAULT_PROMPTS, max_tokens: int = 64,
                     logprobs: int = 5, chunk_budgets: Sequence[int] = (16, 33),
                     graphs: bool = True) -> dict[str, Any]:
    """Counts of prompts (of ``len(prompts)``) identical between the reference run — all prompts
    in one batch, default engine settings but the prefix cache off (``NO_PREFIX_CACHE``: so that the
    prompts run alone after it do not hit what it cached) — and each variant:

    - ``alone``: each prompt generated on its own (a batch of one);
    - ``chunk_<n>``: ``max_num_batched_tokens = n`` (prompts prefilled in n-token chunks);
    - ``eager`` (``graphs``): ``enforce_eager=True`` (no CUDA graphs) against graphs;
    - ``prefix``: prefix caching on, each prompt served once before (so the measured run hits
      the cache for every full block but the last token's) against prefix caching on, cold;
    - ``sync``: ``async_scheduling=False``.
    Also ``outputs``: the reference run's token ids (for the record)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)
    r: dict[str, Any] = {"num_prompts": len(prompts)}

    llm = make_llm(**NO_PREFIX_CACHE)
    ref = outputs_of(llm, prompts, params)
    r["alone"] = count_identical(ref, [outputs_of(llm, [p], params)[0] for p in prompts])
    r["outputs"] = [t for t, _ in ref]
    _release(llm)

    for n in chunk_budgets:
        llm = make_llm(max_num_batched_tokens=n, **NO_PREFIX_CACHE)
        r[f"chunk_{n}"] = count_identical(ref, outputs_of(llm, prompts, params))
        _release(llm)

    if graphs:
        llm = make_llm(enforce_eager=True, **NO_PREFIX_CACHE)
        r["eager"] = count_identical(ref, outputs_of(llm, prompts, params))
        _release(llm)

    llm = make_llm(enable_prefix_caching=True)
    cold = outputs_of(llm, prompts, params)
    warm = outputs_of(llm, prompts, params)  # the second pass hits the blocks the first one left
    r["prefix"] = count_identical(cold, warm)
    r["prefix_hit_rate"] = llm.get_stats().get("prefix_cache_hit_rate")
    _release(llm)

    llm = make_llm(async_scheduling=False, **NO_PREFIX_CACHE)
    r["sync"] = count_identical(ref, outputs_of(llm, prompts, params))
    _release(llm)
    return r


def seeded_sampling_identical(make_llm: Callable[..., Any], prompts: Sequence = DEFAULT_PROMPTS,
                              max_tokens: int = 64, temperature: float = 0.8, seed: int = 0) -> int:
    """Prompts whose seeded temperature-sampled completion is the same alone as in one batch
    (each request has its own seed, ``seed + i``)."""
    params = [SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, seed=seed + i,
                             logprobs=1) for i in range(len(prompts))]
    llm = make_llm(**NO_PREFIX_CACHE)
    batched = outputs_of(llm, prompts, params)
    alone = [outputs_of(llm, [p], [sp])[0] for p, sp in zip(prompts, params)]
    _release(llm)
    return count_identical(batched, alone)


def batch_invariance_of_logits(llm, prompt: list[int], others: list[list[int]], max_tokens: int = 8,
                               logprobs: int = 5) -> bool:
    """``prompt`` generated alone and as the first of ``1 + len(others)`` prompts in one batch:
    True when its token ids and logprobs are bitwise equal."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)
    alone = outputs_of(llm, [prompt], params)
    batched = outputs_of(llm, [prompt, *others], params)[:1]
    return count_identical(alone, batched) == 1


def vllm_batch_invariant_cost(run_peer: Callable[..., dict], model: str, workloads: dict[str, dict],
                              decode: dict, out_dir: str, engine_args: dict | None = None,
                              log: Callable[[str], None] = print, **run_kw: Any) -> dict[str, float]:
    """vLLM's own price for batch invariance, for the table beside pageserve's: one vLLM process
    with ``VLLM_BATCH_INVARIANT=0`` and one with ``=1`` (vLLM reads it at import), the same
    ``workloads`` (W1) and ``decode`` timings in each. ``run_peer`` is ``lab.peers.run_peer``
    (a stand-in in the tests). Returns ``vllm_{default,det}_w1_total_tok_s``,
    ``vllm_{default,det}_batch{B}_ms_per_step`` and the ratios ``vllm_det_w1_ratio`` (det /
    default throughput) and ``vllm_det_batch{B}_ratio`` (det / default step time) for what both
    processes measured; a process that fails is logged and leaves its figures out."""
    figures: dict[str, float] = {}
    for mode, flag in (("default", "0"), ("det", "1")):
        try:
            rec = run_peer("vllm", model, workloads, out=f"{out_dir}/vllm_{mode}.json", decode=decode,
                           engine_args={**(engine_args or {}), "enable_prefix_caching": False},
                           env={"VLLM_BATCH_INVARIANT": flag}, **run_kw)
        except Exception as e:  # noqa: BLE001 - vLLM missing, or its invariant mode refusing this GPU
            text = str(e)
            causes = [line for line in text.splitlines() if "Error" in line and "Traceback" not in line]
            log(f"vLLM with VLLM_BATCH_INVARIANT={flag}: {text[-1500:]}\nerror lines: {causes[-8:]}")
            continue
        for b, d in rec.get("decode", {}).items():
            figures[f"vllm_{mode}_batch{b}_ms_per_step"] = d["decode_ms"]
        if "w1" in rec.get("offline", {}):
            figures[f"vllm_{mode}_w1_total_tok_s"] = rec["offline"]["w1"]["total_tok_s"]
        if rec.get("errors"):
            log(f"vLLM with VLLM_BATCH_INVARIANT={flag}, errors: {rec['errors']}")
    if "vllm_det_w1_total_tok_s" in figures and "vllm_default_w1_total_tok_s" in figures:
        figures["vllm_det_w1_ratio"] = figures["vllm_det_w1_total_tok_s"] / figures["vllm_default_w1_total_tok_s"]
    for b in decode.get("batches", []):
        det, base = figures.get(f"vllm_det_batch{b}_ms_per_step"), figures.get(f"vllm_default_batch{b}_ms_per_step")
        if det and base:
            figures[f"vllm_det_batch{b}_ratio"] = det / base
    return figures
