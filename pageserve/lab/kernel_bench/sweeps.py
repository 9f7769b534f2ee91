"""Config sweeps: decode attention (num_splits, block_n, warps, stages), the GEMV against cuBLAS
at each 3B linear (tuned over ``gemv_candidates``), and the GEMV M = 1 sweep whose bests ship
in ``kernels/configs/<gpu>.json``. Best configs go into the caller's ``tuned`` dict
(``config_key -> GemvConfig``), never into process-wide state."""
from __future__ import annotations

import dataclasses
import math
import time
import traceback

import torch
import triton

from .. import kernel_checks as checks
from ...kernels._util import cdiv, sm_count_for
from ...kernels.gemv import (GemvConfig, config_key, gemv, gemv_config, launch_gemv, silu_mul_gemv,
                             silu_mul_linear_reference)
from ...kernels.paged_decode import MAX_SPLITS, paged_decode_attention, schedule_for
from .shapes import GEMV_SHAPES, HEAD_DIM, HKV, HQ, LAYERS
from .timing import eager_ms, gbps, graph_ms, timed_ms, weight_copies


DECODE_SWEEP = dict(block_n=(16, 32, 64, 128), num_warps=(2, 4, 8), num_stages=(1, 2, 3))


def decode_split_choices(auto: int) -> list[int]:
    """num_splits values the sweep tries: the auto value, 2x, 3x, 4x, and 8, 16, 32 (all <= MAX_SPLITS)."""
    return sorted({min(MAX_SPLITS, s) for s in (auto, 2 * auto, 3 * auto, 4 * auto, 8, 16, 32)})


def _decode_config_str(cfg: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in cfg.items())


def bench_decode_attention(batch=64, ctx=2048, dtype=torch.bfloat16, block_size=16, calls: int = 20,
                           sweep: bool = True, sweep_budget_s: float = 35.0, device: str = "cuda") -> dict:
    """Decode attention at ``batch`` x ``ctx`` (the KV, 134 MB at the defaults, is past the L2),
    ``calls`` back to back in a CUDA graph. ``paged_decode_attn_{ms,gbps}`` (and so
    ``paged_decode_attn_bw_frac``) are the default configuration, what the engine runs;
    ``paged_decode_attn_eager_ms`` is the same call launched from Python, for comparison.

    The sweep, in two rounds to keep compiles (~1 s each) down: each knob alone from the
    default (num_splits from ``decode_split_choices``, then ``DECODE_SWEEP``), then every
    combination of the two best num_splits, block_n and num_warps at the best num_stages.
    It stops at ``sweep_budget_s``. Records the best (``paged_decode_attn_best_*``, config as
    keywords of ``paged_decode_attention``) and the five fastest (``paged_decode_attn_top5``)."""
    es = torch.tensor([], dtype=dtype).element_size()
    gen = torch.Generator().manual_seed(0)
    q, _, _, kc, vc, meta = checks.random_paged_batch([1] * batch, [ctx] * batch, HQ, HKV, HEAD_DIM, block_size,
                                                      dtype, device, gen)
    out = torch.empty_like(q)
    scale = HEAD_DIM**-0.5
    nbytes = (2 * batch * ctx * HKV * HEAD_DIM * es + 2 * q.numel() * es
              + meta.block_tables.numel() * 4 + batch * 4)
    plan = schedule_for(q, kc, meta.block_tables)  # what paged_decode_attention launches without keywords
    splits = plan.num_splits

    def attn(cfg: dict):
        return lambda i: paged_decode_attention(q, kc, vc, meta.seq_lens, meta.block_tables, scale, out=out, **cfg)

    r: dict = {}
    t = timed_ms(r, "paged_decode_attn", attn({}), calls)  # the default, as the engine calls it
    r.update({"paged_decode_attn_ms": t, "paged_decode_attn_gbps": gbps(nbytes, t),
              "paged_decode_attn_splits": splits})
    if torch.cuda.is_available():
        r["paged_decode_attn_eager_ms"] = eager_ms(lambda: attn({})(0))
    if not sweep:
        return r
    default = plan._asdict()
    timed, failed = {tuple(default.items()): t}, set()
    t0 = time.perf_counter()

    def run(cfg: dict):
        key = tuple(cfg.items())
        if key in timed or key in failed:
            return
        if time.perf_counter() - t0 > sweep_budget_s:  # count what the budget left out
            r["paged_decode_attn_sweep_skipped"] = r.get("paged_decode_attn_sweep_skipped", 0) + 1
            return
        try:
            timed[key] = graph_ms(attn(cfg), calls, replays=10)
        except Exception as e:  # out of resources, a failed capture: skip the config
            failed.add(key)
            r[f"paged_decode_attn_sweep_error_{_decode_config_str(cfg).replace(' ', '_')}"] = \
                f"{type(e).__name__}: {e}"[:300]

    axes = {"num_splits": decode_split_choices(splits), **DECODE_SWEEP}
    for axis, values in axes.items():  # round 1: one knob at a time
        for v in values:
            run({**default, axis: v})

    def best_values(axis: str, n: int) -> list:
        return sorted(axes[axis], key=lambda v: timed.get(tuple({**default, axis: v}.items()), math.inf))[:n]

    stages = best_values("num_stages", 1)[0]
    for sp in best_values("num_splits", 2):  # round 2: the two best of the knobs that interact
        for bn in best_values("block_n", 2):
            for nw in best_values("num_warps", 2):
                run({"num_splits": sp, "block_n": bn, "num_warps": nw, "num_stages": stages})
    ranked = sorted(timed.items(), key=lambda kv: kv[1])
    r["paged_decode_attn_sweep_configs"] = len(timed)
    r["paged_decode_attn_sweep_s"] = time.perf_counter() - t0
    (best_cfg, best_t) = ranked[0]
    r["paged_decode_attn_best_ms"], r["paged_decode_attn_best_config"] = best_t, _decode_config_str(dict(best_cfg))
    r["paged_decode_attn_best_gbps"] = gbps(nbytes, best_t)
    r["paged_decode_attn_top5"] = [{"config": _decode_config_str(dict(c)), "ms": tc, "gbps": gbps(nbytes, tc)}
                                   for c, tc in ranked[:5]]
    return r


def gemv_candidates(M: int, N: int, K: int, sms: int, quant: bool = False) -> list[GemvConfig]:
    """The configs ``bench_gemv`` times at batch M. Above 8 rows (the tl.dot tiles of a skinny
    GEMM: every program re-reads the [M, BLOCK_K] activations for its BLOCK_N weight rows, so at
    M = 64 wide weight tiles matter) it goes up to 256-row weight tiles and 4 stages; for int8
    weights (``quant``) also 1 stage, at 4 warps only (every int8 best at 64 rows had 4)."""
    if M > 64:
        return mid_band_candidates(M, N, K, sms)
    base = gemv_config(M, N, K, sms)
    cands = {base}
    skinny = M > 8
    for bn in (32, 64, 128, 256) if skinny else (8, 16, 32, 64):
        for bk in (256, 512) if M == 1 else (64, 128):
            if bn * bk > (32768 if skinny else 16384):  # [64, 512] tiles spill registers at M = 1
                continue
            for nw in (4,) if quant and skinny else (4, 8):
                rows = triton.cdiv(N, bn)
                for mult in ((2, 4, 8) if M == 1 else (4,)):
                    split = max(1, min(triton.cdiv(mult * sms, rows), K // (2 * bk)))
                    stages_list = (3, 4) if skinny and bk == 64 else (3,)
                    if quant and skinny:  # 1 stage: the int8 tile goes global -> registers once, no
                        stages_list = (1,) + stages_list  # cp.async ring to read back (sm_90 SASS)
                    for stages in stages_list:
                        cands.add(GemvConfig(bn, bk, split, nw, stages))
                    if skinny and bn == 128 and nw == 4:  # the weights as the MMA's A side (swap_ab)
                        cands.add(GemvConfig(bn, bk, split, nw, 3, swap_ab=True))
    return sorted(cands, key=lambda c: (c.block_n, c.block_k, c.num_warps, c.split_k, c.num_stages, c.swap_ab))


def mid_band_candidates(M: int, N: int, K: int, sms: int) -> list[GemvConfig]:
    """The tl.dot configs timed against cuBLAS at 65-256 rows, past ``gemv``'s own range (a probe of
    the decode band where cuBLAS runs at ~0.7 of the tensor-core ceiling, NOTES.md session 36): 64-wide
    K steps, 3 stages; 64 to 256 weight rows a program in the plain orientation and, transposed
    (``swap_ab``: the weight rows as wgmma's M side, all M batch rows as its N side), 64 rows at 4 warps
    or 128 at 8 (a [64 or 128, 256] fp32 accumulator at 128 registers a thread); each without split-K
    and with the split that gives about 4 programs an SM."""
    cands = set()
    for bn, nw, swap in ((64, 4, False), (64, 8, False), (128, 4, False), (128, 8, False), (256, 8, False),
                         (64, 4, True), (128, 8, True)):
        rows = triton.cdiv(N, bn)
        split = max(1, min(triton.cdiv(4 * sms, rows), K // 128))
        for s in sorted({1, split}):
            cands.add(GemvConfig(bn, 64, s, nw, 3, swap_ab=swap))
    return sorted(cands, key=lambda c: (c.block_n, c.num_warps, c.split_k, c.swap_ab))


def bench_gemv(M: int = 1, dtype=torch.bfloat16, tune: bool = True, min_bytes: float = 256e6,
               shapes: dict = GEMV_SHAPES, device: str = "cuda", tuned: dict | None = None,
               quant: bool = False) -> dict:
    """Each 3B linear at batch M: the GEMV (tuned over ``gemv_candidates``, best kept in
    into ``tuned`` under ``config_key`` when given) against torch.nn.functional.linear (cuBLAS). Both timed the same way: calls
    back to back in a CUDA graph (``timed_ms``), each call on the next of ``weight_copies``
    so the weights stream from HBM as they do in a decode step. ``quant``: the int8 GEMV
    (``gemv_int8`` on per-channel int8 copies of the weights, figures ``int8gemv_*``, bests under
    ``int8_config_key``) against cuBLAS on the float weights, the speed an int8 step must beat.
    Above 8 rows the int8 tiles are timed with both conversions the tl.dot path can use (``magic``
    "default", the PTX one on a GPU, and "cvt": fewer instructions a weight there in sm_90 SASS):
    figures ``{key}_default_ms``, ``{key}_cvt_ms`` and ``{key}_magic`` (the faster)."""
    from ...kernels.gemv_int8 import gemv_int8, int8_config_key
    from ...kernels.reference import quantize_int8

    es = torch.tensor([], dtype=dtype).element_size()
    prefix = "int8gemv" if quant else "gemv"
    g = torch.Generator(device=device).manual_seed(0)
    sms = sm_count_for(torch.empty(1, device=device))
    r: dict = {}
    stack_gemv = stack_cublas = 0.0
    for name, (N, K) in shapes.items():
        key = f"{prefix}_{name}_m{M}"
        ws = weight_copies(N, K, dtype, g, min_bytes)
        qs = [quantize_int8(w) for w in ws] if quant else None
        calls = max(8, len(ws))
        x = torch.randn(M, K, device=device, dtype=dtype, generator=g)
        b = torch.randn(N, device=device, dtype=dtype, generator=g) if name == "qkv" else None
        out = torch.empty(M, N, device=device, dtype=dtype)
        nbytes = (N * K + M * K + M * N + (N if b is not None else 0)) * es
        qbytes = N * K + (N + M * K + M * N + (N if b is not None else 0)) * es

        def run(cfg, magic="default"):
            if quant:  # "default": the PTX conversion where compiled, Triton ops on the interpreter
                m = True if magic == "default" else magic
                return lambda i: gemv_int8(x, *qs[i % len(qs)], b, config=cfg, out=out, magic=m)
            if M > 64:  # past gemv()'s range (it refuses M > 64): the same kernel through its launcher
                return lambda i: launch_gemv(x, ws[i % len(ws)], None, b, out, cfg, None)
            return lambda i: gemv(x, ws[i % len(ws)], b, config=cfg, out=out)

        t_cublas = timed_ms(r, f"cublas_{name}_m{M}",
                            lambda i: torch.nn.functional.linear(x, ws[i % len(ws)], b), calls)
        heuristic = gemv_config(M, N, K, sms)
        magics = ("default", "cvt") if quant and M > 8 else ("default",)
        timed = {}
        for cfg in gemv_candidates(M, N, K, sms, quant) if tune else [heuristic]:
            for magic in magics:
                try:
                    timed[cfg, magic] = graph_ms(run(cfg, magic), calls, replays=10)
                except Exception as e:  # a config that does not compile (or capture) is skipped
                    r[f"{key}_cfg_error"] = f"{cfg} {magic}: {type(e).__name__}: {e}"[:500]
        if not timed:
            raise RuntimeError(f"{key}: no GEMV config ran (last error: {r.get(f'{key}_cfg_error')})")
        best_cfg, best_magic = min(timed, key=timed.get)
        if tuned is not None:
            tuned[int8_config_key(M, N, K) if quant else config_key(M, N, K)] = best_cfg
        if len(magics) > 1:
            r[f"{key}_magic"] = best_magic
            for magic in magics:
                r[f"{key}_{magic}_ms"] = min(t for (c, m), t in timed.items() if m == magic)
        if not quant:  # the best config's product against cuBLAS's on the same weights (--skip-checks or not)
            run(best_cfg)(0)
            ref = torch.nn.functional.linear(x, ws[0], b).float()
            r[f"{key}_max_rel_err"] = ((out.float() - ref).abs().max() / ref.abs().max()).item()
        t_gemv = timed_ms(r, key, run(best_cfg, best_magic), calls)
        r[f"{key}_ms"], r[f"{key}_gbps"] = t_gemv, gbps(qbytes if quant else nbytes, t_gemv)
        if (heuristic, "default") in timed:
            r[f"{key}_heuristic_ms"] = timed[heuristic, "default"]
        r[f"cublas_{name}_m{M}_ms"], r[f"cublas_{name}_m{M}_gbps"] = t_cublas, gbps(nbytes, t_cublas)
        r[f"{key}_vs_cublas"] = t_cublas / t_gemv  # > 1: the GEMV is faster
        r[f"{key}_config"] = repr(best_cfg)
        reps = 1 if name == "lm_head" else LAYERS
        stack_gemv += reps * t_gemv
        stack_cublas += reps * t_cublas
        del ws, qs
    r[f"{prefix}_stack_m{M}_ms"] = stack_gemv  # 36 layers of qkv+o+gate_up+down, plus lm_head
    r[f"cublas_stack_m{M}_ms"] = stack_cublas
    r[f"{prefix}_stack_m{M}_vs_cublas"] = stack_cublas / stack_gemv
    return r


# ------------------------------------------------------------------------------ GEMV M = 1 sweep
M1_SWEEP = dict(block_n=(1, 2, 4, 8, 16, 32, 64), block_k=(256, 512, 1024), split_k=(1, 2, 4),
                num_warps=(2, 4, 8), num_stages=(2, 3, 4))


def m1_sweep_space(N: int, K: int, sms: int, elem_bytes: int = 2) -> list[GemvConfig]:
    """The M = 1 configs worth a compile (num_stages 3; ``sweep_gemv_m1`` varies it last):

    - 16 to 64 weight elements per thread in a [BLOCK_N, BLOCK_K] tile (at least two 16-byte
      loads each, at most 64 registers of weights);
    - split_k > 1 only while the rows alone give under 4 programs per SM, and only where the
      launch really makes that many splits (else it repeats a smaller split);
    - 1 to 128 programs per SM, each streaming at least 8 KB of weights;
    - ``defer_reduce`` where the [BLOCK_N, BLOCK_K] fp32 accumulator fits in 32 registers a
      thread (the heuristic's rule), plain per-tile reduction above.
    """
    cands = []
    for bn in M1_SWEEP["block_n"]:
        rows = cdiv(N, bn)
        for bk in M1_SWEEP["block_k"]:
            for nw in M1_SWEEP["num_warps"]:
                per_thread = bn * bk // (32 * nw)
                if not 16 <= per_thread <= 64:
                    continue
                for split in M1_SWEEP["split_k"]:
                    k_per_split = cdiv(cdiv(K, split), bk) * bk
                    if split > 1 and (rows >= 4 * sms or cdiv(K, k_per_split) != split):
                        continue
                    if not sms <= rows * split <= 128 * sms or bn * k_per_split * elem_bytes < 8192:
                        continue
                    cands.append(GemvConfig(bn, bk, split, nw, 3, defer_reduce=per_thread <= 32))
    return cands


def m1_sweep_rounds(space: list[GemvConfig]) -> tuple[list[GemvConfig], dict]:
    """The sweep's rounds over ``space``: round 1 is one config per grid shape (block_n, split_k),
    the one closest to a [BLOCK_N, 512] tile at 32 elements a thread; round 2 (the ``groups``
    returned) is every config of the three fastest grid shapes; round 3 varies num_stages."""
    groups: dict = {}
    for c in space:
        groups.setdefault((c.block_n, c.split_k), []).append(c)

    def typical(c: GemvConfig):
        return abs(math.log2(c.block_k / 512)), abs(math.log2(c.block_n * c.block_k / (32 * c.num_warps) / 32))

    return [min(cs, key=typical) for cs in groups.values()], groups


def _sweep_m1_target(r: dict, p: str, N: int, K: int, silu: bool, bias: bool, dtype, gen, sms: int,
                     allot_s: float, min_bytes: float, replays: int, device: str) -> GemvConfig | None:
    """One target of ``sweep_gemv_m1``: its figures into ``r`` under prefix ``p``; the best config."""
    t0 = time.perf_counter()
    es = torch.tensor([], dtype=dtype).element_size()
    ws = weight_copies(N, K, dtype, gen, min_bytes)
    calls = max(8, len(ws))
    out = torch.empty(1, N, device=device, dtype=dtype)
    x = torch.randn(1, 2 * K if silu else K, device=device, dtype=dtype, generator=gen)  # gate|up for silu
    b = torch.randn(N, device=device, dtype=dtype, generator=gen) if bias else None
    if silu:
        def run(cfg):
            return lambda i: silu_mul_gemv(x, ws[i % len(ws)], config=cfg, out=out)

        def torch_fn(i):
            return silu_mul_linear_reference(x, ws[i % len(ws)])
    else:
        def run(cfg):
            return lambda i: gemv(x, ws[i % len(ws)], b, config=cfg, out=out)

        def torch_fn(i):
            return torch.nn.functional.linear(x, ws[i % len(ws)], b)
    nbytes = (N * K + x.numel() + N + (N if b is not None else 0)) * es
    t_torch = timed_ms(r, f"{p}_cublas", torch_fn, calls) * 1e3
    r[f"{p}_cublas_us"], r[f"{p}_cublas_gbps"] = t_torch, nbytes / t_torch / 1e3
    timed: dict = {}  # config -> µs per call
    failed: dict = {}  # config -> error

    def time_config(cfg: GemvConfig, budgeted: bool = True) -> None:
        if cfg in timed or cfg in failed:
            return
        if budgeted and time.perf_counter() - t0 > allot_s:
            r[f"{p}_skipped"] = r.get(f"{p}_skipped", 0) + 1
            return
        try:
            timed[cfg] = graph_ms(run(cfg), calls, replays) * 1e3
        except Exception as e:  # does not compile, out of resources, no capture: skip it
            failed[cfg] = f"{cfg}: {type(e).__name__}: {e}"[:300]

    heuristic = gemv_config(1, N, K, sms, "auto")
    never = gemv_config(1, N, K, sms, "never")
    time_config(heuristic, budgeted=False)
    time_config(never, budgeted=False)
    first, groups = m1_sweep_rounds(m1_sweep_space(N, K, sms, es))
    for cfg in first:  # round 1: one config per grid shape
        time_config(cfg)
    grid_rank = sorted({(c.block_n, c.split_k) for c in timed if (c.block_n, c.split_k) in groups},
                       key=lambda s: min(t for c, t in timed.items() if (c.block_n, c.split_k) == s))
    for grid in grid_rank[:3]:  # round 2: every tile of the three fastest grid shapes
        for cfg in groups[grid]:
            time_config(cfg)
    for cfg in sorted(timed, key=timed.get)[:2]:  # round 3: num_stages of the two fastest
        for ns in M1_SWEEP["num_stages"]:
            time_config(dataclasses.replace(cfg, num_stages=ns))
    r[f"{p}_configs_timed"], r[f"{p}_configs_failed"] = len(timed), len(failed)
    if failed:
        r[f"{p}_first_error"] = next(iter(failed.values()))
    for label, cfg in (("heuristic", heuristic), ("never", never)):
        r[f"{p}_{label}_config"] = repr(cfg)
        if cfg in timed:
            r[f"{p}_{label}_us"] = timed[cfg]
    if heuristic in timed:
        r[f"{p}_heuristic_gbps"] = nbytes / timed[heuristic] / 1e3
    best = min(timed, key=timed.get, default=None)
    if best is not None:
        t_best = graph_ms(run(best), calls) * 1e3  # again, with the full replay count
        r[f"{p}_best_config"], r[f"{p}_best_us"], r[f"{p}_best_gbps"] = repr(best), t_best, nbytes / t_best / 1e3
        r[f"{p}_best_vs_cublas"] = t_torch / t_best
        if heuristic in timed:
            r[f"{p}_best_vs_heuristic"] = timed[heuristic] / timed[best]
        r[f"{p}_top5"] = [{"config": repr(c), "us": t, "gbps": nbytes / t / 1e3}
                          for c, t in sorted(timed.items(), key=lambda ct: ct[1])[:5]]
    r[f"{p}_sweep_s"] = time.perf_counter() - t0
    return best


def sweep_gemv_m1(dtype=torch.bfloat16, budget_s: float = 100.0, min_bytes: float = 256e6,
                  shapes: dict = GEMV_SHAPES, device: str = "cuda", replays: int = 10,
                  tuned: dict | None = None) -> dict:
    """GemvConfig sweep at M = 1 for every 3B linear, and for ``silu_mul_gemv`` on the down
    shape (``silu_down``), each config timed in a CUDA graph with the weights rotated out of L2
    (``graph_ms``), in three rounds over ``m1_sweep_space`` (``m1_sweep_rounds``). Compiles
    dominate (~35 configs a target, ~0.5 s each, fewer where shapes share kernels); each target
    gets an equal share of what is left of ``budget_s``, and configs past it are counted in
    ``_skipped`` (the heuristic configs are always timed). Compile errors, out-of-resources and
    failed captures skip the config; a target that fails as a whole records ``_error``.

    Per target ``sweep_m1_<shape>_``: ``best_config`` (a GemvConfig repr),
    ``best_us`` / ``best_gbps``, ``heuristic_{config,us,gbps}`` (``split_k="auto"``, the default),
    ``never_{config,us}``, ``cublas_us`` / ``cublas_gbps`` (torch: F.linear; for silu_down
    ``kernels.reference.silu_mul_linear``), ``best_vs_cublas`` and ``best_vs_heuristic`` (> 1: best is faster),
    ``top5``, ``key`` and counts. ``sweep_m1_gemv_configs`` maps ``str(config_key)`` to the best
    config (``kernels.parse_configs`` reads it back); the bests also go into ``tuned`` when given."""
    gen = torch.Generator(device=device).manual_seed(0)
    sms = sm_count_for(torch.empty(1, device=device))
    targets = [(name, N, K, False) for name, (N, K) in shapes.items()] + [("silu_down", *shapes["down"], True)]
    r: dict = {}
    best_configs: dict = {}
    t_start = time.perf_counter()
    for done, (name, N, K, silu) in enumerate(targets):
        p = f"sweep_m1_{name}"
        key = config_key(1, N, K, silu)
        r[f"{p}_key"] = str(key)
        allot_s = (budget_s - (time.perf_counter() - t_start)) / (len(targets) - done)  # what is left, shared
        try:
            best = _sweep_m1_target(r, p, N, K, silu, name == "qkv", dtype, gen, sms, allot_s, min_bytes, replays,
                                    device)
        except Exception as e:  # e.g. out of memory: keep the other targets
            r[f"{p}_error"] = f"{type(e).__name__}: {e}"[:500]
            traceback.print_exc()
            continue
        if best is not None:
            if tuned is not None:
                tuned[key] = best
            best_configs[str(key)] = repr(best)
    r["sweep_m1_gemv_configs"] = best_configs
    r["sweep_m1_elapsed_s"] = time.perf_counter() - t_start
    return r
