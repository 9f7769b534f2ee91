"""A decode step's inputs into the CUDA graphs' static buffers, in one launch.

Reference: ``pageserve.kernels.reference.stage_decode_inputs``. Before each replay the graph
runner refreshes five static buffers (input ids, positions, slots, context lengths, block
tables) and marks the padded rows of its bucket (slot -1, length 0). As PyTorch copies that
is five to nine small kernels on the stream ahead of the graph, each a launch of its own at
batch 1; here one program per row of the bucket does all of it. Context lengths and block
tables are narrowed to the static buffers' dtype (int32 for the attention kernels) on the way.
Columns of the block table past the step's width ``nb`` are left as they were: attention
reads a row's table only up to its length.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference import stage_decode_inputs as stage_decode_inputs_reference
from ._util import check, check_device, pdl_args, pdl_enter

__all__ = ["stage_decode_inputs", "stage_decode_inputs_reference"]

_INT_DTYPES = (torch.int32, torch.int64)
_BLOCK_NB = 128  # fixed, so a growing context never compiles a new variant mid-run


# The sources are views at step-dependent offsets of one packed int64 buffer: specialising on
# their alignment (or on bs, nb == 1) would compile new variants in the middle of serving.
@triton.jit(do_not_specialize=["bs", "nb", "stride_src", "stride_dst"],
            do_not_specialize_on_alignment=["ids_src", "pos_src", "slot_src", "lens_src", "bt_src"])
def _stage_decode_kernel(
    ids_src, pos_src, slot_src, lens_src, bt_src,
    ids_dst, pos_dst, slot_dst, lens_dst, bt_dst,
    bs, nb, stride_src, stride_dst,
    BLOCK_NB: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    r = tl.program_id(0).to(tl.int64)
    if r < bs:
        tl.store(ids_dst + r, tl.load(ids_src + r).to(ids_dst.dtype.element_ty))
        tl.store(pos_dst + r, tl.load(pos_src + r).to(pos_dst.dtype.element_ty))
        tl.store(slot_dst + r, tl.load(slot_src + r).to(slot_dst.dtype.element_ty))
        tl.store(lens_dst + r, tl.load(lens_src + r).to(lens_dst.dtype.element_ty))
        for j0 in range(0, nb, BLOCK_NB):
            j = j0 + tl.arange(0, BLOCK_NB)
            m = j < nb
            b = tl.load(bt_src + r * stride_src + j, mask=m)
            tl.store(bt_dst + r * stride_dst + j, b.to(bt_dst.dtype.element_ty), mask=m)
    else:  # a padded row: it writes no KV (slot -1) and attends to nothing (length 0)
        tl.store(ids_dst + r, tl.zeros((), ids_dst.dtype.element_ty))
        tl.store(pos_dst + r, tl.zeros((), pos_dst.dtype.element_ty))
        tl.store(slot_dst + r, tl.full((), -1, slot_dst.dtype.element_ty))
        tl.store(lens_dst + r, tl.zeros((), lens_dst.dtype.element_ty))


def stage_decode_inputs(
    input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor, seq_lens: torch.Tensor,
    block_tables: torch.Tensor, dst: tuple[torch.Tensor, ...], padded: int, pdl: bool | None = False,
) -> None:
    """Copy bs rows of decode inputs into the static buffers ``dst`` = (input_ids [max_bs],
    positions [max_bs], slot_mapping [max_bs], seq_lens [max_bs], block_tables [max_bs,
    max_blocks]) and mark rows bs..padded-1 as padding. Sources: [bs] and [bs, nb] integer
    tensors (any integer dtype the destination can hold; not range-checked). ``pdl``: off by
    default (as measured so far); None/True: ``_util.use_pdl`` at any batch size, for the A/B
    that asks whether a PDL launch before a replay helps as one after it does (kernels/NOTES.md)."""
    ids_d, pos_d, slot_d, lens_d, bt_d = dst
    bs = input_ids.shape[0]
    check("block_tables", block_tables, ndim=2, dtype=_INT_DTYPES)
    nb = block_tables.shape[1]
    for name, t in (("input_ids", input_ids), ("positions", positions), ("slot_mapping", slot_mapping),
                    ("seq_lens", seq_lens)):
        check(name, t, shape=(bs,), dtype=_INT_DTYPES)
    max_bs = ids_d.shape[0]
    for name, t in (("dst input_ids", ids_d), ("dst positions", pos_d), ("dst slot_mapping", slot_d),
                    ("dst seq_lens", lens_d)):
        check(name, t, shape=(max_bs,), dtype=_INT_DTYPES)
    check("dst block_tables", bt_d, shape=(max_bs, None), dtype=_INT_DTYPES)
    if not 0 < bs <= padded <= max_bs or nb > bt_d.shape[1]:
        raise ValueError(f"stage_decode_inputs: {bs} rows of {nb} blocks padded to {padded} do not fit "
                         f"buffers of {max_bs} rows x {bt_d.shape[1]} blocks")
    check_device(input_ids=input_ids, positions=positions, slot_mapping=slot_mapping, seq_lens=seq_lens,
                 block_tables=block_tables, dst=ids_d)
    _stage_decode_kernel[(padded,)](
        input_ids, positions, slot_mapping, seq_lens, block_tables,
        ids_d, pos_d, slot_d, lens_d, bt_d,
        bs, nb, block_tables.stride(0), bt_d.stride(0),
        BLOCK_NB=_BLOCK_NB, num_warps=1, **pdl_args(ids_d, 1, pdl),
    )
