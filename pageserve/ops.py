"""The small fused operations of the decoder, in plain PyTorch.

``TorchOps`` is the reference every fast path is tested against; ``pageserve.kernels``
provides ``TritonOps`` with the same methods. The model holds one ops object and never
branches on the backend itself.
"""
from __future__ import annotations

import math

import torch


class TorchOps:
    name = "torch"

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # x: [T, K], weight: [N, K] -> [T, N]
        return torch.nn.functional.linear(x, weight, bias)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # x: [T, H]; statistics in fp32 whatever the storage dtype (as HF does)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * xf.to(x.dtype)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """residual' = x + residual; returns (rms_norm(residual'), residual')."""
        residual = x + residual
        return self.rms_norm(residual, weight, eps), residual

    def add_rms_norm_linear(
        self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
        weight: torch.Tensor, bias: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A decoder layer's norm and the projection after it: returns (linear(normed, weight, bias),
        residual'), normed and residual' as ``add_rms_norm`` (``rms_norm`` of x, and x itself, when
        residual is None). x, residual: [T, K], weight: [N, K] -> ([T, N], [T, K])."""
        if residual is None:
            normed, residual = self.rms_norm(x, norm_weight, eps), x
        else:
            normed, residual = self.add_rms_norm(x, residual, norm_weight, eps)
        return self.linear(normed, weight, bias), residual

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        # gate_up: [T, 2I] -> [T, I]
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    def silu_mul_linear(self, gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The MLP's down projection of its gate|up output: linear(silu_and_mul(gate_up), weight).
        gate_up: [T, 2I], weight: [N, I] -> [T, N]."""
        return self.linear(self.silu_and_mul(gate_up), weight, None)

    def rotary(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate-half RoPE. q: [T, Hq, D], k: [T, Hkv, D], cos_sin: [max_pos, D] fp32
        (cos in the first half, sin in the second)."""
        cs = cos_sin[positions]  # [T, D]
        cos, sin = cs.chunk(2, dim=-1)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [T, 1, D/2]

        def rot(x: torch.Tensor) -> torch.Tensor:
            x1, x2 = x.float().chunk(2, dim=-1)
            return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

        return rot(q), rot(k)

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        from .attention import write_kv_reference

        write_kv_reference(k, v, k_cache, v_cache, slot_mapping)

    def rotary_write_kv(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
        k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE on q and k, then the rotated k and v into the paged cache (slot -1 skipped).
        Returns (q_rot, k_rot)."""
        q, k = self.rotary(q, k, positions, cos_sin)
        self.write_kv(k, v, k_cache, v_cache, slot_mapping)
        return q, k

    def paged_attention(self, q, k_cache, v_cache, meta, scale: float) -> torch.Tensor:
        from .attention import paged_attention_reference

        return paged_attention_reference(q, k_cache, v_cache, meta, scale)


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
