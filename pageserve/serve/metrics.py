"""Prometheus metrics of one server: engine gauges and counters read from the engine
thread's stats snapshot at scrape time, the engine thread's per-step timing histograms
(``step_stats.StepStats``), latency histograms observed by the handlers.

Each app owns its ``CollectorRegistry`` (no global registry), so tests can build several.
"""
from __future__ import annotations

import sys
import time
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from pageserve.engine.outputs import RequestMetrics

from .step_stats import Buckets, StepStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
                    10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class _EngineCollector:
    """Turns the latest ``LLMEngine.get_stats()`` snapshot into metric families."""

    def __init__(self, snapshot: Callable[[], dict], model_name: str, steps: StepStats | None = None) -> None:
        self.snapshot = snapshot
        self.model_name = model_name
        self.steps = steps

    def collect(self):
        s = self.snapshot()
        label = ["model_name"], [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=label[0])
            g.add_metric(label[1], value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=label[0])
            c.add_metric(label[1], value)
            return c

        used = s["num_blocks"] - s["num_free_blocks"]
        yield gauge("pageserve_num_requests_running", "sequences in the running batch", s["num_running"])
        yield gauge("pageserve_num_requests_waiting", "sequences waiting for a slot or blocks", s["num_waiting"])
        yield gauge("pageserve_kv_blocks_used", "KV-cache blocks held by sequences", used)
        yield gauge("pageserve_kv_blocks_free", "KV-cache blocks free (cached prefix blocks included)",
                    s["num_free_blocks"])
        yield gauge("pageserve_kv_cache_usage_ratio", "fraction of KV-cache blocks in use",
                    used / s["num_blocks"] if s["num_blocks"] else 0.0)
        yield gauge("pageserve_prefix_cache_hit_rate", "prefix-cache hit tokens / queried tokens",
                    s["prefix_cache_hit_rate"])
        yield counter("pageserve_num_preemptions", "sequences preempted for lack of blocks", s["num_preemptions"])
        yield counter("pageserve_prompt_tokens", "prompt tokens admitted (n per request)", s["prompt_tokens"])
        yield counter("pageserve_generation_tokens", "tokens generated", s["generated_tokens"])
        yield counter("pageserve_engine_steps", "engine steps run", s["num_steps"])
        if "spec_draft_tokens" in s:  # speculative decoding (EngineConfig.speculative_config); 0 when off
            yield counter("pageserve_spec_decode_num_draft_tokens", "draft tokens verified", s["spec_draft_tokens"])
            yield counter("pageserve_spec_decode_num_accepted_tokens", "draft tokens the model confirmed",
                          s["spec_accepted_tokens"])
        if "max_loras" in s:  # LoRA on: vLLM's info gauge (its value the scrape's time, its labels the adapters)
            g = GaugeMetricFamily("pageserve_lora_requests_info", "LoRA adapters of the running and waiting requests",
                                  labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
            g.add_metric([str(s["max_loras"]), ",".join(s["lora_running"]), ",".join(s["lora_waiting"])], time.time())
            yield g
            yield counter("pageserve_lora_slot_loads", "adapters copied into a device slot", s["lora_loads"])
        if self.steps is not None:
            yield from self._steps(self.steps)

    def _steps(self, t: StepStats):
        name = self.model_name

        def hist(metric: str, doc: str, b: Buckets, labels: dict | None = None, family=None):
            labels = labels or {}
            family = family or HistogramMetricFamily(metric, doc, labels=["model_name", *labels])
            buckets, _, total = b.cumulative()
            family.add_metric([name, *labels.values()], buckets, total)
            return family

        kinds = HistogramMetricFamily("pageserve_step_seconds", "wall time of one engine step() call, by the "
                                      "kind of step that landed in it (mixed: it computed prompt tokens)",
                                      labels=["model_name", "kind"])
        for kind, b in t.step_seconds.items():
            hist("", "", b, {"kind": kind}, kinds)
        yield kinds
        yield hist("pageserve_step_host_seconds", "step(): scheduling + input preparation + launch", t.host)
        yield hist("pageserve_step_launch_offcpu_seconds", "launch wall minus the engine thread's CPU time: "
                   "mostly waiting to get the GIL back", t.launch_offcpu)
        yield hist("pageserve_step_wait_seconds", "step(): waiting for the previous step's tokens (device)", t.wait)
        yield hist("pageserve_postprocess_seconds", "step(): append, detokenize, stop checks, output building",
                   t.postprocess)
        yield hist("pageserve_engine_overhead_seconds", "engine thread per step outside step(): delivery to "
                   "the event loop and the stats snapshot", t.overhead)
        yield hist("pageserve_step_batch_size", "sequences in a launched step", t.batch)
        idle = CounterMetricFamily("pageserve_engine_idle_seconds", "engine thread asleep with no work",
                                   labels=["model_name"])
        idle.add_metric([name], t.idle_s)
        yield idle
        cmds = CounterMetricFamily("pageserve_engine_commands_seconds", "engine thread adding and aborting requests",
                                   labels=["model_name"])
        cmds.add_metric([name], t.commands_s)
        yield cmds
        sw = GaugeMetricFamily("pageserve_switch_interval_seconds", "sys.getswitchinterval() of the server process",
                               labels=["model_name"])
        sw.add_metric([name], sys.getswitchinterval())
        yield sw


class ServerMetrics:
    """The registry of one app and the histograms its handlers feed."""

    def __init__(self, snapshot: Callable[[], dict], model_name: str, steps: StepStats | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineCollector(snapshot, model_name, steps))
        self.model_name = model_name
        labels = ["model_name"]
        reg = self.registry
        self.ttft = Histogram("pageserve_time_to_first_token_seconds", "arrival to first token",
                              labels, buckets=_LATENCY_BUCKETS, registry=reg).labels(model_name)
        self.itl = Histogram("pageserve_inter_token_latency_seconds", "time between tokens of a sequence",
                             labels, buckets=_LATENCY_BUCKETS, registry=reg).labels(model_name)
        self.e2e = Histogram("pageserve_e2e_request_latency_seconds", "arrival to the last token",
                             labels, buckets=_E2E_BUCKETS, registry=reg).labels(model_name)
        self.requests = Counter("pageserve_requests", "HTTP generation requests by outcome",
                                ["model_name", "outcome"], registry=reg)

    def observe(self, m: RequestMetrics) -> None:
        """Record a finished request's latencies."""
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
        if m.e2e_latency is not None:
            self.e2e.observe(m.e2e_latency)
        for dt in m.inter_token_latencies:
            self.itl.observe(dt)

    def count(self, outcome: str) -> None:
        self.requests.labels(self.model_name, outcome).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
