"""Batched next-token sampling on the device.

One ``Sampler.sample`` call per engine step turns ``logits[B, V]`` into B token ids with
one device->host sync (the final read of the packed results). The pipeline, per row:

    logit_bias -> structured-output mask -> min_tokens ban -> repetition/presence/frequency penalties
      ("penalised logits")
      -> temperature -> top-k -> top-p -> min-p -> softmax          ("sampling probs")
      -> exponential race: argmax(probs / q), q ~ Exp(1) per token

For a sampled row with a top-k (Qwen2.5-Instruct's ``generation_config`` gives every request top_k 20) the filters
and the race run over its k highest penalised logits only (``Candidates``: ids best first, ties toward the lower
id, as a stable sort of the whole row orders them, in a width fixed by its own top_k), not over a sort of its whole
row; a token outside them has probability 0 either way, and a seeded row's noise at a candidate is the whole row's
at that id, bit for bit. Which path a row takes depends on its own params only (``Draws``).

On CUDA three Triton kernels do the work of ~40 torch launches (their references, in ``kernels/reference.py``,
are this module's path elsewhere): a repetition penalty alone (``kernels/penalties.py``); each candidate group's
pick (``kernels/topk_select.py``, widths up to ``SELECT_MAX_WIDTH``; wider ones ``topk`` over the penalised logits
rounded back to the model's 16-bit dtype, monotonic, so the same pick); and its ordering, filters and race in one
launch (``kernels/candidate_race.py``, ``Pick``). There the logits stay in the model's 16-bit dtype until a value
is changed: their fp32 values are exact, so every pick, argmax and race reads the same numbers. A repetition penalty
alone on rows that the pick and race kernels sample (Qwen2.5-Instruct's defaults) changes no value either: each row's
seen tokens go to the kernels as bits (``kernels/penalties.py``, ``seen_words``) and the penalty is applied as they
read the logits, the penalty kernel's bits without its fp32 copy of every row (``_penalty_on_read``).

Rows with ``temperature == 0`` take the argmax of the penalised logits. On CUDA every argmax
here is ``kernels.argmax.argmax_rows`` (the same first maximal index as ``torch.argmax``).

Randomness. ``argmax(p_i / q_i)`` with i.i.d. ``q_i ~ Exp(1)`` draws i with probability
``p_i`` (the exponential race), and needs no host sync, unlike ``torch.multinomial``.
For a seeded row, ``q_i = -log(u)`` where ``u`` is a counter-based hash of
``(seed, step = len(output_token_ids), token id i)``: the draw depends on nothing else
in the batch, so the same seed gives the same text whatever it is batched with. Unseeded
rows draw ``q`` from a ``torch.Generator`` owned by the sampler.

Logprobs (like vLLM's default) describe the model's distribution, not the sampling one:
``log_softmax`` of the penalised logits, before temperature, top-k, top-p and min-p.
"""
from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch
from torch import Tensor

from pageserve.engine.sampling_params import SamplingParams, _mix64, child_seed  # noqa: F401
from pageserve.engine.structured_output import TokenMasks
from pageserve.kernels.reference import (
    GOLDEN, INVALID_ID, MASK64, TABLE_MIN_P, TABLE_TEMP, TABLE_TOP_K, TABLE_TOP_P, TOKEN_MUL, UNIFORM_BITS,
    apply_seen, candidate_filter, filter_sorted, gather_candidates, min_p_filter, mix64_tensor, seeded_uniform_at,
    signed64,
)
from pageserve.kernels.reference import apply_token_bitmask as apply_token_bitmask_reference

if TYPE_CHECKING:
    from pageserve.engine.sequence import TokenHistory

def seeded_uniform(seed: int, step: int, token: int) -> float:
    """The uniform in (0, 1) that seeded sampling uses for ``token`` at output ``step``.

    Plain-Python definition; ``Sampler`` computes the same numbers vectorised on device
    (``seeded_uniform_tensor``, ``kernels.reference.seeded_uniform_at``, the candidate race kernel).
    """
    row = _mix64((seed & MASK64) + GOLDEN * (step + 1))
    h = _mix64(row + TOKEN_MUL * (token + 1))
    return ((h >> (64 - UNIFORM_BITS)) + 0.5) / (1 << UNIFORM_BITS)


def seeded_uniform_tensor(seeds: Tensor, steps: Tensor, vocab_size: int) -> Tensor:
    """``seeded_uniform`` for every token: seeds, steps int64 [S] -> fp32 [S, vocab_size]."""
    row = mix64_tensor(seeds + steps.add(1).mul(signed64(GOLDEN)))  # [S]
    tokens = torch.arange(1, vocab_size + 1, device=seeds.device, dtype=torch.int64)
    h = mix64_tensor(row[:, None] + tokens.mul(signed64(TOKEN_MUL))[None, :])  # [S, V]
    return ((h >> (64 - UNIFORM_BITS)) & ((1 << UNIFORM_BITS) - 1)).float().add_(0.5).mul_(2.0 ** -UNIFORM_BITS)


class Candidates:
    """The tokens worth drawing from for rows with a top-k: ``ids`` [R, k] (each row's highest penalised logits,
    best first, ties toward the lower id) and ``probs`` [R, k], their unnormalised sampling probabilities after
    temperature, top-k, top-p and min-p (every other token's is 0)."""

    __slots__ = ("ids", "probs")

    def __init__(self, ids: Tensor, probs: Tensor) -> None:
        self.ids, self.probs = ids, probs

    def dense(self, vocab_size: int) -> Tensor:
        """The [B, vocab_size] probabilities these stand for (zeros elsewhere): for references and tests."""
        # an unused slot (``INVALID_ID``, probability 0) adds its 0 to token 0
        ids = self.ids.masked_fill(self.ids == INVALID_ID, 0)
        return self.probs.new_zeros(self.probs.shape[0], vocab_size).scatter_add_(1, ids, self.probs)


class Pick:
    """A group's candidates before they are ordered, for the candidate race kernel (``kernels/candidate_race.py``)
    to order, filter and race in one launch: ``ids`` [R, S] (a superset of the rows' k highest penalised logits,
    any order, -1 in unused slots: ``kernels/topk_select.py``, or ``topk``'s k + slack) at width ``k``, read with
    ``logits`` [B, V] (the penalised logits; with ``seen``, (words [B, ceil(V / 32)], penalty [B]), the logits
    before a repetition penalty that the kernels apply as they read them: ``kernels/penalties.py``) and ``table``
    [7, B] at the group's rows. ``candidates()``: the same rows through the torch path (references, tests)."""

    __slots__ = ("ids", "k", "logits", "table", "where", "top_p", "min_p", "seen")

    def __init__(self, ids: Tensor, k: int, logits: Tensor, table: Tensor, where: Tensor | None,
                 top_p: bool, min_p: bool, seen: tuple[Tensor, Tensor] | None = None) -> None:
        self.ids, self.k, self.logits, self.table, self.where = ids, k, logits, table, where
        self.top_p, self.min_p, self.seen = top_p, min_p, seen

    def candidates(self) -> Candidates:
        logits, table = self.logits, self.table
        if self.seen is not None:
            logits = apply_seen(logits, *self.seen)
        if self.where is not None:
            logits, table = logits.index_select(0, self.where), table.index_select(1, self.where)
        return Candidates(*candidate_filter(*gather_candidates(logits, self.ids), self.k, table, self.top_p,
                                            self.min_p))


class Draws:
    """What a step's sampled rows draw from. ``dense``: [B, V] unnormalised probabilities over the whole vocabulary,
    for the rows with no top-k (or one above ``CANDIDATE_MAX_TOP_K``), None if there are none (its other rows are
    not used); ``groups``: (batch rows, those rows on the device or None where they are every row, their
    ``Candidates``, or their ``Pick`` where the candidate race kernel runs), one per candidate width among the other
    sampled rows.
    Which of the two a row takes depends on its own params only, never on the rest of the batch."""

    __slots__ = ("dense", "groups")

    def __init__(self, dense: Tensor | None, groups: list[tuple[list[int], Tensor | None, Candidates | Pick]]) -> None:
        self.dense, self.groups = dense, groups

    def probs(self, batch: int, vocab_size: int) -> Tensor:
        """The [B, vocab_size] probabilities these stand for (unnormalised; greedy rows' meaningless): for
        references and tests."""
        groups = [(rows, cand.candidates() if isinstance(cand, Pick) else cand) for rows, _, cand in self.groups]
        ref = self.dense if self.dense is not None else groups[0][1].probs
        out = self.dense.clone() if self.dense is not None else ref.new_zeros(batch, vocab_size)
        for rows, cand in groups:
            out[torch.tensor(rows, device=out.device)] = cand.dense(vocab_size)
        return out


def _own(logits: Tensor) -> Tensor:
    """An fp32 copy of the caller's logits to write into: converted from 16 bits, or cloned."""
    return logits.float() if logits.dtype != torch.float32 else logits.clone()


def _triton_or(device: torch.device, module: str, name: str, fallback):
    """``pageserve.kernels.<module>.<name>`` on CUDA, else (and if Triton fails to import) ``fallback``: a
    missing or broken Triton costs speed, never the sampler."""
    if device.type == "cuda":
        try:
            return getattr(importlib.import_module(f"pageserve.kernels.{module}"), name)
        except Exception as e:
            warnings.warn(f"Triton {module} unavailable ({type(e).__name__}: {e}); using the torch reference")
    return fallback


def _token_bitmask(device: torch.device):
    """``apply_token_bitmask(logits, rows, bits, V)``, in place: the Triton kernel on CUDA (one pass over the
    words and the banned logits; the reference's unpack, gather, fill and scatter moved ~1.6 GB a step at 256
    guided rows of 151,936 tokens), else the torch reference."""
    return _triton_or(device, "token_bitmask", "apply_token_bitmask", apply_token_bitmask_reference)


def _row_argmax(device: torch.device):
    """Each row's first maximal index: the Triton kernel on CUDA (``torch.argmax`` over one
    151,936-wide row cost ~13-15 µs of every batch-1 decode step on the H200), else torch."""
    return _triton_or(device, "argmax", "argmax_rows", _torch_argmax)


def _allowed_words(p: SamplingParams, vocab_size: int) -> np.ndarray:
    """``p.allowed_token_ids`` as mask words ([ceil(V / 32)] int32, token t at bit ``t % 32`` of word ``t // 32``;
    ids from ``vocab_size`` on dropped), built on the request's first step and kept on its params."""
    cached = p._allowed_words
    if cached is None or cached[0] != vocab_size:
        ids = np.asarray([t for t in p.allowed_token_ids if t < vocab_size], dtype=np.int64)
        words = np.zeros((vocab_size + 31) // 32, dtype=np.uint32)
        np.bitwise_or.at(words, ids // 32, np.left_shift(np.uint32(1), (ids % 32).astype(np.uint32)))
        cached = p._allowed_words = (vocab_size, words.view(np.int32))
    return cached[1]


def _torch_argmax(x: Tensor) -> Tensor:
    return x.argmax(dim=-1)


class SamplerOutput:
    """The result of one sampling step for B rows.

    ``token_ids_gpu`` is there at once; ``token_ids``, ``logprobs`` and ``top_logprobs`` are
    read from the device on first access (a copy started when the step was sampled, so an
    engine can launch the next step before it waits for this one).

    ``logprobs``: None unless some row asked for logprobs; then one float per row (the
    sampled token's logprob under the penalised, pre-temperature distribution).
    ``top_logprobs``: None unless some row asked for ``logprobs >= 1``; then one list
    per row, ``params.logprobs`` long (empty for rows that did not ask), of
    ``(token_id, logprob)`` sorted by decreasing logprob.
    """

    def __init__(self, token_ids_gpu: Tensor, packed: Tensor | None = None, top_k: list[int] | None = None) -> None:
        self.token_ids_gpu = token_ids_gpu  # [B] long, on the sampler's device
        self._top_k = top_k  # with ``packed``: per row, how many top logprobs it asked for
        src = token_ids_gpu if packed is None else packed  # packed: [B, 2 + 2k] fp32 (ids, logprob, top-k)
        self._ready = None
        if src.is_cuda:
            self._host = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
            self._host.copy_(src, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host = src
        self._packed = packed is not None
        self._parsed: tuple | None = None

    def _parse(self) -> tuple:
        if self._parsed is None:
            if self._ready is not None:
                self._ready.synchronize()
            if not self._packed:
                self._parsed = (self._host.tolist(), None, None)
            else:
                rows = self._host.tolist()
                token_ids = [int(r[0]) for r in rows]
                logprobs = [r[1] for r in rows]
                top = None
                if self._top_k is not None and max(self._top_k, default=0):
                    k_max = (len(rows[0]) - 2) // 2
                    top = [[(int(r[2 + k_max + j]), r[2 + j]) for j in range(k)] for r, k in zip(rows, self._top_k)]
                self._parsed = (token_ids, logprobs, top)
        return self._parsed

    @property
    def token_ids(self) -> list[int]:
        return self._parse()[0]

    @property
    def logprobs(self) -> list[float] | None:
        return self._parse()[1]

    @property
    def top_logprobs(self) -> list[list[tuple[int, float]]] | None:
        return self._parse()[2]


# rows of the per-step float parameter pack (the first four are what the candidate race reads)
_TEMP, _TOP_K, _TOP_P, _MIN_P = TABLE_TEMP, TABLE_TOP_K, TABLE_TOP_P, TABLE_MIN_P
_REP, _FREQ, _PRES = 4, 5, 6

# A sampled row with 0 < top_k <= CANDIDATE_MAX_TOP_K draws from its top-k candidates only (``Sampler._candidates``)
# instead of a sort of its whole row. Its candidate width is the first of CANDIDATE_WIDTHS at or above its top_k,
# whatever the other rows ask, so the width of the softmax and cumulative sum its bits come from depends on the row
# alone. CANDIDATE_SLACK extra values are selected first, so the candidates are the stable sort's first ones
# whatever order ``topk`` leaves ties in, unless more than that many values tie with the last (then the ties it kept
# stand; a tie at -inf has probability 0 either way).
CANDIDATE_WIDTHS = (32, 128, 1024)
CANDIDATE_MAX_TOP_K = CANDIDATE_WIDTHS[-1]
CANDIDATE_SLACK = 64
# the widest candidates ``kernels/topk_select.py`` picks (its slots, 4k, are what the race kernel then sorts)
SELECT_MAX_WIDTH = 128


class Sampler:
    """Samples B next tokens from ``logits[B, V]`` under per-row ``SamplingParams``.

    ``vocab_size`` columns are used (padding columns of the LM head beyond it are
    ignored). ``eos_token_ids`` are banned, together with each row's
    ``stop_token_ids``, while a row has fewer than ``min_tokens`` output tokens
    (eos only unless ``ignore_eos``). ``seed`` seeds the generator of unseeded rows.
    """

    def __init__(
        self,
        vocab_size: int,
        device: torch.device | str,
        eos_token_ids: Sequence[int] = (),
        seed: int | None = None,
    ) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.eos_token_ids = list(eos_token_ids)
        self.generator = torch.Generator(device=self.device)
        self._argmax = _row_argmax(self.device)
        self._apply_token_bitmask = _token_bitmask(self.device)
        # draw from each row's top-k candidates where every sampled row has a top-k (``_candidates``); False: sort
        # whole rows always (the path before session 51, kept for A/B runs)
        self.candidates = True
        self._table: tuple | None = None  # (the params' ids, V, the params, their [7, B] table): ``_param_table``
        # keep the parameter table from step to step, and skip the output counts where no row needs them; False:
        # rebuild the table every call and always count (the host work before session 51, kept for A/B runs)
        self.lean_host = True
        # pick the candidates by ``topk`` over the penalised logits rounded back to the model's 16-bit dtype, then
        # order them by their fp32 values (``_candidates``); False: ``topk`` over the fp32 logits (before session
        # 52, kept for A/B runs). On CUDA only by default: there the 16-bit radix select makes half the digit passes
        # (256 rows of Qwen's vocabulary on the H100: 0.63 -> 0.40 ms), while the CPU's topk gains nothing from it
        self.coarse_select = self.device.type == "cuda"
        # order, filter and race each candidate group in one launch (``kernels/candidate_race.py``, on CUDA), in
        # place of ~25 torch launches; None: the torch path (the kernel's reference; CPU, or Triton missing)
        self.candidate_race = _triton_or(self.device, "candidate_race", "candidate_race", None)
        # a repetition penalty alone (no frequency or presence penalty in the step) in one launch
        # (``kernels/penalties.py``, on CUDA) in place of ~14; None: the torch path
        self.repetition_kernel = _triton_or(self.device, "penalties", "repetition_penalty", None)
        # where every penalised row's candidates are picked and raced by the kernels, the repetition penalty as they
        # read the logits: each row's seen tokens as bits (``kernels/penalties.py``, one launch after a zero fill)
        # in place of the fp32 copy of every row the penalty kernel writes into; None: that copy and kernel
        self.seen_words = _triton_or(self.device, "penalties", "seen_words", None)
        # candidates of widths up to SELECT_MAX_WIDTH picked by ``kernels/topk_select.py`` (two launches, each row
        # read once) for the race kernel, in place of ``topk``; None: ``topk``
        self.topk_select = _triton_or(self.device, "topk_select", "topk_candidates", None)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    # ----------------------------------------------------------------- public
    def sample(
        self,
        logits: Tensor,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        seeds: list[int | None],
        num_outputs: list[int] | None = None,
        masks: TokenMasks | None = None,
        histories: Sequence[TokenHistory] | None = None,
        pending: tuple[Tensor, list[int]] | None = None,
    ) -> SamplerOutput:
        """Sample one token per row. ``logits``: [B, >= vocab_size] on the device.

        ``seeds[i]`` is row i's seed (already derived with ``child_seed`` for n > 1);
        its random draw depends only on (seed, step, token id), the step being row i's
        number of output tokens so far: ``num_outputs[i]``, by default
        ``len(output_token_ids[i])`` (an async engine counts tokens still in flight; the
        ids themselves are only read for penalties, which need them all). ``masks``: the
        allowed tokens of the structured-output rows; every other token of such a row is banned.
        ``histories``: each row's ids as arrays (``Sequence.token_history``), which the penalties read
        in place of the two lists (the same ids, without converting them from Python ints every step).
        ``pending``: (the previous step's sampled ids on the device [B'], each row's index into them or -1): a
        token sampled for the row whose value has not reached the host, so is not in its output ids yet (async
        scheduling); the penalties count it as the row's newest output without waiting for it.
        """
        logits = logits[:, : self.vocab_size]
        if num_outputs is None:
            num_outputs = [len(o) for o in output_token_ids]
        if masks is None and self._all_plain_greedy(params, num_outputs):
            return SamplerOutput(self._argmax(logits))

        penalised, probs, greedy_rows, _ = self._prepare(
            logits, params, prompt_token_ids, output_token_ids, num_outputs, masks, histories, pending
        )
        B = logits.shape[0]
        draws = probs
        if draws is None:  # every row greedy
            token_ids_gpu = self._argmax(penalised)
        else:
            token_ids_gpu = None
            if draws.dense is not None:
                q = self._exponential_noise(draws.dense, seeds, num_outputs)
                token_ids_gpu = self._argmax(draws.dense.div_(q))
                if greedy_rows:
                    is_greedy = torch.zeros(B, dtype=torch.bool)
                    is_greedy[greedy_rows] = True
                    is_greedy = self._to_device(is_greedy)
                    token_ids_gpu = torch.where(is_greedy, self._argmax(penalised), token_ids_gpu)
            elif greedy_rows:
                token_ids_gpu = self._argmax(penalised)
            for rows, where, cand in draws.groups:
                if isinstance(cand, Pick):  # ordered, filtered and raced in one launch, written at its rows
                    if token_ids_gpu is None:
                        token_ids_gpu = torch.empty(B, dtype=torch.int64, device=logits.device)
                    self._race(cand, rows, seeds, num_outputs, token_ids_gpu)
                    continue
                q = self._exponential_noise(cand.probs, [seeds[i] for i in rows], [num_outputs[i] for i in rows],
                                            token_ids=cand.ids)
                chosen = cand.ids.gather(1, self._argmax(cand.probs.div_(q))[:, None]).squeeze(1)  # [R]
                if where is None:  # the group is every row
                    token_ids_gpu = chosen
                else:
                    if token_ids_gpu is None:
                        token_ids_gpu = torch.zeros(B, dtype=torch.int64, device=chosen.device)
                    token_ids_gpu = token_ids_gpu.index_copy(0, where, chosen)

        want_logprobs = any(p.logprobs is not None for p in params)
        if not want_logprobs:
            return SamplerOutput(token_ids_gpu)

        # pack ids, sampled logprobs and top-k into one fp32 tensor: one copy to the host.
        # Token ids < 2**24 are exact in fp32.
        logp = penalised.float().log_softmax(dim=-1)  # [B, V] (16-bit where nothing changed them: made fp32)
        parts = [token_ids_gpu.float()[:, None], logp.gather(1, token_ids_gpu[:, None])]
        k_max = min(max((p.logprobs or 0) for p in params), self.vocab_size)
        if k_max:
            top_v, top_i = logp.topk(k_max, dim=-1)
            parts += [top_v, top_i.float()]
        top_k = [min(p.logprobs or 0, k_max) for p in params] if k_max else None
        return SamplerOutput(token_ids_gpu, torch.cat(parts, dim=1), top_k)

    # ---------------------------------------------------------------- helpers
    def _all_plain_greedy(self, params, num_outputs) -> bool:
        for p, n_out in zip(params, num_outputs):
            if (
                p.temperature != 0
                or p.logprobs is not None
                or p.logit_bias
                or p.repetition_penalty != 1.0
                or p.presence_penalty != 0.0
                or p.frequency_penalty != 0.0
                or n_out < p.min_tokens
                or p.bad_words
                or p.allowed_token_ids
            ):
                return False
        return True

    def _to_device(self, t: Tensor) -> Tensor:
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t.to(self.device)

    def _banned_tokens(self, p: SamplingParams, n_out: int, output_ids: list[int]) -> list[int]:
        """The row's bans: eos and stop ids while under ``min_tokens``; each bad word's last token where
        the output ends with the tokens before it (a one-token word: always)."""
        banned = []
        if n_out < p.min_tokens:
            banned += p.stop_token_ids
            if not p.ignore_eos:
                banned += self.eos_token_ids
        for word in p._bad_words_ids or ():
            lead = word[:-1]
            if not lead or output_ids[len(output_ids) - len(lead):] == lead:
                banned.append(word[-1])
        return [t for t in banned if t < self.vocab_size]

    def _process(self, logits, params, prompt_token_ids, output_token_ids, num_outputs=None, masks=None,
                 histories=None, pending=None):
        """-> (penalised logits [B, V], unnormalised sampling probs [B, V] or None, greedy rows). The penalised
        logits are fp32 wherever a value was changed; where none was and the kernels run (CUDA), they are the
        caller's own 16-bit ones (their fp32 values are exact, so every pick, argmax and race reads the same
        numbers without a [B, V] conversion: 0.12 ms of an H100's step at 256 rows of Qwen's vocabulary).
        ``_prepare``'s penalty on read, if any, is applied here to a new fp32 tensor (for references and tests)."""
        penalised, probs, greedy_rows, seen = self._prepare(logits, params, prompt_token_ids, output_token_ids,
                                                            num_outputs, masks, histories, pending)
        return (penalised if seen is None else apply_seen(penalised, *seen)), probs, greedy_rows

    def _prepare(self, logits, params, prompt_token_ids, output_token_ids, num_outputs=None, masks=None,
                 histories=None, pending=None):
        """``_process``'s work, -> (logits [B, V], sampling probs or None, greedy rows, seen). ``seen``: None, and
        the logits are the penalised ones; or (words, penalties) where a repetition penalty is applied on read
        (``_penalty_on_read``): the logits are from before it (right for every unpenalised row), and the pick and
        race kernels apply it through each ``Pick``."""
        B, V = logits.shape
        # the bias and bans below write in place: into an fp32 copy of the caller's logits, made once, where first
        # written (``_own``)
        raw = logits
        owned = False
        if logits.dtype != torch.float32 and self.candidate_race is None:
            logits, owned = logits.float(), True
        changed = False  # whether any value differs from the caller's (bias, bans, masks, penalties)
        table = self._param_table(params, V)

        # logit_bias: added to the raw logits (the bans below and the penalties come after it)
        bias_rows, bias_ids, bias_values = [], [], []
        for i, p in enumerate(params):
            for t, b in (p.logit_bias or {}).items():
                bias_rows.append(i)
                bias_ids.append(t)
                bias_values.append(b)
        if bias_rows:
            logits, owned, changed = logits if owned else _own(logits), True, True
            idx = self._to_device(torch.tensor([bias_rows, bias_ids], dtype=torch.int64))
            logits.index_put_((idx[0], idx[1]), self._to_device(torch.tensor(bias_values)), accumulate=True)

        if num_outputs is None:
            num_outputs = [len(o) for o in output_token_ids]
        # allowed_token_ids: every other token banned
        allow_rows = [i for i, p in enumerate(params) if p.allowed_token_ids]
        if allow_rows:  # as a guided row's mask: each request's words built once, one launch for the step's rows
            logits, owned, changed = logits if owned else _own(logits), True, True
            words = np.stack([_allowed_words(params[i], V) for i in allow_rows])
            rows = self._to_device(torch.tensor(allow_rows, dtype=torch.int64))
            self._apply_token_bitmask(logits, rows, self._to_device(torch.from_numpy(words)), V)
        banned = [self._banned_tokens(p, n, o) for p, n, o in zip(params, num_outputs, output_token_ids)]
        guided = set()
        if masks is not None:  # structured outputs: ban what each guided row's grammar does not allow
            logits, owned, changed = logits if owned else _own(logits), True, True
            bits = self._with_bans(masks, banned)
            # the masks' own (pinned) tensor where no ban changed them: copied to the device as it is
            words = masks.tensor if bits is masks.bits and masks.tensor is not None else torch.from_numpy(bits)
            rows = self._to_device(torch.tensor(masks.rows, dtype=torch.int64))
            self._apply_token_bitmask(logits, rows, self._to_device(words), V)
            guided = set(masks.rows)

        # min_tokens and bad words (a guided row's bans are in its mask)
        ban_rows, ban_ids = [], []
        for i, row_bans in enumerate(banned):
            if i in guided:
                continue
            ban_rows += [i] * len(row_bans)
            ban_ids += row_bans
        if ban_rows:
            logits, owned, changed = logits if owned else _own(logits), True, True
            idx = self._to_device(torch.tensor([ban_rows, ban_ids], dtype=torch.int64))
            # the fill value made on the device: ``logits[...] = float("-inf")`` copies a CPU scalar from pageable
            # memory, which waits for the device (the GPU sync test, session 48)
            logits.index_put_((idx[0], idx[1]), logits.new_full((), float("-inf")))

        pen_rows = [i for i, p in enumerate(params) if p.has_penalties]
        seen = None  # (words, penalties) where the repetition penalty is applied on read
        if pen_rows:
            if histories is not None:
                prompts = [histories[i].prompt() for i in pen_rows]
                outputs = [histories[i].output() for i in pen_rows]
            else:
                prompts = [np.asarray(prompt_token_ids[i], dtype=np.int64) for i in pen_rows]
                outputs = [np.asarray(output_token_ids[i], dtype=np.int64) for i in pen_rows]
            pend = None if pending is None else (pending[0], [pending[1][i] for i in pen_rows])
            counts = not self.lean_host or any(params[i].frequency_penalty != 0.0 or params[i].presence_penalty != 0.0
                                                for i in pen_rows)
            if not counts and self._penalty_on_read(params, pen_rows):
                up = self._seen_upload(pen_rows, prompts, outputs, pend)
                if up is not None:
                    seen = self.seen_words(B, V, *up), table[_REP]
            else:
                logits, owned, changed = logits if owned else _own(logits), True, True
                logits = self._apply_penalties(logits.contiguous(), table, pen_rows, prompts, outputs, pend, counts)

        greedy_rows = [i for i, p in enumerate(params) if p.temperature == 0]
        if len(greedy_rows) == B:
            return logits, None, greedy_rows, seen

        # each sampled row with a top-k up to CANDIDATE_MAX_TOP_K draws from its candidates, grouped by width
        by_width: dict[int, list[int]] = {}
        dense_rows = []
        for i, p in enumerate(params):
            if p.temperature == 0:
                continue
            if self.candidates and 0 < p.top_k <= CANDIDATE_MAX_TOP_K:
                by_width.setdefault(next(w for w in CANDIDATE_WIDTHS if w >= p.top_k), []).append(i)
            else:
                dense_rows.append(i)
        groups = []
        selected = self.candidate_race is not None and self.topk_select is not None  # widths up to SELECT_MAX_WIDTH
        coarse = None  # the penalised logits in the model's 16-bit dtype, for ``topk`` to pick candidates from
        if (any(not selected or w > SELECT_MAX_WIDTH for w in by_width) and self.coarse_select
                and raw.dtype in (torch.bfloat16, torch.float16)):
            coarse = logits.to(raw.dtype) if changed else raw  # unchanged: the caller's own values, no pass
        for width, rows in sorted(by_width.items()):
            where = None if len(rows) == B else self._to_device(torch.tensor(rows, dtype=torch.int64))
            # (where the group is some rows, their ids go up once: for their logits here, for their tokens in
            # ``sample``)
            if self.candidate_race is not None:
                k = min(width, V)
                if selected and width <= SELECT_MAX_WIDTH:
                    # (the caller's own 16-bit values where nothing changed them: their fp32 is exact, the same keys)
                    ids = self.topk_select(logits, k, rows=where, seen=seen)
                else:
                    src = logits if coarse is None else coarse  # what ``topk`` picks the candidates from
                    ids = self._select(src if where is None else src.index_select(0, where), k, None)[1]
                groups.append((rows, where, Pick(ids, k, logits, table, where, any(params[i].top_p < 1.0 for i in rows),
                                                 any(params[i].min_p > 0 for i in rows), seen)))
            elif where is None:
                groups.append((rows, None, self._candidates(logits, table, width, params, coarse)))
            else:
                groups.append((rows, where, self._candidates(
                    logits.index_select(0, where), table.index_select(1, where), width, [params[i] for i in rows],
                    None if coarse is None else coarse.index_select(0, where))))
        if not dense_rows:
            return logits, Draws(None, groups), greedy_rows, seen
        x = logits / table[_TEMP][:, None]  # [B, V]
        need_top_k = any(p.top_k > 0 for p in params)
        need_top_p = any(p.top_p < 1.0 for p in params)
        if need_top_k or need_top_p:
            sorted_x, order = x.sort(dim=-1, descending=True)  # [B, V]
            sorted_x = filter_sorted(sorted_x, table, top_k=need_top_k, top_p=need_top_p)
            x = torch.empty_like(x).scatter_(1, order, sorted_x)
        probs = x.softmax(dim=-1)
        if any(p.min_p > 0 for p in params):
            probs = min_p_filter(probs, table)
        return logits, Draws(probs, groups), greedy_rows, seen

    def _param_table(self, params: list[SamplingParams], V: int) -> Tensor:
        """The rows' float parameters as a [7, B] fp32 table on the device (``_TEMP`` ...). Kept from the step
        before while the step's params are the same objects in the same order (a decode batch that neither gained
        nor lost a request): building it from 256 rows' fields and copying it up took ~0.14 ms of host time a step
        on the CPU box. The cache holds the params themselves, so no id it keys on can be reused by another object;
        a request's params are not changed once it is added."""
        key = tuple(map(id, params))
        if self.lean_host and self._table is not None and self._table[0] == key and self._table[1] == V:
            return self._table[3]
        table = torch.tensor(
            [
                [
                    p.temperature if p.temperature > 0 else 1.0,
                    p.top_k if p.top_k > 0 else V,
                    p.top_p if p.top_p < 1.0 else 2.0,  # 2.0: can never trim
                    p.min_p,
                    p.repetition_penalty,
                    p.frequency_penalty,
                    p.presence_penalty,
                ]
                for p in params
            ],
            dtype=torch.float32,
        ).T.contiguous()  # [7, B]
        table = self._to_device(table)
        self._table = (key, V, list(params), table)
        return table

    def _candidates(self, logits: Tensor, table: Tensor, k: int, params: list[SamplingParams],
                    coarse: Tensor | None = None) -> Candidates:
        """Temperature, top-k, top-p and min-p over each row's ``k`` highest penalised logits (``logits`` [R, V],
        ``table`` [7, R] and ``params`` those rows'; k a candidate width at or above each row's top-k, so its own
        top-k masks the rest): the same filters as the whole-row path, whose sort of [R, V] (~39M values at 256
        rows of Qwen2.5's vocabulary) they avoid.
        Temperature is monotonic, so the highest logits are the highest after it; the values divided are the
        same fp32 values, so the same bits. The softmaxes and the cumulative mass sum k values instead of V (the
        rest are zeros there): their roundings can differ in the last bit, so a top-p cut that sits within
        rounding of the mass may fall the other way.

        ``coarse`` (or None): the same [R, V] logits rounded to a 16-bit dtype, which ``topk`` then selects from
        (on the H100, ``topk`` of 256 rows of fp32 took 0.63 ms, most of Qwen's default sampling's cost). Rounding
        is monotonic, so a token above another in fp32 is not below it in the coarse values: a top-k token can
        only be left out of the coarse selection by a tie at its coarse value with more than the slack's width of
        others, as with the fp32 values' own ties. A 16-bit model's logits round back to themselves, so only the
        values the bias, bans and penalties changed tie more than before. The candidates' values are then read
        from the fp32 logits, and ordered as without ``coarse``: the same candidates, the same bits."""
        k = min(k, logits.shape[1])  # a width past a small vocabulary: the whole of it
        values, ids = self._select(logits, k, coarse)
        ids, probs = candidate_filter(values, ids, k, table, top_p=any(p.top_p < 1.0 for p in params),
                                      min_p=any(p.min_p > 0 for p in params))
        return Candidates(ids, probs)

    def _select(self, logits: Tensor, k: int, coarse: Tensor | None) -> tuple[Tensor, Tensor]:
        """The values and ids of each row's k + ``CANDIDATE_SLACK`` highest logits, in any order ([R, sel] each;
        ``_candidates``): ``topk`` over ``coarse`` where given, the values then read from ``logits``."""
        sel = min(logits.shape[1], k + CANDIDATE_SLACK)
        if coarse is None:
            return logits.topk(sel, dim=-1, sorted=False)  # [R, sel]
        ids = coarse.topk(sel, dim=-1, sorted=False).indices
        return logits.gather(1, ids), ids

    def _with_bans(self, masks: TokenMasks, banned: list[list[int]]) -> np.ndarray:
        """``masks.bits`` with each guided row's bans (``_banned_tokens``) cleared from them, except where
        that would leave a row nothing to sample (its grammar may only end there: the grammar wins)."""
        bits = masks.bits
        for j, row in enumerate(masks.rows):
            if not banned[row]:
                continue
            cleared = bits[j].copy()
            ids = np.asarray(banned[row])
            np.bitwise_and.at(cleared, ids // 32, ~(np.int32(1) << (ids % 32).astype(np.int32)))
            if cleared.any():
                if bits is masks.bits:
                    bits = bits.copy()
                bits[j] = cleared
        return bits

    def _penalty_on_read(self, params: list[SamplingParams], pen_rows: list[int]) -> bool:
        """Whether this step's penalties can be applied as the kernels read the logits (``seen_words``): a
        repetition penalty alone (the caller checks), and every penalised row sampled from candidates that the pick
        and race kernels handle; no row asks for logprobs (they read the penalised logits whole). A penalised greedy
        row takes the copy: the argmax with the bits (built and measured in session 55, 1e75c3b) was no faster."""
        if (self.seen_words is None or self.topk_select is None or self.candidate_race is None or not self.candidates
                or any(p.logprobs is not None for p in params)):
            return False
        # (SELECT_MAX_WIDTH is one of CANDIDATE_WIDTHS: a top-k up to it is in a group the pick kernel serves)
        return all(params[i].temperature != 0 and 0 < params[i].top_k <= SELECT_MAX_WIDTH for i in pen_rows)

    def _seen_upload(self, rows, prompts, outputs, pending=None) -> tuple | None:
        """The repetition penalty kernel's and ``seen_words``' arguments after the logits, in one int32 upload:
        (rows [P], starts [P + 1], ids [S], and, where some row's newest token is pending, the sampled ids and
        each row's index into them [P]); None if no row has seen anything. Arguments as ``_apply_penalties``'."""
        P = len(rows)
        pend = [-1] * P if pending is None else list(pending[1])
        pend_rows = any(j >= 0 for j in pend)
        seen_len = np.fromiter((len(p) + len(o) for p, o in zip(prompts, outputs)), np.int64, P)
        if not seen_len.any() and not pend_rows:
            return None
        starts = np.zeros(P + 1, dtype=np.int64)
        np.cumsum(seen_len, out=starts[1:])
        parts = [np.asarray(rows), starts, *(a for p, o in zip(prompts, outputs) for a in (p, o))]
        if pend_rows:
            parts.append(np.asarray(pend, dtype=np.int64))
        dev = self._to_device(torch.from_numpy(np.concatenate(parts, dtype=np.int32)))
        rows_t, starts_t, ids, pend_src = dev.split([P, P + 1, int(starts[-1]), P if pend_rows else 0])
        return (rows_t, starts_t, ids, *((pending[0].long(), pend_src) if pend_rows else ()))

    def _apply_penalties(self, logits, table, rows, prompts, outputs, pending=None, counts=True):
        """Penalise ``rows`` of ``logits`` (fp32 [B, V], written in place); ``prompts`` / ``outputs``: those rows'
        ids as int64 arrays; ``pending``: None, or (sampled ids on the device, each row's index into them or -1)
        for a newest output token whose value is still on the device only (``sample``'s ``pending``).

        Only the tokens a row has seen change, so only they are touched: every row's prompt and output ids, laid
        end to end in one flat array with each id's row beside it, are gathered, penalised and scattered back. A
        token seen twice is gathered twice and written twice with the same value. Each output count is found
        by key (row * V + id) in the sorted keys of every row's outputs (two ``searchsorted``). Every seen value
        goes through the same fp32 operations as in the dense form (``lab.sampling_reference.penalties_dense``,
        the reference: a row's whole [V] logits, a count per token), so the bits are the same; an unseen token's is
        ``x - 0 - 0`` there, i.e. x, as here. At 256 rows of 151,936 logits the dense form ran ~15 full passes over
        [256, V] fp32 (≈ 1.8 ms a step on the H200, the structured stage at 5ab430d); this one reads and writes
        256 x (512 + 128) values, and its host side is a few whole-array calls whatever the row count (a padded
        [rows, longest] layout filled row by row took ~1.3 ms of host time at 256 rows on the CPU box).

        A pending token joins its row's ids and outputs on the device, read from the sampled ids: so a penalised
        row needs nothing landed from the step before, and async scheduling keeps its overlap.

        ``counts`` False (no row has a frequency or presence penalty: a repetition penalty alone, as Qwen2.5-Instruct's
        generation_config gives every request): the output counts are not found, which takes 17 of a 256-row
        call's ~42 launches and half its upload of output ids; the bits are the same (x - 0 * n - 0 * seen = x)."""
        if not counts and self.repetition_kernel is not None:  # one upload, one launch
            up = self._seen_upload(rows, prompts, outputs, pending)
            return logits if up is None else self.repetition_kernel(logits, *up[:3], table[_REP], *up[3:])
        P, V = len(rows), logits.shape[1]
        pend = [-1] * P if pending is None else list(pending[1])
        pend_rows = [j for j in range(P) if pend[j] >= 0]
        seen_len = np.fromiter((len(p) + len(o) for p, o in zip(prompts, outputs)), np.int64, P)
        out_len = np.fromiter((len(o) for o in outputs), np.int64, P)
        if not seen_len.any() and not pend_rows:
            return logits
        if not counts:  # no output counts to find: the outputs go up once
            outputs_again, out_len = [], out_len[:0]
        else:
            outputs_again = outputs
        parts = [np.asarray(rows), *(a for p, o in zip(prompts, outputs) for a in (p, o)),  # each row's prompt, outputs
                 *outputs_again, seen_len, out_len,  # the outputs again (for the counts); the rows' lengths
                 np.asarray(pend_rows, dtype=np.int64), np.asarray([pend[r] for r in pend_rows], dtype=np.int64)]
        S, O, E = int(seen_len.sum()), int(out_len.sum()), len(pend_rows)
        # one int32 copy to the device (ids < 2**31), widened there; each id's row expanded there from the lengths
        dev = self._to_device(torch.from_numpy(np.concatenate(parts, dtype=np.int32))).long()
        rows_t, ids, outs, seen_n, out_n, pend_row, pend_src = dev.split([P, S, O, P, len(out_len), E, E])
        j = torch.arange(P, device=dev.device)
        id_row = torch.repeat_interleave(j, seen_n, output_size=S)  # output_size: no sync to learn it
        if E:
            token = pending[0].index_select(0, pend_src).to(torch.int64)
            ids, id_row = torch.cat([ids, token]), torch.cat([id_row, pend_row])
        flat = rows_t.index_select(0, id_row) * V + ids
        x = logits.view(-1).index_select(0, flat)
        rep = table[_REP].index_select(0, rows_t).index_select(0, id_row)  # each id's row's penalty
        x = torch.where(x > 0, x / rep, x * rep)  # every gathered token is seen (rep 1: x / 1 = x exactly)
        if counts:
            out_row = torch.repeat_interleave(j, out_n, output_size=O)
            if E:
                outs, out_row = torch.cat([outs, token]), torch.cat([out_row, pend_row])
            keys = (out_row * V + outs).sort().values
            key = id_row * V + ids
            n = (torch.searchsorted(keys, key, right=True) - torch.searchsorted(keys, key)).float()
            t = table.index_select(1, rows_t).index_select(1, id_row)  # [7, S + E]: each id's row's parameters
            x = x - t[_FREQ] * n - t[_PRES] * (n > 0).float()
        # else every row's frequency and presence penalties are 0: x - 0 * n - 0 * seen is x, bit for bit
        logits.view(-1).index_put_((flat,), x)
        return logits

    def _race(self, pick: Pick, rows: list[int], seeds, num_outputs, out: Tensor) -> None:
        """``candidate_race`` for a ``Pick`` of batch ``rows``, each token written to ``out[row]``. Unseeded rows'
        noise is the same [R, k] generator draws the torch path takes (``_exponential_noise``), seeded rows' the
        same hash at the same ids (in the kernel)."""
        R = len(rows)
        seeded = [seeds[i] is not None for i in rows]
        noise = None
        if not all(seeded):
            noise = torch.empty(R, pick.k, device=out.device).exponential_(generator=self.generator)
            noise.clamp_min_(1e-30)  # a zero would turn p / q into inf (or nan for p == 0)
        packed = None
        if any(seeded):
            packed = self._to_device(torch.tensor([seeded, [signed64(seeds[i] or 0) for i in rows],
                                                   [num_outputs[i] for i in rows]], dtype=torch.int64))
        self.candidate_race(pick.logits, pick.ids, pick.k, pick.table, noise, packed, pick.where, out, seen=pick.seen)

    def _exponential_noise(self, probs, seeds, num_outputs, token_ids: Tensor | None = None) -> Tensor:
        """q ~ Exp(1) per (row, token): hashed for seeded rows, generator for the rest. ``token_ids`` [B, k]: the
        token each column of ``probs`` stands for (``Candidates``); None: column j is token j."""
        B, V = probs.shape
        seeded = [i for i, s in enumerate(seeds) if s is not None]
        q = torch.empty_like(probs)
        if len(seeded) < B:
            q.exponential_(generator=self.generator)
            q.clamp_min_(1e-30)  # a zero would turn p / q into inf (or nan for p == 0)
        if seeded:
            packed = self._to_device(
                torch.tensor(
                    [
                        seeded,
                        [signed64(seeds[i]) for i in seeded],
                        [num_outputs[i] for i in seeded],
                    ],
                    dtype=torch.int64,
                )
            )
            if token_ids is None:
                u = seeded_uniform_tensor(packed[1], packed[2], V)
            else:
                u = seeded_uniform_at(packed[1], packed[2], token_ids.index_select(0, packed[0]))
            noise = u.log_().neg_()
            if len(seeded) == B:
                q = noise
            else:
                q[packed[0]] = noise
        return q
