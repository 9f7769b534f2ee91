"""Shared helpers for the kernel wrappers: argument checks and launch sizing.

The checks raise ``ValueError`` naming the argument, so a wrong shape or stride fails in
Python with a readable message instead of as a wrong answer or an illegal address.
"""
from __future__ import annotations

import functools
import os

import numpy as np
import torch

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int = 0) -> int:
    if torch.cuda.is_available() and not interpreting():
        return torch.cuda.get_device_properties(device_index).multi_processor_count
    return 4  # the interpreter: keep grids small


def sm_count_for(t: torch.Tensor) -> int:
    return num_sms(t.device.index or 0) if t.is_cuda else num_sms(0)


@functools.lru_cache(maxsize=None)
def _mma_device(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (8, 0)


def mma_dot_for(t: torch.Tensor) -> bool:
    """Whether Triton lowers ``tl.dot`` to tensor-core MMAs on ``t``'s device: sm_80 and newer, and
    the interpreter and the CPU (where tiles are chosen as for the H200). Below sm_80 (a Colab T4,
    sm_75) Triton 3.2+ computes a dot with FMAs on the CUDA cores (triton-lang/triton#5066), and the
    tiles sized for MMAs on the H200 run out of registers there and spill; launches on such a GPU take
    tiles sized for FMAs instead (``scripts/t4_compile_audit.py`` compiles them for sm_75)."""
    return not (t.is_cuda and not interpreting()) or _mma_device(t.device.index or 0)


def dot_precision(dtype: torch.dtype):
    """fp32 dots in full precision (Triton defaults to tf32 on the GPU); others: default."""
    return "ieee" if dtype == torch.float32 else None


def check_device(**tensors: torch.Tensor) -> None:
    devices = {t.device for t in tensors.values()}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got { {k: str(t.device) for k, t in tensors.items()} }")
    dev = next(iter(devices))
    if dev.type != "cuda" and not interpreting():
        raise ValueError(
            f"Triton kernels need CUDA tensors (got {dev}); on the CPU set TRITON_INTERPRET=1 "
            "before importing triton, or use pageserve.model.ops.TorchOps"
        )


def check(name: str, t: torch.Tensor, *, ndim: int | None = None, shape: tuple | None = None,
          dtype: torch.dtype | tuple | None = None, last_contiguous: bool = True) -> None:
    """Validate one argument. ``shape`` entries of None are free."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dims, got shape {tuple(t.shape)}")
    if shape is not None:
        if len(shape) != t.dim() or any(s is not None and s != ts for s, ts in zip(shape, t.shape)):
            want = tuple("*" if s is None else s for s in shape)
            raise ValueError(f"{name}: expected shape {want}, got {tuple(t.shape)}")
    if dtype is not None:
        allowed = dtype if isinstance(dtype, tuple) else (dtype,)
        if t.dtype not in allowed:
            raise ValueError(f"{name}: dtype {t.dtype} not in {[str(d) for d in allowed]}")
    if last_contiguous and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name}: the last dimension must be contiguous (stride 1), got strides {t.stride()}")


# ---------------------------------------------------------------------------- in-kernel helpers
def check_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, w_name: str = "weight") -> tuple[int, int, int]:
    """x [M, K], ``w_name`` [N, K] in x's dtype, bias [N] or None, all on one device: (M, N, K)."""
    check("x", x, ndim=2, dtype=KERNEL_DTYPES)
    M, K = x.shape
    check(w_name, w, shape=(None, K), dtype=x.dtype)
    N = w.shape[0]
    tensors = {"x": x, w_name: w}
    if bias is not None:
        check("bias", bias, shape=(N,), dtype=x.dtype)
        tensors["bias"] = bias
    check_device(**tensors)
    return M, N, K


def check_paged_meta(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta) -> tuple[int, int, int]:
    """``check_paged_qkv`` plus the attention metadata's int32 lengths and block table on q's
    device: (page size, KV heads, sequences)."""
    page, Hkv = check_paged_qkv(q, k_cache, v_cache)
    B = meta.seq_lens.shape[0]
    check("seq_lens", meta.seq_lens, shape=(B,), dtype=torch.int32)
    check("query_start_loc", meta.query_start_loc, shape=(B + 1,), dtype=torch.int32)
    check("block_tables", meta.block_tables, shape=(B, None), dtype=torch.int32)
    check_device(q=q, k_cache=k_cache, v_cache=v_cache, seq_lens=meta.seq_lens,
                 query_start_loc=meta.query_start_loc, block_tables=meta.block_tables)
    if not (meta.seq_lens.is_contiguous() and meta.query_start_loc.is_contiguous()):
        raise ValueError("seq_lens and query_start_loc must be contiguous")
    return page, Hkv, B


_DECODE_TILES: dict[tuple[int, torch.device], torch.Tensor] = {}


def query_tile_arrays(query_start_loc, seq_lens, q_tok: int, B: int, part: str = "all",
                      short_len: int = 0) -> np.ndarray:
    """``query_tile_map``'s chunked-step map on the host: [2, n_tiles] int32 (sequence, tile of its
    chunk) from host copies of ``query_start_loc`` [B+1] and, for the heavy-first order, ``seq_lens``
    [B] (None: sequence order)."""
    q_len = np.diff(np.asarray(query_start_loc, dtype=np.int32))
    n = (q_len + q_tok - 1) // q_tok  # [B] tiles per sequence, on the host (numpy: 1/7 of torch's host time)
    if part != "all":
        n = np.where((q_len <= short_len) == (part == "short"), n, 0)
    seq = np.repeat(np.arange(B, dtype=np.int32), n)
    first = np.repeat(np.cumsum(n, dtype=np.int32) - n, n)  # each tile's sequence's first tile
    tile = np.arange(seq.size, dtype=np.int32) - first
    if seq_lens is not None:
        lens = np.asarray(seq_lens, dtype=np.int64)
        # keys a tile walks: its sequence's cached prefix plus the chunk up to the tile's last token
        keys = lens[seq] - q_len[seq] + np.minimum((tile.astype(np.int64) + 1) * q_tok, q_len[seq])
        order = np.argsort(-keys, kind="stable")
        seq, tile = seq[order], tile[order]
    return np.stack([seq, tile]).astype(np.int32)


def query_tile_map(meta, q_tok: int, B: int, device: torch.device, part: str = "all", short_len: int = 0,
                   heavy_first: bool = False) -> torch.Tensor:
    """[2, n_tiles] int32: the step's query tiles, (sequence b, tile mb of its chunk), one program
    each (the default prefill kernel and the batch-invariant attention launch from it). A decode
    batch (max_query_len 1) has one tile per sequence: a constant map per batch size, so a graph's
    launch is fixed by shapes. A chunked step's map comes from the host copy of
    ``query_start_loc`` (read once, a sync where the meta has none: tests and the lab), is
    exact — no programs for the tiles a short sequence does not have, which a (max tiles x B)
    grid launched and exited (results/h200/diagnostics/profile_steps at 33a95d3b: a mixed step's
    attention 24 ms against 10 for the same prompts alone) — and is kept in ``meta.scratch`` for
    the step's other layers. ``part``: "all" sequences, only the "short" ones (at most
    ``short_len`` new tokens: decodes) or only the "long" ones (chunks), for launches with
    different tile heights. ``heavy_first``: the tiles in order of the keys each walks, most first
    (a chunked step's map only), so the GPU starts the longest programs first and the step does not
    end on a wave of them started last (a chunk's tiles otherwise come in order, its last tile, which
    sees the whole chunk, at the end). Which program computes a tile does not change a row's bits."""
    scratch = getattr(meta, "scratch", None)
    if meta.max_query_len <= 1:
        key = (B, device)
        if key in _DECODE_TILES:
            return _DECODE_TILES[key]
        if scratch is not None and key in scratch:
            return scratch[key]
        tiles = torch.stack([torch.arange(B, dtype=torch.int32, device=device),
                             torch.zeros(B, dtype=torch.int32, device=device)])
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # made inside a graph capture: its values exist only once the graph replays, so it
            # stays with this graph's metadata and never serves an eager step
            if scratch is not None:
                scratch[key] = tiles
        else:
            _DECODE_TILES[key] = tiles
        return tiles
    key = ("query_tiles", q_tok, part, short_len if part != "all" else 0, heavy_first)  # the merge reuses "all"
    if scratch is not None and key in scratch:
        return scratch[key]
    qsl = meta.query_start_loc_cpu
    qsl = qsl if qsl is not None else meta.query_start_loc.tolist()
    lens = meta.seq_lens_cpu
    lens = (lens if lens is not None else meta.seq_lens.tolist()) if heavy_first else None
    tiles = torch.from_numpy(query_tile_arrays(qsl, lens, q_tok, B, part, short_len))
    tiles = tiles.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else tiles.to(device)
    if scratch is not None:
        scratch[key] = tiles
    return tiles


def check_paged_qkv(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int]:
    """Shared checks of the paged-attention wrappers: q [N, Hq, D] and caches
    [num_blocks, block_size, Hkv, D] of q's dtype, Hq a multiple of Hkv. Returns (block_size, Hkv)."""
    check("q", q, ndim=3, dtype=KERNEL_DTYPES)
    D, Hq = q.shape[2], q.shape[1]
    check("k_cache", k_cache, ndim=4, dtype=q.dtype)
    _, page, Hkv, Dk = k_cache.shape
    if Dk != D:
        raise ValueError(f"k_cache head_dim {Dk} != q head_dim {D}")
    check("v_cache", v_cache, shape=tuple(k_cache.shape), dtype=q.dtype)
    if Hq % Hkv:
        raise ValueError(f"num query heads {Hq} must be a multiple of num kv heads {Hkv}")
    return page, Hkv


import triton  # noqa: E402
import triton.language as tl  # noqa: E402


# ---------------------------------------------------------------------------- programmatic dependent launch
# On Hopper and later a kernel launched with PDL may start while the kernel before it on the
# stream is still finishing; it must call ``pdl_enter`` before it reads anything an earlier
# kernel wrote and before it writes anything. Every decode-path kernel does, so each kernel's
# launch and ramp overlap its predecessor's tail. Measured on the H200 (3B shape, graphed
# decode step, kernels/NOTES.md): batch 1 2.41 -> 2.20 ms; batch 64 a little slower (3.39 ->
# 3.43-3.50 ms), so only launches over at most PDL_MAX_TOKENS rows (the GEMV's batches) use it.
# Each wrapper takes ``pdl`` (TritonOps(pdl=...) passes its own): None = on where supported.
#
# Step inputs before the wait. A kernel may read, before its wait, what no kernel of the step
# writes: weights and tables, and the step's inputs (block tables, sequence lengths, positions,
# slots, tile maps), which are written before the step's first kernel. That is safe because every
# program of every PDL kernel waits before it releases the next kernel: so when a kernel starts,
# the kernel two back has finished, and so has everything before it. Two rules keep it so:
# - a program never exits, and never writes, before its wait (were every program of a kernel
#   to exit unwaited, the next kernel's wait would return while the kernel before still ran);
# - nothing it reads before the wait may come from the kernel right before it.
# The attention and RoPE kernels load their step inputs that way (``pdl_enter_before_inputs``,
# the loads, then ``pdl_enter_after_inputs``), so the chain of dependent loads that starts each
# of them (tile -> sequence length -> block-table entry) runs under the previous kernel's tail;
# the norms load their weight there too. On the H200 (graphed 3B decode step, two pairs): batch 1
# 2.111 -> 2.061 ms, deterministic mode 2.690 -> 2.615 (diagnostics/det_b1_switches_pdl_inputs_0b4076b.*);
# at 16a8aca 2.097 -> 2.036, det 2.676 -> 2.590, int8 1.744 -> 1.697 (..._16a8aca.*).
# Not the GEMV's weights: its first K tile loaded before the wait made batch 1 0.17 ms slower and
# int8's 0.43 (the same run; session 3's L2 prefetch of whole slices lost the same way).
# ``pdl="wait_first"`` keeps every wait at the top (the layout before session 21, for A/Bs).
#
# Between two decode graph replays. A replay runs ~0.13 ms faster (H100, 3B graph at 4-16 rows; 0.14-0.15 ms at
# 2-256 rows on the H200 in session 14) when some kernel launched with PDL ran since the last one: after the
# greedy path's argmax, or any kernel followed by a one-row PDL argmax, the replay takes 2,860 µs, after the same
# kernels without it 2,990, and back-to-back replays keep whichever state the last work left
# (scripts/replay_after_probe.py, results/h100/diagnostics/replay_after_probe_*; the mechanism, driver or
# hardware, is not known). So the sampler's kernels (argmax, repetition penalty or its seen bits, pick, race) launch
# under PDL at any row count: whichever path a step samples by, a PDL kernel runs between its replays.
PDL_MAX_TOKENS = 8
PDL_WAIT_FIRST = 2  # USE_PDL's value under pdl="wait_first"; True (1) is PDL with inputs before the wait
PDL_MODES = (None, True, False, "wait_first")


@functools.lru_cache(maxsize=None)
def pdl_supported(device_index: int) -> bool:
    """sm_90+ and a Triton with grid-dependency control (3.4+); never on the interpreter."""
    if interpreting() or not torch.cuda.is_available():
        return False
    try:
        from triton.language.extra.cuda import gdc_wait  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def use_pdl(t: torch.Tensor, tokens: int, pdl: bool | str | None = None) -> bool:
    """Whether a kernel over ``tokens`` rows (tokens, sequences) on ``t``'s device launches with
    programmatic dependent launch. ``pdl``: False = never; True, None or "wait_first" (the A/B
    layout) = where the GPU and Triton support it (``pdl_supported``); never above PDL_MAX_TOKENS rows."""
    if pdl not in PDL_MODES:
        raise ValueError(f"pdl must be one of {PDL_MODES}, got {pdl!r}")
    if pdl is False or not t.is_cuda or tokens > PDL_MAX_TOKENS:
        return False
    return pdl_supported(t.device.index or 0)


def pdl_args(t: torch.Tensor, tokens: int, pdl: bool | str | None = None) -> dict:
    """A launch's PDL keywords (``use_pdl``): the kernels' ``USE_PDL`` constexpr (True, or
    ``PDL_WAIT_FIRST`` under ``pdl="wait_first"``), and ``launch_pdl`` only when on (the
    interpreter knows no such option)."""
    if not use_pdl(t, tokens, pdl):
        return {"USE_PDL": False}
    return {"USE_PDL": PDL_WAIT_FIRST if pdl == "wait_first" else True, "launch_pdl": True}


@triton.jit
def pdl_enter(USE_PDL: tl.constexpr):
    """Wait until the previous kernel on the stream has finished and its writes are
    visible, then let the next kernel launch (its programs wait the same way)."""
    pdl_wait(USE_PDL)
    pdl_release(USE_PDL)


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """``pdl_enter``'s wait alone, for a kernel that releases the next one later (``pdl_release``)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def pdl_release(USE_PDL: tl.constexpr):
    """``pdl_enter``'s second half, after ``pdl_wait``: let the next kernel launch."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_enter_before_inputs(USE_PDL: tl.constexpr):
    """A kernel's first line where it loads step inputs before its wait: ``pdl_enter`` here only
    under ``pdl="wait_first"`` (see the rules above)."""
    if USE_PDL == 2:  # PDL_WAIT_FIRST
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_enter_after_inputs(USE_PDL: tl.constexpr):
    """After those loads, before any other read, any write or any exit: ``pdl_enter`` here
    unless the kernel already waited (``pdl="wait_first"``)."""
    if USE_PDL == 1:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


ORDERED_DOT = 2  # a dot_upcast value: see below


def dot_upcast(dtype: torch.dtype, ordered: bool = False) -> int:
    """The CPU interpreter stores bf16 as uint16 and its tl.dot multiplies the raw integers:
    there, bf16 dot operands are upcast to fp32 first (rounding is unchanged: the products
    of bf16 values are exact in fp32): 1.

    ``ordered`` (the batch-invariant kernels): in the interpreter tl.dot is a BLAS matmul of the
    tile, whose per-element summation order may depend on the element's row (OpenBLAS's
    microkernels differ by CPU: seen on an AMD EPYC, where a token's fp32 scores changed with
    its row in the tile). ``ORDERED_DOT`` makes ``mma`` sum the products in K order instead,
    the same for every element. On the GPU: 0 whatever is asked."""
    if not interpreting():
        return 0
    if ordered:
        return ORDERED_DOT
    return int(dtype == torch.bfloat16)


@triton.jit
def mma(a, b, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """tl.dot(a, b) accumulating in fp32; see ``dot_upcast`` for UPCAST."""
    if UPCAST == 2:  # ORDERED_DOT (interpreter): [M, K] x [K, N] summed over K in order
        return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=PREC)


@triton.jit
def kv_pages(bt_row, pos, pmask, PAGE: tl.constexpr):
    """Cache block of each token position ``pos`` [N] of one sequence, from its block-table row
    (masked positions: block 0)."""
    return tl.load(bt_row + pos // PAGE, mask=pmask, other=0).to(tl.int64)


@triton.jit
def load_kv_at(kc_ptr, vc_ptr, page, pos, pmask, h, d, dmask,
               stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, PAGE: tl.constexpr):
    """K and V rows of KV head ``h`` for token positions ``pos`` [N] whose cache blocks are
    ``page`` [N] (``kv_pages``); masked positions load zeros. Returns k, v: [N, BLOCK_D]."""
    slot = pos % PAGE
    kvmask = pmask[:, None] & dmask[None, :]
    k = tl.load(kc_ptr + (page * stride_kb + slot * stride_ks + h * stride_kh)[:, None] + d[None, :],
                mask=kvmask, other=0.0)
    v = tl.load(vc_ptr + (page * stride_vb + slot * stride_vs + h * stride_vh)[:, None] + d[None, :],
                mask=kvmask, other=0.0)
    return k, v


@triton.jit
def load_kv_tile(kc_ptr, vc_ptr, bt_row, pos, pmask, h, d, dmask,
                 stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, PAGE: tl.constexpr):
    """K and V rows of KV head ``h`` for token positions ``pos`` [N] of one sequence, read
    through its block-table row (masked positions load zeros). Returns k, v: [N, BLOCK_D]."""
    page = kv_pages(bt_row, pos, pmask, PAGE)
    return load_kv_at(kc_ptr, vc_ptr, page, pos, pmask, h, d, dmask,
                      stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, PAGE)


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row tile, column tile) of program ``pid`` in grouped launch order: GROUP_M row tiles
    take each weight column tile in turn, so it is read from L2 while it is still there."""
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_size, (pid % per_group) // group_size


@triton.jit
def online_softmax_step(scores, v, m_i, l_i, acc, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """Fold one tile into a running softmax-weighted sum. scores: [M, N] in log2 units with
    masked entries at -inf; v: [N, BLOCK_D]; m_i, l_i: [M] running max and denominator;
    acc: [M, BLOCK_D] fp32. Returns the updated (m_i, l_i, acc)."""
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, PREC, UPCAST)
    return m_new, l_i, acc

