"""The engine step: schedule -> one model forward -> postprocess.

``LLMEngine`` owns the requests, the scheduler, the block manager and the model runner.
The offline ``LLM`` API and the server both drive it through ``add_request`` / ``step`` /
``abort_request``.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterable

from .block_manager import BlockManager
from .config import EngineConfig
from .lora import LoRARequest
from .model_runner import ModelRunner
from .outputs import CompletionOutput, RequestMetrics, RequestOutput
from .sampling_params import SamplingParams, child_seed
from .scheduler import Scheduler
from .sequence import Sequence
from .speculative import NgramProposer, SpeculativeConfig, accepted_prefix

logger = logging.getLogger(__name__)


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    arrival_time: float

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


@dataclass
class _Inflight:
    """A launched step: its sampling sequences (row order) and its sampler output."""

    seqs: list[Sequence]
    out: Any  # SamplerOutput
    has_prefill: bool = False  # the step computed prompt tokens (a chunk or a recomputation)
    # speculative decoding: each sampling sequence's drafts this step (its rows: one per draft, then one)
    drafts: list[list[int]] | None = None


@dataclass
class EngineStats:
    num_steps: int = 0
    num_requests_added: int = 0
    num_requests_finished: int = 0
    num_prompt_tokens: int = 0  # prompt tokens of admitted sequences (n per request)
    num_prefill_tokens_computed: int = 0  # prompt chunks + recomputation actually run
    num_decode_tokens_computed: int = 0
    num_generated_tokens: int = 0
    step_time_s: float = 0.0  # wall time inside step(), split below
    host_time_s: float = 0.0  # scheduling + input preparation + launch
    wait_time_s: float = 0.0  # waiting for a launched step's sampled tokens
    postprocess_time_s: float = 0.0  # append, detokenize, stop checks, outputs
    num_mixed_steps: int = 0  # step() calls whose landed step computed prompt tokens
    num_decode_steps: int = 0  # step() calls whose landed step was decodes only
    num_spec_draft_tokens: int = 0  # speculative decoding: drafts computed
    num_spec_accepted_tokens: int = 0  # of those, confirmed by the model's own draws
    num_spec_drafting_steps: int = 0  # sequence-steps that carried drafts


@dataclass
class StepTiming:
    """Where the last ``step()`` call spent its time, read by the server after each call.

    Wall seconds from ``time.perf_counter``; each ``*_cpu_s`` is this thread's CPU time over
    the same span (``time.thread_time``), so ``wall - cpu`` is time the thread was off the
    CPU: waiting to get the GIL back, or blocked in the kernel. No field needs a device sync.

    ``host_s`` = ``total_s - wait_s - post_s``: scheduling (``sched_s``), input preparation
    and launch (``launch_s``, the runner's ``execute``), and bookkeeping. ``kind`` is
    "mixed" when the step whose tokens landed in this call computed prompt tokens (its
    device time is what ``wait_s`` waited for), else "decode"; with nothing landed it is the
    kind of the step launched; "" when the call ran nothing."""

    total_s: float = 0.0
    total_cpu_s: float = 0.0
    sched_s: float = 0.0
    launch_s: float = 0.0
    launch_cpu_s: float = 0.0
    wait_s: float = 0.0
    wait_cpu_s: float = 0.0
    post_s: float = 0.0
    post_cpu_s: float = 0.0
    kind: str = ""
    num_seqs: int = 0  # sequences in the launched batch
    num_tokens: int = 0  # tokens in the launched batch

    @property
    def host_s(self) -> float:
        return self.total_s - self.wait_s - self.post_s

    @property
    def host_cpu_s(self) -> float:
        return self.total_cpu_s - self.wait_cpu_s - self.post_cpu_s


class LLMEngine:
    """A paged-KV engine over one model.

    ``stream_outputs``: ``step()`` returns a ``RequestOutput`` for every request that got
    new tokens (True, for streaming) or only for the requests that finished (False, for
    offline generation, which then also detokenizes once at the end unless stop strings
    need incremental text).
    """

    def __init__(self, config: EngineConfig, loaded: Any = None, stream_outputs: bool = True) -> None:
        self.config = config
        spec = SpeculativeConfig.parse(config.speculative_config)
        if spec is not None and config.async_scheduling:  # EngineConfig turns it off; a later assignment may not
            raise ValueError("speculative decoding needs async_scheduling=False: drafts are looked up from "
                             "tokens the host must already have")
        own_model = loaded is None
        if loaded is None:
            from ..model.loader import load_model

            loaded = load_model(
                config.model, device=config.device, dtype=config.dtype, seed=config.seed,
                max_model_len=config.max_model_len, quantization=config.quantization,
            )
        elif config.quantization is not None:  # a model loaded by the caller: quantize it here (in place)
            from ..model.quant import quantize_model

            quantize_model(loaded.model, config.quantization)
        self.model = loaded.model
        self.model_config = loaded.config
        self.tokenizer = getattr(loaded, "tokenizer", None)
        self.stream_outputs = stream_outputs
        # what a server request leaves unset, and LLM.generate without params, gets (generation_config)
        self.sampling_defaults, self.max_tokens_limit = resolve_sampling_defaults(config, loaded)

        eos = set(self.model_config.eos_token_ids or [])
        if self.tokenizer is not None:
            eos |= set(getattr(self.tokenizer, "eos_token_ids", None) or [])
        self.eos_token_ids = eos
        if config.tensor_parallel_size > 1:  # rank 0 here, workers started (tensor_parallel.py)
            from .tensor_parallel import start_tensor_parallel

            self.runner = start_tensor_parallel(self.model, config, sorted(eos), copy_model=not own_model)
            self.model = self.runner.model  # this rank's shard
        else:
            self.runner = ModelRunner(self.model, config, eos_token_ids=sorted(eos))

        max_len = config.max_model_len or self.model_config.max_position_embeddings
        max_len = min(max_len, getattr(self.model, "max_positions", max_len))
        capacity = self.runner.num_blocks * config.block_size
        if max_len > capacity:
            logger.warning(
                "max_model_len %d exceeds the KV pool (%d blocks x %d = %d tokens); capping it",
                max_len, self.runner.num_blocks, config.block_size, capacity,
            )
            max_len = capacity
        self.max_model_len = max_len

        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, config.max_num_batched_tokens, config.enable_chunked_prefill,
            policy=config.scheduling_policy, max_loras=config.max_loras if config.enable_lora else None,
        )
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats()
        self.last_step = StepTiming()  # reset by every step() call
        self._inflight: _Inflight | None = None  # the launched step whose tokens are not appended yet
        self.grammar = None  # structured_output.GrammarCompiler, made at the first request that needs one
        self.proposer = None if spec is None else NgramProposer(spec)

    @classmethod
    def from_model(cls, model, config: EngineConfig, tokenizer=None, stream_outputs: bool = True) -> "LLMEngine":
        """An engine over an already-built ``Decoder`` (tests, random-weight models)."""
        loaded = SimpleNamespace(model=model, config=model.cfg, tokenizer=tokenizer, source="in-memory")
        return cls(config, loaded, stream_outputs=stream_outputs)

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        cache_salt: str | None = None,
    ) -> None:
        """Queue a request. Raises ValueError (and changes nothing) for a duplicate id, an
        empty or too long prompt, token ids outside the vocabulary, or bad parameters.
        ``priority``: lower runs first, with ``scheduling_policy="priority"`` only (else it must be 0).
        ``lora_request``: the LoRA adapter it runs with (``enable_lora``; read from its folder the first
        time it is named, ``add_lora``). ``cache_salt`` (vLLM's): requests with different salts (or one with a salt
        and one without) never share prefix-cache blocks, so one tenant cannot time another's cached prompts."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"request {request_id!r}: priority must be an integer, got {priority!r}")
        if priority and self.config.scheduling_policy != "priority":
            raise ValueError(f"request {request_id!r}: priority {priority} needs the priority scheduling policy "
                             "(scheduling_policy='priority', --scheduling-policy priority); this engine runs fcfs")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError(f"request {request_id!r}: cache_salt must be a non-empty string, got {cache_salt!r}")
        if params is None:
            params = SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"request {request_id!r}: params must be a SamplingParams, got {type(params).__name__}")
        text: str | None = None
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    f"request {request_id!r}: this model ({self.config.model}) has no tokenizer; pass token ids"
                )
            text = prompt
            ids = list(self.tokenizer.encode(prompt))
            vocab = self.model_config.vocab_size
            if ids and max(ids) >= vocab:  # a tokenizer wider than the model (a lent or mismatched one)
                raise ValueError(f"request {request_id!r}: the tokenizer gave token ids {[t for t in ids if t >= vocab][:5]} "
                                 f"outside the model's vocabulary [0, {vocab})")
        else:
            try:
                ids = [int(t) for t in prompt]
            except (TypeError, ValueError):
                raise ValueError(f"request {request_id!r}: prompt must be a string or a list of token ids") from None
            vocab = self.model_config.vocab_size
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"request {request_id!r}: token ids {bad[:5]} outside the vocabulary [0, {vocab})")
        if params.truncate_prompt_tokens is not None:
            ids = ids[-params.truncate_prompt_tokens:]
        if not ids:
            raise ValueError(f"request {request_id!r}: the prompt is empty")
        if params.prompt_logprobs is not None and self.config.tensor_parallel_size > 1:
            raise ValueError(f"request {request_id!r}: prompt_logprobs is not supported with tensor parallelism")
        vocab = self.model_config.vocab_size
        for name, given in (("logit_bias", params.logit_bias), ("allowed_token_ids", params.allowed_token_ids)):
            outside = [t for t in (given or ()) if t >= vocab]
            if outside:
                raise ValueError(f"request {request_id!r}: {name} names token ids {outside[:5]} outside the "
                                 f"vocabulary [0, {vocab})")
        if params.bad_words and params._bad_words_ids is None:
            if self.tokenizer is None:
                raise ValueError(f"request {request_id!r}: bad_words need the model's tokenizer, and this model "
                                 f"({self.config.model}) has none")
            params._bad_words_ids = bad_word_token_ids(self.tokenizer, params.bad_words)
        matcher = None
        if params.structured_outputs is not None:
            matcher = self._matcher(request_id, params)
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"request {request_id!r}: the prompt has {len(ids)} tokens; max_model_len is "
                f"{self.max_model_len} (the prompt plus at least one generated token must fit); "
                "shorten the prompt or raise max_model_len"
            )
        if not self.config.enable_chunked_prefill and len(ids) > self.config.max_num_batched_tokens:
            raise ValueError(
                f"request {request_id!r}: the prompt has {len(ids)} tokens, more than "
                f"max_num_batched_tokens={self.config.max_num_batched_tokens}, and chunked prefill is off"
            )
        if lora_request is not None:
            try:
                self.add_lora(lora_request)
            except ValueError as e:
                raise ValueError(f"request {request_id!r}: {e}") from None
        now = time.perf_counter() if arrival_time is None else arrival_time
        seqs = []
        for i in range(params.n):
            seed = child_seed(params.seed, i)
            seq = Sequence(request_id, ids, params, index=i, seed=seed, arrival_time=now, priority=priority,
                           lora_request=lora_request, cache_salt=cache_salt)
            if matcher is not None:
                seq.matcher = matcher if i == 0 else matcher.deep_copy()
            if self.tokenizer is not None and (self.stream_outputs or params.stop):
                from .detokenizer import IncrementalDetokenizer

                seq.detokenizer = IncrementalDetokenizer(
                    self.tokenizer.hf, ids, skip_special_tokens=params.skip_special_tokens,
                    stop=params.stop or None, include_stop_str_in_output=params.include_stop_str_in_output,
                )
            seqs.append(seq)
        self.requests[request_id] = Request(request_id, text, ids, params, seqs, now)
        if params.prompt_logprobs is not None:
            self.runner.prompt_logprobs_asked = True
        if matcher is not None:
            self.runner.grammar = self.grammar
        for seq in seqs:
            self.scheduler.add(seq)
        self.stats.num_requests_added += 1
        self.stats.num_prompt_tokens += len(ids) * params.n

    # ------------------------------------------------------------------ LoRA adapters
    def add_lora(self, lora_request: LoRARequest, adapter=None) -> bool:
        """Know a LoRA adapter (read from ``lora_request.lora_path`` unless ``adapter``, a
        ``model.lora.LoRAAdapter``, is given). False if it was known already. ValueError when LoRA is off, for
        an adapter this model cannot take, or for an id or name taken by another adapter."""
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        if self.runner.lora is None:
            raise ValueError(f"LoRA adapter {lora_request.lora_name!r}: this engine was started without "
                             "enable_lora (--enable-lora)")
        return self.runner.lora.add(lora_request, adapter)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter: False if it was not known; ValueError while a request still uses it."""
        manager = self.runner.lora
        if manager is None or lora_int_id not in manager.adapters:
            return False
        users = [r.request_id for r in self.requests.values() if r.seqs and r.seqs[0].lora_id == lora_int_id]
        if users:
            raise ValueError(f"LoRA adapter {manager.adapters[lora_int_id][0].lora_name!r} is in use by "
                             f"{len(users)} request(s), e.g. {users[0]!r}")
        manager.remove(lora_int_id)
        return True

    def list_loras(self) -> list[LoRARequest]:
        """The adapters the engine knows."""
        return [] if self.runner.lora is None else self.runner.lora.requests()

    def _matcher(self, request_id: str, params: SamplingParams):
        """A fresh llguidance matcher for the request's structured-output constraint (raises
        ``ValueError`` when the model has no tokenizer or the constraint does not compile)."""
        if self.tokenizer is None:
            raise ValueError(f"request {request_id!r}: structured outputs need the model's tokenizer, "
                             f"and this model ({self.config.model}) has none")
        if self.grammar is None:
            from .structured_output import GrammarCompiler

            self.grammar = GrammarCompiler(self.tokenizer.hf, self.model_config.vocab_size, sorted(self.eos_token_ids))
            self.grammar.pin_masks = self.runner.device.type == "cuda"
        try:
            return self.grammar.matcher(params.structured_outputs)
        except ValueError as e:
            raise ValueError(f"request {request_id!r}: {e}") from None

    def abort_request(self, request_id: str | Iterable[str]) -> list[RequestOutput]:
        """Stop requests now (finish_reason "abort") and free their blocks; unknown ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        outs = []
        for rid in ids:
            req = self.requests.pop(rid, None)
            if req is None:
                continue
            now = time.perf_counter()
            for seq in req.seqs:
                if not seq.is_finished:
                    self._finish(seq, "abort", now)
            self.stats.num_requests_finished += 1
            outs.append(self._make_output(req))
        self.scheduler.remove_finished()
        return outs

    abort = abort_request

    def abort_all(self) -> list[RequestOutput]:
        """Abort every request and drop the step in flight: the way back to a clean engine
        after ``step()`` raised (the server then keeps serving new requests)."""
        outs = self.abort_request(list(self.requests))
        self._inflight = None
        return outs

    def shutdown(self) -> None:
        """Stop tensor-parallel workers, if any (idempotent; a no-op at size 1)."""
        stop = getattr(self.runner, "shutdown", None)
        if stop is not None:
            stop()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache (``BlockManager.reset_prefix_cache``); False while requests hold blocks."""
        return self.block_manager.reset_prefix_cache()

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """Schedule, launch one forward over every scheduled token, and postprocess a step.

        With ``async_scheduling`` (the default) the step launched here is postprocessed by
        the next call: this call first launches step N+1, then waits for step N's tokens
        and appends them, so the host's scheduling and input preparation overlap the
        device's forward. Where a row of step N+1 samples from host state that step N's
        tokens change (bad words match the newest outputs; a grammar's mask follows them),
        step N is landed between N+1's forward launch and its sampling's: the forward still
        overlaps the host's work. Penalties need no landing: they read step N's tokens from
        the device. Returned outputs are those of the step postprocessed here."""
        t0, c0 = time.perf_counter(), time.thread_time()
        timing = self.last_step = StepTiming()
        landed_prefill: bool | None = None  # None: no step landed in this call
        sched = self.scheduler
        outputs: list[RequestOutput] = []
        ts = time.perf_counter()
        if self.proposer is not None:
            self.proposer.propose(sched.running, self.max_model_len)
        batch = sched.schedule()
        timing.sched_s = time.perf_counter() - ts
        if batch.is_empty:
            if self._inflight is not None:  # nothing new to run: land the step in flight
                landed_prefill = self._inflight.has_prefill
                outputs += self._postprocess(self._take_inflight())
            if landed_prefill is not None:
                timing.kind = "mixed" if landed_prefill else "decode"
            self._close_timing(t0, c0)
            if outputs:
                return outputs
            if sched.has_unfinished() and not batch.preempted:
                # Cannot happen while max_model_len fits the pool; say so rather than spin.
                raise RuntimeError(
                    f"scheduler made no progress with {len(sched.waiting)} waiting and "
                    f"{len(sched.running)} running sequences ({self.block_manager.num_free_blocks} free blocks)"
                )
            return []
        prev = self._inflight
        landed: list[RequestOutput] | None = None  # step N's outputs, when landed before N+1's sampling
        land_s = land_cpu_s = 0.0

        def land_prev() -> None:
            nonlocal landed, land_s, land_cpu_s
            t, c = time.perf_counter(), time.thread_time()
            landed = self._postprocess(prev)
            land_s, land_cpu_s = time.perf_counter() - t, time.thread_time() - c

        hook = None
        if prev is not None and any(s.params.needs_landed_outputs or s.matcher is not None for s in batch.sampling_seqs):
            hook = land_prev
        tl, cl = time.perf_counter(), time.thread_time()
        out = self.runner.execute(batch, None if prev is None else prev.out.token_ids_gpu, before_sampling=hook)
        timing.launch_s = time.perf_counter() - tl - land_s
        timing.launch_cpu_s = time.thread_time() - cl - land_cpu_s
        sched.update_after_step(batch)
        timing.num_seqs, timing.num_tokens = len(batch), batch.num_batched_tokens

        st = self.stats
        st.num_steps += 1
        st.num_prefill_tokens_computed += batch.num_prefill_tokens
        st.num_decode_tokens_computed += batch.num_batched_tokens - batch.num_prefill_tokens

        launched = None
        if out is not None:
            launched = _Inflight(batch.sampling_seqs, out, has_prefill=batch.num_prefill_tokens > 0)
            if batch.num_spec_tokens:
                launched.drafts = [s.spec_token_ids[:d] for s, d, smp in zip(batch.seqs, batch.spec, batch.samples)
                                   if smp]
            max_len = self.max_model_len
            for row, seq in enumerate(launched.seqs):
                seq.num_pending += 1
                seq.pending_row = row
                mt = seq.params.max_tokens
                if (mt is not None and seq.num_output_tokens >= mt) or seq.num_tokens >= max_len:
                    seq.length_capped = True
        self._inflight = launched
        if prev is not None:
            landed_prefill = bool(landed_prefill) | prev.has_prefill
            outputs += landed if landed is not None else self._postprocess(prev)
        if not self.config.async_scheduling and launched is not None:
            landed_prefill = bool(landed_prefill) | launched.has_prefill
            outputs += self._postprocess(self._take_inflight())
        if landed_prefill is None:
            landed_prefill = batch.num_prefill_tokens > 0
        timing.kind = "mixed" if landed_prefill else "decode"
        self._close_timing(t0, c0)
        return outputs

    def _close_timing(self, t0: float, c0: float) -> None:
        """Finish ``last_step`` and add it to the running totals."""
        timing, st = self.last_step, self.stats
        timing.total_s, timing.total_cpu_s = time.perf_counter() - t0, time.thread_time() - c0
        st.step_time_s += timing.total_s
        st.wait_time_s += timing.wait_s
        st.postprocess_time_s += timing.post_s
        st.host_time_s += timing.host_s
        if timing.kind == "mixed":
            st.num_mixed_steps += 1
        elif timing.kind == "decode":
            st.num_decode_steps += 1

    def _take_inflight(self) -> "_Inflight":
        inflight, self._inflight = self._inflight, None
        return inflight

    def _postprocess(self, step: "_Inflight") -> list[RequestOutput]:
        """Append a launched step's sampled tokens (waiting for them if needed), run the stop
        checks, and build the outputs to report."""
        out = step.out
        t0, c0 = time.perf_counter(), time.thread_time()
        token_ids = out.token_ids  # waits for the device
        lp, top = out.logprobs, out.top_logprobs
        now, c1 = time.perf_counter(), time.thread_time()
        timing = self.last_step
        timing.wait_s += now - t0
        timing.wait_cpu_s += c1 - c0
        try:
            return self._land(step, token_ids, lp, top, now)
        finally:
            timing.post_s += time.perf_counter() - now
            timing.post_cpu_s += time.thread_time() - c1

    def _land(self, step: "_Inflight", token_ids: list[int], lp, top, now: float) -> list[RequestOutput]:
        if step.drafts is not None:
            return self._land_speculative(step, token_ids, lp, top, now)
        touched: dict[str, Request] = {}  # requests with something to report
        stream = self.stream_outputs
        appended = 0
        for row, (seq, tok) in enumerate(zip(step.seqs, token_ids)):
            seq.num_pending -= 1
            if seq.is_finished:  # aborted, or stopped while this token was in flight: dropped
                continue
            try:
                self._append_token(
                    seq, tok, now,
                    None if lp is None else lp[row], None if top is None else top[row],
                )
                appended += 1
            except Exception:
                logger.exception("request %r failed in postprocessing; finishing it with 'error'", seq.request_id)
                self._finish(seq, "error", now)
            if stream or seq.is_finished:
                touched[seq.request_id] = self.requests[seq.request_id]
        return self._outputs_of(touched, appended, now)

    def _land_speculative(self, step: "_Inflight", token_ids: list[int], lp, top, now: float) -> list[RequestOutput]:
        """``_land`` for a step with drafts: a sequence's rows are its d drafts' positions and one more. The
        drafts the drawn tokens confirm are kept (their K/V is in the cache: ``num_computed_tokens`` moves past
        them), and the drawn tokens up to the first that differs from its draft are appended, one at a time
        with every stop check (engine/speculative.py)."""
        touched: dict[str, Request] = {}
        bm, st = self.block_manager, self.stats
        appended = row = 0
        for seq, drafts in zip(step.seqs, step.drafts):
            d = len(drafts)
            rows = range(row, row + d + 1)
            row += d + 1
            seq.num_pending -= 1
            if seq.is_finished:
                continue
            drawn = token_ids[rows.start:rows.stop]
            n = accepted_prefix(drawn, drafts)
            if d:
                st.num_spec_draft_tokens += d
                st.num_spec_accepted_tokens += n
                st.num_spec_drafting_steps += 1
                seq.num_computed_tokens += n  # the confirmed drafts' K/V; the rest is written over later
            try:
                for r, tok in zip(rows, drawn[:n + 1]):
                    self._append_token(seq, tok, now, None if lp is None else lp[r], None if top is None else top[r])
                    appended += 1
                    if seq.is_finished:
                        break
                if n and bm.enable_prefix_caching and not seq.is_finished:
                    bm.cache_full_blocks(seq)
            except Exception:
                logger.exception("request %r failed in postprocessing; finishing it with 'error'", seq.request_id)
                self._finish(seq, "error", now)
            if self.stream_outputs or seq.is_finished:
                touched[seq.request_id] = self.requests[seq.request_id]
        return self._outputs_of(touched, appended, now)

    def _outputs_of(self, touched: dict[str, Request], appended: int, now: float) -> list[RequestOutput]:
        """After a step's tokens are appended: drop the finished sequences from the running queue and build
        the outputs to report for the requests in ``touched``."""
        self.scheduler.remove_finished()
        st = self.stats
        st.num_generated_tokens += appended

        outputs = []
        for rid, req in touched.items():
            finished = req.finished
            if not (finished or self.stream_outputs):
                continue
            try:
                outputs.append(self._make_output(req))
            except Exception:
                logger.exception("request %r failed building its output; finishing it with 'error'", rid)
                for seq in req.seqs:
                    self._finish(seq, "error", now)
                self.scheduler.remove_finished()
                outputs.append(self._make_output(req, safe=True))
                finished = True
            if finished:
                del self.requests[rid]
                st.num_requests_finished += 1
        return outputs

    def _append_token(self, seq: Sequence, tok: int, now: float, logprob: float | None, top) -> None:
        seq.output_token_ids.append(tok)
        seq.token_times.append(now)
        if seq.first_token_time is None:
            seq.first_token_time = now
        p = seq.params
        if p.logprobs is not None and logprob is not None:
            if seq.logprobs is None:
                seq.logprobs = []
            entry = {tok: logprob}
            if top:
                for t, v in top:
                    entry.setdefault(t, v)
            seq.logprobs.append(entry)
            seq.cumulative_logprob += logprob
        n_out = len(seq.output_token_ids)
        reason = None
        if n_out >= p.min_tokens:
            if not p.ignore_eos and tok in self.eos_token_ids:
                reason = "stop"
            elif p.stop_token_ids and tok in p.stop_token_ids:
                reason, seq.stop_reason = "stop", tok
        matcher = seq.matcher
        if matcher is not None and not matcher.consume_token(tok):
            raise RuntimeError(f"the structured-output grammar rejected token {tok}: {matcher.get_error()}")
        det = seq.detokenizer
        if det is not None and reason is None:  # stop tokens never reach the text
            det.add(tok)
            if det.stopped and n_out >= p.min_tokens:
                reason, seq.stop_reason = "stop", det.stop_reason
        if reason is None and matcher is not None and matcher.is_stopped():
            reason = "stop"  # the grammar is complete: nothing may follow
        if reason is None and ((p.max_tokens is not None and n_out >= p.max_tokens) or seq.num_known_tokens >= self.max_model_len):
            reason = "length"
        if reason is not None:
            self._finish(seq, reason, now)

    def _finish(self, seq: Sequence, reason: str, now: float) -> None:
        if seq.is_finished:
            return
        self.scheduler.finish(seq, reason)
        seq.finish_time = now
        try:
            self._final_text(seq)
        except Exception:
            logger.exception("request %r: detokenizing failed", seq.request_id)
            seq.finish_reason = "error"

    def _final_text(self, seq: Sequence) -> None:
        det = seq.detokenizer
        if det is not None:
            det.flush()
            seq.text = det.text
        elif self.tokenizer is not None:
            ids = seq.output_token_ids
            if seq.finish_reason == "stop" and ids and (ids[-1] in self.eos_token_ids or ids[-1] in seq.params.stop_token_ids):
                ids = ids[:-1]
            seq.text = self.tokenizer.decode(ids, skip_special_tokens=seq.params.skip_special_tokens)

    def _make_output(self, req: Request, safe: bool = False) -> RequestOutput:
        """The request's cumulative output (a snapshot: later steps never change it).

        Runs once per request per step while streaming, so the common case (n=1) takes a
        path without generators (measured in NOTES.md, serving follow-up)."""
        seqs = req.seqs
        if len(seqs) == 1:
            seq = seqs[0]
            finished = seq.is_finished
            metrics = RequestMetrics(
                arrival_time=req.arrival_time,
                first_token_time=seq.first_token_time,
                finish_time=seq.finish_time if finished else None,
                num_cached_tokens=seq.num_cached_tokens,
                inter_token_latencies=_gaps(seq.token_times) if finished else [],
            )
            return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, [_completion(seq, safe)],
                                 finished, metrics, _prompt_logprobs(seq))
        outs = [_completion(seq, safe) for seq in seqs]
        firsts = [s.first_token_time for s in seqs if s.first_token_time is not None]
        finishes = [s.finish_time for s in seqs if s.finish_time is not None]
        finished = req.finished
        itl = []  # built once, at the end: streaming would otherwise redo it every step
        if finished:
            for s in seqs:
                itl.extend(_gaps(s.token_times))
        metrics = RequestMetrics(
            arrival_time=req.arrival_time,
            first_token_time=min(firsts) if firsts else None,
            finish_time=max(finishes) if finished and finishes else None,
            num_cached_tokens=seqs[0].num_cached_tokens,  # admitted first: the others may hit its blocks
            inter_token_latencies=itl,
        )
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, finished, metrics,
                             _prompt_logprobs(seqs[0]))

    # ------------------------------------------------------------------ stats
    def get_stats(self) -> dict[str, Any]:
        bm, st = self.block_manager, self.stats
        return {
            "num_steps": st.num_steps,
            "num_requests_added": st.num_requests_added,
            "num_requests_finished": st.num_requests_finished,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_preemptions": self.scheduler.num_preemptions,
            "prompt_tokens": st.num_prompt_tokens,
            "prefill_tokens_computed": st.num_prefill_tokens_computed,
            "decode_tokens_computed": st.num_decode_tokens_computed,
            "generated_tokens": st.num_generated_tokens,
            "prefix_cache_queried_tokens": bm.num_queried_tokens,
            "prefix_cache_hit_tokens": bm.num_hit_tokens,
            "prefix_cache_hit_rate": bm.hit_rate,
            "num_blocks": bm.num_blocks,
            "num_free_blocks": bm.num_free_blocks,
            "block_size": bm.block_size,
            "max_model_len": self.max_model_len,
            "step_time_s": st.step_time_s,
            "host_time_s": st.host_time_s,
            "wait_time_s": st.wait_time_s,
            "postprocess_time_s": st.postprocess_time_s,
            "num_mixed_steps": st.num_mixed_steps,
            "num_decode_steps": st.num_decode_steps,
            "spec_draft_tokens": st.num_spec_draft_tokens,
            "spec_accepted_tokens": st.num_spec_accepted_tokens,
            "spec_acceptance_rate": st.num_spec_accepted_tokens / st.num_spec_draft_tokens if st.num_spec_draft_tokens else 0.0,
            # tokens a drafting sequence emitted per step: 1 without speculation
            "spec_tokens_per_drafting_step": ((st.num_spec_accepted_tokens + st.num_spec_drafting_steps)
                                              / st.num_spec_drafting_steps if st.num_spec_drafting_steps else 0.0),
            **self._lora_stats(),
        }

    def _lora_stats(self) -> dict[str, Any]:
        """With LoRA on: the adapters of the running and the waiting sequences (names), the slots, and how many
        times an adapter was copied into a slot."""
        manager = self.runner.lora
        if manager is None:
            return {}

        def names(seqs) -> list[str]:
            return sorted({s.lora_request.lora_name for s in seqs if s.lora_request is not None})

        return {"lora_running": names(self.scheduler.running), "lora_waiting": names(self.scheduler.waiting),
                "max_loras": manager.max_loras, "lora_loads": manager.num_loads}


def bad_word_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """Each bad word's token ids as it would appear in text: alone (at the start of the output) and after
    a space (inside it), each spelling once."""
    seqs: list[list[int]] = []
    for word in words:
        for text in (word.strip(), " " + word.strip()):
            ids = list(tokenizer.encode(text, add_special_tokens=False))
            if ids and ids not in seqs:
                seqs.append(ids)
    return seqs


def _gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:])]


def _prompt_logprobs(seq: Sequence) -> list[dict[int, float] | None] | None:
    """``RequestOutput.prompt_logprobs``: None unless asked for, else one entry a prompt token (None for
    the first, and for any not scored yet)."""
    if seq.params.prompt_logprobs is None:
        return None
    return [seq.prompt_logprobs.get(i) for i in range(seq.num_prompt_tokens)]


def _completion(seq: Sequence, safe: bool) -> CompletionOutput:
    text = seq.text
    det = seq.detokenizer
    if det is not None and not safe and not seq.is_finished:
        text = det.text  # stable text only: a held-back tail may yet be a stop string
        pending = len(det.pending_text())
        if pending:
            text = text[: len(text) - pending]
    want_lp = seq.params.logprobs is not None
    return CompletionOutput(
        index=seq.index,
        text=text,
        token_ids=seq.output_token_ids[:],
        finish_reason=seq.finish_reason,
        logprobs=seq.logprobs[:] if want_lp and seq.logprobs is not None else None,
        cumulative_logprob=seq.cumulative_logprob if want_lp else None,
        stop_reason=seq.stop_reason,
    )


def resolve_sampling_defaults(config: EngineConfig, loaded: Any) -> tuple[dict[str, Any], int | None]:
    """``config.generation_config`` resolved, as vLLM resolves ``--generation-config``: the
    ``SamplingParams`` keywords a request gets for the fields it leaves unset, and the server's
    upper limit on ``max_tokens`` (a folder's max_new_tokens; None with "auto": there the model's
    max_new_tokens is only a default). Logs one line naming them when there are any; raises
    ValueError for a value ``SamplingParams`` refuses."""
    from ..model.loader import sampling_defaults

    if config.generation_config in ("none", "vllm"):
        return {}, None
    if config.generation_config == "auto":
        defaults = dict(getattr(loaded, "sampling_defaults", None) or {})  # {} for an in-memory model
        source = f"the generation_config.json of {getattr(loaded, 'source', config.model)}"
    else:
        defaults = sampling_defaults(config.generation_config)
        source = str(Path(config.generation_config).expanduser() / "generation_config.json")
    if not defaults:
        return {}, None
    try:
        SamplingParams(**defaults)
    except ValueError as e:
        raise ValueError(f"{source}: {e} (generation_config='none' ignores the file)") from None
    limit = defaults.get("max_tokens") if config.generation_config != "auto" else None
    logger.warning("sampling defaults from %s: %s (for the fields a request leaves unset%s; "
                   "generation_config='none' ignores the file)", source,
                   ", ".join(f"{k}={v}" for k, v in defaults.items()),
                   f"; a server request's max_tokens at most {limit}" if limit is not None else "")
    return defaults, limit
