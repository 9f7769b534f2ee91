"""How the bench times kernels: GPU time of calls captured back to back in a CUDA graph
(``graph_ms``), with an eager fallback (``timed_ms``) and weights rotated out of L2
(``weight_copies``). Only the ceilings are timed eagerly (``eager_ms``)."""
from __future__ import annotations

import math
import time

import torch
import triton


def eager_ms(fn, warmup=25, rep=100) -> float:
    """Eager: median ms of ``fn()`` launched from Python (do_bench flushes L2 before each call).
    Right for the ceilings (large ops); for a small kernel it measures Triton's launch path."""
    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


class CaptureFailed(RuntimeError):
    """The calls could not be captured in a CUDA graph."""


def graph_ms(fn, calls: int = 20, replays: int = 20) -> float:
    """Median ms per call of ``fn(i)`` for i in range(calls), captured back to back in one CUDA
    graph and replayed ``replays`` times, each replay timed with CUDA events. This is GPU time
    as the engine's graphed decode step sees it: no Python launch cost, but each kernel's ramp
    and tail and the gaps between dependent kernels. ``fn(0)`` runs once first, outside the
    graph (compiles, allocates); its errors propagate as they are, a failed capture raises
    ``CaptureFailed``. ``fn(i)`` may rotate inputs (``weight_copies``) so that back-to-back
    calls read from HBM, not from L2. Without CUDA (a smoke run on the interpreter): one eager
    pass, wall clock."""
    fn(0)
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        for i in range(calls):
            fn(i)
        return (time.perf_counter() - t0) * 1e3 / calls
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for i in range(calls):
                fn(i)
    except Exception as e:
        raise CaptureFailed(f"{type(e).__name__}: {e}") from e
    for _ in range(2):  # the first replays upload the graph
        graph.replay()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    per_replay = sorted(start.elapsed_time(end) for start, end in events)
    del graph
    return per_replay[len(per_replay) // 2] / calls


def timed_ms(r: dict, name: str, fn, calls: int = 20) -> float:
    """``graph_ms``, or, if the capture fails, the eager ``_ms`` of ``fn(0)``, recorded in ``r``
    as ``<name>_timing: "eager"`` (with the capture error) so the figure is not read as GPU time."""
    try:
        return graph_ms(fn, calls)
    except CaptureFailed as e:
        r[f"{name}_timing"] = "eager"
        r[f"{name}_capture_error"] = str(e)[:300]
        return eager_ms(lambda: fn(0))


def graph_us(fn, calls: int) -> float:
    return graph_ms(fn, calls) * 1e3


def weight_copies(N: int, K: int, dtype, gen, min_bytes: float) -> list[torch.Tensor]:
    """Enough copies of an [N, K] weight to add up to ``min_bytes`` (2 to 16 of them), so that
    back-to-back calls in a graph read from HBM, not from the 50 MB L2."""
    es = torch.tensor([], dtype=dtype).element_size()
    n = max(2, min(16, math.ceil(min_bytes / (N * K * es))))
    return [torch.randn(N, K, device=gen.device, dtype=dtype, generator=gen) * K**-0.5 for _ in range(n)]


def gbps(nbytes: int, ms: float) -> float:
    return nbytes / ms / 1e6
