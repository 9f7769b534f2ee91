"""The small fused operations of the decoder, in plain PyTorch.

``TorchOps`` is the reference every fast path is tested against; ``triton_ops.TritonOps``
has the same methods, each running a kernel. The model holds one ops object and never
branches on the backend itself.
"""
from __future__ import annotations

import math

import torch

from ..kernels import reference
from .quant import QuantizedWeight


class TorchOps:
    """The decoder's small fused operations in plain PyTorch: each method runs the function
    of the same name in ``pageserve.kernels.reference`` (the math the kernels are checked
    against). ``TritonOps`` overrides them with kernels."""

    name = "torch"
    graph_safe = False  # the reference reads host copies of lengths (and may sync): never captured
    lora_kernels = False  # LoRA's products: the reference (model/lora.py), through ``linear``

    def eager_row_buckets_for(self, device: torch.device) -> bool:
        """Whether eager steps pad their rows to ``model_runner.eager_rows_bucket`` (and the engine warms every
        bucket's linears at start-up) when ``EngineConfig.eager_row_buckets`` is None (auto). Off here: for
        the default mode's cuBLAS linears it did not make chat faster on the H200 (NOTES.md, session 17)."""
        return False

    def decode_context_limits(self) -> tuple[int | None, ...]:
        """The context classes a decode step's kernels depend on (``TritonOps``): one here, any context."""
        return (None,)

    def head(self, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The output head: ``linear(x, weight)`` [T, V] in x's dtype, written into ``out`` when given."""
        logits = self.linear(x, weight, None)
        return logits if out is None else out.copy_(logits)

    def linear(self, x: torch.Tensor, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
        """x: [T, K] @ weight [N, K]^T (+ bias) -> [T, N]. A ``QuantizedWeight`` (int8 + per-row scale)
        runs ``reference.linear_int8``: dequantize, then the float product."""
        if isinstance(weight, QuantizedWeight):
            return reference.linear_int8(x, weight.qweight, weight.scale, bias)
        return reference.linear(x, weight, bias)

    def linear_to_norm(self, x: torch.Tensor, weight: torch.Tensor | QuantizedWeight, which: str):
        """``linear(x, weight, None)`` for a caller whose only use of the product is the next
        ``add_rms_norm`` / ``rms_norm`` (a decoder layer's o and down projections, ``which`` "o" /
        "down"): a backend may hand it back as its K slices' partials for that norm to sum
        (``TritonOps(split_to_norm=)``, a ``kernels.norm.SplitSum``). Here: the product."""
        return self.linear(x, weight, None)

    def lora_shrink(self, x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor, width: int,
                    norm_weight: torch.Tensor | None = None, eps: float = 0.0, silu_mul: bool = False,
                    counters: torch.Tensor | None = None) -> torch.Tensor:
        """LoRA's first product, each row keeping its own slot's columns, after an RMSNorm or SiLU·mul of x where
        asked (``reference.lora_shrink``). ``counters``: the kernel's split-K tickets (``kernels.lora``), unused
        here."""
        return reference.lora_shrink(x, a, token_slots, width, norm_weight, eps, silu_mul)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return reference.rms_norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps) -> tuple[torch.Tensor, torch.Tensor]:
        return reference.add_rms_norm(x, residual, weight, eps)

    def add_rms_norm_linear(
        self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
        weight: torch.Tensor, bias: torch.Tensor | None, silu_mul: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A decoder layer's norm and the projection after it: returns (linear(normed, weight, bias),
        residual'), normed and residual' as ``add_rms_norm`` (``rms_norm`` of x, and x itself, when
        residual is None). x, residual: [T, K], weight: [N, K] -> ([T, N], [T, K]). ``silu_mul``:
        the projection is ``gate_up_silu_mul`` (weight: gate|up, no bias) -> ([T, N / 2], [T, K])."""
        if residual is None:
            normed, residual = self.rms_norm(x, norm_weight, eps), x
        else:
            normed, residual = self.add_rms_norm(x, residual, norm_weight, eps)
        if silu_mul:
            if bias is not None:
                raise ValueError("add_rms_norm_linear(silu_mul=True): the gate|up projection takes no bias")
            return self.gate_up_silu_mul(normed, weight), residual
        return self.linear(normed, weight, bias), residual

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return reference.silu_and_mul(gate_up)

    # Where the MLP's SiLU·mul runs: False, in the down projection (``silu_mul_linear``, which a
    # backend may fuse into its down GEMV); True, in the gate_up projection's epilogue
    # (``gate_up_silu_mul``, then a plain ``linear`` for down: ``DeterministicOps``).
    silu_in_gate_up = False

    def silu_in_gate_up_for(self, rows: int, weight) -> bool:
        """``silu_in_gate_up`` for a step of ``rows`` rows whose gate|up matrix is ``weight``: a
        backend may put SiLU·mul in the gate_up product for some batches only (``TritonOps``)."""
        return self.silu_in_gate_up

    def gate_up_silu_mul(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """silu_and_mul(linear(x, weight)): x [T, K], weight the gate|up matrix [2I, K] -> [T, I]."""
        return self.silu_and_mul(self.linear(x, weight, None))

    def silu_mul_linear(self, gate_up: torch.Tensor, weight: torch.Tensor, defer_sum: bool = False):
        """linear(silu_and_mul(gate_up), weight), through this object's own two ops; with ``defer_sum`` (the
        caller's only use is the next norm) the product as ``linear_to_norm(..., "down")`` gives it."""
        act = self.silu_and_mul(gate_up)
        return self.linear_to_norm(act, weight, "down") if defer_sum else self.linear(act, weight, None)

    def rotary(self, q, k, positions, cos_sin) -> tuple[torch.Tensor, torch.Tensor]:
        return reference.rotary(q, k, positions, cos_sin)

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        reference.write_kv(k, v, k_cache, v_cache, slot_mapping)

    def rotary_write_kv(self, q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping):
        """RoPE on q and k, then the rotated k and v into the paged cache (slot -1 skipped).
        Returns (q_rot, k_rot)."""
        q, k = self.rotary(q, k, positions, cos_sin)
        self.write_kv(k, v, k_cache, v_cache, slot_mapping)
        return q, k

    def paged_attention(self, q, k_cache, v_cache, meta, scale: float) -> torch.Tensor:
        return reference.paged_attention(q, k_cache, v_cache, meta, scale)

    def rope_in_decode_attention(self, q: torch.Tensor, meta) -> bool:
        """Whether this step's RoPE, K/V write and attention are one ``rope_decode_attention(q, k, v,
        positions, cos_sin, k_cache, v_cache, meta, scale)`` call (q, k, v before RoPE) instead of
        ``rotary_write_kv`` then the attention: never here (``TritonOps``: decode steps)."""
        return False

    def chunk_attention_for(self, meta) -> bool:
        """Whether this step's attention runs ``chunk_kv_attention`` (the step's own k/v in hand)
        instead of ``paged_attention``: never here (``TritonOps``: eager steps with long chunks)."""
        return False

    def warm_chunk_attention(self, k_cache, v_cache, num_heads: int) -> int:
        """Compile what ``chunk_kv_attention`` launches before serving (``TritonOps``); nothing here: 0."""
        return 0

    def warm_gate_up_silu(self, weight) -> int:
        """Compile the large-batch gate_up + SiLU·mul kernel before serving (``TritonOps``); nothing here: 0."""
        return 0

    def chunk_kv_attention(self, q, k, v, k_cache, v_cache, meta, scale: float) -> torch.Tensor:
        """``paged_attention`` with the step's rotated k and v [T, Hkv, D] at hand (already in the
        cache), for kernels that read a chunk's own keys from them rather than through the block table."""
        return self.paged_attention(q, k_cache, v_cache, meta, scale)


def rope_cos_sin(
    head_dim: int, max_pos: int, theta: float, scaling: dict | None, device: torch.device | str | None = None
) -> torch.Tensor:
    """The [max_pos, head_dim] fp32 table of cos|sin for rotate-half RoPE, with the
    rope-scaling variants the supported configs use (linear, dynamic at load time, llama3, yarn)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim))
    attn_factor = 1.0
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "dynamic":
        # NTK-aware scaling fixed at the maximum length: the table is built once, so the
        # base is stretched for max_pos up front.
        orig = scaling.get("original_max_position_embeddings", max_pos)
        factor = scaling["factor"]
        if max_pos > orig:
            base = theta * ((factor * max_pos / orig) - (factor - 1)) ** (head_dim / (head_dim - 2))
            inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim))
    elif kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        orig = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (orig / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > orig / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= orig / low) & (wavelen >= orig / high)
        inv_freq = torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    elif kind == "yarn":
        factor = scaling["factor"]
        orig = scaling.get("original_max_position_embeddings", max_pos)
        beta_fast, beta_slow = scaling.get("beta_fast", 32.0), scaling.get("beta_slow", 1.0)

        def dim_of(rot: float) -> float:
            return (head_dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(theta))

        lo, hi = max(math.floor(dim_of(beta_fast)), 0), min(math.ceil(dim_of(beta_slow)), head_dim - 1)
        ramp = ((torch.arange(head_dim // 2, dtype=torch.float64, device=device) - lo) / max(hi - lo, 1e-3)).clamp(0, 1)
        extrapolation = 1 - ramp
        inv_freq = inv_freq / factor * (1 - extrapolation) + inv_freq * extrapolation
        attn_factor = scaling.get("attention_factor") or (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)
    elif kind != "default":
        raise ValueError(f"unsupported rope_scaling type {kind!r}")
    t = torch.arange(max_pos, dtype=torch.float64, device=device)
    freqs = torch.outer(t, inv_freq)  # [max_pos, D/2]
    return (torch.cat((freqs.cos(), freqs.sin()), dim=-1) * attn_factor).float()
