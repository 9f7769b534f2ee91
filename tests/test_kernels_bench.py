"""The kernel bench's plumbing (the pageserve.lab.kernel_bench package): sweep grids, tuned-config round trip,
timing fallback, the M = 1 sweep end to end on tiny shapes. CPU: the Triton interpreter; the
timings themselves only mean something on the GPU."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pageserve.lab.kernel_bench import run, shapes, sweeps, timing  # noqa: E402
from pageserve.kernels.gemv import (  # noqa: E402
    GemvConfig, config_key, gemv, gemv_config, linear_reference, parse_config, parse_configs,
)
from pageserve.kernels.paged_decode import MAX_SPLITS  # noqa: E402

CUDA = torch.cuda.is_available()


def test_bench_help_lists_the_sweep_part():
    res = subprocess.run([sys.executable, "-m", "pageserve.lab.kernel_bench", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert "sweep_m1" in res.stdout and "--json" in res.stdout


def test_run_benchmarks_runs_the_asked_parts_in_order_and_survives_a_failing_one(monkeypatch):
    """The default run leaves out the M = 1 sweep, runs the GEMV part once per batch, feeds the
    GEMV part's tuned configs to the switches, records a failing part and goes on, and reads
    the *_gbps figures against the read ceiling measured in the same run."""
    calls = []

    def stub(name, figures):
        def fn(*args, **kw):
            calls.append((name, args, kw))
            if name == "decode_attn":
                raise RuntimeError("out of resources")
            if name == "gemv":
                kw["tuned"][("M", args[0])] = "best"
            return figures
        return fn

    monkeypatch.setattr(run, "measure_ceilings", stub("ceilings", {"read_gbps": 4000.0, "copy_gbps": 3000.0}))
    monkeypatch.setattr(run, "bench_elementwise", stub("elementwise", {"rms_norm_gbps": 2000.0}))
    monkeypatch.setattr(run, "bench_decode_attention", stub("decode_attn", {}))
    monkeypatch.setattr(run, "bench_prefill_attention", stub("prefill_attn", {}))
    monkeypatch.setattr(run, "bench_gemv", stub("gemv", {}))
    monkeypatch.setattr(run, "bench_switches", stub("switches", {}))
    monkeypatch.setattr(run, "sweep_gemv_m1", stub("sweep_m1", {}))
    tuned: dict = {}
    figures = run.run_benchmarks(gemv_batches=(1, 8), tuned=tuned)
    assert [c[0] for c in calls] == ["ceilings", "elementwise", "decode_attn", "prefill_attn", "gemv", "gemv",
                                     "switches"]
    assert [c[1][0] for c in calls if c[0] == "gemv"] == [1, 8]
    assert tuned == {("M", 1): "best", ("M", 8): "best"}
    assert next(c for c in calls if c[0] == "switches")[2]["configs"] is tuned
    assert figures["decode_attn_error"] == "RuntimeError: out of resources"
    assert figures["rms_norm_read_frac"] == 0.5
    calls.clear()
    run.run_benchmarks(parts=("sweep_m1",))
    assert [c[0] for c in calls] == ["sweep_m1"]
    calls.clear()
    run.run_benchmarks(parts=("gemv_int8",), gemv_batches=(64,), tuned={})  # the int8 GEMV only when asked for
    assert [(c[0], c[1][0], c[2].get("quant")) for c in calls] == [("gemv", 64, True)]


def test_decode_split_choices_are_auto_multiples_and_fixed_values_capped():
    assert sweeps.decode_split_choices(5) == [5, 8, 10, 15, 16, 20, 32]
    big = sweeps.decode_split_choices(40)
    assert max(big) == MAX_SPLITS and 40 in big and len(big) == len(set(big))


@pytest.mark.parametrize("name", list(shapes.GEMV_SHAPES))
def test_m1_sweep_space_fills_an_h200_fits_registers_and_stays_small(name):
    N, K = shapes.GEMV_SHAPES[name]
    sms = 132
    space = sweeps.m1_sweep_space(N, K, sms)
    assert space
    for c in space:
        per_thread = c.block_n * c.block_k // (32 * c.num_warps)
        assert 16 <= per_thread <= 64, c
        assert sms <= math.ceil(N / c.block_n) * c.split_k <= 128 * sms, c
        assert c.defer_reduce == (per_thread <= 32), c
    first, groups = sweeps.m1_sweep_rounds(space)
    assert len(first) == len(groups)  # one config per grid shape in round 1
    assert {(c.block_n, c.split_k) for c in first} == set(groups)
    # the budget: round 1, the three biggest groups of round 2, num_stages on the best two, heuristics
    worst = len(first) + sum(sorted(map(len, groups.values()), reverse=True)[:3]) + 4 + 2
    assert worst <= 40


def test_gemv_config_repr_round_trips_through_parse_configs():
    plain = GemvConfig(block_n=4, block_k=256, split_k=1, num_warps=2, num_stages=4, defer_reduce=True)
    fused = GemvConfig(8, 512, 2)
    record = {"bench": {"sweep_m1_gemv_configs": {str(config_key(1, 96, 512)): repr(plain),
                                                  str(config_key(1, 64, 256, silu_mul=True)): repr(fused)}}}
    configs = parse_configs(record)
    assert configs == {(1, 96, 512): plain, (1, 64, 256, "silu_mul"): fused}
    assert parse_config(repr(plain)) == plain
    assert gemv_config(1, 96, 512, sms=132, configs=configs) == plain
    assert gemv_config(1, 64, 256, sms=132, configs=configs, silu_mul=True) == fused
    assert gemv_config(1, 96, 512, sms=132, configs=configs, silu_mul=True) == plain  # no fused entry: the plain one
    assert gemv_config(1, 64, 256, sms=132, configs=configs) != fused  # a fused entry is not the plain GEMV's
    assert gemv_config(1, 96, 512, sms=132) != plain  # without the mapping: the heuristic


def test_parse_config_accepts_only_a_gemv_config_call():
    with pytest.raises(ValueError):
        parse_config("print(1)")
    with pytest.raises(ValueError):
        parse_config("GemvConfig(block_n=__import__('os').getpid(), block_k=1, split_k=1)")


def test_timed_ms_marks_an_eager_fallback_when_the_capture_fails(monkeypatch):
    def no_capture(fn, calls=20, replays=20):
        raise timing.CaptureFailed("capture not supported")

    monkeypatch.setattr(timing, "graph_ms", no_capture)
    monkeypatch.setattr(timing, "eager_ms", lambda fn, warmup=25, rep=100: 1.5)
    r = {}
    assert timing.timed_ms(r, "rms_norm", lambda i: None) == 1.5
    assert r["rms_norm_timing"] == "eager" and "capture not supported" in r["rms_norm_capture_error"]


@pytest.mark.skipif(CUDA, reason="the GPU runs the real sweep (python -m pageserve.lab.kernel_bench --parts sweep_m1)")
def test_sweep_gemv_m1_writes_its_keys_and_working_configs():
    shapes = {"qkv": (24, 64), "down": (16, 128)}
    tuned: dict = {}
    r = sweeps.sweep_gemv_m1(torch.float32, budget_s=5.0, min_bytes=0, shapes=shapes, device="cpu", replays=1,
                            tuned=tuned)
    for name in ("qkv", "down", "silu_down"):
        p = f"sweep_m1_{name}"
        for suffix in ("best_config", "best_us", "best_gbps", "heuristic_us", "cublas_us", "best_vs_cublas", "top5"):
            assert f"{p}_{suffix}" in r, f"{p}_{suffix}"
        assert parse_config(r[f"{p}_best_config"]) in (parse_config(t["config"]) for t in r[f"{p}_top5"])
    assert set(r["sweep_m1_gemv_configs"]) == {str(config_key(1, 24, 64)), str(config_key(1, 16, 128)),
                                               str(config_key(1, 16, 128, silu_mul=True))}
    configs = parse_configs(r)
    assert configs == tuned and len(configs) == 3
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(1, 128, generator=g), torch.randn(16, 128, generator=g)
    torch.testing.assert_close(gemv(x, w, configs=configs), linear_reference(x, w, None), rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(CUDA, reason="CPU smoke run of the GPU bench's plumbing")
def test_bench_decode_attention_times_the_default_and_ranks_what_the_sweep_reached():
    r = sweeps.bench_decode_attention(batch=2, ctx=40, dtype=torch.float32, calls=1, device="cpu", sweep_budget_s=2.0)
    assert r["paged_decode_attn_ms"] > 0 and r["paged_decode_attn_gbps"] > 0
    top = r["paged_decode_attn_top5"]
    assert [t["ms"] for t in top] == sorted(t["ms"] for t in top)
    assert r["paged_decode_attn_best_config"] == top[0]["config"] and r["paged_decode_attn_best_ms"] == top[0]["ms"]
    assert r["paged_decode_attn_best_ms"] <= r["paged_decode_attn_ms"]  # the default is one of the ranked


@pytest.mark.skipif(CUDA, reason="CPU smoke run of the GPU bench's plumbing")
def test_bench_gemv_times_gemv_and_torch_alike_and_keeps_the_best():
    shapes = {"qkv": (24, 64), "lm_head": (40, 64)}
    tuned: dict = {}
    r = sweeps.bench_gemv(1, torch.float32, tune=False, min_bytes=0, shapes=shapes, device="cpu", tuned=tuned)
    for name, (N, K) in shapes.items():
        assert r[f"gemv_{name}_m1_ms"] > 0 and r[f"cublas_{name}_m1_ms"] > 0
        assert parse_config(r[f"gemv_{name}_m1_config"]) == tuned[config_key(1, N, K)]
    assert r["gemv_stack_m1_ms"] == pytest.approx(36 * r["gemv_qkv_m1_ms"] + r["gemv_lm_head_m1_ms"])


def test_bench_gemv_int8_times_the_int8_gemv_against_float_cublas_and_keeps_its_best():
    from pageserve.kernels.gemv_int8 import int8_config_key

    shapes = {"qkv": (24, 64), "lm_head": (40, 64)}
    tuned: dict = {}
    r = sweeps.bench_gemv(16, torch.float32, tune=False, min_bytes=0, shapes=shapes, device="cpu", tuned=tuned,
                          quant=True)
    for name, (N, K) in shapes.items():
        assert r[f"int8gemv_{name}_m16_ms"] > 0 and r[f"cublas_{name}_m16_ms"] > 0
        assert parse_config(r[f"int8gemv_{name}_m16_config"]) == tuned[int8_config_key(16, N, K)]
        # above 8 rows both tl.dot conversions are timed and the faster one named
        times = {m: r[f"int8gemv_{name}_m16_{m}_ms"] for m in ("default", "cvt")}
        assert min(times.values()) > 0 and r[f"int8gemv_{name}_m16_magic"] == min(times, key=times.get)
    assert "gemv_stack_m16_ms" not in r and r["int8gemv_stack_m16_vs_cublas"] > 0


def test_shipped_device_configs_parse_and_name_real_shapes():
    """Every configs/<gpu>.json in the package loads, and its keys are (M, N, K[, 'silu_mul'])."""
    import importlib

    gemv_mod = importlib.import_module("pageserve.kernels.gemv")  # the module (the package exports a function of that name)

    files = sorted(gemv_mod.CONFIG_DIR.glob("*.json"))
    assert files, "no tuned configs shipped"
    for path in files:
        name = json.loads(path.read_text())["device"]
        assert gemv_mod.device_config_path(name) == path
        configs = gemv_mod.load_device_configs(name)
        assert configs and configs == gemv_mod.load_device_configs(name)  # a fresh dict each time
        assert configs is not gemv_mod.load_device_configs(name)
        for key, cfg in configs.items():
            assert len(key) in (3, 4) and all(isinstance(d, int) and d > 0 for d in key[:3])
            assert key[3:] in ((), ("silu_mul",)), key
            assert isinstance(cfg, gemv_mod.GemvConfig) and cfg.block_n > 0 and cfg.split_k >= 1
    assert gemv_mod.load_device_configs("Some Other GPU") == {}


def test_gemv_candidates_above_8_rows_reach_wide_weight_tiles_and_stay_in_budget():
    skinny = sweeps.gemv_candidates(64, 2048, 11008, 132)
    assert {c.block_n for c in skinny} >= {128, 256} and max(c.block_n * c.block_k for c in skinny) <= 32768
    assert any(c.num_stages == 4 for c in skinny) and len(skinny) <= 32  # ~0.5 s of compile each on the H200
    int8 = sweeps.gemv_candidates(64, 2048, 11008, 132, quant=True)
    assert any(c.num_stages == 1 for c in int8) and not any(c.num_stages == 1 for c in skinny)
    assert all(c.num_warps == 4 for c in int8) and len(int8) <= 24  # timed twice: both int8 conversions
    small = sweeps.gemv_candidates(8, 2048, 11008, 132)
    assert max(c.block_n for c in small) <= 64 and all(c.num_stages == 3 for c in small if c.block_n > 16)
    for c in skinny + small:
        assert c.split_k >= 1 and c.block_k in (64, 128)


def test_bench_cli_takes_the_gemv_batches_and_names_its_commit(tmp_path):
    from pageserve.lab.kernel_bench import __main__ as cli

    seen = {}

    def fake_run(**kw):
        seen.update(kw)
        return {}

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cli, "run_benchmarks", fake_run)
        mp.setattr(cli.torch.cuda, "is_available", lambda: True)
        mp.setattr(cli.torch.cuda, "get_device_name", lambda i=0: "fake")
        try:
            cli.main(["--out", str(tmp_path), "--skip-checks", "--parts", "gemv", "--gemv-batches", "16,64",
                      "--json", "bench.json"])
        except Exception:  # the summary after the run may want figures the fake did not give
            pass
    assert seen.get("gemv_batches") == (16, 64) and seen.get("parts") == ("gemv",)
    record = json.loads((tmp_path / "bench.json").read_text())
    assert record["git_commit"] not in (None, "") and "git_commit_source" in record  # a record names its commit


def test_skinny_m_without_its_own_entry_takes_the_nearest_larger_tuned_m():
    from pageserve.kernels.gemv import gemv_config

    c16, c64, c1 = GemvConfig(64, 128, 4, 8, 3), GemvConfig(128, 64, 2, 8, 4), GemvConfig(2, 1024, 1, 4, 3, True)
    configs = {config_key(16, 2048, 2048): c16, config_key(64, 2048, 2048): c64, config_key(1, 2048, 2048): c1}
    assert gemv_config(16, 2048, 2048, 132, configs=configs) is c16
    assert gemv_config(32, 2048, 2048, 132, configs=configs) is c64 and gemv_config(48, 2048, 2048, 132, configs=configs) is c64
    assert gemv_config(12, 2048, 2048, 132, configs=configs) is c16
    heuristic = gemv_config(4, 2048, 2048, 132)  # at or below 8 rows: only an exact entry, else the heuristic
    assert gemv_config(4, 2048, 2048, 132, configs=configs) == heuristic
    assert gemv_config(32, 2560, 2048, 132, configs=configs) == gemv_config(32, 2560, 2048, 132)  # other shape
    assert gemv_config(32, 2048, 2048, 132, configs=configs, silu_mul=True) is c64  # falls back to the plain entry


def test_mid_band_candidates_above_64_rows_time_both_orientations_with_and_without_split_k():
    cands = sweeps.gemv_candidates(200, 22016, 2048, 132)
    assert cands == sweeps.mid_band_candidates(200, 22016, 2048, 132) and len(cands) <= 16  # 5 shapes a call
    assert any(c.swap_ab for c in cands) and any(not c.swap_ab for c in cands)
    for bn in {c.block_n for c in cands}:
        assert any(c.block_n == bn and c.split_k == 1 for c in cands)
    assert all(c.block_k == 64 and c.num_stages == 3 for c in cands)
    assert all(c.block_n in (64, 128) for c in cands if c.swap_ab)  # [64 or 128, 256] accumulators


@pytest.mark.parametrize("M", [65, 130])
@pytest.mark.parametrize("config", [GemvConfig(64, 64, 1, 4, 3, swap_ab=True), GemvConfig(128, 64, 2, 8, 3),
                                    GemvConfig(128, 64, 3, 8, 3, swap_ab=True)], ids=["n64-swap", "n128-split2",
                                                                                      "n128-split3-swap"])
def test_the_mid_band_launch_past_gemvs_range_matches_linear(M, config):
    # what bench_gemv times above 64 rows: the GEMV kernel through launch_gemv (gemv() refuses M > 64);
    # odd N, K not a multiple of the tile, a bias
    from pageserve.kernels.gemv import launch_gemv

    g = torch.Generator().manual_seed(M)
    dev = "cuda" if CUDA else "cpu"  # fp32 (tf32 off) on either
    x, w, b = (t.to(dev) for t in (torch.randn(M, 200, generator=g), torch.randn(300, 200, generator=g),
                                   torch.randn(300, generator=g)))
    out = torch.empty(M, 300, device=dev)
    launch_gemv(x, w, None, b, out, config, None)
    ref = torch.nn.functional.linear(x.double(), w.double(), b.double()).float()
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
