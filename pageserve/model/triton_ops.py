"""``TritonOps``: the decoder's ops object that runs pageserve's Triton kernels.

Same methods and signatures as ``TorchOps`` (the plain-PyTorch reference it is tested
against). Without CUDA the kernels run only on Triton's CPU interpreter, which must be
switched on (``TRITON_INTERPRET=1``) before triton is first imported: tests and notebooks
do that themselves; importing this module changes no process-wide state.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from ..kernels import (SPLIT_K_MODES, add_rms_norm, gemv, interpreting, load_device_configs, matmul_invariant,
                       reference, chunk_prefill_attention, paged_decode_attention, paged_prefill_attention, rms_norm,
                       rotary, rope_decode_attention, rotary_write_kv, silu_and_mul, silu_mul_gemv, write_kv)
from ..kernels.gate_up_silu import gate_up_silu
from ..kernels.matmul_invariant import InvariantMatmulConfig
from ..kernels.gemv_int8 import dequantize_int8, gemm_int8, gemv_int8, load_int8_device_configs, silu_mul_gemv_int8
from ..kernels.int8_planes import PLANES_MAX_M, gemv_int8_planes, silu_mul_gemv_int8_planes
from ..kernels.lora import lora_shrink
from ..kernels.norm import SplitSum
from ..kernels.int8_planes import supported as planes_supported
from ..kernels._util import PDL_MAX_TOKENS, PDL_MODES, mma_dot_for
from ..kernels.paged_decode import SCHEDULES as _KERNEL_SCHEDULES
from ..kernels.paged_decode import pipelined_device, rope_supported
from ..kernels.paged_prefill import CHUNK_CONFIGS, CHUNK_MIN_TOKENS
from .attention import AttentionMetadata
from .ops import TorchOps
from .quant import QuantizedWeight

# int8 weights: the GEMV (split-K over the int8 tiles) up to this many rows, as measured for issue 12
# before the float GEMV's limit came down to one row (not re-measured for int8 since)
INT8_GEMV_ROWS = 8

INT8_GEMM_MODES = ("auto", "triton", "dequant")
# int8 launches of these many rows run on the digit planes on Hopper (``int8_planes_rows="auto"``). H200 bench at
# 6df6c74, the four 3B linears (the fused SiLU·down in down's place): 40-49 us at 2-8 rows where gemv_int8 took
# 78-83 and bf16 55; at one row 35.6 against gemv_int8's 31.8, so one row keeps the GEMV. 5-8 rows since session
# 25: gemv_int8 on the tuned 16-row tiles (``gemv_int8_config``), SiLU·mul in its own kernel: the graphed 3B step
# at 8 rows 2.49 -> 2.21 ms, two pairs (diagnostics/det_b1_switches_int8_5_8_a2e8d86.*).
INT8_PLANES_ROWS = (2, 4)
# int8 weights: SiLU·mul fused into the down product (the GEMV's or the planes' prologue) up to this many rows,
# else its own kernel first. The same A/B: with it unfused at 2-4 rows the planes' step at 4 rows 2.11 -> 2.06 ms.
INT8_SILU_DOWN_ROWS = 1
# ``decode_schedule``: the kernel's two launches, plus "by_context" (each step's longest context picks one:
# "pipelined" up to ``decode_short_context`` tokens, else "split"; CUDA graphs capture both, see
# ``decode_context_limits``) and "auto" ("by_context" where "pipelined" can run, sm_90; else "split")
DECODE_SCHEDULES = _KERNEL_SCHEDULES + ("by_context", "auto")
# the longest context a "by_context" step runs "pipelined" at. H200 sweeps (kernels.paged_decode.decode_schedule):
# at ~512 tokens pipelined wins (64 x 512 16.2 -> 13.6 us, 128 x 512 26.4 -> 21.0; engine b64 -0.06 ms,
# b128 -0.12), at 64 x 2048 it loses (40.7 -> 42.8), at nano-vllm's ~1,300 it made 33-64-row steps 7% slower
DECODE_SHORT_CONTEXT = 768

# decode batches whose gate_up product takes SiLU·mul in its epilogue (the invariant matmul) instead of cuBLAS
# + the SiLU·mul kernel: on the H200 (graphed 3B step, diagnostics/det_b1_switches_gate_up_silu_0807ae7.*) batch 4
# 2.53 -> 2.42 ms, 16 2.73 -> 2.69, 64 3.15 -> 3.03, but 128 3.84 -> 3.99 and 256 5.35 -> 5.61 (..._21f46ad.*),
# and 80 / 96 / 112 rows +0.22-0.27 ms (..._gate_up_silu_80_112_82a5456.*)
# (Hopper only, where it was measured: elsewhere, a T4 among them, cuBLAS keeps every batch)
GATE_UP_SILU_ROWS = (2, 64)
# decode steps whose RoPE and K/V write run inside the decode attention's launch (``fuse_rope_attention="auto"``),
# not in rope_kv's launch before it. H200, graphed 3B steps at context 512, two alternating pairs
# (diagnostics/det_b1_switches_rope_attention_a048ef2.*): b64 2.930 -> 2.867 ms, b200 4.449 -> 4.410; but b1
# 2.010 -> 2.126 (+0.19 at ddc5f36), not explained (a guess: under PDL the attention's programs enter during the
# 1-row qkv GEMV). nano-vllm's decode steps, four alternating pairs over two runs (diagnostics/
# nanovllm_profile_rope_attention_{45b6a3e,7a9da09}.*): 33-64 rows (context ~1,370) -0.04 ms a step in all four,
# 9-32 -0.05 in three and +0.045 in one, 65-128 -0.03 to -0.04 in three and +0.05 in one; 129-256 rows at ~890
# tokens +0.05 in both pairs that ran it (5.44 -> 5.49), with a kernel that then held 154 registers a thread there
# (the newest token's k and v live through the key loop: 3 programs an SM instead of 4; fixed since,
# scripts/decode_regs.py), and with the fix level at 200 rows x 880 (-0.005 / -0.010 ms, two pairs,
# diagnostics/det_b1_switches_rope_9_up_ff78b7f.*). So from 9 rows (above the PDL steps, ``PDL_MAX_TOKENS``) to
# 128, on every GPU.
ROPE_ATTENTION_ROWS = (PDL_MAX_TOKENS + 1, 128)
# steps whose gate_up product runs ``kernels.gate_up_silu`` (gate and up rows interleaved in one tile, SiLU·mul
# in the epilogue; its persistent TMA default) instead of cuBLAS + the SiLU·mul kernel. H200, 3B gate_up, bf16
# (diagnostics/gate_up_silu_probe_c3d080f.*): 2,048 rows 253 vs 269 us, 4,096 487 vs 607, 8,192 974 vs 1,203 (cuBLAS's
# product alone 943); the non-persistent tile lost at 129-512 rows (..._83d553f.*). Hopper only, where it was measured.
PAIRED_SILU_ROWS = (2048, 1 << 30)
# ``split_to_norm``: which of a decoder layer's products (o, down) a step of ``split_to_norm_rows`` rows computes
# as one batched cuBLAS call over this many K slices with fp32 outputs, left unsummed for the add + RMSNorm
# after it to sum (``kernels.norm.SplitSum``). cuBLAS splits down's K itself at 2-64 rows and sums the slices in a
# launch of its own (H200 b64: 14.3 us + 1.9 for that reduce a layer, diagnostics/profile_steps_chain_ce246be.*);
# here the norm does that sum. H100, graphed 3B steps, two alternating pairs: down in 2 slices b64 3.567 -> 3.480 ms,
# b16 3.189 -> 3.135, b4 2.881 -> 2.861 (diagnostics/det_b1_switches_split_down2_3decee8.*); in 4 slices b64 -0.053,
# in 8 slower (..._split_norm_3decee8.*). At 65-256 rows 2 slices gain as well (at 200 rows cuBLAS runs split-K +
# its reduce too, ..._profile_steps_b200_split_range_c267978.*: -2.7 us a layer; H100, 3B down + norm at 128 / 200 /
# 256 rows: 25.6 / 29.5 / 37.3 us, 2 slices 23.3 / 26.9 / 28.9, diagnostics/split_norm_probe_rows_7c55685.*);
# graphed steps, two pairs, 2 slices to 256 rows: b128 4.51 -> 4.43 ms, b200 5.93 / 5.80 -> 5.49 / 5.48, b256
# 6.18 / 6.11 -> 5.99 / 5.96, b64 level (det_b1_switches_split_range_7c55685.*). On by default on Hopper (sm_90+,
# where it was measured) at 2-256 rows.
SPLIT_TO_NORM_ROWS = (2, 256)
SPLIT_TO_NORM = {"down": 2}


def split_products(x: torch.Tensor, weight: torch.Tensor, slices: int) -> SplitSum:
    """x [T, K] @ weight [N, K]^T as ``slices`` K slices' fp32 products in one batched call: a ``SplitSum``
    of [slices, T, N] (``reference.split_products``'s values; on CUDA cuBLAS's strided-batched GEMM with
    fp32 outputs, ``torch.bmm(out_dtype=)``, no copy of x or the weight; elsewhere in fp32)."""
    T, K = x.shape
    ks = K // slices
    if x.stride(-1) != 1:
        x = x.contiguous()
    if weight.stride(-1) != 1:  # the strided views below read rows of K contiguous columns
        weight = weight.contiguous()
    if not x.is_cuda:
        return SplitSum(reference.split_products(x, weight, slices), x.dtype)
    xs = x.as_strided((slices, T, ks), (ks, x.stride(0), 1))
    ws = weight.as_strided((slices, ks, weight.shape[0]), (ks, 1, weight.stride(0)))
    if x.dtype == torch.float32:
        return SplitSum(torch.bmm(xs, ws), x.dtype)
    return SplitSum(torch.bmm(xs, ws, out_dtype=torch.float32), x.dtype)


def _row_range(name: str, value, auto: tuple[int, int] | None) -> tuple[int, int] | None:
    """A (lo, hi) row-range option: None, "auto" (-> ``auto``) or two ints with 1 <= lo <= hi."""
    value = auto if value == "auto" else value
    if value is not None and not (isinstance(value, (tuple, list)) and len(value) == 2
                                  and all(isinstance(r, int) for r in value) and 1 <= value[0] <= value[1]):
        raise ValueError(f"{name} must be None or (lo, hi) with 1 <= lo <= hi, got {value!r}")
    return None if value is None else tuple(value)


class TritonOps(TorchOps):
    """Same methods and signatures as ``TorchOps``; each runs a Triton kernel.

    ``gemv``: use the GEMV for ``linear`` when the batch has at most ``gemv_max_m`` rows
    (larger batches, and ``gemv=False``, go to cuBLAS through torch). One row by default: on the
    H200 the graphed 3B decode step took 4.51 ms at batch 2 with the GEMV up to 8 rows against
    2.73 with cuBLAS from 2 rows (2.16 at batch 1 either way; diagnostics/det_b1_switches_6bad32f.*).
    Int8 weights keep their GEMV up to ``INT8_GEMV_ROWS`` (8) rows (the fused SiLU·down at one row).
    ``gemv_split_k``: ``"auto"`` splits K (GEMV + reduce kernel) where rows alone give too
    few programs; ``"never"`` always runs one kernel with narrower row tiles.
    ``decode_num_splits``: force the split count of the decode kernel (None: from shapes).
    ``decode_schedule``: how the decode kernel is launched (``paged_decode_attention``'s ``schedule``):
    "split" or "pipelined" (faster at contexts of ~512, slower at ~1,300 on the H200;
    ``kernels.paged_decode.decode_schedule`` has the figures) for every step, or "by_context":
    "pipelined" for steps whose longest context is at most ``decode_short_context`` tokens, else
    "split" (the decode CUDA graphs capture both: ``decode_context_limits``). "auto" (default):
    "by_context" where "pipelined" runs (sm_90), else "split".
    Decode-only batches (``meta.max_query_len == 1`` and one query row per sequence) use the
    CUDA-graph-safe decode kernel; anything else the prefill kernel. ``chunk_attention``: in eager
    steps (host-built tile maps), chunks of at least ``CHUNK_MIN_TOKENS`` new tokens run
    ``chunk_prefill_attention`` instead (FlashAttention-2 tiling, the chunk's own keys from the step's
    rotated k/v; the paged kernel takes the decodes and shorter chunks). "auto" (default): on sm_90,
    where it was measured; elsewhere (a T4 among them) the paged kernel takes every row.

    Kernel-count switches for the decode path (on by default: on the H200 each made the
    batch-1 step faster and batch 64 no slower, results/h200/diagnostics/decode_switches.json; off, each
    op runs as the separate kernels it replaces):
    ``fuse_silu_down``: ``silu_mul_linear`` as one GEMV reading gate|up (M <= gemv_max_m).
    ``fuse_rope_kv``: ``rotary_write_kv`` as one kernel.
    ``fuse_rope_attention``: in decode-only steps, RoPE and the K/V write inside the decode attention's
    launch (``kernels.paged_decode.rope_decode_attention``) instead of ``rotary_write_kv`` before it
    (head sizes that are powers of two): True (every decode step), False, (lo, hi): steps of lo..hi rows,
    or "auto" (default): ``ROPE_ATTENTION_ROWS``.
    ``paired_silu_rows``: (lo, hi) or None: steps of lo..hi rows (outside ``gate_up_silu_rows``) run the gate_up
    product through ``kernels.gate_up_silu`` (gate and up rows interleaved in one tile: one MMA chain, SiLU·mul
    in the epilogue, no [T, 2I] intermediate) instead of cuBLAS + the SiLU·mul kernel; float weights only.
    "auto" (default): ``PAIRED_SILU_ROWS`` on Hopper, None elsewhere. ``paired_silu_config``: its tile
    (an ``InvariantMatmulConfig``; None: ``gate_up_silu``'s default).
    ``split_to_norm_rows``: (lo, hi) or None: in steps of lo..hi rows the products named in ``split_to_norm``
    ({"o": slices, "down": slices}), whose only reader is the next add + RMSNorm (``linear_to_norm``), run as
    one batched cuBLAS call over that many equal K slices with fp32 outputs (``split_products``); the norm
    kernel sums the slices in order and rounds once before its residual add (``kernels.norm.SplitSum``), the
    work of a split-K reduce launch. Float weights, K a multiple of the slices, and not where the one-row
    GEMV runs. "auto" (default): ``SPLIT_TO_NORM_ROWS`` on Hopper (where it was measured), None elsewhere.
    ``gate_up_silu_rows``: (lo, hi) or None: steps of lo..hi rows run the MLP's gate_up product with
    SiLU·mul in its epilogue (``kernels.matmul_invariant(silu_mul=True)``, its generic compile) instead
    of cuBLAS followed by the SiLU·mul kernel; float weights only. "auto" (default): ``GATE_UP_SILU_ROWS``
    on Hopper GPUs (sm_90+, measured on the H200), None elsewhere (GPUs not measured, the interpreter).

    Launch settings, held by this object and passed to every kernel call (two objects with
    different settings run side by side):
    ``tuned_configs``: the GEMV tile configs by shape (``self.gemv_configs``). True: on CUDA,
    the ones tuned for this GPU model if the package ships them (``kernels/configs/<gpu>.json``);
    False: none; a mapping ``config_key -> GemvConfig`` (``kernels.parse_configs`` reads a bench
    JSON): these. Shapes without an entry use the heuristic.
    ``pdl``: programmatic dependent launch for the decode-path kernels over at most
    ``pdl_max_rows`` rows (default and cap: ``kernels._util.PDL_MAX_TOKENS``, 8): each kernel's
    launch overlaps the tail of the one before it (H200, batch-1 step 2.41 -> 2.20 ms).
    None = on where the GPU (sm_90+) and Triton support it; False = never. The attention, RoPE and
    norm kernels load their step inputs (the norms their weight) before the wait (``kernels._util``;
    batch 1 -0.05 ms on the H200); "wait_first" waits at every kernel's top, as before (for A/Bs).

    Int8 weights (a ``QuantizedWeight`` from ``model.quant``): up to ``INT8_GEMV_ROWS`` rows the int8
    GEMV (``silu_mul_linear`` fused up to ``int8_silu_down_rows``); above, ``int8_gemm`` picks the path:
    ``"triton"``: the int8 GEMM (reads int8 tiles, half the bytes); ``"dequant"``: dequantize the
    weight into a float buffer, then cuBLAS; ``"auto"``: the int8 GEMV (split-K, ``tl.dot`` on 32-64
    row tiles) up to ``int8_gemv_max_m`` rows, the GEMM up to ``int8_gemm_max_m`` rows, dequantize +
    cuBLAS above (prefill chunks: compute-bound). On the H200 at cceced8 the unsplit GEMM lost to
    dequantize + cuBLAS from M = 64 up (128 vs 118 us a layer; 280 vs 136 at 256), so by default
    ``int8_gemm_max_m`` equals ``int8_gemv_max_m``: no GEMM until the split-K GEMM is measured.
    ``int8_tuned_configs``: as ``tuned_configs``, for the int8 kernels (``int8_config_key``; the
    ``int8_tuned_configs`` section of ``kernels/configs/<gpu>.json``).
    ``int8_planes_rows``: (lo, hi): launches of lo..hi rows with int8 weights (the fused SiLU·down
    too, where ``int8_silu_down_rows`` reaches) run ``kernels/int8_planes.py`` instead: x as int8
    digit planes on the integer MMAs, the weights never converted (bf16/fp16 x on sm_80+; elsewhere
    the paths above). None: never; "auto": ``INT8_PLANES_ROWS`` on Hopper (where it was measured),
    else None.
    ``int8_silu_down_rows``: int8 launches of at most this many rows (0..8) take SiLU·mul inside the down
    product (``INT8_SILU_DOWN_ROWS``: one row); larger ones run the SiLU·mul kernel first.
    """

    name = "triton"
    graph_safe = True  # no host syncs, grids from shapes: decode steps can be captured in CUDA graphs
    # LoRA: the masked first product in one launch (kernels/lora.py), the second and its add one addmm_
    lora_kernels = True

    def __init__(self, gemv: bool = True, gemv_max_m: int = 1, decode_num_splits: int | None = None,
                 gemv_split_k: str = "auto", fuse_silu_down: bool = True, fuse_rope_kv: bool = True,
                 fuse_rope_attention: bool | tuple[int, int] | str = "auto",
                 tuned_configs: bool | Mapping = True, pdl: bool | str | None = None, int8_gemm: str = "auto",
                 int8_gemm_max_m: int = 64, int8_tuned_configs: bool | Mapping = True,
                 int8_gemv_max_m: int = 64, int8_planes_rows: tuple[int, int] | str | None = "auto",
                 int8_silu_down_rows: int = INT8_SILU_DOWN_ROWS,
                 pdl_max_rows: int = PDL_MAX_TOKENS, prefill_tile_map: bool = True,
                 prefill_tile_order: str = "heavy_first", prefill_diag_mask: bool = True,
                 chunk_attention: bool | str = "auto", decode_schedule: str = "auto",
                 decode_short_context: int = DECODE_SHORT_CONTEXT, gate_up_silu_rows: tuple[int, int] | str | None = "auto",
                 paired_silu_rows: tuple[int, int] | str | None = "auto",
                 paired_silu_config: InvariantMatmulConfig | None = None,
                 split_to_norm_rows: tuple[int, int] | str | None = "auto",
                 split_to_norm: Mapping[str, int] | None = None) -> None:
        if gemv_split_k not in SPLIT_K_MODES:
            raise ValueError(f"gemv_split_k must be one of {SPLIT_K_MODES}, got {gemv_split_k!r}")
        if int8_gemm not in INT8_GEMM_MODES:
            raise ValueError(f"int8_gemm must be one of {INT8_GEMM_MODES}, got {int8_gemm!r}")
        if isinstance(int8_tuned_configs, Mapping):
            self.int8_configs = dict(int8_tuned_configs)
        elif int8_tuned_configs and torch.cuda.is_available() and not interpreting():
            self.int8_configs = load_int8_device_configs(torch.cuda.get_device_name())
        else:
            self.int8_configs = {}
        self.int8_gemm = int8_gemm
        self.int8_gemm_max_m = int8_gemm_max_m
        if not 0 <= int8_gemv_max_m <= 64:
            raise ValueError(f"int8_gemv_max_m must be in 0..64 (the GEMV's limit), got {int8_gemv_max_m}")
        self.int8_gemv_max_m = int8_gemv_max_m
        if int8_planes_rows == "auto":
            hopper = torch.cuda.is_available() and not interpreting() and torch.cuda.get_device_capability()[0] >= 9
            int8_planes_rows = INT8_PLANES_ROWS if hopper else None
        if int8_planes_rows is not None and not (
                isinstance(int8_planes_rows, (tuple, list)) and len(int8_planes_rows) == 2
                and all(isinstance(r, int) for r in int8_planes_rows)
                and 1 <= int8_planes_rows[0] <= int8_planes_rows[1] <= PLANES_MAX_M):
            raise ValueError(f"int8_planes_rows must be None, 'auto' or (lo, hi) with 1 <= lo <= hi <= {PLANES_MAX_M}, "
                             f"got {int8_planes_rows!r}")
        self.int8_planes_rows = None if int8_planes_rows is None else tuple(int8_planes_rows)
        if not (isinstance(int8_silu_down_rows, int) and 0 <= int8_silu_down_rows <= INT8_GEMV_ROWS):
            raise ValueError(f"int8_silu_down_rows must be in 0..{INT8_GEMV_ROWS}, got {int8_silu_down_rows!r}")
        self.int8_silu_down_rows = int8_silu_down_rows
        if isinstance(tuned_configs, Mapping):
            self.gemv_configs = dict(tuned_configs)
        elif tuned_configs and torch.cuda.is_available() and not interpreting():
            self.gemv_configs = load_device_configs(torch.cuda.get_device_name())
        else:
            self.gemv_configs = {}
        self.use_gemv = gemv
        self.gemv_max_m = gemv_max_m
        self.decode_num_splits = decode_num_splits
        if decode_schedule not in DECODE_SCHEDULES:
            raise ValueError(f"decode_schedule must be one of {DECODE_SCHEDULES}, got {decode_schedule!r}")
        if decode_schedule == "auto":
            decode_schedule = "by_context" if pipelined_device() else "split"
        self.decode_schedule = decode_schedule
        if not (isinstance(decode_short_context, int) and decode_short_context > 0):
            raise ValueError(f"decode_short_context must be a positive int, got {decode_short_context!r}")
        self.decode_short_context = decode_short_context
        self.gemv_split_k = gemv_split_k
        self.fuse_silu_down = fuse_silu_down
        self.fuse_rope_kv = fuse_rope_kv
        if isinstance(fuse_rope_attention, bool):
            fuse_rope_attention = (1, 1 << 30) if fuse_rope_attention else None
        self.rope_attention_rows = _row_range("fuse_rope_attention", fuse_rope_attention, ROPE_ATTENTION_ROWS)
        hopper = torch.cuda.is_available() and not interpreting() and torch.cuda.get_device_capability()[0] >= 9
        self.gate_up_silu_rows = _row_range("gate_up_silu_rows", gate_up_silu_rows, GATE_UP_SILU_ROWS if hopper else None)
        self.paired_silu_rows = _row_range("paired_silu_rows", paired_silu_rows, PAIRED_SILU_ROWS if hopper else None)
        if paired_silu_config is not None and not isinstance(paired_silu_config, InvariantMatmulConfig):
            raise ValueError(f"paired_silu_config must be None or an InvariantMatmulConfig, got {paired_silu_config!r}")
        self.paired_silu_config = paired_silu_config
        self.split_to_norm_rows = _row_range("split_to_norm_rows", split_to_norm_rows,
                                             SPLIT_TO_NORM_ROWS if hopper else None)
        split_to_norm = dict(SPLIT_TO_NORM if split_to_norm is None else split_to_norm)
        if not all(k in ("o", "down") and isinstance(v, int) and v >= 1 for k, v in split_to_norm.items()):
            raise ValueError(f"split_to_norm must map 'o' / 'down' to slice counts >= 1, got {split_to_norm!r}")
        self.split_to_norm = split_to_norm
        if not 0 <= pdl_max_rows <= PDL_MAX_TOKENS:
            raise ValueError(f"pdl_max_rows must be in 0..{PDL_MAX_TOKENS}, got {pdl_max_rows}")
        if pdl not in PDL_MODES:
            raise ValueError(f"pdl must be one of {PDL_MODES}, got {pdl!r}")
        self.pdl = pdl
        self.pdl_max_rows = pdl_max_rows
        # False: the prefill kernel's old grid (every sequence gets max_query_len's tiles), for A/Bs
        self.prefill_tile_map = prefill_tile_map
        if prefill_tile_order not in ("heavy_first", "sequence"):
            raise ValueError(f"prefill_tile_order must be 'heavy_first' or 'sequence', got {prefill_tile_order!r}")
        # the map's tiles longest first, or in sequence order (session 16's A/B)
        self.prefill_tile_order = prefill_tile_order
        # False: the causal mask on every key tile of a prefill block, as before session 30 (the A/B)
        self.prefill_diag_mask = prefill_diag_mask
        if chunk_attention == "auto":
            chunk_attention = torch.cuda.is_available() and not interpreting() and torch.cuda.get_device_capability()[0] >= 9
        if not isinstance(chunk_attention, bool):
            raise ValueError(f"chunk_attention must be a bool or 'auto', got {chunk_attention!r}")
        self.chunk_attention = chunk_attention

    def pdl_for(self, rows: int) -> bool | str | None:
        """``pdl`` for a launch over ``rows`` rows: False above ``pdl_max_rows``."""
        return False if rows > self.pdl_max_rows else self.pdl

    def _gemv_fits(self, x: torch.Tensor, max_m: int | None = None) -> bool:
        max_m = self.gemv_max_m if max_m is None else max_m
        return self.use_gemv and x.dim() == 2 and 0 < x.shape[0] <= max_m and x.stride(-1) == 1

    def lora_shrink(self, x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor, width: int,
                    norm_weight: torch.Tensor | None = None, eps: float = 0.0, silu_mul: bool = False,
                    counters: torch.Tensor | None = None) -> torch.Tensor:
        if not mma_dot_for(x):  # below sm_80 its dot tiles run on FMAs and spill (t4_compile_audit): the reference
            return super().lora_shrink(x, a, token_slots, width, norm_weight, eps, silu_mul)
        return lora_shrink(x if x.stride(-1) == 1 else x.contiguous(), a, token_slots, width, norm_weight, eps,
                           silu_mul, counters=counters)

    def linear(self, x: torch.Tensor, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
        if isinstance(weight, QuantizedWeight):
            return self._linear_int8(x, weight, bias)
        if self._gemv_fits(x):
            return gemv(x, weight, bias, split_k=self.gemv_split_k, configs=self.gemv_configs,
                        pdl=self.pdl_for(x.shape[0]))
        return torch.nn.functional.linear(x, weight, bias)

    def linear_to_norm(self, x: torch.Tensor, weight, which: str):
        slices, r = self.split_to_norm.get(which, 1), self.split_to_norm_rows
        if (slices > 1 and r is not None and r[0] <= x.shape[0] <= r[1] and x.dim() == 2
                and not isinstance(weight, QuantizedWeight) and weight.shape[1] % slices == 0
                and not self._gemv_fits(x)):
            return split_products(x, weight, slices)
        return self.linear(x, weight, None)

    def head(self, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        # above the GEMV's rows cuBLAS writes the logits into ``out`` itself (the decode graphs' shared
        # buffer), the same product as ``linear`` without a copy of [T, V] after it
        if out is not None and not self._gemv_fits(x) and x.dim() == 2 and out.dtype == x.dtype:
            return torch.mm(x, weight.t(), out=out)
        return super().head(x, weight, out)

    def _planes_fit(self, x: torch.Tensor) -> bool:
        r = self.int8_planes_rows
        return (r is not None and self._gemv_fits(x, r[1]) and x.shape[0] >= r[0]
                and x.dtype in (torch.bfloat16, torch.float16) and planes_supported(x.device))

    def _linear_int8(self, x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] > 1 and not mma_dot_for(x):
            # below sm_80 (a T4) Triton's dots run on FMAs, where the int8 GEMV's 2-64-row tl.dot tiles
            # spill (scripts/t4_compile_audit.py): those rows take the dequantize + cuBLAS path of larger M
            return torch.nn.functional.linear(x if x.stride(-1) == 1 else x.contiguous(),
                                              dequantize_int8(w.qweight, w.scale), bias)
        if self._planes_fit(x):
            return gemv_int8_planes(x, w.qweight, w.scale, bias, configs=self.int8_configs, pdl=self.pdl_for(x.shape[0]))
        if self._gemv_fits(x, INT8_GEMV_ROWS):
            return gemv_int8(x, w.qweight, w.scale, bias, split_k=self.gemv_split_k, configs=self.int8_configs,
                             pdl=self.pdl_for(x.shape[0]))
        x = x if x.stride(-1) == 1 else x.contiguous()
        if self.int8_gemm == "auto" and self.use_gemv and x.dim() == 2 and x.shape[0] <= self.int8_gemv_max_m:
            # decode batches: a split-K skinny GEMM over the int8 weight; no PDL above 8 rows (_util)
            return gemv_int8(x, w.qweight, w.scale, bias, configs=self.int8_configs, pdl=self.pdl_for(x.shape[0]))
        if self.int8_gemm == "triton" or (self.int8_gemm == "auto" and x.shape[0] <= self.int8_gemm_max_m):
            return gemm_int8(x, w.qweight, w.scale, bias, configs=self.int8_configs, pdl=self.pdl_for(x.shape[0]))
        # a fresh [N, K] buffer from the caching allocator: the same block every call of this shape
        return torch.nn.functional.linear(x, dequantize_int8(w.qweight, w.scale), bias)

    def silu_mul_linear(self, gate_up: torch.Tensor, weight: torch.Tensor | QuantizedWeight, defer_sum: bool = False):
        if isinstance(weight, QuantizedWeight):
            fused = self.fuse_silu_down and gate_up.shape[0] <= self.int8_silu_down_rows
            if fused and self._planes_fit(gate_up):
                return silu_mul_gemv_int8_planes(gate_up, weight.qweight, weight.scale, configs=self.int8_configs,
                                                 pdl=self.pdl_for(gate_up.shape[0]))
            if fused and self._gemv_fits(gate_up, INT8_GEMV_ROWS):
                return silu_mul_gemv_int8(gate_up, weight.qweight, weight.scale, split_k=self.gemv_split_k,
                                          configs=self.int8_configs, pdl=self.pdl_for(gate_up.shape[0]))
            return super().silu_mul_linear(gate_up, weight, defer_sum)  # silu_and_mul kernel, then the int8 linear
        if self.fuse_silu_down and self._gemv_fits(gate_up):
            return silu_mul_gemv(gate_up, weight, split_k=self.gemv_split_k, configs=self.gemv_configs,
                                 pdl=self.pdl_for(gate_up.shape[0]))
        return super().silu_mul_linear(gate_up, weight, defer_sum)  # silu_and_mul kernel, then linear_to_norm

    def _gate_up_silu_fits(self, rows: int, weight) -> bool:
        r = self.gate_up_silu_rows
        return r is not None and r[0] <= rows <= r[1] and not isinstance(weight, QuantizedWeight)

    def _paired_silu_fits(self, rows: int, weight) -> bool:
        r = self.paired_silu_rows
        return r is not None and r[0] <= rows <= r[1] and not isinstance(weight, QuantizedWeight)

    def silu_in_gate_up_for(self, rows: int, weight) -> bool:
        return self.silu_in_gate_up or self._gate_up_silu_fits(rows, weight) or self._paired_silu_fits(rows, weight)

    def gate_up_silu_mul(self, x: torch.Tensor, weight) -> torch.Tensor:
        if not self._gate_up_silu_fits(x.shape[0], weight):
            if self._paired_silu_fits(x.shape[0], weight):
                x = x if x.stride(-1) == 1 else x.contiguous()
                return gate_up_silu(x, weight, config=self.paired_silu_config, pdl=self.pdl_for(x.shape[0]))
            return super().gate_up_silu_mul(x, weight)
        x = x if x.stride(-1) == 1 else x.contiguous()
        # the generic compile: one per tile config, not one per graph bucket's row count
        return matmul_invariant(x, weight, None, pdl=self.pdl_for(x.shape[0]), silu_mul=True, specialize=False)

    def warm_gate_up_silu(self, weight) -> int:
        """Compile ``gate_up_silu`` before the engine serves, through the very call a step makes
        (``gate_up_silu_mul``: the same config and PDL setting, which is a compile-time constant; a
        1-row warm-up would compile the PDL variant no step of 2,048+ rows runs). At the range's first
        two row counts: the row count is not specialized in the pointer kernel, but the TMA descriptors
        carry it too. Returns the launches made (0 where it never runs)."""
        if self.paired_silu_rows is None or isinstance(weight, QuantizedWeight):
            return 0
        lo, hi = self.paired_silu_rows
        rows = sorted({lo, min(lo + 1, hi)})
        for m in rows:
            self.gate_up_silu_mul(torch.zeros(m, weight.shape[1], dtype=weight.dtype, device=weight.device), weight)
        return len(rows)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps, pdl=self.pdl_for(x.shape[0]))

    def add_rms_norm(self, x, residual, weight, eps):
        return add_rms_norm(x, residual, weight, eps, pdl=self.pdl_for(x.shape[0]))

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(gate_up, pdl=self.pdl_for(gate_up.shape[0]))

    def rotary(self, q, k, positions, cos_sin):
        return rotary(q, k, positions, cos_sin, pdl=self.pdl_for(q.shape[0]))

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        write_kv(k, v, k_cache, v_cache, slot_mapping, pdl=self.pdl_for(k.shape[0]))

    def rotary_write_kv(self, q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping):
        if self.fuse_rope_kv:
            return rotary_write_kv(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping,
                                   pdl=self.pdl_for(q.shape[0]))
        return super().rotary_write_kv(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping)

    def _decode_only(self, q: torch.Tensor, meta: AttentionMetadata) -> bool:
        return meta.max_query_len == 1 and q.shape[0] == meta.seq_lens.shape[0]

    def rope_in_decode_attention(self, q: torch.Tensor, meta: AttentionMetadata) -> bool:
        r = self.rope_attention_rows
        return (r is not None and r[0] <= q.shape[0] <= r[1] and self._decode_only(q, meta)
                and rope_supported(q.shape[-1]))

    def rope_decode_attention(self, q, k, v, positions, cos_sin, k_cache, v_cache, meta: AttentionMetadata,
                              scale: float) -> torch.Tensor:
        return rope_decode_attention(q, k, v, positions, cos_sin, k_cache, v_cache, meta.slot_mapping, meta.seq_lens,
                                     meta.block_tables, scale, num_splits=self.decode_num_splits,
                                     pdl=self.pdl_for(q.shape[0]), schedule=self.decode_schedule_for(meta.max_seq_len))

    def decode_context_limits(self) -> tuple[int | None, ...]:
        """The context classes a decode step's launch depends on, shortest first: (limit, None) under
        "by_context" (steps whose longest context is at most ``limit``, then every other), else (None,).
        The decode CUDA graphs capture one graph per class and bucket (``engine.cuda_graphs``)."""
        return (self.decode_short_context, None) if self.decode_schedule == "by_context" else (None,)

    def decode_schedule_for(self, max_seq_len: int | None) -> str:
        """The kernel's schedule for a decode step whose longest context is ``max_seq_len`` (None:
        not known, as "split" would run)."""
        if self.decode_schedule != "by_context":
            return self.decode_schedule
        short = max_seq_len is not None and max_seq_len <= self.decode_short_context
        return "pipelined" if short else "split"

    def chunk_attention_for(self, meta: AttentionMetadata) -> bool:
        # eager steps only: the chunk launch's tile map is built on the host (a graphed mixed step's is static)
        return (self.chunk_attention and meta.max_query_len >= CHUNK_MIN_TOKENS
                and meta.query_start_loc_cpu is not None and "static_tiles" not in meta.scratch)

    def chunk_kv_attention(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        out = chunk_prefill_attention(q, k, v, k_cache, v_cache, meta, scale)
        return paged_prefill_attention(q, k_cache, v_cache, meta, scale, out=out, tile_map=True,
                                       heavy_first=self.prefill_tile_order == "heavy_first",
                                       diag_mask=self.prefill_diag_mask, part="short", short_len=CHUNK_MIN_TOKENS - 1)

    def warm_chunk_attention(self, k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int) -> int:
        """Compile the chunk launch at each of its tile configs before the engine serves, so that no
        request pays the compile (seen on the H200: chat's first chunk over 2,048 tokens compiled mid-run,
        diagnostics/chat_profile_chunk_ab_4807f40.json). One 64-token chunk over cache block 0 (read,
        never written), its q, k and v laid out as the decoder's (v a view of a qkv row). Returns the
        launches made (0 with ``chunk_attention`` off)."""
        if not self.chunk_attention:
            return 0
        page, Hkv, D = k_cache.shape[1:]
        T, dev, dtype = CHUNK_MIN_TOKENS, k_cache.device, k_cache.dtype
        q = torch.zeros(T, num_heads, D, dtype=dtype, device=dev)
        k = torch.zeros(T, Hkv, D, dtype=dtype, device=dev)
        qkv = torch.zeros(T, (num_heads + 2 * Hkv) * D, dtype=dtype, device=dev)
        v = qkv[:, (num_heads + Hkv) * D:].view(T, Hkv, D)
        meta = AttentionMetadata(
            slot_mapping=torch.full((T,), -1, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor([0, T], dtype=torch.int32, device=dev),
            seq_lens=torch.tensor([T], dtype=torch.int32, device=dev),
            block_tables=torch.zeros(1, -(-T // page), dtype=torch.int32, device=dev),
            max_query_len=T, max_seq_len=T, query_start_loc_cpu=[0, T], seq_lens_cpu=[T])
        for block_m, block_n, warps, stages in CHUNK_CONFIGS:
            meta.scratch.clear()
            chunk_prefill_attention(q, k, v, k_cache, v_cache, meta, D ** -0.5, block_m=block_m, block_n=block_n,
                                    num_warps=warps, num_stages=stages)
        return len(CHUNK_CONFIGS)

    def paged_attention(self, q: torch.Tensor, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if self._decode_only(q, meta):
            return paged_decode_attention(q, k_cache, v_cache, meta.seq_lens, meta.block_tables, scale,
                                          num_splits=self.decode_num_splits, pdl=self.pdl_for(q.shape[0]),
                                          schedule=self.decode_schedule_for(meta.max_seq_len))
        tile_map = None if self.prefill_tile_map else False
        return paged_prefill_attention(q, k_cache, v_cache, meta, scale, tile_map=tile_map,
                                       heavy_first=self.prefill_tile_order == "heavy_first",
                                       diag_mask=self.prefill_diag_mask)
