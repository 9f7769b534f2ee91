"""The OpenAI-compatible HTTP app: ``build_app(engine, ...)`` returns a FastAPI app.

Routes: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/responses`` (``responses.py``), ``/v1/models``, ``/health``, ``/version``,
``/metrics``, ``/tokenize`` and ``/detokenize`` (vLLM's; ``/tokenizer_info`` when enabled),
``/v1/engine_stats`` (debug: where the engine thread's time goes), ``POST /reset_prefix_cache``. Every error is OpenAI-shaped (``{"error": {"message", "type", "param",
"code"}}``): 400 for bad parameters (pydantic's validation errors included, never 422),
401 for a missing or wrong API key, 404 for an unknown model, 413 for a body over the
limit, 500 when the engine failed the request, 503 when the queue is full.

Handlers only parse, queue, and encode JSON; the engine thread does the model work and the
detokenization (see ``async_engine``).
"""
from __future__ import annotations

import asyncio
import hmac
import itertools
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pageserve.engine.beam_search import BeamSearch, BeamSearchParams, beam_search_output, take_round
from pageserve.engine.llm_engine import LLMEngine
from pageserve.engine.lora import LoRARequest
from pageserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput

from .async_engine import AsyncEngine, EngineDeadError, EngineStepError, QueueFullError, RequestStream, TextPrompt
from .logprobs import TokenTable, chat_logprobs, completion_logprobs
from .metrics import ServerMetrics
from .protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, LoadLoRAAdapterRequest, OpenAIError,
                       TokenizeRequest, UnloadLoRAAdapterRequest, check_continuation, error_body, template_kwargs)
from .reasoning import REASONING_PARSERS, reasoning_token_count
from .responses import ResponseEvents, ResponsesRequest, output_items
from .tools import TOOL_PARSERS, ChatTools, call_json

logger = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BYTES = 4 << 20
_DISCONNECT_POLL_S = 0.25


def build_app(
    engine: LLMEngine | AsyncEngine,
    served_model_name: str | list[str] | None = None,
    api_key: str | None = None,
    max_waiting_requests: int | None = None,
    max_request_bytes: int | None = None,
    chat_template: str | None = None,
    enable_tokenizer_info: bool = False,
    enable_auto_tool_choice: bool = False,
    tool_call_parser: str | None = None,
    allowed_origins: list[str] | None = None,
    reasoning_parser: str | None = None,
    lora_modules: list | None = None,
) -> FastAPI:
    """An app serving ``engine``. The engine thread starts and stops with the app's lifespan.
    ``chat_template``: a Jinja chat template (its text, or a file holding it) used instead of the
    tokenizer's own, as vLLM's ``--chat-template``. ``enable_tokenizer_info``: serve GET
    ``/tokenizer_info`` (the special tokens and the chat template: with ``/tokenize`` and
    ``/detokenize``, what a client such as lm-evaluation-harness needs to tokenize through the server
    instead of a local copy of the tokenizer); off by default, as vLLM's
    ``--enable-tokenizer-info-endpoint``, since it hands out the template. ``enable_auto_tool_choice``
    with ``tool_call_parser`` (a name in ``tools.TOOL_PARSERS``): requests may leave the choice of
    tools to the model (``tool_choice`` "auto", the default when a request has tools), whose text that
    parser reads calls from, as vLLM's flags of the same names. ``allowed_origins``: the origins a browser
    page may call this server from (CORS; default every origin, as vLLM's ``--allowed-origins``: the API key,
    not the origin, is what guards it; ``[]`` turns cross-origin calls off). ``reasoning_parser`` (a name in
    ``reasoning.REASONING_PARSERS``): chat replies split a thinking model's ``<think>`` part into
    ``reasoning_content``, as vLLM's ``--reasoning-parser``. ``lora_modules``: LoRA adapters served from the start
    (``LoRARequest``s, or ``(name, path)`` pairs; the engine needs ``enable_lora``): a request names one in its
    ``model`` field, as with vLLM's ``--lora-modules``; ``POST /v1/load_lora_adapter`` and
    ``/v1/unload_lora_adapter`` add and remove them while serving."""
    template = load_chat_template(chat_template)
    parser = tool_parser(enable_auto_tool_choice, tool_call_parser)
    if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {reasoning_parser!r}; known: {sorted(REASONING_PARSERS)}")
    thinking = None if reasoning_parser is None else REASONING_PARSERS[reasoning_parser]()
    if allowed_origins is not None and not (isinstance(allowed_origins, list)
                                            and all(isinstance(o, str) for o in allowed_origins)):
        raise ValueError(f"allowed_origins must be a list of origins, got {allowed_origins!r}")
    aengine = engine if isinstance(engine, AsyncEngine) else AsyncEngine(engine, max_waiting_requests)
    llm = aengine.engine
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name or [])
    names = names or [llm.config.model]
    metrics = ServerMetrics(lambda: aengine.stats, names[0], aengine.step_stats)
    table = TokenTable(llm.tokenizer.hf if llm.tokenizer is not None else None, llm.model_config.vocab_size)
    server = _Server(aengine, names, metrics, table, template, parser, thinking)
    for module in lora_modules or ():  # the engine thread has not started: its state is ours to change
        server.register_lora(*((module.lora_name, module.lora_path) if isinstance(module, LoRARequest) else module),
                             engine=llm)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        aengine.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            await asyncio.to_thread(aengine.shutdown)

    app = FastAPI(title="pageserve", lifespan=lifespan)
    app.state.server = server
    app.state.engine = aengine
    app.add_middleware(_AuthMiddleware, api_key=api_key)
    app.add_middleware(_BodyLimitMiddleware, max_bytes=max_request_bytes or DEFAULT_MAX_REQUEST_BYTES)
    # added last, so outermost: a preflight is answered before the key is asked for, and a 401 carries CORS headers
    app.add_middleware(CORSMiddleware, allow_origins=["*"] if allowed_origins is None else list(allowed_origins),
                       allow_methods=["*"], allow_headers=["*"], allow_credentials=False)

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        msg = first.get("msg", "invalid request")
        if loc and loc[0] == "prompt":  # a union: pydantic reports every branch
            param, msg = "prompt", "must be a string, a list of strings, token ids or a list of token-id lists"
        more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
        message = f"{param}: {msg}{more}" if param else f"{msg}{more}"
        return JSONResponse(error_body(message, "invalid_request_error", param, "invalid_parameter"), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        logger.exception("unhandled error")
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}", "server_error"), status_code=500)

    @app.get("/health")
    async def health():
        if not aengine.is_running:
            return JSONResponse(error_body("the engine is not running", "server_error"), status_code=503)
        return {"status": "ok"}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        """Forget every cached prefix block (vLLM's route), e.g. between benchmark runs; 409 while requests
        hold blocks."""
        if not await aengine.reset_prefix_cache():
            raise OpenAIError(409, "requests are running: the prefix cache can be reset only when the server is idle",
                              "conflict", code="requests_running")
        return {"reset": True}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/engine_stats")
    async def engine_stats(since: int = 0):
        """Debug: the engine thread's step timings (ms percentiles) over the steps numbered
        above ``since`` (read ``num_records`` before a run, pass it after), and its totals."""
        return {**aengine.step_stats.summary(since), "engine": aengine.stats}

    @app.get("/version")
    async def version_route():
        from pageserve.cli import version

        return {"version": version()}

    @app.get("/v1/models")
    async def models():
        now = int(time.time())
        return {"object": "list", "data": [
            {"id": n, "object": "model", "created": now, "owned_by": "pageserve", "max_model_len": llm.max_model_len}
            for n in names
        ] + [
            {"id": r.lora_name, "object": "model", "created": now, "owned_by": "pageserve", "root": r.lora_path,
             "parent": names[0], "max_model_len": llm.max_model_len}
            for r in server.loras.values()
        ]}

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest):
        """Serve one more LoRA adapter (vLLM's route): 400 when LoRA is off, the name is taken or the folder
        is not an adapter this model can take."""
        await server.load_lora(body.lora_name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
        """Stop serving a LoRA adapter (vLLM's route): 404 for an unknown name, 409 while requests use it."""
        await server.unload_lora(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await server.chat(body, request)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request):
        return await server.respond(body, request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await server.complete(body, request)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        return server.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        return server.detokenize(body)

    if enable_tokenizer_info:
        @app.get("/tokenizer_info")
        async def tokenizer_info():
            return server.tokenizer_info()

    return app


def tool_parser(enable_auto_tool_choice: bool, name: str | None):
    """The parser "auto" tool choice reads calls with (None when auto is off; raises ``ValueError`` for
    an unknown name, or auto without a parser)."""
    if name is not None and name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; known: {sorted(TOOL_PARSERS)}")
    if not enable_auto_tool_choice:
        return None
    if name is None:
        raise ValueError("enable_auto_tool_choice needs a tool_call_parser")
    return TOOL_PARSERS[name]()


def load_chat_template(value: str | None) -> str | None:
    """``--chat-template``'s value as template text: a file's contents, or the value itself when it
    is a Jinja template (raises ``ValueError`` for anything else, e.g. a mistyped path)."""
    if value is None:
        return None
    if "{{" in value or "{%" in value:  # a template (checked first: a long one is no valid path to stat)
        return value
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    raise ValueError(f"chat template {value!r} is neither a file nor a Jinja template")


class _Choice:
    """Streaming bookkeeping of one choice: how much text and how many tokens were sent."""

    __slots__ = ("index", "text_len", "num_tokens", "finished")

    def __init__(self, index: int) -> None:
        self.index, self.text_len, self.num_tokens, self.finished = index, 0, 0, False


class _Server:
    def __init__(self, engine: AsyncEngine, names: list[str], metrics: ServerMetrics, table: TokenTable,
                 chat_template: str | None = None, tool_parser=None, reasoning=None) -> None:
        self.engine = engine
        self.chat_template = chat_template  # None: the tokenizer's own
        self.tool_parser = tool_parser  # reads "auto" tool choice's calls; None: auto is off
        self.reasoning = reasoning  # splits a reply's <think> part off (reasoning.ThinkParser); None: off
        self.names = names
        self.metrics = metrics
        self.table = table
        self.has_tokenizer = engine.tokenizer is not None
        # the model's generation_config.json defaults for unset request fields (EngineConfig.generation_config)
        self.sampling_defaults = engine.engine.sampling_defaults
        self.max_tokens_limit = engine.engine.max_tokens_limit
        self.loras: dict[str, LoRARequest] = {}  # served adapters by name (changed on the event loop only)
        self._lora_ids = itertools.count(1)

    # ---------------------------------------------------------------- LoRA adapters
    def _new_lora(self, name: str, path: str) -> LoRARequest:
        if not isinstance(name, str) or not name:
            raise OpenAIError(400, "lora_name must be a non-empty string", param="lora_name")
        if name in self.names or name in self.loras:
            raise OpenAIError(400, f"the name {name!r} is already served", param="lora_name", code="name_in_use")
        return LoRARequest(name, next(self._lora_ids), str(path))

    def register_lora(self, name: str, path: str, engine) -> None:
        """Serve an adapter from the start (before the engine thread runs): ValueError for a bad one."""
        try:
            request = self._new_lora(name, path)
        except OpenAIError as e:
            raise ValueError(f"LoRA module {name!r}: {e.message}") from None
        engine.add_lora(request)
        self.loras[name] = request

    async def load_lora(self, name: str, path: str) -> None:
        engine = self.engine.engine
        if engine.runner.lora is None:
            raise OpenAIError(400, "this server was started without --enable-lora", param="lora_name")
        request = self._new_lora(name, path)
        from pageserve.model.lora import LoRAAdapter

        try:  # the files are read off the engine thread; the engine only takes the tensors
            adapter = await asyncio.to_thread(LoRAAdapter.load, request.lora_path, engine.model_config,
                                              engine.config.max_lora_rank)
            await self.engine.call(lambda e: e.add_lora(request, adapter))
        except ValueError as e:
            raise OpenAIError(400, str(e), param="lora_path") from None
        self.loras[name] = request

    async def unload_lora(self, name: str) -> None:
        request = self.loras.get(name)
        if request is None:
            raise OpenAIError(404, f"no LoRA adapter named {name!r} is served", param="lora_name",
                              code="model_not_found")
        try:
            await self.engine.call(lambda e: e.remove_lora(request.lora_int_id))
        except ValueError as e:
            raise OpenAIError(409, str(e), "conflict", param="lora_name", code="adapter_in_use") from None
        self.loras.pop(name, None)

    # ---------------------------------------------------------------- shared
    def _check_model(self, model: str | None) -> str:
        """The served name a request runs as: the base model's (or ``model`` None: the first one) or a LoRA
        adapter's."""
        if model is None:
            return self.names[0]
        if model not in self.names and model not in self.loras:
            raise OpenAIError(404, f"the model {model!r} does not exist; this server serves "
                                   f"{self.names + list(self.loras)}", param="model", code="model_not_found")
        return model

    async def _submit(self, rid: str, prompts: list, params, priority: int = 0,
                      model: str | None = None, cache_salt: str | None = None) -> list[RequestStream]:
        streams: list[RequestStream] = []
        lora = self.loras.get(model) if model is not None else None
        try:
            for i, p in enumerate(prompts):
                streams.append(await self.engine.add_request(f"{rid}-{i}", p, params, priority, lora, cache_salt))
        except BaseException as e:
            for s in streams:
                s.close()
            self.metrics.count("rejected")
            if isinstance(e, ValueError):
                msg = str(e)
                param = next((p for p in ("priority", "cache_salt", "prompt") if p in msg), None)
                raise OpenAIError(400, msg, param=param) from None
            if isinstance(e, QueueFullError):
                raise OpenAIError(503, str(e), "server_overloaded", code="queue_full") from None
            if isinstance(e, EngineDeadError):
                raise OpenAIError(503, str(e), "server_error") from None
            if isinstance(e, EngineStepError):
                raise OpenAIError(500, str(e), "server_error") from None
            raise
        return streams

    async def _collect(self, streams: list[RequestStream], request: Request) -> list[RequestOutput]:
        """The final outputs; aborts everything if the client goes away first."""

        async def last(s: RequestStream) -> RequestOutput:
            out = None
            async for out in s:
                pass
            return out

        task = asyncio.ensure_future(asyncio.gather(*(last(s) for s in streams)))
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
                if done:
                    return task.result()
                if await request.is_disconnected():
                    raise OpenAIError(499, "client disconnected")
        except EngineStepError as e:
            self.metrics.count("error")
            raise OpenAIError(500, str(e), "server_error") from None
        except EngineDeadError as e:
            raise OpenAIError(503, str(e), "server_error") from None
        finally:
            if not task.done():
                task.cancel()
            for s in streams:
                s.close()

    async def _beam_search(self, rid: str, prompts: list, params: BeamSearchParams, request: Request,
                           priority: int = 0, model: str | None = None,
                           cache_salt: str | None = None) -> list[RequestOutput]:
        """Each prompt's beam search (``engine/beam_search.py``), round by round: a round's requests (one a live
        beam of every unfinished prompt, one token each with its top log-probabilities) go in together and
        share the engine's steps with every other request. The final outputs, one a prompt."""
        engine = self.engine.engine
        try:
            ids = await self.engine.call(lambda eng: [
                eng.tokenizer.encode(p.text, add_special_tokens=p.add_special_tokens) if isinstance(p, TextPrompt)
                else list(p) for p in prompts])
            searches = [BeamSearch(p, params, engine.eos_token_ids, engine.max_model_len) for p in ids]
        except ValueError as e:
            self.metrics.count("rejected")
            raise OpenAIError(400, str(e), param="prompt") from None
        except EngineDeadError as e:
            raise OpenAIError(503, str(e), "server_error") from None
        metrics = [RequestMetrics(arrival_time=time.perf_counter()) for _ in searches]
        for round_ in itertools.count():
            active = [i for i, s in enumerate(searches) if not s.done]
            if not active:
                break
            asks = [beam for i in active for beam in searches[i].requests()]
            streams = await self._submit(f"{rid}-round{round_}", asks, searches[active[0]].round_params, priority,
                                         model, cache_salt)
            outs = await self._collect(streams, request)
            if any(o.outputs[0].finish_reason == "error" for o in outs):
                self.metrics.count("error")
                raise OpenAIError(500, "the engine failed this request while generating it", "server_error")
            take_round(searches, active, outs, metrics, time.perf_counter())

        def build(eng: LLMEngine) -> list[RequestOutput]:  # on the engine thread, which owns the tokenizer
            def decode(ids: list[int], skip: bool) -> str:
                return "" if eng.tokenizer is None else eng.tokenizer.decode(ids, skip_special_tokens=skip)

            return [beam_search_output(f"{rid}-{i}", None, s, decode, m)
                    for i, (s, m) in enumerate(zip(searches, metrics))]

        return await self.engine.call(build)

    def _finish(self, outs: list[RequestOutput]) -> None:
        for out in outs:
            self.metrics.observe(out.metrics)
        failed = any(c.finish_reason == "error" for out in outs for c in out.outputs)
        self.metrics.count("error" if failed else "ok")
        if failed:
            raise OpenAIError(500, "the engine failed this request while generating it", "server_error")

    def _usage(self, outs: list[RequestOutput], n: int, chat: bool = False) -> dict[str, Any]:
        """OpenAI's usage; ``prompt_tokens_details.cached_tokens``: the prompt tokens the prefix cache held
        when each request was first admitted; on the chat routes with a reasoning parser,
        ``completion_tokens_details.reasoning_tokens``: the replies' tokens up to their ``</think>``."""
        prompt = sum(len(o.prompt_token_ids) for o in outs)
        completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
        cached = sum(o.metrics.num_cached_tokens for o in outs)
        usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                                 "total_tokens": prompt + completion, "prompt_tokens_details": {"cached_tokens": cached}}
        if chat and self.reasoning is not None:
            tok = self.engine.tokenizer
            usage["completion_tokens_details"] = {"reasoning_tokens": sum(
                reasoning_token_count(self.reasoning, lambda ids: tok.decode(ids, skip_special_tokens=True),
                                      c.token_ids) for o in outs for c in o.outputs)}
        return usage

    def _render_chat(self, messages, add_generation_prompt: bool, kwargs: dict[str, Any] | None,
                     tools: list[dict[str, Any]] | None = None, continue_final_message: bool = False) -> str:
        """The chat as prompt text: the server's template, else the tokenizer's, else a plain
        "role: content" transcript (a tokenizer without a template). ``continue_final_message``: the last
        message left open, for the reply to continue it."""
        tok = self.engine.tokenizer
        rows = [m.as_template_dict() for m in messages]
        kwargs = template_kwargs(kwargs)
        if tools:
            kwargs["tools"] = tools
        if continue_final_message:
            kwargs["continue_final_message"] = True
        if self.chat_template is None and not tok.has_chat_template:
            lines = "\n".join(f"{m['role']}: {m['content']}" for m in rows)
            return lines if continue_final_message else lines + "\nassistant:"
        try:
            return tok.render_chat(rows, add_generation_prompt, chat_template=self.chat_template, **kwargs)
        except Exception as e:  # noqa: BLE001 - a template that rejects these messages
            raise OpenAIError(400, f"the chat template rejected the messages: {e}", param="messages") from None

    def _tokenizer(self, model: str | None):
        self._check_model(model)
        if self.engine.tokenizer is None:
            raise OpenAIError(400, "this model has no tokenizer")
        return self.engine.tokenizer

    # ------------------------------------------------------- tokenize / detokenize
    def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        """Token ids of a prompt as /v1/completions encodes it, or of messages as
        /v1/chat/completions renders them."""
        tok = self._tokenizer(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise OpenAIError(400, "give exactly one of prompt and messages", param="prompt")
        if body.messages is not None:
            try:
                check_continuation(body.add_generation_prompt, body.continue_final_message)
            except ValueError as e:
                raise OpenAIError(400, str(e), param="continue_final_message") from None
            tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
            text = self._render_chat(body.messages, body.add_generation_prompt, body.chat_template_kwargs, tools,
                                     body.continue_final_message)
            special = bool(body.add_special_tokens)
        else:
            text, special = body.prompt, body.add_special_tokens is not False
        ids = tok.encode(text, add_special_tokens=special)
        out: dict[str, Any] = {"count": len(ids), "max_model_len": self.engine.engine.max_model_len, "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = tok.hf.convert_ids_to_tokens(ids)
        return out

    def tokenizer_info(self) -> dict[str, Any]:
        hf = self._tokenizer(None).hf
        return {"tokenizer_class": type(hf).__name__, "eos_token": hf.eos_token, "bos_token": hf.bos_token,
                "pad_token": hf.pad_token, "unk_token": hf.unk_token,
                "chat_template": self.chat_template or getattr(hf, "chat_template", None),
                "model_max_length": self.engine.engine.max_model_len}

    def detokenize(self, body: DetokenizeRequest) -> dict[str, str]:
        tok = self._tokenizer(body.model)
        vocab = self.engine.engine.model_config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise OpenAIError(400, f"token ids must be in [0, {vocab}), got {bad[:5]}", param="tokens")
        return {"prompt": tok.decode(body.tokens, skip_special_tokens=False)}

    # ---------------------------------------------------------------- chat
    async def _start_chat(self, body: ChatCompletionRequest, rid: str, request: Request):
        """Queue a chat request: (the model name, its choice count n, its top-logprob count k or None, its
        ChatTools, its streams). A beam search runs to its end here; its stream then holds the final output."""
        model = self._check_model(body.model)
        tok = self.engine.tokenizer
        if tok is None:
            raise OpenAIError(400, f"model {model!r} has no tokenizer, so no chat template: use /v1/completions "
                                   "with token ids", param="messages")
        try:
            if body.use_beam_search:
                params = body.to_beam_search_params(self.sampling_defaults, self.max_tokens_limit)
            else:
                params = body.to_sampling_params(self.sampling_defaults, self.max_tokens_limit)
            tools = ChatTools(body, self.tool_parser)
        except ValueError as e:
            raise OpenAIError(400, str(e), param="tool_choice" if "tool" in str(e) else None) from None
        prompt = TextPrompt(self._render_chat(body.messages, body.add_generation_prompt, body.chat_template_kwargs,
                                              body.template_tools(), body.continue_final_message),
                            add_special_tokens=False)
        if isinstance(params, BeamSearchParams):
            outs = await self._beam_search(rid, [prompt], params, request, body.priority, model, body.cache_salt)
            return model, params.beam_width, None, tools, [_Finished(outs[0])]
        streams = await self._submit(rid, [prompt], params, body.priority, model, body.cache_salt)
        return model, params.n, params.logprobs, tools, streams

    async def chat(self, body: ChatCompletionRequest, request: Request):
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        model, n, k, tools, streams = await self._start_chat(body, rid, request)
        echo = _echoed(body)
        created = int(time.time())
        if body.stream:
            return _sse(self._chat_events(streams, rid, created, model, n, k, _usage_mode(body), tools, echo))
        outs = await self._collect(streams, request)
        self._finish(outs)
        choices = []
        for c in outs[0].outputs:
            reasoning, text = self._split_reasoning(c.text)
            content, calls = (None, []) if text is None else tools.parse(text)
            if echo:
                content = echo + (content or "")
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if self.reasoning is not None:
                message["reasoning_content"] = reasoning
            if calls:
                message["tool_calls"] = [call_json(call) for call in calls]
            choice: dict[str, Any] = {
                "index": c.index,
                "message": message,
                "logprobs": None if k is None else chat_logprobs(self.table, c.token_ids, c.logprobs or [], k),
                "finish_reason": tools.finish_reason(c.finish_reason, bool(calls)),
                "stop_reason": c.stop_reason,
            }
            choices.append(choice)
        return JSONResponse({
            "id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": self._usage(outs, n, chat=True),
        })

    async def _chat_events(self, streams, rid, created, model, n, k, usage: str | None,
                           tools: ChatTools, echo: str = "") -> AsyncIterator[dict]:
        base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
        usage_none = {"usage": None} if usage else {}
        choices = [_Choice(i) for i in range(n)]
        calls = [tools.stream() for _ in range(n)]
        thinks = [None if self.reasoning is None else self.reasoning.streamer() for _ in range(n)]
        yield {**base, "choices": [
            {"index": i, "delta": {"role": "assistant", "content": echo}, "logprobs": None, "finish_reason": None}
            for i in range(n)
        ], **usage_none}
        last = None
        async for _, out in _merge(streams):
            last = out
            delta_choices = []
            for c in out.outputs:
                st = choices[c.index]
                new = self._delta(st, c)
                if new is None:
                    continue
                text, ids = new
                delta = _chat_delta(thinks[c.index], calls[c.index], text, c.finish_reason is not None)
                if not (delta or c.finish_reason is not None or (k is not None and ids)):
                    continue  # text a tool call holds back
                finish = tools.finish_reason(c.finish_reason, calls[c.index].saw_calls)
                entry: dict[str, Any] = {"index": c.index, "delta": delta, "logprobs": None, "finish_reason": finish}
                if k is not None and ids:
                    lps = (c.logprobs or [])[st.num_tokens - len(ids): st.num_tokens]
                    entry["logprobs"] = chat_logprobs(self.table, ids, lps, k)
                if c.finish_reason is not None:
                    entry["stop_reason"] = c.stop_reason
                delta_choices.append(entry)
            if delta_choices:
                yield {**base, "choices": delta_choices,
                       # the usage so far without reasoning_tokens: counting them decodes the reply's prefixes, which
                       # every chunk would redo; the final usage chunk has them
                       **({"usage": self._usage([out], n)} if usage == "continuous" else usage_none)}
        self._finish([last] if last is not None else [])
        if usage and last is not None:
            yield {**base, "choices": [], "usage": self._usage([last], n, chat=True)}

    # ---------------------------------------------------------------- responses
    async def respond(self, body: ResponsesRequest, request: Request):
        """``/v1/responses``: the request run as a chat request, answered as a response (``responses.py``)."""
        try:
            chat = body.to_chat_request()
        except ValueError as e:
            raise OpenAIError(400, str(e)) from None
        rid = f"resp_{uuid.uuid4().hex}"
        model, _, _, tools, streams = await self._start_chat(chat, rid, request)
        created = int(time.time())
        if body.stream:
            return _sse_named(self._response_events(streams, tools, ResponseEvents(body, rid, created, model)))
        outs = await self._collect(streams, request)
        self._finish(outs)
        c = outs[0].outputs[0]
        reasoning, text = self._split_reasoning(c.text)
        content, calls = (None, []) if text is None else tools.parse(text)
        return JSONResponse(body.response(rid, created, model, output_items(content, calls, reasoning),
                                          c.finish_reason, self._usage(outs, 1, chat=True)))

    async def _response_events(self, streams, tools: ChatTools, writer: ResponseEvents) -> AsyncIterator[dict]:
        for event in writer.start():
            yield event
        st, stream, last = _Choice(0), tools.stream(), None
        think = None if self.reasoning is None else self.reasoning.streamer()
        try:
            async for _, out in _merge(streams):
                last = out
                c = out.outputs[0]
                new = self._delta(st, c)
                if new is not None:
                    for event in writer.delta(_chat_delta(think, stream, new[0], c.finish_reason is not None)):
                        yield event
            self._finish([last] if last is not None else [])
        except OpenAIError as e:
            yield writer.error(e.message, e.code)
            return
        except (EngineStepError, EngineDeadError) as e:
            yield writer.error(str(e), "server_error")
            return
        for event in writer.finish(last.outputs[0].finish_reason, self._usage([last], 1, chat=True)):
            yield event

    def _split_reasoning(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, answer) of a whole reply: the reasoning parser's split, or (None, the text) without one."""
        return (None, text) if self.reasoning is None else self.reasoning.split(text)

    def _delta(self, st: _Choice, c: CompletionOutput) -> tuple[str, list[int]] | None:
        """New text and token ids of a choice since the last chunk (None: nothing to send)."""
        if st.finished:
            return None
        text = c.text[st.text_len:]
        ids = c.token_ids[st.num_tokens:]
        st.text_len, st.num_tokens = len(c.text), len(c.token_ids)
        st.finished = c.finish_reason is not None
        if not (text or ids or st.finished):
            return None
        if not (text or st.finished) and self.has_tokenizer:
            # tokens whose text is held back (a partial character or a possible stop string):
            # their text and logprobs go out with the chunk that releases it
            st.num_tokens -= len(ids)
            return None
        return text, ids

    # ---------------------------------------------------------------- completions
    async def complete(self, body: CompletionRequest, request: Request):
        model = self._check_model(body.model)
        try:
            if body.use_beam_search:
                params = body.to_beam_search_params(self.sampling_defaults, self.max_tokens_limit)
            else:
                params = body.to_sampling_params(self.sampling_defaults, self.max_tokens_limit)
            raw = body.prompts()
        except ValueError as e:
            raise OpenAIError(400, str(e)) from None
        if any(isinstance(p, str) for p in raw) and not self.has_tokenizer:
            raise OpenAIError(400, f"model {model!r} has no tokenizer: send the prompt as token ids", param="prompt")
        prompts = [TextPrompt(p) if isinstance(p, str) else p for p in raw]
        rid = f"cmpl-{uuid.uuid4().hex}"
        if isinstance(params, BeamSearchParams):
            n, k = params.beam_width, None
            outs = await self._beam_search(rid, prompts, params, request, body.priority, model, body.cache_salt)
            streams = [_Finished(out) for out in outs]
        else:
            n, k = params.n, params.logprobs
            streams = await self._submit(rid, prompts, params, body.priority, model, body.cache_salt)
        created = int(time.time())
        extras = _CompletionExtras(body.echo, body.prompt_logprobs is not None, raw)
        if body.stream:
            return _sse(self._completion_events(streams, rid, created, model, n, k, _usage_mode(body), extras))
        outs = await self._collect(streams, request)
        self._finish(outs)
        choices = []
        for i, out in enumerate(outs):
            for c in out.outputs:
                choice = self._completion_choice(i * n + c.index, c.text, c.token_ids, c.logprobs, k,
                                                 c.finish_reason, c.stop_reason)
                choices.append(self._with_prompt(choice, out, extras.prompt_text(i, self.table), extras, k))
        return JSONResponse({
            "id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": self._usage(outs, n),
        })

    def _completion_choice(self, index, text, ids, lps, k, finish_reason, stop_reason, offset=0) -> dict:
        choice: dict[str, Any] = {
            "index": index, "text": text,
            "logprobs": None if k is None else completion_logprobs(self.table, ids, lps or [], k, offset),
            "finish_reason": finish_reason, "stop_reason": stop_reason,
        }
        if not self.has_tokenizer:
            choice["token_ids"] = list(ids)
        return choice

    def _with_prompt(self, choice: dict, out: RequestOutput, prompt_text: str, extras: "_CompletionExtras",
                     k: int | None) -> dict:
        """A completion choice with the prompt echoed in front (text and logprobs) and/or the vLLM-style
        ``prompt_logprobs`` beside it, as the request asked."""
        if extras.echo:
            choice["text"] = prompt_text + choice["text"]
            if k is not None:
                ids = out.prompt_token_ids
                lead = completion_logprobs(self.table, ids, list(out.prompt_logprobs or [None] * len(ids)), k)
                gen = choice["logprobs"]
                shift = len(prompt_text)
                choice["logprobs"] = {
                    "tokens": lead["tokens"] + gen["tokens"],
                    "token_logprobs": lead["token_logprobs"] + gen["token_logprobs"],
                    "top_logprobs": lead["top_logprobs"] + gen["top_logprobs"],
                    "text_offset": lead["text_offset"] + [o + shift for o in gen["text_offset"]],
                }
        if extras.prompt_logprobs:
            choice["prompt_logprobs"] = [
                None if e is None else {str(t): {"logprob": lp, "decoded_token": self.table.token_str(t)}
                                        for t, lp in e.items()}
                for e in (out.prompt_logprobs or [])]
        return choice

    async def _completion_events(self, streams, rid, created, model, n, k, usage: str | None,
                                 extras: "_CompletionExtras") -> AsyncIterator[dict]:
        base = {"id": rid, "object": "text_completion", "created": created, "model": model}
        usage_none = {"usage": None} if usage else {}
        choices: dict[int, _Choice] = {}
        finals: dict[int, RequestOutput] = {}
        async for i, out in _merge(streams):
            if out.finished:
                finals[i] = out
            delta_choices = []
            for c in out.outputs:
                index = i * n + c.index
                first = index not in choices
                st = choices.setdefault(index, _Choice(index))
                offset = st.text_len
                new = self._delta(st, c)
                if new is None and not (first and (extras.echo or extras.prompt_logprobs)):
                    continue
                text, ids = new if new is not None else ("", [])
                lps = (c.logprobs or [])[st.num_tokens - len(ids): st.num_tokens]
                choice = self._completion_choice(index, text, ids, lps, k, c.finish_reason if new else None,
                                                 c.stop_reason if new else None, offset)
                if first:  # the prompt goes out with a choice's first chunk
                    choice = self._with_prompt(choice, out, extras.prompt_text(i, self.table), extras, k)
                delta_choices.append(choice)
            if delta_choices:
                yield {**base, "choices": delta_choices,
                       **({"usage": self._usage([out], n)} if usage == "continuous" else usage_none)}
        outs = [finals[i] for i in sorted(finals)]
        self._finish(outs)
        if usage:
            yield {**base, "choices": [], "usage": self._usage(outs, n)}


def _chat_delta(think, calls, text: str, finished: bool) -> dict[str, Any]:
    """A streamed choice's delta for this much more text: the think part split off first (``reasoning_content``,
    when the server has a reasoning parser: ``think`` its stream), the answer through the tool stream ``calls``."""
    reasoning = ""
    if think is not None:
        reasoning, text = think.feed(text)
        if finished:
            more_reasoning, more_text = think.finish()
            reasoning, text = reasoning + more_reasoning, text + more_text
    delta = calls.feed(text, finished)
    return {"reasoning_content": reasoning, **delta} if reasoning else delta


def _usage_mode(body) -> str | None:
    """A stream's usage reports: None, "final" (a last chunk with the usage: include_usage) or "continuous"
    (also the usage so far in every chunk: vLLM's continuous_usage_stats; a completion request's per prompt)."""
    options = body.stream_options
    if not (options and options.include_usage):
        return None
    return "continuous" if options.continuous_usage_stats else "final"


def _echoed(body: ChatCompletionRequest) -> str:
    """What a chat reply's content starts with under ``echo``: the last message's text when it is the
    assistant's (the message the reply continues), else nothing (as vLLM)."""
    if not body.echo or body.messages[-1].role != "assistant":
        return ""
    return body.messages[-1].as_template_dict()["content"]


class _CompletionExtras:
    """What a completion request adds around the generated text: ``echo`` (the prompt in front) and
    ``prompt_logprobs`` (vLLM's per-prompt-token logprobs beside it); ``raw``: its prompts as sent."""

    def __init__(self, echo: bool, prompt_logprobs: bool, raw: list) -> None:
        self.echo, self.prompt_logprobs, self.raw = echo, prompt_logprobs, raw

    def prompt_text(self, i: int, table: TokenTable) -> str:
        """Prompt ``i`` as text: as sent, or its token ids' bytes decoded (the handlers never call the
        tokenizer, which the engine thread uses)."""
        if not self.echo:
            return ""
        p = self.raw[i]
        if isinstance(p, str):
            return p
        return b"".join(table.token_bytes(t) for t in p).decode("utf-8", errors="replace")


class _Finished:
    """A stream whose one output is already final (a beam search's result), read as a ``RequestStream``."""

    def __init__(self, out: RequestOutput) -> None:
        self._out: RequestOutput | None = out

    def __aiter__(self) -> "_Finished":
        return self

    async def __anext__(self) -> RequestOutput:
        out, self._out = self._out, None
        if out is None:
            raise StopAsyncIteration
        return out

    def close(self) -> None:
        self._out = None


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several streams as they come, tagged with the stream's index."""
    if len(streams) == 1:
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            streams[0].close()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for out in s:
                queue.put_nowait((i, out))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.close()


def _sse(events: AsyncIterator[dict]) -> StreamingResponse:
    """Server-sent events: one ``data: <json>`` per chunk, then ``data: [DONE]``. An error
    after the headers went out is sent as an ``{"error": ...}`` event."""

    async def body() -> AsyncIterator[bytes]:
        try:
            async for event in events:
                yield f"data: {json.dumps(event, ensure_ascii=False)}\n\n".encode()
        except OpenAIError as e:
            yield f"data: {json.dumps(e.body())}\n\n".encode()
        except (EngineStepError, EngineDeadError) as e:
            yield f"data: {json.dumps(error_body(str(e), 'server_error'))}\n\n".encode()
        finally:
            await events.aclose()
        yield b"data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _sse_named(events: AsyncIterator[dict]) -> StreamingResponse:
    """Server-sent events named by their ``type`` (``event: <type>`` then ``data: <json>``), as the
    Responses API streams them: no ``[DONE]``; its errors are events of the stream itself."""

    async def body() -> AsyncIterator[bytes]:
        try:
            async for event in events:
                yield f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n".encode()
        finally:
            await events.aclose()

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


# -------------------------------------------------------------------- ASGI middleware
class _BodyLimitMiddleware:
    """413 for request bodies over ``max_bytes``: by Content-Length up front, and by
    counting the bytes actually received (chunked bodies have no length)."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.max_bytes
        message = f"the request body is larger than the limit of {limit} bytes"
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    too_big = int(value) > limit
                except ValueError:
                    too_big = False
                if too_big:
                    return await _send_json(send, 413, error_body(message, "invalid_request_error",
                                                                  code="request_too_large"))
        received = 0

        async def limited_receive():
            nonlocal received
            msg = await receive()
            if msg["type"] == "http.request":
                received += len(msg.get("body", b""))
                if received > limit:
                    # FastAPI re-raises HTTPExceptions from body reading; the handler shapes it
                    raise StarletteHTTPException(413, message)
            return msg

        await self.app(scope, limited_receive, send)


class _AuthMiddleware:
    """``Authorization: Bearer <key>`` on every path but ``/health`` when a key is set."""

    def __init__(self, app, api_key: str | None) -> None:
        self.app = app
        self.key = api_key.encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if self.key is None or scope["type"] != "http" or scope["path"] == "/health":
            return await self.app(scope, receive, send)
        given = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                given = value
        scheme, _, token = given.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
            return await _send_json(send, 401, error_body(
                "invalid or missing API key: send 'Authorization: Bearer <key>'", "invalid_request_error",
                code="invalid_api_key"))
        await self.app(scope, receive, send)


async def _send_json(send, status: int, body: dict) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})
