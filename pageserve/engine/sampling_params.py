"""Per-request sampling parameters, with OpenAI/vLLM semantics.

Penalties follow the two usual conventions:
  * ``repetition_penalty`` (HF/CTRL style) looks at prompt *and* output tokens and
    divides a positive logit by the penalty, multiplies a negative one;
  * ``presence_penalty`` / ``frequency_penalty`` (OpenAI style) look at output tokens
    only and subtract ``presence * [count > 0] + frequency * count`` from the logit.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .structured_output import StructuredOutputsParams

_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64 finaliser on Python ints (unsigned 64-bit arithmetic)."""
    x &= _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def child_seed(seed: int | None, index: int) -> int | None:
    """The seed of the ``index``-th of ``n`` parallel samples of a request seeded ``seed``.

    ``child_seed(s, 0) == s``, so the first sample of an ``n > 1`` request produces the
    same text as the ``n == 1`` request with the same seed; other indices get distinct,
    well-mixed 63-bit seeds. An unseeded request (``None``) stays unseeded.
    """
    if seed is None:
        return None
    if index == 0:
        return seed
    return _mix64(seed + 0x9E3779B97F4A7C15 * index) >> 1


@dataclass
class SamplingParams:
    """How to pick the next tokens of one request and when to stop.

    ``temperature == 0`` means greedy (argmax of the penalised logits). ``top_k`` of
    -1 or 0 is off (normalised to -1). ``max_tokens=None`` means until the model's
    context is full. ``stop`` is normalised to a list. ``logprobs=k`` asks for the
    sampled token's logprob plus the ``k`` most likely alternatives (``0``: only the
    sampled token's logprob). ``prompt_logprobs=k``: each prompt token's logprob given the
    tokens before it (the model's raw distribution: no penalty, bias or temperature) plus
    the ``k`` most likely alternatives, as vLLM's parameter (the first token has none; a
    request asking for them is never served from the prefix cache). ``logit_bias`` maps token ids to a number in [-100, 100] added
    to their logits before penalties, temperature and truncation, as OpenAI's parameter does
    (-100 in effect bans a token, 100 all but forces it). ``structured_outputs`` keeps the output to a JSON
    schema, a regex, a choice or a grammar (``structured_output.py``; a dict of its fields is taken too).
    As in vLLM: ``allowed_token_ids`` bans every other token; ``bad_words`` never lets the output
    spell one of these words (each tokenized alone and after a space: a word's last token is banned
    where the output already ends with the tokens before it); ``truncate_prompt_tokens=k`` keeps the
    prompt's last k tokens.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    # bad_words as token-id sequences, set by the engine that tokenized them (LLMEngine.add_request)
    _bad_words_ids: list[list[int]] | None = field(default=None, init=False, repr=False, compare=False)
    # allowed_token_ids as mask words for a vocabulary size (Sampler._allowed_words): built once a request
    _allowed_words: tuple | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        def fail(name: str, rule: str) -> None:
            raise ValueError(f"SamplingParams.{name} {rule}, got {getattr(self, name)!r}")

        def is_int(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v) -> bool:
            return (is_int(v) or isinstance(v, float)) and math.isfinite(v)

        if not is_int(self.n) or self.n < 1:
            fail("n", "must be an integer >= 1")
        if not is_num(self.temperature) or self.temperature < 0:
            fail("temperature", "must be a finite number >= 0 (0 = greedy)")
        if not is_num(self.top_p) or not 0 < self.top_p <= 1:
            fail("top_p", "must be in (0, 1]")
        if not is_int(self.top_k) or self.top_k < -1:
            fail("top_k", "must be an integer >= 1, or -1/0 to disable")
        if self.top_k == 0:
            self.top_k = -1
        if not is_num(self.min_p) or not 0 <= self.min_p <= 1:
            fail("min_p", "must be in [0, 1]")
        if not is_num(self.repetition_penalty) or self.repetition_penalty <= 0:
            fail("repetition_penalty", "must be a finite number > 0 (1 = off)")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not is_num(v) or not -2 <= v <= 2:
                fail(name, "must be in [-2, 2]")
        if self.seed is not None and not is_int(self.seed):
            fail("seed", "must be an integer or None")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            fail("max_tokens", "must be an integer >= 1 or None")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            fail("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        if not all(isinstance(s, str) and s for s in self.stop):
            fail("stop", "must be a non-empty string or a list of non-empty strings")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            fail("stop_token_ids", "must be a list of non-negative token ids")
        if self.logprobs is not None and (not is_int(self.logprobs) or self.logprobs < 0):
            fail("logprobs", "must be an integer >= 0 or None")
        if self.prompt_logprobs is not None and (not is_int(self.prompt_logprobs) or self.prompt_logprobs < 0):
            fail("prompt_logprobs", "must be an integer >= 0 or None")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                fail(name, "must be a bool")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                fail("logit_bias", "must be a mapping of token id -> bias")
            if not all(is_int(t) and t >= 0 and is_num(b) and -100 <= b <= 100 for t, b in self.logit_bias.items()):
                fail("logit_bias", "must map non-negative token ids to numbers in [-100, 100]")
            self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()} or None
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.of(self.structured_outputs)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
            if not self.allowed_token_ids or not all(is_int(t) and t >= 0 for t in self.allowed_token_ids):
                fail("allowed_token_ids", "must be a non-empty list of non-negative token ids")
        if self.bad_words is not None:
            self.bad_words = list(self.bad_words)
            if not all(isinstance(w, str) and w.strip() for w in self.bad_words):
                fail("bad_words", "must be a list of non-empty words")
        if self.truncate_prompt_tokens is not None and (not is_int(self.truncate_prompt_tokens)
                                                        or self.truncate_prompt_tokens < 1):
            fail("truncate_prompt_tokens", "must be an integer >= 1 or None")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def needs_landed_outputs(self) -> bool:
        """Its sampling reads the values of all its output tokens on the host, the newest included (bad words
        match their end), so under async scheduling the step before must land first. Penalties count them
        too, but read the newest from the device (``Sampler.sample``'s ``pending``)."""
        return bool(self.bad_words)

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )
