"""Decode-loop checks and timings for CUDA graphs (phase 04).

- ``staggered_decode_workload``: sequences of different lengths that join and finish at
  different steps, so a real decode loop crosses block boundaries, changes batch size and
  pads to different graph buckets.
- ``graph_vs_eager``: the same workload run eagerly and from graphs on one engine; the
  tokens must be identical (fp32), and per graphed step the logits are recomputed eagerly,
  on the same padded batch and on the unpadded one, to bound their difference (bf16).
- ``decode_step_ms``: the steady-state time of one full engine step (schedule, one forward,
  sample, postprocess) with ``batch_size`` sequences decoding at a given context length.
- ``graph_replay_ms``: the GPU time of one bucket's graph replayed back to back.
- ``record_step_timings``: the engine's own ``StepTiming`` of every ``step()`` call, from the outside.
- ``decoding_batch``: sequences decoding at a given context for the body of a ``with`` (to profile
  or extend their steps).
- ``mixed_batch`` / ``mixed_step_ms``: steps of those decodes plus a fixed number of prompt tokens
  (the mixed steps of chunked prefill), and their steady-state time.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from .bench import BenchRequest, Workload, _random_ids, run_pageserve_online, synchronize
from ..engine.sampling_params import SamplingParams


def staggered_decode_workload(
    num_seqs: int,
    vocab_size: int,
    min_prompt: int = 5,
    max_prompt: int = 40,
    min_output: int = 16,
    max_output: int = 64,
    join_every: int = 1,
    seed: int = 0,
) -> Workload:
    """``num_seqs`` requests with random prompt and output lengths; request i arrives at
    engine step ``i * join_every`` (so sequences join while others decode and finish)."""
    gen = torch.Generator().manual_seed(seed)
    reqs = []
    for i in range(num_seqs):
        p = int(torch.randint(min_prompt, max_prompt + 1, (1,), generator=gen))
        o = int(torch.randint(min_output, max_output + 1, (1,), generator=gen))
        reqs.append(BenchRequest(_random_ids(gen, p, vocab_size, 0), o, i * join_every, "decode"))
    return Workload(f"staggered-{num_seqs}", reqs)


@dataclass
class GraphCheck:
    identical_requests: int
    num_requests: int
    eager_tokens: list[list[int]]
    graph_tokens: list[list[int]]
    graphed_steps: int
    max_logit_rel_err: float  # over graphed steps: graph vs eager on the same padded batch
    max_unpadded_logit_rel_err: float  # over graphed steps: graph vs eager on the unpadded batch
    eager_s: float
    graph_s: float

    @property
    def identical(self) -> bool:
        return self.identical_requests == self.num_requests


def _tokens(result) -> list[list[int]]:
    return [list(r["token_ids"]) for r in result.per_request]


def graph_vs_eager(llm, workload: Workload, check_logits: bool = True) -> GraphCheck:
    """Run ``workload`` online twice on one engine: eager, then from graphs. The prefix cache is emptied
    before each run, so the graphed run's prompts are computed as the eager run's were, not hit."""
    runner = llm.engine.runner
    if runner.graphs is None:
        raise ValueError("this engine has no graph runner (enforce_eager, or no CUDA): call runner.enable_graphs()")
    graphs = runner.graphs
    counter = _count_graph_runs(graphs)
    try:
        runner.graphs = None
        _empty_prefix_cache(llm)
        eager = run_pageserve_online(llm, workload, name="eager")
        runner.graphs = graphs
        _empty_prefix_cache(llm)
        check = _graph_logit_check(runner) if check_logits else None
        try:
            graphed = run_pageserve_online(llm, workload, name="graphs")
        finally:
            if check is not None:
                check.restore()
        errs = check.errs if check is not None else []
    finally:
        runner.graphs = graphs
        counter.restore()
    a, b = _tokens(eager), _tokens(graphed)
    same = sum(x == y for x, y in zip(a, b))
    nan = float("nan")
    return GraphCheck(same, len(a), a, b, counter.count, max((e[0] for e in errs), default=nan),
                      max((e[1] for e in errs), default=nan), eager.wall_s, graphed.wall_s)


def _empty_prefix_cache(llm) -> None:
    if not llm.reset_prefix_cache():
        raise RuntimeError("graph_vs_eager needs an idle engine (requests are running: the prefix cache stays)")


class _count_graph_runs:
    """Counts ``graphs.run`` calls (to prove the graphed run really used the graphs)."""

    def __init__(self, graphs) -> None:
        self.graphs, self.count = graphs, 0
        self.orig = graphs.run

        def counted(*args, **kwargs):
            self.count += 1
            return self.orig(*args, **kwargs)

        graphs.run = counted

    def restore(self) -> None:
        self.graphs.run = self.orig


class _graph_logit_check:
    """Wraps a runner's ``to_device`` and ``graphs.run`` so that every graphed decode step
    is recomputed eagerly, recording two relative logit differences in ``errs``
    (each recomputation rewrites the same K/V slots with the same values):
    - the same padded batch, eagerly, through the graph runner's static buffers: what
      the graph must reproduce exactly if its buffers were refreshed right;
    - the unpadded batch, eagerly: also differs by kernel choices that depend on the
      batch size (GEMV tiles and splits, cuBLAS algorithms, attention splits), which
      reorder sums: zero-ish in fp32, at the dtype's rounding level in bf16."""

    def __init__(self, runner) -> None:
        self.runner, self.errs = runner, []
        self.graphs = runner.graphs
        self._to_device, self._run = runner.to_device, self.graphs.run
        self._inputs = None  # the DeviceInputs of the step being run

        def to_device(x):
            self._inputs = self._to_device(x)
            return self._inputs

        def run(input_ids, *args, **kwargs):
            logits = self._run(input_ids, *args, **kwargs)
            self.errs.append(self._compare(logits, input_ids))
            return logits

        runner.to_device = to_device
        self.graphs.run = run

    def _compare(self, logits: torch.Tensor, input_ids: torch.Tensor) -> tuple[float, float]:
        from ..model.attention import PagedAttention

        r, d = self.runner, self._inputs
        same = self.graphs.eager_logits(logits.shape[0])
        hidden = r.model(input_ids, d.positions, PagedAttention(r.kv_cache, d.metadata(), r.ops))
        unpadded = r.model.compute_logits(hidden)

        def rel(a: torch.Tensor, b: torch.Tensor) -> float:
            a, b = a.float(), b.float()
            return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()

        return rel(logits, same), rel(logits, unpadded)

    def restore(self) -> None:
        self.runner.__dict__.pop("to_device", None)
        self.graphs.run = self._run


class capture_logits:
    """Record the logits of every step that samples (``[S, V]`` in the model's dtype, CPU copies) by
    wrapping ``runner.sampler.sample``; use as a context manager::

        with capture_logits(llm.engine.runner) as steps:
            ...  # run the engine
        steps.logits  # one tensor per sampling step
    """

    def __init__(self, runner) -> None:
        self.sampler = runner.sampler
        self.logits: list[torch.Tensor] = []

    def __enter__(self) -> "capture_logits":
        orig = self.sampler.sample

        def sample(logits, *args, **kwargs):
            self.logits.append(logits.detach().clone().cpu())
            return orig(logits, *args, **kwargs)

        self.sampler.sample = sample
        return self

    def __exit__(self, *exc) -> None:
        self.sampler.__dict__.pop("sample", None)


def prefill_steps(engine, batch_size: int, context_len: int) -> int:
    """Steps the engine needs to prefill ``batch_size`` prompts of ``context_len`` tokens (plus
    one): the sequences prefilled first decode meanwhile, so a decode timing must leave them that
    many more tokens, or they finish inside the timed window and the batch shrinks under it (at
    b512 x 512 on the H200: 32 steps, and the timed replays fell from 9.5 to 4.8 ms)."""
    budget = engine.config.max_num_batched_tokens
    return -(-batch_size * context_len // budget) + 1


def decode_step_ms(llm, batch_size: int, context_len: int, steps: int = 32, vocab_size: int | None = None,
                   seed: int = 0, repeats: int = 3, lora_requests=None) -> float:
    """Steady-state time of one engine step with ``batch_size`` sequences all decoding at
    about ``context_len`` tokens of context: the wall time of ``steps`` consecutive
    ``engine.step()`` calls divided by ``steps`` (the median of ``repeats`` such runs).
    Consecutive, because under async scheduling a step's host work overlaps the previous
    step's forward: a clock stopped and synchronised around every call would undo that.
    Prefill is done before the clock starts. ``lora_requests``: LoRA adapters the sequences take in turn."""
    engine = llm.engine
    device = engine.runner.device
    with decoding_batch(llm, batch_size, context_len, repeats * steps + 8, vocab_size, seed, lora_requests):
        ms = _median_step_ms(engine.step, device, steps, repeats)
    while engine.has_unfinished_requests():  # land a step still in flight
        engine.step()
    return ms


def _median_step_ms(step, device, steps: int, repeats: int) -> float:
    """ms a call of ``step``: ``steps`` consecutive calls timed together (the device synchronised
    only at both ends), the median of ``repeats`` such runs."""
    runs = []
    for _ in range(repeats):
        synchronize(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        synchronize(device)
        runs.append((time.perf_counter() - t0) / steps)
    return 1e3 * statistics.median(runs)


def graph_replay_ms(runner, batch_size: int, n: int = 50) -> float | None:
    """GPU time of one graphed decode step: the bucket's graph replayed ``n`` times back to
    back with no host work between (its static buffers hold the last step's inputs; the
    K/V writes land in slots that step owned). None without captured graphs. Call it right
    after a step of the full batch: rows of sequences finished since are padding there, and
    the replay then costs less than the batch's step (scripts/step_timeline.py)."""
    graphs = runner.graphs
    if graphs is None or not graphs.graphs:
        return None
    g = graphs.graph_for(batch_size)  # the bucket, in the context class of the step just run
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        g.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / n


class record_step_timings:
    """Every ``engine.step()`` call's ``StepTiming`` (``engine.last_step``, which the engine
    fills in on every call), collected from the outside by wrapping the engine's ``step``
    for the body of the ``with``::

        with record_step_timings(llm.engine) as rec:
            ...  # drive the engine
        rec.steps  # one StepTiming per step() call
    """

    def __init__(self, engine) -> None:
        self.engine = engine
        self.steps: list = []

    def __enter__(self) -> "record_step_timings":
        engine, orig = self.engine, self.engine.step

        def step():
            try:
                return orig()
            finally:
                self.steps.append(engine.last_step)  # a fresh object each call: no copy needed

        engine.step = step
        return self

    def __exit__(self, *exc) -> None:
        self.engine.__dict__.pop("step", None)


class decoding_batch:
    """``batch_size`` sequences decoding at about ``context_len`` tokens of context for the
    body of the ``with`` (the same start as ``decode_step_ms``: prompts added, prefilled,
    one plain decode step run); on exit they are aborted. Each may generate ``max_tokens``
    tokens in all, so the body may run that many steps less the two of the setup. The ids
    of their requests are in ``.ids``. ``lora_requests``: LoRA adapters the sequences take in turn.
    ``sampling``: SamplingParams fields every sequence takes besides greedy's (e.g. temperature, top_p)."""

    def __init__(self, llm, batch_size: int, context_len: int, max_tokens: int, vocab_size: int | None = None,
                 seed: int = 0, lora_requests=None, sampling: dict | None = None) -> None:
        self.sampling = dict(sampling or {})
        self.loras = list(lora_requests or [None])
        self.engine = llm.engine
        self.batch_size, self.context_len, self.max_tokens = batch_size, context_len, max_tokens
        self.vocab_size = vocab_size or self.engine.model_config.vocab_size
        self.seed = seed
        self.ids: list[str] = []

    def __enter__(self) -> "decoding_batch":
        engine = self.engine
        gen = torch.Generator().manual_seed(self.seed)
        # + the prefill's steps: the first-prefilled sequences decode meanwhile (``prefill_steps``)
        params = SamplingParams(**{"temperature": 0.0, **self.sampling}, ignore_eos=True,
                                max_tokens=self.max_tokens + prefill_steps(engine, self.batch_size, self.context_len))
        self.ids = [f"decoding-{self.batch_size}-{i}-{time.monotonic_ns()}" for i in range(self.batch_size)]
        for i, rid in enumerate(self.ids):
            engine.add_request(rid, _random_ids(gen, self.context_len, self.vocab_size, 0), params,
                               lora_request=self.loras[i % len(self.loras)])
        while any(s.num_output_tokens == 0 for r in self.ids if r in engine.requests for s in engine.requests[r].seqs):
            engine.step()
        engine.step()
        return self

    def __exit__(self, *exc) -> None:
        self.engine.abort_request(self.ids)


class mixed_batch:
    """For the body of a ``with``: ``decodes`` sequences decoding at about ``context_len`` tokens of
    context, and a queue of fresh ``prompt_len``-token prompts kept long enough that each ``step()``
    schedules every decode plus exactly ``prefill_tokens`` prompt tokens (the step budget is set to
    their sum). On exit the budget is restored and every request aborted. ``max_steps``: steps the
    body may run."""

    def __init__(self, llm, decodes: int, context_len: int, prefill_tokens: int, prompt_len: int = 512,
                 max_steps: int = 32, vocab_size: int | None = None, seed: int = 0) -> None:
        self.engine, self.sched = llm.engine, llm.engine.scheduler
        self.budget = self.sched.max_num_batched_tokens
        self.prefill = min(prefill_tokens, self.budget - decodes)
        if self.prefill <= 0:
            raise ValueError(f"{decodes} decodes leave no prompt tokens in a {self.budget}-token step")
        self.vocab_size = vocab_size or self.engine.model_config.vocab_size
        self.prompt_len, self.seed = prompt_len, seed
        self.decoding = decoding_batch(llm, decodes, context_len, 2 * max_steps + 8, self.vocab_size, seed)
        self.prompt_ids: list[str] = []
        self._gen = torch.Generator().manual_seed(seed + 4321)
        self._params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1)

    def step(self) -> None:
        queued = sum(s.num_tokens - s.num_computed_tokens for s in self.sched.waiting)
        while queued < self.prefill:
            rid = f"mixed-{len(self.prompt_ids)}-{time.monotonic_ns()}"
            self.engine.add_request(rid, _random_ids(self._gen, self.prompt_len, self.vocab_size, 0), self._params)
            self.prompt_ids.append(rid)
            queued += self.prompt_len
        self.engine.step()

    def __enter__(self) -> "mixed_batch":
        self.decoding.__enter__()
        self.sched.max_num_batched_tokens = self.decoding.batch_size + self.prefill
        return self

    def __exit__(self, *exc) -> None:
        self.sched.max_num_batched_tokens = self.budget
        self.engine.abort_request(self.prompt_ids)
        self.decoding.__exit__(*exc)
        while self.engine.has_unfinished_requests():  # land a step still in flight
            self.engine.step()


def mixed_step_ms(llm, decodes: int, context_len: int, prefill_tokens: int, prompt_len: int = 512,
                  steps: int = 8, vocab_size: int | None = None, seed: int = 0, repeats: int = 3) -> float:
    """Steady-state time of one engine step of ``decodes`` decoding sequences plus
    ``prefill_tokens`` prompt tokens (``mixed_batch``): ``steps`` consecutive steps over their
    count, the median of ``repeats`` runs, as ``decode_step_ms``."""
    with mixed_batch(llm, decodes, context_len, prefill_tokens, prompt_len, repeats * steps + 1, vocab_size,
                     seed) as batch:
        batch.step()  # the timing starts with a step in flight, as in a run
        return _median_step_ms(batch.step, llm.engine.runner.device, steps, repeats)
