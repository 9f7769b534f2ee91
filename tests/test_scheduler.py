"""Scheduler with no model: a fake step appends a token that is a function of the prefix,
so recomputation after preemption must reproduce it."""
import random

from pageserve.engine.block_manager import BlockManager
from pageserve.engine.sampling_params import SamplingParams
from pageserve.engine.scheduler import Scheduler
from pageserve.engine.sequence import Sequence, SequenceStatus

BS = 4


def fake_token(seq: Sequence) -> int:
    return (sum(seq.all_token_ids()) * 31 + seq.num_tokens) % 1000


def make(num_blocks=64, budget=32, max_seqs=8, chunked=True, caching=False):
    bm = BlockManager(num_blocks, BS, enable_prefix_caching=caching)
    return bm, Scheduler(bm, max_seqs, budget, enable_chunked_prefill=chunked)


def add(sched, prompt, max_tokens=5, rid="r"):
    seq = Sequence(rid, list(prompt), SamplingParams(max_tokens=max_tokens))
    sched.add(seq)
    return seq


def run_step(sched):
    """schedule + the engine's bookkeeping, with a fake model. Returns the batch."""
    batch = sched.schedule()
    sched.update_after_step(batch)
    for seq in batch.sampling_seqs:
        seq.output_token_ids.append(fake_token(seq))
        if seq.num_output_tokens >= seq.params.max_tokens:
            sched.finish(seq, "length")
    sched.remove_finished()
    return batch


def run_all(sched, max_steps=10_000, check=None):
    steps = 0
    while sched.has_unfinished():
        batch = run_step(sched)
        assert not batch.is_empty, "no progress"
        if check:
            check(batch)
        steps += 1
        assert steps < max_steps
    return steps


def expected_outputs(prompt, max_tokens):
    seq = Sequence("x", list(prompt), SamplingParams(max_tokens=max_tokens))
    for _ in range(max_tokens):
        seq.output_token_ids.append(fake_token(seq))
    return seq.output_token_ids


def random_prompts(rng, n, lo=1, hi=40):
    return [[rng.randrange(1000) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def test_token_budget_and_seq_limit_are_never_exceeded():
    rng = random.Random(0)
    bm, sched = make(num_blocks=200, budget=24, max_seqs=5)
    seqs = [add(sched, p, max_tokens=rng.randint(1, 8), rid=str(i)) for i, p in enumerate(random_prompts(rng, 20))]

    def check(batch):
        assert batch.num_batched_tokens == sum(batch.num_new_tokens) <= 24
        assert len(batch) <= 5 and len(sched.running) <= 5
        assert all(n > 0 for n in batch.num_new_tokens)

    run_all(sched, check=check)
    assert all(s.is_finished and s.num_output_tokens == s.params.max_tokens for s in seqs)
    assert bm.num_free_blocks == 200


def test_long_prompt_is_chunked_and_decodes_ride_along():
    bm, sched = make(budget=8)
    short = add(sched, range(3), max_tokens=6, rid="short")
    run_step(sched)  # short's prompt, first token
    long = add(sched, range(30), max_tokens=2, rid="long")
    batch = run_step(sched)
    assert batch.seqs == [short, long] and batch.num_new_tokens == [1, 7]
    assert batch.samples == [True, False]  # a chunk short of the prompt's end samples nothing
    assert long.num_computed_tokens == 7 and long.num_output_tokens == 0
    run_all(sched)
    assert long.output_token_ids == expected_outputs(range(30), 2)
    assert bm.num_free_blocks == 64


def test_without_chunked_prefill_a_prompt_runs_whole():
    bm, sched = make(budget=16, chunked=False)
    a = add(sched, range(10), rid="a")
    b = add(sched, range(10), rid="b")  # does not fit beside a in the first step
    batch = run_step(sched)
    assert batch.seqs == [a] and batch.num_new_tokens == [10]
    batch = run_step(sched)
    assert batch.seqs == [a, b] and batch.num_new_tokens == [1, 10]
    run_all(sched)


def test_running_sequences_are_scheduled_before_waiting_ones():
    _, sched = make(budget=4)
    a = add(sched, range(2), max_tokens=10, rid="a")
    run_step(sched)
    add(sched, range(20), rid="b")
    for _ in range(4):
        batch = run_step(sched)
        assert batch.seqs[0] is a and batch.num_new_tokens[0] == 1


def test_preempted_sequences_resume_and_finish_with_the_same_tokens():
    rng = random.Random(1)
    prompts = random_prompts(rng, 10, lo=5, hi=20)
    bm, sched = make(num_blocks=12, budget=32, max_seqs=10)  # far fewer blocks than 10 sequences need
    seqs = [add(sched, p, max_tokens=12, rid=str(i)) for i, p in enumerate(prompts)]
    run_all(sched)
    assert sched.num_preemptions > 0
    assert any(s.num_preemptions for s in seqs)
    for s, p in zip(seqs, prompts):
        assert s.is_finished and s.output_token_ids == expected_outputs(p, 12)
    assert bm.num_free_blocks == 12
    assert all(b.ref_cnt == 0 for b in bm.blocks)


def test_preemption_takes_the_newest_and_requeues_it_first():
    bm, sched = make(num_blocks=4, budget=64)
    old = add(sched, range(7), max_tokens=9, rid="old")  # at most 16 tokens: fits the pool alone
    new = add(sched, range(100, 107), max_tokens=9, rid="new")
    run_step(sched)  # both prompts: 2 blocks each, pool full
    assert bm.num_free_blocks == 0
    run_step(sched)  # both compute token 7, still in their second block
    batch = run_step(sched)  # token 8 needs a third block: the pool is empty
    assert batch.preempted == [new] and new.status is SequenceStatus.WAITING
    assert sched.waiting[0] is new and new.num_computed_tokens == 0 and new.block_table == []
    assert batch.seqs == [old]
    run_all(sched)
    assert old.is_finished and new.is_finished


def test_prefix_cache_restores_part_of_a_preempted_sequence():
    bm, sched = make(num_blocks=8, budget=64, caching=True)  # 6 blocks (as once) evicted all of b's before it came back
    a = add(sched, range(12), max_tokens=10, rid="a")
    b = add(sched, range(50, 58), max_tokens=10, rid="b")
    steps = 0
    while not b.num_preemptions:
        run_step(sched)
        steps += 1
        assert steps < 50
    run_all(sched)
    assert b.is_finished and b.output_token_ids == expected_outputs(range(50, 58), 10)
    assert bm.num_free_blocks == 8
    assert bm.num_hit_tokens > 0  # its recomputation found its own blocks...
    assert b.num_cached_tokens == 0  # ...which are not prompt tokens the cache held for it


def test_lone_sequence_larger_than_free_pool_still_finishes():
    # a sequence that grows to the whole pool must preempt others, never deadlock
    bm, sched = make(num_blocks=5, budget=64)
    big = add(sched, range(10), max_tokens=9, rid="big")  # 19 tokens: 5 blocks at the end
    small = add(sched, range(3), max_tokens=3, rid="small")
    run_all(sched)
    assert big.num_output_tokens == 9 and small.num_output_tokens == 3
    assert bm.num_free_blocks == 5


def test_shared_prefix_hits_and_pool_is_free_after():
    bm, sched = make(num_blocks=64, budget=64, caching=True)
    prefix = list(range(16))
    first = add(sched, prefix + [1], rid="first")
    run_all(sched)
    later = [add(sched, prefix + [i, i + 1], rid=f"l{i}") for i in range(3)]
    run_all(sched)
    assert all(s.num_cached_tokens == 16 for s in later)
    assert first.num_cached_tokens == 0
    assert bm.num_hit_tokens == 48
    assert bm.num_free_blocks == 64 and all(b.ref_cnt == 0 for b in bm.blocks)


def test_finishing_a_waiting_sequence_removes_it():
    bm, sched = make()
    seq = add(sched, range(5))
    sched.finish(seq, "abort")
    assert not sched.has_unfinished() and seq.finish_reason == "abort"
    assert bm.num_free_blocks == 64


# ----------------------------------------------------------------------------- the priority policy
def make_priority(num_blocks=64, budget=32, max_seqs=8):
    bm = BlockManager(num_blocks, BS)
    return bm, Scheduler(bm, max_seqs, budget, policy="priority")


def add_prio(sched, prompt, priority, max_tokens=5, rid="r", arrival=0.0):
    seq = Sequence(rid, list(prompt), SamplingParams(max_tokens=max_tokens), arrival_time=arrival, priority=priority)
    sched.add(seq)
    return seq


def test_the_priority_policy_admits_the_most_urgent_first_and_fcfs_within_a_priority():
    _, sched = make_priority(max_seqs=1)
    seqs = [add_prio(sched, range(i, i + 5), prio, rid=name, arrival=float(i))
            for i, (name, prio) in enumerate([("a", 2), ("b", 0), ("c", 1), ("d", 0), ("e", -1)])]
    finished = []
    while sched.has_unfinished():
        batch = run_step(sched)
        finished += [s.request_id for s in batch.seqs if s.is_finished]
    assert finished == ["e", "b", "d", "c", "a"]
    assert all(s.output_token_ids == expected_outputs(range(i, i + 5), 5) for i, s in enumerate(seqs))


def test_fcfs_is_arrival_order_whatever_the_priorities_say():
    _, sched = make(max_seqs=1)
    for i, prio in enumerate([2, 0, 1]):
        sched.add(Sequence(str(i), list(range(i, i + 5)), SamplingParams(max_tokens=3), priority=prio))
    finished = []
    while sched.has_unfinished():
        finished += [s.request_id for s in run_step(sched).seqs if s.is_finished]
    assert finished == ["0", "1", "2"]


def test_the_priority_policy_preempts_the_least_urgent_not_the_newest():
    bm, sched = make_priority(num_blocks=4, budget=64)
    lazy = add_prio(sched, range(7), 5, max_tokens=9, rid="lazy", arrival=0.0)  # older, less urgent
    urgent = add_prio(sched, range(100, 107), 0, max_tokens=9, rid="urgent", arrival=1.0)
    run_step(sched)
    assert sched.running == [urgent, lazy]  # most urgent first: it gets the budget and the blocks first
    run_step(sched)
    batch = run_step(sched)  # token 8 needs a third block each: the pool is empty
    assert batch.preempted == [lazy] and batch.seqs == [urgent]
    assert sched.waiting[0] is lazy and lazy.block_table == []
    run_all(sched)
    assert urgent.output_token_ids == expected_outputs(range(100, 107), 9)
    assert lazy.output_token_ids == expected_outputs(range(7), 9)


def test_a_preempted_sequence_waits_behind_more_urgent_arrivals_and_ahead_of_less_urgent_ones():
    bm, sched = make_priority(num_blocks=4, budget=64, max_seqs=2)
    a = add_prio(sched, range(7), 0, max_tokens=9, rid="a", arrival=0.0)
    b = add_prio(sched, range(100, 107), 1, max_tokens=9, rid="b", arrival=1.0)
    run_step(sched)
    run_step(sched)
    later = add_prio(sched, range(200, 203), 1, max_tokens=2, rid="later", arrival=2.0)
    first = add_prio(sched, range(300, 303), 0, max_tokens=2, rid="first", arrival=3.0)
    assert list(sched.waiting) == [first, later]
    batch = run_step(sched)
    assert batch.preempted == [b]
    assert list(sched.waiting) == [first, b, later]  # b arrived before later, at the same priority
    run_all(sched)
    assert all(s.is_finished for s in (a, b, later, first))
    assert b.output_token_ids == expected_outputs(range(100, 107), 9)


def test_random_priorities_under_a_tight_pool_finish_with_the_same_tokens():
    rng = random.Random(3)
    prompts = random_prompts(rng, 16, lo=3, hi=24)
    bm, sched = make_priority(num_blocks=14, budget=24, max_seqs=6)
    seqs = [add_prio(sched, p, rng.randint(-2, 2), max_tokens=10, rid=str(i), arrival=float(i))
            for i, p in enumerate(prompts)]
    run_all(sched)
    assert sched.num_preemptions > 0
    for s, p in zip(seqs, prompts):
        assert s.is_finished and s.output_token_ids == expected_outputs(p, 10)
    assert bm.num_free_blocks == 14


def test_an_unknown_policy_is_refused():
    import pytest

    with pytest.raises(ValueError, match="scheduling policy"):
        Scheduler(BlockManager(8, BS), 4, 32, policy="lifo")


def test_a_request_whose_adapter_needs_a_slot_more_waits_without_blocking_the_others():
    """max_loras = 1: with adapter 1 running, a request for adapter 2 is passed over (it keeps its place in the
    queue) while a later request for adapter 1 and one with no adapter are admitted; it runs once adapter 1 left."""
    from pageserve.engine.lora import LoRARequest

    bm = BlockManager(64, BS, enable_prefix_caching=False)
    sched = Scheduler(bm, 8, 64, max_loras=1)
    one, two = LoRARequest("one", 1, "/a"), LoRARequest("two", 2, "/b")

    def add_lora(rid, lora, max_tokens):
        seq = Sequence(rid, [1, 2, 3], SamplingParams(max_tokens=max_tokens), lora_request=lora)
        sched.add(seq)
        return seq

    a = add_lora("a", one, 2)
    b = add_lora("b", two, 2)
    c = add_lora("c", one, 2)
    d = add_lora("d", None, 2)
    first = run_step(sched)
    assert first.seqs == [a, c, d] and list(sched.waiting) == [b]
    while b.status is SequenceStatus.WAITING:
        batch = run_step(sched)
        assert not ({s.lora_id for s in batch.seqs} >= {1, 2})  # never both adapters in one step
    assert a.is_finished and c.is_finished and b.status is SequenceStatus.RUNNING
    assert Scheduler(bm, 8, 64).max_loras is None  # without LoRA nothing is passed over
