"""Tool calls: how a chat request's calls come out of the text its model generates (``ChatTools``,
by the request's ``tool_choice``), and the parsers that read them from free text for the server's
``--enable-auto-tool-choice --tool-call-parser hermes | llama3_json``.

The "hermes" format is the one the Qwen2.5 and NousResearch Hermes chat templates teach: the
model writes ordinary content, then zero or more blocks of one JSON object each::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

``"name"`` is a string; ``"arguments"`` (some models write ``"parameters"``) is a JSON object.
A block that does not parse is not a call: the non-streaming parser then answers the whole text
as content, and the streaming one sends that block's raw text as content. A final block left
open (the model stopped on EOS before ``</tool_call>``) counts as a call when its JSON parses.

The "llama3_json" format (``Llama3JsonToolParser``) is Llama 3.1-3.3's JSON tool calling: a reply made only of
``{"name": ..., "parameters": {...}}`` objects, optionally after ``<|python_tag|>``, separated by ``;``.
"""
from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .protocol import ChatCompletionRequest


def new_call_id() -> str:
    """An OpenAI-style call id: ``call_`` and 24 hex characters."""
    return "call_" + secrets.token_hex(12)


@dataclass
class ToolCall:
    name: str
    arguments: str  # compact JSON text of an object, "{}" when the model gave none
    id: str = field(default_factory=new_call_id)


def _parse_call(block: str) -> ToolCall | None:
    """The call one block's text (between the tags) holds, or None when it is not a call."""
    try:
        obj = json.loads(block)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters"))
    if isinstance(args, str):  # arguments already written as JSON text, OpenAI-style
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


class HermesToolParser:
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """``(content, calls)`` of a whole generation.

        With no ``<tool_call>`` in it, or any block that is not a call, the answer is
        ``(text, [])``: the text unchanged. Otherwise content is the text outside the blocks,
        stripped (None when empty), with whitespace that ends a stretch after a block dropped,
        as ``HermesStream`` drops it.
        """
        segments: list[str] = []  # the text before each block, then the text after the last
        calls: list[ToolCall] = []
        pos = 0
        while (start := text.find(self.START, pos)) >= 0:
            segments.append(text[pos:start])
            end = text.find(self.END, start + len(self.START))
            block_end = len(text) if end < 0 else end
            call = _parse_call(text[start + len(self.START):block_end])
            if call is None:
                return text, []
            calls.append(call)
            pos = block_end if end < 0 else end + len(self.END)
        if not calls:
            return text, []
        segments.append(text[pos:])
        content = (segments[0] + "".join(s.rstrip() for s in segments[1:])).strip()
        return content or None, calls

    def streamer(self) -> HermesStream:
        return HermesStream()


def held_tag_prefix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that is a proper prefix of ``tag``: what a stream holds
    back until the next delta shows whether a tag starts there (also ``reasoning.py``'s)."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class HermesStream:
    """Incremental parsing of one generation's text deltas.

    ``feed()`` returns the events a delta completes, in order: a ``str`` is content to send now,
    a ``ToolCall`` is a whole call (sent as one delta). Content is held back only while its end
    could be the start of ``<tool_call>``; a block's text is held until ``</tool_call>``. Once a
    call has been sent, whitespace is sent only when more content follows it, so the newlines
    between blocks and after the last one never reach the client. ``finish()`` ends the stream.
    """

    START, END = HermesToolParser.START, HermesToolParser.END

    def __init__(self) -> None:
        self._buf = ""          # text not yet sent: a held tag prefix, or an open block's text
        self._in_block = False
        self._held_ws = ""      # whitespace after a call, sent only if content follows it
        self._saw_calls = False

    @property
    def saw_calls(self) -> bool:
        return self._saw_calls

    def feed(self, delta: str) -> list[str | ToolCall]:
        events: list[str | ToolCall] = []
        self._buf += delta
        while True:
            if self._in_block:
                end = self._buf.find(self.END)
                if end < 0:
                    return events
                block, self._buf = self._buf[:end], self._buf[end + len(self.END):]
                self._in_block = False
                self._close_block(block, self.END, events)
            else:
                start = self._buf.find(self.START)
                if start < 0:
                    keep = held_tag_prefix(self._buf, self.START)
                    self._content(self._buf[:len(self._buf) - keep], events)
                    self._buf = self._buf[len(self._buf) - keep:]
                    return events
                self._content(self._buf[:start], events)
                self._buf = self._buf[start + len(self.START):]
                self._in_block = True

    def finish(self) -> list[str | ToolCall]:
        """The events left at the end: an open block as a call (or its raw text), a held prefix."""
        events: list[str | ToolCall] = []
        if self._in_block:
            self._close_block(self._buf, "", events)
        else:
            self._content(self._buf, events)
        self._buf, self._in_block, self._held_ws = "", False, ""
        return events

    def _close_block(self, block: str, end_tag: str, events: list[str | ToolCall]) -> None:
        call = _parse_call(block)
        if call is None:
            self._content(self.START + block + end_tag, events)
            return
        self._held_ws = ""
        self._saw_calls = True
        events.append(call)

    def _content(self, text: str, events: list[str | ToolCall]) -> None:
        if self._saw_calls:
            text = self._held_ws + text
            sent = text.rstrip()
            self._held_ws = text[len(sent):]
            text = sent
        if text:
            events.append(text)


class Llama3JsonToolParser:
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """``(None, calls)`` when the whole generation is calls, else ``(text, [])``: the text unchanged.

        It is calls when, past leading whitespace and an optional ``<|python_tag|>``, it is one or
        more call objects (``_parse_call``) and nothing else, separated by ``;`` and whitespace. A
        ``;`` left at the end, or any text after an object that is not ``;``, makes it all content.
        """
        calls = _llama3_calls(text)
        return (text, []) if calls is None else (None, calls)

    def streamer(self) -> Llama3JsonStream:
        return Llama3JsonStream()


def _llama3_calls(text: str) -> list[ToolCall] | None:
    """The calls a whole llama3_json reply is made of, or None when it is not calls only."""
    body = text.lstrip()
    if body.startswith(Llama3JsonToolParser.TAG):
        body = body[len(Llama3JsonToolParser.TAG):].lstrip()
    if not body.startswith("{"):
        return None
    decoder = json.JSONDecoder()
    calls: list[ToolCall] = []
    pos = 0
    while True:
        try:
            _, end = decoder.raw_decode(body, pos)  # walks past a ";" inside a string
        except ValueError:
            return None
        call = _parse_call(body[pos:end])
        if call is None:
            return None
        calls.append(call)
        rest = body[end:].lstrip()
        if not rest:
            return calls
        if not rest.startswith(";"):
            return None
        pos = len(body) - len(rest[1:].lstrip())  # raw_decode takes no leading whitespace


class Llama3JsonStream:
    """Incremental parsing of one generation's text deltas, with ``HermesStream``'s events.

    The first non-whitespace text decides: a reply that starts with ``{`` or ``<|python_tag|>`` (or
    could still be the start of the tag) is held whole, and ``finish()`` answers it as its calls, or
    as one content string when it does not parse; any other reply is content, sent as it comes (the
    leading whitespace held before the decision goes with it). So the events always agree with
    ``Llama3JsonToolParser.extract`` on the whole text, and a call reply streams nothing until the end.
    """

    TAG = Llama3JsonToolParser.TAG

    def __init__(self) -> None:
        self._buf = ""            # everything so far, while the reply may be calls
        self._is_content = False  # decided: plain content, passed straight through
        self._saw_calls = False

    @property
    def saw_calls(self) -> bool:
        return self._saw_calls

    def feed(self, delta: str) -> list[str | ToolCall]:
        if self._is_content:
            return [delta] if delta else []
        self._buf += delta
        head = self._buf.lstrip()
        if not head or head.startswith("{") or head.startswith(self.TAG) or self.TAG.startswith(head):
            return []
        self._is_content = True
        text, self._buf = self._buf, ""
        return [text]

    def finish(self) -> list[str | ToolCall]:
        """The events left at the end: a held reply's calls, or its whole text as content."""
        text, self._buf, self._is_content = self._buf, "", False
        if not text:
            return []
        calls = _llama3_calls(text)
        if calls is None:
            return [text]
        self._saw_calls = True
        return calls


TOOL_PARSERS: dict[str, type] = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}


def call_json(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    """A tool call as OpenAI's message (``index``: as a streamed delta's)."""
    out: dict[str, Any] = {} if index is None else {"index": index}
    return {**out, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def compact_json(text: str) -> str | None:
    try:
        return json.dumps(json.loads(text), ensure_ascii=False)
    except ValueError:
        return None


class ChatTools:
    """How a chat request's tool calls come out of its generated text, by its tool mode:

    * ``none``: the text is the content;
    * ``auto``: the server's tool-call parser splits the text into content and calls;
    * ``named``: the text is the named function's arguments (its schema constrained it), compacted when
      whole; cut short by ``max_tokens``, the call still comes, with the text as it stands (as vLLM);
    * ``required``: the text is a JSON array of ``{"name", "parameters"}`` (``required_calls_schema``);
      cut short, it does not parse and is answered as content, without calls."""

    def __init__(self, body: "ChatCompletionRequest", parser) -> None:
        self.mode, self.function = body.tool_mode()
        if self.mode == "auto" and parser is None:
            raise ValueError('tool_choice "auto" (the default with tools) needs the server started with '
                             '--enable-auto-tool-choice and --tool-call-parser; or send tool_choice "required", '
                             '"none" or a named function')
        self.parser = parser

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole choice's text."""
        if self.mode == "auto":
            return self.parser.extract(text)
        if self.mode == "named":
            return None, [ToolCall(self.function.name, compact_json(text) or text)]
        if self.mode == "required":
            try:
                items = json.loads(text)
                return None, [ToolCall(i["name"], json.dumps(i["parameters"], ensure_ascii=False)) for i in items]
            except (ValueError, TypeError, KeyError):
                return text, []
        return text, []

    def finish_reason(self, reason: str | None, has_calls: bool) -> str | None:
        """"tool_calls" where the model chose to call (auto, required) and ended on its own, as OpenAI."""
        if has_calls and reason == "stop" and self.mode in ("auto", "required"):
            return "tool_calls"
        return reason

    def stream(self) -> "ToolStream":
        return ToolStream(self)


class ToolStream:
    """One streamed choice's deltas under its request's tool mode: content as it comes (auto: what the
    parser lets through; a call as one delta once whole); named: the arguments as they come, in a call
    delta; required: the calls at the end."""

    def __init__(self, tools: ChatTools) -> None:
        self.tools = tools
        self.parser_stream = tools.parser.streamer() if tools.mode == "auto" else None
        self.text = ""  # required: the whole text, parsed at the end
        self.num_calls = 0
        self.call_id: str | None = None  # named: the call's id, sent with its first delta

    @property
    def saw_calls(self) -> bool:
        return self.num_calls > 0

    def feed(self, text: str, finished: bool) -> dict[str, Any]:
        """The delta for this much more text (``finished``: the choice's last)."""
        mode = self.tools.mode
        if mode == "none":
            return {"content": text} if text else {}
        if mode == "named":
            if not text:
                return {}
            call: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
            if self.call_id is None:
                self.call_id = new_call_id()
                call = {"index": 0, "id": self.call_id, "type": "function",
                        "function": {"name": self.tools.function.name, "arguments": text}}
                self.num_calls = 1
            return {"tool_calls": [call]}
        if mode == "required":
            self.text += text
            if not finished:
                return {}
            content, calls = self.tools.parse(self.text)
            events: list = [content] if content else []
            events += calls
        else:
            events = self.parser_stream.feed(text)
            if finished:
                events += self.parser_stream.finish()
        delta: dict[str, Any] = {}
        content = "".join(e for e in events if isinstance(e, str))
        if content:
            delta["content"] = content
        calls = [e for e in events if isinstance(e, ToolCall)]
        if calls:
            delta["tool_calls"] = [call_json(c, self.num_calls + i) for i, c in enumerate(calls)]
            self.num_calls += len(calls)
        return delta
