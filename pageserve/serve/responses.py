"""OpenAI's Responses API (``POST /v1/responses``) on top of the chat route, as vLLM serves it.

A request is rewritten as a chat request (``ResponsesRequest.to_chat_request``): ``instructions`` become a
system message, ``input`` (a string, or a list of message / ``function_call`` / ``function_call_output``
items) the messages, the flat function ``tools`` the chat's, ``text.format`` its ``response_format``,
``max_output_tokens`` its ``max_tokens``. It then runs exactly as a chat request (template, structured
outputs, tool choice and the tool-call parser); its text becomes the response's ``output``: one
``message`` item with the text, then one ``function_call`` item a call.

Streamed, the response is OpenAI's event sequence (``ResponseEvents``): ``response.created``,
``response.in_progress``, per item ``response.output_item.added`` … ``response.output_item.done`` with the
text deltas (``response.output_text.delta``) or the call's arguments (``response.function_call_arguments.delta``)
between, and ``response.completed`` (``response.incomplete`` when ``max_output_tokens`` cut it short).

With the server's ``--reasoning-parser``, a thinking model's ``<think>`` part comes out as a ``reasoning``
item before the message (streamed as ``response.reasoning_text.delta``); ``reasoning`` items in the input
(an earlier turn's, handed back) are dropped, as chat templates drop earlier reasoning.

Nothing is stored: ``previous_response_id`` and ``background`` are refused with a 400, as are built-in
tools (web search, file search, ...), non-text input parts, ``truncation="auto"`` and ``top_logprobs``.
"""
from __future__ import annotations

import uuid
from typing import Any, Union

from pydantic import BaseModel, ConfigDict, ValidationError

from .protocol import ChatCompletionRequest


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_of(content: Any) -> str:
    """A message item's content as text: a string, or its text parts joined."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise ValueError("an input message's content must be a string or a list of content parts")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text"):
            raise ValueError(f"input content parts of type {kind!r} are not supported (only text)")
        texts.append(part.get("text") or "")
    return "".join(texts)


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: Union[str, list[dict[str, Any]]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    structured_outputs: dict[str, Any] | None = None  # vLLM's extension, as on the chat route
    metadata: dict[str, Any] | None = None
    user: str | None = None
    store: bool | None = None  # accepted; nothing is stored (the response says store false)
    truncation: str | None = None
    top_logprobs: int | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    priority: int = 0  # vLLM's, as on the chat route
    cache_salt: str | None = None  # vLLM's, as on the chat route

    def _refuse_unsupported(self) -> None:
        if self.previous_response_id is not None:
            raise ValueError("previous_response_id is not supported: this server stores no responses; "
                             "send the whole conversation as input")
        if self.background:
            raise ValueError("background responses are not supported")
        if self.truncation not in (None, "disabled"):
            raise ValueError(f"truncation {self.truncation!r} is not supported (only 'disabled')")
        if self.top_logprobs:
            raise ValueError("top_logprobs is not supported on /v1/responses (use /v1/chat/completions)")

    def messages(self) -> list[dict[str, Any]]:
        """The conversation as chat messages (consecutive function calls in one assistant message)."""
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            return messages + [{"role": "user", "content": self.input}]
        for item in self.input:
            kind = item.get("type", "message")
            if kind == "message":
                role = item.get("role")
                if role not in ("user", "assistant", "system", "developer"):
                    raise ValueError(f"an input message's role must be user, assistant, system or developer, got {role!r}")
                messages.append({"role": "system" if role == "developer" else role, "content": _text_of(item.get("content"))})
            elif kind == "function_call":
                call = {"id": item.get("call_id"), "type": "function",
                        "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                    last["tool_calls"].append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif kind == "reasoning":
                continue  # an earlier turn's reasoning, handed back by the client: templates drop it
            elif kind == "function_call_output":
                output = item.get("output")
                messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                                 "content": output if isinstance(output, str) else _text_of(output)})
            else:
                raise ValueError(f"input items of type {kind!r} are not supported "
                                 "(message, function_call and function_call_output are)")
        return messages

    def chat_tools(self) -> tuple[list[dict[str, Any]] | None, Any]:
        """The flat Responses tools and tool choice in the chat route's nested form."""
        tools = None
        if self.tools:
            tools = []
            for t in self.tools:
                if t.get("type") != "function":
                    raise ValueError(f"tools of type {t.get('type')!r} are not supported (only function tools)")
                tools.append({"type": "function", "function": {
                    k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}})
        choice = self.tool_choice
        if isinstance(choice, dict):
            if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
                raise ValueError('tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}')
            choice = {"type": "function", "function": {"name": choice["name"]}}
        return tools, choice

    def response_format(self) -> dict[str, Any] | None:
        fmt = (self.text or {}).get("format")
        if fmt is None:
            return None
        kind = fmt.get("type", "text")
        if kind == "json_schema":  # flat here, nested under json_schema in the chat route
            return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema")}}
        return {"type": kind}

    def to_chat_request(self) -> ChatCompletionRequest:
        """This request as the chat route's (raises ``ValueError`` for what it cannot carry)."""
        self._refuse_unsupported()
        tools, choice = self.chat_tools()
        body = {"model": self.model, "messages": self.messages(), "stream": self.stream,
                "max_tokens": self.max_output_tokens, "temperature": self.temperature, "top_p": self.top_p,
                "tools": tools, "tool_choice": choice, "response_format": self.response_format(), "user": self.user,
                "structured_outputs": self.structured_outputs, "priority": self.priority,
                "cache_salt": self.cache_salt}
        try:
            return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(x) for x in first.get("loc", ()))
            raise ValueError(f"{where}: {first.get('msg')}") from None

    def response(self, rid: str, created: int, model: str, output: list[dict[str, Any]], finish_reason: str | None,
                 usage: dict[str, int] | None, status: str | None = None) -> dict[str, Any]:
        """The response object: the request's settings echoed, ``output`` and ``usage`` (chat usage)."""
        if status is None:
            status = "incomplete" if finish_reason == "length" else "completed"
        return {
            "id": rid, "object": "response", "created_at": created, "model": model, "status": status,
            "output": output, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
            "metadata": self.metadata or {}, "parallel_tool_calls": True, "previous_response_id": None,
            "store": False, "temperature": self.temperature, "top_p": self.top_p,
            "text": self.text or {"format": {"type": "text"}}, "tool_choice": self.tool_choice or "auto",
            "tools": self.tools or [], "truncation": "disabled", "user": self.user,
            "usage": None if usage is None else responses_usage(usage),
        }


def responses_usage(usage: dict[str, Any]) -> dict[str, Any]:
    return {"input_tokens": usage["prompt_tokens"], "input_tokens_details": usage["prompt_tokens_details"],
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": usage.get("completion_tokens_details") or {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"]}


def message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
    return {"type": "message", "id": item_id or _new_id("msg"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def call_item(call_id: str, name: str, arguments: str, status: str = "completed",
              item_id: str | None = None) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id or _new_id("fc"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def reasoning_item(text: str, status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id or _new_id("rs"), "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def output_items(content: str | None, calls: list, reasoning: str | None = None) -> list[dict[str, Any]]:
    """A finished text's output: its reasoning (the server's ``--reasoning-parser``), its message (when there
    is text, or nothing else), then its calls."""
    items = [reasoning_item(reasoning)] if reasoning else []
    if content or not (calls or reasoning):
        items.append(message_item(content or ""))
    return items + [call_item(c.id, c.name, c.arguments) for c in calls]


# per text item kind: its events' names (OpenAI's) and how an item of it starts
_TEXT_ITEMS = {"content": ("output_text", message_item), "reasoning_content": ("reasoning_text", reasoning_item)}


class ResponseEvents:
    """A streamed response's events from the chat route's deltas (``tools.ToolStream.feed``, with the
    reasoning parser's ``reasoning_content``): a reasoning or message item opens with its first text, a call
    item with its call's first delta (the one with its id)."""

    def __init__(self, request: ResponsesRequest, rid: str, created: int, model: str) -> None:
        self.request, self.rid, self.created, self.model = request, rid, created, model
        self.seq = 0
        self.items: list[dict[str, Any]] = []  # in output order, filled as they stream
        self.texts: dict[str, dict[str, Any]] = {}  # the open reasoning / message item, by its delta key
        self.calls: dict[int, dict[str, Any]] = {}  # by the chat delta's call index

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def start(self) -> list[dict[str, Any]]:
        shell = self.request.response(self.rid, self.created, self.model, [], None, None, status="in_progress")
        return [self._event("response.created", response=shell), self._event("response.in_progress", response=shell)]

    def delta(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        events = []
        for key, (kind, make) in _TEXT_ITEMS.items():
            text = delta.get(key)
            if not text:
                continue
            item = self.texts.get(key)
            if item is None:
                item = self.texts[key] = make("", status="in_progress")
                self.items.append(item)
                events.append(self._event("response.output_item.added", output_index=len(self.items) - 1,
                                          item=dict(item, content=[])))
                events.append(self._event("response.content_part.added", item_id=item["id"],
                                          output_index=len(self.items) - 1, content_index=0,
                                          part=dict(item["content"][0])))
            item["content"][0]["text"] += text
            extra = {"logprobs": []} if kind == "output_text" else {}
            events.append(self._event(f"response.{kind}.delta", item_id=item["id"],
                                      output_index=self.items.index(item), content_index=0, delta=text, **extra))
        for tc in delta.get("tool_calls") or []:
            item = self.calls.get(tc["index"])
            if item is None:
                item = self.calls[tc["index"]] = call_item(tc["id"], tc["function"]["name"], "", status="in_progress")
                self.items.append(item)
                events.append(self._event("response.output_item.added", output_index=len(self.items) - 1,
                                          item=dict(item)))
            args = tc["function"].get("arguments") or ""
            if args:
                item["arguments"] += args
                events.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                          output_index=self.items.index(item), delta=args))
        return events

    def finish(self, finish_reason: str | None, usage: dict[str, int]) -> list[dict[str, Any]]:
        events = []
        status = "incomplete" if finish_reason == "length" else "completed"
        for index, item in enumerate(self.items):
            item["status"] = status
            if item["type"] in ("message", "reasoning"):
                part = item["content"][0]
                extra = {"logprobs": []} if part["type"] == "output_text" else {}
                events.append(self._event(f"response.{part['type']}.done", item_id=item["id"], output_index=index,
                                          content_index=0, text=part["text"], **extra))
                events.append(self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                          content_index=0, part=dict(part)))
            else:
                events.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                          output_index=index, name=item["name"], arguments=item["arguments"]))
            events.append(self._event("response.output_item.done", output_index=index, item=dict(item)))
        if not self.items:  # no text at all: the response still has its (empty) message, as output_items gives
            self.items.append(message_item("", status=status))
        final = self.request.response(self.rid, self.created, self.model, self.items, finish_reason, usage)
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        return events + [self._event(kind, response=final)]

    def error(self, message: str, code: str | None = None) -> dict[str, Any]:
        return self._event("error", message=message, code=code, param=None)
