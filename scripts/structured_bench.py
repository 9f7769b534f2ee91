"""What sampling from host state costs: the same requests through one engine with no constraint, with a
JSON schema on 1 request in ``--every``, with it on all of them, and with a repetition penalty on all (as
Qwen2.5-Instruct's generation_config gives every server request); each mode run ``--rounds`` times in
alternation, in one process.

    python scripts/structured_bench.py --out DIR [--model smollm2-135m-instruct | qwen2.5-3b]
        [--tokenizer-from MODEL] [--device cuda] [--requests 256] [--max-tokens 128] [--rounds 2]

Every request yields exactly ``--max-tokens`` tokens whatever its mode, so the modes run the same
steps at the same batch sizes: the plain requests ignore eos, and the schema (an array of at least
``10 * max_tokens`` short strings) can neither end nor allow eos that soon. The difference is then
the masks (built on the host while the forward runs, applied on the device) and the lost overlap of
async scheduling's overlap, if any (a step holding a guided or penalised row lands the previous step
between its forward launch and its sampling); ``plain_sync`` (async scheduling off, no constraint) is
the engine with no overlap at all, which is what penalised and guided steps ran as before d324af6.

A random-weight shape (``qwen2.5-3b``) has no tokenizer: ``--tokenizer-from`` lends it one (default:
the default model's), whose ids all lie inside the shape's vocabulary.

Writes DIR/structured_bench.json (with the commit): per mode and round the output tok/s, steps and
seconds, and each mode's median ratio to plain; then the masks alone on the host (``mask_timing``: the
thread pool's fill against one matcher after another, integer and string items, 1 / 32 / 256 rows) and their
application on the device (``device_mask_timing``, CUDA only: the Triton kernel against the torch reference);
prints one line per run.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path

from pageserve.engine.llm import LLM
from pageserve.engine.sampling_params import SamplingParams
from pageserve.lab.profiling import sampler_op_profile
from pageserve.lab.results import provenance
from pageserve.model.loader import load_model

MODES = ("plain", "plain_sync", "penalised", "guided_some", "guided_all")


def endless_schema(max_tokens: int, items: str = "integer") -> dict:
    """A JSON array that cannot end within ``max_tokens`` tokens (each item takes at least two).

    ``items``: "integer" (the default since 525465c's run) or "string" (short strings: what that run used).
    Inside a string llguidance's mask costs ~0.08-0.1 ms a row against ~0.004 ms for integers (measured on
    the 2-core CPU box, SmolLM2's tokenizer padded to 151,936 ids), so "string" measures llguidance's mask
    cost and "integer" the engine's own."""
    item = {"type": "string", "maxLength": 8} if items == "string" else {"type": "integer"}
    return {"type": "array", "minItems": 10 * max_tokens, "items": item}


def requests(llm: LLM, n: int, max_tokens: int, every: int | None,
             items: str = "integer") -> tuple[list[str], list[SamplingParams]]:
    """``n`` chat prompts, and their params: every ``every``-th guided (None: none; 1: all; 0: none, all
    with a repetition penalty of 1.05)."""
    hf = llm.tokenizer.hf
    prompts = [hf.apply_chat_template([{"role": "user", "content": f"List {i % 50 + 3} fruits as JSON."}],
                                      tokenize=False, add_generation_prompt=True) for i in range(n)]
    plain = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                           repetition_penalty=1.05 if every == 0 else 1.0)
    guided = SamplingParams(temperature=0, max_tokens=max_tokens,
                            structured_outputs={"json": endless_schema(max_tokens, items)})
    params = [guided if every and i % every == 0 else plain for i in range(n)]
    return prompts, params


class _timed:
    """Adds the wall seconds of every call of ``obj.name`` to ``self.s`` (an instance attribute shadowing the
    method while inside the ``with``): host time, as nothing in the engine's sampling or masks syncs."""

    def __init__(self, obj, name: str) -> None:
        self.obj, self.name, self.s = obj, name, 0.0

    def __enter__(self) -> "_timed":
        real = getattr(self.obj, self.name)

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return real(*a, **k)
            finally:
                self.s += time.perf_counter() - t

        setattr(self.obj, self.name, timed)
        return self

    def __exit__(self, *exc) -> None:
        delattr(self.obj, self.name)


def run(llm: LLM, prompts, params) -> dict:
    """One mode's requests through ``llm.generate``: throughput, and where the host's time went (ms a step:
    the engine's own split of ``step()``, plus the calls timed inside its launch: the sampler's and the masks')."""
    engine = llm.engine
    stats0 = llm.get_stats()
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        sample = stack.enter_context(_timed(engine.runner.sampler, "sample"))
        forward = stack.enter_context(_timed(engine.runner, "run_step"))
        masks = stack.enter_context(_timed(engine.grammar, "step_masks")) if engine.grammar is not None else None
        outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    lengths = {len(c.token_ids) for o in outs for c in o.outputs}
    bad = [c.finish_reason for o in outs for c in o.outputs if c.finish_reason != "length"]
    stats = llm.get_stats()
    steps = stats["num_steps"] - stats0["num_steps"]
    per_step = {k: 1e3 * (stats[f"{k}_time_s"] - stats0[f"{k}_time_s"]) / max(steps, 1)
                for k in ("step", "host", "wait", "postprocess")}
    per_step.update({"forward_launch": 1e3 * forward.s / max(steps, 1), "sample_launch": 1e3 * sample.s / max(steps, 1),
                     "step_masks": 1e3 * (masks.s if masks is not None else 0.0) / max(steps, 1)})
    return {"seconds": seconds, "output_tokens": tokens, "output_tok_s": tokens / seconds, "steps": steps,
            "ms_per_step": 1e3 * seconds / max(steps, 1), "host_ms_per_step": per_step,
            "lengths": sorted(lengths), "not_length_capped": len(bad),
            "first_text": outs[0].outputs[0].text[:60]}


def mask_timing(llm: LLM, items: str, max_tokens: int, row_counts=(1, 32, 256), repeats: int = 20) -> dict:
    """The masks alone, on the host: ``GrammarCompiler.step_masks`` (llguidance's thread pool) and one
    matcher after another (``fill_next_token_bitmask`` in a loop), for ``row_counts`` matchers of the
    benchmark's schema each inside the array (after "[1,2,3," or '["ab","cd","'), ms per step (median
    of ``repeats``)."""
    import os

    import numpy as np

    from pageserve.engine.structured_output import GrammarCompiler, StructuredOutputsParams, _import_llguidance

    llg = _import_llguidance()
    engine = llm.engine
    compiler = engine.grammar or GrammarCompiler(engine.tokenizer.hf, engine.model_config.vocab_size,
                                                 sorted(engine.eos_token_ids))
    params = StructuredOutputsParams(json=endless_schema(max_tokens, items))
    # no spaces: the GPU host's transformers 5.17 gave the GGUF tokenizer a view in which llguidance took "Ġ"
    # for its UTF-8 bytes (structured_5ab430d's log)
    prefix = engine.tokenizer.hf.encode("[1,2,3," if items == "integer" else '["ab","cd","',
                                        add_special_tokens=False)
    out = {"cpu_count": os.cpu_count(), "items": items, "prefix_tokens": len(prefix), "ms_per_step": {}}
    for n in row_counts:
        matchers = [compiler.matcher(params) for _ in range(n)]
        for m in matchers:
            m.consume_tokens(prefix)
        if matchers[0].is_error():  # recorded, not raised: the runs above are already measured
            out["error"] = matchers[0].get_error()[:300]
            return out
        par, seq = [], []
        bits = np.zeros((n, (compiler.tokenizer.vocab_size + 31) // 32), dtype=np.int32)
        for _ in range(repeats):
            t0 = time.perf_counter()
            compiler.step_masks(matchers)
            par.append(1e3 * (time.perf_counter() - t0))
            t0 = time.perf_counter()
            for i, m in enumerate(matchers):
                llg.numpy.fill_next_token_bitmask(m, bits, i)
            seq.append(1e3 * (time.perf_counter() - t0))
        out["ms_per_step"][n] = {"step_masks": statistics.median(par), "one_after_another": statistics.median(seq)}
    return out


def device_mask_timing(llm: LLM, row_counts=(1, 32, 256), repeats: int = 50) -> dict:
    """The masks' application on the device, on CUDA: the Triton kernel (``kernels/token_bitmask``, what the
    sampler runs) against the torch reference (unpack, gather, fill, scatter: what it ran before), ms a call
    (median of ``repeats`` timed by CUDA events) on [n, V] fp32 logits with random words, equal outputs checked."""
    import torch

    from pageserve.kernels.reference import apply_token_bitmask as reference
    from pageserve.kernels.token_bitmask import apply_token_bitmask

    dev = llm.engine.runner.sampler.device
    if dev.type != "cuda":
        return {"skipped": f"device {dev}"}
    V = llm.engine.model_config.vocab_size
    out = {"vocab_size": V, "ms": {}}
    gen = torch.Generator(device=dev).manual_seed(0)
    for n in row_counts:
        logits = torch.randn(n, V, device=dev, generator=gen)
        bits = torch.randint(-2**31, 2**31 - 1, (n, (V + 31) // 32), device=dev, generator=gen,
                             dtype=torch.int64).to(torch.int32)
        rows = torch.arange(n, device=dev)
        a, b = apply_token_bitmask(logits.clone(), rows, bits, V), reference(logits.clone(), rows, bits, V)
        times = {}
        for name, fn in (("kernel", apply_token_bitmask), ("reference", reference)):
            # one buffer refilled before each timed call: ``repeats`` copies of 256 x 151,936 fp32 logits were 7.8 GB
            # a function, more than an H100 holds beside a 0.85 engine (session 47)
            x, ms = torch.empty_like(logits), []
            for _ in range(repeats):
                x.copy_(logits)
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                fn(x, rows, bits, V)
                e1.record()
                e1.synchronize()
                ms.append(e0.elapsed_time(e1))
            times[name] = statistics.median(ms)
        out["ms"][n] = {**times, "equal": bool(torch.equal(a, b))}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--tokenizer-from", default="smollm2-135m-instruct",
                    help="the tokenizer lent to a model that has none (random-weight shapes)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--every", type=int, default=8, help="guided_some: one request in this many is guided")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--num-blocks", type=int, default=None)
    ap.add_argument("--items", choices=("integer", "string"), default="integer",
                    help="the guided array's items (string: llguidance's costly in-string masks)")
    args = ap.parse_args()

    loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    if loaded.tokenizer is None:
        loaded.tokenizer = load_model(args.tokenizer_from, device="cpu", dtype="float32").tokenizer
    kw = {"num_blocks": args.num_blocks} if args.num_blocks else {}
    # every mode sends the same prompts: with the prefix cache (on by default since 882fea3) every run after the
    # first would skip its prefills, unlike the records before it
    llm = LLM(args.model, loaded=loaded, device=args.device, dtype=args.dtype, enable_prefix_caching=False, **kw)
    rows = []
    for rnd in range(args.rounds + 1):  # round 0 warms up (compiles, captures) and is not kept
        for mode in (MODES if rnd % 2 else MODES[::-1]):
            # the engine reads async_scheduling at every step: off for this mode's run only
            llm.engine.config.async_scheduling = mode != "plain_sync"
            every = {"guided_some": args.every, "guided_all": 1, "penalised": 0}.get(mode)
            row = {"mode": mode, "round": rnd,
                   **run(llm, *requests(llm, args.requests, args.max_tokens, every, args.items))}
            if rnd:
                rows.append(row)
            print(json.dumps(row), flush=True)
    median = {m: statistics.median(r["output_tok_s"] for r in rows if r["mode"] == m) for m in MODES}
    masks = {}
    for items in ("integer", "string"):
        try:
            masks[items] = mask_timing(llm, items, args.max_tokens)
        except Exception as e:  # the runs above stand; the record says why the masks alone are missing
            masks[items] = {"error": repr(e)[:300]}
    print(json.dumps(masks), flush=True)
    try:
        device_masks = device_mask_timing(llm)
    except Exception as e:
        device_masks = {"error": repr(e)[:300]}
    print(json.dumps(device_masks), flush=True)
    try:  # the penalised mode's sampler, op by op (async, as its timed runs)
        llm.engine.config.async_scheduling = True
        sampler_ops = sampler_op_profile(llm, *requests(llm, args.requests, min(args.max_tokens, 32), 0, args.items),
                                         calls=16, top=25)
    except Exception as e:
        sampler_ops = {"error": repr(e)[:300]}
    print(json.dumps(sampler_ops), flush=True)
    record = {**provenance(), "args": vars(args), "runs": rows, "mask_timing": masks, "device_mask_timing": device_masks,
              "penalised_sampler_ops": sampler_ops,
              "median_output_tok_s": median,
              "ratio_to_plain": {m: median[m] / median["plain"] for m in MODES}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "structured_bench.json").write_text(json.dumps(record, indent=1))
    print(json.dumps(record["ratio_to_plain"]))


if __name__ == "__main__":
    main()
