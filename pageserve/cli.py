"""The ``pageserve`` command.

    pageserve generate "Why is the sky blue?" [--model M] [--max-tokens N] [--temperature T] …

``generate`` runs one request through the paged engine (``LLMEngine``) and streams the
reply's text as the engine's incremental detokenizer releases it. ``build_parser`` makes
one argparse sub-parser per subcommand, and ``serve`` (the OpenAI-compatible server, ``pageserve.serve.cli``) sits beside ``generate``.

Bad input (an unknown model, a missing file, a bad flag value, a prompt longer than the
context, a device this torch cannot use) ends with one line on stderr and exit status 2.
"""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

from .model.default_model import DEFAULT_MODEL

USAGE_ERROR = 2


def version() -> str:
    from importlib.metadata import PackageNotFoundError, version as dist_version

    try:
        return dist_version("pageserve")
    except PackageNotFoundError:
        return "unknown (not installed)"


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (argparse prints the usage block too)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {n}")
    return n


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"HF directory, hub id, .gguf file, dummy:<config>, or a known name (default {DEFAULT_MODEL})")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:1 …")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and activations (default auto: float32 on the CPU, bfloat16 on the GPU)")
    p.add_argument("--max-model-len", type=_positive_int, default=None,
                   help="longest prompt + reply in tokens (default: the model's context)")
    p.add_argument("--quantization", default=None, choices=["int8"],
                   help="int8: weight-only int8 linears, quantized at load time (default: none)")
    p.add_argument("--deterministic", action="store_true",
                   help="batch-invariant kernels: the same output whatever else runs (docs/deterministic.md)")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=_positive_int, default=256, help="most new tokens (default 256)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default), higher = more random")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default 1: off)")
    p.add_argument("--top-k", type=int, default=-1, help="keep the k most likely tokens (default -1: off)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top probability")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="> 1 discourages repeats (default 1: off)")
    p.add_argument("--seed", type=int, default=None, help="makes a sampled reply reproducible")
    p.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="stop when the reply contains TEXT (repeatable; TEXT is left out)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pageserve", description="An LLM serving engine written from scratch.")
    parser.add_argument("--version", action="version", version=f"pageserve {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    gen = sub.add_parser("generate", help="reply to one prompt, streamed to stdout")
    gen.add_argument("prompt", help="the user message (or the raw text with --no-chat)")
    gen.add_argument("--speculative-tokens", type=_positive_int, default=None, metavar="K",
                     help="speculative decoding: up to K draft tokens a step, looked up in the prompt and reply "
                          "(n-gram; the reply does not change, docs/serving.md#speculative-decoding)")
    _add_model_args(gen)
    _add_sampling_args(gen)
    gen.add_argument("--lora", default=None, metavar="PATH",
                     help="generate with a LoRA adapter (a PEFT folder or hub id; docs/serving.md#lora-adapters)")
    gen.add_argument("--tensor-parallel-size", type=_positive_int, default=1,
                     help="split the model over this many GPUs (or CPU processes); default 1")
    gen.add_argument("--disable-custom-all-reduce", action="store_true",
                     help="tensor parallel: every all-reduce through NCCL (default: small ones through CUDA IPC buffers)")
    gen.add_argument("--system", default=None, help="an optional system message (chat only)")
    gen.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                     help="wrap the prompt in the model's chat template (default; --no-chat: plain text)")
    gen.set_defaults(func=cmd_generate)
    from .serve.cli import add_serve_parser  # the server's flags; its imports are deferred to run time

    add_serve_parser(sub)
    from .serve.bench_client import add_bench_parser

    add_bench_parser(sub)
    return parser


class UsageError(Exception):
    """A problem with what the user asked for; the CLI prints it as one line and exits 2."""


def _sampling_params(args: argparse.Namespace):
    from .engine.sampling_params import SamplingParams

    try:
        return SamplingParams(
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
            repetition_penalty=args.repetition_penalty, seed=args.seed, max_tokens=args.max_tokens,
            stop=args.stop,
        )
    except ValueError as e:  # "SamplingParams.top_p must be …" -> "--top-p must be …"
        msg = str(e)
        if msg.startswith("SamplingParams."):
            name, _, rest = msg.removeprefix("SamplingParams.").partition(" ")
            msg = f"--{name.replace('_', '-')} {rest}"
        raise UsageError(msg) from None


def _speculative(k: int | None) -> dict | None:
    return None if k is None else {"method": "ngram", "num_speculative_tokens": k}


def _lora_rank(path: str | None) -> int:
    """The slot's rank for ``--lora``: the adapter's own (one adapter, so no room for others)."""
    if path is None:
        return 16
    from .model.lora import read_adapter_config

    rank = read_adapter_config(path)[1].get("r")
    return rank if isinstance(rank, int) and rank > 0 else 16  # a bad one is refused by name when it is read


def _build_engine(args: argparse.Namespace):
    from .engine.config import EngineConfig
    from .engine.llm_engine import LLMEngine

    try:
        config = EngineConfig(model=args.model, device=args.device, dtype=args.dtype,
                              max_model_len=args.max_model_len, max_num_seqs=1,
                              tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
                              disable_custom_all_reduce=getattr(args, "disable_custom_all_reduce", False),
                              quantization=args.quantization, deterministic=args.deterministic,
                              speculative_config=_speculative(getattr(args, "speculative_tokens", None)),
                              enable_lora=getattr(args, "lora", None) is not None,
                              max_lora_rank=_lora_rank(getattr(args, "lora", None)),
                              generation_config="none")  # every sampling flag has its own default (greedy)
        engine = LLMEngine(config, stream_outputs=True)
    except (ValueError, OSError) as e:  # ModelLoadError, FileNotFoundError, bad device …
        raise UsageError(str(e)) from None
    if engine.tokenizer is None:
        engine.shutdown()
        raise UsageError(f"{args.model} has no tokenizer (random weights); pass a real model, e.g. --model {DEFAULT_MODEL}")
    return engine


def cmd_generate(args: argparse.Namespace) -> int:
    params = _sampling_params(args)  # flags first: a bad one costs no model load
    engine = _build_engine(args)
    try:
        return _generate(engine, args, params)
    finally:
        engine.shutdown()  # tensor-parallel workers, if any


def _generate(engine, args: argparse.Namespace, params) -> int:
    tok = engine.tokenizer
    if args.chat and tok.has_chat_template:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        prompt = tok.apply_chat_template(messages + [{"role": "user", "content": args.prompt}])
    else:
        prompt = tok.encode(args.prompt)
    lora = None
    if getattr(args, "lora", None) is not None:
        from .engine.lora import LoRARequest

        lora = LoRARequest("cli", 1, args.lora)
    try:
        engine.add_request("cli", prompt, params, lora_request=lora)
    except ValueError as e:  # e.g. a prompt longer than the context, an adapter this model cannot take
        raise UsageError(f"{e}" if lora is not None and "LoRA" in str(e) else f"{e} (--max-model-len)") from None

    printed = 0
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():  # stream_outputs: text that can no longer change
            text = out.outputs[0].text
            sys.stdout.write(text[printed:])
            sys.stdout.flush()
            printed = len(text)
            if out.finished:
                final = out
    sys.stdout.write("\n")
    if final is not None:
        print(_stats_line(engine, final), file=sys.stderr)
    return 0


def _stats_line(engine, out) -> str:
    m, n = out.metrics, out.num_generated_tokens
    ttft = f"TTFT {m.ttft * 1e3:.0f} ms" if m.ttft is not None else "no token"
    if n > 1 and m.finish_time is not None and m.first_token_time is not None and m.finish_time > m.first_token_time:
        decode = f", decode {(n - 1) / (m.finish_time - m.first_token_time):.1f} tok/s"
    else:
        decode = ""
    runner = engine.runner
    dtype = str(runner.dtype).removeprefix("torch.")
    spec = ""
    if engine.proposer is not None:
        st = engine.get_stats()
        spec = (f", drafts {st['spec_accepted_tokens']}/{st['spec_draft_tokens']} accepted"
                f" ({st['spec_tokens_per_drafting_step']:.2f} tokens a drafting step)")
    return (f"[{engine.config.model} on {runner.device} {dtype}: {len(out.prompt_token_ids)} prompt + {n} new tokens "
            f"({out.outputs[0].finish_reason}), {ttft}{decode}{spec}]")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except UsageError as e:
        print(f"pageserve {args.command}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return USAGE_ERROR
    except KeyboardInterrupt:
        print("pageserve: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
