"""Phase 08: pageserve against its peers (vLLM, Hugging Face), one engine per process.

Every engine gets the same requests (``workloads``: built by name and seed in each process,
over the model's full vocabulary, so no ids cross a process boundary) and one result shape,
``OfflineResult``: requests, prompt and output tokens, wall seconds, total and output tok/s
(``bench``'s accounting: tokens over a window with the device synchronised at both ends).

The engines:

* ``pageserve``: ``LLM`` over random weights at the shape of ``model``; ``bench.run_pageserve``.
* ``vllm``: ``vllm.LLM(model=<dir with config.json>, load_format="dummy",
  skip_tokenizer_init=True)`` with ``TokensPrompt``s and ``SamplingParams(ignore_eos=True,
  max_tokens=..., temperature=0)``. Only where ``import vllm`` works; elsewhere it raises
  ``VllmMissingError``. The model directory is written from pageserve's shipped config
  (``write_model_dir``).
* ``hf_generate``: transformers ``generate()`` on padded static batches (left padding).
* ``hf_generate_batch``: transformers' continuous batching (``hf_baselines``).

Each runs in its own process, so two engines never share a GPU (memory, allocator caches,
CUDA graphs)::

    python -m pageserve.lab.peers run --engine vllm --model qwen2.5-3b --dtype bfloat16 \\
        --workloads '{"w1": {}, "chat": {"num_requests": 1000}}' --decode '{"batches": [1, 64]}' \\
        --out /tmp/vllm.json

and ``run_peer(...)`` does that from a notebook and returns the JSON.

Decode timing, one method for every engine (``subtraction_decode_ms``): ``B`` fresh random
prompts of ``context_len`` tokens run once with ``max_tokens=1`` (prefill + the first token)
and once with ``max_tokens=1 + steps``; decode ms per step = (t_full - t_prefill) / steps,
each time the median of ``repeats`` runs (fresh prompts every run, so a prefix cache never
helps). For batch 1 that is ms per token; for batch 64, ms per step of 64 tokens. pageserve
also reports ``decode_bench.decode_step_ms`` (consecutive ``engine.step()`` calls, no
request setup or teardown in the window); the two differ by the per-request overhead.

The batch-1 bandwidth floor: every decode step reads all weights once plus the KV cache of
the context, so ``floor_batch1_ms = (weight bytes + KV bytes) / measured read bandwidth``
(``kernel_bench.ceilings.measure_ceilings()["read_gbps"]`` on CUDA).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from .bench import BenchResult, Workload, synchronize
from .profiling import RunConditions, host_info, linear_flops, python_loop_ms
from .workloads import WorkloadSpec, make_workload

ENGINES = ("pageserve", "vllm", "hf_generate_batch", "hf_generate")


class VllmMissingError(RuntimeError):
    """vLLM is not importable here (it is not installed on the CPU box; the GPU session
    installs it from the pieces ``vllm-pack.sh`` makes)."""


def require_vllm():
    """``import vllm``, or a ``VllmMissingError`` that says how to get it."""
    try:
        import vllm
    except ImportError as e:
        raise VllmMissingError(
            f"the vllm engine needs the vllm package, which does not import here ({e}). On the H200 "
            "machine: bash /tmp/acc/.vllm3/install.sh && export PYTHONPATH=/tmp/site:$PYTHONPATH "
            "(see /work/shared/peers/vllm-pack.sh); vLLM is not installable on the CPU box."
        ) from e
    return vllm


def peer_versions() -> dict[str, str | None]:
    """torch, transformers and vllm versions of this process (None: not importable)."""
    out: dict[str, str | None] = {"torch": torch.__version__}
    for name in ("transformers", "vllm", "triton"):
        try:
            out[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001 - a missing or broken peer is just absent
            out[name] = None
    return out


def installed_version(package: str) -> str | None:
    """The installed distribution's version of ``package`` without importing it (None: not
    installed): what a record names when no runner process reported its versions."""
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


# --------------------------------------------------------------------------- model dir for vLLM


def _model_config(model):
    from ..model.config import ModelConfig

    if isinstance(model, ModelConfig):
        return model
    name = str(model).removeprefix("dummy:")
    if name.endswith(".json") or os.sep in name:
        return ModelConfig.from_json(Path(name).expanduser())
    return ModelConfig.shipped(name)


def hf_config_json(model, dtype: str = "bfloat16", max_model_len: int | None = None) -> dict[str, Any]:
    """A complete HF ``config.json`` for ``model`` (a shipped name or a ``ModelConfig``).

    ``hf_reference.hf_config_dict`` gives the shape; vLLM and ``AutoConfig`` also read the
    keys a hub checkpoint has: ``torch_dtype`` (the dtype ``--dtype auto`` picks),
    ``use_cache``, ``attention_dropout``, ``initializer_range``, ``transformers_version``
    and for Qwen2 the sliding-window keys (off, as in Qwen2.5's own config)."""
    from .hf_reference import hf_config_dict

    cfg = _model_config(model)
    d = hf_config_dict(cfg)
    d.update(torch_dtype=dtype, use_cache=True, attention_dropout=0.0, initializer_range=0.02)
    if max_model_len:
        d["max_position_embeddings"] = max(int(max_model_len), d["max_position_embeddings"])
    if cfg.architecture == "qwen2":
        d.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.num_layers)
    try:
        import transformers

        d["transformers_version"] = transformers.__version__
    except ImportError:
        pass
    return {k: v for k, v in d.items() if v is not None or k == "sliding_window"}


def write_model_dir(model, out_dir: str | os.PathLike | None = None, dtype: str = "bfloat16") -> Path:
    """Write ``config.json`` (and a matching ``generation_config.json``) into ``out_dir``
    (a new temporary folder by default): what ``vllm.LLM(model=dir, load_format="dummy")``
    and ``vllm serve dir --load-format dummy`` need. Returns the folder."""
    out = Path(out_dir) if out_dir else Path(tempfile.mkdtemp(prefix="pageserve-peer-model-"))
    out.mkdir(parents=True, exist_ok=True)
    cfg = hf_config_json(model, dtype)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id") if k in cfg}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return out


def workload_vocab(model) -> int:
    """Token ids a workload may use: the model's vocabulary (random weights have no tokenizer,
    and every engine here runs with detokenization off)."""
    return _model_config(model).vocab_size


# --------------------------------------------------------------------------- results


@dataclass
class OfflineResult:
    """One engine on one workload: the shape every runner returns."""

    engine: str
    workload: str
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    wall_s: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def total_tok_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.wall_s if self.wall_s > 0 else float("nan")

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else float("nan")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "total_tok_s": self.total_tok_s, "output_tok_s": self.output_tok_s}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "OfflineResult":
        return cls(**{k: d[k] for k in ("engine", "workload", "num_requests", "prompt_tokens", "output_tokens",
                                         "wall_s")}, extra=dict(d.get("extra") or {}))

    @classmethod
    def from_bench(cls, engine: str, workload: str, r: BenchResult) -> "OfflineResult":
        extra = {k: v for k, v in r.extra.items() if k in ("prefix_hit_rate", "prefill_tokens_saved_frac",
                                                          "num_preemptions")}
        return cls(engine, workload, r.num_requests, r.prompt_tokens, r.output_tokens, r.wall_s, extra)


def timed_generate(engine: str, workload: Workload, generate: Callable[[Workload], int], device=None,
                   clock: Callable[[], float] = time.perf_counter) -> OfflineResult:
    """Time ``generate(workload)`` (which returns the output tokens it produced) between two
    device synchronisations; prompt tokens come from the workload."""
    synchronize(device)
    t0 = clock()
    out_tokens = generate(workload)
    synchronize(device)
    return OfflineResult(engine, workload.name, len(workload), workload.prompt_tokens, int(out_tokens), clock() - t0)


# --------------------------------------------------------------------------- decode timing and the floor


def subtraction_decode_ms(generate: Callable[[list[list[int]], int], Any], batch_size: int, context_len: int,
                          steps: int, vocab_size: int, seed: int = 0, repeats: int = 3,
                          clock: Callable[[], float] = time.perf_counter, device=None) -> dict[str, float]:
    """Decode ms per step by subtraction (the module docstring): ``generate(prompts, max_tokens)``
    must run all prompts to exactly ``max_tokens`` tokens and return when they are done."""
    gen = torch.Generator().manual_seed(seed)

    def fresh() -> list[list[int]]:
        return torch.randint(0, vocab_size, (batch_size, context_len), generator=gen).tolist()

    def run(max_tokens: int) -> float:
        prompts = fresh()
        synchronize(device)
        t0 = clock()
        generate(prompts, max_tokens)
        synchronize(device)
        return clock() - t0

    run(1 + steps)  # warm-up: kernels for this batch size, graph buckets, allocator growth
    prefill = statistics.median(run(1) for _ in range(repeats))
    full = statistics.median(run(1 + steps) for _ in range(repeats))
    return {"decode_ms": 1e3 * (full - prefill) / steps, "prefill_s": prefill, "full_s": full,
            "batch_size": batch_size, "context_len": context_len, "steps": steps}


def weight_bytes(model, dtype_bytes: int = 2) -> int:
    """Bytes one batch-1 decode step must read of the weights: every layer, the final norm
    and the LM head (``vocab x hidden``, tied or not); the embedding lookup reads one row."""
    c = _model_config(model)
    attn = c.hidden_size * (c.q_size + 2 * c.kv_size) + c.q_size * c.hidden_size
    if c.attention_bias:
        attn += c.q_size + 2 * c.kv_size
    mlp = 3 * c.hidden_size * c.intermediate_size
    per_layer = attn + mlp + 2 * c.hidden_size
    return dtype_bytes * (c.num_layers * per_layer + c.hidden_size + c.vocab_size * c.hidden_size + c.hidden_size)


def kv_bytes(model, context_len: int, dtype_bytes: int = 2) -> int:
    """Bytes of K and V for ``context_len`` tokens of one sequence (all layers)."""
    c = _model_config(model)
    return 2 * c.num_layers * c.kv_size * context_len * dtype_bytes


def floor_batch1_ms(model, read_gbps: float, context_len: int, dtype_bytes: int = 2) -> float:
    """The bandwidth floor of one batch-1 decode step: (weights + KV) / read bandwidth, in ms."""
    return 1e3 * (weight_bytes(model, dtype_bytes) + kv_bytes(model, context_len, dtype_bytes)) / (read_gbps * 1e9)


def workload_floor(model, requests: Sequence[tuple[int, int]], read_gbps: float, matmul_tflops: float,
                   dtype_bytes: int = 2) -> dict[str, float]:
    """The hardware floor of an offline workload, ``requests`` given as (prompt tokens, output
    tokens) each: however an engine schedules it, it cannot take less than its FLOPs at the matmul
    ceiling (``compute_s``) nor less than its bytes at the read bandwidth (``memory_s``), so the
    floor is the larger of the two (``floor_s``).

    FLOPs: every linear on every token a forward must see (the prompt, and each output token but
    the last), the LM head on every sampled token, and attention (QK^T and PV) over each such
    token's visible keys. Bytes: the weights once per decode step, of which there are at least the
    longest output's length less one after the prefill, plus every decode token's read of its
    sequence's K and V. (The prefill's own weight read and every write are left out: a floor.)
    The parts come back too: ``linear_flops``, ``attention_flops`` (of which ``prompt_attention_flops``
    is the prompts' own) and ``kv_read_bytes`` (the decode tokens' K and V reads alone)."""
    c = _model_config(model)
    linear, attention, prompt_attention, kv_tokens, longest = 0.0, 0.0, 0.0, 0, 0
    per_pair = 4.0 * c.head_dim * c.num_heads * c.num_layers  # QK^T and PV of one (query, key) pair
    for prompt, output in requests:
        fed = prompt + max(output - 1, 0)
        linear += linear_flops(c, fed, sampled_rows=output)
        attention += per_pair * fed * (fed + 1) / 2  # token i sees i + 1 keys
        prompt_attention += per_pair * prompt * (prompt + 1) / 2
        steps = max(output - 1, 0)
        kv_tokens += steps * prompt + steps * (steps + 1) // 2  # decode token j reads prompt + j tokens' K and V
        longest = max(longest, output)
    kv_read = kv_tokens * kv_bytes(c, 1, dtype_bytes)
    nbytes = weight_bytes(c, dtype_bytes) * max(longest - 1, 0) + kv_read
    flops = linear + attention
    compute_s = flops / (matmul_tflops * 1e12)
    memory_s = nbytes / (read_gbps * 1e9)
    return {"floor_s": max(compute_s, memory_s), "compute_s": compute_s, "memory_s": memory_s, "flops": flops,
            "bytes": float(nbytes), "linear_flops": linear, "attention_flops": attention,
            "prompt_attention_flops": prompt_attention, "kv_read_bytes": float(kv_read)}


def measure_read_gbps(device: str = "auto") -> dict[str, float]:
    """Read bandwidth of this device, and a matmul rate for ``workload_floor``: ``measure_ceilings()``
    on CUDA (``matmul_bf16_tflops``); on the CPU the best of a few ``torch.sum`` passes over 256 MiB
    and of a few fp32 1024³ matmuls (``matmul_fp32_tflops``): rough numbers, for the CPU smoke run."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if str(device).startswith("cuda"):
        from .kernel_bench.ceilings import measure_ceilings

        return measure_ceilings()
    x = torch.ones(64 * 2**20, dtype=torch.float32)
    best = math.inf
    for _ in range(5):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    a = torch.randn(1024, 1024)
    mm = math.inf
    for _ in range(3):
        t0 = time.perf_counter()
        a @ a
        mm = min(mm, time.perf_counter() - t0)
    return {"read_gbps": x.numel() * 4 / best / 1e9, "matmul_fp32_tflops": 2 * 1024**3 / mm / 1e12}


# --------------------------------------------------------------------------- the engines


def _dtype_bytes(dtype: str) -> int:
    return 4 if dtype in ("float32", "fp32") else 2


class PageserveRunner:
    """pageserve's ``LLM`` on random weights at the shape of ``model``."""

    name = "pageserve"

    def __init__(self, model: str, device: str = "auto", dtype: str = "auto", seed: int = 0, **engine_kwargs: Any):
        from ..engine.llm import LLM
        from . import bench

        self.llm = LLM(f"dummy:{str(model).removeprefix('dummy:')}", device=device, dtype=dtype, seed=seed,
                       **engine_kwargs)
        self.device = self.llm.engine.runner.device
        bench.warmup(self.llm, bench.prompt_vocab_size(self.llm))

    def offline(self, workload: Workload) -> OfflineResult:
        from . import bench

        return OfflineResult.from_bench(self.name, workload.name, bench.run_pageserve(self.llm, workload))

    def generate_ids(self, prompts: list[list[int]], max_tokens: int) -> None:
        from .bench import greedy_params

        self.llm.generate(prompts, greedy_params(max_tokens), use_tqdm=False)

    def decode(self, batch_size: int, context_len: int, steps: int, vocab: int, seed: int,
               repeats: int = 3) -> dict[str, float]:
        from .decode_bench import decode_step_ms

        out = subtraction_decode_ms(self.generate_ids, batch_size, context_len, steps, vocab, seed, repeats,
                                    device=self.device)
        out["engine_step_ms"] = decode_step_ms(self.llm, batch_size, context_len, steps=steps, vocab_size=vocab,
                                               seed=seed, repeats=repeats)
        return out


class VllmRunner:
    """``vllm.LLM`` with dummy weights and no tokenizer, fed token ids (needs ``vllm``)."""

    name = "vllm"

    def __init__(self, model: str, device: str = "auto", dtype: str = "auto", seed: int = 0, model_dir: str | None = None,
                 **engine_kwargs: Any):
        require_vllm()
        from vllm import LLM

        dt = "bfloat16" if dtype == "auto" else dtype
        self.model_dir = Path(model_dir) if model_dir else write_model_dir(model, dtype=dt)
        self.llm = LLM(model=str(self.model_dir), load_format="dummy", skip_tokenizer_init=True, dtype=dt, seed=seed,
                       **engine_kwargs)
        self.device = "cuda"
        self.generate_ids([[1] * 16] * 2, 4)  # warm-up

    def _generate(self, prompts: Sequence[list[int]], max_tokens: Sequence[int]) -> int:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = [SamplingParams(temperature=0.0, max_tokens=int(m), ignore_eos=True, detokenize=False)
                  for m in max_tokens]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    def offline(self, workload: Workload) -> OfflineResult:
        return timed_generate(self.name, workload,
                              lambda w: self._generate(w.prompts, [r.max_tokens for r in w.requests]), self.device)

    def generate_ids(self, prompts: list[list[int]], max_tokens: int) -> None:
        self._generate(prompts, [max_tokens] * len(prompts))

    def decode(self, batch_size: int, context_len: int, steps: int, vocab: int, seed: int,
               repeats: int = 3) -> dict[str, float]:
        return subtraction_decode_ms(self.generate_ids, batch_size, context_len, steps, vocab, seed, repeats,
                                     device=self.device)


class _HFRunner:
    """The HF peers on the same random weights as pageserve's (``hf_reference.build_hf_model``)."""

    def __init__(self, model: str, device: str = "auto", dtype: str = "auto", seed: int = 0, **options: Any):
        from ..model.loader import load_model
        from .hf_reference import build_hf_model

        loaded = load_model(f"dummy:{str(model).removeprefix('dummy:')}", device=device, dtype=dtype, seed=seed)
        self.hf = build_hf_model(loaded.model)
        del loaded
        self.device = next(self.hf.parameters()).device
        self.options = options


class HFGenerateRunner(_HFRunner):
    name = "hf_generate"

    def offline(self, workload: Workload) -> OfflineResult:
        bs = int(self.options.get("batch_size", 16))
        r = hf_generate_padded(self.hf, workload, bs)
        res = OfflineResult.from_bench(self.name, workload.name, r)
        res.extra["batch_size"] = bs
        return res


class HFGenerateBatchRunner(_HFRunner):
    name = "hf_generate_batch"

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        from .bench import random_workload
        from .hf_baselines import hf_generate_batch

        vocab = self.hf.config.vocab_size
        hf_generate_batch(self.hf, random_workload(2, 16, 4, vocab, seed=12345), self.options.get("attn", "sdpa"))  # warm-up

    def offline(self, workload: Workload) -> OfflineResult:
        from .hf_baselines import hf_generate_batch

        r = hf_generate_batch(self.hf, workload, self.options.get("attn", "sdpa"))
        return OfflineResult.from_bench(self.name, workload.name, r)


RUNNERS = {"pageserve": PageserveRunner, "vllm": VllmRunner, "hf_generate": HFGenerateRunner,
           "hf_generate_batch": HFGenerateBatchRunner}


@torch.inference_mode()
def hf_generate_padded(model, workload: Workload, batch_size: int = 16,
                       clock: Callable[[], float] = time.perf_counter) -> BenchResult:
    """``model.generate()`` on static batches of ``batch_size`` consecutive requests, left-padded.

    A static batch runs until its longest request is done; each request is credited only
    the ``max_tokens`` it asked for (the padding and the extra steps are the static batch's
    cost, which is what this peer shows)."""
    from .bench import make_result
    from .hf_baselines import _no_eos_config

    device = next(model.parameters()).device
    pad = getattr(model.config, "pad_token_id", None) or 0
    rows, output_tokens = [], 0
    synchronize(device)
    t0 = clock()
    with torch.inference_mode():
        for i in range(0, len(workload), batch_size):
            batch = workload.requests[i:i + batch_size]
            width = max(len(r.prompt_token_ids) for r in batch)
            ids = torch.full((len(batch), width), pad, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for j, r in enumerate(batch):
                n = len(r.prompt_token_ids)
                ids[j, width - n:] = torch.tensor(r.prompt_token_ids)
                mask[j, width - n:] = 1
            ids, mask = ids.to(device), mask.to(device)
            new = max(r.max_tokens for r in batch)
            out = model.generate(ids, attention_mask=mask, generation_config=_no_eos_config(model, new, []))
            gen = out[:, width:]
            for j, r in enumerate(batch):
                toks = gen[j, :r.max_tokens].tolist()
                output_tokens += len(toks)
                rows.append({"tag": r.tag, "ttft_s": None, "itl_s": [], "token_ids": toks})
    synchronize(device)
    wall = clock() - t0
    return make_result(f"hf_generate/{workload.name}", workload.prompt_tokens, output_tokens, wall, rows)


# --------------------------------------------------------------------------- one engine, one process


WARMUP_SEED_OFFSET = 7919  # warm-up workloads: the same builder and shape, other ids (no prefix-cache hits)


def warmup_workload(spec: "WorkloadSpec", vocab: int, seed_offset: int = WARMUP_SEED_OFFSET,
                    num_requests: int = 32) -> Workload:
    """The first ``num_requests`` requests of ``spec``'s workload built with another seed: the
    same lengths and batch shapes, none of the measured prompts (so nothing is cached for them)."""
    kwargs = dict(spec.kwargs)
    kwargs["seed"] = int(kwargs.get("seed", 0)) + seed_offset
    return WorkloadSpec(spec.name, kwargs).build(vocab).head(num_requests)


def run_engine(engine: str, model: str, workloads: dict[str, dict], decode: dict | None = None, device: str = "auto",
               dtype: str = "auto", seed: int = 0, engine_args: dict | None = None,
               floor: bool = False, warmup_requests: int = 32, passes: int = 1) -> dict[str, Any]:
    """Build ``engine`` once, run each workload (``{name: builder kwargs}``) and the decode
    timings (``{"batches": [1, 64], "context_len": 512, "steps": 64}``); a failing workload
    is recorded under ``errors`` and the others still run. Returns a JSON-able record, with the
    host (``host``) and, per workload, its load and SM clock while timed (``conditions``).

    ``passes``: each workload is timed that many times in a row, the same requests each time;
    ``offline`` holds the median pass by wall time (of an even count, the slower of the middle
    two) and ``passes`` every pass. (vLLM's one-pass W1 read 61-70k tok/s from run to run on one
    H200, NOTES.md session 29: one pass a workload left the comparison to that spread.) With
    prefix caching on, a later pass would hit what the first cached: keep one pass there.
    ``floor``: the read bandwidth and matmul ceiling measured in this process, the batch-1
    floor, and each workload's ``workload_floor`` with its fraction (floor / median wall).

    Before each timed workload, ``warmup_requests`` requests of the same shape with other ids
    run untimed (``warmup_workload``; 0: none), in every engine alike: kernels compiled or
    tuned on first sight of a shape (Triton's JIT, cuBLAS heuristics, vLLM's compile buckets)
    then stay out of the timed window. (The 08 run at 3eef1891 had only a 2-request warm-up;
    pageserve's first workload, W1, came in 30% under its own figure from other runs.)"""
    if engine not in RUNNERS:
        raise ValueError(f"unknown engine {engine!r}; known: {sorted(RUNNERS)}")
    if passes < 1:
        raise ValueError(f"passes must be at least 1, got {passes}")
    vocab = workload_vocab(model)
    lengths = {}  # workload -> [(prompt tokens, output tokens)], for its floor
    rec: dict[str, Any] = {"engine": engine, "model": model, "dtype": dtype, "device": device, "seed": seed,
                           "versions": peer_versions(), "host": host_info(), "offline": {}, "decode": {},
                           "errors": {}, "conditions": {}}
    t0 = time.perf_counter()
    runner = RUNNERS[engine](model, device=device, dtype=dtype, seed=seed, **(engine_args or {}))
    rec["startup_s"] = time.perf_counter() - t0
    for name, kwargs in workloads.items():
        kwargs = dict(kwargs)
        builder = kwargs.pop("workload", name)  # {"w1_small": {"workload": "w1", ...}}
        try:
            spec = WorkloadSpec(builder, kwargs)
            if warmup_requests:
                warm = warmup_workload(spec, vocab, num_requests=warmup_requests)
                warm.name = f"{name}_warmup"
                rec.setdefault("warmup", {})[name] = runner.offline(warm).to_dict()
            w = spec.build(vocab)
            w.name = name
            # the host's Python speed just before the timed passes (the start-up probe in ``host`` read 13.5 vs
            # 7.0 ms in two processes of one machine minutes apart: NOTES.md session 37)
            rec.setdefault("host_loop_ms", {})[name] = python_loop_ms()
            runs = []
            for _ in range(passes):
                with RunConditions() as cond:  # the host's load and the SM clock while it ran
                    result = runner.offline(w).to_dict()
                runs.append((result, cond.summary()))
            median = sorted(runs, key=lambda run: run[0]["wall_s"])[len(runs) // 2]
            rec["offline"][name], rec["conditions"][name] = median
            if passes > 1:
                rec.setdefault("passes", {})[name] = [result for result, _ in runs]
            lengths[name] = [(len(r.prompt_token_ids), r.max_tokens) for r in w.requests]
        except Exception as e:  # noqa: BLE001 - one workload's failure (OOM, a peer's bug) is a data point
            rec["errors"][name] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
    if decode and hasattr(runner, "decode"):
        for b in decode.get("batches", []):
            try:
                rec["decode"][str(b)] = runner.decode(int(b), int(decode.get("context_len", 512)),
                                                      int(decode.get("steps", 64)), vocab, seed,
                                                      int(decode.get("repeats", 3)))
            except Exception as e:  # noqa: BLE001
                rec["errors"][f"decode_{b}"] = f"{type(e).__name__}: {e}"
                traceback.print_exc()
    if floor:
        dt = _dtype_bytes(dtype if dtype != "auto" else ("bfloat16" if torch.cuda.is_available() else "float32"))
        ceil = measure_read_gbps(device)
        ctx = int((decode or {}).get("context_len", 512))
        rec["floor"] = {**ceil, "weight_bytes": weight_bytes(model, dt), "kv_bytes": kv_bytes(model, ctx, dt),
                        "context_len": ctx, "floor_batch1_ms": floor_batch1_ms(model, ceil["read_gbps"], ctx, dt)}
        tflops = ceil.get("matmul_bf16_tflops") or ceil["matmul_fp32_tflops"]  # CUDA: bf16's; the CPU: fp32's
        rec["floor"]["workloads"] = {}
        for name, result in rec["offline"].items():
            wf = workload_floor(model, lengths[name], ceil["read_gbps"], tflops, dt)
            rec["floor"]["workloads"][name] = {**wf, "fraction": wf["floor_s"] / result["wall_s"]}
    return rec


def run_peer(engine: str, model: str, workloads: dict[str, dict], out: str | os.PathLike, decode: dict | None = None,
             device: str = "auto", dtype: str = "auto", seed: int = 0, engine_args: dict | None = None,
             floor: bool = False, timeout_s: float | None = None, env: dict | None = None,
             warmup_requests: int = 32, passes: int = 1) -> dict[str, Any]:
    """``python -m pageserve.lab.peers run ...`` in a child process; returns the JSON it wrote.
    Raises ``RuntimeError`` with the child's output tail if it fails."""
    cmd = [sys.executable, "-m", "pageserve.lab.peers", "run", "--engine", engine, "--model", model,
           "--device", device, "--dtype", dtype, "--seed", str(seed), "--workloads", json.dumps(workloads),
           "--out", str(out), "--warmup-requests", str(warmup_requests), "--passes", str(passes)]
    if decode:
        cmd += ["--decode", json.dumps(decode)]
    if engine_args:
        cmd += ["--engine-args", json.dumps(engine_args)]
    if floor:
        cmd.append("--floor")
    root = Path(__file__).resolve().parents[2]
    child_env = {**os.environ, **(env or {})}
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), child_env.get("PYTHONPATH", "")) if p)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=child_env)
    if p.returncode != 0:
        raise RuntimeError(f"{engine} run failed (exit {p.returncode}):\n{(p.stdout + p.stderr)[-3000:]}")
    return json.loads(Path(out).read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pageserve.lab.peers", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="one engine over workloads (+ decode timing), JSON to --out")
    r.add_argument("--engine", required=True, choices=sorted(RUNNERS))
    r.add_argument("--model", default="qwen2.5-3b")
    r.add_argument("--device", default="auto")
    r.add_argument("--dtype", default="auto")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--workloads", default='{"w1": {}}', help='JSON {name: builder kwargs}, e.g. {"w1": {"num_requests": 8}}')
    r.add_argument("--decode", default=None, help='JSON {"batches": [1, 64], "context_len": 512, "steps": 64}')
    r.add_argument("--engine-args", default=None, help="JSON keywords of the engine's constructor")
    r.add_argument("--floor", action="store_true", help="also measure read bandwidth and the batch-1 floor")
    r.add_argument("--warmup-requests", type=int, default=32,
                   help="untimed requests of each workload's shape (other ids) before it is timed (0: none)")
    r.add_argument("--passes", type=int, default=1,
                   help="time each workload this many times in a row and keep the median pass (all in 'passes')")
    r.add_argument("--out", required=True)
    s = sub.add_parser("serve-engine", help="vLLM AsyncLLM under Poisson arrivals (engine-level, no HTTP)")
    s.add_argument("--model", default="qwen2.5-3b")
    s.add_argument("--dtype", default="bfloat16")
    s.add_argument("--spec", required=True, help="JSON: rates, duration_s, prompt_len, output_len, seed, engine_args")
    s.add_argument("--out", required=True)
    c = sub.add_parser("config", help="write config.json for vLLM's dummy loader")
    c.add_argument("--model", default="qwen2.5-3b")
    c.add_argument("--dtype", default="bfloat16")
    c.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    if a.cmd == "config":
        print(write_model_dir(a.model, a.out, a.dtype))
        return 0
    if a.cmd == "serve-engine":
        from .serving import vllm_engine_level_sweep

        rec = vllm_engine_level_sweep(a.model, a.dtype, **json.loads(a.spec))
    else:
        rec = run_engine(a.engine, a.model, json.loads(a.workloads), json.loads(a.decode) if a.decode else None,
                         a.device, a.dtype, a.seed, json.loads(a.engine_args) if a.engine_args else None, a.floor,
                         a.warmup_requests, a.passes)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(rec, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
