"""Weights into L2 while the decode step's latency-bound kernels run (an opt-in hint; sm_90+).

At one to a few rows a decode layer alternates between kernels that stream weights (the GEMVs) and
kernels that move almost no bytes but take microseconds of latency (RoPE + KV write, the attention
and its merge, the norms). During the second kind HBM idles. ``l2_prefetch`` asks L2 for the first
bytes of the weights the layer reads next (o, then gate|up, then down), so those products find part
of their weight in L2. It changes no value: each program issues ``prefetch.global.L2`` for its
128-byte lines and computes nothing.

It is a kernel of its own in the stream, launched after the qkv projection; under programmatic
dependent launch its programs keep the rule of ``_util`` (wait before exit; weights are never
written, so they may be asked for before the wait: ``before_wait``). Session 3's negative result
(each GEMV program asking L2 for its own slice while the GEMV before it streamed) was a prefetch
competing with a bandwidth-bound kernel; this one is meant to overlap the latency-bound ones.

No reference: there is nothing to compute. On the CPU interpreter (no inline PTX) the wrapper does
nothing; ``prefetch_plan`` (the lines each tensor gets under a byte budget) is what the CPU tests see.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._util import cdiv, interpreting, next_pow2, pdl_args, pdl_enter, sm_count_for

LINE = 128  # bytes an L2 prefetch asks for
MAX_TENSORS = 3
EVICT = ("normal", "last")


@triton.jit
def _prefetch_lines(base, n_lines, lo, LINES: tl.constexpr, EVICT_LAST: tl.constexpr):
    """Ask L2 for lines [lo, lo + LINES) of the tensor at ``base`` (indices clamped into [0, n_lines))."""
    idx = tl.minimum(tl.maximum(lo + tl.arange(0, LINES), 0), n_lines - 1)
    ptrs = base.to(tl.pointer_type(tl.uint8)) + idx.to(tl.int64) * 128
    if EVICT_LAST:
        tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", "=r,l", [ptrs],
                                  dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _l2_prefetch_kernel(p0, n0, p1, n1, p2, n2, LINES: tl.constexpr, EVICT_LAST: tl.constexpr,
                        BEFORE_WAIT: tl.constexpr, USE_PDL: tl.constexpr):
    # the tensors' lines laid end to end: [0, n0) of p0, then n1 of p1, then n2 of p2
    lo = tl.program_id(0) * LINES
    if not BEFORE_WAIT:
        pdl_enter(USE_PDL)
    if lo < n0:
        _prefetch_lines(p0, n0, lo, LINES, EVICT_LAST)
    if (lo + LINES > n0) & (lo < n0 + n1):
        _prefetch_lines(p1, n1, lo - n0, LINES, EVICT_LAST)
    if (lo + LINES > n0 + n1) & (lo < n0 + n1 + n2):
        _prefetch_lines(p2, n2, lo - n0 - n1, LINES, EVICT_LAST)
    if BEFORE_WAIT:
        pdl_enter(USE_PDL)  # no program exits unwaited (_util's rule)


def prefetch_plan(tensors, budget_bytes: int) -> list[int]:
    """Lines (of 128 bytes) to ask for from each tensor, in order, until ``budget_bytes`` is spent.
    Each tensor must be contiguous (its bytes are one range)."""
    lines, left = [], max(0, int(budget_bytes)) // LINE
    for t in tensors:
        if not t.is_contiguous():
            raise ValueError(f"l2_prefetch: tensor of shape {tuple(t.shape)} is not contiguous")
        n = min(cdiv(t.numel() * t.element_size(), LINE), left)
        lines.append(n)
        left -= n
    return lines


def prefetch_grid(total_lines: int, sms: int) -> tuple[int, int]:
    """(lines a program, programs): about one program per SM, 256 to 8,192 lines each."""
    per = min(8192, max(256, next_pow2(cdiv(total_lines, max(1, sms)))))
    return per, cdiv(total_lines, per)


def l2_prefetch(tensors, budget_bytes: int, rows: int = 1, evict: str = "normal", before_wait: bool = False,
                pdl: bool | str | None = None) -> None:
    """Ask L2 for the first ``budget_bytes`` of ``tensors`` (up to three, contiguous, in the order the
    step reads them). ``rows``: the step's row count (for the PDL decision). No-op on the interpreter
    and on tensors off CUDA."""
    if evict not in EVICT:
        raise ValueError(f"l2_prefetch: evict must be one of {EVICT}, got {evict!r}")
    tensors = list(tensors)
    if not 0 < len(tensors) <= MAX_TENSORS:
        raise ValueError(f"l2_prefetch: 1 to {MAX_TENSORS} tensors, got {len(tensors)}")
    if interpreting() or not tensors[0].is_cuda:
        return
    lines = prefetch_plan(tensors, budget_bytes)
    total = sum(lines)
    if total == 0:
        return
    while len(tensors) < MAX_TENSORS:
        tensors.append(tensors[0])
        lines.append(0)
    per, programs = prefetch_grid(total, sm_count_for(tensors[0]))
    _l2_prefetch_kernel[(programs,)](tensors[0], lines[0], tensors[1], lines[1], tensors[2], lines[2],
                                     LINES=per, EVICT_LAST=evict == "last", BEFORE_WAIT=before_wait,
                                     num_warps=4, **pdl_args(tensors[0], rows, pdl))
