"""Tensor-parallel execution: rank 0 is the engine's process, ranks 1..N-1 are workers.

The scheduler, block manager and sampler run once, on rank 0. Every step rank 0 sends the
step's host inputs (``StepInputs``: a few small numpy arrays) down one pipe per worker;
each rank then runs the same ``ModelRunner.run_step`` on its shard: same flattened batch,
same block tables (each rank's paged KV cache holds its own KV heads), same CUDA-graph
bucket, the collectives inside the model meeting in the same order. Tokens that the
previous step sampled on the device (async scheduling) reach the workers as one
``broadcast`` of the step's input ids from rank 0.

Why a pipe for the step inputs and not a gloo broadcast: a worker waiting for the next
step may wait forever (an idle server), which a pipe allows and a collective's timeout
does not; and a pipe closes when its parent dies, which stops the worker.

Workers are started with ``torch.multiprocessing`` (spawn) and a free TCP port for the
rendezvous — no ``torchrun``. They never outlive the engine's process: they stop on a
``None`` step (``shutdown``, ``LLM.__del__``, atexit), on the pipe closing, on
``PR_SET_PDEATHSIG`` (Linux: the kernel kills them with their parent) and on a watcher
thread that sees their parent pid change.
"""
from __future__ import annotations

import atexit
import copy
import ctypes
import dataclasses
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
import weakref

import torch

from ..model.parallel import (
    broadcast_, check_tp_divisible, destroy_tensor_parallel, disable_nvlink_multicast, init_tensor_parallel,
    min_over_ranks, shard_decoder_,
)
from .config import EngineConfig
from .model_runner import DeviceInputs, ModelRunner, StepInputs

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 600.0  # a worker loading a large checkpoint may take minutes


class _NoSampler:
    """Workers never sample (rank 0 does)."""


class TPModelRunner(ModelRunner):
    """A ``ModelRunner`` over one rank's shard. On rank 0 ``run_step`` first hands the
    step's inputs to the workers; on a worker it is called from ``worker_loop``."""

    def __init__(self, model, config: EngineConfig, rank: int, workers: "Workers | None" = None, **kwargs) -> None:
        self.tp_rank = rank
        self.workers = workers
        if rank:
            kwargs.setdefault("sampler", _NoSampler())
        super().__init__(model, config, **kwargs)

    def _num_blocks_from_memory(self) -> int:
        # every rank must have the same pool: the smallest that fits on all of them
        return min_over_ranks(super()._num_blocks_from_memory(), self.device)

    def run_step(self, x: StepInputs, prev_tokens: torch.Tensor | None = None):
        if self.tp_rank == 0 and self.workers is not None:
            self.workers.send(x)
        return super().run_step(x, prev_tokens)

    def step_input_ids(self, x: StepInputs, d: DeviceInputs, prev_tokens: torch.Tensor | None) -> torch.Tensor:
        if self.tp_rank == 0:
            ids = super().step_input_ids(x, d, prev_tokens)
            if x.fill_rows is not None:  # tokens only rank 0's device knows: send them on
                ids = broadcast_(ids.to(torch.int64).contiguous())
            return ids
        if x.fill_rows is not None:
            broadcast_(d.input_ids)
        return d.input_ids

    def release_graphs(self) -> None:
        """Drop the captured graphs (each rank before the group's teardown; see
        ``CUDAGraphRunner.release``). Later steps run eagerly."""
        if self.graphs is not None:
            graphs, self.graphs = self.graphs, None
            graphs.release()

    def shutdown(self) -> None:
        if self.workers is not None:
            workers, self.workers = self.workers, None
            self.release_graphs()
            workers.shutdown()


# ----------------------------------------------------------------------------- rank 0
class Workers:
    """Handles on the worker processes (ranks 1..N-1) and their step pipes."""

    def __init__(self, procs, conns) -> None:
        self.procs, self.conns = procs, conns

    def send(self, x: StepInputs | None) -> None:
        for rank, (p, c) in enumerate(zip(self.procs, self.conns), start=1):
            if x is not None and not p.is_alive():
                raise RuntimeError(f"tensor-parallel worker rank {rank} (pid {p.pid}) died (exit code {p.exitcode})")
            c.send(x)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Ask every worker to stop, tear the process group down with them, wait, then kill
        any that did not stop. Idempotent.

        The order matters under NCCL: destroying a process group finalizes its communicator,
        which waits for every rank. The workers destroy theirs as soon as they read the stop
        message, so rank 0 must destroy its own then, before joining them; joining first
        deadlocks (seen on two H200s: rank 0 joined, the worker sat in destroy, and after the
        join timeout rank 0's own destroy waited for a worker it had killed). Where a worker
        is already dead the group cannot be finalized: it is abandoned instead."""
        all_alive = bool(self.procs) and all(p.is_alive() for p in self.procs)
        for c in self.conns:
            try:
                c.send(None)
            except (OSError, ValueError):  # already gone or closed
                all_alive = False
        destroy_tensor_parallel(abandon=not all_alive)
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(2.0)
        for c in self.conns:
            c.close()
        self.procs, self.conns = [], []


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_tensor_parallel(model, config: EngineConfig, eos_token_ids=(), copy_model: bool = False) -> TPModelRunner:
    """Start ranks 1..N-1, shard ``model`` as rank 0 and return rank 0's runner.

    Workers load the same weights themselves: by name (``load_model`` with the config's
    model, dtype and seed) when ``copy_model`` is False (the engine loaded it), else from
    ``model``'s state dict shared through memory (an in-memory model: ``LLM.from_model``),
    which is then copied here so the caller's model stays whole."""
    size = config.tensor_parallel_size
    check_tp_divisible(model.cfg, size)
    device = next(model.parameters()).device
    if device.type == "cuda" and torch.cuda.device_count() < size:
        raise ValueError(f"tensor_parallel_size={size} needs {size} GPUs; {torch.cuda.device_count()} visible")
    disable_nvlink_multicast()
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    if copy_model:
        state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        spec = ("state", model.cfg, state, model.max_positions)
    else:
        spec = ("load", None, None, None)
    ctx = torch.multiprocessing.get_context("spawn")
    pdeathsig = threading.current_thread() is threading.main_thread()  # it fires when the spawning *thread* ends
    procs, conns = [], []
    for rank in range(1, size):
        parent_end, child_end = ctx.Pipe()
        p = ctx.Process(target=_worker_main, name=f"pageserve-tp{rank}", daemon=True,
                        args=(rank, size, init_method, config, spec, os.getpid(), pdeathsig, child_end))
        p.start()
        child_end.close()
        procs.append(p)
        conns.append(parent_end)
    workers = Workers(procs, conns)
    try:
        if copy_model:
            model = copy.deepcopy(model)
        shard_decoder_(model, 0, size)
        _wait_ready(workers)
        init_tensor_parallel(0, size, init_method, device, custom_all_reduce=not config.disable_custom_all_reduce)
        runner = TPModelRunner(model, config, rank=0, workers=workers, eos_token_ids=eos_token_ids)
    except BaseException:
        workers.shutdown(timeout_s=2.0)
        destroy_tensor_parallel(abandon=True)
        raise
    ref = weakref.ref(runner)
    atexit.register(lambda: ref() is not None and ref().shutdown())
    logger.info("tensor parallel: %d ranks, workers %s", size, workers.pids)
    return runner


def _wait_ready(workers: Workers) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    for rank, (p, c) in enumerate(zip(workers.procs, workers.conns), start=1):
        while not c.poll(0.1):
            if not p.is_alive():
                raise RuntimeError(f"tensor-parallel worker rank {rank} exited (code {p.exitcode}) while loading")
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel worker rank {rank} not ready after {READY_TIMEOUT_S:.0f} s")
        try:
            kind, detail = c.recv()
        except EOFError:
            p.join(5.0)
            raise RuntimeError(f"tensor-parallel worker rank {rank} exited (code {p.exitcode}) while loading; "
                               "a script that starts workers needs an `if __name__ == '__main__':` guard") from None
        if kind != "ready":
            raise RuntimeError(f"tensor-parallel worker rank {rank} failed to load its shard:\n{detail}")


# ----------------------------------------------------------------------------- workers
def _die_with_parent(parent_pid: int, pdeathsig: bool) -> None:
    if pdeathsig and sys.platform.startswith("linux"):
        try:
            PR_SET_PDEATHSIG = 1
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        except OSError:
            pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent_pid:
                os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _worker_main(rank, size, init_method, config: EngineConfig, spec, parent_pid, pdeathsig, conn) -> None:
    _die_with_parent(parent_pid, pdeathsig)
    disable_nvlink_multicast()
    try:
        if config.device.startswith("cuda"):
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
        else:
            device = torch.device(config.device)
        config = dataclasses.replace(config, device=str(device))
        model = _load_shard(rank, size, config, spec, device)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", None))
    try:
        init_tensor_parallel(rank, size, init_method, device, custom_all_reduce=not config.disable_custom_all_reduce)
        runner = TPModelRunner(model, config, rank=rank)
        while True:
            try:
                x = conn.recv()
            except EOFError:  # rank 0 is gone
                break
            if x is None:
                break
            runner.run_step(x)
        runner.release_graphs()
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # a half-finished collective cannot be cleaned up politely
    destroy_tensor_parallel()


def _load_shard(rank: int, size: int, config: EngineConfig, spec, device: torch.device):
    from ..model.loader import build_decoder, load_model

    kind, cfg, state, max_positions = spec
    if kind == "load":
        model = load_model(config.model, device=device, dtype=config.dtype, seed=config.seed,
                           max_model_len=config.max_model_len).model
    else:
        dtype = next(iter(state.values())).dtype
        model = build_decoder(cfg, device, dtype, max_positions)
        model.load_state_dict(state)
    return shard_decoder_(model, rank, size)
