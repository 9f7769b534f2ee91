"""The engine behind the server: one thread steps ``LLMEngine``, asyncio handlers read streams.

Threads and ownership:

* the **engine thread** is the only code that touches the ``LLMEngine``. It drains a
  command queue (add / abort), runs ``step()`` while there is work, and sleeps on a
  condition variable when there is none (no busy spin);
* the **event loop** (uvicorn's) runs the HTTP handlers. Each request gets an
  ``asyncio.Queue``; the engine thread feeds it with ``loop.call_soon_threadsafe`` so the
  loop never waits for a step and the step never waits for the loop.

Failure rules: a bad request (``ValueError`` from ``add_request``) fails that request only;
an exception in ``step()`` fails every in-flight request with ``EngineStepError`` and the
engine is reset with ``abort_all()`` so it keeps serving new requests.
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from pageserve.engine.llm_engine import LLMEngine
from pageserve.engine.outputs import RequestOutput
from pageserve.engine.sampling_params import SamplingParams

from .step_stats import StepStats

logger = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """Too many requests are waiting for a slot in the running batch (HTTP 503)."""


class EngineStepError(RuntimeError):
    """The engine's step raised while this request was in flight (HTTP 500)."""


class EngineDeadError(RuntimeError):
    """The engine thread is not running (shut down, or never started)."""


@dataclass
class TextPrompt:
    """A prompt that the engine thread encodes (the tokenizer is only used on that thread)."""

    text: str
    add_special_tokens: bool = True


_ACCEPTED = object()  # first item of a stream: add_request succeeded


@dataclass
class _Stream:
    queue: asyncio.Queue
    finished: bool = False


class AsyncEngine:
    """Runs an ``LLMEngine`` (built with ``stream_outputs=True``) on a background thread.

    ``max_waiting_requests``: requests beyond the running batch (``max_num_seqs``) that may
    wait for a slot; one more is refused with ``QueueFullError``.
    """

    def __init__(self, engine: LLMEngine, max_waiting_requests: int | None = None) -> None:
        if not engine.stream_outputs:
            raise ValueError("AsyncEngine needs an LLMEngine built with stream_outputs=True")
        self.engine = engine
        self.max_num_seqs = engine.config.max_num_seqs
        self.max_waiting_requests = (
            max(1024, 4 * self.max_num_seqs) if max_waiting_requests is None else max_waiting_requests
        )
        self._commands: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._streams: dict[str, _Stream] = {}  # touched by the event loop only
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = False
        self.stats: dict[str, Any] = engine.get_stats()  # a snapshot, replaced by the engine thread
        self.num_step_failures = 0
        self.step_stats = StepStats()  # written by the engine thread only

    # ------------------------------------------------------------------ lifecycle
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the engine thread; outputs are delivered on ``loop`` (default: the running one)."""
        if self._thread is not None:
            return
        self._loop = loop or asyncio.get_running_loop()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="pageserve-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort everything, stop the thread and wait for it (bounded)."""
        if self._thread is None:
            return
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("the engine thread did not stop within %.0f s", timeout)
        self._thread = None

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def num_active_requests(self) -> int:
        return len(self._streams)

    # ------------------------------------------------------------------ requests
    def new_request_id(self, prefix: str = "req") -> str:
        return f"{prefix}-{next(self._ids)}"

    async def add_request(
        self, request_id: str, prompt: list[int] | TextPrompt, params: SamplingParams, priority: int = 0,
        lora_request=None, cache_salt: str | None = None,
    ) -> "RequestStream":
        """Queue a request and return its output stream once the engine accepted it.

        Raises ``ValueError`` (bad input: nothing was queued), ``QueueFullError`` or
        ``EngineDeadError``. The returned ``RequestStream`` yields cumulative ``RequestOutput``s
        and raises ``EngineStepError`` if a step fails; closing it early (``close()``, which
        the handlers do in ``finally`` when a client disconnects) aborts the request.
        """
        if not self.is_running:
            raise EngineDeadError("the engine is not running")
        if len(self._streams) >= self.max_num_seqs + self.max_waiting_requests:
            raise QueueFullError(
                f"the server is at capacity: {len(self._streams)} requests in flight "
                f"(max_num_seqs={self.max_num_seqs} running + max_waiting_requests="
                f"{self.max_waiting_requests} waiting); retry later"
            )
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream = _Stream(asyncio.Queue())
        self._streams[request_id] = stream
        self._submit(("add", request_id, prompt, params, priority, lora_request, cache_salt))
        try:
            first = await stream.queue.get()
        except BaseException:  # cancelled while waiting for the ack
            self._forget(request_id)
            raise
        if first is not _ACCEPTED:
            self._streams.pop(request_id, None)
            raise first
        return RequestStream(self, request_id, stream)

    async def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache, on the engine thread (``LLMEngine.reset_prefix_cache``): False, and nothing
        forgotten, while requests hold blocks."""
        if not self.is_running:
            raise EngineDeadError("the engine is not running")
        done = asyncio.get_running_loop().create_future()
        self._submit(("reset_prefix_cache", done))
        return await done

    async def call(self, fn):
        """``fn(engine)`` on the engine thread, between steps (what changes the engine's state from the event
        loop: adding or removing a LoRA adapter); its result, or its exception raised here."""
        if not self.is_running:
            raise EngineDeadError("the engine is not running")
        done = asyncio.get_running_loop().create_future()
        self._submit(("call", fn, done))
        return await done

    def _forget(self, request_id: str) -> None:
        """The consumer is gone: drop the stream and abort the request if it is unfinished."""
        stream = self._streams.pop(request_id, None)
        if stream is not None and not stream.finished:
            self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._submit(("abort", request_id))

    def _submit(self, command: tuple) -> None:
        with self._cond:
            self._commands.append(command)
            self._cond.notify()

    # ------------------------------------------------------------------ delivery (engine thread)
    def _deliver(self, request_id: str, item: Any) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._put, request_id, item)
        except RuntimeError:  # the loop closed meanwhile
            pass

    def _deliver_step(self, outputs: list[RequestOutput]) -> None:
        """One step's outputs in one hand-over: one wake-up of the loop per step, not per request."""
        loop = self._loop
        if not outputs or loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._put_many, outputs)
        except RuntimeError:  # the loop closed meanwhile
            pass

    def _put(self, request_id: str, item: Any) -> None:  # runs on the event loop
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.queue.put_nowait(item)

    def _put_many(self, outputs: list[RequestOutput]) -> None:  # runs on the event loop
        streams = self._streams
        for out in outputs:
            stream = streams.get(out.request_id)
            if stream is not None:
                stream.queue.put_nowait(out)

    # ------------------------------------------------------------------ the engine thread
    def _run(self) -> None:
        engine = self.engine
        timing = self.step_stats
        clock = time.perf_counter
        while True:
            t_idle = clock()
            with self._cond:
                while not self._commands and not self._stop and not engine.has_unfinished_requests():
                    self._cond.wait()  # idle: sleep until a command arrives
                commands = list(self._commands)
                self._commands.clear()
                stop = self._stop
            t_cmd = clock()
            timing.idle_s += t_cmd - t_idle
            for cmd in commands:
                self._apply(cmd)
            if commands:
                timing.commands_s += clock() - t_cmd
            if stop:
                break
            if engine.has_unfinished_requests():
                t_step = clock()
                deliver_s = self._step()
                self.stats = engine.get_stats()
                overhead = clock() - t_step - engine.last_step.total_s  # delivery + snapshot
                timing.record(engine.last_step, deliver_s, overhead)
            else:
                self.stats = engine.get_stats()
        for rid in list(engine.requests):  # shutdown: nothing in flight survives
            self._deliver(rid, EngineDeadError("the server is shutting down"))
        engine.abort_all()
        self.stats = engine.get_stats()

    def _apply(self, cmd: tuple) -> None:
        engine = self.engine
        if cmd[0] == "abort":
            engine.abort_request(cmd[1])
            return
        if cmd[0] == "call":
            _, fn, done = cmd
            try:
                result, error = fn(engine), None
            except Exception as e:  # noqa: BLE001 - the caller's failure, handed back to it
                result, error = None, e
            loop = self._loop
            if loop is not None and not loop.is_closed():
                def settle():
                    if not done.done():
                        done.set_exception(error) if error is not None else done.set_result(result)

                loop.call_soon_threadsafe(settle)
            return
        if cmd[0] == "reset_prefix_cache":
            done = cmd[1]
            reset = engine.reset_prefix_cache()
            loop = self._loop
            if loop is not None and not loop.is_closed():
                loop.call_soon_threadsafe(lambda: done.done() or done.set_result(reset))
            return
        _, rid, prompt, params, priority, lora_request, cache_salt = cmd
        try:
            if isinstance(prompt, TextPrompt):
                if engine.tokenizer is None:
                    raise ValueError(f"model {engine.config.model!r} has no tokenizer: send token ids")
                prompt = engine.tokenizer.encode(prompt.text, add_special_tokens=prompt.add_special_tokens)
            engine.add_request(rid, prompt, params, priority=priority, lora_request=lora_request,
                               cache_salt=cache_salt)
        except ValueError as e:
            self._deliver(rid, e)
        except Exception as e:  # noqa: BLE001 - anything else is still this request's failure
            logger.exception("request %r could not be added", rid)
            self._deliver(rid, EngineStepError(f"could not add the request: {type(e).__name__}: {e}"))
        else:
            self._deliver(rid, _ACCEPTED)

    def _step(self) -> float:
        """One engine step and its delivery; returns the delivery's wall seconds."""
        engine = self.engine
        try:
            outputs = engine.step()
        except Exception as e:  # noqa: BLE001 - one failed step must not stop the server
            self.num_step_failures += 1
            logger.exception("engine step failed; failing the %d requests in flight", len(engine.requests))
            err = EngineStepError(f"the engine step failed ({type(e).__name__}: {e}); the request was aborted")
            for rid in list(engine.requests):
                self._deliver(rid, err)
            try:
                engine.abort_all()
            except Exception:  # noqa: BLE001
                logger.exception("resetting the engine after a failed step also failed")
            return 0.0
        t = time.perf_counter()
        self._deliver_step(outputs)  # a socket write to wake the loop: it drops the GIL
        return time.perf_counter() - t


class RequestStream:
    """The outputs of one request, in order; the last one has ``finished`` set.

    ``close()`` is idempotent; closing before the last output aborts the request in the
    engine (its blocks are freed on the engine thread's next turn)."""

    def __init__(self, owner: AsyncEngine, request_id: str, stream: _Stream) -> None:
        self.owner = owner
        self.request_id = request_id
        self._stream = stream
        self._closed = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        stream = self._stream
        if self._closed or stream.finished:
            self.close()
            raise StopAsyncIteration
        item = await stream.queue.get()
        if isinstance(item, BaseException):
            stream.finished = True  # the engine has already dropped it
            self.close()
            raise item
        if item.finished:
            stream.finished = True
        return item

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.owner._forget(self.request_id)
