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
