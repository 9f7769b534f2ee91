"""The 08 record renders as a peer table: workloads x engines, pageserve / vLLM, with provenance."""
from pageserve.lab import report
from pageserve.lab.results import write_figures


def test_peer_table_has_a_row_per_workload_a_column_per_engine_and_the_vllm_ratio(tmp_path):
    figs = {"w1_total_tok_s.pageserve": 60000.0, "w1_total_tok_s.vllm": 50000.0, "w1_total_tok_s.hf_generate": 900.0,
            "chat_total_tok_s.pageserve": 30000.0, "chat_total_tok_s.vllm": 40000.0,
            "batch1_ms_per_token.pageserve": 2.2, "batch1_ms_per_token.vllm": 2.0, "floor_batch1_ms": 1.5}
    params = {"MODEL": "qwen2.5-3b", "DTYPE": "auto", "engine_dtype": "bfloat16", "vllm_version": "0.26.0",
              "transformers_version": "5.24.0"}
    write_figures("08_benchmarks", params, figs, tmp_path / "h200")
    out = report.render(tmp_path)
    assert "| workload | `pageserve` | `vllm` | `hf_generate` | pageserve / vLLM |" in out
    assert "| W1 total tok/s (500 × 512 → 256) | 60,000.0 | 50,000.0 | 900.0 | 1.2 |" in out
    assert "| chat total tok/s (lognormal lengths) | 30,000.0 | 40,000.0 |  | 0.75 |" in out
    assert "| batch-1 decode, ms per token | 2.2 | 2 |  | 1.1 |" in out
    assert "nano-vllm" not in out  # no figure, no row
    assert "bandwidth floor" in out and "| 1.5 |" in out
    for must in ("qwen2.5-3b", "bfloat16", "vLLM 0.26.0", "transformers 5.24.0", "`h200`"):
        assert must in out, must


def test_without_vllm_there_is_no_ratio_column(tmp_path):
    write_figures("08_benchmarks", {"MODEL": "smollm2-135m"}, {"w1_total_tok_s.pageserve": 10.0,
                                                               "w1_total_tok_s.hf_generate_batch": 5.0}, tmp_path / "h200")
    out = report.render(tmp_path)
    assert "| workload | `pageserve` | `hf_generate_batch` |" in out and "pageserve / vLLM" not in out


def test_serving_table_has_a_row_per_server_and_rate_and_names_the_level(tmp_path):
    figs = {"serve.pageserve.4.ttft_p50_ms": 26.0, "serve.pageserve.4.tpot_p50_ms": 4.7,
            "serve.vllm.4.ttft_p50_ms": 25.0, "serve.vllm.4.tpot_p99_ms": 3.4, "serve.vllm.16.ttft_p50_ms": 31.5,
            "serve.vllm.engine_level": 1}
    params = {"MODEL": "qwen2.5-3b", "engine_dtype": "bfloat16", "vllm_version": "0.26.0",
              "serve_levels": {"pageserve": "http", "vllm": "engine"}, "RATE_DURATION_S": 15}
    write_figures("08_serving", params, figs, tmp_path / "h200")
    out = report.render(tmp_path)
    assert "| server | level | req/s | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 |" in out
    assert "| `pageserve` | http | 4 | 26.0 |  | 4.7 |  |" in out
    assert "| `vllm` | engine | 4 | 25.0 |  |  | 3.4 |" in out
    assert out.index("| `vllm` | engine | 4 |") < out.index("| `vllm` | engine | 16 |")
    assert "[08_serving](results/h200/08_serving.ipynb)" in out and "vLLM 0.26.0" in out


def test_installed_version_reads_the_distribution_and_says_none_when_absent():
    from importlib import metadata

    from pageserve.lab.peers import installed_version

    assert installed_version("torch") == metadata.version("torch")
    assert installed_version("no-such-package-pageserve") is None


def test_the_throughput_record_gets_its_own_table_linked_to_its_own_notebook(tmp_path):
    params = {"MODEL": "qwen2.5-3b", "engine_dtype": "bfloat16", "vllm_version": "0.26.0", "PAGESERVE_ARGS": {},
              "CACHED_WORKLOADS": []}
    write_figures("08_benchmarks", {"MODEL": "qwen2.5-3b"}, {"w1_total_tok_s.pageserve": 70000.0,
                                                             "w1_total_tok_s.vllm": 65000.0}, tmp_path / "h200")
    write_figures("08_throughput", params, {"w1_total_tok_s.pageserve": 74000.0, "w1_total_tok_s.vllm": 60000.0},
                  tmp_path / "h200")
    out = report.render(tmp_path)
    assert out.count("| workload | `pageserve` | `vllm` | pageserve / vLLM |") == 2
    assert "both engines on their defaults" in out and "pageserve on its defaults" in out
    assert "prefix caching off in both engines" in out and "HF peers" not in out
    assert "(results/h200/08_throughput.ipynb)" in out and "(results/h200/08_benchmarks.ipynb)" in out
    assert "| W1 total tok/s (500 × 512 → 256) | 74,000.0 | 60,000.0 | 1.233 |" in out


def test_floor_fractions_sit_in_pageserve_column_and_the_passes_are_named(tmp_path):
    params = {"MODEL": "qwen2.5-3b", "engine_dtype": "bfloat16", "PASSES": 3}
    figs = {"w1_total_tok_s.pageserve": 78000.0, "w1_total_tok_s.vllm": 65000.0, "w1_floor_fraction.pageserve": 0.66,
            "w1_floor_s": 3.25, "nanovllm_total_tok_s.pageserve": 48000.0, "nanovllm_total_tok_s.vllm": 40000.0}
    write_figures("08_throughput", params, figs, tmp_path / "h200")
    out = report.render(tmp_path)
    assert "| w1: hardware floor / pageserve's wall (floor 3.25 s: FLOPs at the matmul ceiling or bytes at the " \
           "read bandwidth) | 0.66 |  |  |" in out
    assert "nanovllm: hardware floor" not in out  # no fraction, no row
    assert "each workload timed 3 times in a row in each engine, the median pass shown" in out
