"""The engine's knobs: a dataclass that validates itself; notebook parameters and CLI
flags map one-to-one onto its fields."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


@dataclass
class EngineConfig:
    """Knobs of the paged engine. Every field is a keyword of ``LLM(...)``."""

    model: str = "smollm2-135m-instruct"
    # where a request's unset sampling fields come from, as vLLM's --generation-config: "auto" reads
    # the model folder's generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty,
    # max_new_tokens as max_tokens; a GGUF file or random weights have none); "none" (or "vllm") uses
    # pageserve's own (temperature 1, no truncation or penalty); a folder path reads that folder's
    # generation_config.json, and its max_new_tokens is then also every server request's upper limit.
    # A field the request sets keeps its value; LLM.generate uses them only with no sampling params
    generation_config: str = "auto"
    device: str = "auto"  # auto: cuda when available, else cpu
    dtype: str = "auto"
    seed: int = 0
    block_size: int = 16
    num_blocks: int | None = None  # None: sized from gpu_memory_utilization (or 1 GiB on the CPU)
    gpu_memory_utilization: float = 0.85
    # None: sized from the KV pool once it is allocated (auto_max_num_seqs): 512 on an H200 at
    # the Qwen2.5-3B shape, 256 on a 16 GB T4, 32 in the CPU's 1 GiB pool
    max_num_seqs: int | None = None
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    # on, as in vLLM v1: with fresh prompts (no hits) it cost W1 -0.12% and nano-vllm +0.02% on the H200
    # (results/h200/diagnostics/w1_defaults_prefix_caching_cbbf3ae.*, two alternating pairs)
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # "fcfs": requests run in arrival order; "priority": by each request's priority (lower first, then
    # arrival), the least urgent preempted first, as vLLM's --scheduling-policy (engine/scheduler.py)
    scheduling_policy: str = "fcfs"
    enforce_eager: bool = False  # True: no CUDA graphs
    use_triton: bool | None = None  # None: Triton kernels on CUDA, PyTorch reference on the CPU
    triton_options: dict = field(default_factory=dict)  # keywords of pageserve.model.triton_ops.TritonOps (fusion switches)
    cuda_graph_max_bs: int = 512
    # the decode batch sizes captured as CUDA graphs (a step pads to the next one; larger ones run
    # eagerly). None: 1, 2, 4, 8, 16, 32, 48, steps of 32 to 256, of 64 above, up to
    # min(cuda_graph_max_bs, max_num_seqs) (engine.cuda_graphs.bucket_sizes)
    cuda_graph_sizes: list[int] | None = None
    # eager (prefill / mixed) steps over 64 tokens run their matrices at a bucketed row count (a
    # multiple of 1/16 of the count's power of two; padding rows write no KV), and the engine calls
    # each bucket's GEMMs once at start-up: cuBLAS's first call at a new row count costs the host
    # 0.2-4 ms (a heuristic query, often a kernel load). None (default): the ops decide
    # (``eager_row_buckets_for``): off in the default mode, where on the H200 it did not make the chat
    # workload faster (NOTES.md, session 17: its eager steps are bound by launch work); on in the
    # deterministic mode on CUDA, where a new row count also costs a cuBLAS bit probe.
    # True / False: always / never. model_runner.eager_rows_bucket
    eager_row_buckets: bool | None = None
    # mixed and prefill steps of up to mixed_graph_max_tokens tokens replayed from CUDA graphs (one
    # a token bucket; engine/mixed_graphs.py): their eager forward is bound by the host's launch
    # work. On the H200 a 640-token mixed step went from 19.1 to 8.1 ms of wall time (NOTES.md,
    # session 18). The Triton path only (not deterministic or tensor parallel; int8 since session 25);
    # off with enforce_eager
    mixed_cuda_graphs: bool = True
    mixed_graph_max_tokens: int = 2048
    # launch step N+1 before reading step N's tokens (the host's work overlaps the device's);
    # False: every step is postprocessed before step() returns
    async_scheduling: bool = True
    # ranks the model is split over (heads, MLP width, vocabulary); > 1 starts worker processes
    tensor_parallel_size: int = 1
    # True: every all-reduce through NCCL; False: small ones (decode) through the one-shot
    # all-reduce over CUDA IPC buffers when the GPUs have peer access (pageserve.model.custom_allreduce)
    disable_custom_all_reduce: bool = False
    # weight-only quantization of the decoder's linears at load time: None (the model dtype) or
    # "int8" (per-output-channel int8 weights, model-dtype scales; pageserve.model.quant)
    quantization: str | None = None
    # batch-invariant kernels: a sequence's logits are bitwise the same alone or batched, in one
    # prefill chunk or several, from a prefix hit or not, graphed or eager (pageserve.model.deterministic_ops)
    deterministic: bool = False
    # speculative decoding, as vLLM's --speculative-config: None (off) or {"method": "ngram",
    # "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2, "disable_by_batch_size": None}
    # (engine/speculative.py). Steps then run synchronously (async_scheduling is turned off)
    speculative_config: dict | None = None
    # LoRA adapters, as vLLM's --enable-lora / --max-loras / --max-lora-rank: requests may name a PEFT adapter
    # (engine/lora.py), up to max_loras distinct ones in a step, each of rank <= max_lora_rank. Every forward
    # then runs the projections unfused, with each row's adapter added (model/lora.py)
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if (self.max_num_seqs is not None and self.max_num_seqs <= 0) or self.max_num_batched_tokens <= 0:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        if self.mixed_graph_max_tokens <= 0:
            raise ValueError(f"mixed_graph_max_tokens must be positive, got {self.mixed_graph_max_tokens}")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {self.tensor_parallel_size!r}")
        if self.cuda_graph_sizes is not None:
            sizes = self.cuda_graph_sizes
            if not isinstance(sizes, (list, tuple)) or not sizes \
                    or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in sizes):
                raise ValueError(f"cuda_graph_sizes must be a non-empty list of positive ints, got {sizes!r}")
            self.cuda_graph_sizes = sorted(set(sizes))
        if self.generation_config not in ("auto", "none", "vllm"):
            rule = "generation_config must be 'auto', 'none' (alias 'vllm') or a folder holding generation_config.json"
            if not isinstance(self.generation_config, str):
                raise ValueError(f"{rule}, got {self.generation_config!r}")
            gen_file = Path(self.generation_config).expanduser() / "generation_config.json"
            if not gen_file.is_file():
                raise ValueError(f"{rule}, got {self.generation_config!r} (there is no {gen_file})")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {self.num_blocks}")
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        from ..model.config import resolve_dtype
        from ..model.loader import resolve_device

        resolve_device(self.device)  # ValueError for a device this torch cannot use (cuda on a CPU-only build)
        if not isinstance(self.dtype, torch.dtype):
            resolve_dtype(self.dtype, "cpu")  # ValueError for an unknown dtype name
        from ..model.quant import check_quantization

        check_quantization(self.quantization)  # ValueError for anything but None / "int8"
        if self.quantization is not None and self.tensor_parallel_size > 1:
            raise ValueError("quantization and tensor_parallel_size > 1 together are not supported yet: "
                             "the shards are cut from float weights; use one of the two")
        if self.deterministic and self.quantization is not None:
            raise ValueError("deterministic=True with quantization is not supported: the int8 kernels split by batch size")
        if self.deterministic and self.tensor_parallel_size > 1:
            raise ValueError("deterministic=True with tensor_parallel_size > 1 is not supported: "
                             "the all-reduce's algorithm (and so its rounding) changes with the message size")
        from .speculative import SpeculativeConfig

        SpeculativeConfig.parse(self.speculative_config)  # ValueError for a malformed one
        if self.speculative_config is not None:
            if self.tensor_parallel_size > 1:
                raise ValueError("speculative_config with tensor_parallel_size > 1 is not supported yet")
            if self.async_scheduling:
                logger.info("speculative decoding: steps run synchronously (async_scheduling off), since a "
                            "step's drafts are looked up from tokens the host must already have")
                self.async_scheduling = False
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.enable_lora and self.tensor_parallel_size > 1:
            raise ValueError("enable_lora with tensor_parallel_size > 1 is not supported yet")
        if self.max_model_len is not None and self.max_model_len <= 1:
            raise ValueError(f"max_model_len must be at least 2 (a prompt token and a generated one), got {self.max_model_len}")

    def resolve_max_num_seqs(self, kv_tokens: int) -> int:
        """Fill in ``max_num_seqs`` when it was left None (``auto_max_num_seqs``) and return it."""
        if self.max_num_seqs is None:
            self.max_num_seqs = auto_max_num_seqs(kv_tokens)
        return self.max_num_seqs

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}


AUTO_MAX_NUM_SEQS = 512  # the cap: CUDA graphs are captured up to cuda_graph_max_bs (512)
AUTO_MIN_NUM_SEQS = 32
AUTO_TOKENS_PER_SEQ = 512  # context each running sequence is budgeted when sizing the batch


def auto_max_num_seqs(kv_tokens: int) -> int:
    """The default running-batch limit for a KV pool of ``kv_tokens`` tokens: the largest power
    of two such that every running sequence has AUTO_TOKENS_PER_SEQ tokens of cache, within
    [AUTO_MIN_NUM_SEQS, AUTO_MAX_NUM_SEQS]. A big pool gets the cap (W1 admits all of its 500
    requests at once); a small one gets a batch it can hold without preempting at ~512 tokens of
    context each (longer ones are preempted and recomputed, as with any limit)."""
    if kv_tokens < 0:
        raise ValueError(f"kv_tokens must be >= 0, got {kv_tokens}")
    fit = max(1, kv_tokens // AUTO_TOKENS_PER_SEQ)
    return max(AUTO_MIN_NUM_SEQS, min(AUTO_MAX_NUM_SEQS, 1 << (fit.bit_length() - 1)))
