"""The engine step: schedule -> one model forward -> postprocess.

``LLMEngine`` owns the requests, the scheduler, the block manager and the model runner.
The offline ``LLM`` API and the server both drive it through ``add_request`` / ``step`` /
``abort_request``.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Iterable

from .block_manager import BlockManager
from .config import EngineConfig
from .model_runner import ModelRunner
from .outputs import CompletionOutput, RequestMetrics, RequestOutput
from .sampling_params import SamplingParams, child_seed
from .scheduler import Scheduler
from .sequence import Sequence

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
    needs_landing: bool = False  # a row has penalties: land it before the next schedule


@dataclass
class EngineStats:
    num_steps: int = 0
    num_requests_added: int = 0
    num_requests_finished: int = 0
    num_prompt_tokens: int = 0  # prompt tokens of admitted sequences (n per request)
    num_prefill_tokens_computed: int = 0  # prompt chunks + recomputation actually run
    num_decode_tokens_computed: int = 0
    num_generated_tokens: int = 0
    step_time_s: float = 0.0


class LLMEngine:
    """A paged-KV engine over one model.

    ``stream_outputs``: ``step()`` returns a ``RequestOutput`` for every request that got
    new tokens (True, for streaming) or only for the requests that finished (False, for
    offline generation, which then also detokenizes once at the end unless stop strings
    need incremental text).
    """

    def __init__(self, config: EngineConfig, loaded: Any = None, stream_outputs: bool = True) -> None:
        self.config = config
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
            self.block_manager, config.max_num_seqs, config.max_num_batched_tokens, config.enable_chunked_prefill
        )
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats()
        self._inflight: _Inflight | None = None  # the launched step whose tokens are not appended yet

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
    ) -> None:
        """Queue a request. Raises ValueError (and changes nothing) for a duplicate id, an
        empty or too long prompt, token ids outside the vocabulary, or bad parameters."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
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
        else:
            try:
                ids = [int(t) for t in prompt]
            except (TypeError, ValueError):
                raise ValueError(f"request {request_id!r}: prompt must be a string or a list of token ids") from None
            vocab = self.model_config.vocab_size
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"request {request_id!r}: token ids {bad[:5]} outside the vocabulary [0, {vocab})")
        if not ids:
            raise ValueError(f"request {request_id!r}: the prompt is empty")
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
        now = time.perf_counter() if arrival_time is None else arrival_time
        seqs = []
        for i in range(params.n):
            seed = child_seed(params.seed, i)
            seq = Sequence(request_id, ids, params, index=i, seed=seed, arrival_time=now)
            if self.tokenizer is not None and (self.stream_outputs or params.stop):
                from .detokenizer import IncrementalDetokenizer

                seq.detokenizer = IncrementalDetokenizer(
                    self.tokenizer.hf, ids, skip_special_tokens=params.skip_special_tokens,
                    stop=params.stop or None, include_stop_str_in_output=params.include_stop_str_in_output,
                )
            seqs.append(seq)
        self.requests[request_id] = Request(request_id, text, ids, params, seqs, now)
        for seq in seqs:
            self.scheduler.add(seq)
        self.stats.num_requests_added += 1
        self.stats.num_prompt_tokens += len(ids) * params.n

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

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """Schedule, launch one forward over every scheduled token, and postprocess a step.

        With ``async_scheduling`` (the default) the step launched here is postprocessed by
        the next call: this call first launches step N+1, then waits for step N's tokens
        and appends them, so the host's scheduling and input preparation overlap the
        device's forward. Returned outputs are those of the step postprocessed here."""
        t0 = time.perf_counter()
        sched = self.scheduler
        outputs: list[RequestOutput] = []
        if self._inflight is not None and self._inflight.needs_landing:
            # penalties read every output token id: land the step before planning the next
            outputs = self._postprocess(self._take_inflight())
        batch = sched.schedule()
        if batch.is_empty:
            if self._inflight is not None:  # nothing new to run: land the step in flight
                outputs += self._postprocess(self._take_inflight())
            if outputs:
                self.stats.step_time_s += time.perf_counter() - t0
                return outputs
            if sched.has_unfinished() and not batch.preempted:
                # Cannot happen while max_model_len fits the pool; say so rather than spin.
                raise RuntimeError(
                    f"scheduler made no progress with {len(sched.waiting)} waiting and "
                    f"{len(sched.running)} running sequences ({self.block_manager.num_free_blocks} free blocks)"
                )
            return []
        prev = self._inflight
        out = self.runner.execute(batch, None if prev is None else prev.out.token_ids_gpu)
        sched.update_after_step(batch)

        st = self.stats
        st.num_steps += 1
        st.num_prefill_tokens_computed += batch.num_prefill_tokens
        st.num_decode_tokens_computed += batch.num_batched_tokens - batch.num_prefill_tokens

        launched = None
        if out is not None:
            launched = _Inflight(batch.sampling_seqs, out)
            max_len = self.max_model_len
            for row, seq in enumerate(launched.seqs):
                launched.needs_landing |= seq.params.has_penalties
                seq.num_pending += 1
                seq.pending_row = row
                mt = seq.params.max_tokens
                if (mt is not None and seq.num_output_tokens >= mt) or seq.num_tokens >= max_len:
                    seq.length_capped = True
        self._inflight = launched
        if prev is not None:
            outputs += self._postprocess(prev)
        if not self.config.async_scheduling and launched is not None:
            outputs += self._postprocess(self._take_inflight())
        st.step_time_s += time.perf_counter() - t0
        return outputs

    def _take_inflight(self) -> "_Inflight":
        inflight, self._inflight = self._inflight, None
        return inflight

    def _postprocess(self, step: "_Inflight") -> list[RequestOutput]:
        """Append a launched step's sampled tokens (waiting for them if needed), run the stop
        checks, and build the outputs to report."""
        out = step.out
        token_ids = out.token_ids  # waits for the device
        lp, top = out.logprobs, out.top_logprobs
        now = time.perf_counter()
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
        det = seq.detokenizer
        if det is not None and reason is None:  # stop tokens never reach the text
            det.add(tok)
            if det.stopped and n_out >= p.min_tokens:
                reason, seq.stop_reason = "stop", det.stop_reason
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
        outs = []
        for seq in req.seqs:
            text = seq.text
            if not seq.is_finished and seq.detokenizer is not None and not safe:
                det = seq.detokenizer  # stable text only: a held-back tail may yet be a stop string
                text = det.text[: len(det.text) - len(det.pending_text())]
            want_lp = seq.params.logprobs is not None
            outs.append(
                CompletionOutput(
                    index=seq.index,
                    text=text,
                    token_ids=list(seq.output_token_ids),
                    finish_reason=seq.finish_reason,
                    logprobs=list(seq.logprobs) if want_lp and seq.logprobs is not None else None,
                    cumulative_logprob=seq.cumulative_logprob if want_lp else None,
                    stop_reason=seq.stop_reason,
                )
            )
        firsts = [s.first_token_time for s in req.seqs if s.first_token_time is not None]
        finishes = [s.finish_time for s in req.seqs if s.finish_time is not None]
        finished = req.finished
        itl = []  # built once, at the end: streaming would otherwise redo it every step
        if finished:
            for s in req.seqs:
                tt = s.token_times
                itl.extend(b - a for a, b in zip(tt, tt[1:]))
        metrics = RequestMetrics(
            arrival_time=req.arrival_time,
            first_token_time=min(firsts) if firsts else None,
            finish_time=max(finishes) if finished and finishes else None,
            num_cached_tokens=max((s.num_cached_tokens for s in req.seqs), default=0),
            inter_token_latencies=itl,
        )
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, finished, metrics)

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
        }
