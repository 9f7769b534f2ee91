"""The repetition penalty over the tokens each row has seen, in one launch.

Reference: ``pageserve.kernels.reference.repetition_penalty``. The sampler's torch path for it
(``Sampler._apply_penalties``: the seen ids uploaded, each id's row expanded with ``repeat_interleave``, the flat
indices built, gathered, penalised and scattered back) is ~14 launches a step; on the H200's host, where a launch
costs ~16 µs, that is ~0.2 ms of every step with Qwen2.5-Instruct's defaults (repetition_penalty 1.05), which the
GPU finishes in a few µs. Here one program a penalised row reads its seen ids and their logits, penalises them into a
scratch buffer, waits for the whole program (a barrier), then writes them back: a token seen twice is read twice
before either write, so it is penalised once, as in the reference; the division and the product are IEEE-rounded,
so the bits are the reference's. A newest token still on the device (async scheduling) is read from ``pending``.

``seen_words`` + ``seen_penalty``: the same penalty applied where the logits are read, not written. The penalty
kernel works in place on fp32 logits, so a 16-bit model's [B, V] logits were first converted to a new fp32 tensor:
at 256 rows of Qwen2.5's 151,936 that copy (78 MB read, 156 MB written) and the candidate pick's read of it were
most of what Qwen2.5-Instruct's default sampling cost over plain sampling (NOTES, session 54). Instead,
``seen_words`` sets one bit per seen token ([B, ceil(V / 32)] int32 words, 4.9 MB at 256 rows), and the pick and the
race (``kernels/topk_select.py``, ``kernels/candidate_race.py``) read the model's own logits and apply
``seen_penalty`` to each value they read: the same fp32 value, the same division or product, so the same bits as
the penalty kernel's (reference: ``reference.seen_words``, ``reference.apply_seen``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference import repetition_penalty as repetition_penalty_reference, seen_words as seen_words_reference
from ._util import check, check_device, pdl_args, pdl_enter

__all__ = ["repetition_penalty", "repetition_penalty_reference", "seen_words", "seen_words_reference", "seen_penalty",
           "penalise_where", "check_seen"]

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


@triton.jit
def seen_penalty(v, col, words_row, rep, mask):
    """fp32 values ``v`` at columns ``col`` (``mask``: where read) of one row, with the repetition penalty ``rep``
    applied where the row's bits at ``words_row`` (``seen_words``) mark the token seen: the penalty kernel's ops."""
    w = tl.load(words_row + (col >> 5), mask=mask, other=0)
    return penalise_where(v, ((w >> (col & 31).to(tl.int32)) & 1) != 0, rep)


@triton.jit
def penalise_where(v, seen, rep):
    """The repetition penalty ``rep`` on fp32 values ``v`` where ``seen``: divided where positive, multiplied where
    not (IEEE-rounded: the penalty kernel's and the reference's bits)."""
    return tl.where(seen, tl.where(v > 0, tl.math.div_rn(v, rep), v * rep), v)


@triton.jit
def _seen_words_kernel(words_ptr, stride_w, W, rows_ptr, starts_ptr, ids_ptr, pending_ptr, pending_src_ptr,
                       BLOCK: tl.constexpr, HAS_PENDING: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    j = tl.program_id(0)
    row = tl.load(rows_ptr + j).to(tl.int64)
    start = tl.load(starts_ptr + j)
    end = tl.load(starts_ptr + j + 1)
    base = words_ptr + row * stride_w
    lanes = tl.arange(0, BLOCK)
    for off in range(start, end, BLOCK):  # ids repeat: OR, so each lands once whichever order they meet in
        t = off + lanes
        inside = t < end
        tok = tl.load(ids_ptr + t, mask=inside, other=0)
        inside &= (tok >= 0) & ((tok >> 5) < W)  # an id past the row's words would set another row's bit
        tl.atomic_or(base + (tok >> 5), (1 << (tok & 31)).to(tl.int32), mask=inside)
    if HAS_PENDING:
        src = tl.load(pending_src_ptr + j)
        one = (lanes == 0) & (lanes * 0 + src >= 0)
        tok = tl.load(pending_ptr + tl.maximum(src, 0) + lanes * 0, mask=one, other=0).to(tl.int32)
        one &= (tok >= 0) & ((tok >> 5) < W)
        tl.atomic_or(base + (tok >> 5), (1 << (tok & 31)).to(tl.int32), mask=one)


def seen_words(batch: int, vocab_size: int, rows: torch.Tensor, starts: torch.Tensor, ids: torch.Tensor,
               pending: torch.Tensor | None = None, pending_src: torch.Tensor | None = None,
               pdl: bool | None = None) -> torch.Tensor:
    """The reference's ``seen_words`` in two launches (the zeroed words, then one program a row setting its bits):
    [batch, ceil(vocab_size / 32)] int32 on ``ids``' device; the arguments as ``repetition_penalty``'s (ids below
    ``vocab_size``: one past the row's last word is dropped, never another row's). ``pdl``: as
    ``repetition_penalty``'s."""
    P = _check_seen_ids("seen_words", rows, starts, ids, pending, pending_src)
    words = torch.zeros(batch, (vocab_size + 31) // 32, dtype=torch.int32, device=ids.device)
    if P:
        _seen_words_kernel[(P,)](
            words, words.stride(0), words.shape[1], rows, starts, ids, rows if pending is None else pending,
            rows if pending_src is None else pending_src, BLOCK=BLOCK, HAS_PENDING=pending is not None,
            num_warps=4, **pdl_args(words, 1, pdl))
    return words


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
    P = _check_seen_ids("repetition_penalty", rows, starts, ids, pending, pending_src)
    check_device(logits=logits, rows=rows, penalty=penalty)
    if logits.shape[1] > 1 and logits.stride(1) != 1:
        raise ValueError("repetition_penalty: logits need a contiguous last dimension")
    if P:
        scratch = torch.empty(ids.shape[0], dtype=torch.float32, device=logits.device)
        _repetition_penalty_kernel[(P,)](
            logits, logits.stride(0), rows, starts, ids, penalty, rows if pending is None else pending,
            rows if pending_src is None else pending_src, scratch, BLOCK=BLOCK, HAS_PENDING=pending is not None,
            num_warps=4, **pdl_args(logits, 1, pdl))
    return logits


def _check_seen_ids(what: str, rows: torch.Tensor, starts: torch.Tensor, ids: torch.Tensor,
                    pending: torch.Tensor | None, pending_src: torch.Tensor | None) -> int:
    """The seen ids' checks (``repetition_penalty``'s and ``seen_words``' arguments), all on one device; -> P."""
    for name, t in (("rows", rows), ("starts", starts), ("ids", ids)):
        check(name, t, ndim=1, dtype=torch.int32)
    P = rows.shape[0]
    if starts.shape[0] != P + 1:
        raise ValueError(f"{what}: {P} rows need {P + 1} starts, not {starts.shape[0]}")
    if (pending is None) != (pending_src is None):
        raise ValueError(f"{what}: pending and pending_src go together")
    if pending is not None:
        check("pending", pending, ndim=1, dtype=torch.int64)
        check("pending_src", pending_src, shape=(P,), dtype=torch.int32)
    check_device(rows=rows, starts=starts, ids=ids,
                 **({} if pending is None else {"pending": pending, "pending_src": pending_src}))
    return P


def check_seen(seen: tuple[torch.Tensor, torch.Tensor] | None, x: torch.Tensor):
    """``seen``'s (words, penalty) checked against ``x`` [B, V] (the pick and race kernels' ``seen``), or
    (None, None)."""
    if seen is None:
        return None, None
    words, rep = seen
    B, V = x.shape
    check("words", words, shape=(B, (V + 31) // 32), dtype=torch.int32)
    check("penalty", rep, shape=(B,), dtype=torch.float32)
    return words, rep
