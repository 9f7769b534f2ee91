"""Checks of tensor parallelism that need the engine's forward without its scheduler.

``prompt_logits(llm, prompts)`` runs one prefill of whole prompts through the engine's
runner (so, under tensor parallelism, through every rank) and returns the fp32 logits of
every prompt position: the quantity TP=N must reproduce from TP=1.
"""
from __future__ import annotations

import numpy as np
import torch

from ..engine.model_runner import StepInputs


def prompt_logits(llm, prompts: list[list[int]]) -> torch.Tensor:
    """fp32 logits [sum(len(p)), V] of every position of ``prompts`` (one batch, laid end to
    end), computed by ``llm``'s runner into scratch KV blocks. The engine must be idle with
    its prefix cache emptied first (the scratch blocks are the pool's first ones; no request owns
    them, and no cached prefix may point at what they are about to hold)."""
    engine = llm.engine
    if engine.has_unfinished_requests() or not engine.reset_prefix_cache():
        raise RuntimeError("prompt_logits needs an idle engine")
    bs = engine.config.block_size
    lens = np.array([len(p) for p in prompts], dtype=np.int64)
    nblocks = -(-lens // bs)
    if nblocks.sum() > engine.runner.num_blocks:
        raise ValueError(f"{int(nblocks.sum())} blocks needed, the pool has {engine.runner.num_blocks}")
    first = np.concatenate([[0], np.cumsum(nblocks)[:-1]])
    tables = np.zeros((len(prompts), int(nblocks.max())), dtype=np.int64)
    for i, (f, n) in enumerate(zip(first, nblocks)):
        tables[i, :n] = np.arange(f, f + n)
    positions = np.concatenate([np.arange(n) for n in lens])
    seq_idx = np.repeat(np.arange(len(prompts)), lens)
    slots = tables[seq_idx, positions // bs] * bs + positions % bs
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    T = int(cu[-1])
    x = StepInputs(
        input_ids=np.concatenate([np.asarray(p, dtype=np.int64) for p in prompts]), positions=positions,
        slot_mapping=slots, query_start_loc=cu, seq_lens=lens, block_tables=tables,
        logits_indices=np.arange(T, dtype=np.int64), max_query_len=int(lens.max()), max_seq_len=int(lens.max()),
    )
    return engine.runner.run_step(x).clone()


def fewer_layers(model: str, num_layers: int | None, out_dir) -> str:
    """``dummy:<json>`` naming a shipped config (``qwen2.5-0.5b``…) cut to its first
    ``num_layers`` layers (random weights; same heads, widths and vocabulary), so a CPU run
    keeps the model's split; ``num_layers=None`` returns ``model`` unchanged."""
    if num_layers is None:
        return model
    import json
    from pathlib import Path

    from ..model.config import SHIPPED_CONFIGS

    hf = json.loads((SHIPPED_CONFIGS / f"{model}.json").read_text())
    path = Path(out_dir) / f"{model}-{num_layers}layers.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(hf, num_hidden_layers=num_layers)))
    return f"dummy:{path}"


def shard_table(cfg, size: int) -> list[dict]:
    """One row per weight of a decoder layer (and the embedding/head): its full shape, the
    shape each of ``size`` ranks keeps, how it is split and the collective after it."""
    from ..model.parallel import vocab_shard

    d, H, inter = cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    hq, hkv = cfg.num_heads // size, cfg.num_kv_heads // size
    per = vocab_shard(cfg.vocab_size, 0, size)[1]
    rows = [
        ("embed_tokens", (cfg.vocab_size, H), (per, H), f"vocab rows r·{per}…", "all-reduce (masked lookup)"),
        ("qkv_proj", (cfg.q_size + 2 * cfg.kv_size, H), ((hq + 2 * hkv) * d, H),
         f"column: {hq} q + {hkv} k + {hkv} v heads per rank", "—"),
        ("KV cache / layer", ("blocks", "bs", cfg.num_kv_heads, d), ("blocks", "bs", hkv, d), f"{hkv} KV head(s) per rank", "—"),
        ("o_proj", (H, cfg.q_size), (H, hq * d), "row (input columns of its q heads)", "all-reduce [T, H]"),
        ("gate_up_proj", (2 * inter, H), (2 * inter // size, H), "column: its slice of gate and of up", "—"),
        ("down_proj", (H, inter), (H, inter // size), "row", "all-reduce [T, H]"),
        ("norms", (H,), (H,), "replicated", "—"),
        ("lm_head" + (" (tied)" if cfg.tie_word_embeddings else ""), (cfg.vocab_size, H), (per, H),
         "vocab rows", "all-gather logits [N, V]"),
    ]
    return [dict(weight=w, full=str(f), per_rank=str(p), split=s, collective=c) for w, f, p, s, c in rows]


GRAPH_CALLS = 24  # all-reduces captured in one CUDA graph when timing them in a graph


def _time_us(fn, x, iters: int, graph: bool) -> float:
    """µs per call of ``fn(x)``: eager (a host loop) or replayed from one captured graph of
    GRAPH_CALLS calls (how a decode step makes them). Every rank runs the same calls."""
    import time

    cuda = x.is_cuda
    for _ in range(10):
        fn(x)
    if not graph:
        if cuda:
            torch.cuda.synchronize(x.device)
        t0 = time.perf_counter()
        for _ in range(iters):
            fn(x)
        if cuda:
            torch.cuda.synchronize(x.device)
        return (time.perf_counter() - t0) / iters * 1e6
    g = torch.cuda.CUDAGraph()
    torch.cuda.synchronize(x.device)
    with torch.cuda.graph(g):
        for _ in range(GRAPH_CALLS):
            fn(x)
    replays = max(2, iters // GRAPH_CALLS)
    g.replay()
    torch.cuda.synchronize(x.device)
    t0 = time.perf_counter()
    for _ in range(replays):
        g.replay()
    torch.cuda.synchronize(x.device)
    return (time.perf_counter() - t0) / (replays * GRAPH_CALLS) * 1e6


def _allreduce_worker(rank, size, init_method, device_type, sizes, iters, queue) -> None:
    from ..model import parallel

    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    parallel.init_tensor_parallel(rank, size, init_method, device)
    custom = parallel.custom_all_reduce()
    impls = {"dist": parallel.nccl_all_reduce}
    if custom is not None:
        impls["custom"] = custom.all_reduce_
    modes = ("eager", "graph") if device.type == "cuda" else ("eager",)
    out: dict[str, dict[int, float]] = {}
    for n in sizes:
        x = torch.ones(n, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32, device=device)
        for name, fn in impls.items():
            if name == "custom" and not custom.fits(x):
                continue
            for mode in modes:
                out.setdefault(f"{name}_{mode}", {})[n * x.element_size()] = _time_us(fn, x, iters, mode == "graph")
    if rank == 0:
        queue.put(out)
    parallel.destroy_tensor_parallel()


def _spawn(target, size: int, *args, timeout_s: float = 300.0):
    """Run ``target(rank, size, init_method, *args, queue)`` in ``size`` fresh processes and
    return what rank 0 puts on the queue."""
    from ..engine.tensor_parallel import _free_port
    from ..model.parallel import disable_nvlink_multicast

    disable_nvlink_multicast()
    ctx = torch.multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    init = f"tcp://127.0.0.1:{_free_port()}"
    procs = [ctx.Process(target=target, args=(r, size, init, *args, queue), daemon=True) for r in range(size)]
    for p in procs:
        p.start()
    try:
        return queue.get(timeout=timeout_s)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()


def allreduce_latency_us(size: int = 2, device: str = "cpu", numels=(1024, 8192, 65536),
                         iters: int = 200) -> dict[str, dict[int, float]]:
    """Microseconds per all-reduce by message size, between ``size`` fresh processes:
    ``{"dist_eager" | "dist_graph" | "custom_eager" | "custom_graph": {bytes: µs}}``.

    ``dist``: ``torch.distributed`` (NCCL on CUDA, gloo on the CPU); ``custom``: the one-shot
    all-reduce over IPC buffers (CUDA with peer access, messages it takes); ``graph``: replayed
    from a captured graph, as in a decode step (CUDA only). bf16 on CUDA, fp32 on the CPU. A
    decode step of a TP model makes 2 × num_layers of these at [batch, hidden]."""
    return _spawn(_allreduce_worker, size, torch.device(device).type, list(numels), iters)


def _custom_check_worker(rank, size, init_method, numels, dtypes, queue) -> None:
    from ..kernels.reference import all_reduce_sum
    from ..model import parallel

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    parallel.init_tensor_parallel(rank, size, init_method, device)
    custom = parallel.custom_all_reduce()
    report = {"enabled": custom is not None, "failures": [], "checked": 0}
    if custom is not None:
        import torch.distributed as dist

        def expect(x):
            parts = [torch.empty_like(x) for _ in range(size)]
            dist.all_gather(parts, x)
            return all_reduce_sum(parts)

        for dtype in dtypes:
            for n in numels:
                g = torch.Generator(device=device).manual_seed(1000 * rank + n)
                # eager: three calls in a row (both slots, and a reuse of the first)
                for call in range(3):
                    x = torch.randn(n, generator=g, device=device).to(dtype)
                    ref = expect(x)
                    got = custom.all_reduce_(x.clone())
                    report["checked"] += 1
                    if not torch.equal(got, ref):
                        report["failures"].append(f"eager {dtype} n={n} call {call}: max |diff| "
                                                  f"{(got.float() - ref.float()).abs().max().item():.3g}")
                # graphed: two all-reduces captured, replayed on fresh inputs
                a = torch.zeros(n, dtype=dtype, device=device)
                b = torch.zeros(n, dtype=dtype, device=device)
                graph = torch.cuda.CUDAGraph()
                torch.cuda.synchronize(device)
                with torch.cuda.graph(graph):
                    custom.all_reduce_(a)
                    b.add_(a)
                    custom.all_reduce_(b)
                for rep in range(3):
                    xa = torch.randn(n, generator=g, device=device).to(dtype)
                    xb = torch.randn(n, generator=g, device=device).to(dtype)
                    ra = expect(xa)
                    rb = expect((xb + ra).contiguous())
                    a.copy_(xa)
                    b.copy_(xb)
                    graph.replay()
                    report["checked"] += 1
                    if not (torch.equal(a, ra) and torch.equal(b, rb)):
                        report["failures"].append(f"graph {dtype} n={n} replay {rep}")
                # every rank holds the same bits
                s = a.float().sum().reshape(1)
                all_s = [torch.empty_like(s) for _ in range(size)]
                dist.all_gather(all_s, s)
                if any(not torch.equal(t, all_s[0]) for t in all_s):
                    report["failures"].append(f"ranks disagree {dtype} n={n}")
    if rank == 0:
        queue.put(report)
    parallel.destroy_tensor_parallel()


def check_custom_all_reduce(size: int = 2, numels=(1, 2048, 2049, 65536, 1 << 20, 4 << 20),
                            dtypes=(torch.bfloat16, torch.float16, torch.float32)) -> dict:
    """The one-shot all-reduce against ``all_reduce_sum`` of the gathered inputs, bitwise, on
    ``size`` GPUs: eager calls in a row and calls replayed from a CUDA graph, for each size
    and dtype; sizes over the buffer are skipped. ``{"enabled", "checked", "failures"}``."""
    from ..model.custom_allreduce import DEFAULT_MAX_BYTES

    numels = [n for n in numels if n * 4 <= DEFAULT_MAX_BYTES]
    return _spawn(_custom_check_worker, size, list(numels), list(dtypes))


def decode_ms_per_token(llm, prompt_len: int, output_len: int, vocab: int, seed: int = 0) -> float:
    """Batch-1 decode: ms between output tokens of one greedy request (after its first)."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab, (prompt_len,), generator=g).tolist()
    from ..engine.sampling_params import SamplingParams

    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True), use_tqdm=False)[0]
    m = out.metrics
    return (m.finish_time - m.first_token_time) / max(1, len(out.outputs[0].token_ids) - 1) * 1e3
