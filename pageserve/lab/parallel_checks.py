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
    prefix caching off (the scratch blocks are the pool's first ones; no request owns them)."""
    engine = llm.engine
    if engine.has_unfinished_requests() or engine.config.enable_prefix_caching:
        raise RuntimeError("prompt_logits needs an idle engine with prefix caching off")
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
