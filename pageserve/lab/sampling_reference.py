"""Plain, row-by-row references for the engine's ``Sampler`` (tests and notebooks only).

- ``sample_reference``: what ``Sampler.sample`` must pick, one row and one token at a
  time; seeded rows draw the same ``seeded_uniform`` noise, so they pick the same tokens.
- ``sampler_probs``: the distribution a ``Sampler`` row draws from, read out of the
  sampler's own penalty/filter pipeline, to compare with ``sample_reference``'s.
- ``penalties_dense``: ``Sampler._apply_penalties``'s bits, computed over each row's whole
  vocabulary (a count and a seen flag per token), as the sampler did before session 43.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from ..engine.sampler import _FREQ, _PRES, _REP, Draws, Sampler, seeded_uniform
from ..engine.sampling_params import SamplingParams


@dataclass
class ReferenceSample:
    token_ids: list[int]
    logprobs: list[float] | None  # as ``SamplerOutput.logprobs``
    top_logprobs: list[list[tuple[int, float]]] | None  # as ``SamplerOutput.top_logprobs``
    probs: Tensor  # [B, V] the normalised distribution each row drew from (one-hot for greedy rows)


def sampler_probs(
    sampler: Sampler,
    logits: Tensor,
    params: list[SamplingParams],
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
) -> Tensor:
    """The distribution each row of ``sampler.sample`` draws from, [B, V] normalised;
    one-hot for greedy rows."""
    logits = logits[:, : sampler.vocab_size]
    penalised, probs, greedy_rows = sampler._process(logits, params, prompt_token_ids, output_token_ids)
    if isinstance(probs, Draws):
        probs = probs.probs(*logits.shape)
    if probs is None:
        probs = torch.zeros_like(penalised, dtype=torch.float32)
    else:
        probs = probs / probs.sum(dim=-1, keepdim=True)
    if greedy_rows:
        rows = torch.tensor(greedy_rows, device=probs.device)
        one_hot = torch.zeros_like(probs[rows])
        one_hot.scatter_(1, penalised[rows].argmax(dim=-1, keepdim=True), 1.0)
        probs[rows] = one_hot
    return probs


def sample_reference(
    logits: Tensor,
    params: list[SamplingParams],
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
    seeds: list[int | None],
    eos_token_ids: Sequence[int] = (),
    generator: torch.Generator | None = None,
) -> ReferenceSample:
    """Row-by-row plain version of ``Sampler.sample``, for tests.

    Seeded rows use ``seeded_uniform``
    token by token, so they pick the same tokens as ``Sampler``; unseeded rows use
    ``torch.multinomial``.
    """
    B, V = logits.shape
    token_ids, logprobs, top_logprobs, all_probs = [], [], [], []
    for i in range(B):
        p, prompt, out = params[i], prompt_token_ids[i], output_token_ids[i]
        row = logits[i].float().clone()
        for t, b in (p.logit_bias or {}).items():
            row[t] += b
        if len(out) < p.min_tokens:
            for t in list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_token_ids)):
                if t < V:
                    row[t] = float("-inf")
        if p.repetition_penalty != 1.0:
            for t in set(prompt) | set(out):
                row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
        for t, c in Counter(out).items():
            row[t] -= p.frequency_penalty * c + p.presence_penalty
        logp = torch.log_softmax(row, dim=-1)

        if p.temperature == 0:
            token = int(row.argmax())
            probs = torch.zeros(V)
            probs[token] = 1.0
        else:
            x = row / p.temperature
            if p.top_k > 0:
                sorted_x, order = x.sort(descending=True)
                x = torch.full_like(x, float("-inf"))
                x[order[: p.top_k]] = sorted_x[: p.top_k]
            if p.top_p < 1.0:
                sorted_x, order = x.sort(descending=True)
                sp = sorted_x.softmax(-1)
                kept, mass = [], 0.0
                for j in range(V):
                    if mass >= p.top_p:
                        break
                    kept.append(int(order[j]))
                    mass += float(sp[j])
                y = torch.full_like(x, float("-inf"))
                y[kept] = x[kept]
                x = y
            probs = x.softmax(-1)
            if p.min_p > 0:
                probs = torch.where(probs < p.min_p * probs.max(), 0.0, probs)
            probs = probs / probs.sum()
            if seeds[i] is not None:
                step = len(out)
                q = torch.tensor([-math.log(seeded_uniform(seeds[i], step, t)) for t in range(V)])
                token = int((probs / q).argmax())
            else:
                token = int(torch.multinomial(probs, 1, generator=generator))
        token_ids.append(token)
        all_probs.append(probs)
        logprobs.append(float(logp[token]))
        k = p.logprobs or 0
        top_v, top_i = logp.topk(k) if k else (torch.empty(0), torch.empty(0, dtype=torch.long))
        top_logprobs.append(list(zip(top_i.tolist(), top_v.tolist())))
    return ReferenceSample(
        token_ids,
        logprobs if any(p.logprobs is not None for p in params) else None,
        top_logprobs if any((p.logprobs or 0) > 0 for p in params) else None,
        torch.stack(all_probs),
    )


def penalties_dense(logits: Tensor, table: Tensor, rows: list[int], prompts: list[np.ndarray],
                    outputs: list[np.ndarray]) -> Tensor:
    """The penalties of ``rows`` over each row's whole [V] logits, returned as a new tensor: the
    reference for ``Sampler._apply_penalties`` (same arguments; ``table`` the sampler's [7, B]
    parameter table), which touches only the seen tokens and must give these very bits."""
    V = logits.shape[1]

    def padded(arrays):  # one [P, width] array padded with V: an extra column dropped after the scatter
        out = np.full((len(arrays), max(1, max(len(a) for a in arrays))), V, dtype=np.int64)
        for j, a in enumerate(arrays):
            out[j, : len(a)] = a
        return torch.from_numpy(out).to(logits.device)

    rows_t = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    sub = logits.index_select(0, rows_t)  # [P, V]
    t = table.index_select(1, rows_t)  # [7, P]
    counts = torch.zeros(len(rows), V + 1, device=logits.device)
    out_ids = padded(outputs)
    counts.scatter_add_(1, out_ids, torch.ones_like(out_ids, dtype=counts.dtype))
    counts = counts[:, :V]
    seen = torch.zeros(len(rows), V + 1, device=logits.device)
    seen.scatter_(1, padded(prompts), 1.0)
    seen = (seen[:, :V] > 0) | (counts > 0)
    rep = t[_REP][:, None]
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    sub = sub - t[_FREQ][:, None] * counts - t[_PRES][:, None] * (counts > 0).float()
    return logits.index_copy(0, rows_t, sub)
