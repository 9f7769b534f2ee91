"""Registers a thread of the decode attention's split kernel, with and without RoPE in its launch
(``paged_decode.rope_decode_attention``), compiled for sm_90 on this machine (Triton's own ptxas and
cuobjdump, shipped in its wheel; no GPU), at the launches the engine makes for the Qwen2.5-3B heads.

Why (NOTES.md, session 34): with the newest token folded in after the key loop, its k and v stayed live
through the loop and the split rule's 64-key launch took 154 registers a thread against 111, so 3 programs
fitted an SM instead of 4 and a 200-row step's 400 programs no longer fitted one wave (the H200 measured
that band 0.05 ms a step slower). ``--check`` fails if RoPE costs any launch a program an SM.

    python scripts/decode_regs.py [--check]     # must run without TRITON_INTERPRET (it compiles for sm_90)
"""
from __future__ import annotations

import argparse
import importlib
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gemv_sass import compile_sm90, cuobjdump  # noqa: E402  (this folder is on sys.path when run as a script)

paged_decode = importlib.import_module("pageserve.kernels.paged_decode")

POINTERS = dict(q_ptr="*bf16", kc_ptr="*bf16", vc_ptr="*bf16", bt_ptr="*i32", seq_lens_ptr="*i32",
                part_o_ptr="*fp32", part_lse_ptr="*fp32", out_ptr="*bf16", kn_ptr="*bf16", vn_ptr="*bf16",
                pos_ptr="*i64", cs_ptr="*fp32", slot_ptr="*i64")
# (label, splits, BLOCK_N, warps, stages, prefetch): ``decode_schedule``'s launches at 2 KV heads on 132 SMs
CASES = [("split rule, 200 rows: 1 split x 64 keys, 4 warps, 2 stages", 1, 64, 4, 2),
         ("split rule, 96 rows: 2 splits x 64 keys, 4 warps, 2 stages", 2, 64, 4, 2),
         ("pipelined, 200 rows: 1 split x 32 keys, 4 warps, 3 stages", 1, 32, 4, 3),
         ("pipelined, 64 rows: 1 split x 128 keys, 8 warps, 3 stages", 1, 128, 8, 3)]
REGS_PER_SM, SMEM_PER_SM = 65536, 228 * 1024


def resources(rope: bool, splits: int, block_n: int, warps: int, stages: int) -> tuple[int, int]:
    """(registers a thread, static shared memory bytes) of ``_decode_split_kernel`` for sm_90."""
    k = paged_decode._decode_split_kernel
    names = list(k.arg_names)
    sig = {n: "i32" for n in names}
    sig.update(POINTERS, qk_scale="fp32")
    const = dict(GROUP=8, HEAD_DIM=128, PAGE=16, NUM_SPLITS=splits, BLOCK_G=16, BLOCK_D=128, BLOCK_N=block_n,
                 PREC=None, UPCAST=False, DIRECT=splits == 1, USE_PDL=False, PREFETCH=True, ROPE=rope)
    sig.update({n: "constexpr" for n in const})
    aligned = [["tt.divisibility", 16]]
    # as the engine's calls specialize them: 16-byte aligned pointers and strides, stride_bt left unspecialized
    attrs = {(names.index(n),): aligned for n in names
             if n.endswith("_ptr") or (n.startswith("stride_") and n != "stride_bt")}
    compiled = compile_sm90(k, sig, const, attrs, warps, stages)
    usage = cuobjdump(compiled, "-res-usage")
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    return regs, compiled.metadata.shared


def programs_per_sm(regs: int, smem: int, warps: int) -> int:
    """Resident programs an SM holds: registers go in 8-a-thread steps, then the shared memory."""
    per_program = -(-regs // 8) * 8 * 32 * warps
    return min(REGS_PER_SM // per_program, SMEM_PER_SM // max(smem, 1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if RoPE in the launch costs a program an SM")
    args = ap.parse_args()
    worse = []
    for label, splits, block_n, warps, stages in CASES:
        row = {}
        for rope in (False, True):
            regs, smem = resources(rope, splits, block_n, warps, stages)
            row[rope] = programs_per_sm(regs, smem, warps)
            print(f"{label}, {'RoPE in the launch' if rope else 'plain'}: {regs} registers a thread, {smem} B shared, "
                  f"{row[rope]} programs an SM", flush=True)
        if row[True] < row[False]:
            worse.append(label)
    if args.check and worse:
        print("RoPE in the launch costs programs an SM:", worse)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
