"""``pageserve serve``: every ``EngineConfig`` field as a flag, plus the server's own.

Flags are generated from the dataclass, so a new engine knob is a new flag with no edit
here: ``--block-size 32``, ``--enable-prefix-caching / --no-enable-prefix-caching``,
``--triton-options '{"fuse_norm": true}'`` (dict fields as JSON), ``--num-blocks none``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import types
import typing

from pageserve.engine.config import EngineConfig

from .reasoning import REASONING_PARSERS
from .tools import TOOL_PARSERS
from .tunnel import TunnelError, close_tunnel, open_tunnel, resolve_api_key


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _optional(parse):
    def convert(text: str):
        return None if text.lower() in ("none", "null") else parse(text)

    convert.__name__ = getattr(parse, "__name__", "value")
    return convert


def _json_dict(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace("[", "").replace("]", "").split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of ints: {text!r}") from None


def _lora_module(text: str) -> tuple[str, str]:
    """``name=path`` or vLLM's JSON form ``{"name": ..., "path": ...}``."""
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
            return str(value["name"]), str(value["path"])
        except (json.JSONDecodeError, KeyError, TypeError):
            raise argparse.ArgumentTypeError(f"not a JSON object with name and path: {text!r}") from None
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"a LoRA module is name=path (or JSON with name and path), got {text!r}")
    return name, path


def add_engine_config_args(parser: argparse.ArgumentParser) -> None:
    """One flag per ``EngineConfig`` field, typed from its annotation."""
    hints = typing.get_type_hints(EngineConfig)
    group = parser.add_argument_group("engine (EngineConfig fields)")
    for f in dataclasses.fields(EngineConfig):
        tp = hints[f.name]
        args = typing.get_args(tp) if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union else ()
        optional = type(None) in args
        base = next((a for a in args if a is not type(None)), tp)
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        help_text = f"EngineConfig.{f.name} (default: {default!r})"
        if base is bool:
            group.add_argument(_flag(f.name), action=argparse.BooleanOptionalAction, default=default, help=help_text)
        elif base is dict or typing.get_origin(base) is dict:
            group.add_argument(_flag(f.name), type=_json_dict, default=default, help=help_text + ", JSON")
        elif typing.get_origin(base) is list:
            group.add_argument(_flag(f.name), type=_optional(_int_list) if optional else _int_list, default=default,
                               help=help_text + ", comma-separated" + (" ('none' for None)" if optional else ""))
        else:
            parse = base if base in (int, float, str) else str
            group.add_argument(_flag(f.name), type=_optional(parse) if optional else parse, default=default,
                               help=help_text + (" ('none' for None)" if optional else ""))


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{name: getattr(args, name) for name in EngineConfig.field_names()})


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``serve`` to the ``pageserve`` command's sub-parsers."""
    p = subparsers.add_parser("serve", help="an OpenAI-compatible HTTP server",
                              description="Serve a model over the OpenAI API (chat, completions, models, metrics).")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--served-model-name", default=None, nargs="+",
                   help="name(s) clients use in 'model' (default: --model)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer <key>'; 'auto' generates one and prints it")
    p.add_argument("--max-waiting-requests", type=int, default=None,
                   help="requests that may wait beyond the running batch before 503 (default max(1024, 4*max_num_seqs))")
    p.add_argument("--max-request-bytes", type=int, default=None,
                   help="largest request body, else 413 (default 4 MiB)")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template, or a file holding one, used instead of the tokenizer's own")
    p.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                   help="serve GET /tokenizer_info (special tokens, chat template), as vLLM's flag")
    p.add_argument("--allowed-origins", default=None, type=json.loads,
                   help='origins a browser page may call the server from, as a JSON list (default \'["*"]\', as '
                        "vLLM; '[]' turns CORS off)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='let requests leave the choice of tools to the model (tool_choice "auto"); needs '
                        "--tool-call-parser")
    p.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help="how tool calls are read from the model's text (hermes: Qwen2.5, Hermes)")
    p.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                   help="split a thinking model's <think> part into reasoning_content (qwen3, deepseek_r1)")
    p.add_argument("--lora-modules", default=None, nargs="+", type=_lora_module, metavar="NAME=PATH",
                   help="LoRA adapters (PEFT folders) served from the start, each a model name requests may use; "
                        "turns --enable-lora on")
    p.add_argument("--tunnel", action="store_true",
                   help="also open a public Cloudflare quick tunnel (needs --api-key)")
    p.add_argument("--log-level", default="info", help="uvicorn's log level (default info)")
    p.add_argument("--switch-interval-ms", type=float, default=None,
                   help="sys.setswitchinterval for the server process, in ms (default: Python's own, 5 ms): how "
                        "long the event loop may hold the GIL before the engine thread gets it back")
    add_engine_config_args(p)
    p.set_defaults(func=run_serve)
    return p


def run_serve(args: argparse.Namespace) -> int:
    """Load the model, serve until Ctrl-C. Returns the exit status."""
    api_key = resolve_api_key(args.api_key)
    if args.tunnel and not api_key:
        print("error: --tunnel makes the server public; it needs --api-key <key> (or --api-key auto)",
              file=sys.stderr)
        return 2
    if args.api_key == "auto":
        print(f"API key (generated): {api_key}", flush=True)
    if args.host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        print(f"warning: serving on {args.host} without --api-key: anyone who can reach this port can use it",
              file=sys.stderr)
    from .api import build_app, load_chat_template, tool_parser

    if args.lora_modules:
        args.enable_lora = True
    try:
        config = engine_config_from_args(args)
        chat_template = load_chat_template(args.chat_template)  # before the model loads: a typo fails fast
        tool_parser(args.enable_auto_tool_choice, args.tool_call_parser)
        if args.allowed_origins is not None and not isinstance(args.allowed_origins, list):
            raise ValueError(f"--allowed-origins takes a JSON list, got {args.allowed_origins!r}")
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.switch_interval_ms is not None:
        if not args.switch_interval_ms > 0:
            print("error: --switch-interval-ms must be > 0", file=sys.stderr)
            return 2
        sys.setswitchinterval(args.switch_interval_ms / 1e3)

    from pageserve.engine.llm_engine import LLMEngine

    from .background import start_server_in_background

    engine = LLMEngine(config, stream_outputs=True)
    try:
        app = build_app(engine, served_model_name=args.served_model_name, api_key=api_key,
                        max_waiting_requests=args.max_waiting_requests, max_request_bytes=args.max_request_bytes,
                        chat_template=chat_template, enable_tokenizer_info=args.enable_tokenizer_info_endpoint,
                        enable_auto_tool_choice=args.enable_auto_tool_choice, tool_call_parser=args.tool_call_parser,
                        allowed_origins=args.allowed_origins, reasoning_parser=args.reasoning_parser,
                        lora_modules=args.lora_modules)
    except ValueError as e:  # a LoRA module this model cannot take
        print(f"error: {e}", file=sys.stderr)
        engine.shutdown()
        return 2
    server = start_server_in_background(app, host=args.host, port=args.port, log_level=args.log_level)
    print(f"pageserve: serving {config.model} on {server.url}/v1 (Ctrl-C to stop)", flush=True)
    if args.tunnel:
        try:
            public = open_tunnel(server.port, api_key)
            print(f"public URL: {public}/v1  (send 'Authorization: Bearer <key>')", flush=True)
        except TunnelError as e:
            print(f"tunnel: {e}", file=sys.stderr, flush=True)
    try:
        while server.thread.is_alive():
            time.sleep(0.5)
    except KeyboardInterrupt:
        print("pageserve: shutting down", file=sys.stderr)
    finally:
        if args.tunnel:
            close_tunnel(server.port)
        server.stop()
    return 0
