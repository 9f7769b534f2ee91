"""The one-shot all-reduce (phase 06c): its kernel on the CPU interpreter against
``all_reduce_sum`` with the peers' side of the exchange done by hand, and on two GPUs against
NCCL-gathered inputs (eager and in CUDA graphs), bitwise."""
from __future__ import annotations

import pytest
import torch

from pageserve.kernels import allreduce as ar
from pageserve.kernels.reference import all_reduce_sum

CAP = 64 * 1024  # bytes of one rank's row in a slot


def _buffers(world: int) -> list[torch.Tensor]:
    return [torch.zeros(ar.flag_bytes(world) + 2 * world * CAP, dtype=torch.uint8) for _ in range(world)]


def _data(buf: torch.Tensor, world: int, dtype: torch.dtype) -> torch.Tensor:
    es = torch.tensor([], dtype=dtype).element_size()
    return buf[ar.flag_bytes(world):].view(dtype).view(2, world, CAP // es)  # [slot, src rank, elems]


def _flags(buf: torch.Tensor, world: int) -> torch.Tensor:
    return buf[: ar.flag_bytes(world)].view(torch.int64).view(ar.MAX_BLOCKS, world)  # [block, src rank]


def _close(got: torch.Tensor, ref: torch.Tensor) -> bool:
    if got.dtype == torch.float32:
        return torch.equal(got, ref)
    # the interpreter rounds fp32 -> 16 bits toward zero, the GPU to nearest: one ulp apart
    return torch.allclose(got.float(), ref.float(), rtol=2 ** -7 if got.dtype == torch.bfloat16 else 2 ** -10, atol=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test (the GPU test is below)")
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [1, 1000, 2 * ar.BLOCK + 5])
def test_one_shot_all_reduce_sums_in_rank_order_and_alternates_slots(world, dtype, n):
    """Rank 0's kernel runs last, after ranks 1.. pushed their rows and raised its flags (done
    by hand: the interpreter runs one program at a time, so two ranks cannot spin on each
    other). Three calls in a row: slots 1, 0, 1, and the counters count them."""
    torch.manual_seed(n + world)
    bufs = _buffers(world)
    bases = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
    counters = torch.zeros(ar.MAX_BLOCKS, dtype=torch.int64)
    blocks = max(1, min(ar.MAX_BLOCKS, -(-n // ar.BLOCK)))
    for call in range(1, 4):
        xs = [torch.randn(n).to(dtype) for _ in range(world)]
        for src in range(1, world):  # the peers' side: their rows in my buffer, then their flags
            _data(bufs[0], world, dtype)[call % 2, src, :n] = xs[src]
            _flags(bufs[0], world)[:blocks, src] = call
        out = torch.empty_like(xs[0])
        ar.one_shot_all_reduce(xs[0], out, bufs[0], bases, counters, 0, world, CAP)
        assert _close(out, all_reduce_sum(xs))
        for dst in range(1, world):  # what rank 0 pushed to every peer: its row, and its flag
            assert torch.equal(_data(bufs[dst], world, dtype)[call % 2, 0, :n], xs[0])
            assert (_flags(bufs[dst], world)[:blocks, 0] == call).all()
        assert (counters[:blocks] == call).all() and (counters[blocks:] == 0).all()


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test")
def test_one_shot_all_reduce_writes_in_place_and_refuses_what_does_not_fit():
    world, n = 2, 300
    bufs = _buffers(world)
    bases = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
    counters = torch.zeros(ar.MAX_BLOCKS, dtype=torch.int64)
    x0, x1 = torch.randn(n), torch.randn(n)
    _data(bufs[0], world, torch.float32)[1, 1, :n] = x1
    _flags(bufs[0], world)[:1, 1] = 1
    ref = all_reduce_sum([x0, x1])
    assert ar.one_shot_all_reduce(x0, x0, bufs[0], bases, counters, 0, world, CAP) is x0
    assert torch.equal(x0, ref)
    with pytest.raises(ValueError, match="exceeds"):
        ar.one_shot_all_reduce(torch.zeros(CAP), torch.zeros(CAP), bufs[0], bases, counters, 0, world, CAP)
    with pytest.raises(ValueError, match="contiguous"):
        ar.one_shot_all_reduce(torch.zeros(8, 2).t(), torch.zeros(2, 8), bufs[0], bases, counters, 0, world, CAP)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_custom_all_reduce_equals_the_rank_ordered_sum_on_two_gpus():
    from pageserve.lab.parallel_checks import check_custom_all_reduce

    report = check_custom_all_reduce(2)
    assert report["enabled"], "the GPUs report no peer access: the custom all-reduce stayed off"
    assert report["checked"] > 0 and report["failures"] == []
