"""Where bf16 error comes from in a random-weight decoder: run the model in fp32 on
bf16-valued weights, round to bf16 at one kind of site at a time, and compare the logits
with the clean fp32 run (‖Δ‖/‖ref‖). A CPU diagnostic for the bf16 parity figure of notebook 01:

    python scripts/bf16_rounding_sites.py qwen2.5-0.5b     # ~2 minutes on 2 CPU cores

Sites: ``lin`` (every linear output), ``norm`` (RMSNorm outputs), ``res`` (the residual
stream after each add), ``act`` (SiLU·mul), ``kv`` (rotated q/k and the cached k/v),
``attn`` (attention outputs); then all together, and all but the residual.
"""
from __future__ import annotations

import argparse

import torch

from pageserve.model.attention import AttentionMetadata, PagedAttention
from pageserve.model.loader import load_model
from pageserve.model.ops import TorchOps


def bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).float()


class RoundingOps(TorchOps):
    """The reference ops in fp32, rounding to bf16 at the named sites."""

    def __init__(self, sites: set[str]) -> None:
        self.sites = sites

    def _r(self, site: str, t: torch.Tensor) -> torch.Tensor:
        return bf16(t) if site in self.sites else t

    def linear(self, x, weight, bias):
        return self._r("lin", super().linear(x, weight, bias))

    def rms_norm(self, x, weight, eps):
        return self._r("norm", super().rms_norm(x, weight, eps))

    def add_rms_norm(self, x, residual, weight, eps):
        residual = self._r("res", x + residual)
        return self.rms_norm(residual, weight, eps), residual

    def silu_and_mul(self, gate_up):
        return self._r("act", super().silu_and_mul(gate_up))

    def rotary(self, q, k, positions, cos_sin):
        q, k = super().rotary(q, k, positions, cos_sin)
        return self._r("kv", q), self._r("kv", k)

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping):
        super().write_kv(self._r("kv", k), self._r("kv", v), k_cache, v_cache, slot_mapping)

    def paged_attention(self, q, k_cache, v_cache, meta, scale):
        return self._r("attn", super().paged_attention(q, k_cache, v_cache, meta, scale))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="qwen2.5-0.5b")
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(2)
    model = load_model(args.model, device="cpu", dtype="bfloat16", seed=0).model.float().eval()  # bf16-valued weights
    cfg, T = model.cfg, args.tokens
    ids = torch.randint(0, cfg.vocab_size, (T,), generator=torch.Generator().manual_seed(0))

    def logits(sites: set[str]) -> torch.Tensor:
        model.set_ops(RoundingOps(sites))
        nb = -(-T // 16)
        kv = torch.zeros(cfg.num_layers, 2, nb, 16, cfg.num_kv_heads, cfg.head_dim)
        meta = AttentionMetadata(torch.arange(T), torch.tensor([0, T], dtype=torch.int32),
                                 torch.tensor([T], dtype=torch.int32), torch.arange(nb, dtype=torch.int32)[None],
                                 T, T, [0, T], [T])
        with torch.no_grad():
            return model.compute_logits(model(ids, torch.arange(T), PagedAttention(kv, meta, model.ops)))

    ref = logits(set())
    every = {"lin", "norm", "res", "act", "kv", "attn"}
    for sites in [{"lin"}, {"norm"}, {"res"}, {"act"}, {"kv"}, {"attn"}, every, every - {"res"}]:
        out = logits(sites)
        print(f"{args.model} rounded at {','.join(sorted(sites)):28s} ‖Δ‖/‖ref‖ = {((out - ref).norm() / ref.norm()).item():.4f}",
              flush=True)


if __name__ == "__main__":
    main()
