"""The phase-08 workloads: every engine (pageserve, vLLM, the HF peers) gets the same requests.

All are random token ids (throughput does not depend on what tokens mean), greedy, EOS
ignored, so every request emits exactly its ``max_tokens`` tokens. Each is a pure function of
its arguments and ``seed``: two processes that build ``make_workload("chat", vocab, seed=0)``
get identical requests, which is how engines in separate processes see the same work.

* ``random_len_workload``: vLLM's ``random`` dataset convention. Lengths are uniform integers
  in ``[round(len * (1 - range_ratio)), round(len * (1 + range_ratio))]`` (``range_ratio=0``:
  every request the same shape).
* ``nanovllm_workload``: nano-vllm's ``bench.py`` convention: 256 sequences, prompt and output
  lengths each uniform in ``[100, 1024]``, ignore EOS.
* ``w1_workload``: W1 of phases 02 and 04, 500 requests x 512 prompt tokens -> 256 output.
* ``shared_prefix_workload`` (from ``bench``): a shared system prompt + a per-request suffix,
  for prefix caching. Phase-08 default: 4 system prompts of 1024 tokens, 64-token questions,
  64 output tokens, 128 requests (the 06a shape).
* ``chat_workload``: chat-like lengths with long tails. Prompt and output lengths are
  lognormal, ``exp(N(log(median), sigma))``: defaults median 200 prompt tokens with
  sigma 0.9 (p90 ~ 630, p99 ~ 1,600) and median 150 output tokens with sigma 0.7
  (p90 ~ 370, p99 ~ 770); then clipped to ``[min_len, max_len]`` each and, together, to the
  context ``max_model_len`` (the prompt is shortened first: the output length is the
  request's own ask).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from .bench import BenchRequest, Workload, shared_prefix_workload


def _ids(rng: np.random.Generator, n: int, vocab_size: int, low: int) -> list[int]:
    return rng.integers(low, vocab_size, size=n).tolist() if n > 0 else []


def uniform_lengths(rng: np.random.Generator, n: int, length: int, range_ratio: float) -> np.ndarray:
    """``n`` integers uniform in ``[round(length * (1 - r)), round(length * (1 + r))]`` (at least 1)."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    lo = max(1, int(round(length * (1 - range_ratio))))
    hi = max(lo, int(round(length * (1 + range_ratio))))
    return rng.integers(lo, hi + 1, size=n)


def random_len_workload(
    num_requests: int, input_len: int, output_len: int, vocab_size: int, range_ratio: float = 0.0,
    seed: int = 0, low: int = 0, name: str = "random",
) -> Workload:
    """vLLM's ``random`` dataset: random ids, lengths uniform within ``range_ratio`` of the given."""
    rng = np.random.default_rng(seed)
    ins = uniform_lengths(rng, num_requests, input_len, range_ratio)
    outs = uniform_lengths(rng, num_requests, output_len, range_ratio)
    reqs = [BenchRequest(_ids(rng, int(i), vocab_size, low), int(o)) for i, o in zip(ins, outs)]
    return Workload(name, reqs)


def nanovllm_workload(
    vocab_size: int, num_requests: int = 256, min_len: int = 100, max_len: int = 1024, seed: int = 0,
    low: int = 0, name: str = "nanovllm",
) -> Workload:
    """nano-vllm's benchmark: prompt and output lengths each uniform in ``[min_len, max_len]``."""
    rng = np.random.default_rng(seed)
    ins = rng.integers(min_len, max_len + 1, size=num_requests)
    outs = rng.integers(min_len, max_len + 1, size=num_requests)
    return Workload(name, [BenchRequest(_ids(rng, int(i), vocab_size, low), int(o)) for i, o in zip(ins, outs)])


def w1_workload(vocab_size: int, num_requests: int = 500, prompt_len: int = 512, output_len: int = 256,
                seed: int = 0, low: int = 0, name: str = "w1") -> Workload:
    """W1: ``num_requests`` x ``prompt_len`` random ids -> ``output_len`` tokens each."""
    return random_len_workload(num_requests, prompt_len, output_len, vocab_size, 0.0, seed, low, name)


def lognormal_lengths(rng: np.random.Generator, n: int, median: float, sigma: float, lo: int, hi: int) -> np.ndarray:
    """``n`` integer lengths ``exp(N(log(median), sigma))`` rounded and clipped to ``[lo, hi]``."""
    x = rng.lognormal(math.log(median), sigma, size=n)
    return np.clip(np.rint(x), lo, hi).astype(np.int64)


def chat_workload(
    vocab_size: int, num_requests: int = 1000, prompt_median: float = 200, prompt_sigma: float = 0.9,
    output_median: float = 150, output_sigma: float = 0.7, min_len: int = 4, max_prompt_len: int = 4096,
    max_output_len: int = 1024, max_model_len: int = 4096, seed: int = 0, low: int = 0, name: str = "chat",
) -> Workload:
    """Chat-like traffic: lognormal prompt and output lengths (long tails), see the module docstring.

    Every request fits the context: ``prompt + output <= max_model_len``."""
    rng = np.random.default_rng(seed)
    outs = lognormal_lengths(rng, num_requests, output_median, output_sigma, min_len, min(max_output_len, max_model_len - 1))
    ins = lognormal_lengths(rng, num_requests, prompt_median, prompt_sigma, min_len, max_prompt_len)
    ins = np.maximum(1, np.minimum(ins, max_model_len - outs))
    return Workload(name, [BenchRequest(_ids(rng, int(i), vocab_size, low), int(o)) for i, o in zip(ins, outs)])


def shared_prefix(vocab_size: int, num_requests: int = 128, prefix_len: int = 1024, suffix_len: int = 64,
                  output_len: int = 64, num_prefixes: int = 4, seed: int = 0, low: int = 0,
                  name: str = "shared_prefix") -> Workload:
    """The shared-system-prompt workload with phase-08 defaults (``bench.shared_prefix_workload``)."""
    return shared_prefix_workload(num_requests, prefix_len, suffix_len, output_len, vocab_size, num_prefixes,
                                  seed, low, name)


# name -> builder(vocab_size, **kwargs); the driver and the notebook build workloads by name
WORKLOADS: dict[str, Callable[..., Workload]] = {
    "w1": w1_workload,
    "nanovllm": nanovllm_workload,
    "chat": chat_workload,
    "shared_prefix": shared_prefix,
    "random": lambda vocab_size, num_requests=64, input_len=512, output_len=128, range_ratio=0.0, seed=0, low=0:
        random_len_workload(num_requests, input_len, output_len, vocab_size, range_ratio, seed, low),
}


def make_workload(name: str, vocab_size: int, **kwargs: Any) -> Workload:
    """``WORKLOADS[name](vocab_size, **kwargs)`` with a clear error for an unknown name."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; known: {sorted(WORKLOADS)}")
    return WORKLOADS[name](vocab_size, **kwargs)


@dataclass
class WorkloadSpec:
    """A workload by name and keywords: what crosses a process boundary (as JSON) instead of ids."""

    name: str
    kwargs: dict[str, Any] = field(default_factory=dict)

    def build(self, vocab_size: int) -> Workload:
        return make_workload(self.name, vocab_size, **self.kwargs)
