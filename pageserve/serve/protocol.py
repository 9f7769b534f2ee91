"""The OpenAI wire format: request models (unknown fields ignored), errors, and the mapping
from a request onto ``SamplingParams``.

Requests are parsed leniently where OpenAI is lenient (``stop`` as a string or a list,
``max_completion_tokens`` beside the older ``max_tokens``) and carry the usual extensions of
open servers: ``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``,
``stop_token_ids``, ``skip_special_tokens``, ``include_stop_str_in_output``, ``allowed_token_ids``,
``bad_words``, ``truncate_prompt_tokens``; and vLLM's ``use_beam_search`` (``n`` beams, with
``length_penalty``; ``engine/beam_search.py``). A sampling field the
request leaves unset takes the model's generation_config.json default when the engine has one
(``EngineConfig.generation_config``), as vLLM's server does.

Structured outputs (``engine/structured_output.py``): OpenAI's ``response_format`` (``json_object``,
``json_schema``), vLLM's ``structured_outputs`` object (``json``, ``regex``, ``choice``, ``grammar``,
``json_object``) and its older ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``
fields; one of them a request.

Tools (chat only): ``tools`` reach the chat template; ``tool_choice`` ``"required"`` or a named function
is a structured-output constraint over the tools' parameter schemas, as in vLLM; ``"auto"`` parses the
model's text with the server's ``--tool-call-parser`` (``tools.py``) and needs
``--enable-auto-tool-choice``; ``"none"`` generates plain text.

OpenAI features this server does not have are refused with a 400 that names them, not ignored:
the legacy ``functions`` / ``function_call`` (use ``tools``), ``suffix``.
"""
from __future__ import annotations

import json
from typing import Any, Literal, Mapping, Union

from pydantic import BaseModel, ConfigDict, Field

from pageserve.engine.beam_search import BeamSearchParams
from pageserve.engine.sampling_params import SamplingParams
from pageserve.engine.structured_output import StructuredOutputsParams

MAX_TOP_LOGPROBS = 20


class OpenAIError(Exception):
    """An error the API answers with ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries the usage so far


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    max_tokens: int | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    logit_bias: dict[str, float] | None = None  # token id (a JSON key, so a string) -> bias in [-100, 100]
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    priority: int = 0  # vLLM's: lower runs first; needs --scheduling-policy priority unless 0
    # vLLM's: requests with different salts never share prefix-cache blocks (multi-tenant privacy)
    cache_salt: str | None = None
    user: str | None = None
    # vLLM's beam search: n beams, ranked by the model's log-probabilities (engine/beam_search.py)
    use_beam_search: bool = False
    length_penalty: float = 1.0
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's extension, and its older names below
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # refused (see the module docstring): a request that relies on them must not get an unconstrained
    # answer that looks like a success
    functions: list[Any] | None = None
    function_call: Any = None

    def structured(self) -> StructuredOutputsParams | None:
        """The request's output constraint, from whichever field gives it (raises ``ValueError`` for
        more than one, an unknown ``response_format`` type, or a malformed constraint)."""
        given = {}
        kind = (self.response_format or {}).get("type", "text")
        if kind == "json_object":
            given["response_format"] = {"json_object": True}
        elif kind == "json_schema":
            spec = self.response_format.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                raise ValueError("response_format json_schema needs json_schema.schema, a JSON schema object")
            given["response_format"] = {"json": spec["schema"]}
        elif kind != "text":
            raise ValueError(f"response_format type {kind!r} is not supported; "
                             "use 'text', 'json_object' or 'json_schema'")
        if self.structured_outputs is not None:
            given["structured_outputs"] = self.structured_outputs
        for name in ("json", "regex", "choice", "grammar"):
            value = getattr(self, "guided_" + name)
            if value is not None:
                given["guided_" + name] = {name: value}
        if len(given) > 1:
            raise ValueError(f"give one output constraint, got {sorted(given)}")
        if not given:
            return None
        (source, value), = given.items()
        try:
            return StructuredOutputsParams.of(value)
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None

    def _refuse_unsupported(self) -> None:
        if self.functions or self.function_call not in (None, "none"):
            raise ValueError("functions and function_call (OpenAI's legacy function calling) are not supported: "
                             "send tools and tool_choice")

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, defaults: Mapping[str, Any] | None = None,
                        max_tokens_limit: int | None = None) -> SamplingParams:
        """``SamplingParams`` for this request (raises ``ValueError`` with the rule broken).

        ``defaults`` (the engine's ``sampling_defaults``, from the model's generation_config.json)
        fill the fields this request leaves unset, ``max_tokens`` among them; ``max_tokens_limit``
        caps ``max_tokens`` whether set or not (vLLM's limit from a --generation-config folder)."""
        self._refuse_unsupported()
        defaults = defaults or {}
        if max_tokens is None:
            max_tokens = defaults.get("max_tokens")
        if max_tokens_limit is not None:
            max_tokens = max_tokens_limit if max_tokens is None else min(max_tokens, max_tokens_limit)
        kw: dict[str, Any] = {**defaults, "n": self.n, "max_tokens": max_tokens, "logprobs": logprobs,
                              "seed": self.seed}
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "stop", "stop_token_ids", "min_tokens", "ignore_eos",
                     "skip_special_tokens", "include_stop_str_in_output", "allowed_token_ids", "bad_words",
                     "truncate_prompt_tokens"):
            value = getattr(self, name)
            if value is not None:
                kw[name] = value
        if self.logit_bias is not None:
            try:
                kw["logit_bias"] = {int(t): b for t, b in self.logit_bias.items()}
            except ValueError:
                raise ValueError(f"logit_bias keys must be token ids, got {sorted(self.logit_bias)[:5]}") from None
        if kw["n"] > 128:
            raise ValueError(f"n must be at most 128, got {kw['n']}")
        kw["structured_outputs"] = self.structured()
        return SamplingParams(**kw)


    def beam_search_params(self, max_tokens: int | None, defaults: Mapping[str, Any] | None = None,
                           max_tokens_limit: int | None = None, *, other: tuple[str, ...] = ()) -> BeamSearchParams:
        """``BeamSearchParams`` for a ``use_beam_search`` request: ``n`` beams, ``max_tokens`` as for sampling
        (the model's default when unset, capped by ``max_tokens_limit``). A beam search samples nothing, so a
        sampling field set to anything but its neutral value is refused by name (``other``: the route's own
        fields the request set that beam search cannot honour), never ignored."""
        self._refuse_unsupported()
        set_fields = [name for name, neutral in _BEAM_NEUTRAL.items()
                      if getattr(self, name) is not None and getattr(self, name) not in neutral]
        set_fields += [name for name in ("seed", "stop", "stop_token_ids", "logit_bias", "allowed_token_ids",
                                         "bad_words", "truncate_prompt_tokens") if getattr(self, name)]
        if self.structured() is not None:
            set_fields.append("an output constraint")
        set_fields += other
        if set_fields:
            raise ValueError(f"use_beam_search ranks beams by the model's own log-probabilities and takes no "
                             f"{', '.join(set_fields)}; leave them unset")
        if self.n > 128:
            raise ValueError(f"n (the beam width) must be at most 128, got {self.n}")
        if max_tokens is None:
            max_tokens = (defaults or {}).get("max_tokens")
        if max_tokens_limit is not None:
            max_tokens = max_tokens_limit if max_tokens is None else min(max_tokens, max_tokens_limit)
        return BeamSearchParams(beam_width=self.n, max_tokens=max_tokens, ignore_eos=bool(self.ignore_eos),
                                length_penalty=self.length_penalty,
                                skip_special_tokens=self.skip_special_tokens is not False)


# the sampling fields a beam search accepts only at their neutral values (unset: None, always accepted)
_BEAM_NEUTRAL: dict[str, tuple] = {
    "temperature": (0,), "top_p": (1,), "top_k": (-1, 0), "min_p": (0,), "presence_penalty": (0,),
    "frequency_penalty": (0,), "repetition_penalty": (1,), "min_tokens": (0,), "include_stop_str_in_output": (False,),
}


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object

    def parameters_schema(self) -> dict[str, Any]:
        return self.parameters if self.parameters is not None else {"type": "object", "properties": {}}


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"] = "function"
    function: FunctionDefinition


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str = "text"
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: Union[str, list[ContentPart], None] = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    def as_template_dict(self) -> dict[str, Any]:
        """The message as chat templates read it. An earlier call's ``arguments`` (JSON text on the wire)
        become an object, which is what templates print (as transformers' chat-template docs and vLLM do)."""
        content = self.content
        if isinstance(content, list):
            other = [p.type for p in content if p.type != "text"]
            if other:
                raise OpenAIError(400, f"only text content parts are supported, got {other}", param="messages")
            content = "".join(p.text or "" for p in content)
        row: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            row["name"] = self.name
        if self.tool_call_id is not None:
            row["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            row["tool_calls"] = [_template_call(c) for c in self.tool_calls]
        return row


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise OpenAIError(400, "a message's tool_calls need function.name", param="messages")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            raise OpenAIError(400, f"tool call {function['name']!r}: arguments are not JSON", param="messages") from None
    return {**call, "function": {**function, "arguments": arguments}}


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    # vLLM's extensions: the reply continues the final (assistant) message instead of starting a new one
    # (a "prefilled" reply; needs add_generation_prompt false), and echo puts that message in front of the reply
    continue_final_message: bool = False
    echo: bool = False
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables for the chat template (vLLM's extension)
    tools: list[ToolDefinition] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], dict[str, Any], None] = None
    parallel_tool_calls: bool | None = None  # accepted; "required" may give several calls, as vLLM

    def tool_mode(self) -> tuple[str, FunctionDefinition | None]:
        """How this request uses its tools: ("none" | "auto" | "required" | "named", the named function)
        (raises ``ValueError`` for a choice that names no tool or comes without tools)."""
        choice = self.tool_choice
        if choice is None:
            choice = "auto" if self.tools else "none"
        if choice == "none":
            return "none", None
        if not self.tools:
            raise ValueError(f"tool_choice {choice!r} needs tools")
        if isinstance(choice, str):
            return choice, None
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if not isinstance(name, str):
            raise ValueError('tool_choice must be "none", "auto", "required" or '
                             '{"type": "function", "function": {"name": ...}}')
        for tool in self.tools:
            if tool.function.name == name:
                return "named", tool.function
        raise ValueError(f"tool_choice names {name!r}, which is not among the tools")

    def structured(self) -> StructuredOutputsParams | None:
        """The output constraint; for tool_choice "required" or a named function, the one the tools give."""
        given = super().structured()
        mode, function = self.tool_mode()
        if mode not in ("required", "named"):
            return given
        if given is not None:
            raise ValueError(f"tool_choice {self.tool_choice!r} constrains the output itself: "
                             "it takes no response_format or structured_outputs")
        if mode == "named":
            return StructuredOutputsParams(json=function.parameters_schema())
        return StructuredOutputsParams(json=required_calls_schema([t.function for t in self.tools]))

    def template_tools(self) -> list[dict[str, Any]] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def to_sampling_params(self, defaults: Mapping[str, Any] | None = None,
                           max_tokens_limit: int | None = None) -> SamplingParams:
        check_continuation(self.add_generation_prompt, self.continue_final_message)
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        top = self.top_logprobs or 0
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top}")
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self.sampling_params(limit, top if self.logprobs else None, defaults, max_tokens_limit)

    def to_beam_search_params(self, defaults: Mapping[str, Any] | None = None,
                              max_tokens_limit: int | None = None) -> BeamSearchParams:
        check_continuation(self.add_generation_prompt, self.continue_final_message)
        other = tuple(name for name in ("logprobs", "top_logprobs") if getattr(self, name))
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self.beam_search_params(limit, defaults, max_tokens_limit, other=other)


def required_calls_schema(functions: list[FunctionDefinition]) -> dict[str, Any]:
    """tool_choice "required": a JSON array of one or more calls, each ``{"name", "parameters"}`` of one of
    the tools (the form vLLM constrains such a request to)."""
    return {"type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "object", "properties": {"name": {"const": f.name}, "parameters": f.parameters_schema()},
         "required": ["name", "parameters"], "additionalProperties": False}
        for f in functions]}}


# a completion prompt: text, texts, token ids, or lists of token ids
PromptType = Union[str, list[str], list[int], list[list[int]]]


class CompletionRequest(_Request):
    prompt: PromptType
    # OpenAI's default for /v1/completions, kept over a generation_config.json's max_new_tokens as vLLM
    # does (only an explicit null lets that default apply)
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False  # the prompt leads each choice's text (and, with logprobs, its logprobs)
    prompt_logprobs: int | None = None  # vLLM's extension: each choice also carries them, per prompt token
    suffix: str | None = None
    best_of: int | None = None

    def _refuse_unsupported(self) -> None:
        if self.suffix:
            raise ValueError("suffix is not supported by this server")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported (only best_of == n)")

    def to_sampling_params(self, defaults: Mapping[str, Any] | None = None,
                           max_tokens_limit: int | None = None) -> SamplingParams:
        self._refuse_unsupported()
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs}")
        params = self.sampling_params(self.max_tokens, self.logprobs, defaults, max_tokens_limit)
        # echo with logprobs scores the prompt too (its tokens lead the choice's logprobs)
        asked = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        if asked:
            params.prompt_logprobs = max(asked)
        return params

    def to_beam_search_params(self, defaults: Mapping[str, Any] | None = None,
                              max_tokens_limit: int | None = None) -> BeamSearchParams:
        self._refuse_unsupported()
        other = tuple(name for name in ("logprobs", "prompt_logprobs") if getattr(self, name) is not None)
        return self.beam_search_params(self.max_tokens, defaults, max_tokens_limit, other=other)

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of prompts (each text or token ids)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ValueError("prompt is empty")
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


# variables a chat template is rendered with by the server itself: a request's chat_template_kwargs may not set them
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "add_generation_prompt", "tokenize", "chat_template", "conversation",
                                      "tools", "continue_final_message"})


def check_continuation(add_generation_prompt: bool, continue_final_message: bool) -> None:
    """Raises ``ValueError`` for both at once: a new assistant turn cannot also continue the last message."""
    if add_generation_prompt and continue_final_message:
        raise ValueError("continue_final_message needs add_generation_prompt false: the reply either starts a new "
                         "message or continues the last one")


def template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """A request's ``chat_template_kwargs``, checked (raises ``OpenAIError`` 400 for a reserved name)."""
    kwargs = dict(kwargs or {})
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if reserved:
        raise OpenAIError(400, f"chat_template_kwargs may not set {reserved}: the server sets them",
                          param="chat_template_kwargs")
    return kwargs


class TokenizeRequest(BaseModel):
    """``/tokenize``: a text ``prompt`` or chat ``messages`` (exactly one), as vLLM's route."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDefinition] | None = None  # rendered by the chat template, as /v1/chat/completions does
    # None: True for a prompt (as /v1/completions encodes it), False for messages (the template writes them)
    add_special_tokens: bool | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    """``/detokenize``: token ids back to text."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]



class LoadLoRAAdapterRequest(BaseModel):
    """``/v1/load_lora_adapter``: serve the PEFT adapter folder ``lora_path`` as model ``lora_name`` (vLLM's route)."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    """``/v1/unload_lora_adapter``: stop serving ``lora_name``."""

    model_config = ConfigDict(extra="ignore")  # vLLM's clients may send lora_int_id too

    lora_name: str
