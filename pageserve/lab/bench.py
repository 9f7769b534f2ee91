"""Benchmarks: the workloads the phase notebooks measure, and one way to time them.

Throughput is always reported two ways over the same wall-clock window:

    total tok/s  = (prompt tokens + output tokens) / wall seconds
    output tok/s = output tokens / wall seconds

The device is synchronised before the clock starts and after the last request finishes,
so GPU work still queued when ``generate`` returns is never left out of the window.
Latencies come from each request's own timestamps: TTFT = first token - arrival, and the
inter-token latencies (ITL) are the gaps between a request's successive output tokens.

Workloads are lists of token ids drawn from a seeded generator, so two engines (pageserve
and the Hugging Face peers in ``hf_baselines``) see exactly the same requests.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch

Clock = Callable[[], float]


# --------------------------------------------------------------------------- workloads


@dataclass
class BenchRequest:
    """One request of a workload: a prompt of token ids and how many tokens to generate."""

    prompt_token_ids: list[int]
    max_tokens: int
    arrival_step: int = 0  # online mode: the engine step at which the request is added
    tag: str = ""  # a group name for the report ("long", "short", ...)


@dataclass
class Workload:
    name: str
    requests: list[BenchRequest]

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def prompts(self) -> list[list[int]]:
        return [r.prompt_token_ids for r in self.requests]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.requests)

    @property
    def requested_output_tokens(self) -> int:
        return sum(r.max_tokens for r in self.requests)

    def head(self, k: int | None) -> "Workload":
        """The first ``k`` requests (all of them when ``k`` is None): a slice for slow peers."""
        if k is None or k >= len(self.requests):
            return self
        return replace(self, name=f"{self.name}[:{k}]", requests=self.requests[:k])

    def tagged(self, tag: str) -> "Workload":
        return replace(self, name=f"{self.name}/{tag}", requests=[r for r in self.requests if r.tag == tag])


def _random_ids(gen: torch.Generator, n: int, vocab_size: int, low: int) -> list[int]:
    if n <= 0:
        return []
    return torch.randint(low, vocab_size, (n,), generator=gen).tolist()


def random_workload(
    num_requests: int,
    prompt_len: int,
    output_len: int,
    vocab_size: int,
    seed: int = 0,
    low: int = 0,
    name: str = "W1",
) -> Workload:
    """W1: ``num_requests`` prompts of ``prompt_len`` random token ids, ``output_len`` tokens each.

    Every request has the same shape, so throughput depends on the engine, not on luck of
    the draw; run with ``ignore_eos`` and greedy sampling so every request emits exactly
    ``output_len`` tokens. Ids are drawn uniformly from ``[low, vocab_size)``.
    """
    gen = torch.Generator().manual_seed(seed)
    reqs = [BenchRequest(_random_ids(gen, prompt_len, vocab_size, low), output_len) for _ in range(num_requests)]
    return Workload(name, reqs)


def shared_prefix_workload(
    num_requests: int,
    prefix_len: int,
    suffix_len: int,
    output_len: int,
    vocab_size: int,
    num_prefixes: int = 1,
    seed: int = 0,
    low: int = 0,
    name: str = "shared_prefix",
) -> Workload:
    """A shared system prompt: request ``i`` is ``prefix[i % num_prefixes] + own suffix``.

    With prefix caching on, only the first request per prefix computes the prefix's full
    blocks; the others reuse them. The best possible fraction of prompt tokens saved is
    about ``prefix_len / (prefix_len + suffix_len)`` (rounded down to whole blocks).
    """
    gen = torch.Generator().manual_seed(seed)
    prefixes = [_random_ids(gen, prefix_len, vocab_size, low) for _ in range(num_prefixes)]
    reqs = [
        BenchRequest(prefixes[i % num_prefixes] + _random_ids(gen, suffix_len, vocab_size, low), output_len, tag=f"prefix{i % num_prefixes}")
        for i in range(num_requests)
    ]
    return Workload(name, reqs)


def mixed_workload(
    num_short: int,
    short_prompt_len: int,
    short_output_len: int,
    num_long: int,
    long_prompt_len: int,
    long_output_len: int,
    vocab_size: int,
    long_first_step: int = 4,
    long_every_steps: int = 8,
    seed: int = 0,
    low: int = 0,
    name: str = "mixed",
) -> Workload:
    """Short requests decoding while long prompts arrive: the chunked-prefill workload.

    All short requests arrive at step 0 and decode ``short_output_len`` tokens; long
    request ``j`` arrives at step ``long_first_step + j * long_every_steps``. Without a
    token budget a long prompt's whole prefill lands in one step and every short request
    waits for it (an inter-token-latency spike); a small budget spreads the prefill over
    several steps, smoothing the shorts' ITL at the cost of the long request's TTFT.
    """
    gen = torch.Generator().manual_seed(seed)
    reqs = [
        BenchRequest(_random_ids(gen, short_prompt_len, vocab_size, low), short_output_len, 0, "short")
        for _ in range(num_short)
    ]
    reqs += [
        BenchRequest(
            _random_ids(gen, long_prompt_len, vocab_size, low),
            long_output_len,
            long_first_step + j * long_every_steps,
            "long",
        )
        for j in range(num_long)
    ]
    return Workload(name, reqs)


# --------------------------------------------------------------------------- results


def int_list(value) -> list[int]:
    """``"64,128, 256"``, ``"[64, 128]"`` or ``[64, 128]`` -> ``[64, 128]`` (papermill ``-p`` passes strings)."""
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(v) for v in str(value).strip("[]() ").replace(" ", "").split(",") if v]


def percentile(xs: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (linear interpolation); NaN for an empty list."""
    return float(np.percentile(np.asarray(xs, dtype=np.float64), q)) if len(xs) else float("nan")


@dataclass
class BenchResult:
    """What one timed run measured. Latencies are in seconds; ``summary`` converts to ms."""

    name: str
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    wall_s: float
    ttft_s: list[float] = field(default_factory=list)  # one per request
    itl_s: list[float] = field(default_factory=list)  # every gap between successive tokens
    per_request: list[dict[str, Any]] = field(default_factory=list)  # tag, ttft_s, itl_s, ...
    extra: dict[str, float] = field(default_factory=dict)  # engine stats and the like
    info: dict[str, Any] = field(default_factory=dict)  # non-numeric notes (kept out of summary)

    @property
    def total_tok_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.wall_s if self.wall_s > 0 else float("nan")

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else float("nan")

    def subset(self, tag: str) -> "BenchResult":
        """Latencies of the requests tagged ``tag`` (throughput fields are kept as measured)."""
        rows = [r for r in self.per_request if r.get("tag") == tag]
        return replace(
            self,
            name=f"{self.name}/{tag}",
            ttft_s=[r["ttft_s"] for r in rows if r.get("ttft_s") is not None],
            itl_s=[x for r in rows for x in r.get("itl_s", [])],
            per_request=rows,
        )

    def summary(self, percentiles: Iterable[int] = (50, 90, 99)) -> dict[str, float]:
        """Plain numbers: tok/s, wall time, and TTFT / ITL percentiles in milliseconds."""
        out = {
            "num_requests": self.num_requests,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "wall_s": self.wall_s,
            "total_tok_s": self.total_tok_s,
            "output_tok_s": self.output_tok_s,
        }
        for name, xs in (("ttft", self.ttft_s), ("itl", self.itl_s)):
            if xs:
                out[f"{name}_mean_ms"] = 1e3 * float(np.mean(xs))
                for q in percentiles:
                    out[f"{name}_p{q}_ms"] = 1e3 * percentile(xs, q)
        out.update(self.extra)
        return out


def latencies_from_timestamps(arrival: float, token_times: Sequence[float]) -> tuple[float | None, list[float]]:
    """TTFT and the inter-token gaps of one request from its arrival and per-token times."""
    if not token_times:
        return None, []
    ttft = token_times[0] - arrival
    itl = [b - a for a, b in zip(token_times[:-1], token_times[1:])]
    return ttft, itl


def make_result(
    name: str,
    prompt_tokens: int,
    output_tokens: int,
    wall_s: float,
    per_request: list[dict[str, Any]],
    extra: dict[str, float] | None = None,
) -> BenchResult:
    """Assemble a BenchResult from per-request rows ``{"tag", "ttft_s", "itl_s", ...}``."""
    return BenchResult(
        name=name,
        num_requests=len(per_request),
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        wall_s=wall_s,
        ttft_s=[r["ttft_s"] for r in per_request if r.get("ttft_s") is not None],
        itl_s=[x for r in per_request for x in r.get("itl_s", [])],
        per_request=per_request,
        extra=dict(extra or {}),
    )


def synchronize(device: str | torch.device | None = None) -> None:
    """Wait for queued device work, so a timing window covers all of it."""
    device = torch.device(device) if device is not None else None
    if device is None or device.type == "cuda":
        if torch.cuda.is_available():
            torch.cuda.synchronize(device)


def free_device_memory() -> None:
    """Return freed tensors' memory to the device, so the next engine can size its KV pool.

    Delete your references first (``del llm``); this collects the cycles and empties
    PyTorch's CUDA cache.
    """
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------- pageserve


def greedy_params(max_tokens: int):
    """The benchmark's sampling: greedy, exactly ``max_tokens`` tokens (EOS ignored)."""
    from ..engine.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _engine_device(llm) -> str | None:
    cfg = getattr(llm, "config", None) or getattr(getattr(llm, "engine", None), "config", None)
    return getattr(cfg, "device", None)


def _metric(metrics, *names, default=None):
    for n in names:
        v = metrics.get(n) if isinstance(metrics, dict) else getattr(metrics, n, None)
        if v is not None:
            return v
    return default


def request_row(out, tag: str = "") -> dict[str, Any]:
    """TTFT, inter-token gaps and cached tokens of one finished ``RequestOutput``."""
    m = getattr(out, "metrics", None)
    row: dict[str, Any] = {"tag": tag, "ttft_s": None, "itl_s": [], "num_cached_tokens": 0}
    if getattr(out, "outputs", None):
        row["token_ids"] = list(out.outputs[0].token_ids)
    if m is None:
        return row
    arrival = _metric(m, "arrival_time")
    first = _metric(m, "first_token_time")
    ttft = _metric(m, "ttft")
    if ttft is None and arrival is not None and first is not None:
        ttft = first - arrival
    itl = _metric(m, "inter_token_latencies", "itl", "itls", default=None)
    if itl is None:
        token_times = _metric(m, "token_times", "token_timestamps", default=None)
        if token_times:
            _, itl = latencies_from_timestamps(arrival or token_times[0], token_times)
    row["ttft_s"] = ttft
    row["itl_s"] = list(itl or [])
    row["num_cached_tokens"] = _metric(m, "num_cached_tokens", default=0) or 0
    row["arrival_time"], row["first_token_time"] = arrival, first
    row["finish_time"] = _metric(m, "finish_time")
    return row


# Gauges describe the engine now; everything else in get_stats() is a running counter.
_GAUGES = {"num_running", "num_waiting", "prefix_cache_hit_rate", "num_blocks", "num_free_blocks", "block_size", "max_model_len"}


def engine_stats(llm) -> dict[str, float]:
    """The engine's counters as plain numbers (``LLMEngine.get_stats()``)."""
    engine = getattr(llm, "engine", llm)
    get = getattr(engine, "get_stats", None)
    stats = get() if callable(get) else {}
    return {k: float(v) for k, v in stats.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def stats_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What one run added to the engine's counters, plus the derived figures.

    ``prefix_hit_rate``: prompt tokens found in the prefix cache / prompt tokens looked up.
    ``prefill_tokens_saved_frac``: 1 - prefill tokens computed / prompt tokens admitted
    (prefix hits save work; recomputation after a preemption costs it again).
    """
    d = {k: v - before.get(k, 0.0) for k, v in after.items() if k not in _GAUGES}
    queried, hit = d.get("prefix_cache_queried_tokens", 0.0), d.get("prefix_cache_hit_tokens", 0.0)
    d["prefix_hit_rate"] = hit / queried if queried else 0.0
    prompt, computed = d.get("prompt_tokens", 0.0), d.get("prefill_tokens_computed", 0.0)
    d["prefill_tokens_saved_frac"] = 1.0 - computed / prompt if prompt else 0.0
    return d


def prompt_vocab_size(llm) -> int:
    """Token ids a random prompt may use: the model's vocabulary, capped by the tokenizer's
    (padded embedding rows have no text, and the engine detokenizes every output).
    Takes an ``LLM``, an ``LLMEngine`` or a ``LoadedModel``."""
    engine = getattr(llm, "engine", llm)
    vocab = (getattr(engine, "model_config", None) or engine.config).vocab_size
    tok = getattr(engine, "tokenizer", None)
    hf = getattr(tok, "hf", tok)
    if hf is not None:
        try:
            vocab = min(vocab, len(hf))
        except TypeError:
            pass
    return vocab


def warmup(llm, vocab_size: int, prompt_len: int = 16, output_len: int = 4, num_requests: int = 2) -> None:
    """A short untimed run, so lazy compilation (Triton JIT, CUDA graphs) stays out of timings."""
    w = random_workload(num_requests, prompt_len, output_len, vocab_size, seed=12345)
    llm.generate(w.prompts, greedy_params(output_len), use_tqdm=False)


def prime(llm, prompts: list[list[int]]) -> None:
    """Serve each prompt once (one output token, untimed), leaving its blocks in the prefix cache."""
    llm.generate(prompts, greedy_params(1), use_tqdm=False)


def run_pageserve(llm, workload: Workload, clock: Clock = time.perf_counter, name: str | None = None) -> BenchResult:
    """Time ``llm.generate`` over the whole workload (all requests at once, offline).

    Prompt tokens are counted from the workload; output tokens from what came back.
    """
    device = _engine_device(llm)
    max_tokens = {r.max_tokens for r in workload.requests}
    if len(max_tokens) == 1:
        params = greedy_params(max_tokens.pop())
    else:
        params = [greedy_params(r.max_tokens) for r in workload.requests]
    before = engine_stats(llm)
    synchronize(device)
    t0 = clock()
    outputs = llm.generate(workload.prompts, params, use_tqdm=False)
    synchronize(device)
    wall = clock() - t0
    after = engine_stats(llm)
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    rows = [request_row(o, r.tag) for o, r in zip(outputs, workload.requests)]
    return make_result(name or f"pageserve/{workload.name}", workload.prompt_tokens, output_tokens, wall, rows, stats_delta(before, after))


def run_pageserve_online(llm, workload: Workload, clock: Clock = time.perf_counter, name: str | None = None) -> BenchResult:
    """Drive the engine step by step, adding each request at its ``arrival_step``.

    This is how a server sees the engine: requests arrive while others decode. Arrivals
    are counted in engine steps, not seconds, so the interleaving is the same on every
    machine; latencies are still wall-clock, measured by the engine's own request metrics.
    """
    engine = llm.engine
    device = _engine_device(llm)
    pending = sorted(range(len(workload)), key=lambda i: workload.requests[i].arrival_step)
    finished: dict[str, Any] = {}
    rid_to_idx: dict[str, int] = {}
    before = engine_stats(llm)
    synchronize(device)
    t0 = clock()
    step, nxt = 0, 0
    while nxt < len(pending) or len(finished) < len(rid_to_idx):
        while nxt < len(pending) and workload.requests[pending[nxt]].arrival_step <= step:
            i = pending[nxt]
            r = workload.requests[i]
            rid = f"bench-{i}"
            _add_request(engine, rid, r)
            rid_to_idx[rid] = i
            nxt += 1
        if not _has_unfinished(engine) and nxt < len(pending):
            # Nothing to run: jump straight to the next arrival.
            step = workload.requests[pending[nxt]].arrival_step
            continue
        for out in engine.step():
            if getattr(out, "finished", False) or _is_finished(out):
                finished[out.request_id] = out
        step += 1
    synchronize(device)
    wall = clock() - t0
    after = engine_stats(llm)
    rows, output_tokens = [], 0
    for rid, i in sorted(rid_to_idx.items(), key=lambda kv: kv[1]):
        out = finished[rid]
        output_tokens += len(out.outputs[0].token_ids)
        row = request_row(out, workload.requests[i].tag)
        row["arrival_step"] = workload.requests[i].arrival_step
        rows.append(row)
    return make_result(name or f"pageserve-online/{workload.name}", workload.prompt_tokens, output_tokens, wall, rows, stats_delta(before, after))


def _add_request(engine, request_id: str, r: BenchRequest) -> None:
    engine.add_request(request_id, r.prompt_token_ids, greedy_params(r.max_tokens))


def _has_unfinished(engine) -> bool:
    for attr in ("has_unfinished_requests", "has_unfinished"):
        f = getattr(engine, attr, None)
        if f is not None:
            return bool(f() if callable(f) else f)
    return True


def _is_finished(out) -> bool:
    return all(c.finish_reason is not None for c in out.outputs)
