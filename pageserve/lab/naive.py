"""Phase 01: the simplest correct generation loop.

One sequence, a contiguous KV cache per layer, prefill the prompt in one forward, then
decode one token at a time, greedy. Everything later (paged KV, batching, CUDA graphs,
Triton) is checked against this.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

from ..model.decoder import Decoder


class ContiguousKVCache:
    """K/V of one sequence in contiguous tensors: k, v: [num_layers, max_len, Hkv, D].

    Implements the attention-context protocol. A forward of T tokens writes its K/V at
    rows [length, length + T) of every layer; the caller then calls ``advance(T)``.
    Invariant: rows [0, length) hold the K/V of the tokens at positions 0 … length-1.
    """

    def __init__(self, num_layers: int, max_len: int, num_kv_heads: int, head_dim: int,
                 device: torch.device | str, dtype: torch.dtype) -> None:
        shape = (num_layers, max_len, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.max_len = max_len
        self.length = 0

    @classmethod
    def for_model(cls, model: Decoder, max_len: int) -> "ContiguousKVCache":
        cfg, w = model.cfg, model.embed_tokens.weight
        return cls(cfg.num_layers, max_len, cfg.num_kv_heads, cfg.head_dim, w.device, w.dtype)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        # q: [T, Hq, D], k/v: [T, Hkv, D] -> [T, Hq, D]
        T, start = q.shape[0], self.length
        end = start + T
        if end > self.max_len:
            raise ValueError(f"KV cache full: {end} tokens > max_len {self.max_len}")
        self.k[layer, start:end] = k
        self.v[layer, start:end] = v
        keys, values = self.k[layer, :end], self.v[layer, :end]  # [S, Hkv, D]
        hkv, d = keys.shape[1], keys.shape[2]
        group = q.shape[1] // hkv
        qg = q.view(T, hkv, group, d).permute(1, 2, 0, 3)  # [Hkv, G, T, D]; query head h = kv head h // G
        scores = (qg @ keys.permute(1, 2, 0).unsqueeze(1)).float() * scale  # [Hkv, G, T, S]
        # query i sits at position start + i and sees keys 0 … start + i
        causal = torch.arange(end, device=q.device)[None, :] <= (start + torch.arange(T, device=q.device))[:, None]
        probs = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1).to(q.dtype)
        out = probs @ values.transpose(0, 1).unsqueeze(1)  # [Hkv, G, T, D]
        return out.permute(2, 0, 1, 3).reshape(T, hkv * group, d)

    def advance(self, num_tokens: int) -> None:
        self.length += num_tokens


@torch.inference_mode()
def forward_tokens(model: Decoder, cache: ContiguousKVCache, token_ids: list[int] | torch.Tensor) -> torch.Tensor:
    """Run ``token_ids`` (the next tokens of the sequence) through the model; returns the
    hidden states [T, H] and advances the cache."""
    device = model.embed_tokens.weight.device
    ids = torch.as_tensor(token_ids, dtype=torch.long, device=device)
    positions = torch.arange(cache.length, cache.length + ids.numel(), device=device)
    hidden = model(ids, positions, cache)
    cache.advance(ids.numel())
    return hidden


@torch.inference_mode()
def prompt_logits(model: Decoder, prompt_ids: list[int]) -> torch.Tensor:
    """fp32 logits [T, V] at every prompt position (one prefill, no generation)."""
    cache = ContiguousKVCache.for_model(model, len(prompt_ids))
    return model.compute_logits(forward_tokens(model, cache, prompt_ids))


@dataclass
class NaiveGeneration:
    """The generated ids (the eos token included when it ended the generation) and the
    wall time of the prefill and of every decode step, in seconds."""

    token_ids: list[int]
    prompt_len: int
    prefill_s: float
    step_s: list[float] = field(default_factory=list)

    @property
    def ttft_s(self) -> float:
        return self.prefill_s

    @property
    def decode_s(self) -> float:
        return sum(self.step_s)

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def decode_tok_s(self) -> float:
        """Decode throughput: tokens after the first over the time of their steps."""
        return len(self.step_s) / self.decode_s if self.step_s else float("nan")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def naive_generate(
    model: Decoder,
    prompt_ids: list[int],
    max_new_tokens: int,
    eos_token_ids: Iterable[int] | None = None,
    ignore_eos: bool = False,
    on_token: Callable[[int], None] | None = None,
) -> NaiveGeneration:
    """Greedy generation: prefill, then one token per forward until ``max_new_tokens`` or
    an eos token (unless ``ignore_eos``). ``on_token`` is called with each new id."""
    if not prompt_ids:
        raise ValueError("naive_generate needs at least one prompt token")
    device = model.embed_tokens.weight.device
    stop = set() if ignore_eos else set(eos_token_ids or ())
    cache = ContiguousKVCache.for_model(model, len(prompt_ids) + max_new_tokens)
    out = NaiveGeneration(token_ids=[], prompt_len=len(prompt_ids), prefill_s=0.0)
    if max_new_tokens <= 0:
        return out

    _sync(device)
    t0 = time.perf_counter()
    # prefill: logits of the last prompt position only
    hidden = forward_tokens(model, cache, prompt_ids)
    token = int(model.compute_logits(hidden[-1:]).argmax(dim=-1).item())
    out.prefill_s = time.perf_counter() - t0
    out.token_ids.append(token)
    if on_token:
        on_token(token)
    # decode
    while len(out.token_ids) < max_new_tokens and token not in stop:
        t0 = time.perf_counter()
        hidden = forward_tokens(model, cache, [token])
        token = int(model.compute_logits(hidden).argmax(dim=-1).item())  # .item() syncs
        out.step_s.append(time.perf_counter() - t0)
        out.token_ids.append(token)
        if on_token:
            on_token(token)
    return out
