"""The ``pageserve`` command.

    pageserve generate "Why is the sky blue?" [--model M] [--max-tokens N] [--device D] [--dtype T]

``generate`` streams a greedy chat reply from the phase-01 loop (``naive_generate``);
``serve`` runs the OpenAI-compatible server (``pageserve serve --help``, ``pageserve.serve.cli``).
"""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

from .default_model import DEFAULT_MODEL


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"HF directory, hub id, .gguf file, dummy:<config>, or a known name (default {DEFAULT_MODEL})")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:1 …")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pageserve", description="An LLM serving engine written from scratch.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="greedy chat reply to one prompt, streamed to stdout")
    gen.add_argument("prompt", help="the user message")
    _add_model_args(gen)
    gen.add_argument("--max-tokens", type=int, default=256, help="most new tokens (default 256)")
    gen.add_argument("--system", default=None, help="an optional system message")
    gen.add_argument("--raw", action="store_true", help="encode the prompt as plain text, no chat template")
    gen.set_defaults(func=cmd_generate)
    from .serve.cli import add_serve_parser  # the server's flags; its imports are deferred to run time

    add_serve_parser(sub)
    return parser


def cmd_generate(args: argparse.Namespace) -> int:
    from .loader import load_model
    from .naive import naive_generate

    loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    tok = loaded.tokenizer
    if tok is None:
        print(f"error: {loaded.source} has no tokenizer (random weights); use a real model", file=sys.stderr)
        return 2
    if args.raw or not tok.has_chat_template:
        prompt_ids = tok.encode(args.prompt)
    else:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        prompt_ids = tok.apply_chat_template(messages + [{"role": "user", "content": args.prompt}])

    generated: list[int] = []
    printed = ""

    def stream(token: int) -> None:
        # decode everything so far and print only the new, complete part of the text
        nonlocal printed
        generated.append(token)
        text = tok.decode(generated)
        if text.endswith("\ufffd"):
            return  # an incomplete UTF-8 sequence: wait for the next token
        sys.stdout.write(text[len(printed):])
        sys.stdout.flush()
        printed = text

    out = naive_generate(loaded.model, prompt_ids, args.max_tokens, eos_token_ids=loaded.eos_token_ids,
                         on_token=stream)
    sys.stdout.write("\n")
    print(
        f"[{loaded.source} on {loaded.device} {str(loaded.dtype).removeprefix('torch.')}: "
        f"{len(prompt_ids)} prompt + {len(out.token_ids)} new tokens, TTFT {out.ttft_s * 1e3:.0f} ms, "
        f"decode {out.decode_tok_s:.1f} tok/s]",
        file=sys.stderr,
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
