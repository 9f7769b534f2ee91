"""Small-batch decode steps (1-8 rows), one switch at a time, in both modes (issues 15 and 14). At
97c30a6 notebook 09 measured the deterministic batch-1 step at 3.11 ms (1.40x the default mode); at
2df709a this script found it was the SiLU·mul epilogue in gate_up under programmatic dependent launch
(graph 3.07 ms, 2.73 with SiLU·mul in its own kernel), and the default mode's batch-8 step slower than
the deterministic one (4.52 vs 3.21 ms of graph time). At 6bad32f: the GEMV at 2-8 rows was the cause
(cuBLAS 2.73-2.80 ms at 2-8 rows) and PDL over 5-8 rows slows the det step; since then the default
mode's GEMV serves one row and the det mode's PDL stops at 4 rows (variants *_8_rows: as before).

Each variant is an engine of its own at the Qwen2.5-3B shape (random weights, bf16): the default mode,
with the GEMV at one or up to 8 rows, with PDL at one row only; the deterministic mode as it ships, with
PDL up to 1, 4 or 8 rows, without PDL, and the earlier switches (SiLU·mul always in its own kernel, the
generic matmul compile in the graphs); and (session 13) int8 weights as they ship (PDL at one row),
with PDL to 8 rows, or with CUDA-core tiles at 2-8 rows; (session 14) any of these with the step's
copy-in and the sampler's argmax as before (``*_torch_copy_in``) or only the argmax (``*_torch_argmax``). Per variant and batch: the step's wall time over consecutive ``engine.step()`` calls
(what 09 reports) and its graph's GPU time alone (replays).

(session 23) ``det_mix_*`` run the deterministic engine with some ops handed to the default ones, to split its
batch-1 step into parts (attribution only: not invariant); ``--w1 N`` sizes the engines as notebook 09's and runs
W1 per variant too (stage ``detw1``).

    python scripts/det_b1_switches.py --out DIR [--batches 1,2,4,8] [--variants name,...] [--w1 500 --name NAME]

Writes DIR/det_b1_switches.json (with the commit) after every variant. On the H200: stage ``detb1``
of scripts/h200_run.sh.
"""
from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path

import torch

from pageserve.engine import model_runner
from pageserve.engine.llm import LLM
from pageserve.lab import bench
from pageserve.lab.decode_bench import decode_step_ms, graph_replay_ms
from pageserve.lab.profiling import PATCHES
from pageserve.lab.results import provenance

VARIANTS = {
    "default": (False, {}),
    "default_gemv_1_row": (False, {"gemv_max_m": 1}),
    "default_gemv_8_rows": (False, {"gemv_max_m": 8}),
    "default_pdl_1_row": (False, {"pdl_max_rows": 1}),
    # session 19 ran "default_pdl_512_rows" ({"pdl_max_rows": 512}: every decode-path Triton kernel under PDL
    # at any batch) at 7b2381e-732dc20, the only commits whose TritonOps accept it: b64 +0.11 ms, b256
    # +0.05-0.12 ms (diagnostics/det_b1_switches_pdl_all_rows_732dc20.*); removed with that switch
    # session 20: the decode attention's pipelined schedule (opt-in) and the split rule (the default; at 5c810d1,
    # where pipelined was the default on sm_90, this variant was the A/B's reference). At 9a8bb02 the variants
    # default_attn_prefetch{,_stages_3} ran the split rule with the prefetch alone / with 3 stages
    # (diagnostics/det_b1_switches_attn_prefetch_9a8bb02.*)
    "default_attn_pipelined": (False, {"decode_schedule": "pipelined"}),
    # session 21: PDL kernels load their step inputs (and the norms their weight) before the wait; "wait_first"
    # keeps every wait at the kernel's top, as before (kernels/_util.py, "Step inputs before the wait"). At
    # 0b4076b the GEMV's first weight tile came before the wait too, and "default_pdl_weights_after_wait" (that
    # TritonOps's pdl="weights_after_wait") left it after: diagnostics/det_b1_switches_pdl_inputs_0b4076b.*
    "default_pdl_wait_first": (False, {"pdl": "wait_first"}),
    "det_pdl_wait_first": (True, {"pdl": "wait_first"}),
    "int8_pdl_wait_first": (False, {"pdl": "wait_first"}, "int8"),
    "default_attn_split_rule": (False, {"decode_schedule": "split"}),
    # session 28: "default_decode_{longest_first,batch_order}" ({"decode_order": "waves" / "none"}) at 3da542c-7c452d3,
    # the decode kernel's sequences longest context first past one wave; not run here, removed with the switch
    # session 22: "default_l2pf_{16,32}[_before_wait|_evict_last]", "default_l2pf_16_to_64_rows", "det_l2pf_32",
    # "int8_l2pf_32" ran TritonOps(l2_prefetch_mb=...) at 3f7c02f, the only commit that has it: a kernel after each
    # qkv projection asking L2 for o, gate|up and down; +0.10-0.13 ms at b1 in every mode
    # (diagnostics/det_b1_switches_l2_prefetch_3f7c02f.*)
    # session 22: "default_fold_reduce" / "default_no_fold" / "int8_no_fold" ran TritonOps(fold_split_k_reduce=) at
    # 04a45f0, the only commit that has it (the down GEMV's split-K partials summed by the next norm): +0.027 ms at
    # b1 (diagnostics/det_b1_switches_fold_reduce_04a45f0.*)
    # session 22: torch's preferred BLAS library for the engine's cuBLAS products (decode batches of 2+ rows),
    # set before the engine is built and put back after ("_blas" is this script's, not a TritonOps option)
    "default_cublaslt": (False, {"_blas": "cublaslt"}),
    # session 29: the logits converted to fp32 after the head, as before (lab.profiling.fp32_logits, a patch
    # around the engine: "_patch" is this script's, not a TritonOps option)
    "default_fp32_logits": (False, {"_patch": "fp32_logits"}),
    # session 22: SiLU·mul in the gate_up product's epilogue (the invariant matmul) for decode batches in a row range
    # (at 0807ae7 the default had it off: diagnostics/det_b1_switches_gate_up_silu_0807ae7.*); 2..128 at 21f46ad, 2..64 on
    # Hopper since f9fa8a0 (..._gate_up_silu_range_21f46ad.*)
    "default_gate_up_silu_9_256": (False, {"gate_up_silu_rows": (9, 256)}),
    "default_gate_up_silu_2_256": (False, {"gate_up_silu_rows": (2, 256)}),
    "default_gate_up_silu_2_64": (False, {"gate_up_silu_rows": (2, 64)}),
    "default_gate_up_silu_2_192": (False, {"gate_up_silu_rows": (2, 192)}),
    "default_gate_up_silu_2_128": (False, {"gate_up_silu_rows": (2, 128)}),  # 80-112 rows: +0.22-0.27 ms (..._82a5456.*)
    "default_no_gate_up_silu": (False, {"gate_up_silu_rows": None}),
    # session 56: "default_no_norm_fold" / "default_input_norm_fold" (TritonOps(norm_fold_rows=, input_norm_fold_rows=):
    # the add + RMSNorm folded into o_proj's beta and gate_up's / qkv's K loop) at 1c6cfef only: slower at every batch
    # session 34: decode steps' RoPE and K/V write as rope_kv's launch before the attention (as before), not
    # inside the decode attention's launch (kernels.paged_decode.rope_decode_attention, the default since)
    # session 57: o / down as K slices in one batched cuBLAS call, summed by the next add + RMSNorm instead of
    # cuBLAS's own split-K reduce launch (TritonOps(split_to_norm_rows=, split_to_norm=))
    "default_split_down2": (False, {"split_to_norm_rows": (2, 64), "split_to_norm": {"down": 2}}),
    "default_split_down4": (False, {"split_to_norm_rows": (2, 64), "split_to_norm": {"down": 4}}),
    "default_split_down8": (False, {"split_to_norm_rows": (2, 64), "split_to_norm": {"down": 8}}),
    "default_split_down4_o2": (False, {"split_to_norm_rows": (2, 64), "split_to_norm": {"down": 4, "o": 2}}),
    # session 58 at 7c55685 (diagnostics/det_b1_switches_split_range_7c55685.*): o in slices too with down's 2, and
    # wider row ranges (above 64 rows down takes the SiLU·mul kernel first, then its slices to the norm)
    "default_split_down2_o2": (False, {"split_to_norm_rows": (2, 64), "split_to_norm": {"down": 2, "o": 2}}),
    "default_split_down2_to_128": (False, {"split_to_norm_rows": (2, 128), "split_to_norm": {"down": 2}}),
    "default_split_down2_to_256": (False, {"split_to_norm_rows": (2, 256), "split_to_norm": {"down": 2}}),
    "default_split_down4_to_256": (False, {"split_to_norm_rows": (2, 256), "split_to_norm": {"down": 4}}),
    # session 58 (after the range became 2-256 rows at a68d9d7): "default" is down in 2 slices at 2-256 rows; these
    # are the range as before it, and o in 2 slices on top (the probe: -1.7 us at 200 rows, +1.0 at 256)
    "default_split_to_64": (False, {"split_to_norm_rows": (2, 64)}),
    "default_split_down2_o2_to_256": (False, {"split_to_norm_rows": (2, 256), "split_to_norm": {"down": 2, "o": 2}}),
    "default_no_rope_attention": (False, {"fuse_rope_attention": False}),
    "int8_no_rope_attention": (False, {"fuse_rope_attention": False}, "int8"),
    "default_rope_attention_9_up": (False, {"fuse_rope_attention": (9, 1 << 30)}),  # not in steps under PDL
    "default_rope_attention_all": (False, {"fuse_rope_attention": True}),  # batch 1 too (+0.12 ms there at a048ef2)
    "det": (True, {}),
    "det_pdl_1_row": (True, {"pdl_max_rows": 1}),
    "det_pdl_4_rows": (True, {"pdl_max_rows": 4}),
    "det_pdl_8_rows": (True, {"pdl_max_rows": 8}),
    "det_no_pdl": (True, {"pdl": False}),
    "det_silu_kernel": (True, {"silu_in_gate_up_max_rows": 0}),
    "det_generic_in_graphs": (True, {"matmul_specialize": False}),
    "det_all_three_off": (True, {"pdl": False, "silu_in_gate_up_max_rows": 0, "matmul_specialize": False}),
    # session 23: the deterministic batch-1 step, part by part. "_mix" (this script's, not an ops option) hands
    # some of DeterministicOps' methods to a default-options TritonOps (not invariant: attribution only):
    # the default decode attention, or the default linears (the GEMVs at one row, cuBLAS above)
    "det_mix_default_attention": (True, {"_mix": "attention"}),
    "det_mix_default_linears": (True, {"_mix": "linears"}),
    # and the switches built for it at 3416e93-943114a (diagnostics/det_b1_switches_{det_b1_parts_3416e93,
    # ksplit_silu_in_943114a}.*): "det_attn_unroll[_no_ahead|_fold4|_warps8]", "det_attn_fold4" (the attention's
    # split tiles unrolled, the merge folding 4 splits a trip), "det_ksplit{2,3,4}" (the down projection's K in
    # fixed splits), "det_silu_in_down" (SiLU·mul on down's x tiles) and their combinations ran DeterministicOps
    # options that only those commits have: none faster at one row but 8 attention warps, now the policy's
    "det_attn_warps4": (True, {"attention_launch": {"split_warps": 4}}),  # the launch before the policy
    # session 26: the linears on cuBLAS where it gives the invariant kernel's bits (checked per shape and rows;
    # DeterministicOps.cublas_rows, 128-2,048 rows by default on a GPU); this variant keeps every linear on
    # kernels/matmul_invariant.py, as before
    "det_no_cublas": (True, {"cublas_rows": None}),
    # session 49: cuBLAS tried up to the default token budget (eager prefill steps of 2,049-8,192 rows too, each
    # bucket probed at start-up like the rest), against CUBLAS_ROWS' 2,048
    "det_cublas_to_8192": (True, {"cublas_rows": (128, 8192)}),
    # session 49: the paired gate_up + SiLU·mul kernel where its bits are this mode's (on by default on Hopper)
    "det_no_paired": (True, {"paired_rows": None}),
    # session 38: decode steps' RoPE and K/V write inside the invariant attention's split launch (the default up
    # to 4 rows since then: diagnostics/det_b1_switches_rope_in_attention_02b5869.*); rope_kv's launch before the
    # attention at every row count, as before, or the fused launch at every row count (as "det" ran at 02b5869)
    "det_rope_kv_launch": (True, {"rope_in_attention": 0}),
    "det_rope_in_attention_all_rows": (True, {"rope_in_attention": 1 << 30}),
    # session 39: the SiLU·mul epilogue on launches with PDL, letting down launch after its K loop (the det default
    # since e11de29's runs); before, SiLU·mul in its own kernel there; or the epilogue released at its top, as every
    # other PDL kernel (session 12's +0.34 ms). At 60d2e48-e11de29 "det_mm_late_release" / "_late_release" (every
    # matmul after its K loop), "..._gate_up_tail{2,4}" (two / four K steps before the end) and "..._late_gate_up_qkv"
    # ran DeterministicOps options only those commits have: slower or level (diagnostics/det_b1_switches_
    # {late_release_60d2e48,release_points_e11de29}.*)
    "det_silu_kernel_under_pdl": (True, {"silu_in_gate_up_pdl": False}),
    # at 8212719 "det_down_one_per_sm[_top]" (DeterministicOps(small_m_configs=...), that commit only: down at <= 16 rows
    # with 9 stages, 128 KB of shared memory, one program an SM) ran +0.01 ms at b1 either way: released at gate_up's top
    # it no longer cost 0.35 ms (diagnostics/det_b1_switches_down_one_per_sm_8212719.*)
    # at 813b4e9 "default_late_gate_up" / "default_late_qkv" (TritonOps(gemv_pdl_release=...), that commit only: the
    # default mode's gate_up / qkv GEMV letting the next kernel in after its K loop) ran level / +0.01-0.02 ms at b1
    # (diagnostics/det_b1_switches_default_release_813b4e9.*)
    "det_silu_epilogue_pdl_top": (True, {"gate_up_pdl_release": "top"}),
    # session 40: the attention's split programs at 1-4 rows walk a split's four key tiles in phases (K loads, score
    # products, maxes, V loads, p @ V products, then the folds in key order: paged_attention_invariant(phased=...))
    # instead of one tile after the other. The A/B at ac249bd (det_attn_phased against det, then the loop) gained
    # 0.033-0.052 ms at b1 and 0.05-0.06 at b4 (diagnostics/det_b1_switches_ac249bd.*): the default since, so
    # "det_attn_unphased" (the loop everywhere) is now the A/B's other side
    "det_attn_unphased": (True, {"_patch": "attn_unphased"}),
    "det_attn_phased": (True, {"_patch": "attn_phased_small_decodes"}),
    "det_attn_phased_all": (True, {"_patch": "attn_phased_all_decodes"}),  # every decode launch (b64: 4 warps)
    # session 27 ran "det_merge_kernel" ({"attention_launch": {"fused_merge": False}}) at 9f472ab, where decode
    # launches of at most 8 (sequence, KV head) tiles merged the attention's splits in the split kernel's last
    # program (a ticket counter) and "det" did so: b1 +0.08 ms slower fused (diagnostics/
    # det_b1_switches_fused_merge_9f472ab.*); removed after that commit
    # session 13: int8 at 2-8 rows (3.8-4.1 ms a step at 635d5e3, bf16 2.6): the tl.dot GEMV under PDL, as
    # bf16's GEMV was at 2-8 rows before 60944a8 (PDL cost it 0.75 ms there); and CUDA-core tiles at 2-8 rows.
    # At 0ef56d1 "int8" had PDL to 8 rows and "int8_pdl_1_row" (now int8's default) to one row.
    "int8": (False, {}, "int8"),
    "int8_pdl_8_rows": (False, {"pdl_max_rows": 8}, "int8"),
    "int8_cuda_cores": (False, {"int8_tuned_configs": "cuda_cores_2_8"}, "int8"),
    # session 24: int8 linears on the integer MMAs with x as digit planes (kernels/int8_planes.py): "int8" runs them
    # at 2-8 rows since then (INT8_PLANES_ROWS); without them, and from 1 row. ("int8_planes_2_64" ran them to 64
    # rows at f307388, with the digits by a prepass kernel above 8 rows: slower in the kernel bench, out of shared
    # memory at 64 rows in the engine; removed)
    "int8_no_planes": (False, {"int8_planes_rows": None}, "int8"),
    "int8_planes_1_8": (False, {"int8_planes_rows": (1, 8)}, "int8"),
    # session 25: 8 rows (int8 2.54 ms on the planes, level with bf16) against 16 (2.27 on gemv_int8's tuned 16-row
    # tiles, SiLU·mul in its own kernel): planes to 4 rows, 5-8 rows on the 16-row tiles, the SiLU·down unfused
    # (the fused one recomputes SiLU per row tile; fuse_silu_down also covers 1 row, so b1 is not this variant's)
    "int8_m16_tiles_5_8": (False, {"int8_planes_rows": (2, 4), "int8_tuned_configs": "m16_for_8",
                                   "fuse_silu_down": False}, "int8"),
    # after that A/B the int8 defaults are its winner (planes to 4 rows, the 16-row tiles at 5-8, SiLU·down fused at
    # one row only); "int8_session24" is the default before it
    "int8_session24": (False, {"int8_planes_rows": (2, 8), "int8_silu_down_rows": 8}, "int8"),
    # session 25: kernels/int8_rowplanes.py (x's digits made once a launch under one scale per row, int32 sums over
    # the whole K) was measured in its kernel bench only, slower than gemv_int8 / bf16 cuBLAS at 8-512 rows, and
    # removed (code at 0b0a14e, diagnostics/int8_rowplanes_bench_0b0a14e.*)
}
# session 14: the step's copy-in as PyTorch copies (5 launches, more when padded) and torch.argmax in the
# sampler, as before kernels/step_inputs.py and kernels/argmax.py: "<variant>_torch_copy_in" (both as
# before) or "<variant>_torch_argmax" (only the argmax) for every variant above. A name may end in "#n" to
# run a variant again (the engine's order in the process moved batch-2 times before).
OLD_PATHS = {"_torch_copy_in": ("copy_in", "argmax"), "_torch_argmax": ("argmax",)}


def use_old_paths(runner, paths) -> None:
    from pageserve.engine import sampler
    from pageserve.kernels.reference import stage_decode_inputs

    if "copy_in" in paths:
        runner.graphs._stage = stage_decode_inputs
    if "argmax" in paths:
        runner.sampler._argmax = sampler._torch_argmax


MIXES = {"attention": ("paged_attention", "rope_in_decode_attention", "rope_decode_attention", "chunk_attention_for",
                       "mixed_tile_maps"),
         "linears": ("linear", "silu_mul_linear", "gate_up_silu_mul", "silu_in_gate_up_for")}


def mixed_select_ops(select, names):
    """``model_runner.select_ops`` whose ops object runs ``names`` as a default TritonOps does."""
    def mixed(*args, **kwargs):
        from pageserve.model.triton_ops import TritonOps

        ops, plain = select(*args, **kwargs), TritonOps()
        for name in names:
            # the default ops read one tile map in a mixed graph (the runner's default when the ops name none)
            setattr(ops, name, (lambda group, device: None) if name == "mixed_tile_maps" else getattr(plain, name))
        return ops
    return mixed


def int8_cuda_core_configs() -> dict:
    """This GPU's tuned int8 configs plus, for 2, 4 and 8 rows at the 3B shapes, CUDA-core tiles (block_n < 16:
    each int8 weight converted once for every row of the batch) instead of the heuristic's tl.dot tiles."""
    from pageserve.kernels.gemv import GemvConfig
    from pageserve.kernels.gemv_int8 import int8_config_key, load_int8_device_configs

    configs = dict(load_int8_device_configs(torch.cuda.get_device_name()))
    for M in (2, 4, 8):
        for N, K in ((2560, 2048), (2048, 2048), (22016, 2048), (2048, 11008)):
            configs[int8_config_key(M, N, K)] = GemvConfig(block_n=2 if M <= 4 else 1, block_k=512, split_k=1)
        configs[int8_config_key(M, 2048, 11008, "silu_mul")] = GemvConfig(block_n=8, block_k=512, split_k=3)
    return configs


def int8_m16_configs_for_8() -> dict:
    """This GPU's tuned int8 configs plus, for 8 rows (the bucket of 5-8), the tuned 16-row entries."""
    from pageserve.kernels.gemv_int8 import load_int8_device_configs

    configs = dict(load_int8_device_configs(torch.cuda.get_device_name()))
    for key, cfg in list(configs.items()):
        if key[0] == 16:
            configs[(8, *key[1:])] = cfg
    return configs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--w1", type=int, default=0,
                    help="also run W1 (this many 512 -> 256 requests) --w1-passes times per variant, on engines sized "
                         "as notebook 09's (512 sequences, the default graph sizes)")
    ap.add_argument("--w1-passes", type=int, default=2)
    ap.add_argument("--name", default="det_b1_switches", help="the JSON's file name (without .json)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("det_b1_switches times CUDA-graphed engine steps: it needs a GPU")
    out = Path(args.out) / f"{args.name}.json"
    batches = [int(b) for b in args.batches.split(",")]
    rec = {**provenance(), "model": "qwen2.5-3b", "context": args.context, "variants": {}}
    for name in args.variants.split(","):
        base, old = name.split("#")[0], ()
        for suffix, paths in OLD_PATHS.items():
            if base.endswith(suffix):
                base, old = base.removesuffix(suffix), paths
        det, options, *quant = VARIANTS[base]
        blas, mix, patch = options.get("_blas"), options.get("_mix"), options.get("_patch")
        options = {k: v for k, v in options.items() if k not in ("_blas", "_mix", "_patch")}
        patch = PATCHES[patch]() if patch else contextlib.nullcontext()
        patch.__enter__()
        select_before = model_runner.select_ops
        if mix:
            model_runner.select_ops = mixed_select_ops(select_before, MIXES[mix])
        blas_before = torch.backends.cuda.preferred_blas_library()
        if blas:
            torch.backends.cuda.preferred_blas_library(blas)
        if options.get("int8_tuned_configs") == "cuda_cores_2_8":
            options = {**options, "int8_tuned_configs": int8_cuda_core_configs()}
        if options.get("int8_tuned_configs") == "m16_for_8":
            options = {**options, "int8_tuned_configs": int8_m16_configs_for_8()}
        sizes = dict(max_num_seqs=512) if args.w1 else dict(max_num_seqs=max(64, *batches), cuda_graph_max_bs=max(batches))
        llm = LLM("dummy:qwen2.5-3b", device="cuda", dtype="bfloat16", seed=0, max_model_len=2048, deterministic=det,
                  triton_options=options, quantization=quant[0] if quant else None, **sizes)
        use_old_paths(llm.engine.runner, old)
        bench.warmup(llm, bench.prompt_vocab_size(llm))
        model_runner.select_ops = select_before
        row = {"options": {k: v if isinstance(v, (int, float, str, bool)) else repr(v) for k, v in options.items()},
               "blas": str(torch.backends.cuda.preferred_blas_library()), "mix": mix}
        for b in batches:
            row[f"b{b}_step_ms"] = decode_step_ms(llm, b, args.context, args.steps)
            row[f"b{b}_graph_ms"] = graph_replay_ms(llm.engine.runner, b)
        if args.w1:
            vocab = bench.prompt_vocab_size(llm)
            for p in range(args.w1_passes):  # the first pass compiles the eager steps' kernels
                w1 = bench.random_workload(args.w1, 512, 256, vocab, seed=p, name="W1")
                row[f"w1_pass{p + 1}_total_tok_s"] = bench.run_pageserve(llm, w1).total_tok_s
        rec["variants"][name] = row
        print(name, {k: round(v, 3) for k, v in row.items() if isinstance(v, float)}, flush=True)
        out.write_text(json.dumps(rec, indent=1))
        llm.shutdown()
        del llm
        patch.__exit__(None, None, None)
        bench.free_device_memory()
        torch.backends.cuda.preferred_blas_library(blas_before)


if __name__ == "__main__":
    main()
