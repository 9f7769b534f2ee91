"""Reasoning parsers: a thinking model's ``<think>…</think>`` part split from its answer, for the server's
``--reasoning-parser`` (the chat route then answers ``reasoning_content`` beside ``content``, as vLLM does).

* ``qwen3``: Qwen3 writes ``<think>`` itself when it thinks (its template puts an empty think block in
  the prompt when thinking is off), so only a reply that starts with ``<think>`` has reasoning.
* ``deepseek_r1``: DeepSeek-R1's template opens the think block in the prompt, so everything before
  ``</think>`` is reasoning (a leading ``<think>`` is dropped if the model writes one anyway).

A reply cut short inside its reasoning (no ``</think>`` yet) is all reasoning, with no content.
"""
from __future__ import annotations

from .tools import held_tag_prefix

START, END = "<think>", "</think>"


class ThinkParser:
    """``split`` a whole reply; ``streamer`` for one streamed reply."""

    def __init__(self, needs_start_tag: bool) -> None:
        self.needs_start_tag = needs_start_tag

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole reply; either None when empty or absent."""
        body = text.lstrip()
        if body.startswith(START):
            body = body[len(START):]
        elif self.needs_start_tag:
            return None, text
        else:
            body = text
        reasoning, end, content = body.partition(END)
        if not end:  # cut short while thinking
            return reasoning.strip() or None, None
        return reasoning.strip() or None, content.lstrip() or None

    def streamer(self) -> "ThinkStream":
        return ThinkStream(self.needs_start_tag)


class ThinkStream:
    """``feed(delta) -> (reasoning, content)`` text to send now; ``finish()`` what is held at the end.
    Text is held back only while it could still be the start of a tag."""

    def __init__(self, needs_start_tag: bool) -> None:
        self.mode = "start"  # "start": the reply's opening not yet known; "think"; "answer"
        self.needs_start_tag = needs_start_tag
        self.buf = ""
        self.answer_started = False  # answer text has been sent (the newlines that open it after </think> are dropped)

    def feed(self, delta: str) -> tuple[str, str]:
        self.buf += delta
        reasoning = content = ""
        if self.mode == "start":
            body = self.buf.lstrip()
            if body.startswith(START):
                self.mode, self.buf = "think", body[len(START):]
            elif START.startswith(body):  # "", "<", "<th"...: not yet known
                return "", ""
            elif self.needs_start_tag:  # no reasoning: the reply is all answer, sent as it is
                self.mode, self.answer_started = "answer", True
            else:
                self.mode = "think"
        if self.mode == "think":
            head, end, rest = self.buf.partition(END)
            if end:
                reasoning, self.mode, self.buf = head, "answer", rest
            else:
                keep = held_tag_prefix(self.buf, END)
                reasoning, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                return reasoning, ""
        if self.mode == "answer":
            content, self.buf = self.buf, ""
            if not self.answer_started:
                content = content.lstrip()
                self.answer_started = bool(content)
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is held at the end: a partial tag that never completed is text of the part it was in."""
        held, self.buf = self.buf, ""
        if self.mode == "think":
            return held, ""
        if self.mode == "start":  # only a part of "<think>" ever came
            return ("", held) if self.needs_start_tag else (held, "")
        return "", held if self.answer_started else held.lstrip()


def reasoning_token_count(parser: ThinkParser, decode, token_ids: list[int]) -> int:
    """How many of a reply's tokens are its reasoning (OpenAI's ``reasoning_tokens``): those up to the one that
    completes ``</think>``; all of them for a reply cut short while thinking; none for a reply without a think part.
    ``decode(ids) -> text`` as the reply's text was decoded (the tag may span several tokens)."""
    if not token_ids:
        return 0
    text = decode(token_ids)
    if END not in text:
        reasoning, _ = parser.split(text)
        thinking = text.lstrip().startswith(START) or not parser.needs_start_tag
        return len(token_ids) if thinking and reasoning is not None else 0
    if parser.needs_start_tag and not text.lstrip().startswith(START):
        return 0
    lo, hi = 1, len(token_ids)  # the shortest prefix whose text holds the end tag
    while lo < hi:
        mid = (lo + hi) // 2
        if END in decode(token_ids[:mid]):
            hi = mid
        else:
            lo = mid + 1
    return lo


REASONING_PARSERS = {"qwen3": lambda: ThinkParser(needs_start_tag=True),
                     "deepseek_r1": lambda: ThinkParser(needs_start_tag=False)}
