"""Ops for ``EngineConfig(deterministic=True)``: every row computed the same way whatever the batch.

In the default ops a row's bits depend on what else is in the step: cuBLAS and the decode
GEMVs pick tiles and split-K by the number of rows, the decode attention splits the context
by a count that depends on the batch, and prefill and decode attention reduce in different
orders. Here each op computes a row with one reduction order that depends only on that row
(its values, its position), so a sequence's logits are bitwise the same alone or in a batch of
any size, prefilled in one chunk or several, from a prefix-cache hit or not, graphed or eager.
docs/deterministic.md lists each op and why it is invariant.

``DeterministicOps`` (CUDA, or Triton's CPU interpreter): ``kernels.matmul_invariant`` for
every float linear (decode rows, prefill chunks and the LM head alike: one fixed K tiling, no
split-K) and ``kernels.paged_attention_invariant`` for every attention (one kernel for prefill
and decode, KV split by a fixed *size*). Where cuBLAS computes a linear's very bits (checked per
weight shape and row count on this GPU, ``cublas_rows``), the linear runs on cuBLAS: the same
bits, sooner. SiLU·mul runs in the gate_up matmul's epilogue
(``silu_in_gate_up``: elementwise on that product's rounded values, as the separate kernel).
Norms (one program per row), RoPE and the KV write are ``TritonOps``' own kernels, already
invariant.

``DeterministicTorchOps`` (the CPU reference path): the same contract from plain PyTorch by
computing the linears and the attention one row at a time, so every call has the same shape
whatever the batch. Slow, and meant for the CPU smoke runs and tests.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from ..kernels import interpreting, reference
from ..kernels._util import use_pdl
from ..kernels.gate_up_silu import gate_up_silu
from ..kernels.matmul_invariant import PDL_RELEASES
from ..kernels.paged_decode import rope_supported
from ..kernels.paged_invariant import LAUNCH_OPTIONS, invariant_block_m
from .ops import TorchOps
from .quant import QuantizedWeight
from .triton_ops import PAIRED_SILU_ROWS, TritonOps, _row_range


def _probe_rows(M: int, weight: torch.Tensor, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A bit probe's input: M random rows for ``weight``'s K, each scaled by up to 8 (mixed magnitudes)."""
    gen = torch.Generator(device=weight.device).manual_seed(seed)
    scale = torch.rand(M, 1, device=weight.device, generator=gen) * 8
    return (torch.randn(M, weight.shape[1], device=weight.device, generator=gen) * scale).to(dtype)


def _all_bits_equal(fast: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Every element of ``fast`` has ``ref``'s bits: a bool tensor on their device (asking costs no sync).
    Another order of the fp32 sums shows in few 16-bit outputs (the rounding hides the rest: on the interpreter
    1-4 of 16,384 for the paired kernel at K = 320), so a probe is as sure as it is large: at the 3B shapes it
    holds M x N >= 128 x 2,048 outputs (the paired kernel's: >= 2,048 x 11,008)."""
    if fast.shape != ref.shape:
        return torch.zeros((), dtype=torch.bool, device=ref.device)
    bits = torch.int16 if fast.element_size() == 2 else torch.int32
    return (fast.view(bits) == ref.view(bits)).all()


def _refuse_int8(weight) -> None:
    if isinstance(weight, QuantizedWeight):
        raise ValueError("deterministic mode does not support int8 weights (its kernels split by batch)")


class DeterministicOps(TritonOps):
    """``TritonOps`` with the batch-dependent kernels replaced by batch-invariant ones.

    ``kv_split``: tokens per KV split of the attention (a fixed size, so the number of
    splits a row sees depends only on its position). ``matmul_block_m``: force the matmul's
    row tile (None: its measured policy; see ``kernels.matmul_invariant``).
    ``attention_prefill_block_m``: taller attention tiles for steps with chunks, with MMA row
    sums (``kernels.paged_invariant``; other bits than None, so one setting per run). "auto":
    128 on Hopper (sm_90+), where the H200 measured its bits (gpu_det_tests at 12c46862) and
    its speed, else None (16-row tiles: a T4's 64 KB of shared memory, and GPUs not measured).
    ``silu_in_gate_up_max_rows``: the most rows whose SiLU·mul runs in the gate_up matmul's
    epilogue (below). ``matmul_specialize``: which compile of the matmul kernels (None: the
    M-specialized one inside graph captures; ``kernels.matmul_invariant``). ``attention_launch``:
    keywords of ``paged_attention_invariant`` that choose a launch (``LAUNCH_OPTIONS``: programs, walk,
    stages, warps; None: its policy). None of these changes a bit: they are there to time the batch-1
    step with and without each (scripts/det_b1_switches.py). ``rope_in_attention``: the most rows of a
    decode-only step whose RoPE and K/V write run inside the attention's split launch
    (``paged_attention_invariant(rope=...)``, the same bits as rope_kv's launch before it:
    tests/test_attention_invariant.py) instead of a launch of their own (0: never). On the H200 at 02b5869
    (diagnostics/det_b1_switches_rope_in_attention_02b5869.*, two pairs) inside the launch the graphed 3B step
    took 2.525 / 2.526 ms at one row against 2.557 / 2.551, 2.660 / 2.661 at four against 2.690 / 2.691, but
    3.383 / 3.387 at 64 against 3.279 / 3.281, and W1 70.4k against 71.5k: so up to 4 rows.
    ``silu_in_gate_up_pdl``: the SiLU·mul epilogue on launches with PDL too (below), letting the next kernel
    (down) launch at ``gate_up_pdl_release`` ("after_loop", or "top" as every other PDL launch;
    ``matmul_invariant``'s ``pdl_release``). Neither changes a bit.

    ``cublas_rows``: (lo, hi), the row counts at which a linear may run on cuBLAS instead (None: never;
    "auto": ``CUBLAS_ROWS`` on CUDA, else never). Not an approximation: for each weight shape, dtype,
    bias and row count M the first call computes a probe of M random rows (mixed magnitudes) both ways
    and keeps cuBLAS for that (shape, M) only if every output element has the invariant kernel's bits;
    outside a CUDA-graph capture (the warm-up run before each capture decides for its bucket). On the
    H200 (diagnostics/cublas_bits_probe_aaeaaed.*) cuBLAS gave the invariant bits for every row at every
    M from 1 to 8,192 on qkv, o, gate_up and the LM head, bf16 and fp16 (its kernels there are one wgmma
    chain over K in K order, as ours), and on down (K = 11,008) from 448 rows, split-K below (0 rows of
    M equal; fp16 at 512 rows too: why the check is per M). Where equal it is the faster one from 128
    rows (qkv 9.8 vs 13.3 us, gate_up 63.1 vs 73.3, down 35.0 vs 47.5, LM head 416 vs 476 at 512 rows);
    the decode steps of W1 (~500 rows) and chunks of mixed steps live there. ``fast_linear``: the
    function tried (tests substitute it). ``probe_blocking``: True (from construction through the engine's
    start-up, graph captures included), the first call waits for its probe's answer; False (the engine sets it
    once its graphs are captured), the probe is queued on the GPU with its answer copied to a pinned host
    flag, and the call, and every call of that (shape, M) until the answer is back, runs the invariant
    kernel: no host sync in a serving step (on the H200 the waiting probes cost W1's first pass 59.0k
    tok/s against 71.5k for its second, diagnostics/det_w1_switches_4c8457e.*).

    ``paired_rows``: (lo, hi), the row counts at which the MLP's gate_up product and its SiLU·mul may run as
    ``kernels.gate_up_silu`` (the default mode's kernel for prefill-sized steps: gate and up rows in one tile,
    one MMA chain, SiLU·mul in the epilogue) instead of the product followed by the SiLU·mul kernel; checked
    per (shape, rows) by a probe as cuBLAS is, against what this mode computes otherwise (the invariant
    product, then ``silu_and_mul``), so taken only where every bit is that path's. "auto": the default mode's
    ``PAIRED_SILU_ROWS`` (2,048 rows up) on Hopper GPUs, never elsewhere; None: never. On the H200 the kernel
    took 974 µs at 8,192 rows of the 3B gate_up against 1,203 for cuBLAS + the SiLU·mul kernel
    (diagnostics/gate_up_silu_probe_c3d080f.*): W1's prefill steps are 8,192 rows."""

    # cuBLAS tried from 128 rows (where the probe timed it faster on every 3B shape but o, which is level)
    # to 8,192, the default token budget: eager steps' rows are padded to buckets in this mode and every
    # bucket is probed at start-up. Up to session 48 the top was 2,048 (the largest graphed step); on an
    # H100, 8,192 took det W1 from 0.900 to 0.923 of the default mode (session 49, det_w1_switches_ec91ff9)
    CUBLAS_ROWS = (128, 8192)
    fast_linear = staticmethod(F.linear)
    fast_gate_up_silu = staticmethod(gate_up_silu)  # the paired kernel ``paired_rows`` tries (tests substitute it)

    name = "deterministic"
    lora_kernels = False  # LoRA's products through the invariant ``linear`` (cuBLAS's addmm_ is not invariant)
    # mixed steps (chunks, speculative verify steps) replayed from CUDA graphs (engine/mixed_graphs.py, the
    # static tile maps of ``mixed_tile_maps``). On since session 49: on an H100 the det tests (169) and 09's
    # comparisons (16 of 16, graphed chunks vs eager ones included) passed with them, and a 3B verify step at
    # batch 1 took 4.6 ms against ~30 eager. PAGESERVE_DET_MIXED_GRAPHS=0 turns them off for a process.
    mixed_graphs = os.environ.get("PAGESERVE_DET_MIXED_GRAPHS", "1") != "0"

    def mixed_tile_maps(self, group: int, device: torch.device) -> list[tuple[int, str, int]]:
        """The query tile maps ``paged_attention`` reads in a chunked step, as (tokens a tile, part, short
        length) of ``query_tile_map``: the small tiles' map of every sequence (the merge's, and the one launch's
        without tall tiles) and, with tall tiles (``prefill_block_m_for``), the decodes' small-tile map and the
        chunks' tall-tile map (``paged_attention_invariant``'s two launches)."""
        small = invariant_block_m(group)
        maps = [(small // group, "all", 0)]
        tall = self.prefill_block_m_for(device)
        if tall is not None:
            maps += [(small // group, "short", small // group), (tall // group, "long", small // group)]
        return maps

    def eager_row_buckets_for(self, device: torch.device) -> bool:
        """On where cuBLAS may be probed (``cublas_rows`` on CUDA): eager steps' rows padded to buckets, and
        every bucket's linears called at start-up, so each (shape, rows) an eager step can meet has had its
        probe before the first request (on the H200 the probes met during W1's first pass cost it 0.78x the
        default's throughput with a host sync each, 0.84x without one, against 0.93x in its second pass:
        diagnostics/det_w1_switches_{4c8457e,async_probe_6c44762}.*). Padding rows change no real row's bits."""
        return self.cublas_rows_for(device) is not None

    def __init__(self, kv_split: int | None = None, matmul_block_m: int | None = None,
                 attention_prefill_block_m: int | str | None = "auto", silu_in_gate_up_max_rows: int = 1024,
                 matmul_specialize: bool | None = None, attention_launch: dict | None = None,
                 cublas_rows: tuple[int, int] | str | None = "auto", rope_in_attention: int = 4,
                 silu_in_gate_up_pdl: bool = True, gate_up_pdl_release: str = "after_loop",
                 paired_rows: tuple[int, int] | str | None = "auto", **triton_options) -> None:
        # the decode fusions read through the GEMV: off, so silu·down is silu_and_mul + the matmul
        triton_options.setdefault("fuse_silu_down", False)
        # its attention is kernels/paged_invariant.py, which takes RoPE and the K/V write itself
        # (``rope_in_attention``): the default decode kernel's fusion is not its
        if triton_options.setdefault("fuse_rope_attention", False):
            raise ValueError("deterministic mode: fuse_rope_attention is the default decode kernel's; its attention "
                             "is the batch-invariant one")
        # the default mode's gate_up epilogue policy (2-64 rows on Hopper) is not this mode's: its own
        # gate_up_silu_mul decides, and its fallback under PDL must be the product + the SiLU·mul kernel (with
        # that policy inherited, batch 4 ran the epilogue under PDL: 3.07 ms a graphed 3B step against 2.74,
        # diagnostics/det_b1_switches_det_b1_parts_3416e93.*)
        triton_options.setdefault("gate_up_silu_rows", None)
        # the default mode's paired gate_up + SiLU·mul kernel: not by its row policy, but where a probe finds
        # this mode's bits (``paired_rows``)
        triton_options.setdefault("paired_silu_rows", None)
        # PDL up to 4 rows: on the H200 the graphed 3B decode step at batch 8 took 3.17 ms with it,
        # 3.01 without; at 1-4 rows it gains 0.17-0.19 ms (diagnostics/det_b1_switches_6bad32f.*)
        triton_options.setdefault("pdl_max_rows", 4)
        triton_options.setdefault("chunk_attention", False)  # nothing to warm: chunk_attention_for is always False
        super().__init__(**triton_options)
        self.kv_split = kv_split
        self.matmul_block_m = matmul_block_m
        if not isinstance(rope_in_attention, int) or isinstance(rope_in_attention, bool) or rope_in_attention < 0:
            raise ValueError(f"rope_in_attention: a row count >= 0, got {rope_in_attention!r}")
        self.rope_in_attention = rope_in_attention
        if gate_up_pdl_release not in PDL_RELEASES:
            raise ValueError(f"gate_up_pdl_release must be one of {PDL_RELEASES}, got {gate_up_pdl_release!r}")
        self.gate_up_pdl_release = gate_up_pdl_release
        self.silu_in_gate_up_pdl = bool(silu_in_gate_up_pdl)
        if attention_prefill_block_m not in ("auto", None) and not isinstance(attention_prefill_block_m, int):
            raise ValueError(f"attention_prefill_block_m {attention_prefill_block_m!r}: an int, None or 'auto'")
        self.attention_prefill_block_m = attention_prefill_block_m
        self.silu_in_gate_up_max_rows = silu_in_gate_up_max_rows
        self.matmul_specialize = matmul_specialize
        unknown = set(attention_launch or {}) - set(LAUNCH_OPTIONS)
        if unknown:
            raise ValueError(f"attention_launch: unknown options {sorted(unknown)} (known: {LAUNCH_OPTIONS})")
        self.attention_launch = dict(attention_launch or {})
        if cublas_rows not in ("auto", None) and not (
                isinstance(cublas_rows, (tuple, list)) and len(cublas_rows) == 2
                and all(isinstance(r, int) for r in cublas_rows) and 1 <= cublas_rows[0] <= cublas_rows[1]):
            raise ValueError(f"cublas_rows {cublas_rows!r}: (lo, hi) with 1 <= lo <= hi, None or 'auto'")
        # a list too: --triton-options arrives as JSON
        self.cublas_rows = tuple(cublas_rows) if isinstance(cublas_rows, list) else cublas_rows
        # (weight shape, row count, dtype, bias, device) -> cuBLAS gave the invariant bits on the probe
        self.cublas_checked: dict[tuple, bool] = {}
        # probes whose answer is still on its way from the GPU (non-blocking probes): key -> (event, pinned flag)
        self.cublas_pending: dict[tuple, tuple[torch.cuda.Event, torch.Tensor]] = {}
        self.probe_blocking = True
        hopper = torch.cuda.is_available() and not interpreting() and torch.cuda.get_device_capability()[0] >= 9
        self.paired_rows = _row_range("paired_rows", paired_rows, PAIRED_SILU_ROWS if hopper else None)
        # (gate|up shape, row count, dtype, device) -> the paired kernel gave this mode's bits on the probe
        self.paired_checked: dict[tuple, bool] = {}
        self.paired_pending: dict[tuple, tuple[torch.cuda.Event, torch.Tensor]] = {}

    def linear(self, x: torch.Tensor, weight, bias: torch.Tensor | None) -> torch.Tensor:
        from ..kernels import matmul_invariant

        _refuse_int8(weight)
        x = x if x.stride(-1) == 1 else x.contiguous()
        if self.cublas_bits_equal(x, weight, bias):
            return self.fast_linear(x, weight, bias)
        return matmul_invariant(x, weight, bias, block_m=self.matmul_block_m, pdl=self.pdl_for(x.shape[0]),
                                specialize=self.matmul_specialize)

    def head(self, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return TorchOps.head(self, x, weight, out)  # this class's ``linear``, then the copy

    def linear_to_norm(self, x: torch.Tensor, weight, which: str) -> torch.Tensor:
        # never K slices summed by the norm (``TritonOps(split_to_norm=)``): the product is this class's ``linear``
        return self.linear(x, weight, None)

    def cublas_rows_for(self, device: torch.device) -> tuple[int, int] | None:
        """``cublas_rows`` resolved for a device ("auto": ``CUBLAS_ROWS`` on CUDA)."""
        if self.cublas_rows != "auto":
            return self.cublas_rows
        return self.CUBLAS_ROWS if device.type == "cuda" else None

    def cublas_bits_equal(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """Whether this product may run on ``fast_linear``: M within ``cublas_rows`` and, for this weight
        shape, dtype, bias and M, the probe found every bit equal (checked once, never inside a capture;
        x must be 16-byte aligned like the probe, since cuBLAS picks kernels by alignment too)."""
        rows = self.cublas_rows_for(x.device)
        M = x.shape[0]
        if rows is None or not rows[0] <= M <= rows[1] or x.dim() != 2 or x.data_ptr() % 16:
            return False
        key = (tuple(weight.shape), M, x.dtype, bias is not None, x.device)
        return self._probed(self.cublas_checked, self.cublas_pending, key, x,
                            lambda: self._probe_bits_equal(M, weight, bias, x.dtype))

    def _probed(self, checked: dict, pending: dict, key: tuple, x: torch.Tensor, probe) -> bool:
        """A fast path's answer for ``key`` (``checked``), or its probe: ``probe()`` gives a bool tensor on
        the device (all bits equal?). Blocking (start-up) it waits for it; else it queues the answer to a
        pinned host flag and says False (the invariant path) until the flag is back (``pending``). Never
        probes, and never asks an event, inside a CUDA-graph capture."""
        ok = checked.get(key)
        if ok is not None:
            return ok
        # undecided inside a capture: the invariant kernel (the same bits); no event queried there
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        waiting = pending.get(key)
        if waiting is not None:
            if capturing or not waiting[0].query():
                return False  # the answer is not back yet: the invariant kernel meanwhile
            ok = checked[key] = bool(waiting[1].item())  # a pinned host flag: no sync
            del pending[key]
            return ok
        if capturing:
            return False
        equal = probe()
        if self.probe_blocking or not x.is_cuda:
            ok = checked[key] = bool(equal)  # waits for the probe
            return ok
        flag = torch.empty((), dtype=torch.bool, pin_memory=True)
        flag.copy_(equal, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        pending[key] = (done, flag)
        return False

    def _probe_bits_equal(self, M: int, weight: torch.Tensor, bias: torch.Tensor | None,
                          dtype: torch.dtype) -> torch.Tensor:
        """M random rows of mixed magnitudes through ``fast_linear`` and the invariant kernel: all bits equal?
        (a bool tensor on the weight's device, so that asking costs no sync). A different order of the sums
        (split-K, stream-K) changes nearly every row of such a probe (down's split-K rows on the H200: none
        of M equal)."""
        from ..kernels import matmul_invariant

        x = _probe_rows(M, weight, dtype, seed=M)
        return _all_bits_equal(self.fast_linear(x, weight, bias),
                               matmul_invariant(x, weight, bias, block_m=self.matmul_block_m,
                                                specialize=self.matmul_specialize))

    def paired_bits_equal(self, x: torch.Tensor, weight) -> bool:
        """Whether gate_up + SiLU·mul may run on ``fast_gate_up_silu`` at these rows: M within
        ``paired_rows`` and the probe for (shape, M) gave every bit of the product-then-``silu_and_mul`` path."""
        rows, M = self.paired_rows, x.shape[0]
        if (rows is None or not rows[0] <= M <= rows[1] or x.dim() != 2 or x.data_ptr() % 16
                or isinstance(weight, QuantizedWeight)):
            return False
        key = (tuple(weight.shape), M, x.dtype, x.device)
        return self._probed(self.paired_checked, self.paired_pending, key, x,
                            lambda: self._probe_paired_equal(M, weight, x.dtype))

    def _paired(self, x: torch.Tensor, weight) -> torch.Tensor:
        return self.fast_gate_up_silu(x, weight, config=self.paired_silu_config, pdl=False)

    def _probe_paired_equal(self, M: int, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """M random rows through the paired kernel and through this mode's own path at M rows (the invariant
        product, whose bits cuBLAS keeps where it runs, then the SiLU·mul kernel): all bits equal? (a bool
        tensor on the device: asking costs no sync)."""
        from ..kernels import matmul_invariant

        x = _probe_rows(M, weight, dtype, seed=M + 1)
        return _all_bits_equal(self._paired(x, weight),
                               self.silu_and_mul(matmul_invariant(x, weight, None, block_m=self.matmul_block_m,
                                                                  specialize=self.matmul_specialize)))

    def silu_mul_linear(self, gate_up: torch.Tensor, weight, defer_sum: bool = False) -> torch.Tensor:
        return self.linear(self.silu_and_mul(gate_up), weight, None)  # never deferred: see linear_to_norm

    # SiLU·mul in the gate_up matmul's epilogue up to ``silu_in_gate_up_max_rows`` rows: no [T, 2I]
    # intermediate and no launch of its own, bit for bit the separate kernel's values
    # (``matmul_invariant``'s ``silu_mul``). On the H200, gate_up + SiLU·mul in µs a call, epilogue vs
    # separate kernel: 25.0 vs 25.1 at M = 1, 26.2 vs 27.9 at 64, 78.6 vs 82.9 at 512 (diagnostics/
    # det_m1_bench_a41ec7b.*). With it at every M (and a fused attention merge, since reverted) W1's
    # ~8k-row chunk steps went 86.5 -> 88.8 ms (diagnostics/w1_profile_modes_00ce090.*; 87.5 at
    # 97c30a6 with neither): the two were not timed apart, and the fused product's chunk tiles are
    # 256 x (64 + 64), two N = 64 MMA chains a k-step for one N = 128, so chunks keep the separate
    # kernel until an isolated timing at ~8k rows says otherwise.
    # On launches with programmatic dependent launch (batches of <= pdl_max_rows) the fused product lets down
    # launch only after its K loop (``gate_up_pdl_release``). Released at its top, as every other PDL kernel,
    # it cost the graphed batch-1 step 0.34 ms (2df709a: 3.07 ms vs 2.73 with the separate kernel; without PDL
    # the epilogue is the faster one, 2.90 vs 2.98) and still 0.35 at 60d2e48 (2.88 vs 2.53), though alone the
    # two are level (25.0 vs 25.1 us): down's 128 programs (80 KB each at one row, two fit an SM), let in while
    # it held most SMs, doubled up on the few with room (a 128 KB down tile released there cost nothing:
    # det_b1_switches_down_one_per_sm_8212719). Released after its
    # loop it beats the separate kernel: b1 2.490 / 2.482 vs 2.515 / 2.524 ms at 7be3a46, 2.493 / 2.481 vs
    # 2.523 / 2.522 at e11de29 (two pairs each, diagnostics/det_b1_switches_{late_gate_up_7be3a46,
    # release_points_e11de29}.*). Released two of its 16 K steps before the end: level; four: +0.35 again;
    # every matmul after its loop: +0.28-0.34 (their next kernels' launches exposed); qkv after its loop too:
    # +0.03 (session 39's switches, code at e11de29).
    silu_in_gate_up = True

    def gate_up_silu_mul(self, x: torch.Tensor, weight) -> torch.Tensor:
        from ..kernels import matmul_invariant

        _refuse_int8(weight)
        rows = x.shape[0]
        x = x if x.stride(-1) == 1 else x.contiguous()
        if self.paired_bits_equal(x, weight):
            return self._paired(x, weight)  # the paired kernel, where its bits are this path's (``paired_rows``)
        pdl = use_pdl(x, rows, self.pdl_for(rows))
        if (rows > self.silu_in_gate_up_max_rows or (pdl and not self.silu_in_gate_up_pdl)
                or self.cublas_bits_equal(x, weight, None)):
            return super().gate_up_silu_mul(x, weight)  # the product (cuBLAS where equal), then the SiLU·mul kernel
        return matmul_invariant(x, weight, None, block_m=self.matmul_block_m, pdl=self.pdl_for(rows) if pdl else False,
                                silu_mul=True, specialize=self.matmul_specialize, pdl_release=self.gate_up_pdl_release)

    def decode_context_limits(self) -> tuple[int | None, ...]:
        return (None,)  # one attention kernel for every context

    def chunk_attention_for(self, meta) -> bool:
        return False  # every row through the invariant attention below, whatever its chunk

    def paged_attention(self, q: torch.Tensor, k_cache, v_cache, meta, scale: float, rope: tuple | None = None
                        ) -> torch.Tensor:
        from ..kernels import paged_attention_invariant

        kw = dict(self.attention_launch)
        if self.kv_split is not None:
            kw["kv_split"] = self.kv_split
        tall = self.prefill_block_m_for(q.device)
        if tall is not None:
            kw["prefill_block_m"] = tall
        return paged_attention_invariant(q, k_cache, v_cache, meta, scale, pdl=self.pdl_for(q.shape[0]), rope=rope,
                                         **kw)

    def rope_in_decode_attention(self, q: torch.Tensor, meta) -> bool:
        return q.shape[0] <= self.rope_in_attention and self._decode_only(q, meta) and rope_supported(q.shape[-1])

    def rope_decode_attention(self, q, k, v, positions, cos_sin, k_cache, v_cache, meta, scale: float) -> torch.Tensor:
        return self.paged_attention(q, k_cache, v_cache, meta, scale,
                                    rope=(k, v, positions, cos_sin, meta.slot_mapping))

    def prefill_block_m_for(self, device: torch.device) -> int | None:
        """``attention_prefill_block_m`` resolved for a device ("auto": see the class)."""
        if self.attention_prefill_block_m != "auto":
            return self.attention_prefill_block_m
        return 128 if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9 else None


class DeterministicTorchOps(TorchOps):
    """``TorchOps`` computing linears, norms and attention one row at a time (CPU reference)."""

    name = "torch-deterministic"

    def linear(self, x: torch.Tensor, weight, bias: torch.Tensor | None) -> torch.Tensor:
        _refuse_int8(weight)
        # x: [T, K] -> [T, N]; each row its own [1, K] product, so its bits never depend on T.
        # Each row is copied to a fresh buffer first: the CPU kernels' vector loops start
        # differently on a row that is not 64-byte aligned (row i of a [T, K] view, K odd).
        return torch.cat([reference.linear(x[i:i + 1].clone(), weight, bias) for i in range(x.shape[0])])

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return torch.cat([reference.rms_norm(x[i:i + 1].clone(), weight, eps) for i in range(x.shape[0])])

    def add_rms_norm(self, x, residual, weight, eps):
        rows = [reference.add_rms_norm(x[i:i + 1].clone(), residual[i:i + 1].clone(), weight, eps)
                for i in range(x.shape[0])]
        return torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows])

    def paged_attention(self, q, k_cache, v_cache, meta, scale: float) -> torch.Tensor:
        """One query token at a time: token j of sequence i (position p) attends to keys 0..p
        through a one-token call of the reference, so the softmax and the products always have
        the shapes [Hq, 1, p + 1] whatever the chunk the token came in."""
        T, Hq, D = q.shape
        out = torch.zeros_like(q)
        qsl = meta.query_start_loc_cpu or meta.query_start_loc.tolist()
        lens = meta.seq_lens_cpu or meta.seq_lens.tolist()
        block_size, Hkv = k_cache.shape[1], k_cache.shape[2]
        group = Hq // Hkv
        for i, ctx in enumerate(lens):
            start, end = qsl[i], qsl[i + 1]
            if end == start or ctx == 0:
                continue
            blocks = meta.block_tables[i, :(ctx + block_size - 1) // block_size].long()
            kk = k_cache[blocks].reshape(-1, Hkv, D)[:ctx].float().repeat_interleave(group, dim=1).transpose(0, 1)
            vv = v_cache[blocks].reshape(-1, Hkv, D)[:ctx].float().repeat_interleave(group, dim=1).transpose(0, 1)
            for t in range(start, end):
                p = ctx - (end - t)  # this token's position
                qi = q[t].float()[:, None, :]  # [Hq, 1, D]
                scores = torch.matmul(qi, kk[:, :p + 1].transpose(1, 2)) * scale  # [Hq, 1, p+1]
                out[t] = torch.matmul(scores.softmax(-1), vv[:, :p + 1])[:, 0].to(q.dtype)
        return out
