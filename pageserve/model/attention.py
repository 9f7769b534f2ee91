"""Attention over a paged KV cache: the per-step metadata and the plain-PyTorch reference.

A step's batch is flattened: T new tokens from B sequences, laid end to end. Sequence i owns
tokens ``query_start_loc[i] : query_start_loc[i+1]``; they are its last ``q_len_i`` positions,
so a query at position p attends to keys 0..p of its own sequence (causal within the chunk,
full over the cached prefix). Prefill chunks and one-token decodes mix freely.

KV cache: one tensor ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``;
token j of sequence i lives at slot ``block_tables[i, j // block_size] * block_size +
j % block_size``. A slot of -1 in ``slot_mapping`` marks a padding token: it is not written. The plain-PyTorch
reference of the attention and the KV write is in ``pageserve.kernels.reference``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64, -1 = padding (skipped)
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32, context length after this step (cached + new)
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int32 (unused entries: any valid id)
    max_query_len: int
    max_seq_len: int
    # host copies, so the reference path never syncs on device tensors
    query_start_loc_cpu: list[int] | None = None
    seq_lens_cpu: list[int] | None = None
    # launch data a kernel derives from this step's metadata, shared by the step's layers
    scratch: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


class PagedAttention:
    """The attention context the model calls in each layer during one engine step."""

    def __init__(self, kv_cache: torch.Tensor, meta: AttentionMetadata, ops) -> None:
        self.kv_cache = kv_cache
        self.meta = meta
        self.ops = ops

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        k_cache, v_cache = self.kv_cache[layer, 0], self.kv_cache[layer, 1]
        self.ops.write_kv(k, v, k_cache, v_cache, self.meta.slot_mapping)
        return self.ops.paged_attention(q, k_cache, v_cache, self.meta, scale)

    def attend_rope(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                    cos_sin: torch.Tensor, scale: float) -> torch.Tensor:
        """``attend`` on un-rotated q/k: RoPE and the K/V write are one ops call
        (one kernel under ``TritonOps(fuse_rope_kv=True)``), then attention (with the rotated k
        and v at hand where the ops take them: ``chunk_attention_for``); in decode steps where the
        ops say so (``rope_in_decode_attention``), all of it in the attention's own launch."""
        k_cache, v_cache = self.kv_cache[layer, 0], self.kv_cache[layer, 1]
        if self.ops.rope_in_decode_attention(q, self.meta):
            return self.ops.rope_decode_attention(q, k, v, positions, cos_sin, k_cache, v_cache, self.meta, scale)
        q, k = self.ops.rotary_write_kv(q, k, v, positions, cos_sin, k_cache, v_cache, self.meta.slot_mapping)
        if self.ops.chunk_attention_for(self.meta):
            return self.ops.chunk_kv_attention(q, k, v, k_cache, v_cache, self.meta, scale)
        return self.ops.paged_attention(q, k_cache, v_cache, self.meta, scale)
