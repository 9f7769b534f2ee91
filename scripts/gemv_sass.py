"""The M = 1 GEMV's K loop as the GPU would run it, without a GPU: compiles ``_gemv_kernel`` for
sm_90 (Triton's own ptxas and cuobjdump, shipped in its wheel), finds the K loop in the SASS (the
span a backward branch closes) and counts its instructions by opcode.

Why: the int8 GEMV streamed at 2.36 TB/s of int8 where the bf16 one reaches ~3.9 (06b at
ca551bec), and the exponent-trick conversion gave only 6%. Its SASS showed why: the int8 weight
tile was loaded 16 bytes a thread while the bf16 activations come 8 elements a thread, so every
iteration moved the converted tile through shared memory to match them (2 STS.128, 4 LDS.128
and 4 BAR.SYNC a loop trip). ``gemv.launch_gemv(match_x=True)`` reads int8 weights in x's vector
width instead; ``--check`` fails if a barrier or a shared-memory access is back in the loop.

    python scripts/gemv_sass.py [--check]     # must run without TRITON_INTERPRET (it compiles for sm_90)
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import importlib  # noqa: E402

gemv_mod = importlib.import_module("pageserve.kernels.gemv")  # the module (the package exports a function of that name)

ARGS = ["x_ptr", "w_ptr", "scale_ptr", "bias_ptr", "out_ptr", "part_ptr", "M", "N", "K", "K_PER_SPLIT",
        "stride_xm", "stride_wn", "stride_om"]
# (label, int8 weights, BLOCK_N, BLOCK_K, warps): the shapes the H200's tuned configs use at M = 1
CASES = [("bf16 2x1024", False, 2, 1024, 4), ("int8 2x1024", True, 2, 1024, 4), ("int8 2x2048", True, 2, 2048, 4),
         ("int8 1x2048", True, 1, 2048, 4), ("int8 4x1024", True, 4, 1024, 4)]


def compile_sass(quant: bool, block_n: int, block_k: int, warps: int, match_x: bool = True, block_m: int = 1,
                 swap_ab: bool = False, stages: int = 3, magic: str = "ptx") -> str:
    """SASS of ``_gemv_kernel`` for sm_90: M = 1 (the CUDA-core GEMV) or ``block_m`` > 1 (its tl.dot
    tiles, split-K on, ``swap_ab`` as ``GemvConfig.swap_ab``); ``magic``: the int8 conversion
    (``gemv.MAGIC_MODES``)."""
    k = gemv_mod._gemv_kernel
    sig = {n: "i32" for n in ARGS}
    sig.update(x_ptr="*bf16", w_ptr="*i8" if quant else "*bf16", scale_ptr="*bf16", bias_ptr="*bf16",
               out_ptr="*bf16", part_ptr="*fp32")
    dot = block_m > 1
    const = dict(HAS_BIAS=False, SPLIT=dot, SILU_MUL=False, QUANT=quant,
                 MAGIC=gemv_mod.MAGIC_MODES[magic] if quant else 0, BLOCK_M=block_m,
                 BLOCK_N=block_n, BLOCK_K=block_k, USE_DOT=dot, DEFER_REDUCE=not dot, PREC="ieee", UPCAST=False,
                 USE_PDL=False, W_VEC=0 if dot else gemv_mod.weight_vector(2, quant, match_x), SWAP_AB=swap_ab)
    sig.update({n: "constexpr" for n in const})
    names = list(k.arg_names)
    aligned = [["tt.divisibility", 16]]
    attrs = {(names.index(n),): aligned for n in ("x_ptr", "w_ptr", "K", "K_PER_SPLIT", "stride_wn", "stride_xm", "N")}
    return cuobjdump(compile_sm90(k, sig, const, attrs, warps, stages), "-sass")


def compile_sm90(kernel, sig: dict, const: dict, attrs: dict, warps: int, stages: int, capability: int = 90):
    """``kernel`` compiled for sm_90 (or another ``capability``: 75 for a T4, scripts/t4_compile_audit.py)
    with Triton's own tools: ``sig`` maps argument names to types ("constexpr" for those in ``const``,
    which gives their values), ``attrs`` (argument index,) to hints."""
    names = list(kernel.arg_names)
    src = ASTSource(kernel, sig, {(names.index(n),): v for n, v in const.items()}, attrs)
    return triton.compile(src, target=GPUTarget("cuda", capability, 32),
                          options={"num_warps": warps, "num_stages": stages})


def cuobjdump(compiled, flag: str) -> str:
    """``cuobjdump <flag>`` (``-sass``, ``-res-usage``) of a compiled kernel's cubin, by the wheel's own tool."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    try:
        return subprocess.run([str(tool), flag, f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)


LINE = re.compile(r"/\*([0-9a-f]{4})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")


def k_loop(sass: str) -> list[str]:
    """Opcodes of the K loop: from the target of the first backward branch to that branch."""
    ins = [(int(a, 16), op, rest) for a, op, rest in LINE.findall(sass)]
    for addr, op, rest in ins:
        if op == "BRA":
            target = re.match(r"\s*(?:`\()?\s*(0x[0-9a-f]+)", rest)
            if target and int(target.group(1), 16) < addr:
                lo = int(target.group(1), 16)
                return [o for a, o, _ in ins if lo <= a <= addr]
    return []


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if a K loop has a barrier or shared-memory access")
    ap.add_argument("--old", action="store_true", help="also show the int8 tiles in their own vector width (match_x=False)")
    ap.add_argument("--magic", default="ptx,ops", help="int8 conversions to compile, of gemv.MAGIC_MODES (default ptx,ops)")
    ap.add_argument("--dot", action="store_true",
                    help="also the tl.dot tiles at M = 64 (64 x 128 x 64, 4 warps, 4 stages), plain and swap_ab")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: this compiles for sm_90", file=sys.stderr)
        return 2
    bad = []
    magics = [m for m in args.magic.split(",") if m]
    counts: dict[tuple[str, str], int] = {}
    for label, quant, bn, bk, warps in CASES:
        for magic in magics if quant else ["-"]:
            for match_x in (True, False) if (args.old and quant) else (True,):
                loop = k_loop(compile_sass(quant, bn, bk, warps, match_x, magic=magic if quant else "cvt"))
                ops = collections.Counter(o.split(".")[0] for o in loop)
                weights = bn * bk / (32 * warps)  # a thread's weights per loop trip
                tag = label + ("" if not quant else f" [{magic}]") + ("" if match_x else " (own vector width)")
                print(f"{tag}: {len(loop)} instructions a loop trip for {weights:.0f} weights a thread "
                      f"({len(loop) / weights:.2f} a weight); BAR {ops['BAR']}, STS {ops['STS']}, LDS {ops['LDS']}, "
                      f"LDG {ops['LDG']}; {dict(ops.most_common(6))}")
                if match_x and (not loop or ops["BAR"] or ops["STS"] or ops["LDS"]):
                    bad.append(tag)
                if match_x:
                    counts[(label, magic)] = len(loop)
    # the PTX conversion must stay cheaper than the same arithmetic in Triton ops (1.25 vs 2.25 a weight)
    for label, *_ in CASES:
        if (label, "ptx") in counts and (label, "ops") in counts and counts[(label, "ptx")] >= counts[(label, "ops")]:
            bad.append(f"{label}: ptx {counts[(label, 'ptx')]} >= ops {counts[(label, 'ops')]} instructions")
    if args.dot:
        for quant in (False, True):
            for swap in (False, True):
                loop = k_loop(compile_sass(quant, 128, 64, 4, block_m=64, swap_ab=swap, stages=4))
                ops = collections.Counter(o.split(".")[0] for o in loop)
                print(f"{'int8' if quant else 'bf16'} M=64 64x128x64{' swap_ab' if swap else ''}: {len(loop)} instructions "
                      f"a loop trip; BAR {ops['BAR']}, STS {ops['STS']}, LDS {ops['LDS']}, LDGSTS {ops['LDGSTS']}, "
                      f"HGMMA {ops['HGMMA']}, F2FP {ops['F2FP']}")
    if args.check and bad:
        print("shared memory or barriers in the K loop, no loop found, or PTX no cheaper: " + ", ".join(bad),
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
