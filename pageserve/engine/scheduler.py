"""Which sequences run in the next step, and how many tokens each.

One rule covers everything: a scheduled sequence computes ``num_new_tokens`` more of its
tokens, ``num_computed_tokens -> num_computed_tokens + num_new_tokens <= num_tokens``, and
the step's total stays within ``max_num_batched_tokens``. Running sequences go first
(decodes and unfinished prompt chunks, oldest first), then waiting ones are admitted in
arrival order. When the pool runs out of blocks the newest running sequences are
preempted: their blocks are freed and they go back to the front of the waiting queue to
be recomputed (the prefix cache may restore part of them).

With ``policy="priority"`` (vLLM's ``--scheduling-policy priority``) "oldest" becomes "most
urgent": both queues are kept in (priority, arrival) order, a lower priority value first, so
urgent requests are admitted first and get the step's token budget first, and the least
urgent running sequence is the one preempted. A waiting request never preempts a running one:
it waits for blocks or a free batch slot like any other (as in vLLM v1).

With LoRA adapters (engine/lora.py) at most ``max_loras`` distinct adapters run at once (the device holds
that many); a waiting request whose adapter would be one more is passed over until one leaves.

Speculative decoding (engine/speculative.py): a decoding sequence with d drafts
(``Sequence.spec_token_ids``) is given 1 + d tokens when the budget and the free blocks allow (else
it decodes plainly: drafts never preempt anyone); its ``num_computed_tokens`` moves past its newest
token at the step, and past the drafts the model confirmed when the step lands.
"""
from __future__ import annotations

from bisect import bisect_right
from collections import deque
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .sequence import Sequence, SequenceStatus

POLICIES = ("fcfs", "priority")


def _urgency(seq: Sequence) -> tuple[int, float, int]:
    """The priority policy's order: lower priority values first, then arrival, then creation."""
    return seq.priority, seq.arrival_time, seq.seq_id


@dataclass
class ScheduledBatch:
    """One step's work. ``seqs[i]`` computes ``num_new_tokens[i]`` tokens starting at its
    ``num_computed_tokens``; ``samples[i]`` says whether that reaches its last token (so the
    step samples a token for it). ``spec[i]``: how many of its ``num_new_tokens[i]`` are speculative
    drafts (``Sequence.spec_token_ids``) after its newest token; such a sequence samples at each of
    its last ``spec[i] + 1`` tokens (engine/speculative.py)."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    samples: list[bool] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    spec: list[int] = field(default_factory=list)
    num_spec_tokens: int = 0  # drafts in the step
    num_batched_tokens: int = 0
    num_prefill_tokens: int = 0  # tokens of prompt chunks and recomputation (not plain decodes)

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def sampling_seqs(self) -> list[Sequence]:
        return [s for s, smp in zip(self.seqs, self.samples) if smp]

    def add(self, seq: Sequence, num_new: int, num_tokens: int, spec: int = 0) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(num_new)
        self.samples.append(seq.num_computed_tokens + num_new == num_tokens + spec)
        self.spec.append(spec)
        self.num_spec_tokens += spec
        self.num_batched_tokens += num_new
        if not (num_new == 1 + spec and seq.num_output_tokens and seq.num_computed_tokens == num_tokens - 1):
            self.num_prefill_tokens += num_new


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
        policy: str = "fcfs",
        max_loras: int | None = None,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"scheduling policy must be one of {POLICIES}, got {policy!r}")
        self.block_manager = block_manager
        self.by_priority = policy == "priority"
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.max_loras = max_loras  # distinct LoRA adapters running at once (the device's slots); None: no adapters
        self.waiting: deque[Sequence] = deque()  # fcfs: arrival order; priority: by _urgency
        self.running: list[Sequence] = []  # fcfs: admission order, the last the newest; priority: by _urgency
        self.num_preemptions = 0

    # ------------------------------------------------------------------ queues
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        if self.by_priority:
            self.waiting.insert(bisect_right(self.waiting, _urgency(seq), key=_urgency), seq)
        else:
            self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ the step
    def schedule(self) -> ScheduledBatch:
        bm = self.block_manager
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        running = self.running

        # running sequences: decodes and unfinished prompt chunks, oldest first
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            if seq.length_capped:  # finishes when its pending token lands: nothing more to run
                i += 1
                continue
            num_tokens = seq.num_tokens
            num_new = min(num_tokens - seq.num_computed_tokens, budget)
            if num_new <= 0:  # nothing to compute (should not happen); keep it for later
                i += 1
                continue
            spec = 0
            if seq.spec_token_ids and num_tokens - seq.num_computed_tokens == 1:  # a decode with drafts
                spec = min(len(seq.spec_token_ids), budget - 1)
                if spec and not bm.allocate_slots(seq, 1 + spec):
                    spec = 0  # no blocks for the drafts: decode plainly rather than preempt for them
                num_new += spec
            while not bm.allocate_slots(seq, num_new):
                victim = running.pop()  # the newest (least urgent); never one already scheduled (those are < i)
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            else:
                batch.add(seq, num_new, num_tokens, spec)
                budget -= num_new
                i += 1
                continue
            break  # seq preempted itself: it was the last running one

        # waiting sequences, in order, unless this step had to preempt running ones. One whose LoRA adapter would
        # be one too many for the slots is passed over (it waits for a running adapter to leave), as in vLLM
        waiting = self.waiting
        loras = None if self.max_loras is None else {s.lora_id for s in running if s.lora_id is not None}
        w = 0
        while w < len(waiting) and (not batch.preempted or batch.is_empty) and budget > 0 \
                and len(running) < self.max_num_seqs:
            seq = waiting[w]
            if loras is not None and seq.lora_id is not None and seq.lora_id not in loras \
                    and len(loras) >= self.max_loras:
                w += 1
                continue
            if seq.num_pending:  # preempted with a token in flight: recompute once it has landed
                break
            hits = bm.get_computed_blocks(seq)
            num_hit = len(hits) * bm.block_size
            num_new = seq.num_tokens - num_hit
            if num_new > budget:
                # without chunked prefill a prompt runs whole; one longer than the whole
                # budget (only a recomputed preempted sequence) is chunked all the same
                whole_fits_some_step = num_new <= self.max_num_batched_tokens
                if not self.enable_chunked_prefill and (whole_fits_some_step or budget < self.max_num_batched_tokens):
                    break
                num_new = budget
            if not bm.allocate_slots(seq, num_new, hits):
                break
            del waiting[w]
            if loras is not None and seq.lora_id is not None:
                loras.add(seq.lora_id)
            seq.num_computed_tokens = num_hit
            if not seq.num_preemptions:  # what the prompt found; a recomputation's hits are its own blocks
                seq.num_cached_tokens = min(num_hit, seq.num_prompt_tokens)
            seq.status = SequenceStatus.RUNNING
            if self.by_priority:
                running.insert(bisect_right(running, _urgency(seq), key=_urgency), seq)
            else:
                running.append(seq)
            batch.add(seq, num_new, seq.num_tokens)
            budget -= num_new
        return batch

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        if self.by_priority:
            self.waiting.insert(bisect_right(self.waiting, _urgency(seq), key=_urgency), seq)
        else:
            self.waiting.appendleft(seq)  # preempted newest-first, so older ones end up in front

    def update_after_step(self, batch: ScheduledBatch) -> None:
        """The step ran: the scheduled tokens are in the cache; publish newly full blocks. (A sequence
        that finished since it was scheduled, its blocks freed, is skipped: the engine may land the
        previous step in between, ``LLMEngine.step``.)"""
        bm = self.block_manager
        caching = bm.enable_prefix_caching  # checked once a step, not once a sequence
        for seq, n, spec in zip(batch.seqs, batch.num_new_tokens, batch.spec):
            if not seq.is_finished:
                seq.num_computed_tokens += n - spec  # drafts count once accepted (LLMEngine._land)
                if caching:
                    bm.cache_full_blocks(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark ``seq`` finished and free its blocks; it leaves ``running`` at the next
        :meth:`remove_finished` (or ``waiting`` right away)."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.WAITING:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        else:  # blocks its last step filled (a speculative step's accepted drafts) are published before they go
            self.block_manager.cache_full_blocks(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def remove_finished(self) -> None:
        self.running = [s for s in self.running if not s.is_finished]
