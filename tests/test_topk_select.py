"""The candidate pick (``kernels/topk_select.py``) against the exact top k (its reference): the kernel's ids are a
superset of the reference's, distinct, real and within the slots, whatever the dtype, the rows, ties, -inf and
vocabularies not a multiple of a chunk; where too many values tie at the threshold it gives the exact top k."""
import pytest
import torch

from pageserve.kernels.topk_select import CHUNK, default_cap, topk_candidates, topk_candidates_reference

DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]


def _check(got, want, cap, V):
    assert got.shape[1] == cap
    for g, w in zip(got.tolist(), want.tolist()):
        g_ids = [i for i in g if i >= 0]
        assert len(g_ids) == len(set(g_ids)) and all(0 <= i < V for i in g_ids)
        assert {i for i in w if i >= 0} <= set(g_ids)
        assert all(i == -1 for i in g[len(g_ids):])  # the unused slots come last


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [32, 128])
def test_the_pick_holds_every_top_k_id(device, dtype, k):
    g = torch.Generator().manual_seed(k)
    B, V = 6, 50 * CHUNK + 37
    x = (torch.randn(B, V, generator=g) * 3)
    x[1, ::3] = float("-inf")  # banned tokens
    x[2, :] = float("-inf")
    x[2, 50:60] = 1.0  # fewer finite values than k, tied
    x[3, 7 * CHUNK: 8 * CHUNK] += 20  # the top values crowded in one chunk: many at or above the threshold
    x[4, :] = x[4, :].round()  # few distinct values: ties across the threshold
    x[5, torch.arange(45) * CHUNK + 3] = 10 + torch.arange(45.0) / 8  # the top values one a chunk: the k-th is T
    x = x.to(dtype).to(device)
    got = topk_candidates(x, k)
    _check(got.cpu(), topk_candidates_reference(x, k).cpu(), default_cap(k), V)


@pytest.mark.parametrize("device", DEVICES)
def test_too_many_ties_at_the_threshold_give_the_exact_top_k(device):
    # every value equal: all of them tie with the threshold, more than the slots hold; the exact top k is the k
    # lowest ids (the race's order), and so is every row of a few distinct values
    V, k = 9 * CHUNK + 5, 32
    x = torch.zeros(3, V)
    x[1, 300:] = 5.0
    x[2] = torch.arange(V).remainder(3).float()
    x = x.to(device)
    got = topk_candidates(x, k, cap=2 * k)
    want = topk_candidates_reference(x, k)
    assert torch.equal(got[:, :k].sort(dim=1).values.cpu(), want.sort(dim=1).values.cpu())
    assert (got[:, k:] == -1).all()


@pytest.mark.parametrize("device", DEVICES)
def test_rows_pick_from_their_batch_rows_and_small_vocabularies_work(device):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, 3000, generator=g).to(device)
    rows = torch.tensor([4, 1], dtype=torch.int64, device=device)
    _check(topk_candidates(x, 32, rows=rows).cpu(), topk_candidates_reference(x, 32, rows=rows).cpu(), 128, 3000)
    small = torch.randn(3, 40, generator=g).to(device)  # fewer columns than k: all of them
    got = topk_candidates(small, 32)
    assert sorted(i for i in got[0].tolist() if i >= 0) == list(range(40))


def test_a_k_above_the_slots_is_refused():
    with pytest.raises(ValueError, match="cap"):
        topk_candidates(torch.zeros(1, 10), 32, cap=16)
