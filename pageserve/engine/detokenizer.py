"""Incremental detokenization with stop strings, safe to stream.

Decoding one token at a time on its own does not work: a byte-level BPE token can hold
half of a UTF-8 character (decodes to '\\ufffd' until the rest arrives), and
SentencePiece-style tokenizers decode a token differently at the start of a string
than in the middle (the leading-space marker). So each step decodes a short *window*
of recent tokens twice -- ``tokens[prefix_offset:read_offset]`` (already emitted) and
``tokens[prefix_offset:]`` (with the new ones) -- and the new text is what the second
adds to the first. The window only moves forward once its decode ends in a complete
character, so the left context is always clean and the text stays identical to one
decode of the whole output.

Stop strings are searched in the decoded text (they may span tokens). Streaming rule:
``add()`` never returns text that could still turn out to be the start of a stop
string; that tail is held back (``pending_text()``) until resolved, and ``flush()``
returns it at the end. So the concatenation of everything returned is exactly
``text``, and nothing returned is ever cut later.
"""
from __future__ import annotations

from typing import Any

# prompt tokens of left context for the first window: enough for any tokenizer's
# "how does this token decode after a previous one" rule
_PROMPT_CONTEXT = 5


class IncrementalDetokenizer:
    """Turns sampled token ids into stable text, one token at a time.

    ``text``: the output so far (with a matched stop string cut, unless
    ``include_stop_str_in_output``); ``stopped`` / ``stop_reason``: whether and which
    stop string matched. After a match, ``add()`` returns '' for good.
    """

    def __init__(
        self,
        hf_tokenizer: Any,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        stop: str | list[str] | None = None,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self.tokenizer = hf_tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = [stop] if isinstance(stop, str) else list(stop or [])
        self.include_stop_str_in_output = include_stop_str_in_output
        self._max_stop = max((len(s) for s in self.stop), default=0)

        self.token_ids = list(prompt_token_ids)  # prompt + output
        self.prefix_offset = max(len(self.token_ids) - _PROMPT_CONTEXT, 0)
        self.read_offset = len(self.token_ids)
        self._prefix_text = self._decode(self.prefix_offset, self.read_offset)

        self._decoded = ""  # all stable output text, before any stop cut
        self.text = ""
        self._emitted = 0  # characters of ``text`` already returned
        self.stopped = False
        self.stop_reason: str | None = None

    def add(self, token_id: int) -> str:
        """Append one output token; return the text that became safe to emit."""
        if self.stopped:
            return ""
        self.token_ids.append(token_id)
        window = self._decode(self.prefix_offset, len(self.token_ids))
        # an unfinished multi-byte character decodes to U+FFFD: wait for more bytes
        if len(window) > len(self._prefix_text) and not window.endswith("\ufffd"):
            self._append(window[len(self._prefix_text) :])
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
            self._prefix_text = self._decode(self.prefix_offset, self.read_offset)
        return self._release(final=False)

    def flush(self) -> str:
        """At the end of generation: return everything still held back."""
        if not self.stopped and self.read_offset < len(self.token_ids):
            window = self._decode(self.prefix_offset, len(self.token_ids))
            self._append(window[len(self._prefix_text) :])
            self.prefix_offset = self.read_offset = len(self.token_ids)
            self._prefix_text = ""
        return self._release(final=True)

    def pending_text(self) -> str:
        """Decoded text held back because it could be the start of a stop string."""
        return self.text[self._emitted :]

    # ---------------------------------------------------------------- helpers
    def _decode(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        return self.tokenizer.decode(
            self.token_ids[start:end],
            skip_special_tokens=self.skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def _append(self, new: str) -> None:
        old_len = len(self._decoded)
        self._decoded += new
        if self.stop:
            # a new match must end inside the new text
            start = max(0, old_len - self._max_stop + 1)
            best: tuple[int, str] | None = None
            for s in self.stop:
                i = self._decoded.find(s, start)
                if i != -1 and (best is None or i < best[0]):
                    best = (i, s)
            if best is not None:
                i, s = best
                self.text = self._decoded[: i + len(s) if self.include_stop_str_in_output else i]
                self.stopped, self.stop_reason = True, s
                return
        self.text = self._decoded

    def _held_back(self) -> int:
        """Length of the longest tail of ``text`` that begins some stop string."""
        for k in range(min(self._max_stop - 1, len(self.text)), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0

    def _release(self, final: bool) -> str:
        end = len(self.text)
        if not (final or self.stopped):
            end -= self._held_back()
        if end <= self._emitted:
            return ""
        out = self.text[self._emitted : end]
        self._emitted = end
        return out
