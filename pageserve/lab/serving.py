"""Serving benchmarks: a request-rate sweep against any OpenAI-compatible ``/v1`` URL.

The load comes from ``serve.bench_client.run_load`` (streamed ``/v1/completions`` with
token-id prompts, Poisson arrivals: gaps ``random.Random(seed).expovariate(rate)``). The
metrics follow vLLM's ``bench serve`` (``vllm/benchmarks/serve.py``) definitions:

* TTFT: request sent -> first chunk carrying a token; TPOT: ``(e2e - ttft) / (output_tokens - 1)``
  per request with more than one output token; ITL: every gap between successive token chunks,
  pooled over requests; E2E: request sent -> end of stream. Each as mean, median (p50),
  p90 and p99, in milliseconds, over the completed requests.
* request throughput = completed requests / benchmark duration; output token throughput =
  output tokens / duration; total token throughput = (prompt + output tokens) / duration,
  the duration running from the first request sent to the last response finished.

Servers: ``pageserve serve`` through ``serve.background.start_server_process``, and
``vllm serve`` through ``start_vllm_server`` (``python -m vllm.entrypoints.openai.api_server
--model <dir> --load-format dummy --skip-tokenizer-init``). Where ``vllm serve`` cannot start,
``vllm_engine_level_sweep`` drives vLLM's ``AsyncLLM`` in-process with the same arrival
schedule: no HTTP, no JSON, so its figures are labelled engine-level and are a lower bound
of what the server would show.
"""
from __future__ import annotations

import asyncio
import math
import os
import random
import sys
import time
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from ..serve.bench_client import LoadResult, RequestResult, run_load_sync
from .workloads import random_len_workload

METRICS = ("ttft", "tpot", "itl", "e2e")


def _values(load: LoadResult, metric: str) -> list[float]:
    ok = [r for r in load.results if r.ok]
    if metric == "itl":
        return [x for r in ok for x in r.itl_s]
    return [v for r in ok if (v := getattr(r, f"{metric}_s")) is not None]


def serving_metrics(load: LoadResult, percentiles: Iterable[int] = (50, 90, 99)) -> dict[str, float | None]:
    """vLLM ``bench serve``'s figures for one run (see the module docstring); ms for latencies."""
    ok = [r for r in load.results if r.ok]
    out_tok = sum(r.output_tokens for r in ok)
    in_tok = sum(r.prompt_tokens for r in ok)
    dur = load.duration_s
    out: dict[str, float | None] = {
        "completed": len(ok), "errors": load.errors, "duration_s": dur,
        "prompt_tokens": in_tok, "output_tokens": out_tok,
        "request_throughput": len(ok) / dur if dur > 0 else None,
        "output_throughput": out_tok / dur if dur > 0 else None,
        "total_token_throughput": (in_tok + out_tok) / dur if dur > 0 else None,
    }
    for m in METRICS:
        xs = np.asarray(_values(load, m), dtype=np.float64) * 1e3
        out[f"{m}_mean_ms"] = float(xs.mean()) if xs.size else None
        out[f"{m}_median_ms"] = float(np.median(xs)) if xs.size else None
        for q in percentiles:
            out[f"{m}_p{q}_ms"] = float(np.percentile(xs, q)) if xs.size else None
    return out


def poisson_offsets(n: int, rate: float, seed: int = 0) -> list[float]:
    """Send times (s after the first) of ``n`` Poisson arrivals: the schedule ``run_load`` uses."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        out.append(t)
        if math.isfinite(rate) and i + 1 < n:
            t += rng.expovariate(rate)
    return out


def rate_prompts(rate: float, duration_s: float, prompt_len: int, vocab_size: int, seed: int = 0,
                 low: int = 100) -> list[list[int]]:
    """``round(rate * duration_s)`` (at least 1) random token-id prompts of ``prompt_len``."""
    n = max(1, int(round(rate * duration_s)))
    return random_len_workload(n, prompt_len, 1, vocab_size, seed=seed, low=low).prompts


def rate_sweep(base_url: str, rates: Sequence[float], duration_s: float, prompt_len: int, output_len: int,
               vocab_size: int, model: str | None = None, api_key: str | None = None, seed: int = 0,
               warmup_requests: int = 2, extra_body: dict | None = None,
               log: Callable[[str], None] | None = print) -> dict[float, dict[str, Any]]:
    """One Poisson run per rate (after ``warmup_requests`` unmeasured ones) against ``base_url``
    (ending in ``/v1``); returns ``{rate: serving_metrics}``."""
    kw = dict(model=model, api_key=api_key, extra_body=extra_body)
    if warmup_requests:
        run_load_sync(base_url, rate_prompts(warmup_requests, 1, prompt_len, vocab_size, seed + 999),
                      max_tokens=output_len, seed=seed, **kw)
    out = {}
    for i, rate in enumerate(rates):
        load = run_load_sync(base_url, rate_prompts(rate, duration_s, prompt_len, vocab_size, seed + i),
                             max_tokens=output_len, rate=rate, seed=seed, **kw)
        out[rate] = serving_metrics(load)
        if log:
            m = out[rate]
            log(f"{rate:g} req/s: {m['completed']} completed, {m['errors']} errors; TTFT p50 {m['ttft_p50_ms']} "
                f"p99 {m['ttft_p99_ms']} ms; TPOT p50 {m['tpot_p50_ms']} p99 {m['tpot_p99_ms']} ms")
            errs = [r.error for r in load.results if not r.ok]
            if errs:
                log(f"   first error: {errs[0]}")
    return out


def sweep_figures(engine: str, sweep: dict[float, dict[str, Any]],
                  keys: Sequence[str] = ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms")) -> dict[str, Any]:
    """``serve.<engine>.<rate>.<key>`` figures of a sweep."""
    return {f"serve.{engine}.{float(rate):g}.{k}": m.get(k) for rate, m in sweep.items() for k in keys}


# --------------------------------------------------------------------------- vllm serve


def vllm_serve_command(model_dir: str, port: int, host: str = "127.0.0.1", dtype: str = "bfloat16",
                       served_model_name: str = "peer", extra_args: Sequence[str] = ()) -> list[str]:
    """The ``vllm serve`` command line for a dummy-weight model dir with no tokenizer. Request
    logging is off by default in vLLM 0.26, whose parser rejects the older ``--disable-log-requests``
    (the 08 run at 1642299e fell back to engine-level on it)."""
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--load-format", "dummy", "--skip-tokenizer-init", "--dtype", dtype, "--host", host, "--port", str(port),
            "--served-model-name", served_model_name, *extra_args]


def start_vllm_server(model_dir: str, dtype: str = "bfloat16", host: str = "127.0.0.1", port: int = 0,
                      startup_timeout_s: float = 600.0, log_path: str | None = None,
                      extra_args: Sequence[str] = ()):
    """Start ``vllm serve`` in a child process and wait for ``/health``; returns a
    ``serve.background.ServerProcess`` (``.base_url``, ``.stop()``). Raises ``VllmMissingError``
    without vllm, ``RuntimeError`` with the log's tail if it exits or stays unhealthy."""
    import subprocess
    import tempfile

    from ..serve.background import ServerProcess, _free_port, wait_until_healthy
    from .peers import require_vllm

    require_vllm()
    port = port or _free_port(host)
    if log_path is None:
        fd, log_path = tempfile.mkstemp(prefix="vllm-serve-", suffix=".log")
        os.close(fd)
    cmd = vllm_serve_command(model_dir, port, host, dtype, extra_args=extra_args)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    server = ServerProcess(f"http://{host}:{port}", port, proc, log_path)
    return wait_until_healthy(server, "vllm serve", startup_timeout_s, poll_s=1.0)


# vLLM's completions stream carries token ids only when asked (the server has no tokenizer,
# so its text is empty); pageserve ignores the unknown field and sends token_ids anyway.
VLLM_EXTRA_BODY = {"return_token_ids": True}


# --------------------------------------------------------------------------- engine-level fallback


async def _engine_level_run(engine, prompts: list[list[int]], output_len: int, rate: float, seed: int) -> LoadResult:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, detokenize=False,
                            output_kind=RequestOutputKind.DELTA)

    async def one(i: int, p: list[int]) -> RequestResult:
        res = RequestResult(prompt_tokens=len(p))
        t0 = last = time.perf_counter()
        try:
            async for out in engine.generate(TokensPrompt(prompt_token_ids=p), params, f"r{seed}-{i}-{time.monotonic_ns()}"):
                n = len(out.outputs[0].token_ids)
                if n:
                    now = time.perf_counter()
                    if res.ttft_s is None:
                        res.ttft_s = now - t0
                    else:
                        res.itl_s.append(now - last)
                    last = now
                    res.output_tokens += n
            res.e2e_s = time.perf_counter() - t0
            res.ok = True
        except Exception as e:  # noqa: BLE001
            res.error = f"{type(e).__name__}: {e}"
        return res

    start = time.perf_counter()
    tasks = []
    for i, (p, at) in enumerate(zip(prompts, poisson_offsets(len(prompts), rate, seed))):
        delay = start + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one(i, p)))
    results = await asyncio.gather(*tasks)
    return LoadResult(list(results), time.perf_counter() - start)


def vllm_engine_level_sweep(model: str, dtype: str = "bfloat16", rates: Sequence[float] = (4, 16, 32),
                            duration_s: float = 60.0, prompt_len: int = 512, output_len: int = 256, seed: int = 0,
                            warmup_requests: int = 4, engine_args: dict | None = None) -> dict[str, Any]:
    """vLLM's ``AsyncLLM`` (dummy weights, no tokenizer) under the same Poisson schedules and
    prompts as ``rate_sweep``; run it in its own process (``peers serve-engine``)."""
    from .peers import peer_versions, require_vllm, workload_vocab, write_model_dir

    require_vllm()
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    model_dir = write_model_dir(model, dtype=dtype)
    vocab = workload_vocab(model)
    args = AsyncEngineArgs(model=str(model_dir), load_format="dummy", skip_tokenizer_init=True, dtype=dtype,
                           seed=seed, **(engine_args or {}))

    async def main() -> dict[float, dict[str, Any]]:
        engine = AsyncLLM.from_engine_args(args)
        try:
            await _engine_level_run(engine, rate_prompts(warmup_requests, 1, prompt_len, vocab, seed + 999),
                                    output_len, math.inf, seed)
            return {rate: serving_metrics(await _engine_level_run(
                engine, rate_prompts(rate, duration_s, prompt_len, vocab, seed + i), output_len, rate, seed))
                for i, rate in enumerate(rates)}
        finally:
            engine.shutdown()

    sweep = asyncio.run(main())
    return {"engine": "vllm", "level": "engine (AsyncLLM, no HTTP)", "model": model, "dtype": dtype,
            "versions": peer_versions(), "sweep": {str(k): v for k, v in sweep.items()}}


def vllm_serving_sweep(model: str, dtype: str, rates: Sequence[float], duration_s: float, prompt_len: int,
                       output_len: int, seed: int = 0, warmup_requests: int = 2, extra_args: Sequence[str] = (),
                       engine_args: dict | None = None, out_dir: str | None = None,
                       log: Callable[[str], None] | None = print) -> tuple[dict[float, dict[str, Any]], str]:
    """``vllm serve`` on ``model``'s shape under ``rate_sweep``; if the server cannot start,
    ``AsyncLLM`` engine-level in its own process (``peers serve-engine``). Returns the sweep
    and its level: ``"http"`` or ``"engine"``."""
    import json
    import subprocess
    import tempfile
    from pathlib import Path

    from .peers import require_vllm, workload_vocab, write_model_dir

    require_vllm()
    dtype = "bfloat16" if dtype == "auto" else dtype
    out_dir = out_dir or tempfile.mkdtemp(prefix="vllm-serving-")
    try:
        model_dir = write_model_dir(model, Path(out_dir) / "model", dtype)
        with start_vllm_server(str(model_dir), dtype, extra_args=extra_args,
                               log_path=str(Path(out_dir) / "vllm_serve.log")) as srv:
            sweep = rate_sweep(srv.base_url, rates, duration_s, prompt_len, output_len, workload_vocab(model),
                               model="peer", seed=seed, warmup_requests=warmup_requests, extra_body=VLLM_EXTRA_BODY,
                               log=log)
        return sweep, "http"
    except Exception as e:  # noqa: BLE001 - fall back to the engine alone, labelled as such
        if log:
            log(f"vllm serve failed ({type(e).__name__}: {str(e)[-500:]}); measuring AsyncLLM engine-level instead")
    spec = dict(rates=list(rates), duration_s=duration_s, prompt_len=prompt_len, output_len=output_len, seed=seed,
                warmup_requests=warmup_requests, engine_args=engine_args or {})
    out = Path(out_dir) / "vllm_engine_level.json"
    p = subprocess.run([sys.executable, "-m", "pageserve.lab.peers", "serve-engine", "--model", model, "--dtype", dtype,
                        "--spec", json.dumps(spec), "--out", str(out)], capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"vLLM engine-level sweep failed (exit {p.returncode}):\n{(p.stdout + p.stderr)[-3000:]}")
    rec = json.loads(out.read_text())
    return {float(k): v for k, v in rec["sweep"].items()}, "engine"
