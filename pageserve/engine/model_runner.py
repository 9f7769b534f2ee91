"""Runs one engine step on the device: flatten the batch, one model forward, sample.

Per step the host builds every device input as numpy arrays (``prepare_inputs``), packs
them into one int64 buffer and copies it to the device once (pinned, non-blocking on
CUDA); nothing waits for the device: the sampled token ids come back through a copy the
caller reads when it needs them (so the engine can schedule and launch the next step
first). A CUDA graph runner can take over ``prepare_inputs``' output and copy it into
static buffers.
"""
from __future__ import annotations

import itertools
import logging
import time
import warnings
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np
import torch

from ..model.attention import AttentionMetadata, PagedAttention
from .config import AUTO_MAX_NUM_SEQS, EngineConfig
from ..model.decoder import Decoder
from ..model.ops import TorchOps
from .scheduler import ScheduledBatch

logger = logging.getLogger(__name__)

CPU_KV_CACHE_BYTES = 1 << 30  # the KV pool on the CPU when num_blocks is not given

# Eager steps' row buckets (EngineConfig.eager_row_buckets). On the H200, cuBLAS's first call at a
# row count it has not seen in the process cost the host 0.12-0.46 ms (its heuristic) and, for 30 of
# 75 new counts, 2.6-3.6 ms (a kernel loaded on first use), while the GPU waited
# (results/h200/diagnostics/gemm_first_call_24a080e.json); a chat-like workload meets a new token
# count nearly every eager step. Up to EAGER_ROWS_EXACT rows a step keeps its count (64 values, all
# warmed at start-up; the int8 kernels switch paths at 64 rows); above it the count rounds up to a
# multiple of 1/EAGER_ROWS_PER_OCTAVE of its power of two: at most 6.25% padding rows, 112 buckets
# from 65 to 8,192 (176 row counts in all). Off by default (EngineConfig.eager_row_buckets None: the ops
# decide, ``eager_row_buckets_for``): it did not make chat faster on the H200, whose eager steps are bound by
# the host's launch work (NOTES.md, session 17). On in the deterministic mode on CUDA, where each new row
# count would also cost a cuBLAS bit probe (model/deterministic_ops.py).
EAGER_ROWS_EXACT = 64
EAGER_ROWS_PER_OCTAVE = 16


def eager_rows_bucket(n: int) -> int:
    """The row count an eager step's matrices run at for ``n`` real rows (n itself up to
    ``EAGER_ROWS_EXACT``)."""
    if n <= EAGER_ROWS_EXACT:
        return n
    step = (1 << (n.bit_length() - 1)) // EAGER_ROWS_PER_OCTAVE
    return -(-n // step) * step


def eager_rows_buckets(max_rows: int) -> list[int]:
    """Every row count ``eager_rows_bucket`` gives for 1..max_rows real rows, ascending."""
    return sorted({eager_rows_bucket(n) for n in range(1, max_rows + 1)})


def pad_step_rows(x: "StepInputs") -> "StepInputs":
    """``x`` with its tokens padded to ``eager_rows_bucket`` of their count (id 0, position 0, slot
    -1: no KV written, no sequence reads them; attention zeroes their rows) and its sampling rows to
    ``eager_rows_bucket`` of theirs (repeats of the last one; the caller keeps the first S logits)."""
    T, S = x.num_tokens, x.logits_indices.shape[0]
    pad_t, pad_s = eager_rows_bucket(T) - T, (eager_rows_bucket(S) - S) if S else 0
    if not pad_t and not pad_s:
        return x
    zeros, none = np.zeros(pad_t, dtype=np.int64), np.full(pad_t, -1, dtype=np.int64)
    return replace(
        x, input_ids=np.concatenate([x.input_ids, zeros]), positions=np.concatenate([x.positions, zeros]),
        slot_mapping=np.concatenate([x.slot_mapping, none]),
        lora_slots=None if x.lora_slots is None else np.concatenate([x.lora_slots, none]),
        logits_indices=np.concatenate([x.logits_indices, np.full(pad_s, x.logits_indices[-1] if S else 0,
                                                                 dtype=np.int64)]),
    )


# int8 weights: programmatic dependent launch at one row only. From 2 to 8 rows the int8 GEMV runs
# tl.dot tiles, which under PDL made the graphed 3B step 4.09 ms at batch 2 and 4.15 at 8, against
# 3.57 and 3.61 with PDL at one row (batch 1 1.79-1.80 either way; H200,
# results/h200/diagnostics/det_b1_switches_0ef56d1.*); a TritonOps option given explicitly wins
INT8_PDL_MAX_ROWS = 1


def select_ops(use_triton: bool | None, device: torch.device, options: dict | None = None,
               deterministic: bool = False, quantization: str | None = None):
    """Triton kernels when asked (or by default on CUDA), else the PyTorch reference.
    ``options``: keywords of ``TritonOps`` (its fusion switches). ``deterministic``: the
    batch-invariant variant of either (``model.deterministic_ops``). ``quantization`` "int8":
    ``INT8_PDL_MAX_ROWS`` unless ``options`` sets ``pdl_max_rows``."""
    want = use_triton if use_triton is not None else device.type == "cuda"
    if quantization == "int8" and not deterministic:
        options = {"pdl_max_rows": INT8_PDL_MAX_ROWS, **(options or {})}
    if deterministic:
        from ..model.deterministic_ops import DeterministicOps, DeterministicTorchOps

        if not want:
            return DeterministicTorchOps()
        try:
            return DeterministicOps(**(options or {}))
        except (TypeError, ValueError) as e:
            raise ValueError(f"triton_options {options!r}: {e}") from None
    if want:
        try:
            from ..model.triton_ops import TritonOps
        except Exception as e:  # a missing or broken kernels package must not stop the engine
            warnings.warn(f"Triton ops unavailable ({type(e).__name__}: {e}); using the PyTorch reference ops")
            return TorchOps()
        try:
            return TritonOps(**(options or {}))
        except (TypeError, ValueError) as e:
            raise ValueError(f"triton_options {options!r}: {e}") from None
    return TorchOps()


# prompt-logprob rows scored per head launch (``ModelRunner._land_prompt_logprobs``)
PROMPT_LOGPROBS_ROWS = 512


@dataclass
class StepInputs:
    """A step's flattened batch as host arrays (T tokens of B sequences, S of which sample)."""

    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64
    query_start_loc: np.ndarray  # [B+1] int64
    seq_lens: np.ndarray  # [B] int64, context length after this step
    block_tables: np.ndarray  # [B, max_blocks] int64
    logits_indices: np.ndarray  # [S] int64, row of each sampling sequence's last token
    max_query_len: int
    max_seq_len: int
    # tokens not yet on the host (async scheduling): input_ids[fill_rows[i]] is the previous
    # step's sampled token fill_src[i]; input_ids holds 0 there until the device fills it
    fill_rows: np.ndarray | None = None  # [F] int64
    fill_src: np.ndarray | None = None  # [F] int64
    lora_slots: np.ndarray | None = None  # [T] int64: each token's LoRA slot (-1: none); None without LoRA

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


PART_ALIGN = 2  # int64 elements: 16 bytes


def aligned_concat(parts: list[np.ndarray]) -> tuple[np.ndarray, list[int]]:
    """``parts`` (int64) in one array, each starting at a multiple of ``PART_ALIGN`` elements
    (zeros between them), and where each starts. A step's device inputs are views into one
    buffer; were they packed back to back, a part's address would follow the previous parts'
    lengths, and Triton, which specialises a kernel on whether each pointer is 16-byte aligned,
    would compile a new variant mid-run whenever a step's token count changed parity (seen on
    the H200: the nano-vllm workload's first odd-length steps compiled `_rope_kv_kernel` again)."""
    offsets, n = [], 0
    for p in parts:
        offsets.append(n)
        n += -(-p.size // PART_ALIGN) * PART_ALIGN
    flat = np.zeros(n, dtype=np.int64)
    for o, p in zip(offsets, parts):
        flat[o:o + p.size] = p.reshape(-1)
    return flat, offsets


@dataclass
class DeviceInputs:
    """A step's inputs on the device: int64 views into one buffer copied in one go."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T]
    query_start_loc: torch.Tensor  # [B+1]
    seq_lens: torch.Tensor  # [B]
    logits_indices: torch.Tensor  # [S]
    block_tables: torch.Tensor  # [B, max_blocks]
    host: StepInputs
    fill_rows: torch.Tensor  # [F]: rows of input_ids that take a token sampled by the previous step
    fill_src: torch.Tensor  # [F]: which of that step's sampled tokens
    lora_slots: torch.Tensor | None = None  # [T]: each token's LoRA slot; None without LoRA

    def metadata(self) -> AttentionMetadata:
        """Attention metadata for an eager forward (the kernels take int32 lengths/tables)."""
        x = self.host
        return AttentionMetadata(
            slot_mapping=self.slot_mapping,
            query_start_loc=self.query_start_loc.to(torch.int32),
            seq_lens=self.seq_lens.to(torch.int32),
            block_tables=self.block_tables.to(torch.int32),
            max_query_len=x.max_query_len,
            max_seq_len=x.max_seq_len,
            query_start_loc_cpu=x.query_start_loc.tolist(),
            seq_lens_cpu=x.seq_lens.tolist(),
        )


class ModelRunner:
    """Owns the model, the paged KV cache, the ops choice and the sampler."""

    def __init__(self, model: Decoder, config: EngineConfig, sampler=None, eos_token_ids=()) -> None:
        self.model = model
        self.config = config
        self.cfg = model.cfg
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.block_size = config.block_size
        self.ops = select_ops(config.use_triton, self.device, config.triton_options, config.deterministic,
                              config.quantization)
        model.set_ops(self.ops)
        model.eval()
        # LoRA adapters' device slots (before the KV pool takes the free memory, and before graphs are captured)
        self.lora = self._make_lora() if config.enable_lora else None
        if self.lora is None:
            model.set_lora(None)  # a model an earlier engine served adapters from serves none here
        self.num_blocks = config.num_blocks or self._num_blocks_from_memory()
        config.resolve_max_num_seqs(self.num_blocks * self.block_size)  # None: sized from the pool
        cfg = self.cfg
        # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        self.kv_cache = torch.zeros(
            cfg.num_layers, 2, self.num_blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim,
            dtype=self.dtype, device=self.device,
        )
        if sampler is None:
            from .sampler import Sampler

            sampler = Sampler(cfg.vocab_size, self.device, eos_token_ids=eos_token_ids, seed=config.seed)
        self.sampler = sampler
        bucket = config.eager_row_buckets
        self.eager_row_buckets = self.ops.eager_row_buckets_for(self.device) if bucket is None else bucket
        self.eager_warm_s = None  # seconds warm_eager_gemms took at start-up
        if self.eager_row_buckets and self.device.type == "cuda":
            self.eager_warm_s = self.warm_eager_gemms()
        if self.device.type == "cuda" and config.tensor_parallel_size == 1:
            self.ops.warm_chunk_attention(self.kv_cache[0, 0], self.kv_cache[0, 1], cfg.num_heads)
        if self.device.type == "cuda":
            self.ops.warm_gate_up_silu(self.model.layers[0].mlp.gate_up_proj.weight)
        self._pinned: torch.Tensor | None = None  # host staging buffer for the per-step copy
        self._copy_done: torch.cuda.Event | None = None
        self.graphs = None  # CUDAGraphRunner for decode-only steps
        # set by the engine once a request asks for prompt logprobs: until then no step looks for their rows
        self.prompt_logprobs_asked = False
        # set by the engine at its first structured-output request (a GrammarCompiler): the masks' source
        self.grammar = None
        self.mixed_graphs = None  # MixedGraphRunner for mixed / prefill steps (config.mixed_cuda_graphs)
        if self.device.type == "cuda" and not config.enforce_eager:
            if getattr(self.ops, "graph_safe", False):
                try:
                    self.enable_graphs()
                except Exception:  # a capture failure costs speed, never the engine
                    logger.exception("CUDA graph capture failed; decode steps run eagerly")
                    self.graphs = None
            else:
                logger.warning("CUDA graphs need the Triton ops (the reference ops sync the host); running eagerly")
            if config.mixed_cuda_graphs and self.mixed_graphs_supported():
                try:
                    self.enable_mixed_graphs()
                except Exception:  # a capture failure costs speed, never the engine
                    logger.exception("mixed-step CUDA graph capture failed; mixed steps run eagerly")
                    self.mixed_graphs = None
        if getattr(self.ops, "probe_blocking", False):
            # the graphs are captured (their warm-up runs waited for their probes): from here on, a step that
            # meets a new (shape, rows) queues its cuBLAS probe instead of syncing on it (DeterministicOps)
            self.ops.probe_blocking = False

    def _make_lora(self):
        """The LoRA slots on the model, sized for the largest forward a step can run, and their manager."""
        from ..model.lora import LoRASlots
        from .lora import LoRAManager

        c = self.config
        rows = eager_rows_bucket(max(c.max_num_batched_tokens, c.max_num_seqs or AUTO_MAX_NUM_SEQS, c.cuda_graph_max_bs))
        slots = LoRASlots(self.cfg, c.max_loras, c.max_lora_rank, rows, self.dtype, self.device)
        self.model.set_lora(slots)
        return LoRAManager(slots, self.cfg)

    # ------------------------------------------------------------------ CUDA graphs
    def max_blocks_per_seq(self) -> int:
        max_len = min(self.config.max_model_len or self.cfg.max_position_embeddings, self.model.max_positions)
        return -(-max_len // self.block_size)

    def enable_graphs(self, capture: bool | None = None) -> None:
        """Build the decode graph runner and capture its buckets (``capture=False``: same
        static buffers and padding, run eagerly: the CPU check of the bookkeeping)."""
        from .cuda_graphs import CUDAGraphRunner

        max_bs = min(self.config.cuda_graph_max_bs, self.config.max_num_seqs)
        self.graphs = CUDAGraphRunner(self.model, self.kv_cache, max_bs, self.max_blocks_per_seq(), capture=capture,
                                      sizes=self.config.cuda_graph_sizes)
        self.graphs.capture()

    @torch.inference_mode()
    def warm_eager_gemms(self) -> float:
        """Call each decoder linear (layer 0's: every layer has the same shapes) at every row bucket
        an eager step can take, and the output head at every bucket of sampling rows, so that no
        step pays cuBLAS's first call at a row count (``eager_rows_bucket``). Returns its seconds
        (1.6-2.7 s measured on the H200 at the Qwen2.5-3B shape)."""
        t0 = time.perf_counter()
        layer, c = self.model.layers[0], self.config
        projs = [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
        rows = eager_rows_buckets(c.max_num_batched_tokens)
        for proj in projs:
            x = torch.zeros(rows[-1], proj.weight.shape[1], dtype=self.dtype, device=self.device)
            for m in rows:
                self.ops.linear(x[:m], proj.weight, proj.bias)
        # the deterministic ops' paired gate_up + SiLU·mul kernel, probed per row count as cuBLAS is
        # (``DeterministicOps.paired_rows``): the MLP's call at each bucket in its range
        paired = getattr(self.ops, "paired_rows", None)
        if paired is not None:
            w = layer.mlp.gate_up_proj.weight
            x = torch.zeros(rows[-1], w.shape[1], dtype=self.dtype, device=self.device)
            for m in rows:
                if paired[0] <= m <= paired[1]:
                    self.ops.gate_up_silu_mul(x[:m], w)
        # the head's local product only (a tensor-parallel shard's compute_logits also gathers)
        head = self.model.embed_tokens.weight if self.model.lm_head is None else self.model.lm_head.weight
        x = torch.zeros(rows[-1], head.shape[1], dtype=self.dtype, device=self.device)
        for m in eager_rows_buckets(min(c.max_num_seqs, c.max_num_batched_tokens)):
            self.ops.linear(x[:m], head, None)
        del x
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - t0
        logger.info("eager row buckets: %d, GEMMs warmed in %.2f s", len(rows), seconds)
        return seconds

    def mixed_graphs_supported(self) -> bool:
        """The Triton ops on one GPU, int8 weights included (not a shard). Int8 had them off until session 25,
        whose serving record found its mixed steps eager (08_serving_int8_a2e8d86: TPOT p50 11.1 ms at 32 req/s
        against bf16's 3.4). The deterministic ops where their ``mixed_graphs`` is on (the default since a GPU
        checked their graphed mixed steps' bits, session 49: ``DeterministicOps.mixed_graphs``)."""
        ops_ok = self.ops.name == "triton" or getattr(self.ops, "mixed_graphs", False)
        return ops_ok and self.config.tensor_parallel_size == 1

    def enable_mixed_graphs(self, capture: bool | None = None) -> None:
        """Build the mixed-step graph runner and capture its buckets (``capture=False``: the same
        static buffers, run eagerly: the CPU check of the bookkeeping)."""
        from ..kernels.paged_prefill import prefill_block_m
        from .mixed_graphs import MixedGraphRunner

        c, cfg = self.config, self.cfg
        group = cfg.num_heads // cfg.num_kv_heads
        heavy_first = getattr(self.ops, "prefill_tile_order", "heavy_first") == "heavy_first"
        maps = self.ops.mixed_tile_maps(group, self.device) if hasattr(self.ops, "mixed_tile_maps") else None
        self.mixed_graphs = MixedGraphRunner(
            self.model, self.kv_cache, min(c.mixed_graph_max_tokens, c.max_num_batched_tokens), c.max_num_seqs,
            self.max_blocks_per_seq(), prefill_block_m(group) // group, heavy_first, capture=capture, maps=maps)
        self.mixed_graphs.capture()

    # ------------------------------------------------------------------ KV pool size
    @property
    def bytes_per_block(self) -> int:
        cfg = self.cfg
        elsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * cfg.num_layers * self.block_size * cfg.num_kv_heads * cfg.head_dim * elsize

    def activation_margin_bytes(self) -> int:
        """A generous bound on the memory one step needs beyond weights and KV cache."""
        cfg, c = self.cfg, self.config
        elsize = torch.empty((), dtype=self.dtype).element_size()
        T = c.max_num_batched_tokens
        per_token = 4 * cfg.hidden_size + 3 * cfg.intermediate_size + 2 * (cfg.q_size + 2 * cfg.kv_size)
        acts = 2 * T * per_token * elsize
        seqs = c.max_num_seqs or AUTO_MAX_NUM_SEQS  # None is resolved after the pool is sized: assume the cap
        logits = 4 * min(seqs, T) * cfg.vocab_size * 4  # fp32 logits + sampler temporaries
        return acts + logits + (512 << 20)

    def _num_blocks_from_memory(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(total * self.config.gpu_memory_utilization) - (total - free) - self.activation_margin_bytes()
            where = (
                f"{free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB, "
                f"gpu_memory_utilization={self.config.gpu_memory_utilization}"
            )
        else:
            budget, where = CPU_KV_CACHE_BYTES, "the fixed CPU budget"
        n = budget // self.bytes_per_block
        if n < 1:
            raise ValueError(
                f"no memory left for the KV cache ({where}); raise gpu_memory_utilization, "
                f"lower max_num_batched_tokens, or pass num_blocks"
            )
        logger.info("KV cache: %d blocks of %d tokens from %s", n, self.block_size, where)
        return int(n)

    # ------------------------------------------------------------------ the step
    def prepare_inputs(self, batch: ScheduledBatch) -> StepInputs:
        """Flatten ``batch`` into host arrays: O(B) Python work plus list slicing for prompt chunks."""
        seqs = batch.seqs
        B = len(seqs)
        bs = self.block_size
        n = np.asarray(batch.num_new_tokens, dtype=np.int64)  # [B]
        starts = np.fromiter((s.num_computed_tokens for s in seqs), dtype=np.int64, count=B)
        cu = np.zeros(B + 1, dtype=np.int64)
        np.cumsum(n, out=cu[1:])
        T = int(cu[-1])

        fill_rows: list[int] = []
        fill_src: list[int] = []
        if T == B:  # every sequence computes one token (decodes): its token at num_computed
            ids = []
            for r, s in enumerate(seqs):
                i = s.num_computed_tokens
                if i < s.num_known_tokens:
                    ids.append(s.token_at(i))
                else:  # the token the previous step sampled for it: filled on the device
                    ids.append(0)
                    fill_rows.append(r)
                    fill_src.append(s.pending_row)
        else:
            ids = []
            for s, k, spec in zip(seqs, batch.num_new_tokens, batch.spec):
                st = s.num_computed_tokens
                known = s.num_known_tokens
                if spec:  # its newest token, then its drafts (engine/speculative.py)
                    if k != spec + 1 or st != known - 1:
                        raise RuntimeError(f"{s!r}: {k} tokens from {st} scheduled with {spec} drafts, {known} known")
                    ids.append(s.token_at(st))
                    ids.extend(s.spec_token_ids[:spec])
                    continue
                if st + k > known:  # only a decode's one token can be pending
                    if k != 1 or st != known:
                        raise RuntimeError(f"{s!r}: {k} tokens from {st} scheduled, {known} known")
                    fill_rows.append(len(ids))
                    fill_src.append(s.pending_row)
                    ids.append(0)
                else:
                    ids.extend(s.token_slice(st, st + k))
        input_ids = np.asarray(ids, dtype=np.int64)

        positions = np.arange(T, dtype=np.int64) + np.repeat(starts - cu[:-1], n)
        seq_lens = starts + n

        nblocks = np.fromiter((len(s.block_table) for s in seqs), dtype=np.int64, count=B)
        max_blocks = int(nblocks.max())
        flat = np.fromiter(
            itertools.chain.from_iterable(s.block_table for s in seqs), dtype=np.int64, count=int(nblocks.sum())
        )
        block_tables = np.zeros((B, max_blocks), dtype=np.int64)
        block_tables[np.arange(max_blocks)[None, :] < nblocks[:, None]] = flat

        seq_idx = np.repeat(np.arange(B), n)
        slot_mapping = block_tables[seq_idx, positions // bs] * bs + positions % bs
        sampling = np.asarray(batch.samples, dtype=bool)
        logits_indices = cu[1:][sampling] - 1
        if batch.num_spec_tokens:  # a sequence with d drafts samples at its last d + 1 tokens
            d = np.asarray(batch.spec, dtype=np.int64)[sampling]
            rows = d + 1
            first = np.repeat(logits_indices - d, rows)
            logits_indices = first + np.arange(int(rows.sum())) - np.repeat(np.cumsum(rows) - rows, rows)
        fills = (np.asarray(fill_rows, dtype=np.int64), np.asarray(fill_src, dtype=np.int64)) if fill_rows else (None, None)
        # each token's LoRA slot (the adapters of this step's sequences are put in slots here)
        lora_slots = None if self.lora is None else np.repeat(self.lora.assign([s.lora_id for s in seqs]), n)
        return StepInputs(
            input_ids, positions, slot_mapping, cu, seq_lens, block_tables, logits_indices,
            max_query_len=int(n.max()), max_seq_len=int(seq_lens.max()), fill_rows=fills[0], fill_src=fills[1],
            lora_slots=lora_slots,
        )

    def to_device(self, x: StepInputs) -> "DeviceInputs":
        """One host->device copy of every per-step input (int64, sliced on the device)."""
        B = x.seq_lens.shape[0]
        F = 0 if x.fill_rows is None else x.fill_rows.shape[0]
        parts = [x.input_ids, x.positions, x.slot_mapping, x.query_start_loc, x.seq_lens, x.logits_indices,
                 x.block_tables.reshape(-1)]
        if F:
            parts += [x.fill_rows, x.fill_src]
        if x.lora_slots is not None:
            parts.append(x.lora_slots)
        flat, offsets = aligned_concat(parts)
        host = torch.from_numpy(flat)
        if self.device.type == "cuda":
            if self._pinned is None or self._pinned.numel() < host.numel():
                if self._copy_done is not None:
                    self._copy_done.synchronize()
                self._pinned = torch.empty(max(host.numel(), 1 << 16) * 2, dtype=torch.int64, pin_memory=True)
                self._copy_done = torch.cuda.Event()
            elif self._copy_done is not None:
                self._copy_done.synchronize()  # the previous step's copy has left the staging buffer
            staged = self._pinned[: host.numel()]
            staged.copy_(host)
            dev = staged.to(self.device, non_blocking=True)
            self._copy_done.record()
        else:
            dev = host
        views = [dev[o:o + p.size] for o, p in zip(offsets, parts)]
        ids, pos, slots, qsl, lens, li, bt = views[:7]
        fill_rows, fill_src = views[7:9] if F else (dev[:0], dev[:0])
        lora_slots = views[-1] if x.lora_slots is not None else None
        return DeviceInputs(ids, pos, slots, qsl, lens, li, bt.view(B, -1), x, fill_rows, fill_src, lora_slots)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, prev_tokens: torch.Tensor | None = None,
                before_sampling: Callable[[], None] | None = None):
        """Run the model once over every scheduled token; sample for the sequences whose
        chunk reaches their last token. Returns a ``SamplerOutput`` (rows in batch order of
        the sampling sequences), or None when no sequence samples this step.
        ``before_sampling``: called once the forward is launched and before the sampling is
        (not at all when nothing samples): the engine lands the previous step there when a
        row's sampling reads what that step's tokens change on the host (bad words, a grammar).

        ``prev_tokens``: the previous step's sampled tokens on the device, when that step's
        values have not reached the host yet (async scheduling); a sequence decoding from
        such a token reads it from there (``Sequence.pending_row``). Nothing here waits
        for the device: the returned output reads its tokens when asked."""
        x = self.prepare_inputs(batch)
        prompt_rows = self._prompt_logprob_rows(batch, x) if self.prompt_logprobs_asked else None
        if prompt_rows is None:
            logits = self.run_step(x, prev_tokens)
        else:
            logits, prompt_hidden = self.run_step(x, prev_tokens, prompt_rows[0])
            self._land_prompt_logprobs(prompt_hidden, *prompt_rows[1:])
        if logits is None:
            return None
        seqs = [s for s, smp in zip(batch.seqs, batch.samples) if smp]
        if batch.num_spec_tokens:
            return self._sample_speculative(logits, batch, seqs)
        num_outputs = [s.num_output_tokens for s in seqs]
        if before_sampling is not None:
            before_sampling()
        # guided rows' masks: built on the host while the device runs the forward launched above
        masks = None if self.grammar is None else self.grammar.step_masks([s.matcher for s in seqs])
        penalised = any(s.params.has_penalties for s in seqs)
        # a penalised row's newest output may still be on the device only (async scheduling): the penalties
        # read it from the previous step's sampled ids (a landed step leaves no sequence pending)
        pending = None
        if penalised and prev_tokens is not None and any(s.num_pending for s in seqs):
            pending = (prev_tokens, [s.pending_row if s.num_pending else -1 for s in seqs])
        return self.sampler.sample(
            logits,
            [s.params for s in seqs],
            [s.prompt_token_ids for s in seqs],
            [s.output_token_ids for s in seqs],
            [s.seed for s in seqs],
            num_outputs,
            masks,
            [s.token_history() for s in seqs] if penalised else None,
            pending,
        )

    def _sample_speculative(self, logits: torch.Tensor, batch: ScheduledBatch, seqs: list):
        """Sample a step with drafts: a sequence with d drafts has d + 1 rows, row j sampled as plain decoding
        would sample its output step ``num_outputs + j`` after the first j drafts (engine/speculative.py).
        Speculation runs synchronously, so no row waits for a landing or reads a pending token; a penalised row j
        counts its output with the first j drafts (``DraftHistory``), a guided row j takes its grammar's mask after
        them."""
        spec = [d for d, smp in zip(batch.spec, batch.samples) if smp]
        params, prompts, outputs, seeds, num_outputs, matchers = [], [], [], [], [], []
        for s, d in zip(seqs, spec):
            p, n_out = s.params, s.num_output_tokens
            for j in range(d + 1):
                params.append(p)
                prompts.append(s.prompt_token_ids)
                # bad words match the end of the output as it would be with the first j drafts accepted
                outputs.append(s.output_token_ids + s.spec_token_ids[:j] if j and p.bad_words else s.output_token_ids)
                seeds.append(s.seed)
                num_outputs.append(n_out + j)
                m = s.matcher
                if m is not None and j:  # the grammar's state after the first j drafts (they passed validate_tokens)
                    m = m.deep_copy()
                    m.consume_tokens(s.spec_token_ids[:j])
                matchers.append(m)
        masks = None if self.grammar is None else self.grammar.step_masks(matchers)
        penalised = any(s.params.has_penalties for s in seqs)
        histories = None
        if penalised:
            from .speculative import DraftHistory

            histories = []
            for s, d in zip(seqs, spec):
                h = s.token_history()
                histories += [h] + [DraftHistory(h, s.spec_token_ids[:j]) for j in range(1, d + 1)]
        return self.sampler.sample(logits, params, prompts, outputs, seeds, num_outputs, masks, histories, None)

    @staticmethod
    def _prompt_logprob_rows(batch: ScheduledBatch, x: StepInputs):
        """For the sequences asking for prompt logprobs (``SamplingParams.prompt_logprobs``): the step's
        rows whose next token is a prompt token not yet scored, as (rows [R], targets [R], and per row its
        sequence and the position it scores); None when there are none (every other step)."""
        rows, targets, owners = [], [], []
        for i, seq in enumerate(batch.seqs):
            if seq.params.prompt_logprobs is None:
                continue
            for row in range(int(x.query_start_loc[i]), int(x.query_start_loc[i + 1])):
                nxt = int(x.positions[row]) + 1  # the position this row's logits score
                if nxt < seq.num_prompt_tokens and nxt not in seq.prompt_logprobs:  # once, even if recomputed
                    rows.append(row)
                    targets.append(seq.prompt_token_ids[nxt])
                    owners.append((seq, nxt))
        if not rows:
            return None
        return np.asarray(rows, dtype=np.int64), targets, owners

    def _land_prompt_logprobs(self, hidden: torch.Tensor, targets: list[int], owners: list) -> None:
        """Score the prompt tokens from their rows' final hidden states [R, H], ``PROMPT_LOGPROBS_ROWS``
        rows at a time (a chunk's [R, V] fp32 log-probabilities at once would be ~5 GB at 8k rows and the 3B
        vocabulary), and land them on the host (a sync, on the rare steps that have them)."""
        k = max(seq.params.prompt_logprobs for seq, _ in owners)
        tgt = torch.as_tensor(targets, device=hidden.device)
        # per slice on the device: [rows, 1 + k] of the target's logprob then the top k, and the top ids
        lps, ids = [], []
        for r0 in range(0, hidden.shape[0], PROMPT_LOGPROBS_ROWS):
            lp = torch.log_softmax(self.model.head_logits(hidden[r0:r0 + PROMPT_LOGPROBS_ROWS]).float(), dim=-1)
            top = lp.topk(k, dim=-1)
            lps.append(torch.cat([lp.gather(1, tgt[r0:r0 + PROMPT_LOGPROBS_ROWS, None]), top.values], dim=1))
            ids.append(top.indices)
        lps, ids = torch.cat(lps).tolist(), torch.cat(ids).tolist()  # the one sync
        for r, (seq, pos) in enumerate(owners):
            entry = {targets[r]: lps[r][0]}
            for t, v in zip(ids[r][:seq.params.prompt_logprobs], lps[r][1:]):
                entry.setdefault(t, v)
            seq.prompt_logprobs[pos] = entry

    @torch.inference_mode()
    def run_step(self, x: StepInputs, prev_tokens: torch.Tensor | None = None,
                 prompt_rows: np.ndarray | None = None):
        """The step's forward from its host inputs: logits [S, V] of the sampling rows (the model's dtype),
        or None when no row samples. With ``prompt_rows`` (rows whose logits score a prompt token,
        ``_prompt_logprob_rows``): (those logits, the final hidden states of ``prompt_rows`` [R, H]). (Under tensor
        parallelism every rank runs this with the same ``x``; see ``tensor_parallel.py``.)"""
        B, T, S = x.seq_lens.shape[0], x.num_tokens, x.logits_indices.shape[0]
        # one token per sequence and every one samples (not so when a prompt's chunk is a single
        # token short of its end): the graph ends with the output head over all B rows
        # (a step with prompt rows never is: such a row's chunk does not reach its prompt's end, so S < B)
        graphed = self.graphs is not None and x.max_query_len == 1 and S == B and self.graphs.can_run(B, T == B)
        if not graphed and self.eager_row_buckets and x.max_query_len > 1:
            x = pad_step_rows(x)  # T and S stay the real counts
        d = self.to_device(x)
        input_ids = self.step_input_ids(x, d, prev_tokens)
        if d.lora_slots is not None:  # before the forward or replay reads them
            self.lora.slots.set_token_slots(d.lora_slots)
        if graphed:
            return self.graphs.run(input_ids, d.positions, d.slot_mapping, d.seq_lens, d.block_tables, x.max_seq_len)
        if self.mixed_graphs is not None and x.max_query_len > 1 and self.mixed_graphs.can_run(x.num_tokens, B):
            hidden = self.mixed_graphs.run(x, d, input_ids)
        else:
            hidden = self.model(input_ids, d.positions, PagedAttention(self.kv_cache, d.metadata(), self.ops))
        if prompt_rows is not None:  # their hidden states (a copy: a mixed graph's output buffer is reused)
            return self._sampled_logits(hidden, d, S, T), hidden[torch.from_numpy(prompt_rows).to(hidden.device)]
        return self._sampled_logits(hidden, d, S, T)

    def _sampled_logits(self, hidden: torch.Tensor, d: "DeviceInputs", S: int, T: int) -> torch.Tensor | None:
        if S == 0:
            return None
        if S < T:
            hidden = hidden[d.logits_indices]  # [S, H] (padded: the sampling rows' bucket)
        return self.model.head_logits(hidden)[:S]  # [S, V]

    def step_input_ids(self, x: StepInputs, d: DeviceInputs, prev_tokens: torch.Tensor | None) -> torch.Tensor:
        """The step's input ids on the device: tokens the previous step sampled (async
        scheduling) are taken from ``prev_tokens``."""
        input_ids = d.input_ids
        if x.fill_rows is not None:
            if prev_tokens is None:
                raise RuntimeError("a scheduled token is still pending but no previous step's tokens were given")
            F, B = x.fill_rows.shape[0], x.seq_lens.shape[0]
            if F == B == x.num_tokens == prev_tokens.shape[0] and (x.fill_rows == x.fill_src).all() and x.fill_rows[-1] == F - 1:
                input_ids = prev_tokens  # steady decode: the same rows in the same order, no gather
            else:
                input_ids[d.fill_rows] = prev_tokens[d.fill_src]
        return input_ids
