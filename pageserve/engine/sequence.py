"""A request's sequence: plain counters with derived properties.

The one scheduling rule: each step a sequence's ``num_computed_tokens`` (tokens whose K/V
are in the cache) catches up with its ``num_tokens`` (prompt + generated) under the
step's token budget. Under async scheduling a generated token counts as soon as its step
is launched (``num_pending``), before its value reaches the host. A prompt chunk, a prefix-cache hit, a decode and a recompute after
preemption are all that same move; a sequence samples a new token exactly when a step
brings ``num_computed_tokens`` up to ``num_tokens``.
"""
from __future__ import annotations

import enum
import itertools
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from .sampling_params import SamplingParams
    from .lora import LoRARequest

_seq_ids = itertools.count()


class TokenHistory:
    """A sequence's prompt and output ids as int64 arrays, for the sampler's penalties.

    The prompt's array is built once; the output's grows by the ids appended to the list since the
    last call (``Sequence.output_token_ids`` is append-only), into a buffer that doubles when full.
    So a penalised row costs the sampler two array copies a step, not a walk of its whole history
    as Python ints (at 256 rows of 512 + 128 tokens: ~0.3 ms against ~9 ms on a CPU core)."""

    __slots__ = ("_prompt_ids", "_output_ids", "_prompt", "_out", "_n")

    def __init__(self, prompt_ids: list[int], output_ids: list[int]) -> None:
        self._prompt_ids, self._output_ids = prompt_ids, output_ids
        self._prompt: np.ndarray | None = None
        self._out = np.empty(0, dtype=np.int64)
        self._n = 0

    def prompt(self) -> np.ndarray:
        if self._prompt is None:
            self._prompt = np.asarray(self._prompt_ids, dtype=np.int64).reshape(-1)
        return self._prompt

    def output(self) -> np.ndarray:
        ids, n = self._output_ids, len(self._output_ids)
        if n < self._n:  # not append-only after all: start over
            self._n = 0
        if n > len(self._out):
            grown = np.empty(max(n, 2 * len(self._out), 16), dtype=np.int64)
            grown[: self._n] = self._out[: self._n]
            self._out = grown
        if n > self._n:
            self._out[self._n : n] = ids[self._n : n]
            self._n = n
        return self._out[:n]


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """One generated continuation of a prompt (a request with ``n > 1`` owns n of them).

    Invariants: ``0 <= num_computed_tokens <= num_tokens``; while
    running, ``block_table`` holds ``ceil(num_computed_tokens / block_size)`` blocks or
    more (blocks for a scheduled chunk are allocated before the step runs).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: "SamplingParams",
        index: int = 0,
        seed: int | None = None,
        arrival_time: float = 0.0,
        priority: int = 0,
        lora_request: "LoRARequest | None" = None,
        cache_salt: str | None = None,
    ) -> None:
        self.seq_id = next(_seq_ids)
        self.request_id = request_id
        self.index = index  # which of the request's n completions
        self.prompt_token_ids = prompt_token_ids
        self.output_token_ids: list[int] = []
        self._token_history: TokenHistory | None = None
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.seed = seed
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
        self.stop_reason: int | str | None = None  # the stop token id or stop string that ended it

        self.num_pending = 0  # tokens sampled by launched steps whose values the host has not read yet
        self.matcher = None  # llguidance's state of its structured-output constraint (structured_output.py)
        self.pending_row = -1  # the row of the newest pending token in its step's sampled-token tensor
        self.length_capped = False  # its pending tokens reach max_tokens / max_model_len: schedule no more
        self.spec_token_ids: list[int] = []  # speculative decoding's drafts for the next step (engine/speculative.py)
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.num_cached_tokens = 0  # prompt tokens its first admission found in the prefix cache
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # chain hashes of the full blocks of the tokens, computed lazily
        self.num_registered_blocks = 0  # leading blocks of block_table already published in the prefix cache

        self.logprobs: list[dict[int, float]] | None = None
        # params.prompt_logprobs: position i -> {prompt token i: logprob, top ids: logprob}, i >= 1
        self.prompt_logprobs: dict[int, dict[int, float]] = {}
        self.cumulative_logprob = 0.0
        self.arrival_time = arrival_time
        self.priority = priority  # the priority scheduling policy's: lower runs first
        self.lora_request = lora_request  # its LoRA adapter (engine/lora.py); None: the base model
        self.lora_id = None if lora_request is None else lora_request.lora_int_id
        # the root of its block-hash chain: other K/V under another adapter, so no prefix hit across adapters, nor
        # across cache salts (vLLM's cache_salt: a tenant's cached prompts are not found by another's)
        self.cache_root = 0 if lora_request is None else lora_request.cache_key
        if cache_salt is not None:
            self.cache_root = hash(("salt", self.cache_root, cache_salt))
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.token_times: list[float] = []  # when each output token was appended
        self.num_preemptions = 0
        self.detokenizer: Any = None  # IncrementalDetokenizer when text is produced incrementally
        self.text = ""

    # ------------------------------------------------------------------ derived counts
    @property
    def num_tokens(self) -> int:
        """Prompt + generated tokens, pending ones included (what the scheduler plans with)."""
        return self.num_prompt_tokens + len(self.output_token_ids) + self.num_pending

    @property
    def num_known_tokens(self) -> int:
        """Prompt + generated tokens whose values the host has."""
        return self.num_prompt_tokens + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids) + self.num_pending

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def token_at(self, i: int) -> int:
        p = self.num_prompt_tokens
        return self.prompt_token_ids[i] if i < p else self.output_token_ids[i - p]

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens ``start:end`` of prompt + output without concatenating the two lists."""
        p = self.num_prompt_tokens
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_history(self) -> TokenHistory:
        """Its ids as arrays for the sampler's penalties (made on first use, then kept up to date)."""
        if self._token_history is None:
            self._token_history = TokenHistory(self.prompt_token_ids, self.output_token_ids)
        return self._token_history

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, req={self.request_id!r}, status={self.status.value}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens}, blocks={len(self.block_table)})"
        )
