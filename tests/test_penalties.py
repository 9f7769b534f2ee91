"""The repetition penalty kernel (``kernels/penalties.py``) against its reference: rows longer than a program's
block, ids repeated within and across blocks, rows with nothing seen, the newest token from the device (also one
already seen), -inf and zero logits, penalties below and above 1. The sampler's own tests run it against the dense
penalties (tests/test_sampler.py, ``_repetition_kernels``)."""
import pytest
import torch

from pageserve.kernels.penalties import BLOCK, repetition_penalty, repetition_penalty_reference

# the kernels on CUDA where there is a GPU, else on the interpreter (tests/conftest.py sets it only then)
DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_pending", [False, True])
def test_the_kernel_gives_the_references_bits(device, with_pending):
    g = torch.Generator().manual_seed(7 + with_pending)
    B, V = 6, 400
    logits = torch.randn(B, V, generator=g) * 3
    logits[0, :5] = float("-inf")
    logits[1, 7] = 0.0
    lens = [3, 0, BLOCK + 517, 40, 1]
    rows = torch.tensor([4, 2, 0, 1, 5], dtype=torch.int32)
    ids = torch.randint(0, 60, (sum(lens),), generator=g, dtype=torch.int32)  # many repeats, across blocks too
    ids[lens[0] + 1000] = 3  # a -inf logit seen
    starts = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    penalty = torch.tensor([1.3, 0.7, 2.0, 1.0, 1.05, 0.9])
    pending = pending_src = None
    if with_pending:
        pending = torch.randint(0, V, (9,), generator=g)
        pending[2] = int(ids[0])  # the newest token already in row 4's ids
        pending_src = torch.tensor([2, 5, -1, 0, 8], dtype=torch.int32)
    args = [t if t is None else t.to(device) for t in (rows, starts, ids, penalty, pending, pending_src)]
    x = logits.to(device)
    got = repetition_penalty(x.clone(), *args)
    want = repetition_penalty_reference(x.clone(), *args)
    assert torch.equal(got, want)
    assert not torch.equal(got, x)
    assert torch.equal(got[3], x[3])  # not a penalised row


def test_mismatched_arguments_are_refused():
    x = torch.zeros(2, 10)
    rows, ids = torch.tensor([0], dtype=torch.int32), torch.tensor([1, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match="starts"):
        repetition_penalty(x, rows, torch.tensor([0], dtype=torch.int32), ids, torch.ones(2))
    with pytest.raises(ValueError, match="go together"):
        repetition_penalty(x, rows, torch.tensor([0, 2], dtype=torch.int32), ids, torch.ones(2),
                           torch.zeros(1, dtype=torch.int64))


def _seen_inputs(g, B, V, lens, with_pending):
    """Seen ids for rows 4, 2, 0, 1, 5 (``lens`` each) drawn from each row's highest logits and a few others, so the
    penalty moves the top of the rows; ``pending`` / ``pending_src`` as ``repetition_penalty``'s, or None."""
    logits = torch.randn(B, V, generator=g) * 3
    rows = torch.tensor([4, 2, 0, 1, 5], dtype=torch.int32)
    top = logits.topk(40, dim=-1).indices
    ids = torch.cat([torch.cat([top[r, torch.randint(0, 40, (n,), generator=g)],
                                torch.randint(0, V, (n // 4,), generator=g)])
                     for r, n in zip(rows.tolist(), lens)]).to(torch.int32)
    lens = [n + n // 4 for n in lens]
    starts = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    ids[0] = 31  # the bit whose word is negative as an int32
    pending = pending_src = None
    if with_pending:
        pending = torch.randint(0, V, (9,), generator=g)
        pending[2] = int(ids[0])  # already among row 4's ids
        pending[5] = int(top[2, 0])  # row 2's highest logit: seen only through the device
        pending_src = torch.tensor([2, 5, -1, 0, 8], dtype=torch.int32)
    return logits, rows, starts, ids, pending, pending_src


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_pending", [False, True])
def test_seen_words_give_the_references_bits(device, with_pending):
    from pageserve.kernels.penalties import seen_words, seen_words_reference

    g = torch.Generator().manual_seed(17 + with_pending)
    B, V = 6, 1000
    _, rows, starts, ids, pending, pending_src = _seen_inputs(g, B, V, [3, 0, BLOCK + 300, 40, 1], with_pending)
    ids[5] = V + 40  # past the row's words: dropped, not set in the next row's
    args = [t if t is None else t.to(device) for t in (rows, starts, ids, pending, pending_src)]
    got = seen_words(B, V, *args)
    want = seen_words_reference(B, V, *(t if t is None else t.cpu() for t in args))
    assert got.shape == (B, (V + 31) // 32) and got.dtype == torch.int32
    assert torch.equal(got.cpu(), want)
    assert got[4, 0] < 0  # token 31 set: the sign bit
    assert not got[3].any()  # not a penalised row


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_penalty_on_read_picks_and_races_as_the_penalised_copy_does(device, dtype):
    # the pick and the race with the repetition penalty applied as they read the model's logits give the ids and
    # tokens they give over the penalised fp32 copy (the same fp32 values: the same bits), and not the unpenalised
    from pageserve.kernels.candidate_race import candidate_race
    from pageserve.kernels.penalties import seen_words
    from pageserve.kernels.reference import apply_seen
    from pageserve.kernels.topk_select import topk_candidates

    g = torch.Generator().manual_seed(23)
    B, V, k = 6, 3000, 20
    logits, rows, starts, ids, pending, pending_src = _seen_inputs(g, B, V, [30, 0, 500, 12, 2], True)
    if dtype == torch.float32:  # row 5 (its ids last): a seen NaN, and a seen negative NaN (0xFFC00000) alone in
        # its chunk (a GPU's NaN arithmetic gives +NaN for it, the CPU's keeps its sign: the kernels must agree)
        logits[5, 7] = float("nan")
        logits[5, 300] = torch.tensor([-0x400000], dtype=torch.int32).view(torch.float32).item()
        ids, starts = torch.cat([ids, torch.tensor([7, 300], dtype=torch.int32)]), starts.clone()
        starts[-1] += 2
    x = logits.to(dtype).to(device)
    penalty = torch.tensor([1.3, 1.0, 2.0, 1.0, 1.05, 0.7], device=device)
    words = seen_words(B, V, *(t.to(device) for t in (rows, starts, ids, pending, pending_src)))
    dense = apply_seen(x, words, penalty)
    assert dense.dtype == torch.float32 and not torch.equal(dense[:5], x[:5].float())
    for sub in (None, torch.tensor([5, 0, 2], device=device)):
        picked = topk_candidates(x, k, rows=sub, seen=(words, penalty))
        assert torch.equal(picked, topk_candidates(dense, k, rows=sub))
    picked = topk_candidates(dense, k)
    assert not torch.equal(picked, topk_candidates(x, k))  # the penalty moved some row's candidates
    table = torch.tensor([[0.7] * B, [20.0] * B, [0.8] * B, [0.0] * B], device=device)
    noise = torch.empty(B, k).exponential_(generator=g).to(device)
    got = candidate_race(x, picked, k, table, noise, seen=(words, penalty))
    assert torch.equal(got, candidate_race(dense, picked, k, table, noise))
    with pytest.raises(ValueError, match="words"):
        topk_candidates(x, k, seen=(words[:, 1:].contiguous(), penalty))
