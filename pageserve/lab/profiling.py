"""Where a step's GPU time goes: kernels grouped into phases, against the hardware's floor.

Issue 14 asks for a table per phase of a workload: measured, floor, fraction. The pieces:

- ``kernel_category``: a kernel's name -> "gemm" (cuBLAS, and pageserve's GEMVs and tile
  matmuls), "attention", "norm", "rope_kv", "activation", "sampling", "copy" or "other".
- ``profile_kernels``: run a function under ``torch.profiler`` and add up the device time of
  each kernel it launched (eager launches and CUDA-graph replays alike).
- ``by_category``: those rows summed per category.
- ``linear_flops`` / ``prefill_attention_flops`` / ``decode_bytes``: what a prefill of T tokens
  must compute and a decode step must read, from the model's shape (a ``ModelConfig``), to divide by the
  measured TFLOP/s and GB/s (``kernel_bench.ceilings.measure_ceilings``).
- ``idle_us`` / ``decode_gaps`` / ``gpu_idle_fraction``: how much of a step's wall time no
  kernel covers: inside a decode graph's replay, outside it (sampling, input copies, host
  work not hidden), or in an eager step.
- ``chain_shares`` / ``chain_profile``: what each kernel adds to a span (a graph replay's) when
  kernels overlap under programmatic dependent launch and their durations do not add up.
- ``mean_step_timing``: the engine's own per-``step()`` host timings (``StepTiming``), averaged.

``scripts/profile_steps.py`` puts them together on the GPU (stage ``profile_steps`` of
scripts/h200_run.sh); everything here but ``profile_kernels`` is plain arithmetic, tested on
the CPU.
"""
from __future__ import annotations

import collections
import contextlib
import os
import statistics
import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from ..kernels.matmul_invariant import InvariantMatmulConfig

# (category, substrings of a kernel's name, lower case); the first match wins
CATEGORY_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    # this repository's own attention kernels by name: "_prefill_kernel" would otherwise land in "copy"
    # (it holds "fill"), as it did in the profile_steps records before session 15
    ("attention", ("paged", "decode_split", "decode_merge", "prefill_attn", "attention", "flash", "fmha",
                   "_prefill_kernel", "_chunk_kernel", "_split_kernel", "_merge_kernel")),
    ("norm", ("rms_norm", "rmsnorm", "layer_norm")),
    ("rope_kv", ("rope", "rotary", "kv_write", "write_kv", "reshape_and_cache")),
    # a product with SiLU·mul in its epilogue is a GEMM (counted as "activation" before session 38)
    ("gemm", ("gate_up_silu",)),
    ("activation", ("silu", "gelu", "act_and_mul")),
    ("sampling", ("sample", "softmax", "argmax", "topk", "top_k", "top_p", "gumbel", "exponential", "multinomial",
                  "log_softmax", "penalt", "sort")),
    ("gemm", ("gemv", "gemm", "matmul", "dequant", "nvjet", "cutlass", "xmma", "cublas", "splitkreduce", "sm90_",
              "sm80_", "ampere_", "turing_")),
    ("copy", ("copy", "memcpy", "memset", "gather", "index", "cat_", "fill")),
)
# the engine variants the profiling scripts build by name: LLM keyword arguments of each
ENGINE_MODES = {
    "default": {}, "deterministic": {"deterministic": True}, "int8": {"quantization": "int8"},
    # the default prefill kernel over its old grid (max_query_len's tiles for every sequence; session 15)
    "default_full_grid": {"triton_options": {"prefill_tile_map": False}},
    # the prefill kernel's causal mask on every key tile, as before session 30
    "default_full_mask": {"triton_options": {"prefill_diag_mask": False}},
    # session 40: the deterministic attention's split programs at 1-4 rows walk a split's key tiles in phases
    "deterministic_attn_phased": {"deterministic": True, "_patch": "attn_phased_small_decodes"},
    # session 31: eager steps' chunks of >= 64 new tokens through the paged kernel too, as before (no chunk launch)
    "default_no_chunk_attention": {"triton_options": {"chunk_attention": False}},
    # session 32: the gate_up product with SiLU·mul in its epilogue (kernels.gate_up_silu: gate and up rows
    # interleaved in one tile) from 4,096 rows, one program a tile (83d553f ran it from 65 rows), and the
    # persistent walk (the default from 2,048 rows since 9b5c754); and without it (cuBLAS + the SiLU·mul kernel)
    "default_paired_silu": {"triton_options": {"paired_silu_rows": (4096, 1 << 20), "paired_silu_config":
                                               InvariantMatmulConfig(128, 256, 64, 8, 3, tma=True)}},
    "default_paired_silu_persistent": {"triton_options": {"paired_silu_rows": (4096, 1 << 20), "paired_silu_config":
                                                          InvariantMatmulConfig(128, 256, 64, 8, 3, tma=True, persistent=True)}},
    "default_no_paired_silu": {"triton_options": {"paired_silu_rows": None}},
    # session 58: down's K slices summed by the next norm at 2-64 rows only, as at a1c4746 (the default since
    # a68d9d7 is 2-256 rows on Hopper)
    "default_split_to_64": {"triton_options": {"split_to_norm_rows": (2, 64)}},
    # the tile map in sequence order instead of longest tiles first (session 16)
    "default_sequence_order": {"triton_options": {"prefill_tile_order": "sequence"}},
    # eager steps at bucketed row counts, every bucket's GEMMs warmed at start-up (session 17)
    "default_row_buckets": {"eager_row_buckets": True},
    # mixed and prefill steps up to 2,048 tokens from CUDA graphs (session 17; the default since
    # session 18), and without them (every step with a prompt chunk eager, as before)
    "mixed_graphs": {"mixed_cuda_graphs": True}, "eager_mixed": {"mixed_cuda_graphs": False},
    # graphs up to the whole 8,192-token budget: W1's prefill steps too (56 buckets; NOTES.md, session 18)
    "mixed_graphs_8k": {"mixed_cuda_graphs": True, "mixed_graph_max_tokens": 8192},
    # the decode attention's pipelined schedule (opt-in, session 20) and the split rule (the default;
    # at 20c1dab, where pipelined was the default on sm_90, the nano-vllm A/B's reference)
    "attn_pipelined": {"triton_options": {"decode_schedule": "pipelined"}},
    "attn_split_rule": {"triton_options": {"decode_schedule": "split"}},
    # session 28: the schedule by each step's longest context (the default on sm_90 since), and decode graphs
    # at vLLM's sizes (1, 2, 4, then steps of 8 to 256 and of 16 to 512) instead of steps of 32 / 64
    "attn_by_context": {"triton_options": {"decode_schedule": "by_context"}},
    "fine_graph_sizes": {"cuda_graph_sizes": [1, 2, 4] + list(range(8, 257, 8)) + list(range(272, 513, 16))},
    # session 28 also ran "decode_batch_order" / "decode_longest_first" (TritonOps decode_order, 3da542c-7c452d3:
    # the decode kernel's sequences longest context first past one wave): inside the spread, removed
    # session 29: the logits converted to fp32 after the head, as before (``fp32_logits``; "_patch" keys name a
    # patch of ``PATCHES`` that ``engine_mode`` applies around the engine, not an ``LLM`` argument)
    "fp32_logits": {"_patch": "fp32_logits"},
    # session 33: KV pages of 32 / 64 tokens instead of 16 (fewer block-table reads and longer runs of
    # contiguous keys a tile), and a KV pool of 16,384 blocks (9.4 GB at the 3B shape) instead of one sized
    # from the GPU's memory (~100 GB): whether the decode attention's page walks pay for the pool's spread
    "block32": {"block_size": 32}, "block64": {"block_size": 64}, "kv_pool_16k": {"num_blocks": 16384},
    # session 34: decode steps' RoPE and K/V write as rope_kv's own launch before the attention, as before
    # (the default since: inside the decode attention's launch, kernels.paged_decode.rope_decode_attention)
    "default_no_rope_attention": {"triton_options": {"fuse_rope_attention": False}},
    "default_rope_attention_9_up": {"triton_options": {"fuse_rope_attention": (9, 1 << 30)}},  # 45b6a3e's default
    "default_rope_attention_all": {"triton_options": {"fuse_rope_attention": True}},  # steps under PDL too
}


@contextlib.contextmanager
def fp32_logits():
    """The engine as before session 29, for an A/B: ``Decoder.head_logits`` converts the head's product
    to fp32 (the decode graphs' shared buffer fp32, one conversion kernel after the head). Patches the
    class while the block runs: build and run the engine inside it."""
    from ..model.decoder import Decoder

    head, dtype = Decoder.head_logits, Decoder.logits_dtype

    def head_fp32(self, hidden, out=None):
        return head(self, hidden).float() if out is None else out.copy_(head(self, hidden))

    Decoder.head_logits, Decoder.logits_dtype = head_fp32, property(lambda self: torch.float32)
    try:
        yield
    finally:
        Decoder.head_logits, Decoder.logits_dtype = head, dtype


@contextlib.contextmanager
def attn_phased(max_tiles: int | None = None):
    """The deterministic attention's split programs walk a split's key tiles in phases on decode launches of at
    most ``max_tiles`` (sequence, KV head) tiles (``kernels.paged_invariant.PHASED_MAX_TILES``; None: the launches
    that run at 8 warps, ``WIDE_WARPS_MAX_TILES``, i.e. batches of 1-4 at 2 KV heads)."""
    from ..kernels import paged_invariant

    before = paged_invariant.PHASED_MAX_TILES
    paged_invariant.PHASED_MAX_TILES = paged_invariant.WIDE_WARPS_MAX_TILES if max_tiles is None else max_tiles
    try:
        yield
    finally:
        paged_invariant.PHASED_MAX_TILES = before


PATCHES = {"fp32_logits": fp32_logits, "attn_phased_small_decodes": attn_phased,
           "attn_unphased": lambda: attn_phased(0),
           "attn_phased_all_decodes": lambda: attn_phased(1 << 30)}


def engine_mode(mode: str | dict) -> tuple[dict, contextlib.AbstractContextManager]:
    """(``LLM`` keyword arguments, the patch to run the engine under) of an ``ENGINE_MODES`` name or dict."""
    kw = dict(ENGINE_MODES[mode] if isinstance(mode, str) else mode)
    patch = kw.pop("_patch", None)
    return kw, PATCHES[patch]() if patch else contextlib.nullcontext()


CATEGORIES = tuple(dict.fromkeys(c for c, _ in CATEGORY_RULES)) + ("other",)


def kernel_category(name: str) -> str:
    """The phase a kernel belongs to, from its name (``CATEGORY_RULES``)."""
    low = name.lower()
    for category, needles in CATEGORY_RULES:
        if any(n in low for n in needles):
            return category
    return "other"


@dataclass(frozen=True)
class KernelRow:
    name: str
    us: float  # device time per call of the profiled function
    launches: int  # launches per call

    @property
    def category(self) -> str:
        return kernel_category(self.name)


def profile_kernels(fn: Callable[[], object], repeats: int = 1) -> list[KernelRow]:
    """Device time of each kernel ``fn`` launches, per call of ``fn`` (``repeats`` profiled
    calls after one unprofiled one), largest first. Needs CUDA: on the CPU nothing is a kernel."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    if not torch.cuda.is_available():  # nothing to count: run it as the GPU run would, return no rows
        for _ in range(repeats):
            fn()
        return []
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    total: dict[str, float] = collections.defaultdict(float)
    count: dict[str, int] = collections.defaultdict(int)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            total[e.name] += e.device_time
            count[e.name] += 1
    rows = [KernelRow(n, t / repeats, count[n] // repeats) for n, t in total.items()]
    return sorted(rows, key=lambda r: -r.us)


def difference_per_step(full: Iterable[KernelRow], base: Iterable[KernelRow], steps: int) -> list[KernelRow]:
    """The kernels ``steps`` more steps add: per kernel name, (full - base) device time and launches divided by
    ``steps``, largest first; names whose time does not grow are left out. For a peer whose steps cannot be
    profiled one by one (vLLM's ``generate`` of 1 + steps tokens against 1 token: the prefill cancels)."""
    if steps <= 0:
        raise ValueError(f"steps must be positive, got {steps}")
    before = {r.name: r for r in base}
    rows = []
    for r in full:
        b = before.get(r.name)
        us = r.us - (b.us if b else 0.0)
        if us > 0:
            rows.append(KernelRow(r.name, us / steps, round((r.launches - (b.launches if b else 0)) / steps)))
    return sorted(rows, key=lambda r: -r.us)


def by_category(rows: Iterable[KernelRow]) -> dict[str, float]:
    """Microseconds per category (every category present, 0.0 where nothing ran)."""
    out = dict.fromkeys(CATEGORIES, 0.0)
    for r in rows:
        out[r.category] += r.us
    return out


def linear_flops(config, tokens: int, sampled_rows: int = 0) -> float:
    """FLOPs of every linear layer for ``tokens`` rows (qkv, o, gate_up, down in each layer),
    plus the LM head for the ``sampled_rows`` rows whose logits are computed."""
    h, i = config.hidden_size, config.intermediate_size
    qkv = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
    per_token_layer = qkv * h + h * config.num_heads * config.head_dim + 2 * i * h + h * i
    return 2.0 * (tokens * config.num_layers * per_token_layer + sampled_rows * config.vocab_size * h)


def prefill_attention_flops(config, prompt_len: int, num_prompts: int = 1) -> float:
    """FLOPs of causal attention over whole prompts (QK^T and PV, the visible half only)."""
    pairs = prompt_len * (prompt_len + 1) / 2
    return 2 * 2.0 * pairs * config.head_dim * config.num_heads * config.num_layers * num_prompts


def decode_bytes(model, batch: int, context_len: int, dtype_bytes: int = 2, weights: float | None = None) -> float:
    """Bytes one decode step must read: every weight once (``weights`` if given, e.g. an int8
    model's, else ``peers.weight_bytes``) and ``batch`` sequences' K and V at ``context_len``."""
    from .peers import kv_bytes, weight_bytes

    return (weight_bytes(model, dtype_bytes) if weights is None else weights) + batch * kv_bytes(
        model, context_len, dtype_bytes)


def device_events(prof) -> list[tuple[int, int, str]]:
    """(start ns, end ns, name) of every device event (kernels, copies, memsets) of a finished
    ``torch.profiler.profile``. Reads Kineto's raw events (a whole workload holds ~10^5-10^6
    kernels, too many to build the profiler's Python event tree for); falls back to ``prof.events()``."""
    cuda = torch.autograd.DeviceType.CUDA
    try:
        return [(e.start_ns(), e.end_ns(), e.name()) for e in prof.profiler.kineto_results.events()
                if e.device_type() == cuda]
    except AttributeError:
        return [(int(e.time_range.start * 1e3), int(e.time_range.end * 1e3), e.name) for e in prof.events()
                if e.device_type == cuda]


def chain_shares(kernels: Iterable[tuple[int, int, str]]) -> dict:
    """How much of a span each kernel *adds*: ``kernels`` (start ns, end ns, name) of one stream,
    in any order. Walked in start order, a kernel's share is how far its end moves the frontier
    (the latest end so far) past max(frontier, its own start); the time between the frontier and
    a later start is idle, put on the kernel that starts there. The shares and the idle times add
    up to the span exactly, where summed durations do not: under programmatic dependent launch a
    kernel starts while the one before still runs, so durations overlap. A kernel that ends inside
    the frontier adds nothing. Returns µs: ``span_us``, ``busy_us`` (the shares' sum),
    ``idle_us``, and per name ``share_us`` / ``idle_before_us`` / ``duration_us`` / ``launches``."""
    rows = sorted(kernels)
    if not rows:
        return {"span_us": 0.0, "busy_us": 0.0, "idle_us": 0.0, "kernels": {}}
    per: dict[str, dict] = {}
    frontier = rows[0][0]
    for start, end, name in rows:
        r = per.setdefault(name, {"share_us": 0.0, "idle_before_us": 0.0, "duration_us": 0.0, "launches": 0})
        if start > frontier:
            r["idle_before_us"] += (start - frontier) / 1e3
            frontier = start
        if end > frontier:
            r["share_us"] += (end - frontier) / 1e3
            frontier = end
        r["duration_us"] += (end - start) / 1e3
        r["launches"] += 1
    busy = sum(r["share_us"] for r in per.values())
    idle = sum(r["idle_before_us"] for r in per.values())
    ranked = dict(sorted(per.items(), key=lambda kv: -kv[1]["share_us"]))
    return {"span_us": (frontier - rows[0][0]) / 1e3, "busy_us": busy, "idle_us": idle, "kernels": ranked}


def by_layer_position(kernels: list[tuple[int, int, str]], layers: int) -> list[tuple[int, int, str]]:
    """Kernels renamed by their place in the layer, so one kernel serving several products (the
    invariant matmul for qkv, o, gate_up and down) is told apart: the anchor is the attention kernel
    launched exactly ``layers`` times; every kernel gets ``name @k``, k its launch's offset from the
    latest anchor in start order (``@pre`` before the first). Unchanged if no attention kernel
    appears ``layers`` times."""
    rows = sorted(kernels)
    counts = collections.Counter(name for _, _, name in rows)
    anchors = [n for n, c in counts.items() if c == layers and kernel_category(n) == "attention"]
    if not anchors:
        return rows
    anchor = min(anchors, key=lambda n: next(i for i, r in enumerate(rows) if r[2] == n))  # the first launched
    out, offset = [], None
    for start, end, name in rows:
        if name == anchor:
            offset = 0
        out.append((start, end, f"{name} @{'pre' if offset is None else offset}"))
        if offset is not None:
            offset += 1
    return out


def chain_profile(fn: Callable[[], object], repeats: int = 10, layers: int | None = None) -> dict | None:
    """``chain_shares`` of each of ``repeats`` profiled calls of ``fn`` (one unprofiled first), averaged
    per call: a CUDA-graph replay's kernels, where each kernel's share of the replay says what it costs
    the chain. The calls are told apart by their kernel count (every call launches the same kernels, one
    after another on one stream). With ``layers``, kernels are named by their place in the layer
    (``by_layer_position``). None without CUDA, or if the events do not split into equal calls."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    events = sorted(device_events(prof))
    if not events or len(events) % repeats:
        return None
    n = len(events) // repeats
    calls = [events[i * n:(i + 1) * n] for i in range(repeats)]
    if layers:
        calls = [by_layer_position(c, layers) for c in calls]
    return average_chain_shares([chain_shares(c) for c in calls])


def average_chain_shares(calls: list[dict]) -> dict:
    """The mean of several ``chain_shares`` results (the same kernels in each), per call."""
    k = len(calls)
    out = {key: sum(c[key] for c in calls) / k for key in ("span_us", "busy_us", "idle_us")}
    names: dict[str, dict] = {}
    for c in calls:
        for name, r in c["kernels"].items():
            acc = names.setdefault(name, dict.fromkeys(r, 0.0))
            for f, v in r.items():
                acc[f] += v / k
    out["kernels"] = dict(sorted(names.items(), key=lambda kv: -kv[1]["share_us"]))
    return out


GAP_BUCKETS_US = (2.0, 10.0, 100.0, 1000.0)


def gpu_gaps(kernels: Iterable[tuple[int, int, str]], top: int = 12) -> dict:
    """Where the GPU sat idle between kernels: ``kernels`` (start ns, end ns, name) of one device,
    in any order. Returns the span (first start to last end), the busy time (the union of the
    kernels' intervals), the idle time between them, that idle time by gap length (``GAP_BUCKETS_US``:
    under 2 µs, 2-10, 10-100, 100 µs-1 ms, longer) and by the kernel each gap follows and precedes
    (``top`` each, seconds, largest first): an idle GPU waits on the host, so a gap's neighbours say
    which launch the host was late with. Seconds throughout."""
    rows = sorted(kernels)
    if not rows:
        return {"span_s": 0.0, "busy_s": 0.0, "idle_s": 0.0, "by_length_s": {}, "after": [], "before": []}
    edges = GAP_BUCKETS_US + (float("inf"),)
    labels = [f"<{edges[0]:g}us"] + [f"{lo:g}-{hi:g}us" for lo, hi in zip(edges, edges[1:-1])] + [f">{edges[-2]:g}us"]
    by_length = dict.fromkeys(labels, 0.0)
    after: dict[str, float] = collections.defaultdict(float)
    before: dict[str, float] = collections.defaultdict(float)
    busy = 0.0
    cur_start, cur_end, last_name = rows[0][0], rows[0][1], rows[0][2]
    for start, end, name in rows[1:]:
        if start > cur_end:  # an idle gap: close the busy interval
            busy += cur_end - cur_start
            gap = (start - cur_end) / 1e9
            us = gap * 1e6
            by_length[labels[next(i for i, e in enumerate(edges) if us < e)]] += gap
            after[last_name] += gap
            before[name] += gap
            cur_start = start
        if end >= cur_end:
            cur_end, last_name = end, name
    busy += cur_end - cur_start
    span = (cur_end - rows[0][0]) / 1e9

    def ranked(d):
        return [[k, v] for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:top]]

    return {"span_s": span, "busy_s": busy / 1e9, "idle_s": span - busy / 1e9, "by_length_s": by_length,
            "after": ranked(after), "before": ranked(before)}


def workload_bound(kernel_s: dict[str, float], floor: dict[str, float], read_gbps: float,
                   matmul_tflops: float) -> dict[str, float | None]:
    """What one workload's kernels say about how far its wall time could fall (issue 14).

    ``kernel_s``: device seconds per category over the whole workload (``by_category`` of its
    kernels); ``floor``: its ``peers.workload_floor``. Returns the GEMMs' time, rate and fraction of
    the matmul ceiling; the attention's time and floor (the decode tokens' K/V read at the read
    bandwidth plus the prompts' attention FLOPs at the matmul ceiling); the other kernels' time; and
    ``bound_s``: the GEMMs as measured plus the attention at its floor, every other kernel free and no
    idle, i.e. the wall this engine cannot go under without faster GEMMs."""
    gemm = kernel_s.get("gemm", 0.0)
    attention = kernel_s.get("attention", 0.0)
    attention_floor = (floor["kv_read_bytes"] / (read_gbps * 1e9)
                       + floor["prompt_attention_flops"] / (matmul_tflops * 1e12))
    tflops = floor["linear_flops"] / gemm / 1e12 if gemm > 0 else None
    return {"gemm_s": gemm, "gemm_floor_s": floor["linear_flops"] / (matmul_tflops * 1e12), "gemm_tflops": tflops,
            "gemm_ceiling_fraction": tflops / matmul_tflops if tflops is not None else None,
            "attention_s": attention, "attention_floor_s": attention_floor,
            "other_s": sum(kernel_s.values()) - gemm - attention, "bound_s": gemm + attention_floor}


def phase_rows(categories_us: dict[str, float], floors_us: dict[str, float]) -> list[dict]:
    """Table rows (phase, measured µs, floor µs, floor / measured) for the categories that ran,
    largest first; a category with no floor gets None there."""
    rows = []
    for cat, us in categories_us.items():
        if us <= 0:
            continue
        floor = floors_us.get(cat)
        rows.append({"phase": cat, "measured_us": us, "floor_us": floor,
                     "fraction": (floor / us) if floor else None})
    return sorted(rows, key=lambda r: -r["measured_us"])


def idle_us(wall_us: float, kernel_us: float) -> tuple[float, bool]:
    """Time in a span that no kernel covers: ``wall - kernels`` (µs), clamped at 0, and
    whether the kernels' summed durations exceed the wall. They can: with programmatic
    dependent launch a kernel starts before its predecessor ends, so durations overlap
    and the true gap is unknown (not zero) when the flag is set."""
    return max(0.0, wall_us - kernel_us), kernel_us > wall_us


def decode_gaps(step_ms: float, replay_ms: float, graph_kernel_us: float,
                step_kernel_us: float | None = None) -> dict:
    """Where a graphed decode step's wall time goes beyond its graph's kernels, in µs.

    - ``in_graph_gap_us``: one replay's time minus its kernels' sum: idle between kernels
      inside the graph (``idle_us``: clamped, ``kernels_overlap`` when the sum is larger);
    - ``outside_graph_us``: the engine step minus one replay: sampling, input copies and host
      work the async scheduling did not hide. Signed: the two are timed in different runs,
      so a small negative value is noise;
    - with ``step_kernel_us`` (every kernel of one engine step): ``outside_graph_kernel_us``,
      the kernels launched outside the graph, and ``outside_graph_idle_us``, the rest of
      ``outside_graph_us`` (signed likewise)."""
    gap, overlap = idle_us(1e3 * replay_ms, graph_kernel_us)
    outside = 1e3 * (step_ms - replay_ms)
    out = {"in_graph_gap_us": gap, "kernels_overlap": overlap, "outside_graph_us": outside}
    if step_kernel_us is not None:
        out_kernels = step_kernel_us - graph_kernel_us
        out.update(outside_graph_kernel_us=out_kernels, outside_graph_idle_us=outside - out_kernels)
    return out


def gpu_idle_fraction(kernel_us: float, wall_ms: float) -> float:
    """``1 - kernels / wall``: the share of a step's wall time with no kernel running,
    clamped at 0 (overlapping kernels can sum to more than the wall; see ``idle_us``)."""
    return max(0.0, 1.0 - kernel_us / (1e3 * wall_ms))


STEP_TIMING_FIELDS = ("total", "sched", "launch", "wait", "post")


def mean_step_timing(timings: Iterable) -> dict[str, float]:
    """Means over ``engine.step()`` calls of their ``StepTiming`` (``engine.last_step``), in µs:
    ``total_us`` (the call's wall time), ``sched_us`` (``Scheduler.schedule``), ``launch_us``
    (the runner's ``execute``: input preparation, the host->device copy, the graph or kernel
    launches, the sampler's launches), ``wait_us`` (blocked on the device for the landed
    step's tokens), ``post_us`` (appending tokens, stop checks, outputs) and ``host_busy_us``
    = total - wait: the host's own work per call. Under async scheduling the device runs the
    next step during that work, so the host is hidden while ``wait_us`` stays above zero.
    ``steps``: how many calls; an empty input gives ``{"steps": 0}``."""
    timings = list(timings)
    if not timings:
        return {"steps": 0}
    n = len(timings)
    out: dict[str, float] = {"steps": n}
    for f in STEP_TIMING_FIELDS:
        out[f"{f}_us"] = 1e6 * sum(getattr(t, f"{f}_s") for t in timings) / n
    out["host_busy_us"] = out["total_us"] - out["wait_us"]
    return out


class CompileLog:
    """Triton JIT compiles while active (``knobs.runtime.jit_post_compile_hook``, Triton >= 3.4;
    elsewhere it records nothing and ``available`` is False): which kernels compiled inside a timed
    pass (scripts/w1_profile.py), or that a warmed-up engine compiles nothing more (the GPU tests)."""

    def __init__(self) -> None:
        self.names: list[str] = []
        try:
            import triton
            self._knobs = triton.knobs.runtime
            self._knobs.jit_post_compile_hook  # noqa: B018 (older knobs lack it)
        except (ImportError, AttributeError):
            self._knobs = None

    @property
    def available(self) -> bool:
        return self._knobs is not None

    def __enter__(self):
        if self._knobs is not None:
            self._prev = self._knobs.jit_post_compile_hook
            self._knobs.jit_post_compile_hook = self._hook
        return self

    def _hook(self, *, fn=None, **_):
        self.names.append(getattr(fn, "name", str(fn)))
        return None

    def __exit__(self, *exc) -> None:
        if self._knobs is not None:
            self._knobs.jit_post_compile_hook = self._prev

    def summary(self) -> dict:
        if self._knobs is None:
            return {"available": False}
        return {"available": True, "compiles": len(self.names),
                "by_kernel": {n: self.names.count(n) for n in sorted(set(self.names))}}


class ClockLog:
    """The GPU's SM clock (MHz) polled every ``period`` s while active (NVML through pynvml when
    importable, else ``nvidia-smi``): is a variant's speed the GPU running at another clock?"""

    def __init__(self, period: float = 0.02) -> None:
        self.period, self.mhz = period, []
        self._stop = threading.Event()
        try:
            import pynvml
            pynvml.nvmlInit()
            h = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
            self._read = lambda: pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)
        except Exception:  # no pynvml: one nvidia-smi call a sample (~20-50 ms each)
            self._read = lambda: int(subprocess.run(
                ["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader,nounits", "-i",
                 str(torch.cuda.current_device())], capture_output=True, text=True, timeout=5).stdout.split()[0])

    def _poll(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self.mhz.append(self._read())
            except Exception:
                return

    def __enter__(self) -> "ClockLog":
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict:
        m = self.mhz
        p10 = sorted(m)[len(m) // 10] if m else None
        return {"samples": len(m), "mean_mhz": sum(m) / len(m) if m else None, "min_mhz": min(m, default=None),
                "p10_mhz": p10, "max_mhz": max(m, default=None)}


def python_loop_ms(n: int = 200_000, repeats: int = 5) -> float:
    """Best of ``repeats`` timings, in ms, of a fixed pure-Python loop of ``n`` steps: how fast this host
    runs an engine's Python (a scheduler, a front end). The records' CPU model name ("Intel(R) Xeon(R)
    Processor") cannot tell the pool's hosts apart, and vLLM's W1 moves with how busy it keeps the GPU
    (NOTES.md session 36)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        acc = 0
        for i in range(n):
            acc += i & 7
        best = min(best, time.perf_counter() - t0)
    return 1e3 * best


def host_info() -> dict:
    """The machine a benchmark ran on: CPU model, logical cores, the first core's clock as the kernel reports
    it, and ``python_loop_ms`` (peers' runs differ from host to host)."""
    model = mhz = None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if model is None and line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                elif mhz is None and line.startswith("cpu MHz"):
                    mhz = float(line.split(":", 1)[1])
    except (OSError, ValueError):
        pass
    return {"cpu_model": model, "cpu_count": os.cpu_count(), "cpu_mhz": mhz, "py_loop_ms": python_loop_ms()}


class RunConditions:
    """What the host and GPU were doing while a timed run ran: the 1-minute load average before and
    after, and on CUDA the SM clock (``ClockLog``, every ``period`` s). For runs whose speed moves from
    one run to the next (vLLM's W1 read 62-72k tok/s on one H200 within ten minutes, NOTES.md session 21)."""

    def __init__(self, period: float = 0.5) -> None:  # sparse: without pynvml each sample is an nvidia-smi process
        self.clock = ClockLog(period) if torch.cuda.is_available() else None
        self.load: list[float | None] = []

    @staticmethod
    def _load_1m() -> float | None:
        try:
            return os.getloadavg()[0]
        except OSError:
            return None

    def __enter__(self) -> "RunConditions":
        self.load.append(self._load_1m())
        if self.clock is not None:
            self.clock.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.clock is not None:
            self.clock.__exit__(*exc)
        self.load.append(self._load_1m())

    def summary(self) -> dict:
        out = {"load_1m_before": self.load[0] if self.load else None,
               "load_1m_after": self.load[1] if len(self.load) > 1 else None}
        if self.clock is not None:
            out.update({f"sm_{k}": v for k, v in self.clock.summary().items()})
        return out


def sampler_op_profile(llm, prompts, params, calls: int = 8, top: int = 20) -> dict:
    """The first ``calls`` sampler calls of ``llm.generate(prompts, params)`` under ``torch.profiler``: the ``top``
    ops by host time and by device time (ms a call), and every CUDA runtime call's host time and count a call
    (``cuda*`` keys: a ``cudaStreamSynchronize``, ``cudaMalloc``, ``cudaFree`` or ``cudaHostAlloc`` shows there).
    What no op accounts for in a call's wall time is Python and the profiler's overhead. Used by
    ``scripts/sampling_bench.py`` and ``scripts/structured_bench.py``."""
    from torch.profiler import ProfilerActivity, profile

    sampler = llm.engine.runner.sampler
    real = sampler.sample
    cuda = sampler.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    host: dict[str, float] = {}
    device: dict[str, float] = {}
    counts: dict[str, int] = {}
    walls: list[float] = []

    def profiled(*a, **k):
        if len(walls) >= calls:
            return real(*a, **k)
        t = time.perf_counter()
        with profile(activities=activities) as prof:
            out = real(*a, **k)
        walls.append(1e3 * (time.perf_counter() - t))
        if cuda:
            torch.cuda.synchronize()  # the device times of this call's kernels, before the profile closes
        for e in prof.key_averages():
            host[e.key] = host.get(e.key, 0.0) + e.self_cpu_time_total / 1e3
            dev = getattr(e, "self_device_time_total", None)
            if dev is None:
                dev = getattr(e, "self_cuda_time_total", 0.0)
            device[e.key] = device.get(e.key, 0.0) + dev / 1e3
            counts[e.key] = counts.get(e.key, 0) + e.count
        return out

    sampler.sample = profiled
    try:
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        del sampler.sample
    n = max(len(walls), 1)

    def per_call(d: dict, keys) -> dict:
        return {k: round(d[k] / n, 4) for k in keys}

    by_host = sorted(host, key=lambda k: -host[k])[:top]
    by_device = sorted((k for k in device if device[k] > 0), key=lambda k: -device[k])[:top]
    runtime = sorted((k for k in host if k.startswith("cuda")), key=lambda k: -host[k])
    return {"calls": len(walls), "wall_ms_median": statistics.median(walls) if walls else None,
            "host_ms_per_call": per_call(host, by_host), "device_ms_per_call": per_call(device, by_device),
            "runtime_host_ms_per_call": per_call(host, runtime),
            "runtime_calls_per_call": {k: round(counts[k] / n, 2) for k in runtime}}
