"""One-shot all-reduce over peer-to-peer buffers, for the small messages of a TP decode step.

A decode step at batch 1 makes 2 × num_layers all-reduces of [1, hidden] (4 KiB at the
Qwen2.5-3B shape): NCCL's per-call latency, not bandwidth, is what they cost. Here every
rank owns one buffer that all ranks can address (CUDA IPC, opened by
``pageserve.model.custom_allreduce``), laid out as

    [ flags: MAX_BLOCKS × world int64 ][ slot 0: world × cap bytes ][ slot 1: world × cap bytes ]

and each program (block) of the kernel, for its share of the elements:

1. *push*: stores its rank's input into slot ``s`` / row ``rank`` of every peer's buffer;
2. *signal*: after a block barrier, one release store of ``c`` (this block's call count)
   into each peer's flag ``[block, rank]``;
3. *wait*: spins until its own flags ``[block, p]`` reach ``c`` for every peer ``p``;
4. *sum*: adds the world's rows in rank order (its own from the input itself) in fp32 and
   writes the output — the same order on every rank, so every rank gets the same bits.

Why this is safe without a second barrier: ``c`` only grows (flags are compared with ``>=``,
so a peer already on call ``c + 1`` does not hide call ``c``), and the two slots alternate
with ``c``. A rank can write slot ``s`` again only at call ``c + 2``, after passing call
``c + 1``'s wait, which its peers signalled after finishing call ``c``'s kernel (one stream,
kernels in order). Block ``b`` of one rank only ever talks to block ``b`` of another, so the
grid must be the same on every rank for the same message (it is: it depends on ``n`` only)
and small enough that all its blocks are resident at once (at most ``MAX_BLOCKS``).

The call count lives in device memory (``counters``), not in an argument, so a captured
CUDA graph replays correctly: each replay reads and bumps it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._util import cdiv, pdl_args, pdl_enter

MAX_BLOCKS = 128  # programs per call (and flag rows per rank): at most one per SM on an H200
BLOCK = 2048  # elements a program moves per iteration (8 warps: one 16-byte vector a thread in 16 bits)


def flag_bytes(world: int) -> int:
    """Bytes of the flag area at the head of every rank's buffer."""
    return MAX_BLOCKS * world * 8


@triton.jit
def _one_shot_allreduce_kernel(x_ptr, out_ptr, n, data_ptr, bases_ptr, counters_ptr, rank, cap_elems,
                               FLAG_BYTES: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr,
                               USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)  # x is the previous kernel's output: wait for it (its launch overlapped)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    elem = x_ptr.dtype.element_ty
    ELEM_BYTES: tl.constexpr = elem.primitive_bitwidth // 8
    c = tl.load(counters_ptr + pid) + 1  # this block's call number, the same on every rank
    slot = c % 2
    own = tl.load(bases_ptr + rank)
    # data_ptr is my buffer's data (a real pointer: the compiler knows its alignment and
    # vectorizes); a peer's data is that pointer plus the distance between the buffers, in
    # elements (every buffer is 16-byte aligned, so the distance is a multiple of 16 bytes)
    mine = data_ptr + slot * WORLD * cap_elems  # this call's slot: [WORLD, cap_elems]

    # 1. push my rows into every peer's buffer: slot, row `rank`
    for start in range(pid * BLOCK, n, nprog * BLOCK):
        offs = tl.max_contiguous(tl.multiple_of(start, BLOCK) + tl.arange(0, BLOCK), BLOCK)
        m = offs < n
        v = tl.load(x_ptr + offs, mask=m)
        for p in tl.static_range(WORLD):
            if p != rank:
                dist = tl.multiple_of((tl.load(bases_ptr + p) - own) // ELEM_BYTES, 16 // ELEM_BYTES)
                tl.store(mine + dist + rank * cap_elems + offs, v, mask=m)
    tl.debug_barrier()  # every thread's stores happen before the release below

    # 2. tell each peer this block's rows of call c have landed
    for p in tl.static_range(WORLD):
        if p != rank:
            flag = tl.load(bases_ptr + p).to(tl.pointer_type(tl.int64)) + pid * WORLD + rank
            tl.atomic_xchg(flag, c, sem="release", scope="sys")

    # 3. wait until every peer has said the same to me
    for p in tl.static_range(WORLD):
        if p != rank:
            flag = own.to(tl.pointer_type(tl.int64)) + pid * WORLD + p
            seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
            while seen < c:
                seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
    tl.debug_barrier()

    # 4. sum the rows in rank order (the same bits on every rank)
    for start in range(pid * BLOCK, n, nprog * BLOCK):
        offs = tl.max_contiguous(tl.multiple_of(start, BLOCK) + tl.arange(0, BLOCK), BLOCK)
        m = offs < n
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for p in tl.static_range(WORLD):
            if p == rank:
                v = tl.load(x_ptr + offs, mask=m, other=0.0)
            else:
                v = tl.load(mine + p * cap_elems + offs, mask=m, other=0.0, cache_modifier=".cg")
            acc += v.to(tl.float32)
        tl.store(out_ptr + offs, acc.to(elem), mask=m)
    tl.store(counters_ptr + pid, c)


def one_shot_all_reduce(x: torch.Tensor, out: torch.Tensor, buffer: torch.Tensor, bases: torch.Tensor,
                        counters: torch.Tensor, rank: int, world: int, cap_bytes: int,
                        pdl: bool | None = None) -> torch.Tensor:
    """``out`` = the sum over ``world`` ranks of each rank's ``x`` (``out`` may be ``x``).

    ``buffer``: this rank's buffer, uint8 [flag_bytes(world) + 2 · world · cap_bytes] (flags,
    then two slots of ``world × cap_bytes``), 16-byte aligned like every rank's. ``bases``:
    int64 [world] on this device, the address of every rank's buffer as seen from this process
    (``bases[rank] == buffer.data_ptr()``). ``counters``: int64 [MAX_BLOCKS] of this rank's
    call counts, zero at the start, touched by nothing else. Every rank must call this with the
    same shape, in the same order. ``pdl``: programmatic dependent launch for decode-sized
    messages (``_util.use_pdl``)."""
    if not (x.is_contiguous() and out.is_contiguous() and x.shape == out.shape and x.dtype == out.dtype):
        raise ValueError("one_shot_all_reduce needs contiguous x and out of one shape and dtype")
    if x.numel() * x.element_size() > cap_bytes:
        raise ValueError(f"message of {x.numel() * x.element_size()} bytes exceeds the buffer's {cap_bytes}")
    if bases.dtype != torch.int64 or bases.numel() != world or counters.numel() < MAX_BLOCKS:
        raise ValueError("bases must be int64 [world] and counters int64 [MAX_BLOCKS]")
    if cap_bytes % 16 or buffer.dtype != torch.uint8 or buffer.numel() < flag_bytes(world) + 2 * world * cap_bytes:
        raise ValueError("buffer must be uint8 of flag_bytes(world) + 2 * world * cap_bytes bytes, cap_bytes a multiple of 16")
    n = x.numel()
    data = buffer[flag_bytes(world):].view(x.dtype)
    grid = (max(1, min(MAX_BLOCKS, cdiv(n, BLOCK))),)
    _one_shot_allreduce_kernel[grid](x, out, n, data, bases, counters, rank, cap_bytes // x.element_size(),
                                     FLAG_BYTES=flag_bytes(world), WORLD=world, BLOCK=BLOCK, num_warps=8,
                                     **pdl_args(x, x.shape[0] if x.dim() > 1 else 1, pdl))
    return out
