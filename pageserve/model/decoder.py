"""The decoder, from scratch: Llama, Qwen2 and Qwen3 families (RMSNorm, RoPE, GQA, SwiGLU; Qwen3's
RMSNorm over each head's q and k).

``forward(input_ids, positions, attn)`` takes a flat batch of T tokens and an attention
context; it never changes shape between prefill and decode. The attention context decides
where K/V live (a contiguous cache in phase 01, the paged pool in the engine); the ops
object decides whether the small fused ops run as PyTorch or Triton.

Weights are stored fused (q|k|v in one matrix, gate|up in another) so each layer makes
four matrix products; ``load_weights`` takes Hugging Face names and places them.
"""
from __future__ import annotations

from typing import Iterable, Protocol

import torch
from torch import nn

from .config import ModelConfig
from .ops import TorchOps, rope_cos_sin


class AttentionContext(Protocol):
    """Where K/V live. A context may also offer ``attend_rope(layer, q, k, v, positions,
    cos_sin, scale)``, taking q/k before RoPE so it can fuse RoPE with its K/V write
    (``PagedAttention`` does); the model then calls that instead of ``ops.rotary`` + ``attend``."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] (RoPE applied) -> [T, Hq, D]; stores k/v first."""
        ...


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, ops) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps), x
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)

    def project(self, x: torch.Tensor, residual: torch.Tensor | None, proj: nn.Linear, silu_mul: bool = False):
        """``proj(self(x, residual))`` as one op, so a backend can fold the norm into the
        projection's activation load. Returns (projected [T, N], residual' [T, H]); with
        ``silu_mul`` (proj: gate|up) the projection is SiLU(gate) * up: [T, N / 2]."""
        return self.ops.add_rms_norm_linear(x, residual, self.weight, self.eps, proj.weight, proj.bias, silu_mul)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, ops) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.scale = cfg.head_dim**-0.5
        self.qkv_proj = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=False)
        self.ops = ops
        if cfg.qk_norm:  # one [D] weight each, shared by every head (so replicated under tensor parallelism)
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, ops)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, ops)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, attn: AttentionContext,
                defer_sum: bool = False):
        # qkv: [T, (Hq + 2 Hkv) D], the qkv_proj output (the layer fuses that projection with its norm).
        # defer_sum: the caller's only use of the output is the next add + RMSNorm (``ops.linear_to_norm``)
        o = self.attend(qkv, positions, cos_sin, attn)
        if defer_sum:
            return self.ops.linear_to_norm(o, self.o_proj.weight, "o")
        return self.ops.linear(o, self.o_proj.weight, None)

    def attend(self, qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, attn: AttentionContext):
        """The attention's output before o_proj: [T, Hq * D]."""
        T = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None:  # each head's row normalised: [T * H, D]
            q = self.q_norm(q.reshape(-1, self.head_dim))[0]
            k = self.k_norm(k.reshape(-1, self.head_dim))[0]
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if hasattr(attn, "attend_rope"):
            o = attn.attend_rope(self.layer, q, k, v, positions, cos_sin, self.scale)  # [T, Hq, D]
        else:
            q, k = self.ops.rotary(q, k, positions, cos_sin)
            o = attn.attend(self.layer, q, k, v, self.scale)
        return o.reshape(T, self.q_size)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ops) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.ops = ops

    def forward(self, h: torch.Tensor, silu_done: bool | None = None, defer_sum: bool = False) -> torch.Tensor:
        # h: the gate_up_proj output [T, 2I] (the layer fuses that projection with its norm), or,
        # where the ops put SiLU·mul in that projection (``silu_done``; None: ``ops.silu_in_gate_up``),
        # SiLU(gate) * up [T, I]. defer_sum: as ``Attention.forward``'s
        if self.ops.silu_in_gate_up if silu_done is None else silu_done:
            if defer_sum:
                return self.ops.linear_to_norm(h, self.down_proj.weight, "down")  # [T, H] or its K slices
            return self.ops.linear(h, self.down_proj.weight, None)  # [T, H]
        return self.ops.silu_mul_linear(h, self.down_proj.weight, defer_sum=defer_sum)  # [T, H] (or its K slices)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, ops) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.self_attn = Attention(cfg, layer, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.mlp = MLP(cfg, ops)
        self.lora = None  # LoRASlots (model/lora.py) when the engine serves adapters: the unfused path below

    def forward(self, x, residual, positions, cos_sin, attn):
        if self.lora is not None:
            return self._forward_lora(x, residual, positions, cos_sin, attn)
        qkv, residual = self.input_layernorm.project(x, residual, self.self_attn.qkv_proj)
        # o's and down's outputs go only to the next add + RMSNorm (this layer's, the next layer's or the final
        # one): the ops may leave them as K slices for that norm to sum (``ops.linear_to_norm``)
        x = self.self_attn(qkv, positions, cos_sin, attn, defer_sum=True)
        silu = self.mlp.ops.silu_in_gate_up_for(x.shape[0], self.mlp.gate_up_proj.weight)
        h, residual = self.post_attention_layernorm.project(x, residual, self.mlp.gate_up_proj, silu_mul=silu)
        return self.mlp(h, silu_done=silu, defer_sum=True), residual

    def _forward_lora(self, x, residual, positions, cos_sin, attn):
        if self.lora.fused_for(self.mlp.ops):
            return self._forward_lora_fused(x, residual, positions, cos_sin, attn)
        # each projection's input is needed for its adapter's product, so nothing is fused into a projection
        lora, i, at, mlp = self.lora, self.self_attn.layer, self.self_attn, self.mlp
        ops = mlp.ops
        xn, residual = self.input_layernorm(x, residual)
        qkv = lora.add(ops, i, "qkv", xn, ops.linear(xn, at.qkv_proj.weight, at.qkv_proj.bias))
        o = at.attend(qkv, positions, cos_sin, attn)
        x = lora.add(ops, i, "o", o, ops.linear(o, at.o_proj.weight, None))
        xn, residual = self.post_attention_layernorm(x, residual)
        h = lora.add(ops, i, "gate_up", xn, ops.linear(xn, mlp.gate_up_proj.weight, None))
        act = ops.silu_and_mul(h)
        return lora.add(ops, i, "down", act, ops.linear(act, mlp.down_proj.weight, None)), residual

    def _forward_lora_fused(self, x, residual, positions, cos_sin, attn):
        # the plain path's fused projections (the norms in qkv's and gate_up's, SiLU·mul in down's), each adapter's
        # first product taking the same prologue from the projection's input (LoRASlots.add), the second adding
        # itself into the projection's output; gate_up's output stays unactivated, for its adapter to add to
        lora, i, at, mlp = self.lora, self.self_attn.layer, self.self_attn, self.mlp
        ops = mlp.ops
        qkv, residual = self.input_layernorm.project(x, residual, at.qkv_proj)
        qkv = lora.add(ops, i, "qkv", residual, qkv, norm=self.input_layernorm)
        o = at.attend(qkv, positions, cos_sin, attn)
        x = lora.add(ops, i, "o", o, ops.linear(o, at.o_proj.weight, None))
        h, residual = self.post_attention_layernorm.project(x, residual, mlp.gate_up_proj, silu_mul=False)
        h = lora.add(ops, i, "gate_up", residual, h, norm=self.post_attention_layernorm)
        return lora.add(ops, i, "down", h, mlp(h, silu_done=False), silu_mul=True), residual


class Decoder(nn.Module):
    """A causal LM. ``forward`` returns final hidden states [T, H]; ``head_logits`` turns the
    rows you need into logits [N, V] in the model's dtype, ``compute_logits`` into fp32 ones."""

    def __init__(self, cfg: ModelConfig, ops=None, max_positions: int | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.ops = ops or TorchOps()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, self.ops) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, self.ops)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.lora = None  # LoRASlots (set_lora)
        self.max_positions = max_positions or cfg.max_position_embeddings
        self.register_buffer(
            "cos_sin",
            rope_cos_sin(cfg.head_dim, self.max_positions, cfg.rope_theta, cfg.rope_scaling),
            persistent=False,
        )

    def _apply(self, fn, recurse=True):
        # .to(bf16) must not round the RoPE table: rebuild it in fp32 on its new device
        super()._apply(fn, recurse)
        if self.cos_sin.dtype != torch.float32:
            cfg = self.cfg
            self.cos_sin = rope_cos_sin(
                cfg.head_dim, self.max_positions, cfg.rope_theta, cfg.rope_scaling, self.cos_sin.device
            )
        return self

    def set_ops(self, ops) -> None:
        """Swap the implementation of the small ops (PyTorch reference or Triton) everywhere."""
        self.ops = ops
        for m in self.modules():
            if hasattr(m, "ops"):
                m.ops = ops

    def set_lora(self, slots) -> None:
        """Serve LoRA adapters from ``slots`` (``model.lora.LoRASlots``; None: off). Every forward then takes
        each layer's unfused path and adds each row's adapter (rows of no adapter get exact zeros)."""
        self.lora = slots
        for layer in self.layers:
            layer.lora = slots

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionContext) -> torch.Tensor:
        # input_ids, positions: [T]
        if self.lora is not None:
            self.lora.begin(input_ids.shape[0], self.ops)
        x = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, positions, self.cos_sin, attn)
        x, _ = self.norm(x, residual)
        return x

    @property
    def logits_dtype(self) -> torch.dtype:
        """The dtype of ``head_logits`` (the output head's: never quantized)."""
        return self._head_weight().dtype

    def _head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def head_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [N, V] as the output head computes them, in ``logits_dtype``; into ``out`` ([N, V],
        that dtype) when given. What the engine samples from: a bf16 product holds bf16 values, so
        converting them to fp32 first changes no token, and at the 3B shape's 151,936 columns that
        conversion cost ~0.1 ms of a 200-row decode step on the H200 (NOTES.md, session 29)."""
        return self.ops.head(hidden, self._head_weight(), out)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``head_logits`` in fp32 [N, V]; into ``out`` (any float dtype) when given."""
        logits = self.head_logits(hidden)
        return logits.float() if out is None else out.copy_(logits)

    # ----------------------------------------------------------------------------- weights
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], source: str = "checkpoint") -> None:
        """Place Hugging Face-named tensors (``model.layers.3.self_attn.q_proj.weight``…).

        Every parameter must be covered exactly; shape mismatches and missing or unknown
        names raise an error that names the checkpoint and the tensor.
        """
        params = dict(self.named_parameters())
        loaded: dict[str, int] = {}  # fused parameter -> number of shards placed
        qs, ks = self.cfg.q_size, self.cfg.kv_size
        inter = self.cfg.intermediate_size
        shard_slices = {
            "q_proj": ("qkv_proj", 0, qs), "k_proj": ("qkv_proj", qs, ks), "v_proj": ("qkv_proj", qs + ks, ks),
            "gate_proj": ("gate_up_proj", 0, inter), "up_proj": ("gate_up_proj", inter, inter),
        }
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding is the head
            target, rows = name, None
            for shard, (fused, start, size) in shard_slices.items():
                if f".{shard}." in name:
                    target, rows = name.replace(shard, fused), (start, size)
                    break
            if target not in params:
                raise ValueError(f"{source}: unexpected tensor {hf_name!r} for a {self.cfg.architecture} model")
            param = params[target]
            dest = param.data if rows is None else param.data.narrow(0, rows[0], rows[1])
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"{source}: tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
                    f"the model expects {tuple(dest.shape)}"
                )
            dest.copy_(tensor.to(dest.dtype))
            loaded[target] = loaded.get(target, 0) + 1
        expected_shards = {n: (3 if "qkv_proj.weight" in n or "qkv_proj.bias" in n else 2 if "gate_up" in n else 1) for n in params}
        missing = [n for n in params if loaded.get(n, 0) < expected_shards[n]]
        if missing:
            raise ValueError(f"{source}: missing weights for {missing[:5]}{' …' if len(missing) > 5 else ''}")

    @torch.no_grad()
    def init_dummy_weights(self, seed: int = 0, std: float = 0.02) -> None:
        """Random weights (for shapes with no checkpoint here): normal(0, std) matrices, norms at 1."""
        gen = torch.Generator(device=self.embed_tokens.weight.device).manual_seed(seed)
        for name, p in self.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, std, generator=gen)
