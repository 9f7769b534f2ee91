"""Tensor parallelism for the decoder: the process group, the collectives, and the shards.

Each of ``tp`` ranks holds a slice of every large weight (Megatron-style):

    qkv_proj      column-parallel: rank r keeps its q heads and its KV heads (rows of q|k|v)
    o_proj        row-parallel: the columns of its q heads; partial sums -> one all-reduce
    gate_up_proj  column-parallel: rows r of gate and rows r of up (so SiLU·mul stays local)
    down_proj     row-parallel: the matching columns; partial sums -> one all-reduce
    embed_tokens  vocab-parallel: rows [r·Vp, (r+1)·Vp); a token outside them embeds to 0,
                  then one all-reduce (exactly one rank contributes each row)
    lm_head       vocab-parallel (the embedding's shard when tied); logits all-gathered
    norms, RoPE   replicated

So a layer costs two all-reduces of [T, hidden], the paged KV cache of rank r holds only its
KV heads, and the fp32 sums differ from one process only in the order of additions.

The decoder itself stays unaware of parallelism: ``shard_decoder_`` turns a loaded full
model into rank r's shard in place (slicing the same full tensors on every rank, so
random weights of one seed give TP=N equal to TP=1) and switches its attention, MLP,
embedding and head to the subclasses below, which add the collectives.

Every collective goes through ``all_reduce`` / ``all_gather_last_dim`` here. On GPUs with
peer access, ``all_reduce`` sends messages up to ``custom_allreduce.DEFAULT_MAX_BYTES`` (every
decode step's) through a one-shot all-reduce over CUDA IPC buffers (``custom_allreduce.py``,
kernel in ``pageserve/kernels/allreduce.py``) and larger ones (prefill) through NCCL.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import threading
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .decoder import MLP, Attention, Decoder

logger = logging.getLogger(__name__)

# NVLink SHARP / multicast stays off: the machines this runs on forbid multicast objects.
NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def disable_nvlink_multicast() -> None:
    """setdefault the variables that keep NCCL / symmetric memory / NVSHMEM off NVLink
    multicast; must run in every process before NCCL initialises."""
    for k, v in NO_MULTICAST_ENV.items():
        os.environ.setdefault(k, v)


# ----------------------------------------------------------------------------- the group
@dataclasses.dataclass
class _TPState:
    rank: int = 0
    size: int = 1
    custom: object | None = None  # CustomAllReduce when the GPUs can address each other


_state = _TPState()


def tp_rank() -> int:
    return _state.rank


def tp_size() -> int:
    return _state.size


def init_tensor_parallel(rank: int, size: int, init_method: str, device: torch.device,
                         timeout_s: float = 600.0, custom_all_reduce: bool = True) -> None:
    """Join the ``size``-rank group (NCCL on CUDA, gloo on the CPU) and run one collective,
    so the communicator exists before any CUDA graph is captured; on CUDA with
    ``custom_all_reduce`` (and ``$PAGESERVE_CUSTOM_ALL_REDUCE`` not ``0``: a process-wide off
    switch for debugging), also open the one-shot all-reduce's IPC buffers (collective)."""
    disable_nvlink_multicast()
    if dist.is_initialized():
        raise RuntimeError("a torch.distributed process group already exists in this process; "
                           "tensor_parallel_size > 1 starts its own: one tensor-parallel engine per process at a "
                           "time (shut the other down first)")
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                            timeout=timedelta(seconds=timeout_s), **kwargs)
    _state.rank, _state.size = rank, size
    warm = torch.ones(1, device=device)
    dist.all_reduce(warm)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        if custom_all_reduce and os.environ.get("PAGESERVE_CUSTOM_ALL_REDUCE", "1") != "0":
            from .custom_allreduce import CustomAllReduce

            _state.custom = CustomAllReduce.create(rank, size, device)


def destroy_tensor_parallel(abandon: bool = False) -> None:
    """Tear the process group down: every rank calls this at about the same time (under
    NCCL the teardown waits for all of them). ``abandon``: a peer is gone, so the group is
    dropped without the collective teardown (its resources go with the process)."""
    custom, _state.custom = _state.custom, None
    if custom is not None and not abandon:
        try:
            custom.close()
        except Exception:  # freeing is best effort: the process's exit frees it too
            pass
    if dist.is_initialized():
        try:
            if abandon and hasattr(dist.distributed_c10d, "_abort_process_group"):
                dist.distributed_c10d._abort_process_group()
            elif not abandon:
                _destroy_with_timeout(DESTROY_TIMEOUT_S)
        except Exception:  # a peer already gone must not stop the shutdown
            pass
    _state.rank, _state.size = 0, 1


DESTROY_TIMEOUT_S = 60.0


def _destroy_with_timeout(timeout_s: float) -> None:
    """``destroy_process_group`` on a helper thread: should NCCL's teardown never return (a
    graph still holding its collectives, a peer stuck), the caller goes on after ``timeout_s``
    with a warning rather than hanging its process."""
    t = threading.Thread(target=dist.destroy_process_group, name="pageserve-tp-destroy", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        logger.warning(
            "torch.distributed teardown did not finish in %.0f s; leaving it (its resources go with the process)", timeout_s)


# ----------------------------------------------------------------------------- collectives
def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the ranks, in place (graph-capturable); identity at TP=1. Small
    messages take the one-shot IPC all-reduce when it is open, the rest NCCL (or gloo)."""
    if _state.size > 1:
        custom = _state.custom
        if custom is not None and custom.fits(x):
            custom.all_reduce_(x)
        else:
            dist.all_reduce(x)
    return x


def nccl_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """``all_reduce`` through the process group whatever the size (for comparisons)."""
    if _state.size > 1:
        dist.all_reduce(x)
    return x


def custom_all_reduce():
    """This rank's ``CustomAllReduce`` when it is open, else None."""
    return _state.custom


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """[..., n] on every rank -> [..., size·n], rank-major along the last dim."""
    if _state.size == 1:
        return x
    x = x.contiguous()
    out = torch.empty((_state.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)  # rank-major rows
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
    gather(out, x)
    return out.view(_state.size, *x.shape).movedim(0, -2).reshape(*x.shape[:-1], _state.size * x.shape[-1])


def broadcast_(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's ``x`` into every rank's ``x`` (same shape and dtype everywhere)."""
    if _state.size > 1:
        dist.broadcast(x, src=0)
    return x


def min_over_ranks(value: int, device: torch.device) -> int:
    """The smallest of every rank's ``value`` (host sync: start-up only)."""
    if _state.size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


# ----------------------------------------------------------------------------- shards
def check_tp_divisible(cfg: ModelConfig, size: int) -> None:
    """ValueError unless query heads, KV heads and the MLP width split evenly over ``size``."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {size}")
    bad = [f"{name}={n}" for name, n in (("num_attention_heads", cfg.num_heads),
                                         ("num_key_value_heads", cfg.num_kv_heads),
                                         ("intermediate_size", cfg.intermediate_size)) if n % size]
    if bad:
        raise ValueError(
            f"tensor_parallel_size={size} does not divide this model's {', '.join(bad)}: each rank "
            f"must hold whole query and KV heads; use a size that divides {cfg.num_heads} query "
            f"heads and {cfg.num_kv_heads} KV heads (e.g. 1)"
        )


def vocab_shard(vocab_size: int, rank: int, size: int) -> tuple[int, int]:
    """(start, rows) of rank's vocabulary slice; every rank has ``ceil(V / size)`` rows, the
    last one's padded with zero rows past the vocabulary."""
    per = -(-vocab_size // size)
    return rank * per, per


class ParallelAttention(Attention):
    """Attention over this rank's heads; o_proj's partial sums are all-reduced."""

    def forward(self, qkv, positions, cos_sin, attn, defer_sum: bool = False):
        return all_reduce(super().forward(qkv, positions, cos_sin, attn))  # the all-reduce needs the sum


class ParallelMLP(MLP):
    """SwiGLU over this rank's slice of the intermediate width; down_proj all-reduced."""

    def forward(self, h, silu_done: bool | None = None, defer_sum: bool = False):
        return all_reduce(super().forward(h, silu_done))  # the all-reduce needs the sum


class VocabParallelEmbedding(nn.Embedding):
    """Rows [vocab_start, vocab_start + rows) of the embedding; other ids give 0, then the
    all-reduce fills every row from the one rank that holds it."""

    vocab_start: int = 0

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        inside = (local >= 0) & (local < self.weight.shape[0])  # [T]
        x = F.embedding(torch.where(inside, local, 0), self.weight)  # [T, H]
        return all_reduce(x.masked_fill_(~inside.unsqueeze(-1), 0))


class ParallelDecoder(Decoder):
    """A decoder shard: ``head_logits`` (and so ``compute_logits``) gathers the vocabulary slices
    into [N, V] on every rank. ``cfg`` is the shard's shape (heads and MLP width per rank, full vocab
    and hidden size); ``full_cfg`` the model's."""

    full_cfg: ModelConfig

    def head_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        local = super().head_logits(hidden)  # [N, Vp]
        logits = all_gather_last_dim(local)[:, : self.full_cfg.vocab_size]
        return logits if out is None else out.copy_(logits)


def _rows(w: torch.Tensor, parts: list[tuple[int, int]]) -> torch.Tensor:
    return torch.cat([w.narrow(0, s, n) for s, n in parts], dim=0).contiguous()


def _keep(module: nn.Module, name: str, value: torch.Tensor) -> None:
    setattr(module, name, nn.Parameter(value, requires_grad=False))


@torch.no_grad()
def shard_decoder_(model: Decoder, rank: int, size: int) -> Decoder:
    """Turn a full ``model`` into rank ``rank``'s shard of ``size``, in place (see the module
    docstring for the layout). Returns the same object, now a ``ParallelDecoder``."""
    cfg = model.cfg
    check_tp_divisible(cfg, size)
    if size == 1:
        return model
    hq, hkv, inter = cfg.num_heads // size, cfg.num_kv_heads // size, cfg.intermediate_size // size
    d = cfg.head_dim
    qs, kvs = cfg.q_size, cfg.kv_size
    q_part = (rank * hq * d, hq * d)
    k_part, v_part = (qs + rank * hkv * d, hkv * d), (qs + kvs + rank * hkv * d, hkv * d)
    for layer in model.layers:
        att, mlp = layer.self_attn, layer.mlp
        _keep(att.qkv_proj, "weight", _rows(att.qkv_proj.weight, [q_part, k_part, v_part]))
        if att.qkv_proj.bias is not None:
            _keep(att.qkv_proj, "bias", _rows(att.qkv_proj.bias, [q_part, k_part, v_part]))
        _keep(att.o_proj, "weight", att.o_proj.weight[:, q_part[0]: q_part[0] + q_part[1]].contiguous())
        att.num_heads, att.num_kv_heads, att.q_size, att.kv_size = hq, hkv, hq * d, hkv * d
        att.__class__ = ParallelAttention
        g = mlp.gate_up_proj.weight
        _keep(mlp.gate_up_proj, "weight", _rows(g, [(rank * inter, inter), (cfg.intermediate_size + rank * inter, inter)]))
        _keep(mlp.down_proj, "weight", mlp.down_proj.weight[:, rank * inter: (rank + 1) * inter].contiguous())
        mlp.__class__ = ParallelMLP

    start, per = vocab_shard(cfg.vocab_size, rank, size)

    def vocab_rows(w: torch.Tensor) -> torch.Tensor:
        out = w.new_zeros(per, w.shape[1])
        n = max(0, min(per, cfg.vocab_size - start))
        out[:n] = w[start: start + n]
        return out

    emb = model.embed_tokens
    _keep(emb, "weight", vocab_rows(emb.weight))
    emb.num_embeddings = per
    emb.__class__ = VocabParallelEmbedding
    emb.vocab_start = start
    if model.lm_head is not None:
        _keep(model.lm_head, "weight", vocab_rows(model.lm_head.weight))
        model.lm_head.out_features = per
    model.full_cfg = cfg
    model.cfg = dataclasses.replace(cfg, num_heads=hq, num_kv_heads=hkv, intermediate_size=inter)
    model.tp_rank, model.tp_size = rank, size
    model.__class__ = ParallelDecoder
    return model
