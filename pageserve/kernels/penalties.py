"""The repetition penalty over the tokens each row has seen, in one launch.

Reference: ``pageserve.kernels.reference.repetition_penalty``. The sampler's torch path for it
(``Sampler._apply_penalties``: the seen ids uploaded, each id's row expanded with ``repeat_interleave``, the flat
indices built, gathered, penalised and scattered back) is ~14 launches a step; on the H200's host, where a launch
costs ~16 µs, that is ~0.2 ms of every step with Qwen2.5-Instruct's defaults (repetition_penalty 1.05), which the
GPU finishes in a few µs. Here one program a penalised row reads its seen ids and their logits, penalises them into a
scratch buffer, waits for the whole program (a barrier), then writes them back: a token seen twice is read twice
before either write, so it is penalised once, as in the reference; the division and the product are IEEE-rounded,
so the bits are the reference's. A newest token still on the device (async scheduling) is read from ``pending``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference import repetition_penalty as repetition_penalty_reference
from ._util import check, check_device, pdl_args, pdl_enter

__all__ = ["repetition_penalty", "repetition_penalty_reference"]

BLOCK = 1024  # seen ids a program reads at a time


@triton.jit
def _repetition_penalty_kernel(logits_ptr, stride_l, rows_ptr, starts_ptr, ids_ptr, penalty_ptr, pending_ptr,
                               pending_src_ptr, scratch_ptr, BLOCK: tl.constexpr, HAS_PENDING: tl.constexpr,
                               USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    j = tl.program_id(0)
    row = tl.load(rows_ptr + j).to(tl.int64)
    start = tl.load(starts_ptr + j)
    end = tl.load(starts_ptr + j + 1)
    rep = tl.load(penalty_ptr + row)
    base = logits_ptr + row * stride_l
    lanes = tl.arange(0, BLOCK)
    if HAS_PENDING:  # the newest token, on the device only: read and penalised here, kept in registers
        src = tl.load(pending_src_ptr + j)
        one = (lanes == 0) & (lanes * 0 + src >= 0)
        newest = tl.load(pending_ptr + tl.maximum(src, 0) + lanes * 0, mask=one, other=0)
        x = tl.load(base + newest, mask=one, other=0.0)
        newest_value = tl.where(x > 0, tl.math.div_rn(x, rep), x * rep)
    for off in range(start, end, BLOCK):
        t = off + lanes
        inside = t < end
        tok = tl.load(ids_ptr + t, mask=inside, other=0)
        x = tl.load(base + tok, mask=inside, other=0.0)
        tl.store(scratch_ptr + t, tl.where(x > 0, tl.math.div_rn(x, rep), x * rep), mask=inside)
    tl.debug_barrier()  # every read of the row's logits lands before any write
    for off in range(start, end, BLOCK):
        t = off + lanes
        inside = t < end
        tok = tl.load(ids_ptr + t, mask=inside, other=0)
        tl.store(base + tok, tl.load(scratch_ptr + t, mask=inside, other=0.0), mask=inside)
    if HAS_PENDING:
        tl.store(base + newest, newest_value, mask=one)


def repetition_penalty(logits: torch.Tensor, rows: torch.Tensor, starts: torch.Tensor, ids: torch.Tensor,
                       penalty: torch.Tensor, pending: torch.Tensor | None = None,
                       pending_src: torch.Tensor | None = None, pdl: bool | None = None) -> torch.Tensor:
    """The reference's ``repetition_penalty`` in one launch, in place. ``logits`` [B, V] fp32 (last dim contiguous),
    ``rows`` [P] int32 (distinct), ``starts`` [P + 1] int32, ``ids`` [S] int32, ``penalty`` [B] fp32, ``pending``
    [B'] int64 and ``pending_src`` [P] int32, or both None. Returns ``logits``. ``pdl``: see ``_util.use_pdl``,
    except that any row count may use it, as the argmax's (``_util``: a PDL launch between two decode graph
    replays)."""
    check("logits", logits, ndim=2, dtype=torch.float32)
    check("penalty", penalty, ndim=1, dtype=torch.float32)
    for name, t in (("rows", rows), ("starts", starts), ("ids", ids)):
        check(name, t, ndim=1, dtype=torch.int32)
    P = rows.shape[0]
    if starts.shape[0] != P + 1:
        raise ValueError(f"repetition_penalty: {P} rows need {P + 1} starts, not {starts.shape[0]}")
    if (pending is None) != (pending_src is None):
        raise ValueError("repetition_penalty: pending and pending_src go together")
    if pending is not None:
        check("pending", pending, ndim=1, dtype=torch.int64)
        check("pending_src", pending_src, shape=(P,), dtype=torch.int32)
    check_device(logits=logits, rows=rows, starts=starts, ids=ids, penalty=penalty,
                 **({} if pending is None else {"pending": pending, "pending_src": pending_src}))
    if logits.shape[1] > 1 and logits.stride(1) != 1:
        raise ValueError("repetition_penalty: logits need a contiguous last dimension")
    if P:
        scratch = torch.empty(ids.shape[0], dtype=torch.float32, device=logits.device)
        _repetition_penalty_kernel[(P,)](
            logits, logits.stride(0), rows, starts, ids, penalty, rows if pending is None else pending,
            rows if pending_src is None else pending_src, scratch, BLOCK=BLOCK, HAS_PENDING=pending is not None,
            num_warps=4, **pdl_args(logits, 1, pdl))
    return logits
