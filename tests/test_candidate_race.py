"""The candidate race kernel (``kernels/candidate_race.py``) against its torch reference, and the sampler with it
against the sampler without it. The kernel's softmaxes and cumulative mass round in their own order, so tokens are
compared where the reference's decisions (the top-p cut, the min-p threshold, the race's winner) are wider than
that rounding, measured in fp64; every test also checks that most rows are such rows."""
import pytest
import torch

from pageserve.engine.sampler import Sampler
from pageserve.engine.sampling_params import SamplingParams
from pageserve.kernels.candidate_race import candidate_race, candidate_race_reference
from pageserve.kernels.reference import ordered_keys, seeded_uniform_at, signed64

# the kernels on CUDA where there is a GPU, else on the interpreter (tests/conftest.py sets it only then)
DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]


def _inputs(B, V, k, S, device, seed, seeded_every=3):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, V, generator=g) * 4).to(device)
    table = torch.stack([
        torch.rand(B, generator=g) * 1.2 + 0.2,  # temperature
        torch.randint(1, k + 1, (B,), generator=g).float(),  # top_k
        torch.where(torch.rand(B, generator=g) < 0.7, torch.rand(B, generator=g) * 0.9 + 0.05, torch.tensor(2.0)),
        torch.where(torch.rand(B, generator=g) < 0.3, torch.rand(B, generator=g) * 0.2, torch.tensor(0.0)),
    ]).to(device)
    ids = logits.topk(S, dim=-1, sorted=False).indices
    noise = torch.empty(B, k).exponential_(generator=g).clamp_min_(1e-30).to(device)
    flags = [int(i % seeded_every == 0) for i in range(B)]
    seeds = torch.tensor([flags, [signed64(int(torch.randint(0, 2**62, (), generator=g)) * 3) for _ in range(B)],
                          torch.randint(0, 500, (B,), generator=g).tolist()], dtype=torch.int64, device=device)
    return logits, table, ids, noise, seeds


def _wide_margins(logits, ids, k, table, noise, seeds, rows=None, tol=1e-4):
    """[R] bool: rows whose every decision in fp64 is wider than ``tol`` (relative), so any fp32 order of the
    sums decides it the same way."""
    if rows is not None:
        logits, table = logits.index_select(0, rows), table.index_select(1, rows)
    values = logits.gather(1, ids)
    t = table.double()
    order = ordered_keys(values, ids).argsort(dim=-1, descending=True)[:, :k]  # the rank order
    cid = ids.gather(1, order)
    v = values.gather(1, order).double() / t[0][:, None]
    rank = torch.arange(k, device=v.device)
    v = v.masked_fill(rank[None, :] >= t[1][:, None], float("-inf"))
    p = v.softmax(-1)
    mass = p.cumsum(-1) - p
    top_p_ok = ((mass - t[2][:, None]).abs() > tol).all(-1)
    v = v.masked_fill(mass >= t[2][:, None], float("-inf"))
    probs = v.softmax(-1)
    thr = t[3][:, None] * probs.amax(-1, keepdim=True)
    min_p_ok = ((probs - thr).abs() > tol * probs.amax(-1, keepdim=True)).all(-1) | (t[3] == 0)
    probs = probs.masked_fill(probs < thr, 0.0)
    q = noise.double()
    seeded_q = seeded_uniform_at(seeds[1], seeds[2], cid).double().log().neg()
    q = torch.where(seeds[0][:, None] != 0, seeded_q, q)
    ratio = (probs / q).sort(-1, descending=True).values
    race_ok = (ratio[:, 0] - ratio[:, 1]) > tol * ratio[:, 0]
    return top_p_ok & min_p_ok & race_ok


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k,S", [(32, 96), (128, 192), (8, 8)])
def test_the_kernel_draws_the_references_token_wherever_the_decisions_are_wider_than_rounding(device, k, S):
    B, V = 48, 700
    logits, table, ids, noise, seeds = _inputs(B, V, k, S, device, seed=k + S)
    got = candidate_race(logits, ids, k, table, noise, seeds)
    want = candidate_race_reference(logits, ids, k, table, noise, seeds)
    wide = _wide_margins(logits, ids, k, table, noise, seeds)
    assert wide.sum() >= 0.8 * B  # the comparison covers most rows
    assert torch.equal(got[wide], want[wide])
    assert ((got == want) | ~wide).all()


@pytest.mark.parametrize("device", DEVICES)
def test_rows_write_their_own_batch_rows_and_nothing_else(device):
    B, V, k, S = 10, 300, 32, 96
    logits, table, ids, noise, seeds = _inputs(B, V, k, S, device, seed=5)
    rows = torch.tensor([7, 2, 4], dtype=torch.int64, device=device)
    out = torch.full((B,), -1, dtype=torch.int64, device=device)
    got = candidate_race(logits, ids[rows], k, table, noise[:3], seeds[:, :3], rows=rows, out=out)
    assert got is out
    want = candidate_race_reference(logits, ids[rows], k, table, noise[:3], seeds[:, :3], rows=rows)
    wide = _wide_margins(logits, ids[rows], k, table, noise[:3], seeds[:, :3], rows=rows)
    assert wide.all() and torch.equal(out[rows], want)
    others = torch.ones(B, dtype=torch.bool, device=device)
    others[rows] = False
    assert (out[others] == -1).all()


@pytest.mark.parametrize("device", DEVICES)
def test_ties_rank_toward_the_lower_id_as_a_stable_sort(device):
    # every candidate's logit equal: top_k 1 takes the lowest id; top_k 5 gives five equal probabilities, so the
    # race's winner is the rank with the smallest noise, and the token says which id each rank holds
    B, V, S = 6, 64, 40
    logits = torch.zeros(B, V, device=device)
    ids = torch.stack([torch.randperm(V, generator=torch.Generator().manual_seed(i))[:S] for i in range(B)]).to(device)
    noise = torch.rand(B, 32, generator=torch.Generator().manual_seed(9)).to(device) + 0.5
    for top_k in (1.0, 5.0):
        table = torch.tensor([[1.0] * B, [top_k] * B, [2.0] * B, [0.0] * B], device=device)
        got = candidate_race(logits, ids, 32, table, noise)
        lowest = ids.sort(dim=1).values
        want = lowest.gather(1, noise[:, : int(top_k)].argmin(dim=1, keepdim=True)).squeeze(1)
        assert torch.equal(got, want)
        assert torch.equal(got, candidate_race_reference(logits, ids, 32, table, noise))


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_rows_need_no_noise_and_draw_by_id_not_by_position(device):
    # the same candidates in two column orders: a seeded row's draw depends on the ids, not on where topk put them
    B, V, k, S = 8, 400, 32, 96
    logits, table, ids, _, seeds = _inputs(B, V, k, S, device, seed=11, seeded_every=1)
    a = candidate_race(logits, ids, k, table, None, seeds)
    b = candidate_race(logits, ids.flip(1).contiguous(), k, table, None, seeds)
    assert torch.equal(a, b)
    want = candidate_race_reference(logits, ids, k, table, None, seeds)
    wide = _wide_margins(logits, ids, k, table, torch.ones(B, k, device=device), seeds)
    assert wide.sum() >= 0.75 * B and torch.equal(a[wide], want[wide])


def test_bad_arguments_are_refused_with_their_name():
    logits, table, ids, noise, seeds = _inputs(4, 100, 32, 96, "cpu", seed=1)
    with pytest.raises(ValueError, match="k 97"):
        candidate_race(logits, ids, 97, table, noise)
    with pytest.raises(ValueError, match="need noise"):
        candidate_race(logits, ids, 32, table, None, None)
    with pytest.raises(ValueError, match="noise"):
        candidate_race(logits, ids, 32, table, noise[:, :16].contiguous())


def _sampler_pair(V, device, select=True):
    from pageserve.kernels.topk_select import topk_candidates

    torch_path, fused = Sampler(V, device, seed=3), Sampler(V, device, seed=3)
    torch_path.candidate_race, fused.candidate_race = None, candidate_race
    torch_path.topk_select, fused.topk_select = None, (topk_candidates if select else None)
    return torch_path, fused


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("select,dtype", [(True, torch.float32), (False, torch.float32), (True, torch.bfloat16)])
def test_a_sampler_with_the_kernel_draws_what_the_torch_path_draws(device, select, dtype):
    # a mixed batch: greedy rows, whole-row rows (no top-k), two candidate widths, seeded and unseeded, penalties,
    # logprobs; the same generator state on both samplers, so unseeded rows race the same noise. bf16 logits: the
    # kernels' sampler leaves them unconverted where nothing changed them (``_process``), the torch path converts
    B, V = 24, 2000
    kinds = [SamplingParams(temperature=0.0, logprobs=2),
             SamplingParams(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05),
             SamplingParams(temperature=0.9, top_k=100, min_p=0.05),
             SamplingParams(temperature=0.8, top_p=0.9),
             SamplingParams(temperature=0.6, top_k=20, seed=77)]
    mixed = params = [kinds[i % len(kinds)] for i in range(B)]
    seeds = [p.seed for p in params]
    prompts = [[(i * 7 + j) % V for j in range(16)] for i in range(B)]
    outs = [[(i * 13 + j) % V for j in range(i % 5)] for i in range(B)]
    torch_path, fused = _sampler_pair(V, device, select)
    agree = total = 0
    unpenalised = [p if p.repetition_penalty == 1.0 else SamplingParams(temperature=0.7, top_p=0.8, top_k=20)
                   for p in params]
    for step in range(4):
        params = unpenalised if step % 2 else mixed  # unpenalised: the kernels read the caller's logits as they are
        logits = torch.randn(B, V, generator=torch.Generator().manual_seed(step)).mul_(3).to(dtype).to(device)
        out_a = torch_path.sample(logits, params, prompts, outs, seeds)
        out_b = fused.sample(logits, params, prompts, outs, seeds)
        a, b = out_a.token_ids, out_b.token_ids
        assert out_a.top_logprobs == out_b.top_logprobs  # the penalised distribution's, in fp32 both ways
        agree += sum(x == y for x, y in zip(a, b))
        total += B
        for i in range(B):
            if params[i].temperature == 0 or params[i].top_k == 0:  # not the kernel's rows: the same ops
                assert a[i] == b[i]
    # the kernel's rows: equal but where a decision sits within rounding (none expected at these spreads)
    assert agree >= total - 2
    # and the unpenalised batch was indeed left in the caller's dtype (the penalised one converted)
    assert fused._process(logits, unpenalised, prompts, outs)[0].dtype == dtype
    assert fused._process(logits, mixed, prompts, outs)[0].dtype == torch.float32


@pytest.mark.parametrize("device", DEVICES)
def test_one_row_with_its_table_as_the_sampler_builds_it(device):
    # the sampler's [7, 1] table comes from a [1, 7] one transposed: its last dimension's stride is 7, not 1
    V, k, S = 300, 32, 96
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(2)).mul_(3).to(device)
    table = torch.tensor([[0.7, 20.0, 0.8, 0.0, 1.05, 0.0, 0.0]]).T.contiguous().to(device)
    assert table.stride(1) != 1
    ids = logits.topk(S, dim=-1, sorted=False).indices
    noise = torch.empty(1, k).exponential_(generator=torch.Generator().manual_seed(3)).to(device)
    assert torch.equal(candidate_race(logits, ids, k, table, noise),
                       candidate_race_reference(logits, ids, k, table, noise))


@pytest.mark.parametrize("device", DEVICES)
def test_the_repetition_penalty_on_read_samples_what_the_penalised_copy_samples(device):
    # Qwen2.5-Instruct's defaults (a repetition penalty with temperature / top_p / top_k) beside unpenalised sampled
    # rows, greedy rows, a whole-row row and seeded rows, with the newest tokens still on the device: the sampler
    # that applies the penalty as its kernels read the bf16 logits draws the same tokens as the one that penalises
    # an fp32 copy, step after step, and makes no copy. A row asking for logprobs sends the step back to the copy;
    # so do a penalised row sampled from its whole row (no top-k) and a penalised greedy row.
    from pageserve.kernels.argmax import argmax_rows
    from pageserve.kernels.penalties import repetition_penalty, seen_words

    B, V = 12, 2000
    qwen = SamplingParams(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05)
    kinds = [qwen, SamplingParams(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.5, seed=5),
             SamplingParams(temperature=0.9, top_k=100, min_p=0.05), SamplingParams(temperature=0.0),
             SamplingParams(temperature=0.8, top_p=0.9), qwen]
    params = [kinds[i % len(kinds)] for i in range(B)]
    seeds = [p.seed for p in params]
    copy, on_read = _sampler_pair(V, device)
    for s in (copy, on_read):
        s.repetition_kernel, s._argmax = repetition_penalty, argmax_rows
    on_read.seen_words = seen_words
    copy.seen_words = None
    g = torch.Generator().manual_seed(31)
    prompts = [torch.randint(0, V, (int(n),), generator=g).tolist() for n in torch.randint(4, 40, (B,), generator=g)]
    outs = [[] for _ in range(B)]
    prev = None
    for step in range(6):
        logits = (torch.randn(B, V, generator=g) * 3).to(torch.bfloat16).to(device)
        top = logits.float().topk(8, dim=-1).indices.cpu()
        for i in range(B):  # each row has seen some of its current best tokens, so the penalty decides things
            prompts[i][:2] = top[i, step % 4: step % 4 + 2].tolist()
        # the previous step's tokens: on the device only (async scheduling), not yet in the output lists
        pending = None if prev is None else (prev, list(range(B)))
        if step == 0:
            assert copy._prepare(logits, params, prompts, outs)[3] is None
            got = on_read._prepare(logits, params, prompts, outs)
            assert got[0].dtype == torch.bfloat16 and got[3] is not None  # no copy made: the bits go to the kernels
            # the penalised logits that ``_process`` makes of them for references are the copy's bits
            assert torch.equal(on_read._process(logits, params, prompts, outs)[0],
                               copy._process(logits, params, prompts, outs)[0])
        a = copy.sample(logits, params, prompts, outs, seeds, pending=pending)
        b = on_read.sample(logits, params, prompts, outs, seeds, pending=pending)
        assert a.token_ids == b.token_ids
        if prev is not None:
            for i in range(B):
                outs[i].append(int(prev[i]))
        prev = b.token_ids_gpu
    with_logprobs = params[:-1] + [SamplingParams(temperature=0.7, top_p=0.8, top_k=20, logprobs=1)]
    whole_row = params[:-1] + [SamplingParams(temperature=0.7, repetition_penalty=1.05)]
    greedy = params[:-1] + [SamplingParams(temperature=0.0, repetition_penalty=1.3)]
    for other in (with_logprobs, whole_row, greedy):
        assert on_read._prepare(logits, other, prompts, outs)[3] is None
        a = copy.sample(logits, other, prompts, outs, seeds)
        b = on_read.sample(logits, other, prompts, outs, seeds)
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
