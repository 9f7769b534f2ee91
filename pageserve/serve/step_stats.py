"""Where the engine thread's time goes, step by step: always on, no device syncs.

The engine thread calls ``StepStats.record`` once per loop turn with the engine's
``StepTiming`` (host / wait / postprocess split of ``step()``) and its own overhead (draining
commands, handing outputs to the event loop, the stats snapshot). Each record goes into
fixed-bucket histograms (exported by ``/metrics``) and a bounded window of raw records
(summarised with percentiles by ``/v1/engine_stats``).

Readers on the event loop copy the counters and the window in one C-level call each
(``list(...)``), which the GIL makes atomic; the engine thread never takes a lock here.

Off-CPU time (wall minus this thread's CPU time over a span) is the GIL's footprint: inside
the launch and the postprocess the thread makes no blocking call except the ones that drop
the GIL (CUDA calls, socket writes), so the time it spends off the CPU there is mostly
time spent waiting to get the GIL back from the event loop.
"""
from __future__ import annotations

import bisect
import collections
import sys
from typing import Any

from pageserve.engine.llm_engine import StepTiming

# seconds: 50 µs .. 1 s, about 1.5x apart (host phases are tens of µs, steps a few ms)
STEP_BUCKETS = (5e-5, 1e-4, 2e-4, 3e-4, 5e-4, 7.5e-4, 1e-3, 1.5e-3, 2e-3, 2.5e-3, 3e-3, 4e-3, 5e-3, 6e-3,
                8e-3, 1e-2, 1.5e-2, 2e-2, 3e-2, 5e-2, 0.1, 0.25, 0.5, 1.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)

# one record per loop turn that stepped; index names the tuple's fields
FIELDS = ("step", "kind", "total_s", "host_s", "sched_s", "launch_s", "launch_offcpu_s", "wait_s",
          "wait_offcpu_s", "post_s", "post_offcpu_s", "overhead_s", "deliver_s", "num_seqs")


class Buckets:
    """A fixed-bucket histogram: ``counts[i]`` observations ``<= bounds[i]``, the last slot +Inf."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def cumulative(self) -> tuple[list[tuple[str, int]], int, float]:
        """``([(le, cumulative count), ...], count, sum)`` in Prometheus' form."""
        counts, total = list(self.counts), self.sum
        out, acc = [], 0
        for le, c in zip(self.bounds, counts):
            acc += c
            out.append((repr(float(le)), acc))
        acc += counts[-1]
        out.append(("+Inf", acc))
        return out, acc, total


class StepStats:
    """Per-step timings of the engine thread (written by that thread only)."""

    def __init__(self, window: int = 65536) -> None:
        self.step_seconds = {"decode": Buckets(STEP_BUCKETS), "mixed": Buckets(STEP_BUCKETS)}
        self.host = Buckets(STEP_BUCKETS)
        self.launch_offcpu = Buckets(STEP_BUCKETS)
        self.wait = Buckets(STEP_BUCKETS)
        self.postprocess = Buckets(STEP_BUCKETS)
        self.overhead = Buckets(STEP_BUCKETS)
        self.batch = Buckets(BATCH_BUCKETS)
        self.idle_s = 0.0  # asleep on the condition variable: no work
        self.commands_s = 0.0  # adding (tokenizing) and aborting requests
        self.overhead_s = 0.0  # delivery + stats snapshot, per stepping turn
        self.num_records = 0
        self.records: collections.deque = collections.deque(maxlen=window)

    def record(self, t: StepTiming, deliver_s: float, overhead_s: float) -> None:
        if not t.kind:
            return
        self.num_records += 1
        host, launch_off = t.host_s, t.launch_s - t.launch_cpu_s
        self.step_seconds[t.kind].observe(t.total_s)
        self.host.observe(host)
        self.launch_offcpu.observe(launch_off)
        self.wait.observe(t.wait_s)
        self.postprocess.observe(t.post_s)
        self.overhead.observe(overhead_s)
        if t.num_seqs:
            self.batch.observe(t.num_seqs)
        self.overhead_s += overhead_s
        self.records.append((
            self.num_records, t.kind, t.total_s, host, t.sched_s, t.launch_s, launch_off, t.wait_s,
            t.wait_s - t.wait_cpu_s, t.post_s, t.post_s - t.post_cpu_s, overhead_s, deliver_s, t.num_seqs,
        ))

    def summary(self, since: int = 0) -> dict[str, Any]:
        """Percentiles (ms) of every field over the records numbered above ``since`` (the
        window keeps the last ``maxlen``), the mixed-step fraction, and the thread's totals."""
        rows = [r for r in list(self.records) if r[0] > since]
        out: dict[str, Any] = {
            "num_records": self.num_records, "since": since, "count": len(rows),
            "switch_interval_s": sys.getswitchinterval(),
            "idle_s": self.idle_s, "commands_s": self.commands_s, "overhead_s": self.overhead_s,
        }
        if not rows:
            return out
        mixed = sum(r[1] == "mixed" for r in rows)
        out["mixed_step_frac"] = mixed / len(rows)
        out["mean_num_seqs"] = sum(r[-1] for r in rows) / len(rows)
        kinds = {"all": rows, "decode": [r for r in rows if r[1] == "decode"], "mixed": [r for r in rows if r[1] == "mixed"]}
        for i, name in enumerate(FIELDS):
            if not name.endswith("_s"):
                continue
            for kind, sel in kinds.items():
                if not sel:
                    continue
                vals = sorted(r[i] for r in sel)
                key = name[:-2] if kind == "all" else f"{kind}.{name[:-2]}"
                out[f"{key}_ms_p50"] = 1e3 * _pct(vals, 0.50)
                out[f"{key}_ms_p99"] = 1e3 * _pct(vals, 0.99)
                out[f"{key}_ms_mean"] = 1e3 * sum(vals) / len(vals)
        return out


def _pct(sorted_vals: list[float], q: float) -> float:
    return sorted_vals[min(len(sorted_vals) - 1, int(q * len(sorted_vals)))]
