"""Micro-benchmarks of the server's per-step Python (CPU, no model): what one engine step
costs the host beyond the forward, and what the GIL does to a thread waiting on the device.

    python scripts/bench_serve_host.py [--streams 40] [--tokens 256]

1. ``_make_output`` for ``--streams`` streaming requests (no tokenizer: the GPU rate runs
   send token ids), averaged over a request's life (1..tokens output tokens);
2. the event loop's per-chunk work for one streamed completion: ``_completion_events`` +
   the SSE encoder, driven with precomputed outputs (what the loop does per token per request);
3. the always-on instrumentation: clock reads and ``StepStats.record``;
4. the GIL hand-back: a thread sleeps 2 ms (a stand-in for the device wait, GIL released)
   while another thread encodes chunks (pure Python, or with a write syscall per chunk as
   uvicorn's transport does); the overshoot past 2 ms is time spent getting the GIL back.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time
from types import SimpleNamespace

from pageserve.engine.llm_engine import LLMEngine, Request, StepTiming
from pageserve.engine.outputs import RequestMetrics, RequestOutput, CompletionOutput
from pageserve.engine.sampling_params import SamplingParams
from pageserve.engine.sequence import Sequence


def bench(fn, repeat: int = 5, number: int = 200) -> float:
    """Best of ``repeat`` mean seconds per call."""
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        for _ in range(number):
            fn()
        best = min(best, (time.perf_counter() - t) / number)
    return best


def make_requests(streams: int, num_out: int) -> list[Request]:
    params = SamplingParams(max_tokens=10**6, ignore_eos=True)
    reqs = []
    for i in range(streams):
        prompt = list(range(100, 612))
        seq = Sequence(f"r{i}", prompt, params, index=0, seed=None, arrival_time=0.0)
        seq.output_token_ids.extend(range(1000, 1000 + num_out))
        seq.token_times.extend(float(t) for t in range(num_out))
        seq.first_token_time = 0.0
        reqs.append(Request(f"r{i}", None, prompt, params, [seq], 0.0))
    return reqs


def bench_make_output(streams: int, tokens: int) -> float:
    """µs per step for ``streams`` requests, averaged over output lengths 1..tokens."""
    total = 0.0
    lengths = [max(1, tokens * k // 8) for k in range(1, 9)]
    for n in lengths:
        reqs = make_requests(streams, n)
        total += bench(lambda: [LLMEngine._make_output(None, r) for r in reqs], number=50)
    return 1e6 * total / len(lengths)


def bench_sse(tokens: int) -> float:
    """µs of event-loop work per streamed token of one completion request (no tokenizer)."""
    from pageserve.serve.api import _Server, _sse
    from pageserve.serve.logprobs import TokenTable

    server = _Server(SimpleNamespace(tokenizer=None), ["m"], None, TokenTable(None, 32000))
    server._finish = lambda outs: None
    ids = list(range(1000, 1000 + tokens))
    outs = [
        RequestOutput("r", None, [1, 2], [CompletionOutput(0, "", ids[:t], "length" if t == tokens else None)],
                      t == tokens, RequestMetrics(0.0))
        for t in range(1, tokens + 1)
    ]

    class FakeStream:
        def __init__(self):
            self.it = iter(outs)

        def __aiter__(self):
            return self

        async def __anext__(self):
            try:
                return next(self.it)
            except StopIteration:
                raise StopAsyncIteration from None

        def close(self):
            pass

    async def one() -> int:
        events = server._completion_events([FakeStream()], "cmpl-x", 0, "m", 1, None, False)
        n = 0
        async for chunk in _sse(events).body_iterator:
            n += len(chunk)
        return n

    loop = asyncio.new_event_loop()
    try:
        per_request = bench(lambda: loop.run_until_complete(one()), repeat=5, number=20)
    finally:
        loop.close()
    return 1e6 * per_request / tokens


def bench_instrumentation() -> dict:
    from pageserve.serve.step_stats import StepStats

    stats = StepStats()
    t = StepTiming(total_s=2.2e-3, total_cpu_s=1e-3, sched_s=5e-5, launch_s=3e-4, launch_cpu_s=2.5e-4,
                   wait_s=1.5e-3, wait_cpu_s=1.4e-3, post_s=2e-4, post_cpu_s=2e-4, kind="decode", num_seqs=40)
    return {
        "perf_counter_us": 1e6 * bench(time.perf_counter, number=20000),
        "thread_time_us": 1e6 * bench(time.thread_time, number=20000),
        "step_stats_record_us": 1e6 * bench(lambda: stats.record(t, 1e-5, 2e-5), number=20000),
        "summary_65k_ms": 1e3 * bench(lambda: stats.summary(), repeat=1, number=1),
    }


def bench_gil(switch_s: float, syscall_per_chunk: bool, wait_s: float = 2e-3, rounds: int = 200) -> float:
    """Median overshoot (ms) of a ``wait_s`` GIL-free wait while another thread encodes chunks."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(switch_s)
    stop = threading.Event()
    chunk = {"id": "cmpl-x", "object": "text_completion", "created": 0, "model": "m",
             "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": None, "stop_reason": None,
                          "token_ids": [1234]}]}
    fd = os.open(os.devnull, os.O_WRONLY)

    def loop_thread():
        while not stop.is_set():
            data = f"data: {json.dumps(chunk)}\n\n".encode()
            if syscall_per_chunk:
                os.write(fd, data)  # drops and retakes the GIL, as a socket send does

    th = threading.Thread(target=loop_thread, daemon=True)
    th.start()
    over = []
    try:
        for _ in range(rounds):
            t = time.perf_counter()
            time.sleep(wait_s)  # GIL released: the device wait
            over.append(time.perf_counter() - t - wait_s)
    finally:
        stop.set()
        th.join()
        os.close(fd)
        sys.setswitchinterval(old)
    over.sort()
    return 1e3 * over[len(over) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=40)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--skip-gil", action="store_true")
    args = ap.parse_args()
    res = {
        f"make_output_us_per_step_{args.streams}_streams": bench_make_output(args.streams, args.tokens),
        "sse_us_per_token": bench_sse(args.tokens),
        **bench_instrumentation(),
    }
    if not args.skip_gil:
        for sw in (5e-3, 1e-3, 5e-4):
            for sc in (False, True):
                res[f"gil_overshoot_ms.switch_{sw * 1e3:g}ms.{'syscall' if sc else 'pure'}"] = bench_gil(sw, sc)
        t = time.perf_counter()
        over = []
        for _ in range(200):
            t = time.perf_counter()
            time.sleep(2e-3)
            over.append(time.perf_counter() - t - 2e-3)
        res["gil_overshoot_ms.no_other_thread"] = 1e3 * sorted(over)[100]
    for k, v in res.items():
        print(f"{k:55s} {v if v is None else round(v, 3)}")


if __name__ == "__main__":
    main()
