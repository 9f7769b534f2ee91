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


# ---------------------------------------------------------------------------- `pageserve bench`
def random_prompts(num: int, input_len: int, seed: int = 0, low: int = 1000, high: int = 20000) -> list[list[int]]:
    """``num`` prompts of ``input_len`` token ids drawn from [low, high): inside any current vocabulary, so one
    set of prompts serves every server (token-id prompts skip the tokenizer, as vLLM's random dataset)."""
    rng = random.Random(seed)
    return [[rng.randrange(low, high) for _ in range(input_len)] for _ in range(num)]


def add_bench_parser(subparsers) -> None:
    """``pageserve bench``: load a running OpenAI-compatible server (pageserve's, vLLM's, any that takes token-id
    prompts and ``ignore_eos``) and print vLLM ``bench serve``'s latency and throughput figures."""
    p = subparsers.add_parser("bench", help="load test a running OpenAI-compatible server", description=(
        "Send streamed completions (random token-id prompts, eos ignored) to a running OpenAI-compatible server "
        "(pageserve, vLLM, ...) and print throughput and the TTFT / TPOT / ITL / E2E percentiles, as vLLM's "
        "'bench serve' defines them."))
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the server's /v1 URL (default %(default)s)")
    p.add_argument("--model", default=None, help="the model name to send (default: the server's first)")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer <key>'")
    p.add_argument("--num-prompts", type=int, default=100, help="requests to send (default %(default)s)")
    p.add_argument("--input-len", type=int, default=256, help="prompt tokens each (default %(default)s)")
    p.add_argument("--output-len", type=int, default=128, help="generated tokens each, eos ignored (default %(default)s)")
    p.add_argument("--rate", type=float, default=math.inf,
                   help="requests/s, Poisson arrivals (default inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (default: no cap)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="PATH", help="also write the figures to PATH as JSON")
    p.set_defaults(func=run_bench)


def run_bench(args) -> int:
    import httpx

    from pageserve.cli import UsageError

    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be 1 or more")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        models = httpx.get(args.base_url.rstrip("/") + "/models", headers=headers, timeout=30)
    except httpx.HTTPError as e:
        raise UsageError(f"no server at {args.base_url}: {type(e).__name__}: {e}") from None
    if models.status_code != 200:
        raise UsageError(f"{args.base_url}/models answered HTTP {models.status_code}: {models.text[:200]}")
    model = args.model or models.json()["data"][0]["id"]
    prompts = random_prompts(args.num_prompts, args.input_len, args.seed)
    result = run_load_sync(args.base_url, prompts, args.output_len, model=model, rate=args.rate,
                           max_concurrency=args.max_concurrency, api_key=args.api_key, seed=args.seed)
    s = result.summary()
    s.update(model=model, base_url=args.base_url, num_prompts=args.num_prompts, input_len=args.input_len,
             output_len=args.output_len, rate=args.rate, max_concurrency=args.max_concurrency,
             request_throughput=s["completed"] / s["duration_s"] if s["duration_s"] else 0.0)
    print(f"{model} at {args.base_url}: {s['completed']} of {args.num_prompts} requests completed "
          f"({s['errors']} errors) in {s['duration_s']:.2f} s")
    print(f"  request throughput  {s['request_throughput']:.2f} req/s, output {s['output_tok_s']:.1f} tok/s")
    for m, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "E2E")):
        p50, p99 = s[f"{m}_p50_ms"], s[f"{m}_p99_ms"]
        if p50 is not None:
            print(f"  {label:<5} p50 {p50:9.2f} ms   p99 {p99:9.2f} ms")
    errors = [r.error for r in result.results if not r.ok]
    if errors:
        print(f"  first error: {errors[0]}")
    if args.json:
        from pathlib import Path

        Path(args.json).write_text(json.dumps({k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                                               for k, v in s.items()}, indent=2) + "\n")
    return 0 if not errors else 1
