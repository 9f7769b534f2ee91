"""Attention over a paged KV cache: the per-step metadata and the plain-PyTorch reference.

A step's batch is flattened: T new tokens from B sequences, laid end to end. Sequence i owns
tokens ``query_start_loc[i] : query_start_loc[i+1]``; they are its last ``q_len_i`` positions,
so a query at position p attends to keys 0..p of its own sequence (causal within the chunk,
full over the cached prefix). Prefill chunks and one-token decodes mix freely.

KV cache: one tensor ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``;
token j of sequence i lives at slot ``block_tables[i, j // block_size] * block_size +
j % block_size``. A slot of -1 in ``slot_mapping`` marks a padding token: it is not written.
"""
from __future__ import annotations

from dataclasses import dataclass

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

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


def write_kv_reference(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """k, v: [T, Hkv, D] into caches [N, block_size, Hkv, D] at slot_mapping [T] (-1 skipped)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[keep]
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[keep]


def paged_attention_reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """q: [T, Hq, D] -> [T, Hq, D]. One sequence at a time: slow and plainly right."""
    T, Hq, D = q.shape
    block_size, Hkv = k_cache.shape[1], k_cache.shape[2]
    group = Hq // Hkv
    out = torch.zeros_like(q)
    qsl = meta.query_start_loc_cpu or meta.query_start_loc.tolist()
    lens = meta.seq_lens_cpu or meta.seq_lens.tolist()
    for i, ctx in enumerate(lens):
        start, end = qsl[i], qsl[i + 1]
        q_len = end - start
        if q_len == 0 or ctx == 0:
            continue
        n_blocks = (ctx + block_size - 1) // block_size
        blocks = meta.block_tables[i, :n_blocks].long()
        kk = k_cache[blocks].reshape(-1, Hkv, D)[:ctx]  # [ctx, Hkv, D]
        vv = v_cache[blocks].reshape(-1, Hkv, D)[:ctx]
        qi = q[start:end].float().transpose(0, 1)  # [Hq, q_len, D]
        kk = kk.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, ctx, D]
        vv = vv.float().repeat_interleave(group, dim=1).transpose(0, 1)
        scores = torch.matmul(qi, kk.transpose(1, 2)) * scale  # [Hq, q_len, ctx]
        q_pos = torch.arange(ctx - q_len, ctx, device=q.device)
        k_pos = torch.arange(ctx, device=q.device)
        scores.masked_fill_(k_pos[None, :] > q_pos[:, None], float("-inf"))
        out[start:end] = torch.matmul(scores.softmax(-1), vv).transpose(0, 1).to(q.dtype)
    return out


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
        (one kernel under ``TritonOps(fuse_rope_kv=True)``), then attention."""
        k_cache, v_cache = self.kv_cache[layer, 0], self.kv_cache[layer, 1]
        q, _ = self.ops.rotary_write_kv(q, k, v, positions, cos_sin, k_cache, v_cache, self.meta.slot_mapping)
        return self.ops.paged_attention(q, k_cache, v_cache, self.meta, scale)
