"""A small async load generator for an OpenAI-compatible ``/v1/completions`` endpoint.

Requests stream with ``stream_options.include_usage``; arrivals are Poisson at ``rate``
requests/s (exponential gaps, seeded) or all at once (``rate=inf``), optionally capped at
``max_concurrency`` in flight. The latency definitions follow vLLM's ``bench serve``:

* TTFT: from sending the request to the first chunk that carries generated text or tokens;
* ITL: the gap between consecutive such chunks (one chunk may hold several tokens);
* TPOT: ``(e2e - ttft) / (output_tokens - 1)`` per request with more than one output token,
  ``output_tokens`` taken from the final usage chunk;
* E2E: from sending the request to the end of the stream.
"""
from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np


@dataclass
class RequestResult:
    ok: bool = False
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.output_tokens <= 1 or self.ttft_s is None or self.e2e_s is None:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass
class LoadResult:
    results: list[RequestResult]
    duration_s: float

    @property
    def completed(self) -> int:
        return sum(r.ok for r in self.results)

    @property
    def errors(self) -> int:
        return sum(not r.ok for r in self.results)

    def percentile_ms(self, metric: str, q: float) -> float | None:
        """``metric``: ttft, tpot, itl or e2e; ``q`` in [0, 100]."""
        if metric == "itl":
            values = [x for r in self.results if r.ok for x in r.itl_s]
        else:
            values = [v for r in self.results if r.ok and (v := getattr(r, f"{metric}_s")) is not None]
        return float(np.percentile(values, q) * 1e3) if values else None

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"completed": self.completed, "errors": self.errors, "duration_s": self.duration_s,
                               "output_tokens": sum(r.output_tokens for r in self.results if r.ok)}
        out["output_tok_s"] = out["output_tokens"] / self.duration_s if self.duration_s else 0.0
        for m in ("ttft", "tpot", "itl", "e2e"):
            for q in (50, 99):
                out[f"{m}_p{q}_ms"] = self.percentile_ms(m, q)
        return out


async def _one(client, url: str, body: dict, headers: dict) -> RequestResult:
    res = RequestResult()
    t0 = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                res.error = f"HTTP {resp.status_code}: {text[:200]}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = chunk["error"].get("message", "error event")
                    return res
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                    res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                if any(c.get("text") or c.get("token_ids") or (c.get("delta") or {}).get("content")
                       for c in chunk.get("choices", ())):
                    now = time.perf_counter()
                    if last is None:
                        res.ttft_s = now - t0
                    else:
                        res.itl_s.append(now - last)
                    last = now
        res.e2e_s = time.perf_counter() - t0
        res.ok = True
    except Exception as e:  # noqa: BLE001 - a failed request is a data point, not a crash
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run_load(
    base_url: str,
    prompts: Sequence[str | list[int]],
    max_tokens: int,
    model: str | None = None,
    rate: float = math.inf,
    max_concurrency: int | None = None,
    api_key: str | None = None,
    seed: int = 0,
    ignore_eos: bool = True,
    timeout_s: float = 600.0,
    extra_body: dict | None = None,
) -> LoadResult:
    """Send one streamed completion per prompt; returns every request's timings.

    ``base_url`` ends in ``/v1``. ``ignore_eos`` (a server extension) makes every request
    produce exactly ``max_tokens`` tokens, as benchmarks usually want. ``extra_body`` adds
    fields to every request (e.g. vLLM's ``return_token_ids`` for a server with no tokenizer)."""
    import httpx

    rng = random.Random(seed)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = base_url.rstrip("/") + "/completions"
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    limits = httpx.Limits(max_connections=max_concurrency or len(prompts) or 1, max_keepalive_connections=64)

    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:

        async def send(prompt) -> RequestResult:
            # greedy with every other sampling field neutral and set: a server's defaults from the model's
            # generation_config.json (vLLM's and pageserve's; e.g. a repetition penalty) must not apply
            body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "top_p": 1.0, "top_k": 0,
                    "min_p": 0.0, "repetition_penalty": 1.0, "stream": True,
                    "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos}
            if model:
                body["model"] = model
            if extra_body:
                body.update(extra_body)
            if sem is None:
                return await _one(client, url, body, headers)
            async with sem:
                return await _one(client, url, body, headers)

        t0 = time.perf_counter()
        tasks = []
        for i, prompt in enumerate(prompts):
            tasks.append(asyncio.ensure_future(send(prompt)))
            if math.isfinite(rate) and i + 1 < len(prompts):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return LoadResult(list(results), time.perf_counter() - t0)


def run_load_sync(*args: Any, **kwargs: Any) -> LoadResult:
    """``run_load`` from synchronous code, including a notebook whose loop is running."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(run_load(*args, **kwargs))
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, run_load(*args, **kwargs)).result()
