"""The offline API: ``LLM(model, **engine_config_fields).generate(prompts, params)``."""
from __future__ import annotations

import itertools
import time
from typing import Any, Sequence as Seq

from .beam_search import BeamSearch, BeamSearchParams, beam_search_output, take_round
from .config import EngineConfig
from .llm_engine import LLMEngine
from .lora import LoRARequest
from .outputs import RequestMetrics, RequestOutput
from .sampling_params import SamplingParams


class LLM:
    """Batch generation over the paged engine.

    ``LLM("smollm2-135m-instruct", max_num_seqs=64, enable_prefix_caching=True)``: every
    keyword is an ``EngineConfig`` field. ``generate`` and ``chat`` return one
    ``RequestOutput`` per prompt, in input order.
    """

    def __init__(self, model: str = "smollm2-135m-instruct", *, loaded: Any = None, **kwargs: Any) -> None:
        unknown = set(kwargs) - EngineConfig.field_names()
        if unknown:
            raise TypeError(f"LLM got unknown options {sorted(unknown)}; valid: {sorted(EngineConfig.field_names())}")
        self.config = EngineConfig(model=model, **kwargs)
        self.engine = LLMEngine(self.config, loaded, stream_outputs=False)
        self._ids = itertools.count()

    @classmethod
    def from_model(cls, model, tokenizer=None, **kwargs: Any) -> "LLM":
        """An ``LLM`` over an already-built ``Decoder`` (random-weight models, tests)."""
        from types import SimpleNamespace

        loaded = SimpleNamespace(model=model, config=model.cfg, tokenizer=tokenizer, source="in-memory")
        return cls(kwargs.pop("model", "in-memory"), loaded=loaded, **kwargs)

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes (also done by ``__del__`` and at exit)."""
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:
            pass

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_stats(self) -> dict[str, Any]:
        return self.engine.get_stats()

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache, as vLLM's ``LLM.reset_prefix_cache``; False (nothing done) while
        requests are running."""
        return self.engine.reset_prefix_cache()

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.engine.block_manager.hit_rate

    @property
    def num_preemptions(self) -> int:
        return self.engine.scheduler.num_preemptions

    # ------------------------------------------------------------------ generation
    def generate(
        self,
        prompts: str | dict | list[str] | list[int] | list[list[int]] | list[dict],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Seq[int] | None = None,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids; vLLM's ``{"prompt": text}`` and ``{"prompt_token_ids":
        ids}`` dicts too); results in input order. With no
        ``sampling_params``: ``SamplingParams`` with the engine's ``sampling_defaults`` (the model's
        generation_config.json, see ``EngineConfig.generation_config``) over its own defaults.
        ``priority``: one a prompt, lower first (``scheduling_policy="priority"``). ``lora_request``: a LoRA
        adapter for every prompt, or one (or None) a prompt (``enable_lora=True``)."""
        return self._run(_prompt_list(prompts), sampling_params, use_tqdm, priority, lora_request)

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        priority: Seq[int] | None = None,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of ``{"role", "content"}``) or a list of them.

        As vLLM's ``LLM.chat``: ``continue_final_message`` continues the last (assistant) message instead of
        starting a new one (with ``add_generation_prompt=False``); ``tools`` (OpenAI-style definitions),
        ``chat_template`` (in place of the tokenizer's) and ``chat_template_kwargs`` go to the template. The
        replies are text: tool calls in them are not parsed (the server does that, ``serve/tools.py``).
        ``priority`` and ``lora_request``: one a conversation (or one for all), as in ``generate``."""
        if self.tokenizer is None:
            raise ValueError(f"model {self.config.model!r} has no tokenizer, so no chat template")
        if not isinstance(messages, (list, tuple)):
            raise ValueError(f"messages must be a list of {{'role', 'content'}} dicts or a list of those; got {type(messages).__name__}")
        if add_generation_prompt and continue_final_message:
            raise ValueError("continue_final_message needs add_generation_prompt=False")
        kwargs = dict(chat_template_kwargs or {})
        if tools:
            kwargs["tools"] = tools
        if continue_final_message:
            kwargs["continue_final_message"] = True
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt, chat_template=chat_template, **kwargs)
                   for c in convs]
        return self._run(prompts, sampling_params, use_tqdm, priority, lora_request)

    def beam_search(
        self,
        prompts: str | dict | list[str] | list[int] | list[list[int]] | list[dict],
        params: BeamSearchParams,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Beam search for every prompt (as ``generate`` takes them), as vLLM's ``LLM.beam_search``; results in input
        order, each ``RequestOutput`` holding ``params.beam_width`` beams best first (``beam_search.py`` has
        the rules: Hugging Face's ``num_beams`` search with ``early_stopping="never"``). The searches of all
        prompts share each round's engine steps; with prefix caching on (the default) a round recomputes only
        each beam's tail past its last full block."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        prompts = _prompt_list(prompts)
        loras = _per_prompt(lora_request, len(prompts))
        engine = self.engine
        searches: list[BeamSearch] = []
        for p in prompts:
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise ValueError(f"model {self.config.model!r} has no tokenizer; pass token ids")
                ids = list(self.tokenizer.encode(p))  # as add_request encodes a text prompt
            else:
                ids = [int(t) for t in p]
            searches.append(BeamSearch(ids, params, engine.eos_token_ids, engine.max_model_len))
        start = time.perf_counter()
        metrics = [RequestMetrics(arrival_time=start) for _ in searches]
        pbar = None
        if use_tqdm and len(searches) > 1:
            from tqdm.auto import tqdm

            pbar = tqdm(total=len(searches), desc="beam search", unit="req")
        try:
            while True:
                active = [i for i, s in enumerate(searches) if not s.done]
                if not active:
                    break
                asks = [(i, ids) for i in active for ids in searches[i].requests()]
                outs = self._run([ids for _, ids in asks], [searches[i].round_params for i, _ in asks], False,
                                 None, [loras[i] for i, _ in asks])
                failed = [o.request_id for o in outs if o.outputs[0].finish_reason == "error"]
                if failed:
                    raise RuntimeError(f"beam search: the engine failed the round's requests {failed}")
                take_round(searches, active, outs, metrics, time.perf_counter())
                if pbar is not None:
                    pbar.update(sum(searches[i].done for i in active))
        finally:
            if pbar is not None:
                pbar.close()
        tok = self.tokenizer

        def decode(ids: list[int], skip: bool) -> str:
            return "" if tok is None else tok.decode(ids, skip_special_tokens=skip)

        return [beam_search_output(f"beam-{next(self._ids)}", p if isinstance(p, str) else None, s, decode, m)
                for p, s, m in zip(prompts, searches, metrics)]

    def _run(self, prompts: list, sampling_params, use_tqdm: bool, priority: Seq[int] | None = None,
             lora_request=None) -> list[RequestOutput]:
        if sampling_params is None:
            params = [SamplingParams(**self.engine.sampling_defaults)] * len(prompts)
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(priorities)} priorities")
        loras = _per_prompt(lora_request, len(prompts))
        engine = self.engine
        ids = [f"gen-{next(self._ids)}" for _ in prompts]
        added: list[str] = []
        try:
            for rid, prompt, p, prio, lora in zip(ids, prompts, params, priorities, loras):
                engine.add_request(rid, prompt, p, priority=prio, lora_request=lora)
                added.append(rid)
        except Exception:
            engine.abort_request(added)  # leave the engine as it was
            raise
        order = {rid: i for i, rid in enumerate(ids)}
        results: list[RequestOutput | None] = [None] * len(ids)
        pbar = None
        if use_tqdm and len(ids) > 1:
            from tqdm.auto import tqdm

            pbar = tqdm(total=len(ids), desc="generate", unit="req")
        try:
            remaining = len(ids)
            while remaining:
                for out in engine.step():
                    i = order.get(out.request_id)
                    if i is not None and out.finished and results[i] is None:
                        results[i] = out
                        remaining -= 1
                        if pbar is not None:
                            pbar.update(1)
        except BaseException:
            engine.abort_request([rid for rid, r in zip(ids, results) if r is None])
            raise
        finally:
            if pbar is not None:
                pbar.close()
        return results  # type: ignore[return-value]


def _per_prompt(lora_request, count: int) -> list:
    """One LoRA request (or None) for every prompt, or the list given with one a prompt."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * count
    loras = list(lora_request)
    if len(loras) != count:
        raise ValueError(f"got {count} prompts but {len(loras)} LoRA requests")
    return loras


def _prompt_list(prompts) -> list[str | list[int]]:
    """The prompts as a list, each text or token ids: one prompt (a string, a list of token ids, or vLLM's
    ``{"prompt": text}`` / ``{"prompt_token_ids": ids}``) or a list of them."""
    if isinstance(prompts, (str, dict)) or (
        isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts)
    ):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise ValueError("prompts must be a string, a list of token ids, a {'prompt': ...} or "
                         f"{{'prompt_token_ids': ...}} dict, or a list of those; got {type(prompts).__name__}")
    out = []
    for p in prompts:
        if isinstance(p, dict):
            keys = set(p)
            if keys == {"prompt_token_ids"}:
                p = list(p["prompt_token_ids"])
            elif keys == {"prompt"}:
                p = p["prompt"]
            else:
                raise ValueError(f"a prompt dict holds either 'prompt' (text) or 'prompt_token_ids', and nothing "
                                 f"else; got keys {sorted(keys)}")
        out.append(p)
    return out
