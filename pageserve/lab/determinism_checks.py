"""Batch invariance of the deterministic mode's matmul (issue 15), checked and timed.

``invariance_mismatches`` is the check the tests use: it computes a few probe rows alone (M = 1)
and again inside batches of other sizes, at random positions among random other rows, and
counts the rows whose bits differ. ``invariance_report`` runs it on the Qwen2.5-3B linear shapes
for ``matmul_invariant`` (its default, and BLOCK_M policies that follow M, whose invariance is a
question for the GPU) and for cuBLAS, and times them against cuBLAS and, at M = 1, the GEMV.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch
import torch.nn.functional as F

from ..kernels._util import sm_count_for
from ..kernels.gemv import gemv
from ..kernels.matmul_invariant import BLOCK_N_CHOICES, _launch, invariant_config, matmul_invariant
from .kernel_bench.shapes import DTYPE_NAMES, GEMV_SHAPES
from .kernel_bench.timing import graph_ms, weight_copies

Matmul = Callable[[torch.Tensor], torch.Tensor]  # x [M, K] -> [M, N], the weight bound inside

BATCH_SIZES = (2, 7, 64, 257, 1024)
# BLOCK_M as a function of M, for the record: does a smaller (mma.sync) or larger row tile stay
# bitwise equal to itself across M? None is matmul_invariant's fixed default.
BLOCK_M_POLICIES: dict[str, Callable[[int], int | None]] = {
    "default": lambda M: None,
    "16_upto_16": lambda M: 16 if M <= 16 else None,
    "32_upto_32": lambda M: 32 if M <= 32 else None,
    "128_from_256": lambda M: 128 if M >= 256 else None,
}


def invariance_mismatches(fn: Matmul, probe: torch.Tensor, batch_sizes: Iterable[int],
                          gen: torch.Generator) -> dict[str, int]:
    """How many probe rows come out with other bits in a batch than alone.

    probe: [R, K]. Each probe row is computed alone (``fn(probe[i:i+1])``); then, for each S in
    ``batch_sizes``, min(R, S) probe rows are placed at random positions of a batch of S rows
    whose other rows are random (of mixed magnitudes), and, under "shuffled", all R probe rows
    are computed together in a random order. Returns {"M=S" | "shuffled": rows that differ}.
    ``gen``: a CPU generator (fillers are drawn on the CPU and copied to probe's device)."""
    R, K = probe.shape
    alone = torch.cat([fn(probe[i:i + 1]) for i in range(R)])
    out = {}
    for S in batch_sizes:
        r = min(R, S)
        scale = torch.rand(S, 1, generator=gen) * 8
        batch = (torch.randn(S, K, generator=gen) * scale).to(device=probe.device, dtype=probe.dtype)
        pos = torch.randperm(S, generator=gen)[:r].to(probe.device)
        batch[pos] = probe[:r]
        got = fn(batch)[pos]
        out[f"M={S}"] = sum(not torch.equal(got[i], alone[i]) for i in range(r))
    perm = torch.randperm(R, generator=gen).to(probe.device)
    got = torch.empty_like(alone)
    got[perm] = fn(probe[perm])
    out["shuffled"] = sum(not torch.equal(got[i], alone[i]) for i in range(R))
    return out


def split_k_by_m(w: torch.Tensor) -> Matmul:
    """A deliberately non-invariant matmul: alone, ``matmul_invariant``; in a batch, two halves
    of K rounded to the dtype and added (what a split-K chosen by M does). The checker must
    catch it."""
    h = w.shape[1] // 2

    def fn(x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1:
            return matmul_invariant(x, w)
        lo, hi = matmul_invariant(x[:, :h], w[:, :h]), matmul_invariant(x[:, h:], w[:, h:])
        return (lo.float() + hi.float()).to(x.dtype)

    return fn


def _linear_fns(w: torch.Tensor) -> dict[str, Matmul]:
    fns = {f"block_m:{name}": (lambda x, p=p: matmul_invariant(x, w, block_m=p(x.shape[0])))
           for name, p in BLOCK_M_POLICIES.items()}
    fns["cublas"] = lambda x: F.linear(x, w)
    return fns


def invariance_report(shapes: Mapping[str, tuple[int, int]] | None = None,
                      dtypes: Iterable[torch.dtype] = (torch.bfloat16, torch.float16),
                      batch_sizes: Iterable[int] = BATCH_SIZES, probe_rows: int = 8,
                      timing_ms: Iterable[int] = (1, 8, 64, 1024, 4096), device: str = "cuda",
                      seed: int = 0) -> dict:
    """Bitwise batch invariance and timings on the linear shapes (default: Qwen2.5-3B's).

    Returns {"invariant": {case: bool}, "mismatches": {case: {"M=S": rows, ...}},
    "ms": {case: ms}, "mma": {case: instruction}, "config": {...}}. An invariance case is
    "<dtype>/<shape>/<variant>" with variant ``block_m:<policy>`` (``BLOCK_M_POLICIES``;
    ``block_m:default`` is the deterministic mode's kernel) or ``cublas``
    (torch.nn.functional.linear, for comparison). A timing case is
    "<dtype>/<shape>/M=<m>/<impl>", impl ``matmul_invariant``, ``cublas``, and at M = 1
    ``gemv`` (split-K "auto") and ``gemv_never`` (split-K "never"): GPU time per call in a CUDA
    graph of back-to-back calls (CUDA events), weights rotated out of L2; also
    ``matmul_invariant_<policy>`` where a ``BLOCK_M_POLICIES`` entry changes BLOCK_M at that M,
    and ``matmul_invariant_bn<B>`` for each BLOCK_N (warps and stages as the config picks
    them): the sweep that the default's BLOCK_N rule should be checked against. ``timing_ms=()``
    skips timing (all of it takes minutes: ~60 compiles, 500 timings); off CUDA nothing is
    timed. "mma" says, per "<dtype>/<shape>/M=<m>/block_m=<b>", which instruction the compiled
    kernel uses (``mma_instruction``): the invariance argument assumes wgmma at every M."""
    shapes = GEMV_SHAPES if shapes is None else shapes
    batch_sizes = tuple(batch_sizes)
    report: dict = {"invariant": {}, "mismatches": {}, "ms": {}, "mma": {},
                    "config": {"batch_sizes": batch_sizes, "probe_rows": probe_rows, "seed": seed,
                               "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}}
    for dtype in dtypes:
        for name, (N, K) in shapes.items():
            gen = torch.Generator().manual_seed(seed)
            w = (torch.randn(N, K, generator=gen) * K**-0.5).to(device=device, dtype=dtype)
            probe = torch.randn(probe_rows, K, generator=gen).to(device=device, dtype=dtype)
            for variant, fn in _linear_fns(w).items():
                case = f"{DTYPE_NAMES[dtype]}/{name}/{variant}"
                mism = invariance_mismatches(fn, probe, batch_sizes, gen)
                report["mismatches"][case] = mism
                report["invariant"][case] = not any(mism.values())
            del w, probe
            if torch.cuda.is_available() and device != "cpu":
                for M in (1, 8, 64, 1024):
                    for bm in sorted({p(M) for p in BLOCK_M_POLICIES.values()} - {None}) + [None]:
                        key = f"{DTYPE_NAMES[dtype]}/{name}/M={M}/block_m={bm or 'default'}"
                        report["mma"][key] = mma_instruction(M, N, K, dtype, bm)
                report["ms"].update(matmul_timings(name, N, K, dtype, timing_ms, seed))
    return report


def mma_instruction(M: int, N: int, K: int, dtype: torch.dtype, block_m: int | None = None,
                    device: str = "cuda") -> str:
    """Which instruction ``matmul_invariant``'s kernel multiplies with for this shape and
    BLOCK_M: "wgmma", "mma.sync" or "fma" (read from the compiled kernel's PTX)."""
    x = torch.zeros(M, K, device=device, dtype=dtype)
    w = torch.zeros(N, K, device=device, dtype=dtype)
    out = torch.empty(M, N, device=device, dtype=dtype)
    ptx = _launch(x, w, None, out, invariant_config(M, N, dtype, sm_count_for(x), block_m), None).asm["ptx"]
    return "wgmma" if "wgmma" in ptx else "mma.sync" if "mma.sync" in ptx else "fma"


def matmul_timings(name: str, N: int, K: int, dtype: torch.dtype, ms_for: Iterable[int], seed: int) -> dict[str, float]:
    """GPU ms per call of the invariant matmul (default config, each BLOCK_M policy, each BLOCK_N)
    against cuBLAS and at M = 1 the GEMVs, for an [M, K] x [N, K]^T product: the timing half of
    ``invariance_report`` (keys as there)."""
    out = {}
    gen = torch.Generator(device="cuda").manual_seed(seed)
    ws = weight_copies(N, K, dtype, gen, min_bytes=200e6)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for M in ms_for:
        x = torch.randn(M, K, device="cuda", dtype=dtype, generator=gen)
        y = torch.empty(M, N, device="cuda", dtype=dtype)
        impls = {
            "matmul_invariant": lambda i: matmul_invariant(x, ws[i % len(ws)], out=y),
            "cublas": lambda i: torch.matmul(x, ws[i % len(ws)].T, out=y),
        }
        for policy, p in BLOCK_M_POLICIES.items():
            if p(M) is not None:
                impls[f"matmul_invariant_{policy}"] = lambda i, bm=p(M): matmul_invariant(x, ws[i % len(ws)], out=y,
                                                                                          block_m=bm)
        for bn in BLOCK_N_CHOICES:
            cfg = invariant_config(M, N, dtype, sms, block_n=bn)
            impls[f"matmul_invariant_bn{bn}"] = lambda i, c=cfg: matmul_invariant(x, ws[i % len(ws)], out=y, config=c)
        if M == 1:
            impls["gemv"] = lambda i: gemv(x, ws[i % len(ws)], out=y)
            impls["gemv_never"] = lambda i: gemv(x, ws[i % len(ws)], out=y, split_k="never")
        for impl, fn in impls.items():
            out[f"{DTYPE_NAMES[dtype]}/{name}/M={M}/{impl}"] = graph_ms(fn, calls=len(ws))
    return out
