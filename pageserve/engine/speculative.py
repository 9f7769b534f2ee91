"""Speculative decoding with n-gram drafts ("prompt lookup"), as vLLM's
``--speculative-config '{"method": "ngram", "num_speculative_tokens": 3}'``.

Each step a decoding sequence looks for its last n tokens (n from ``prompt_lookup_max`` down to
``prompt_lookup_min``) earlier in its prompt and output; where they occurred, the tokens that followed
become up to ``num_speculative_tokens`` drafts. The step computes the sequence's newest token and its
d drafts as one chunk of d + 1 tokens, with logits at every one of them, and the sampler draws a token
at each of the d + 1 positions exactly as plain decoding would have drawn it at that output step (the
same logit processing; the same seeded draw, since row j is output step ``num_outputs + j``).

Acceptance: drafts are kept while the drawn token equals the draft; the first drawn token that differs,
or the one drawn after the last draft, is emitted too. So a step emits 1 to d + 1 tokens, and each one
is a draw from the model's distribution given exactly the tokens emitted before it (the accepted drafts
are those tokens): the output has the model's distribution, not the drafter's. With a one-token draft
(probability 1 on it) this is rejection sampling's rule: accept with p(draft), else draw from p with
the draft removed. Greedy rows take the argmax at every position, so their text is plain decoding's, up
to the rounding of a (d + 1)-token chunk against one-token steps (bit for bit with ``deterministic=True``,
whose logits do not depend on how a sequence's tokens are split into steps).

Which rows draft: decoding sequences with room for at least one draft under ``max_tokens`` and
``max_model_len``. Penalties are applied per row as plain decoding would: row j counts the output with the
first j drafts appended (``DraftHistory``), so the penalised rows Qwen2.5-Instruct's generation_config gives
every request draft too. A guided row's drafts are cut where its grammar would reject one, and row j's mask is
the grammar's after the first j drafts (a copy of the matcher advanced through them).
The engine runs steps synchronously while speculating: the drafts are looked up on the host from tokens the
host must already have.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

METHODS = ("ngram",)


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 3  # drafts a sequence may propose a step
    prompt_lookup_max: int = 4  # the longest suffix looked up
    prompt_lookup_min: int = 2  # the shortest (a 1-token match drafts a lot and is often wrong)
    # no drafts in a step that runs this many sequences or more (None: always draft): where the batch is large
    # the step is bound by compute, and draft tokens that are rejected are paid for at full price
    disable_by_batch_size: int | None = None

    @classmethod
    def parse(cls, spec: dict | None) -> "SpeculativeConfig | None":
        """``EngineConfig.speculative_config`` checked (raises ``ValueError`` naming what is wrong)."""
        if spec is None:
            return None
        if not isinstance(spec, dict):
            raise ValueError(f"speculative_config must be a dict (JSON object), got {type(spec).__name__}")
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(spec) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown}; known: {sorted(known)}")
        if "method" not in spec:
            raise ValueError(f"speculative_config needs a method; supported: {list(METHODS)}")
        cfg = cls(**spec)
        if cfg.method not in METHODS:
            raise ValueError(f"speculative_config: method {cfg.method!r} is not supported; supported: {list(METHODS)}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            v = getattr(cfg, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"speculative_config: {name} must be an integer >= 1, got {v!r}")
        if cfg.prompt_lookup_min > cfg.prompt_lookup_max:
            raise ValueError(f"speculative_config: prompt_lookup_min ({cfg.prompt_lookup_min}) is more than "
                             f"prompt_lookup_max ({cfg.prompt_lookup_max})")
        d = cfg.disable_by_batch_size
        if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d < 1):
            raise ValueError(f"speculative_config: disable_by_batch_size must be an integer >= 1 or null, got {d!r}")
        return cfg


def propose_ngram(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> np.ndarray:
    """Up to ``k`` draft tokens for a sequence whose tokens so far are ``tokens`` (1-D): the longest suffix of
    ``n_max``..``n_min`` tokens that occurred before (not as the suffix itself) proposes what followed it.
    Among its earlier occurrences, the most recent one followed by ``k`` tokens, else the earliest (the one
    followed by the most). Empty when no suffix recurs."""
    L = tokens.shape[0]
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        suffix = tokens[L - n:]
        # windows starting at p = 0 .. L - 1 - n, so every match has a next token (p + n <= L - 1)
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:L - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            full = hits[hits + n + k <= L]
            p = int(full[-1] if full.size else hits[0]) + n
            return tokens[p:p + k]
    return tokens[:0]


def can_draft(seq, max_model_len: int) -> int:
    """How many drafts ``seq`` may take this step: 0 unless it is decoding (its newest token on the host and
    not yet computed); else the room left under max_tokens and max_model_len for the d + 1 tokens a step may
    emit."""
    p = seq.params
    if seq.num_pending:
        return 0
    if seq.num_tokens - seq.num_computed_tokens != 1 or not seq.output_token_ids:
        return 0
    room = max_model_len - seq.num_tokens - 1
    if p.max_tokens is not None:
        room = min(room, p.max_tokens - seq.num_output_tokens - 1)
    return max(room, 0)


class NgramProposer:
    """Looks up each decoding sequence's drafts before a step is scheduled (``Sequence.spec_token_ids``)."""

    def __init__(self, cfg: SpeculativeConfig) -> None:
        self.cfg = cfg

    def propose(self, running, max_model_len: int) -> None:
        cfg = self.cfg
        off = cfg.disable_by_batch_size is not None and len(running) >= cfg.disable_by_batch_size
        for seq in running:
            room = 0 if off else min(can_draft(seq, max_model_len), cfg.num_speculative_tokens)
            if room <= 0:
                seq.spec_token_ids = []
                continue
            h = seq.token_history()
            tokens = np.concatenate([h.prompt(), h.output()])
            drafts = propose_ngram(tokens, room, cfg.prompt_lookup_min, cfg.prompt_lookup_max).tolist()
            if drafts and seq.matcher is not None:  # only what the grammar accepts: later rows need its states
                drafts = drafts[:seq.matcher.validate_tokens(drafts)]
            seq.spec_token_ids = drafts


class DraftHistory:
    """A drafting row's ids for the sampler's penalties: its sequence's prompt, and its output with the first j
    drafts appended (what plain decoding's history would be at that output step)."""

    __slots__ = ("_history", "_drafts")

    def __init__(self, history, drafts: list[int]) -> None:
        self._history, self._drafts = history, drafts

    def prompt(self) -> np.ndarray:
        return self._history.prompt()

    def output(self) -> np.ndarray:
        return np.concatenate([self._history.output(), np.asarray(self._drafts, dtype=np.int64)])


def accepted_prefix(drawn: list[int], drafts: list[int]) -> int:
    """How many leading drafts the drawn tokens confirm (``drawn[j] == drafts[j]``)."""
    n = 0
    for t, d in zip(drawn, drafts):
        if t != d:
            break
        n += 1
    return n
