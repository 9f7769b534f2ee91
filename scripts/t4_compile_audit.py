"""Every Triton kernel the engine launches on a T4 (sm_75, fp16), compiled for sm_75 on this machine at the
configs the engine's own selection code picks there, with its registers, spills and shared memory.

Why: pageserve's users run it on Colab T4s (40 SMs, 64 KB of shared memory a block, 255 registers a
thread, no bf16, no PDL / TMA / wgmma), and no T4 is lent to us. The tiles were measured on the H200;
a T4 gets them through the same selection functions called with its numbers, and this script calls
those functions with them (``T4``: sm_count 40, 65,536 bytes of shared memory, float16), never mocking
CUDA. Each launch is compiled by Triton for ``GPUTarget("cuda", 75, 32)`` (``gemv_sass.compile_sm90``
with ``capability=75``) with the argument specialisation Triton's JIT would give the engine's tensors
(16-byte aligned pointers and strides divisible by 16 as ``tt.divisibility`` 16, an int equal to 1 as a
constant, none of it on arguments a kernel marks ``do_not_specialize``), and its figures read from the
compile itself: ``metadata.shared`` and ptxas's own ``-v`` report (registers, spill stores, stack).

What a T4 launches (the branches each wrapper takes there; the modes share their kernels, and a
compile that serves several launches is compiled once and listed with all of their row counts):
- default (``TritonOps``): the M = 1 GEMVs (qkv, o, gate_up, SiLU·down, LM head; ``gemv_config``'s
  heuristic: no tuned configs ship for a T4) and their split-K reduce; RMSNorm with and without the
  residual; RoPE + K/V write (``rope_kv``); decode attention on the split rule (``decode_schedule``,
  "pipelined" being sm_90 only: ``pipelined_device``), with RoPE in the launch at 9-128 rows
  (``ROPE_ATTENTION_ROWS``), and its merge; the paged prefill kernel for chunks (``chunk_attention``,
  ``gate_up_silu_rows`` and ``paired_silu_rows`` are Hopper only); SiLU·mul above one row; the
  sampler's argmax, its structured-output masks (``token_bitmask``), its candidate pick, race and
  repetition penalty; the decode graphs' input staging. ``rotary`` and ``write_kv`` run only with ``fuse_rope_kv=False``
  and are listed as such.
- deterministic (``DeterministicOps``): ``matmul_invariant`` for every linear and the LM head at every
  row count (``invariant_config`` -> ``measured_config`` shrunk by ``fit_shared_memory`` to the T4's
  ``smem_budget``; its TMA tiles fall back to the pointer kernel below sm_90, ``_tma_ok``), SiLU·mul in
  gate_up's epilogue up to ``silu_in_gate_up_max_rows``; both compiles (M-specialised for the decode
  graphs' captures, generic for eager steps); ``paged_attention_invariant`` with 16-row tiles
  (``attention_prefill_block_m`` is Hopper only) through ``split_launch``, RoPE in the launch up to
  ``rope_in_attention`` rows, and its merge.
- int8 (``--quantization int8``, default ops): ``gemv_int8`` up to 64 rows (its heuristics), the fused
  SiLU·down at one row, the dequantize kernel before cuBLAS above 64 rows (``int8_planes`` is Hopper
  only, ``gemm_int8`` unreachable with ``int8_gemm="auto"``); its other kernels are the default mode's.
Not audited: ``kernels/allreduce.py`` (tensor parallelism: a T4 box has one GPU), and the A/B knobs
that no default reaches.

What a compile cannot tell: the figures are ptxas's for sm_75 (what a T4 runs) but not the time;
whether a config is fast on a T4 needs one. Triton (3.9 here) lowers ``tl.dot`` on sm_75 to FMAs on the
CUDA cores (its MMA path starts at sm_80): the script reports the instruction each dot became.

Found on first run (kernels as at be8054a, Triton 3.9): every launch compiled, none exceeded 64 KB of
shared memory (the 3B prefill kernel's 64 x 64 tile took exactly 65,536 B) and none held a bf16 or
Hopper-only instruction; but 203 of 328 launches spilled (up to 73 KB a thread), all of them ``tl.dot``
kernels whose tiles were sized for MMAs: the decode attention's 64-key tiles, the prefill kernel, every
``matmul_invariant`` config, the invariant attention, and ``gemv_int8``'s 2-64-row dot tiles. Since then a
GPU whose dots run on FMAs (``_util.mma_dot_for``: below sm_80) takes tiles sized for them: decode 16 keys
over 8 warps, prefill 64 rows x 16 keys over 8 warps, ``matmul_invariant.FMA_CONFIG``, the invariant
attention's ``FMA_BLOCK_N`` (32), and int8 products of more than one row on dequantize + cuBLAS; the sm_80+
choices are unchanged. Now: 228 launches, none spills, at most 40,960 B of shared memory.

    python scripts/t4_compile_audit.py [--check] [--only TEXT] [--jobs 2]   # without TRITON_INTERPRET (it compiles for sm_75)

``--check``: exit 1 if a launch fails to compile, needs more than 65,536 bytes of shared memory, spills,
or holds a bf16 or Hopper-only instruction (wgmma, TMA, griddepcontrol) in its PTX.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import os
import re
import shutil
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

T4 = dict(capability=75, sms=40, smem=65536)  # sm_75: 40 SMs, 64 KB of shared memory a block
MAX_REGS = 255
DTYPE = "fp16"  # a T4 has no bf16: the engine's --dtype auto gives fp16 there
PAGE = 16  # KV block size
CONTEXTS = (1024, 4096)  # max_model_len: the block table's width in the decode graphs (its / PAGE)
DECODE_ROWS = (1, 2, 4, 8, 16, 64, 256)
PREFILL_TOKENS = (16, 64, 256, 512, 2048)
# Hopper-only or bf16 instructions a sm_75 compile must not hold
FORBIDDEN_PTX = ("wgmma", "cp.async.bulk", "griddepcontrol", "bf16", "setmaxnreg", "mbarrier")


@dataclass(frozen=True)
class Model:
    name: str
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    bias: bool  # q/k/v bias

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    @property
    def qkv(self) -> int:
        return (self.heads + 2 * self.kv_heads) * self.head_dim


MODELS = (Model("smollm2-135m", 576, 1536, 9, 3, 64, 49152, False),
          Model("qwen2.5-3b", 2048, 11008, 16, 2, 128, 151936, True))


@dataclass
class Launch:
    """One kernel launch: ``args`` the runtime arguments by name (a pointer as its Triton type, e.g.
    "*fp16"; an int as its value, None where it varies and is not specialised; a float), ``const`` the
    constexprs (defaults filled from the kernel)."""
    mode: str
    model: str
    what: str
    kernel: str  # "module:attribute" or "module:attribute[index]"
    args: dict
    const: dict
    warps: int
    stages: int = 3  # Triton's default where a launch gives none
    rows: list = field(default_factory=list)


def kernel_of(ref: str):
    mod, attr = ref.split(":")
    index = None
    if attr.endswith("]"):
        attr, index = attr[:-1].split("[")
    k = getattr(importlib.import_module(mod), attr)
    return k[int(index)] if index is not None else k


def specialize(kernel, args: dict, const: dict) -> tuple[dict, dict, dict]:
    """(signature, constants, attributes) as Triton's JIT specialises a call with these arguments."""
    sig, consts, attrs = {}, {}, {}
    aligned = [["tt.divisibility", 16]]
    for i, p in enumerate(kernel.params):
        if p.is_constexpr:
            consts[p.name] = const[p.name] if p.name in const else p.default
            sig[p.name] = "constexpr"
            continue
        v = args[p.name]
        if isinstance(v, str):  # a pointer to a 16-byte aligned tensor
            sig[p.name] = v
            if not p.do_not_specialize_on_alignment:
                attrs[(i,)] = aligned
        elif isinstance(v, float):
            sig[p.name] = "fp32"
        elif v is None or p.do_not_specialize:
            sig[p.name] = "i32"
        elif v == 1:
            sig[p.name], consts[p.name] = "constexpr", 1
        else:
            sig[p.name] = "i64" if abs(v) >= 2 ** 31 else "i32"
            if v % 16 == 0:
                attrs[(i,)] = aligned
    unknown = set(const) - {p.name for p in kernel.params}
    if unknown:
        raise KeyError(f"{kernel.__name__}: no parameters {sorted(unknown)}")
    return sig, consts, attrs


PTXAS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads.*?Used (\d+) registers",
                   re.S)


def compile_one(task: tuple) -> dict:
    """Compile one launch for sm_75: its figures, or the error."""
    from triton import knobs

    from gemv_sass import compile_sm90

    ref, sig, consts, attrs, warps, stages = task
    kernel = kernel_of(ref)
    try:
        log = io.StringIO()
        with knobs.nvidia.scope(), knobs.compilation.scope():
            knobs.nvidia.dump_ptxas_log = True  # ptxas -v's report, printed by Triton after it runs
            # launches of one body under two JITFunctions (``_two_compiles``) can hash alike: compile anyway
            knobs.compilation.always_compile = True
            with contextlib.redirect_stdout(log):
                compiled = compile_sm90(kernel, sig, consts, attrs, warps, stages, capability=T4["capability"])
        m = PTXAS.search(log.getvalue())
        if m is None:
            raise RuntimeError("no ptxas report (a cached compile?)")
        stack, spill_st, spill_ld, regs = (int(g) for g in m.groups())
        ptx = compiled.asm["ptx"]
        dots = sorted({op for op in ("mma.sync", "wgmma", "ldmatrix") if op in ptx})
        bad = [op for op in FORBIDDEN_PTX if re.search(r"\b" + re.escape(op), ptx)]
        return dict(ok=True, regs=regs, spills=spill_st + spill_ld, stack=stack, smem=compiled.metadata.shared,
                    dot="+".join(dots) if dots else ("fma" if "tt.dot" in compiled.asm["ttgir"] else "-"),
                    forbidden=bad)
    except Exception as e:  # noqa: BLE001 - a failed compile is a finding, not a crash
        return dict(ok=False, error=f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e) else ''}")


# ---------------------------------------------------------------------------- the engine's launches on a T4
def _pdl_off() -> dict:
    # PDL needs sm_90 (``_util.pdl_supported``): every launch on a T4 has USE_PDL False
    return dict(USE_PDL=False)


def gemv_launches(mode: str, m: Model, what: str, M: int, N: int, K: int, quant=False, silu_mul=False,
                  bias=False) -> list[Launch]:
    """``gemv``/``silu_mul_gemv``/``gemv_int8``/``silu_mul_gemv_int8`` (``launch_gemv``) and the split-K reduce."""
    from pageserve.kernels.gemv import gemv_config, gemv_tiles, magic_code, weight_vector
    from pageserve.kernels.gemv_int8 import gemv_int8_config

    pick = gemv_int8_config if quant else gemv_config
    cfg = pick(M, N, K, T4["sms"], "auto", {}, silu_mul=silu_mul)  # no tuned configs ship for a T4
    k_per_split, splits, block_m, use_dot = gemv_tiles(M, K, cfg)
    f = "*" + DTYPE
    x_stride = 2 * K if silu_mul else K
    const = dict(HAS_BIAS=bias, SPLIT=splits > 1, SILU_MUL=silu_mul, QUANT=quant, MAGIC=magic_code(True) if quant else 0,
                 BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, USE_DOT=use_dot,
                 DEFER_REDUCE=cfg.defer_reduce and M == 1, PREC=None, UPCAST=0,
                 W_VEC=weight_vector(2, quant) if M == 1 else 0, SWAP_AB=cfg.swap_ab and use_dot, **_pdl_off())
    args = dict(x_ptr=f, w_ptr="*i8" if quant else f, scale_ptr=f, bias_ptr=f, out_ptr=f,
                part_ptr="*fp32" if splits > 1 else f, M=M, N=N, K=K, K_PER_SPLIT=k_per_split, stride_xm=x_stride,
                stride_wn=K, stride_om=N)
    tag = f"{what} [{M}x{K}]x[{N}x{K}]^T"
    out = [Launch(mode, m.name, tag, "pageserve.kernels.gemv:_gemv_kernel", args, const, cfg.num_warps,
                  cfg.num_stages, [M])]
    if splits > 1:
        out.append(Launch(mode, m.name, f"{what} reduce of {splits} splits", "pageserve.kernels.gemv:_gemv_reduce_kernel",
                          dict(part_ptr="*fp32", scale_ptr=f, bias_ptr=f, out_ptr=f, M=M, N=N, stride_om=N),
                          dict(SPLITS=splits, HAS_BIAS=bias, QUANT=quant, BLOCK=256, **_pdl_off()), 2, 3, [M]))
    return out


def norm_launches(mode: str, m: Model, rows: int) -> list[Launch]:
    from pageserve.kernels.norm import norm_launch

    block, warps = norm_launch(m.hidden)
    f, H = "*" + DTYPE, m.hidden
    return [Launch(mode, m.name, f"rms_norm{' + residual' if res else ''} H={H}",
                   "pageserve.kernels.norm:_rms_norm_kernel",
                   dict(x_ptr=f, res_ptr=f, w_ptr=f, out_ptr=f, res_out_ptr=f, H=H, stride_x=H, stride_r=H,
                        stride_o=H, stride_ro=H, stride_part=0, eps=1e-6),
                   dict(HAS_RESIDUAL=res, BLOCK=block, **_pdl_off()), warps, rows=[rows]) for res in (False, True)]


def _cache_strides(m: Model) -> dict:
    # a layer's k/v cache: kv_cache[layer, 0|1], [num_blocks, PAGE, Hkv, D]
    return dict(stride_kb=PAGE * m.kv_heads * m.head_dim, stride_ks=m.kv_heads * m.head_dim, stride_kh=m.head_dim,
                stride_vb=PAGE * m.kv_heads * m.head_dim, stride_vs=m.kv_heads * m.head_dim, stride_vh=m.head_dim)


def rope_kv_launches(mode: str, m: Model, rows: int, unfused: bool = False) -> list[Launch]:
    """``rotary_write_kv`` (q, k, v: views of the qkv rows); with ``unfused`` ``rotary`` and ``write_kv``."""
    from pageserve.kernels._util import next_pow2

    f, D, c = "*" + DTYPE, m.head_dim, _cache_strides(m)
    views = dict(stride_qt=m.qkv, stride_qh=D, stride_kt=m.qkv, stride_kh=D)
    outs = dict(stride_qot=m.heads * D, stride_qoh=D, stride_kot=m.kv_heads * D, stride_koh=D, stride_cs=D)
    rope = dict(HALF=D // 2, BLOCK_HALF=next_pow2(D // 2), BLOCK_HQ=next_pow2(m.heads), BLOCK_HKV=next_pow2(m.kv_heads),
                **_pdl_off())
    if not unfused:
        args = dict(q_ptr=f, k_ptr=f, v_ptr=f, qo_ptr=f, ko_ptr=f, kc_ptr=f, vc_ptr=f, pos_ptr="*i64",
                    cs_ptr="*fp32", slot_ptr="*i64", HQ=m.heads, HKV=m.kv_heads, stride_vt=m.qkv, stride_vh=D,
                    stride_kcb=c["stride_kb"], stride_kcs=c["stride_ks"], stride_kch=c["stride_kh"],
                    stride_vcb=c["stride_vb"], stride_vcs=c["stride_vs"], stride_vch=c["stride_vh"], **views, **outs)
        return [Launch(mode, m.name, f"rope_kv Hq={m.heads} Hkv={m.kv_heads} D={D}", "pageserve.kernels.rope_kv:_rope_kv_kernel",
                       args, dict(PAGE=PAGE, **rope), 4, rows=[rows])]
    rot = dict(q_ptr=f, k_ptr=f, qo_ptr=f, ko_ptr=f, pos_ptr="*i64", cs_ptr="*fp32", HQ=m.heads, HKV=m.kv_heads,
               **views, **outs)
    kv = dict(k_ptr=f, v_ptr=f, kc_ptr=f, vc_ptr=f, slot_ptr="*i64", HKV=m.kv_heads, D=D,
              stride_kt=m.kv_heads * D, stride_kh=D, stride_vt=m.qkv, stride_vh=D, stride_kcb=c["stride_kb"],
              stride_kcs=c["stride_ks"], stride_kch=c["stride_kh"], stride_vcb=c["stride_vb"], stride_vcs=c["stride_vs"],
              stride_vch=c["stride_vh"])
    return [Launch(mode, m.name, "rotary (fuse_rope_kv=False)", "pageserve.kernels.rotary:_rotary_kernel", rot, rope, 4,
                   rows=[rows]),
            Launch(mode, m.name, "write_kv (fuse_rope_kv=False)", "pageserve.kernels.kv_write:_write_kv_kernel", kv,
                   dict(BLOCK_SIZE=PAGE, BLOCK_H=next_pow2(m.kv_heads), BLOCK_D=next_pow2(D), **_pdl_off()), 2,
                   rows=[rows])]


def decode_attention_launches(m: Model, B: int, ctx: int) -> list[Launch]:
    """``paged_decode_attention`` / ``rope_decode_attention`` as ``TritonOps`` launches them on a T4."""
    from pageserve.kernels._util import next_pow2
    from pageserve.kernels.paged_decode import decode_schedule, rope_supported
    from pageserve.model.triton_ops import ROPE_ATTENTION_ROWS

    # decode_schedule="auto" is "split" where pipelined_device() is False: every GPU below sm_90
    plan = decode_schedule(B, m.kv_heads, m.head_dim, 2, ctx // PAGE, PAGE, T4["sms"], pipelined=False, mma=False)
    rope = ROPE_ATTENTION_ROWS[0] <= B <= ROPE_ATTENTION_ROWS[1] and rope_supported(m.head_dim)
    f, D, S = "*" + DTYPE, m.head_dim, plan.num_splits
    direct = S == 1
    q_stride = m.qkv if rope else m.heads * D  # before RoPE: a view of the qkv rows; after: rope_kv's output
    args = dict(q_ptr=f, kc_ptr=f, vc_ptr=f, bt_ptr="*i32", seq_lens_ptr="*i32", part_o_ptr=f if direct else "*fp32",
                part_lse_ptr=f if direct else "*fp32", out_ptr=f, stride_qb=q_stride, stride_qh=D,
                stride_ob=m.heads * D, stride_oh=D, stride_bt=ctx // PAGE, qk_scale=0.125, **_cache_strides(m))
    if rope:
        args.update(kn_ptr=f, vn_ptr=f, pos_ptr="*i64", cs_ptr="*fp32", slot_ptr="*i64", stride_knb=m.qkv,
                    stride_knh=D, stride_vnb=m.qkv, stride_vnh=D, stride_cs=D)
    else:
        args.update(kn_ptr=f, vn_ptr=f, pos_ptr="*i32", cs_ptr=f, slot_ptr="*i32", stride_knb=0, stride_knh=0,
                    stride_vnb=0, stride_vnh=0, stride_cs=0)
    block_d = max(16, next_pow2(D))
    const = dict(GROUP=m.group, HEAD_DIM=D, PAGE=PAGE, NUM_SPLITS=S, BLOCK_G=max(16, next_pow2(m.group)),
                 BLOCK_D=block_d, BLOCK_N=plan.block_n, PREC=None, UPCAST=0, DIRECT=direct, PREFETCH=plan.prefetch,
                 ROPE=rope, **_pdl_off())
    what = f"decode attention{' + RoPE' if rope else ''} {S} split(s) x {plan.block_n} keys (context {ctx})"
    out = [Launch("default", m.name, what, "pageserve.kernels.paged_decode:_decode_split_kernel", args, const,
                  plan.num_warps, plan.num_stages, [B])]
    if not direct:
        out.append(Launch("default", m.name, f"decode attention merge of {S} splits",
                          "pageserve.kernels.paged_decode:_decode_merge_kernel",
                          dict(part_o_ptr="*fp32", part_lse_ptr="*fp32", seq_lens_ptr="*i32", out_ptr=f,
                               stride_ob=m.heads * D, stride_oh=D),
                          dict(HEAD_DIM=D, NUM_SPLITS=S, BLOCK_S=next_pow2(S), BLOCK_D=block_d, BLOCK_N=plan.block_n,
                               **_pdl_off()), 2, rows=[B]))
    return out


def prefill_attention_launch(m: Model, T: int) -> Launch:
    from pageserve.kernels._util import next_pow2
    from pageserve.kernels.paged_prefill import prefill_config

    bm, bn, warps, stages = prefill_config(m.group, mma=False)
    f, D = "*" + DTYPE, m.head_dim
    args = dict(q_ptr=f, kc_ptr=f, vc_ptr=f, out_ptr=f, bt_ptr="*i32", seq_lens_ptr="*i32", qsl_ptr="*i32",
                tiles_ptr="*i32", stride_qt=m.heads * D, stride_qh=D, stride_ot=m.heads * D, stride_oh=D,
                stride_bt=None, qk_scale=0.125, n_tiles=None, **_cache_strides(m))
    const = dict(GROUP=m.group, HEAD_DIM=D, PAGE=PAGE, Q_TOK=bm // m.group, BLOCK_M=bm, BLOCK_D=max(16, next_pow2(D)),
                 BLOCK_N=bn, PREC=None, UPCAST=0, TILE_MAP=True, DIAG_MASK=True)
    return Launch("default", m.name, f"prefill attention {bm} rows x {bn} keys", "pageserve.kernels.paged_prefill:_prefill_kernel",
                  args, const, warps, stages, [T])


def silu_and_mul_launch(mode: str, m: Model, rows: int) -> Launch:
    f, I = "*" + DTYPE, m.intermediate
    return Launch(mode, m.name, f"silu_and_mul I={I}", "pageserve.kernels.activation:_silu_and_mul_kernel",
                  dict(x_ptr=f, out_ptr=f, I=I, stride_x=2 * I, stride_o=I),
                  dict(BLOCK=1024 if I >= 1024 else 128, **_pdl_off()), 4, rows=[rows])


def argmax_launches(mode: str, m: Model, B: int, dtype: str) -> list[Launch]:
    from pageserve.kernels._util import cdiv, next_pow2
    from pageserve.kernels.argmax import default_block

    block = default_block(B)
    parts = cdiv(m.vocab, block)
    return [Launch(mode, m.name, f"argmax partials {dtype} V={m.vocab} / {block}",
                   "pageserve.kernels.argmax:_argmax_partial_kernel",
                   dict(x_ptr="*" + dtype, val_ptr="*fp32", idx_ptr="*i32", V=m.vocab, stride_x=m.vocab, PARTS=parts),
                   dict(BLOCK=block, **_pdl_off()), 4 if block <= 4096 else 8, rows=[B]),
            Launch(mode, m.name, f"argmax reduce of {parts}", "pageserve.kernels.argmax:_argmax_reduce_kernel",
                   dict(val_ptr="*fp32", idx_ptr="*i32", out_ptr="*i64", V=m.vocab, PARTS=parts),
                   dict(BLOCK_P=max(16, next_pow2(parts)), **_pdl_off()), 4, rows=[B])]


def token_bitmask_launch(m: Model, B: int) -> Launch:
    """Structured outputs' masks on the sampler's fp32 rows (any mode: the sampler is the same)."""
    from pageserve.kernels.token_bitmask import BLOCK

    words = (m.vocab + 31) // 32
    return Launch("default", m.name, f"token bitmask V={m.vocab}", "pageserve.kernels.token_bitmask:_apply_token_bitmask_kernel",
                  dict(x_ptr="*fp32", rows_ptr="*i64", bits_ptr="*i32", V=m.vocab, stride_x=m.vocab, stride_bits=words),
                  dict(BLOCK=BLOCK), 4, rows=[B])


def candidate_race_launches(m: Model, B: int) -> list[Launch]:
    """The sampler's candidate race at each candidate width (any mode), with and without seeded rows and a
    subset of the batch's rows."""
    from pageserve.engine.sampler import CANDIDATE_SLACK, CANDIDATE_WIDTHS
    from pageserve.kernels.candidate_race import launch_config

    out = []
    words = (m.vocab + 31) // 32
    for k in CANDIDATE_WIDTHS:
        S = min(m.vocab, k + CANDIDATE_SLACK)
        block, warps = launch_config(S)
        # fp32 (processed) logits, seeded or not; the model's 16-bit ones with the repetition penalty on read
        for seeds, seen in ((False, False), (True, False), (False, True)):
            out.append(Launch("default", m.name, f"candidate race k={k}{' seeded' if seeds else ''}"
                              f"{' seen' if seen else ''}",
                              "pageserve.kernels.candidate_race:_candidate_race_kernel",
                              dict(logits_ptr="*" + (DTYPE if seen else "fp32"), stride_l=m.vocab, ids_ptr="*i64",
                                   stride_ids=S, S=S, rows_ptr="*i64", table_ptr="*fp32", stride_t=B,
                                   noise_ptr="*fp32", stride_n=k, seeds_ptr="*i64", stride_s=B, out_ptr="*i64", K=k,
                                   words_ptr="*i32", stride_w=words, rep_ptr="*fp32"),
                              dict(BLOCK=block, HAS_ROWS=True, HAS_NOISE=True, HAS_SEEDS=seeds, HAS_SEEN=seen,
                                   LIBDEVICE_LOG=True, **_pdl_off()),
                              warps, rows=[B]))
    return out


def topk_select_launches(m: Model, B: int) -> list[Launch]:
    """The sampler's candidate pick at the widths it serves (any mode; the model's 16-bit logits or fp32 ones)."""
    from pageserve.engine.sampler import CANDIDATE_WIDTHS, SELECT_MAX_WIDTH
    from pageserve.kernels._util import cdiv, next_pow2
    from pageserve.kernels.topk_select import CHUNK, CHUNKS_PER_PROGRAM, TILE_CHUNKS, default_cap

    NC = cdiv(m.vocab, CHUNK)
    seen_args = dict(words_ptr="*i32", stride_w=(m.vocab + 31) // 32, rep_ptr="*fp32")
    # the model's 16-bit logits (as they are, or with the repetition penalty on read) or processed fp32 ones
    variants = ((DTYPE, False), (DTYPE, True), ("fp32", False))
    out = [Launch("default", m.name, f"candidate chunk maxima {dtype}{' seen' if seen else ''}",
                  "pageserve.kernels.topk_select:_chunk_max_kernel",
                  dict(x_ptr="*" + dtype, stride_x=m.vocab, rows_ptr="*i64", V=m.vocab, max_ptr="*i32", NC=NC,
                       **seen_args),
                  dict(CHUNK=CHUNK, CHUNKS=CHUNKS_PER_PROGRAM, HAS_ROWS=True, HAS_SEEN=seen, **_pdl_off()), 4, rows=[B])
           for dtype, seen in variants]
    for k in (w for w in CANDIDATE_WIDTHS if w <= SELECT_MAX_WIDTH):
        cap = default_cap(k)
        for dtype, seen in variants:
            out.append(Launch("default", m.name, f"candidate select k={k} {dtype}{' seen' if seen else ''}",
                              "pageserve.kernels.topk_select:_select_kernel",
                              dict(x_ptr="*" + dtype, stride_x=m.vocab, rows_ptr="*i64", V=m.vocab, max_ptr="*i32",
                                   NC=NC, list_ptr="*i32", out_ptr="*i64", K=k, CAP=cap, **seen_args),
                              dict(CHUNK=CHUNK, BLOCK_NC=max(16, next_pow2(NC)), TILE=TILE_CHUNKS,
                                   BLOCK_CAP=max(16, next_pow2(cap)), HAS_ROWS=True, HAS_SEEN=seen, **_pdl_off()), 8,
                              rows=[B]))
    return out


def repetition_penalty_launches(m: Model, B: int) -> list[Launch]:
    """The sampler's repetition penalty (any mode), with and without a newest token on the device."""
    from pageserve.kernels.penalties import BLOCK

    return [Launch("default", m.name, f"repetition penalty{' pending' if pending else ''}",
                   "pageserve.kernels.penalties:_repetition_penalty_kernel",
                   dict(logits_ptr="*fp32", stride_l=m.vocab, rows_ptr="*i32", starts_ptr="*i32", ids_ptr="*i32",
                        penalty_ptr="*fp32", pending_ptr="*i64", pending_src_ptr="*i32", scratch_ptr="*fp32"),
                   dict(BLOCK=BLOCK, HAS_PENDING=pending, **_pdl_off()), 4, rows=[B]) for pending in (False, True)] + [
        Launch("default", m.name, f"seen words{' pending' if pending else ''}",
               "pageserve.kernels.penalties:_seen_words_kernel",
               dict(words_ptr="*i32", stride_w=(m.vocab + 31) // 32, W=(m.vocab + 31) // 32, rows_ptr="*i32",
                    starts_ptr="*i32", ids_ptr="*i32", pending_ptr="*i64", pending_src_ptr="*i32"),
               dict(BLOCK=BLOCK, HAS_PENDING=pending, **_pdl_off()), 4, rows=[B]) for pending in (False, True)]


def stage_inputs_launch(m: Model, B: int) -> Launch:
    args = dict(ids_src="*i64", pos_src="*i64", slot_src="*i64", lens_src="*i64", bt_src="*i64", ids_dst="*i64",
                pos_dst="*i64", slot_dst="*i64", lens_dst="*i32", bt_dst="*i32", bs=None, nb=None, stride_src=None,
                stride_dst=None)
    return Launch("default", m.name, "decode graphs' input staging", "pageserve.kernels.step_inputs:_stage_decode_kernel",
                  args, dict(BLOCK_NB=128, **_pdl_off()), 1, rows=[B])


def matmul_launch(m: Model, what: str, M: int, N: int, K: int, bias: bool, silu_mul: bool, graphed: bool) -> Launch:
    """``matmul_invariant`` as ``DeterministicOps`` calls it on a T4 (``_launch``'s pointer kernel)."""
    import dataclasses

    import torch

    from pageserve.kernels.matmul_invariant import invariant_config

    # smem_budget(x) on a T4: 7/8 of its 65,536 bytes a block
    cfg = invariant_config(M, 2 * N if silu_mul else N, torch.float16, T4["sms"], None, K=K,
                           smem_bytes=T4["smem"] * 7 // 8, mma=False)
    if silu_mul:
        cfg = dataclasses.replace(cfg, block_n=max(16, cfg.block_n // 2))
    f = "*" + DTYPE
    args = dict(x_ptr=f, w_ptr=f, bias_ptr=f, out_ptr=f, M=M if graphed else None, N=N, K=K, stride_xm=K, stride_wn=K,
                stride_om=N)
    const = dict(HAS_BIAS=bias, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                 PREC=None, UPCAST=0, SILU_MUL=silu_mul, LATE_RELEASE=False, **_pdl_off())
    tma = " (TMA tile: pointer loads below sm_90)" if cfg.tma else ""
    return Launch("deterministic", m.name,
                  f"matmul_invariant {what}{' + SiLU·mul' if silu_mul else ''} N={N} K={K} "
                  f"{'M-specialised (graphs)' if graphed else 'generic'}{tma}",
                  f"pageserve.kernels.matmul_invariant:_POINTER_KERNELS[{0 if graphed else 1}]", args, const,
                  cfg.num_warps, cfg.num_stages, [M])


def invariant_attention_launches(m: Model, T: int, decode: bool, ctx: int, rope: bool) -> list[Launch]:
    """``paged_attention_invariant`` as ``DeterministicOps`` calls it on a T4: T decode rows, or one chunk of T tokens."""
    from pageserve.kernels._util import cdiv, next_pow2
    from pageserve.kernels.paged_invariant import FMA_BLOCK_N as BLOCK_N  # mma_dot_for is False on a T4
    from pageserve.kernels.paged_invariant import KV_SPLIT, invariant_block_m, split_launch

    small_m = invariant_block_m(m.group)  # attention_prefill_block_m "auto" is None below sm_90: small tiles only
    q_tok = small_m // m.group
    n_tiles = T if decode else cdiv(T, q_tok)
    max_ctx = ctx if decode else min(ctx, T)
    S = max(1, cdiv(max_ctx, KV_SPLIT))
    P, flat, stages, warps, phased = split_launch(small_m, small_m, n_tiles, m.kv_heads, S, T4["sms"], decode, False,
                                                  block_n=BLOCK_N)
    f, D = "*" + DTYPE, m.head_dim
    q_stride = m.qkv if rope else m.heads * D
    args = dict(q_ptr=f, kc_ptr=f, vc_ptr=f, out_ptr=f, part_acc_ptr="*fp32", part_ml_ptr="*fp32", bt_ptr="*i32",
                seq_lens_ptr="*i32", qsl_ptr="*i32", tiles_ptr="*i32", stride_qt=q_stride, stride_qh=D,
                stride_ot=m.heads * D, stride_oh=D, stride_bt=None, qk_scale=0.125, num_splits=None, n_tiles=None,
                split_programs=None, split_rows=None, **_cache_strides(m))
    if rope:
        args.update(kn_ptr=f, vn_ptr=f, pos_ptr="*i64", cs_ptr="*fp32", slot_ptr="*i64", stride_knt=m.qkv, stride_knh=D,
                    stride_vnt=m.qkv, stride_vnh=D, stride_cs=D)
    else:
        args.update(kn_ptr=f, vn_ptr=f, pos_ptr=f, cs_ptr=f, slot_ptr=f, stride_knt=0, stride_knh=0, stride_vnt=0,
                    stride_vnh=0, stride_cs=0)
    common = dict(GROUP=m.group, NUM_KV_HEADS=m.kv_heads, HEAD_DIM=D, KV_SPLIT=KV_SPLIT,
                  BLOCK_D=max(16, next_pow2(D)), **_pdl_off())
    const = dict(PAGE=PAGE, BLOCK_N=BLOCK_N, PREC=None, UPCAST=0, ROWSUM_DOT=False, Q_TOK=q_tok, BLOCK_M=small_m,
                 FLAT=flat, ROPE=rope, PHASED=phased, **common)
    kind = "decode" if decode else "chunk"
    what = (f"invariant attention{' + RoPE' if rope else ''} {small_m} rows x {BLOCK_N} keys, "
            f"{'flat' if flat else 'a loop per split'} ({kind}, context {ctx})")
    out = [Launch("deterministic", m.name, what, "pageserve.kernels.paged_invariant:_split_kernel", args, const, warps,
                  stages, [T])]
    if S > 1:
        out.append(Launch("deterministic", m.name, "invariant attention merge",
                          "pageserve.kernels.paged_invariant:_merge_kernel",
                          dict(part_acc_ptr="*fp32", part_ml_ptr="*fp32", out_ptr=f, seq_lens_ptr="*i32",
                               qsl_ptr="*i32", tiles_ptr="*i32", stride_ot=m.heads * D, stride_oh=D, num_splits=None,
                               n_tiles=None, split_rows=None),
                          dict(Q_TOK=q_tok, BLOCK_M=small_m, **common), 4, rows=[T]))
    return out


def dequant_launch(m: Model, what: str, N: int, K: int, rows: int) -> Launch:
    return Launch("int8", m.name, f"dequantize_int8 {what} [{N}x{K}]", "pageserve.kernels.gemv_int8:_dequant_kernel",
                  dict(q_ptr="*i8", scale_ptr="*" + DTYPE, out_ptr="*" + DTYPE, N=N, K=K, stride_qn=K, stride_on=K),
                  dict(BLOCK_N=16, BLOCK_K=256, USE_PDL=False), 4, rows=[rows])


def launches() -> list[Launch]:
    from pageserve.model.deterministic_ops import DeterministicOps
    from pageserve.model.triton_ops import INT8_SILU_DOWN_ROWS, ROPE_ATTENTION_ROWS

    det = DeterministicOps(cublas_rows=None)  # only its row limits are read; no GPU is touched
    out: list[Launch] = []
    for m in MODELS:
        H, I, V, qd = m.hidden, m.intermediate, m.vocab, m.heads * m.head_dim
        linears = (("qkv", m.qkv, H, m.bias), ("o", H, qd, False), ("gate_up", 2 * I, H, False), ("down", H, I, False))
        steps = [(B, True) for B in DECODE_ROWS] + [(T, False) for T in PREFILL_TOKENS]
        # default ops
        for rows, decode in steps:
            out += norm_launches("default", m, rows)
            if rows == 1:  # the GEMV up to gemv_max_m (1) rows; cuBLAS above
                out += gemv_launches("default", m, "qkv", 1, m.qkv, H, bias=m.bias)
                out += gemv_launches("default", m, "o", 1, H, qd)
                out += gemv_launches("default", m, "gate_up", 1, 2 * I, H)
                out += gemv_launches("default", m, "SiLU·down", 1, H, I, silu_mul=True)
                out += gemv_launches("default", m, "LM head", 1, V, H)
            else:
                out.append(silu_and_mul_launch("default", m, rows))
            if decode:
                for ctx in CONTEXTS:
                    out += decode_attention_launches(m, rows, ctx)
                out.append(stage_inputs_launch(m, rows))
                for dtype in (DTYPE, "fp32"):  # graphs' logits, or the sampler's processed fp32 rows
                    out += argmax_launches("default", m, rows, dtype)
                out.append(token_bitmask_launch(m, rows))
                out += candidate_race_launches(m, rows)
                out += repetition_penalty_launches(m, rows)
                out += topk_select_launches(m, rows)
            else:
                out.append(prefill_attention_launch(m, rows))
            if not (decode and ROPE_ATTENTION_ROWS[0] <= rows <= ROPE_ATTENTION_ROWS[1]):
                out += rope_kv_launches("default", m, rows)
            out += rope_kv_launches("default", m, rows, unfused=True)
        # deterministic ops
        for rows, decode in steps:
            out += norm_launches("deterministic", m, rows)
            for graphed in ((False, True) if decode else (False,)):
                for what, N, K, bias in linears:
                    out.append(matmul_launch(m, what, rows, N, K, bias, False, graphed))
                if rows <= det.silu_in_gate_up_max_rows:
                    out.append(matmul_launch(m, "gate_up", rows, I, H, False, True, graphed))
                out.append(matmul_launch(m, "LM head", rows, V, H, False, False, graphed))
            if rows > det.silu_in_gate_up_max_rows:
                out.append(silu_and_mul_launch("deterministic", m, rows))
            rope = decode and rows <= det.rope_in_attention
            if not rope:
                out += rope_kv_launches("deterministic", m, rows)
            for ctx in CONTEXTS:
                out += invariant_attention_launches(m, rows, decode, ctx, rope)
        # int8 weights (default ops): the int8 kernels only, the rest is the default mode's. Below sm_80
        # TritonOps._linear_int8 sends every launch of more than one row to dequantize + cuBLAS (mma_dot_for)
        for rows, decode in steps:
            for what, N, K, bias in linears:
                if what == "down" and rows <= INT8_SILU_DOWN_ROWS:
                    out += gemv_launches("int8", m, "SiLU·down int8", rows, N, K, quant=True, silu_mul=True)
                elif rows == 1:
                    out += gemv_launches("int8", m, f"{what} int8", rows, N, K, quant=True, bias=bias)
                else:
                    out.append(dequant_launch(m, what, N, K, rows))
            if rows > INT8_SILU_DOWN_ROWS:
                out.append(silu_and_mul_launch("int8", m, rows))
    return out


def _key(ln: Launch) -> tuple:
    """The compile a launch needs: its kernel, specialisation and options (launches that differ only in
    values Triton does not specialise on share it; each compile must run ptxas, whose report we read)."""
    sig, consts, attrs = specialize(kernel_of(ln.kernel), ln.args, ln.const)
    return (ln.kernel, repr(sig), repr(sorted(consts.items())), repr(sorted(attrs.items())), ln.warps, ln.stages)


def _task(ln: Launch) -> tuple:
    return (ln.kernel, *specialize(kernel_of(ln.kernel), ln.args, ln.const), ln.warps, ln.stages)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true",
                    help="exit 1 if a launch fails to compile, exceeds 64 KB of shared memory, spills, or holds a "
                         "bf16 / Hopper-only instruction")
    ap.add_argument("--only", default="", help="audit only the launches whose kernel or description holds this text")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="compiles in parallel (default 2)")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: this compiles for sm_75", file=sys.stderr)
        return 2
    # a cache of our own, removed at the end: every compile runs ptxas (its report is what we read)
    cache = tempfile.mkdtemp(prefix="t4_audit_")
    os.environ["TRITON_CACHE_DIR"] = cache
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's default, said (it warns otherwise)
    try:
        merged: dict[tuple, Launch] = {}
        for ln in launches():  # one compile per distinct launch, listed with every row count it serves
            if args.only and args.only not in f"{ln.kernel} {ln.what}":
                continue
            key = (ln.mode, ln.model, ln.what, ln.kernel, repr(sorted(ln.args.items())),
                   repr(sorted(ln.const.items())), ln.warps, ln.stages)
            if key in merged:
                merged[key].rows += [r for r in ln.rows if r not in merged[key].rows]
            else:
                merged[key] = ln
        tasks, keys_of = {}, {}
        for key, ln in merged.items():
            keys_of[key] = _key(ln)
            tasks.setdefault(keys_of[key], _task(ln))
        keys = list(tasks)
        if args.jobs > 1:
            with ProcessPoolExecutor(args.jobs) as pool:
                results = dict(zip(keys, pool.map(compile_one, [tasks[k] for k in keys])))
        else:
            results = {k: compile_one(tasks[k]) for k in keys}
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    bad = []
    for key, ln in merged.items():
        r = results[keys_of[key]]
        name = ln.kernel.split(":")[1]
        head = (f"[{ln.mode}] {ln.model}: {name} — {ln.what}; rows {','.join(map(str, sorted(ln.rows)))}; "
                f"{ln.warps} warps, {ln.stages} stages")
        if not r["ok"]:
            print(f"{head}: COMPILE FAILED {r['error']}")
            bad.append(head)
            continue
        problems = []
        if r["smem"] > T4["smem"]:
            problems.append(f"shared memory {r['smem']} > {T4['smem']}")
        if r["spills"]:
            problems.append(f"spills {r['spills']} B")
        if r["regs"] > MAX_REGS:
            problems.append(f"{r['regs']} registers")
        if r["forbidden"]:
            problems.append("PTX holds " + ", ".join(r["forbidden"]))
        print(f"{head}: {r['regs']} regs, {r['spills']} B spilled, {r['stack']} B stack, {r['smem']} B shared, "
              f"dot {r['dot']}" + (f"  <-- {'; '.join(problems)}" if problems else ""))
        if problems:
            bad.append(head)
    ok = [r for r in results.values() if r["ok"]]
    print(f"{len(merged)} launches ({len(results)} distinct compiles for sm_75): max {max(r['smem'] for r in ok)} B "
          f"shared, max {max(r['regs'] for r in ok)} registers a thread, max {max(r['spills'] for r in ok)} B spilled; "
          f"{len(bad)} over a T4's limits or failed")
    if args.check and bad:
        print("launches that do not fit a T4:\n  " + "\n  ".join(bad), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
