"""The Hugging Face peers, timed exactly like pageserve (see ``bench``).

Two ways transformers serves a batch of requests, on the same weights as the pageserve
engine (build the model with ``hf_reference``):

* ``hf_generate_serial``: ``model.generate()`` one request at a time, the naive baseline.
* ``hf_generate_batch``: transformers' own continuous batching (a paged KV cache and a
  scheduler running in a background thread), the same machinery ``model.generate_batch``
  wraps. Its warm-up (CUDA-graph capture, cache allocation) happens before the clock
  starts, as pageserve's does when ``LLM`` is constructed.

Both are greedy and ignore EOS, so every request emits exactly its ``max_tokens`` tokens.
The HF peers are slow at the 3B shape, so notebooks time them on the first K requests of
the same workload (``Workload.head(K)``) and report K beside the figure.
"""
from __future__ import annotations

import inspect
import time
from typing import Any

import torch

from .bench import BenchResult, Clock, Workload, latencies_from_timestamps, make_result, synchronize


def _device(model) -> torch.device:
    return next(model.parameters()).device


def _no_eos_config(model, max_new_tokens: int, eos_token_id):
    """A greedy GenerationConfig that never stops early.

    ``generate()`` wants ``eos_token_id=[]`` (an unset value would fall back to the model's
    EOS); continuous batching wants ``-1``.
    """
    from transformers import GenerationConfig

    pad = getattr(model.config, "pad_token_id", None)
    if pad is None:
        pad = 0
    return GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos_token_id, pad_token_id=pad
    )


@torch.inference_mode()
def hf_generate_serial(
    model, workload: Workload, clock: Clock = time.perf_counter, name: str | None = None
) -> BenchResult:
    """``model.generate()`` on one request at a time (batch size 1, HF's dynamic KV cache)."""
    device = _device(model)
    rows, output_tokens = [], 0
    synchronize(device)
    t0 = clock()
    for r in workload.requests:
        ids = torch.tensor([r.prompt_token_ids], device=device)
        t_req = clock()
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), generation_config=_no_eos_config(model, r.max_tokens, [])
        )
        synchronize(device)
        n = out.shape[1] - ids.shape[1]
        output_tokens += n
        rows.append({"tag": r.tag, "ttft_s": None, "itl_s": [], "e2e_s": clock() - t_req, "token_ids": out[0, ids.shape[1]:].tolist()})
    synchronize(device)
    wall = clock() - t0
    return make_result(name or f"hf_generate/{workload.name}", workload.prompt_tokens, output_tokens, wall, rows)


def set_cb_attention(model, attn_implementation: str = "sdpa") -> str:
    """Put the model on an attention implementation continuous batching accepts.

    Recent transformers take ``"sdpa"`` (and flash) directly and drop the old ``"paged|"``
    prefix; older ones want ``"paged|sdpa"``. Try the given name, then the other spelling.
    """
    names = [attn_implementation]
    alt = attn_implementation.removeprefix("paged|") if attn_implementation.startswith("paged|") else f"paged|{attn_implementation}"
    names.append(alt)
    last: Exception | None = None
    for n in names:
        try:
            model.set_attn_implementation(n)
            return model.config._attn_implementation
        except (ValueError, KeyError, AttributeError) as e:
            last = e
    raise RuntimeError(f"cannot set attention implementation {names}: {last}")


def _accepted(fn, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Keep only the keywords ``fn`` takes: the CB API moved between transformers releases."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def _cb_config(**kwargs):
    try:
        from transformers import ContinuousBatchingConfig
    except ImportError:
        try:
            from transformers.generation.configuration_utils import ContinuousBatchingConfig
        except ImportError:
            return None
    names = set(inspect.signature(ContinuousBatchingConfig).parameters)
    return ContinuousBatchingConfig(**{k: v for k, v in kwargs.items() if k in names and v is not None})


def _cpu_cache_size(workload: Workload, page_size: int = 64) -> dict[str, int]:
    """A paged cache that holds the whole workload at once, and a step budget to match."""
    pages = sum(-(-(len(r.prompt_token_ids) + r.max_tokens) // page_size) for r in workload.requests)
    longest = max(len(p) for p in workload.prompts)
    return {"page_size": page_size, "num_blocks": pages + 1, "max_batch_tokens": max(256, min(2048, longest + len(workload)))}


def _workload_hints(workload: Workload):
    try:
        from transformers.generation.continuous_batching.utils import WorkloadHints
    except ImportError:
        return None
    return WorkloadHints(
        max_prompt_length=max(len(p) for p in workload.prompts),
        max_generated_length=max(r.max_tokens for r in workload.requests),
        num_requests=len(workload),
    )


# No inference_mode here: the CB loop updates, from its own thread, tensors made in this one.
@torch.no_grad()
def hf_generate_batch(
    model,
    workload: Workload,
    attn_implementation: str = "sdpa",
    clock: Clock = time.perf_counter,
    name: str | None = None,
    record_timestamps: bool = True,
    **cb_options: Any,
) -> BenchResult:
    """transformers' continuous batching over the whole workload, warm-up excluded.

    ``cb_options`` go to ``ContinuousBatchingConfig`` when this transformers has it
    (e.g. ``page_size``, ``max_batch_tokens``, ``num_blocks``, ``auto_switch_to_flash``).
    TTFT and inter-token latencies come from HF's per-token timestamps.
    """
    if len(workload) == 0:
        return make_result(name or f"hf_generate_batch/{workload.name}", 0, 0, 0.0, [])
    attn = set_cb_attention(model, attn_implementation)
    device = _device(model)
    if device.type == "cpu":
        # HF sizes its cache from device memory: slow on the CPU (tens of seconds). Fit it to the workload.
        for k, v in _cpu_cache_size(workload).items():
            cb_options.setdefault(k, v)
    max_new = {r.max_tokens for r in workload.requests}
    gen_cfg = _no_eos_config(model, max(max_new), -1)  # -1: no EOS, every request runs to max_new_tokens
    cb_cfg = _cb_config(**cb_options)
    cm = model.continuous_batching_context_manager
    cm_kwargs = _accepted(
        cm,
        dict(
            generation_config=gen_cfg,
            continuous_batching_config=cb_cfg,
            workload_hints=_workload_hints(workload),
            warmup=True,
            block=True,
            timeout=5,
        ),
    )
    results: dict[str, Any] = {}
    with cm(**cm_kwargs) as manager:
        add_kwargs = _accepted(manager.add_request, dict(record_timestamps=record_timestamps))
        synchronize(device)
        t0 = clock()
        ids = [
            manager.add_request(input_ids=r.prompt_token_ids, max_new_tokens=r.max_tokens, **add_kwargs)
            for r in workload.requests
        ]
        while len(results) < len(ids):
            res = manager.get_result(timeout=1)
            if res is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' continuous batching loop stopped before finishing")
                continue
            if res.is_finished():
                results[res.request_id] = res
        synchronize(device)
        wall = clock() - t0
    rows, output_tokens = [], 0
    for rid, r in zip(ids, workload.requests):
        res = results[rid]
        if getattr(res, "error", None):
            raise RuntimeError(f"HF request {rid} failed: {res.error}")
        output_tokens += len(res.generated_tokens)
        stamps = getattr(res, "timestamps", None) or []
        ttft, itl = latencies_from_timestamps(res.created_time, stamps) if stamps else (None, [])
        rows.append({"tag": r.tag, "ttft_s": ttft, "itl_s": itl, "token_ids": list(res.generated_tokens)})
    out = make_result(name or f"hf_generate_batch/{workload.name}", workload.prompt_tokens, output_tokens, wall, rows)
    out.info["attn_implementation"] = attn
    return out
