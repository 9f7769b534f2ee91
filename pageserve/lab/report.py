"""Regenerate the README's results tables from the JSON record in ``results/<hardware>/``.

    python -m pageserve.lab.report            # rewrites the block between the markers in README.md

Only figures that a notebook wrote are shown; nothing here is typed in by hand.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository (pageserve/lab/report.py)
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"


def _fmt(v) -> str:
    if isinstance(v, float):
        if v == 0 or 1e-3 <= abs(v) < 1e6:
            return f"{v:,.4g}" if abs(v) < 10 else f"{v:,.1f}"
        return f"{v:.3g}"
    return str(v)


# The figures a reader asks for first: (notebook, figure, what it is, the goal it is held to)
HEADLINES = [
    ("02_continuous_batching_paged_kv", "w1_total_tok_s", "W1 total tok/s (500 × 512 → 256, bf16)", "≥ 15,000"),
    ("02_continuous_batching_paged_kv", "w1_speedup_vs_hf_generate_batch", "× HF `generate_batch`, same requests", ""),
    ("04_cuda_graphs", "w1_total_tok_s", "W1 total tok/s with decode graphs", "≥ 50,000"),
    ("04_cuda_graphs", "batch1_ms_per_token", "batch-1 decode, ms per token", "≤ 2.4"),
    ("04_cuda_graphs", "batch64_ms_per_step", "batch-64 decode, ms per step", "≤ 3.5"),
    ("04_cuda_graphs", "graph_vs_eager_fp32_identical", "graphs = eager token for token, fp32 (1 = yes)", "1"),
    ("04_cuda_graphs", "graph_vs_eager_bf16_logit_rel_err", "graphs vs eager logits, bf16, same padded batch, ‖Δ‖/‖ref‖",
     "≤ 1e-2"),
    ("04_cuda_graphs", "graph_vs_eager_bf16_unpadded_logit_rel_err",
     "graphs vs eager logits, bf16, eager on the unpadded batch, ‖Δ‖/‖ref‖", "≤ 1e-2"),
    ("04_cuda_graphs", "mixed_step_graphed_ms", "640-token mixed step (128 decodes + 512 prompt tokens) from graphs, ms",
     "< eager (`mixed_step_eager_ms`)"),
    ("04_cuda_graphs", "chat_mixed_graphs_speedup", "chat-like workload, tok/s with mixed-step graphs / without", "> 1"),
    ("01_naive_generation", "fp32_max_abs_logit_diff", "max abs Δ logit vs transformers, fp32", "< 1e-3"),
    ("01_naive_generation", "fp32_greedy_identical_prompts", "greedy 64-token prompts identical to HF (of 8)", "8"),
    ("01_naive_generation", "bf16_rel_logit_err", "bf16 logits vs transformers' bf16, ‖Δ‖/‖ref‖", "≤ 1e-2"),
    ("01_naive_generation", "bf16_rel_logit_err_vs_fp32", "bf16 logits vs fp32, ‖Δ‖/‖ref‖", ""),
    ("01_naive_generation", "hf_bf16_rel_logit_err_vs_fp32", "the same for transformers' own bf16 run", ""),
    ("06a_prefix_caching", "prefix_hit_rate", "prefix-cache hit rate, shared system prompts", ""),
    ("05_triton_kernels", "paged_decode_attn_bw_frac", "decode attention, fraction of read bandwidth", "≥ 0.70"),
    ("07_openai_server", "serve.4.ttft_p50_ms", "HTTP serving, 4 req/s (512 → 256): TTFT p50, ms", "vLLM engine alone, issue 10: 45"),
    ("07_openai_server", "serve.4.tpot_p50_ms", "HTTP serving, 4 req/s: TPOT p50, ms", "vLLM engine alone, issue 10: 3.4"),
    ("07_openai_server", "serve.16.ttft_p50_ms", "HTTP serving, 16 req/s: TTFT p50, ms", "vLLM engine alone, issue 10: 74"),
    ("07_openai_server", "serve.16.tpot_p50_ms", "HTTP serving, 16 req/s: TPOT p50, ms", "vLLM engine alone, issue 10: 6.7"),
    ("07_openai_server", "serve.32.ttft_p50_ms", "HTTP serving, 32 req/s: TTFT p50, ms", "vLLM engine alone, issue 10: 80"),
    ("07_openai_server", "serve.32.tpot_p50_ms", "HTTP serving, 32 req/s: TPOT p50, ms", "vLLM engine alone, issue 10: 9.5"),
    ("07_openai_server", "load_64_streams_completed", "64 concurrent streams, real weights: completed", "64"),
    ("07_openai_server", "stream_equals_whole_cjk_emoji", "streamed == whole text, CJK + emoji (1 = yes)", "1"),
]


def render_headlines(results_dir: Path = ROOT / "results", hardware: str = "h200") -> str:
    rows = []
    for nb, key, what, goal in HEADLINES:
        path = results_dir / hardware / f"{nb}.json"
        if not path.exists():
            continue
        rec = json.loads(path.read_text())
        if key in rec["figures"]:
            rows.append(f"| {what} | {_fmt(rec['figures'][key])} | {goal} | [{nb[:3].rstrip('_')}](results/{hardware}/{nb}.ipynb) |")
    if not rows:
        return ""
    return "\n".join([f"Headline figures on `{hardware}`:\n", "| figure | measured | goal | record |", "|---|---|---|---|", *rows, ""])


def _provenance_note(rec: dict) -> str:
    """What a reader must know about the commit: uncommitted changes, or a commit only declared."""
    notes = []
    if rec.get("git_dirty"):
        notes.append("with uncommitted changes")
    if rec.get("git_commit_source") == "env":
        notes.append("commit computed by git where the run was sent from, handed over in $PAGESERVE_GIT_COMMIT")
    return f" ({', '.join(notes)})" if notes else ""


PEER_ENGINES = ("pageserve", "vllm", "hf_generate_batch", "hf_generate")
PEER_ROWS = [  # (figure prefix, what the row is)
    ("w1_total_tok_s", "W1 total tok/s (500 × 512 → 256)"),
    ("nanovllm_total_tok_s", "nano-vllm total tok/s (256, lengths U[100, 1024])"),
    ("chat_total_tok_s", "chat total tok/s (lognormal lengths)"),
    ("shared_prefix_cached_s", "shared system prompts, prefix caching on: wall s (lower is better)"),
    ("batch1_ms_per_token", "batch-1 decode, ms per token"),
    ("batch64_ms_per_step", "batch-64 decode, ms per step"),
]


def _settings_note(params: dict, figs: dict) -> str:
    """What a reader must know to compare the rows: prefix caching per engine, HF's request
    slice, and whether vLLM's serving figures came from its HTTP server or its engine alone."""
    notes = []
    if "CACHED_WORKLOADS" in params:
        cached = ", ".join(params["CACHED_WORKLOADS"])
        notes.append(f"prefix caching on for {cached} and off for the other workloads, in both engines" if cached
                     else "prefix caching off in both engines")
    for name, key in (("pageserve", "PAGESERVE_ARGS"), ("vLLM", "VLLM_ARGS")):
        if isinstance(params.get(key), dict) and "enable_prefix_caching" in params[key]:
            notes.append(f"{name} prefix caching {'on' if params[key]['enable_prefix_caching'] else 'off'}")
    if params.get("PAGESERVE_ARGS") == {}:
        notes.append("pageserve on its defaults")
    if (params.get("PASSES") or 1) > 1:
        notes.append(f"each workload timed {params['PASSES']} times in a row in each engine, the median pass shown")
    if params.get("HF_W1_NUM_REQUESTS") and any(k.endswith((".hf_generate", ".hf_generate_batch")) for k in figs):
        notes.append(f"the HF peers ran W1's first {params['HF_W1_NUM_REQUESTS']} requests")
    if figs.get("serve.vllm.engine_level"):
        notes.append("vLLM's serving sweep is engine-level (AsyncLLM, no HTTP)")
    return ("; " + ", ".join(notes)) if notes else ""


def render_peers(rec: dict, hardware: str, title: str = "pageserve against its peers") -> str:
    """An 08 record as one table: rows are workloads, columns engines, and pageserve / vLLM.
    ``title`` opens the caption (the 08_throughput record: issue 14's comparison on defaults)."""
    figs, params = rec["figures"], rec.get("parameters", {})
    engines = [e for e in PEER_ENGINES if any(f"{k}.{e}" in figs for k, _ in PEER_ROWS)]
    if not engines:
        return ""
    head = ["workload", *[f"`{e}`" for e in engines]]
    if "vllm" in engines and "pageserve" in engines:
        head.append("pageserve / vLLM")
    rows = []
    for key, what in PEER_ROWS:
        vals = [figs.get(f"{key}.{e}") for e in engines]
        if all(v is None for v in vals):
            continue
        cells = [what, *["" if v is None else _fmt(v) for v in vals]]
        if len(head) > len(engines) + 1:
            ps, vl = figs.get(f"{key}.pageserve"), figs.get(f"{key}.vllm")
            cells.append(_fmt(ps / vl) if ps and vl else "")
        rows.append("| " + " | ".join(cells) + " |")
    if "floor_batch1_ms" in figs:
        rows.append("| batch-1 bandwidth floor, ms (weights + KV / read GB/s) | "
                    + " | ".join([_fmt(figs["floor_batch1_ms"]), *[""] * (len(head) - 2)]) + " |")
    if "pageserve" in engines:  # pageserve's column: each throughput workload's fraction of its hardware floor
        for workload in (key.removesuffix("_total_tok_s") for key, _ in PEER_ROWS if key.endswith("_total_tok_s")):
            fraction = figs.get(f"{workload}_floor_fraction.pageserve")
            if fraction is not None:
                cells = ["" for _ in head[1:]]
                cells[engines.index("pageserve")] = _fmt(fraction)
                rows.append(f"| {workload}: hardware floor / pageserve's wall (floor {_fmt(figs[f'{workload}_floor_s'])} s: "
                            "FLOPs at the matmul ceiling or bytes at the read bandwidth) | " + " | ".join(cells) + " |")
    dtype = params.get("engine_dtype") or params.get("DTYPE", "?")
    peers = ", ".join(f"{n} {params[k]}" for n, k in (("vLLM", "vllm_version"), ("transformers", "transformers_version"))
                      if params.get(k))
    caption = (f"{title} on `{hardware}` ({rec['hardware']}), model shape `{params.get('MODEL', '?')}` "
               f"(random weights), {dtype}, {rec['date']}; torch {rec['torch']}" + (f", {peers}" if peers else "")
               + f"; commit `{rec['git_commit'][:10]}`{_provenance_note(rec)} "
               f"([{rec.get('notebook', '08_benchmarks')}](results/{hardware}/{rec.get('notebook', '08_benchmarks')}.ipynb)). "
               "Each engine in its own process, same requests"
               + _settings_note(params, figs)
               + ("; the ratio column divides pageserve's figure by vLLM's (> 1: faster in tok/s rows, slower in "
                  "ms or s rows)" if len(head) > len(engines) + 1 else "") + ".\n")
    return "\n".join([caption, "| " + " | ".join(head) + " |", "|" + "---|" * len(head), *rows, ""])


SERVE_COLUMNS = [("ttft_p50_ms", "TTFT p50"), ("ttft_p99_ms", "TTFT p99"), ("tpot_p50_ms", "TPOT p50"),
                 ("tpot_p99_ms", "TPOT p99")]


def render_serving(rec: dict, hardware: str) -> str:
    """A record's serving sweep (``serve.<engine>.<rate>.<key>`` figures) as one table: a row
    per engine and rate, latencies in ms, and how each engine was reached (HTTP or engine-level)."""
    figs, params = rec["figures"], rec.get("parameters", {})
    cells: dict[tuple[str, float], dict[str, float]] = {}
    for k, v in figs.items():
        parts = k.split(".")
        if parts[0] == "serve" and len(parts) >= 4 and parts[-1] in dict(SERVE_COLUMNS):
            cells.setdefault((parts[1], float(".".join(parts[2:-1]))), {})[parts[-1]] = v
    if not cells:
        return ""
    levels = params.get("serve_levels", {})
    rows = [f"| `{e}` | {levels.get(e, '?')} | {rate:g} | " + " | ".join(_fmt(m[k]) if k in m else "" for k, _ in SERVE_COLUMNS)
            + " |" for (e, rate), m in sorted(cells.items(), key=lambda kv: (PEER_ENGINES.index(kv[0][0])
                                                                             if kv[0][0] in PEER_ENGINES else 99, kv[0][1]))]
    name = rec["notebook"]
    caption = (f"Serving on `{hardware}` ({rec['hardware']}), `{params.get('MODEL', '?')}` shape (random weights), "
               f"{params.get('engine_dtype') or params.get('DTYPE', '?')}, {rec['date']}"
               + (f", vLLM {params['vllm_version']}" if params.get("vllm_version") else "")
               + f"; commit `{rec['git_commit'][:10]}`{_provenance_note(rec)} ([{name}](results/{hardware}/{name}.ipynb)). "
               f"Each server in its own process, Poisson arrivals for {params.get('RATE_DURATION_S', '?')} s per rate, "
               f"{params.get('RATE_PROMPT_LEN', '?')}-token prompts, {params.get('RATE_OUTPUT_LEN', '?')} output tokens, "
               "streamed; latencies in ms as vLLM's `bench serve` defines them; level `http` is the OpenAI server, "
               "`engine` the engine alone (no HTTP).\n")
    head = ["server", "level", "req/s", *[w for _, w in SERVE_COLUMNS]]
    return "\n".join([caption, "| " + " | ".join(head) + " |", "|" + "---|" * len(head), *rows, ""])


def render(results_dir: Path = ROOT / "results") -> str:
    headlines = render_headlines(results_dir)
    lines: list[str] = [headlines] if headlines else []
    peers = results_dir / "h200" / "08_benchmarks.json"
    if peers.exists():
        table = render_peers(json.loads(peers.read_text()), "h200")
        if table:
            lines.append(table)
    throughput = results_dir / "h200" / "08_throughput.json"  # issue 14's comparison, when it was a run of its own
    if throughput.exists():
        table = render_peers(json.loads(throughput.read_text()), "h200",
                             title="pageserve against vLLM, both engines on their defaults,")
        if table:
            lines.append(table)
    serving = results_dir / "h200" / "08_serving.json"  # the sweep over HTTP, when it was a run of its own
    for path in ([serving] if serving.exists() else [peers] if peers.exists() else []):
        table = render_serving(json.loads(path.read_text()), "h200")
        if table:
            lines.append(table)
    for hw_dir in sorted(p for p in results_dir.iterdir() if p.is_dir() and p.name != "local"):
        records = [json.loads(p.read_text()) for p in sorted(hw_dir.glob("*.json"))]
        records = [r for r in records if "notebook" in r and "figures" in r]  # notebook records only
        if not records:
            continue
        lines.append(f"### `results/{hw_dir.name}/`\n")
        for rec in records:
            lines.append(
                f"**{rec['notebook']}** — {rec['hardware']}, torch {rec['torch']}, "
                f"{rec['date']}, commit `{rec['git_commit'][:10]}`{_provenance_note(rec)} "
                f"([notebook](results/{hw_dir.name}/{rec['notebook']}.ipynb))\n"
            )
            lines.append("| figure | value |\n|---|---|")
            for k, v in rec["figures"].items():
                lines.append(f"| `{k}` | {_fmt(v)} |")
            lines.append("")
    return "\n".join(lines) if lines else "_No GPU results recorded yet._\n"


def main(argv: list[str] | None = None) -> int:
    readme = ROOT / "README.md"
    text = readme.read_text()
    if BEGIN not in text or END not in text:
        print(f"README.md has no {BEGIN} … {END} block", file=sys.stderr)
        return 1
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(f"{head}{BEGIN}\n{render()}\n{END}{tail}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
