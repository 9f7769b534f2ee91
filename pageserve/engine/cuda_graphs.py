"""Decode steps replayed from CUDA graphs.

One graph per batch-size bucket (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, … up to ``max_bs``),
all sharing one memory pool, captured largest first. Every per-step input lives in a static
device buffer that is refreshed before replay:

    input_ids, positions, slot_mapping   [max_bs]
    seq_lens                             [max_bs]
    block_tables                         [max_bs, max_blocks_per_seq]
    query_start_loc                      [max_bs + 1]  (= arange: one token per sequence)

Each graph ends with the output head, so a replay yields the logits of every row (in a
decode step every sequence samples), in the model's dtype, written into one [max_bs, V]
buffer that every bucket shares: the sampler reads them on the same stream before the next
replay. (One fp32 output per bucket held ~1.8 GB at max_bs 512 and the 3B shape's vocabulary;
this one 156 MB in bf16.) Above the GEMV's rows cuBLAS writes the head's product into it
directly (``ops.head``).
A batch of ``bs`` decodes is padded to the next bucket: padded rows get slot -1 (their K/V
is not written) and seq_len 0 (attention writes zeros for them), so they touch nothing real.
Prefill and batches larger than ``max_bs`` run eagerly. ``EngineConfig.cuda_graph_sizes``
replaces the default buckets with a list of its own.

Where the ops launch a decode step differently by context (``ops.decode_context_limits()``:
on sm_90 the attention's "pipelined" schedule up to 768 tokens, the split rule above), each
bucket has one graph per context class, and a step replays the class of its longest context,
which the host knows from the scheduler.

On CUDA the copy-in is one Triton launch (``kernels.step_inputs``) instead of five to nine
PyTorch copies, each a launch on the stream ahead of the replay.

Where graphs are unavailable (the CPU) ``capture=False`` keeps the same static buffers and
padding but runs the model eagerly on them: CI checks the bookkeeping with the same code.
"""
from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass

import torch

from ..model.attention import AttentionMetadata, PagedAttention

logger = logging.getLogger(__name__)


def bucket_sizes(max_bs: int, sizes: list[int] | None = None) -> list[int]:
    """The batch sizes captured: ``sizes`` up to ``max_bs`` if given (``EngineConfig.cuda_graph_sizes``),
    else 1, 2, 4, 8, 16, 32, 48, then steps of 32 to 256 and of 64 above, and ``max_bs`` itself."""
    if sizes is not None:
        kept = sorted({s for s in sizes if 0 < s <= max_bs})
        if not kept:
            raise ValueError(f"no CUDA graph size in {sizes} is within 1..{max_bs} (max_num_seqs / cuda_graph_max_bs)")
        return kept
    sizes = [1, 2, 4, 8] + list(range(16, 64, 16)) + list(range(64, 256, 32)) + list(range(256, 8192, 64))
    sizes = [s for s in sizes if s < max_bs] + [max_bs]
    return sorted(set(sizes))


@dataclass
class Captured:
    """What ``capture_buckets`` made: per size its graph and the output its replays write, the
    pool they share, and what the capture cost (seconds; bytes the caching allocator reserved)."""

    graphs: dict
    outputs: dict
    pool: object
    seconds: float
    reserved_bytes: int


def capture_buckets(sizes: list, forward, device: torch.device) -> Captured:
    """Capture ``forward(size)`` for every size (an int, or a tuple whose first item is the row
    count), largest first, into one shared memory pool, each after one eager warm-up run (Triton
    compiles, cuBLAS picks its kernels)."""
    t0, reserved = time.perf_counter(), torch.cuda.memory_reserved(device)
    graphs, outputs, pool = {}, {}, None
    for size in sorted(sizes, reverse=True):
        forward(size)
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            outputs[size] = forward(size)
        if pool is None:
            pool = graph.pool()
        graphs[size] = graph
    torch.cuda.synchronize(device)
    return Captured(graphs, outputs, pool, time.perf_counter() - t0, torch.cuda.memory_reserved(device) - reserved)


class CUDAGraphRunner:
    def __init__(
        self,
        model,
        kv_cache: torch.Tensor,
        max_bs: int,
        max_blocks_per_seq: int,
        capture: bool | None = None,
        stage_kernel: bool | None = None,
        sizes: list[int] | None = None,
    ) -> None:
        """``stage_kernel``: copy inputs in with the Triton kernel (default: on CUDA). ``sizes``: the
        buckets (``bucket_sizes``; default: its own list)."""
        self.model = model
        self.kv_cache = kv_cache
        self.device = kv_cache.device
        self.capture_enabled = (self.device.type == "cuda") if capture is None else capture
        self.stage_kernel = (self.device.type == "cuda") if stage_kernel is None else stage_kernel
        if self.stage_kernel:
            from ..kernels.step_inputs import stage_decode_inputs
        else:
            from ..kernels.reference import stage_decode_inputs
        self._stage = stage_decode_inputs
        self.buckets = bucket_sizes(max_bs, sizes)
        self.max_bs = max_bs = self.buckets[-1]
        self.max_seq_len = max_blocks_per_seq * kv_cache.shape[3]
        # context classes, shortest first (None: any context); a step replays the first that holds it.
        # A limit at or past the longest context the table holds would never be left: one class less
        self.context_limits = tuple(lim for lim in model.ops.decode_context_limits()
                                    if lim is None or lim < self.max_seq_len)
        self.last_key: tuple[int, int] | None = None  # (bucket, class) of the last run
        dev, i32, i64 = self.device, torch.int32, torch.int64
        self.input_ids = torch.zeros(max_bs, dtype=i64, device=dev)
        self.positions = torch.zeros(max_bs, dtype=i64, device=dev)
        self.slot_mapping = torch.full((max_bs,), -1, dtype=i64, device=dev)
        self.seq_lens = torch.zeros(max_bs, dtype=i32, device=dev)
        self.block_tables = torch.zeros(max_bs, max_blocks_per_seq, dtype=i32, device=dev)
        self.query_start_loc = torch.arange(max_bs + 1, dtype=i32, device=dev)
        self._static_inputs = (self.input_ids, self.positions, self.slot_mapping, self.seq_lens, self.block_tables)
        self.hidden = torch.zeros(max_bs, model.cfg.hidden_size, dtype=kv_cache.dtype, device=dev)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        # (bucket, context class) -> its graph's output, a view of logits_out
        self.logits: dict[tuple[int, int], torch.Tensor] = {}
        # every bucket's logits (a tensor-parallel shard's cfg has the full vocabulary: it gathers)
        self.logits_out = torch.empty(max_bs, model.cfg.vocab_size, dtype=model.logits_dtype, device=dev)
        self.pool = None
        self.capture_s, self.capture_bytes = None, None  # seconds and reserved bytes the capture took

    def _context(self, bs: int, cls: int) -> PagedAttention:
        limit = self.context_limits[cls]
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs],
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            block_tables=self.block_tables[:bs],
            max_query_len=1,
            max_seq_len=self.max_seq_len if limit is None else limit,
        )
        return PagedAttention(self.kv_cache, meta, self.model.ops)

    def _forward(self, key: tuple[int, int], out: torch.Tensor | None = None) -> torch.Tensor:
        bs, cls = key
        self.hidden[:bs] = self.model(self.input_ids[:bs], self.positions[:bs], self._context(bs, cls))
        return self.model.head_logits(self.hidden[:bs], out=out)  # [bs, V], the model's dtype

    def _forward_shared(self, key: tuple[int, int]) -> torch.Tensor:
        return self._forward(key, out=self.logits_out[: key[0]])

    def keys(self) -> list[tuple[int, int]]:
        """Every (bucket, context class) the runner replays."""
        return [(b, c) for b in self.buckets for c in range(len(self.context_limits))]

    def key_for(self, bs: int, max_seq_len: int | None = None) -> tuple[int, int]:
        """The (bucket, context class) a step of ``bs`` rows whose longest context is ``max_seq_len``
        replays (None: the longest class)."""
        padded = self.buckets[bisect.bisect_left(self.buckets, bs)]
        cls = len(self.context_limits) - 1
        if max_seq_len is not None:
            cls = next(i for i, lim in enumerate(self.context_limits) if lim is None or max_seq_len <= lim)
        return padded, cls

    def graph_for(self, bs: int, max_seq_len: int | None = None) -> torch.cuda.CUDAGraph:
        """The captured graph a step of ``bs`` rows replays: of ``max_seq_len``'s context class, or
        (None) of the last run's class (benchmarks replay the graph of the step they just ran)."""
        if max_seq_len is None and self.last_key is not None:
            return self.graphs[(self.key_for(bs)[0], self.last_key[1])]
        return self.graphs[self.key_for(bs, max_seq_len)]

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, into one shared memory pool."""
        if not self.capture_enabled:
            return
        self._reset_padding(self.max_bs)
        c = capture_buckets(self.keys(), self._forward_shared, self.device)
        self.graphs, self.logits, self.pool = c.graphs, c.outputs, c.pool
        self.capture_s, self.capture_bytes = c.seconds, c.reserved_bytes
        logger.info("decode CUDA graphs: %d buckets up to %d rows, %d context class(es), captured in %.2f s (%.0f MiB)",
                    len(self.buckets), self.max_bs, len(self.context_limits), c.seconds, c.reserved_bytes / 2**20)
        if self.stage_kernel:  # compile the copy-in now, not in the first request's step
            self._copy_in(self.input_ids[:1], self.positions[:1], self.slot_mapping[:1], self.seq_lens[:1],
                          self.block_tables[:1, :1], 1)
        torch.cuda.synchronize(self.device)

    def release(self) -> None:
        """Free every captured graph and its pool. Under tensor parallelism this must come
        before the process group's teardown: NCCL's communicator destroy waits forever while
        a graph holding its collectives is alive (pytorch/pytorch#115388; seen on two H200s)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        for g in self.graphs.values():
            g.reset()
        self.graphs, self.logits, self.pool = {}, {}, None

    def _reset_padding(self, upto: int) -> None:
        self.slot_mapping[:upto].fill_(-1)
        self.seq_lens[:upto].fill_(0)

    def can_run(self, num_seqs: int, decode_only: bool) -> bool:
        return decode_only and 0 < num_seqs <= self.max_bs

    @torch.inference_mode()
    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
        max_seq_len: int | None = None,
    ) -> torch.Tensor:
        """One decode step for bs sequences (one token each) -> logits [bs, V] (a view of
        the shared output buffer: read it, on the stream, before the next call). Inputs may be
        int64; the copy into the static buffers converts. ``max_seq_len``: the step's longest
        context (after this token), which picks the context class; None: the longest class."""
        bs = input_ids.shape[0]
        key = self.key_for(bs, max_seq_len)
        self._copy_in(input_ids, positions, slot_mapping, seq_lens, block_tables, key[0])
        self.last_key = key
        if key in self.graphs:
            self.graphs[key].replay()
            return self.logits[key][:bs]
        return self._forward_shared(key)[:bs]

    def _copy_in(self, input_ids, positions, slot_mapping, seq_lens, block_tables, padded: int) -> None:
        self._stage(input_ids, positions, slot_mapping, seq_lens, block_tables, self._static_inputs, padded)

    @torch.inference_mode()
    def eager_logits(self, bs: int) -> torch.Tensor:
        """The last ``run``'s step recomputed eagerly on the same static buffers, padded bucket
        and context class (a check of the graphs: a fresh [bs, V] tensor)."""
        key = self.key_for(bs) if self.last_key is None else (self.key_for(bs)[0], self.last_key[1])
        return self._forward(key)[:bs].clone()
