
import numpy as np
import pytest
import torch

from pageserve.engine import sampler as sampler_module
from pageserve.engine.sampler import Sampler, seeded_uniform, seeded_uniform_at, seeded_uniform_tensor
from pageserve.kernels.reference import unpack_token_bits
from pageserve.engine.structured_output import TokenMasks
from pageserve.lab.sampling_reference import penalties_dense, sample_reference, sampler_probs
from pageserve.engine.sampling_params import SamplingParams, child_seed

V = 96


def rand_logits(B, V=V, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, V, generator=g) * 3


def token_lists(B, length, seed=1, V=V):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (length,), generator=g).tolist() for _ in range(B)]


# --------------------------------------------------------------- params
@pytest.mark.parametrize(
    "field,value",
    [
        ("n", 0),
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", 1.5),
        ("repetition_penalty", 0.0),
        ("presence_penalty", 3.0),
        ("frequency_penalty", -2.5),
        ("seed", 1.5),
        ("max_tokens", 0),
        ("min_tokens", -1),
        ("stop", [""]),
        ("stop", [3]),
        ("stop_token_ids", [-1]),
        ("logprobs", -1),
        ("ignore_eos", "yes"),
        ("logit_bias", {3: 101}),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {2: float("inf")}),
        ("logit_bias", [1, 2]),
    ],
)
def test_invalid_params_raise_clear_errors(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field} "):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens_is_rejected():
    with pytest.raises(ValueError, match="min_tokens.*max_tokens"):
        SamplingParams(min_tokens=10, max_tokens=5)
    SamplingParams(min_tokens=10, max_tokens=None)


def test_stop_is_normalised_to_a_list_and_top_k_zero_means_off():
    assert SamplingParams(stop="\n").stop == ["\n"]
    assert SamplingParams().stop == []
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(top_k=0).top_k == -1


def test_child_seed_keeps_index_zero_and_gives_distinct_children():
    assert child_seed(42, 0) == 42
    assert child_seed(None, 3) is None
    kids = {child_seed(42, i) for i in range(100)}
    assert len(kids) == 100
    assert child_seed(42, 1) != child_seed(43, 1)


# ------------------------------------------------------------ the hash
def test_vectorised_hash_matches_python_definition():
    seeds = [0, 1, 12345, -7, 2**63 - 1, 2**64 - 5]
    steps = [0, 3, 1000, 5, 0, 9]
    from pageserve.kernels.reference import signed64 as _signed64

    got = seeded_uniform_tensor(
        torch.tensor([_signed64(s) for s in seeds]), torch.tensor(steps), 40
    )
    want = torch.tensor([[seeded_uniform(s, st, t) for t in range(40)] for s, st in zip(seeds, steps)])
    assert torch.equal(got, want.float())
    assert got.min() > 0 and got.max() < 1
    # well spread: mean of many uniforms near 1/2, and no two rows alike
    assert abs(got.mean().item() - 0.5) < 0.05
    assert len({tuple(r) for r in got.tolist()}) == len(seeds)


# -------------------------------------------------------------- greedy
def test_all_greedy_batch_is_argmax():
    logits = rand_logits(5)
    s = Sampler(V, "cpu")
    out = s.sample(logits, [SamplingParams(temperature=0)] * 5, [[1]] * 5, [[]] * 5, [None] * 5)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.token_ids_gpu.dtype == torch.long
    assert out.logprobs is None and out.top_logprobs is None


def test_padding_columns_beyond_vocab_are_never_sampled():
    logits = rand_logits(3, V + 8)
    logits[:, V:] = 100.0
    s = Sampler(V, "cpu", seed=0)
    params = [SamplingParams(temperature=0), SamplingParams(seed=1), SamplingParams()]
    for _ in range(5):
        out = s.sample(logits, params, [[1]] * 3, [[]] * 3, [None, 1, None])
        assert max(out.token_ids) < V


def test_top_k_1_equals_greedy():
    logits = rand_logits(6)
    s = Sampler(V, "cpu", seed=0)
    params = [SamplingParams(temperature=1.5, top_k=1)] * 6
    out = s.sample(logits, params, [[1]] * 6, [[]] * 6, [None, 1, None, 2, None, 3])
    assert out.token_ids == logits.argmax(-1).tolist()


def test_temperature_zero_rows_are_argmax_in_mixed_batch():
    logits = rand_logits(8)
    s = Sampler(V, "cpu", seed=0)
    params = [SamplingParams(temperature=0 if i % 2 else 5.0) for i in range(8)]
    outs = [s.sample(logits, params, [[1]] * 8, [[]] * 8, [None] * 8).token_ids for _ in range(10)]
    argmax = logits.argmax(-1).tolist()
    for out in outs:
        assert [out[i] for i in range(1, 8, 2)] == [argmax[i] for i in range(1, 8, 2)]
    # the hot rows really sample (not argmax every time)
    assert any(out[0] != argmax[0] for out in outs)


# ---------------------------------------------------------------- seeds
def test_same_seed_same_tokens_whatever_else_is_in_the_batch():
    logits = rand_logits(7)
    target = SamplingParams(temperature=1.0, top_p=0.95, seed=777)
    alone = Sampler(V, "cpu", seed=0).sample(logits[3:4], [target], [[5]], [[1, 2]], [777])
    others = [SamplingParams(temperature=0.7, top_k=5, repetition_penalty=1.2, logprobs=2)] * 6
    params = others[:3] + [target] + others[3:]
    seeds = [None, 5, None, 777, 9, None, None]
    crowd = Sampler(V, "cpu", seed=123).sample(
        logits, params, [[5]] * 7, [[1, 2], [], [3], [1, 2], [4, 4, 4], [], [0]], seeds
    )
    assert crowd.token_ids[3] == alone.token_ids[0]


def test_seeded_draw_changes_with_step_and_seed():
    logits = rand_logits(1).expand(64, V).contiguous() * 0  # uniform distribution
    s = Sampler(V, "cpu")
    by_seed = s.sample(logits, [SamplingParams()] * 64, [[1]] * 64, [[]] * 64, list(range(64)))
    assert len(set(by_seed.token_ids)) > 20
    by_step = [
        s.sample(logits[:1], [SamplingParams()], [[1]], [[0] * step], [5]).token_ids[0]
        for step in range(32)
    ]
    assert len(set(by_step)) > 10


@pytest.mark.parametrize(
    "kw",
    [
        dict(temperature=1.0),
        dict(temperature=0.6, top_k=7),
        dict(temperature=1.3, top_p=0.8),
        dict(temperature=0.9, min_p=0.05),
        dict(temperature=1.0, top_k=20, top_p=0.9, min_p=0.02, repetition_penalty=1.3,
             presence_penalty=0.5, frequency_penalty=0.3),
    ],
)
def test_seeded_sampling_picks_the_reference_tokens(kw):
    B = 6
    logits = rand_logits(B, seed=11)
    params = [SamplingParams(**kw)] * B
    prompts, outs = token_lists(B, 10, seed=2), token_lists(B, 4, seed=3)
    seeds = [10 * i + 1 for i in range(B)]
    got = Sampler(V, "cpu").sample(logits, params, prompts, outs, seeds)
    want = sample_reference(logits, params, prompts, outs, seeds)
    assert got.token_ids == want.token_ids


@pytest.mark.parametrize("seeded", [True, False])
def test_samples_follow_the_softmax_distribution(seeded):
    torch.manual_seed(0)
    logits = torch.randn(1, 6)
    n = 6000
    s = Sampler(6, "cpu", seed=0)
    params = [SamplingParams(temperature=1.0)] * n
    seeds = list(range(n)) if seeded else [None] * n
    out = s.sample(logits.expand(n, 6), params, [[0]] * n, [[]] * n, seeds)
    freq = torch.bincount(out.token_ids_gpu, minlength=6).float() / n
    assert (freq - logits.softmax(-1)[0]).abs().max() < 0.025


# -------------------------------------------------------------- filters
@pytest.mark.parametrize(
    "kw",
    [
        dict(top_k=5),
        dict(top_p=0.7),
        dict(min_p=0.1),
        dict(temperature=0.5, top_k=10, top_p=0.9, min_p=0.05),
        dict(temperature=2.0, top_p=0.3),
    ],
)
def test_filtered_probabilities_match_reference(kw):
    B = 5
    logits = rand_logits(B, seed=4)
    params = [SamplingParams(**kw)] * (B - 1) + [SamplingParams(temperature=0.8)]
    prompts, outs = [[1]] * B, [[]] * B
    got = sampler_probs(Sampler(V, "cpu"), logits, params, prompts, outs)
    want = sample_reference(logits, params, prompts, outs, [None] * B).probs
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    s = Sampler(4, "cpu")
    for top_p, kept in [(0.5, 1), (0.51, 2), (0.8, 2), (0.81, 3), (0.99, 4)]:
        probs = sampler_probs(s, logits, [SamplingParams(top_p=top_p)], [[0]], [[]])[0]
        assert (probs > 0).sum().item() == kept, top_p


def test_min_p_filters_low_probability_tokens():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    probs = sampler_probs(Sampler(4, "cpu"), logits, [SamplingParams(min_p=0.2)], [[0]], [[]])[0]
    # threshold = 0.2 * 0.5 = 0.1: 0.05 goes, the rest is renormalised
    torch.testing.assert_close(probs, torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95)


def test_rows_with_filters_off_are_unaffected_by_filtered_rows():
    logits = rand_logits(3)
    params = [SamplingParams(top_k=3), SamplingParams(temperature=0.7), SamplingParams(top_p=0.2)]
    probs = sampler_probs(Sampler(V, "cpu"), logits, params, [[1]] * 3, [[]] * 3)
    torch.testing.assert_close(probs[1], (logits[1] / 0.7).softmax(-1))
    assert (probs[0] > 0).sum() == 3


# ------------------------------------------------------------ penalties
def test_repetition_penalty_matches_reference():
    B = 4
    logits = rand_logits(B, seed=5)
    params = [SamplingParams(temperature=1.0, repetition_penalty=r) for r in (1.0, 1.1, 1.5, 0.8)]
    prompts, outs = token_lists(B, 30, seed=6), token_lists(B, 12, seed=7)
    got = sampler_probs(Sampler(V, "cpu"), logits, params, prompts, outs)
    want = sample_reference(logits, params, prompts, outs, [None] * B).probs
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    p = SamplingParams(temperature=1.0, repetition_penalty=2.0)
    probs = sampler_probs(Sampler(4, "cpu"), logits, [p], [[0]], [[1]])  # 0 from prompt, 1 from output
    want = torch.tensor([1.0, -4.0, 1.0, 0.5]).softmax(-1)
    torch.testing.assert_close(probs[0], want)


def test_presence_and_frequency_penalties_count_output_tokens_only():
    logits = torch.zeros(1, 4)
    p = SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.25)
    probs = sampler_probs(Sampler(4, "cpu"), logits, [p], [[3, 3, 3]], [[0, 0, 1]])
    want = torch.tensor([-(0.5 + 0.5), -(0.5 + 0.25), 0.0, 0.0]).softmax(-1)
    torch.testing.assert_close(probs[0], want)


def test_presence_frequency_penalties_match_reference_in_mixed_batch():
    B = 4
    logits = rand_logits(B, seed=8)
    params = [
        SamplingParams(presence_penalty=1.0),
        SamplingParams(temperature=0.5),
        SamplingParams(frequency_penalty=-0.7, repetition_penalty=1.2),
        SamplingParams(presence_penalty=-1.5, frequency_penalty=2.0, top_k=30),
    ]
    prompts, outs = token_lists(B, 20, seed=9), [[], [1, 1], [2, 2, 3], [4] * 9 + [5]]
    got = sampler_probs(Sampler(V, "cpu"), logits, params, prompts, outs)
    want = sample_reference(logits, params, prompts, outs, [None] * B).probs
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_token_history_follows_its_lists_as_they_grow_past_the_buffer():
    from pageserve.engine.sequence import TokenHistory

    prompt, out = [5, 6, 7], []
    h = TokenHistory(prompt, out)
    assert h.prompt().tolist() == prompt and h.output().tolist() == []
    rng = np.random.default_rng(3)
    for n in (1, 1, 14, 1, 40, 0, 100):  # crosses the first buffer (16) and two doublings
        out += rng.integers(0, V, n).tolist()
        assert h.output().tolist() == out
    del out[10:]  # not append-only: started over, not left stale
    out.append(1)
    assert h.output().tolist() == out


def test_penalties_read_from_token_histories_equal_the_lists_path():
    from pageserve.engine.sequence import TokenHistory

    B = 5
    logits = rand_logits(B, seed=31)
    params = [SamplingParams(temperature=0.9, repetition_penalty=1.3, frequency_penalty=0.4),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.1, presence_penalty=-0.6),
              SamplingParams(temperature=0.0, repetition_penalty=0.7, presence_penalty=0.9),
              SamplingParams(temperature=0.6, top_k=10)]
    prompts, outs = token_lists(B, 25, seed=32), [[], [1, 1], [2, 2, 3], list(range(40)), [4]]
    histories = [TokenHistory(p, o) for p, o in zip(prompts, outs)]
    seeds = [11 * i + 1 for i in range(B)]
    sampler = Sampler(V, "cpu")
    for step in range(3):
        want = sampler.sample(logits, params, prompts, outs, seeds)
        got = sampler.sample(logits, params, [[]] * B, [[]] * B, seeds, [len(o) for o in outs],
                             histories=histories)
        assert got.token_ids == want.token_ids
        from_lists = sampler._process(logits, params, prompts, outs)[0]
        from_histories = sampler._process(logits, params, [[]] * B, [[]] * B, histories=histories)[0]
        assert torch.equal(from_histories, from_lists)
        assert not torch.equal(from_histories, sampler._process(logits, params, [[]] * B, [[]] * B)[0])
        torch.testing.assert_close(sampler_probs(sampler, logits, params, prompts, outs),
                                   sample_reference(logits, params, prompts, outs, [None] * B).probs,
                                   atol=1e-6, rtol=1e-5)
        for o, t in zip(outs, want.token_ids):
            o.append(t)


def _repetition_kernels(sampler):
    """The repetition-only paths to check: the torch one, then the Triton kernel (on CUDA the sampler's default;
    on the CPU through the interpreter, set by hand; not on a GPU machine's CPU, where no interpreter runs)."""
    from pageserve.kernels._util import interpreting
    from pageserve.kernels.penalties import repetition_penalty

    on_cpu = sampler.device.type == "cpu"
    return [None] + ([repetition_penalty] if not on_cpu or interpreting() else [])


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_sparse_penalties_give_the_dense_references_bits(device):
    # fresh random inputs: repeated ids in prompts and outputs, ids seen in both, banned (-inf) logits, rows
    # with no output yet, each penalty alone and together, negative and > 1 factors
    from pageserve.engine.sampler import _FREQ, _PRES, _REP

    gen = torch.Generator().manual_seed(41)
    for trial in range(4):
        B, Vt = 7, 1000 + trial
        logits = torch.randn(B, Vt, generator=gen) * 4
        logits[torch.rand(B, Vt, generator=gen) < 0.02] = float("-inf")
        rows = [0, 2, 3, 5, 6]
        prompts = [torch.randint(0, Vt // (1 + 3 * (j % 2)), (int(n),), generator=gen).numpy()
                   for j, n in enumerate(torch.randint(1, 60, (len(rows),), generator=gen))]
        outputs = [torch.randint(0, Vt // 8, (int(n),), generator=gen).numpy()
                   for n in torch.randint(0, 40, (len(rows),), generator=gen)]
        outputs[1] = np.array([], dtype=np.int64)
        outputs[2] = np.concatenate([outputs[2], prompts[2][:5]])  # ids in both
        table = torch.zeros(7, B)
        table[_REP] = torch.tensor([1.3, 1.0, 0.7, 1.0, 2.0, 1.0, 1.05])
        table[_FREQ] = torch.tensor([0.0, 0.0, -0.5, 0.4, 1.5, 0.0, 0.0])
        table[_PRES] = torch.tensor([0.0, 0.0, 0.8, 0.0, -1.2, 0.0, 0.3])
        sampler = Sampler(Vt, device)
        x, tab = logits.to(device), table.to(device)
        want = penalties_dense(x, tab, rows, prompts, outputs)
        got = sampler._apply_penalties(x.clone(), tab, rows, prompts, outputs)
        assert torch.equal(got, want)
        assert not torch.equal(got, x)
        # the rows not penalised, and the tokens no penalised row has seen, keep their bits
        assert torch.equal(got[[1, 4]], x[[1, 4]])
        # repetition penalties alone: the path without output counts gives the dense bits too, and would not
        # with frequency / presence penalties present (the flag is what decides)
        rep_only = tab.clone()
        rep_only[_FREQ] = 0.0
        rep_only[_PRES] = 0.0
        for kernel in _repetition_kernels(sampler):  # the torch path, then the kernel (the interpreter on the CPU)
            sampler.repetition_kernel = kernel
            got = sampler._apply_penalties(x.clone(), rep_only, rows, prompts, outputs, counts=False)
            assert torch.equal(got, penalties_dense(x, rep_only, rows, prompts, outputs))
            assert not torch.equal(sampler._apply_penalties(x.clone(), tab, rows, prompts, outputs, counts=False), want)


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_penalties_with_the_newest_token_on_the_device_give_the_dense_bits_of_the_whole_history(device):
    # async scheduling: a row's newest output is on the device only (an index into the previous step's sampled
    # ids); sparse(prompt, outputs[:-1], that token) must be dense(prompt, outputs)'s bits. Rows with and
    # without a pending token, a pending token also in the prompt or the outputs, a row whose only id is pending
    from pageserve.engine.sampler import _FREQ, _PRES, _REP

    gen = torch.Generator().manual_seed(43)
    for trial in range(4):
        B, Vt = 6, 900 + trial
        logits = torch.randn(B, Vt, generator=gen) * 4
        rows = [0, 1, 2, 4, 5]
        prompts = [torch.randint(0, Vt // 4, (int(n),), generator=gen).numpy()
                   for n in torch.randint(1, 50, (len(rows),), generator=gen)]
        prompts[4] = np.array([], dtype=np.int64)
        outputs = [torch.randint(0, Vt // 8, (int(n),), generator=gen).numpy()
                   for n in torch.randint(1, 30, (len(rows),), generator=gen)]
        outputs[4] = outputs[4][:1]  # with no prompt: its only id is the pending one
        outputs[1] = np.concatenate([outputs[1], outputs[1][:1]])  # the newest already seen among the outputs
        outputs[2] = np.concatenate([outputs[2], prompts[2][:1]])  # ... and in the prompt
        has_pending = [True, True, True, False, True]
        prev = torch.randint(0, Vt, (9,), generator=gen)  # the previous step's sampled ids, other rows' too
        where = torch.randperm(9, generator=gen)[: len(rows)].tolist()
        pend = []
        landed = []
        for j, o in enumerate(outputs):
            if has_pending[j]:
                prev[where[j]] = int(o[-1])
                pend.append(where[j])
                landed.append(o[:-1])
            else:
                pend.append(-1)
                landed.append(o)
        table = torch.zeros(7, B)
        table[_REP] = torch.tensor([1.3, 0.8, 1.1, 1.0, 2.0, 1.5])
        table[_FREQ] = torch.tensor([0.5, 0.0, -0.4, 0.0, 1.2, 0.3])
        table[_PRES] = torch.tensor([0.0, 0.9, 0.4, 0.0, -0.7, 0.2])
        sampler = Sampler(Vt, device)
        x, tab = logits.to(device), table.to(device)
        want = penalties_dense(x, tab, rows, prompts, outputs)
        got = sampler._apply_penalties(x.clone(), tab, rows, prompts, landed, (prev.to(device), pend))
        assert torch.equal(got, want)
        rep_only = tab.clone()
        rep_only[_FREQ] = 0.0
        rep_only[_PRES] = 0.0
        for kernel in _repetition_kernels(sampler):
            sampler.repetition_kernel = kernel
            assert torch.equal(sampler._apply_penalties(x.clone(), rep_only, rows, prompts, landed,
                                                        (prev.to(device), pend), counts=False),
                               penalties_dense(x, rep_only, rows, prompts, outputs))
        # without the pending token the bits differ (the newest output matters), and rows not penalised keep theirs
        assert not torch.equal(sampler._apply_penalties(x.clone(), tab, rows, prompts, landed), want)
        assert torch.equal(got[3], x[3])


def test_greedy_rows_with_penalties_take_argmax_of_penalised_logits():
    logits = torch.tensor([[3.0, 2.9, 0.0, 0.0]])
    p = SamplingParams(temperature=0, presence_penalty=1.0)
    out = Sampler(4, "cpu").sample(logits, [p], [[]], [[0]], [None])
    assert out.token_ids == [1]


def test_logit_bias_matches_the_reference_and_moves_greedy_and_sampled_rows():
    B = 6
    logits = rand_logits(B, seed=21)
    bias = {3: 100.0, 7: -100.0, 11: 2.5}
    params = [SamplingParams(temperature=0, logit_bias=bias), SamplingParams(temperature=0),
              SamplingParams(temperature=0.9, top_k=20, logit_bias={int(logits[2].argmax()): -100.0}),
              SamplingParams(temperature=1.1, logit_bias=bias, repetition_penalty=1.2),
              SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(temperature=0, logit_bias={5: 0.0})]
    prompts, outs = token_lists(B, 8, seed=5), token_lists(B, 3, seed=6)
    seeds = [7 * i + 3 for i in range(B)]
    got = Sampler(V, "cpu").sample(logits, params, prompts, outs, seeds)
    want = sample_reference(logits, params, prompts, outs, seeds)
    assert got.token_ids == want.token_ids
    assert got.token_ids[0] == 3  # +100 all but forces it
    assert got.token_ids[1] == int(logits[1].argmax())  # a row without a bias is untouched
    assert got.token_ids[2] != int(logits[2].argmax())  # -100 bans it
    probs = sampler_probs(Sampler(V, "cpu"), logits, params, prompts, outs)
    torch.testing.assert_close(probs, sample_reference(logits, params, prompts, outs, [None] * B).probs,
                               atol=1e-6, rtol=1e-5)
    assert SamplingParams(logit_bias={}).logit_bias is None


def test_min_tokens_bans_eos_and_stop_tokens_until_reached():
    logits = torch.tensor([[9.0, 8.0, 7.0, 0.0]])
    s = Sampler(4, "cpu", eos_token_ids=[0])
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[1])
    assert s.sample(logits, [p], [[]], [[3]], [None]).token_ids == [2]
    assert s.sample(logits, [p], [[]], [[3, 3]], [None]).token_ids == [0]
    p2 = SamplingParams(temperature=0, min_tokens=2, ignore_eos=True)
    assert s.sample(logits, [p2], [[]], [[3]], [None]).token_ids == [0]


# ------------------------------------------------------------- logprobs
def test_logprobs_are_log_softmax_of_the_raw_logits():
    B = 4
    logits = rand_logits(B, seed=12)
    params = [
        SamplingParams(temperature=0.3, top_k=4, logprobs=0),
        SamplingParams(temperature=0, logprobs=0),
        SamplingParams(temperature=2.0, top_p=0.5, min_p=0.1, logprobs=0, seed=3),
        SamplingParams(temperature=1.0),
    ]
    out = Sampler(V, "cpu", seed=0).sample(logits, params, [[1]] * B, [[]] * B, [None] * B)
    raw = logits.log_softmax(-1)
    want = [raw[i, t].item() for i, t in enumerate(out.token_ids)]
    assert out.logprobs == pytest.approx(want, abs=1e-5)
    assert out.top_logprobs is None


def test_logprobs_include_penalties_but_not_temperature():
    logits = rand_logits(1, seed=13)
    p = SamplingParams(temperature=0.5, repetition_penalty=1.5, logprobs=1, seed=0)
    out = Sampler(V, "cpu").sample(logits, [p], [[3, 4]], [[5]], [0])
    ref = sample_reference(logits, [p], [[3, 4]], [[5]], [0])
    assert out.logprobs == pytest.approx(ref.logprobs, abs=1e-5)
    assert out.top_logprobs[0][0][0] == ref.top_logprobs[0][0][0]


def test_top_logprobs_sorted_and_k_long():
    B = 3
    logits = rand_logits(B, seed=14)
    params = [SamplingParams(logprobs=5), SamplingParams(logprobs=None), SamplingParams(logprobs=2)]
    out = Sampler(V, "cpu", seed=0).sample(logits, params, [[1]] * B, [[]] * B, [1, 2, 3])
    assert [len(t) for t in out.top_logprobs] == [5, 0, 2]
    raw = logits.log_softmax(-1)
    for i, tops in enumerate(out.top_logprobs):
        values = [v for _, v in tops]
        assert values == sorted(values, reverse=True)
        ids = [t for t, _ in tops]
        assert ids == raw[i].topk(len(ids)).indices.tolist()
        for t, v in tops:
            assert v == pytest.approx(raw[i, t].item(), abs=1e-5)


# ------------------------------------------------- top-k candidates
def whole_rows(device="cpu", **kw) -> Sampler:
    s = Sampler(V if "V" not in kw else kw.pop("V"), device, **kw)
    s.candidates = False
    return s


def tied_logits(B, seed=0, V=V):
    """bf16-rounded logits (what the LM head gives): many values tie, across the top-k cut among them."""
    return (rand_logits(B, V, seed) * 0.5).bfloat16().float()


CANDIDATE_CASES = [
    dict(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05),  # Qwen2.5-Instruct's generation_config
    dict(temperature=1.0, top_k=5),
    dict(temperature=0.5, top_k=40, min_p=0.05),
    dict(temperature=1.3, top_k=90, top_p=0.95, frequency_penalty=0.4),
]


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("kw", CANDIDATE_CASES)
def test_top_k_candidates_give_the_whole_row_paths_distribution(kw, tied):
    B = 6
    logits = tied_logits(B, seed=5) if tied else rand_logits(B, seed=5)
    params = [SamplingParams(**kw)] * (B - 1) + [SamplingParams(temperature=0)]  # a greedy row among them
    prompts, outs = token_lists(B, 10, seed=6), token_lists(B, 4, seed=7)
    fast = Sampler(V, "cpu")
    draws = fast._process(logits, params, prompts, outs)[1]
    assert draws.dense is None and draws.groups  # the path under test is taken
    got = sampler_probs(fast, logits, params, prompts, outs)
    for want in (sampler_probs(whole_rows(), logits, params, prompts, outs),
                 sample_reference(logits, params, prompts, outs, [None] * B).probs):
        if tied:
            # values tied at a top-p cut: the CPU's sort of a whole row is not stable, so it may keep another of
            # them than the candidates do (the lowest id, as the GPU's stable radix sort): the same probabilities
            torch.testing.assert_close(got.sort(dim=-1).values, want.sort(dim=-1).values, atol=1e-6, rtol=1e-5)
        else:
            assert torch.equal(got > 0, want > 0)  # the same tokens survive the filters
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("kw", CANDIDATE_CASES)
def test_top_k_candidates_draw_the_whole_row_paths_seeded_tokens(kw):
    B = 64
    logits = rand_logits(B, seed=8)
    params = [SamplingParams(**kw)] * B
    prompts, outs = token_lists(B, 10, seed=9), token_lists(B, 3, seed=10)
    seeds = [1000 + i for i in range(B)]
    got = Sampler(V, "cpu").sample(logits, params, prompts, outs, seeds).token_ids
    assert got == whole_rows().sample(logits, params, prompts, outs, seeds).token_ids
    assert got == sample_reference(logits, params, prompts, outs, seeds).token_ids
    assert len(set(got)) > 3  # rows really sample


def test_each_row_takes_the_candidates_or_the_whole_row_by_its_own_top_k():
    logits = rand_logits(5)
    big = sampler_module.CANDIDATE_MAX_TOP_K + 1
    params = [SamplingParams(temperature=0.7, top_k=20), SamplingParams(temperature=0.7, top_p=0.9),
              SamplingParams(temperature=0), SamplingParams(temperature=0.9, top_k=90),
              SamplingParams(temperature=0.7, top_k=big)]
    draws = Sampler(V, "cpu")._process(logits, params, [[1]] * 5, [[]] * 5)[1]
    assert draws.dense is not None  # rows 1 and 4 sort their whole rows
    assert [(rows, cand.ids.shape[1]) for rows, _, cand in draws.groups] == [([0], 32), ([3], min(128, V))]


def test_a_seeded_top_k_rows_draw_is_the_same_alone_or_beside_rows_of_other_paths_and_widths():
    # the row's candidate width and path follow its own top_k, so its probabilities are the same bits and its
    # token the same whatever the batch holds: a top-p-only row (the whole-row path), a wider top-k, greedy rows
    logits = tied_logits(4, seed=12)
    target = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=5)
    others = [SamplingParams(temperature=0.7, top_p=0.95, seed=1), SamplingParams(temperature=1.0, top_k=300),
              SamplingParams(temperature=0)]
    s = Sampler(V, "cpu", seed=0)
    alone = s._process(logits[2:3], [target], [[1]], [[]])[1].groups[0][2]
    crowd = s._process(logits, others[:2] + [target] + others[2:], [[1]] * 4, [[]] * 4)[1]
    rows, _, cand = next(g for g in crowd.groups if 2 in g[0])
    assert torch.equal(cand.probs[rows.index(2)], alone.probs[0]) and torch.equal(cand.ids[rows.index(2)], alone.ids[0])
    for step in range(20):
        want = s.sample(logits[2:3], [target], [[1]], [[0] * step], [5]).token_ids
        got = s.sample(logits, others[:2] + [target] + others[2:], [[1]] * 4, [[0] * step] * 4, [1, None, 5, None])
        assert got.token_ids[2] == want[0]


def test_the_parameter_table_is_kept_only_while_the_steps_params_are_the_same_objects_in_the_same_order():
    from pageserve.engine.sampler import _REP, _TEMP

    s = Sampler(V, "cpu")
    a, b = SamplingParams(temperature=0.5, repetition_penalty=1.1), SamplingParams(temperature=0.9)
    first = s._param_table([a, b], V)
    assert s._param_table([a, b], V) is first  # a decode step with the same batch: no rebuild, no copy
    swapped = s._param_table([b, a], V)
    assert swapped[_TEMP].tolist() == pytest.approx([0.9, 0.5])
    c = SamplingParams(temperature=0.9, repetition_penalty=1.3)  # equal fields but one: another object
    assert s._param_table([b, c], V)[_REP].tolist() == pytest.approx([1.0, 1.3])
    assert s._param_table([b, c, a], V).shape == (7, 3)


@pytest.mark.parametrize("slack", [None, 0])
def test_candidates_are_the_stable_sorts_first_k_where_values_tie_across_the_cut(monkeypatch, slack):
    # 40 values tie for the 11th place and top_k = 20: the candidates are the ten above them, then the tied
    # values with the lowest ids, as a stable descending sort of the whole row puts them (``topk`` alone may
    # keep any of the tied ones: with no slack the candidates are not the sort's, which the test must see)
    Vb = 5000
    x = torch.zeros(2, Vb)
    x[:, 100:140] = 5.0
    x[:, 4000:4010] = 6.0
    x[1] = x[1].roll(7)
    if slack is not None:
        monkeypatch.setattr(sampler_module, "CANDIDATE_SLACK", slack)
    params = [SamplingParams(temperature=1.0, top_k=20)] * 2
    cand = Sampler(Vb, "cpu")._process(x, params, [[]] * 2, [[]] * 2)[1].groups[0][2]
    want = x.sort(dim=-1, descending=True, stable=True).indices[:, :20]
    same = torch.equal(cand.ids[:, :20], want)
    assert same if slack is None else not same


def coarse_sampler(V=V, **kw) -> Sampler:
    """A sampler that picks candidates from the logits rounded to their 16-bit dtype, as on CUDA."""
    s = Sampler(V, "cpu", **kw)
    s.coarse_select = True
    return s


COARSE_CASES = CANDIDATE_CASES + [
    dict(temperature=0.9, top_k=30, logit_bias={3: 2.5, 7: -1.75, 11: 0.3}),
    dict(temperature=0.6, top_k=8, top_p=0.9, min_tokens=5, repetition_penalty=0.8),  # eos banned; rep < 1 raises
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kw", COARSE_CASES)
def test_candidates_picked_from_16_bit_logits_are_the_fp32_picks_bits(kw, dtype):
    # the LM head's own dtype goes in, as in the engine: penalties, bias and bans change some values, which the
    # coarse pick sees rounded back to that dtype; the candidates and their probabilities are the same bits
    B = 8
    raw = tied_logits(B, seed=14).to(dtype)
    params = [SamplingParams(**kw)] * B
    prompts, outs = token_lists(B, 12, seed=15), token_lists(B, 5, seed=16)
    fine = Sampler(V, "cpu", eos_token_ids=[1]), coarse_sampler(eos_token_ids=[1])
    a, b = (s._process(raw, params, prompts, outs)[1].groups[0][2] for s in fine)
    assert torch.equal(a.ids, b.ids) and torch.equal(a.probs, b.probs)
    seeds = [40 + i for i in range(B)]
    assert (fine[0].sample(raw, params, prompts, outs, seeds).token_ids
            == fine[1].sample(raw, params, prompts, outs, seeds).token_ids)


def test_penalised_values_that_tie_once_rounded_are_still_ordered_by_their_fp32_values():
    # ten unseen tokens at -8 lead; fifteen seen ones follow, penalised x 1.3 to distinct fp32 values, of which
    # pairs round to one bf16 value: the first pair (-9.1 and -9.14 -> -9.125) straddles top_k = 11, and the
    # higher fp32 value sits at the higher id, so ordering by the rounded values (ties to the lower id) would
    # keep the wrong one of the pair
    Vb = 200
    x = torch.full((1, Vb), -20.0)
    x[0, 50:60] = -8.0
    seen = [114 - j for j in range(15)]
    x[0, seen] = -7.0 - 0.03125 * torch.arange(15.0)
    raw = x.bfloat16()
    p = SamplingParams(temperature=1.0, top_k=11, repetition_penalty=1.3)
    cand = coarse_sampler(Vb)._process(raw, [p], [seen], [[]])[1].groups[0][2]
    penalised = raw.float()
    penalised[0, seen] *= 1.3
    want = penalised.sort(dim=-1, descending=True, stable=True).indices[:, :25]
    assert torch.equal(cand.ids[:, :25], want)  # (then the 175 tokens at -20 tie, more than the slack)
    assert (cand.probs[0] > 0).tolist() == [True] * 11 + [False] * 21  # token 114 (j = 0) in, 113 out
    assert cand.ids[0, 10].item() == 114


@pytest.mark.parametrize("push", ["logit_bias", "repetition_penalty", "allowed_token_ids"])
def test_tokens_pushed_down_before_the_pick_do_not_crowd_it(push):
    # 100 tokens lead the raw logits (more than a candidate width and its slack) and are pushed far down by the
    # row's own params: the coarse pick must see the values after them, not the LM head's
    Vb, lead = 600, list(range(200, 300))
    g = torch.Generator().manual_seed(21)
    raw = (torch.randn(1, Vb, generator=g)).bfloat16()
    raw[0, lead] = 30.0
    kw = {"logit_bias": {t: -100.0 for t in lead}, "repetition_penalty": 50.0,
          "allowed_token_ids": [t for t in range(Vb) if t not in lead]}[push]
    p = SamplingParams(temperature=1.0, top_k=8, **{push: kw})
    prompt = lead if push == "repetition_penalty" else [1]
    fine, coarse = Sampler(Vb, "cpu"), coarse_sampler(Vb)
    a, b = (s._process(raw, [p], [prompt], [[]])[1].groups[0][2] for s in (fine, coarse))
    assert torch.equal(a.ids, b.ids) and torch.equal(a.probs, b.probs)
    assert not set(b.ids[0, :8].tolist()) & set(lead)


def test_seeded_noise_at_candidate_ids_is_the_whole_rows_bits():
    g = torch.Generator().manual_seed(3)
    seeds = torch.randint(-2**62, 2**62, (5,), generator=g)
    steps = torch.randint(0, 4000, (5,), generator=g)
    ids = torch.randint(0, 151936, (5, 33), generator=g)
    whole = seeded_uniform_tensor(seeds, steps, 151936)
    assert torch.equal(seeded_uniform_at(seeds, steps, ids), whole.gather(1, ids))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_on_the_gpu_top_k_candidates_draw_the_cpus_tokens_alone_or_in_a_big_batch(dtype):
    # Qwen2.5's vocabulary and its generation_config; 256 rows, where ``topk`` may take another algorithm than at
    # one row, and 16-bit logits as the LM head gives them, whose ties cross the cut (the GPU picks its candidates
    # from them, ``coarse_select``; the CPU from fp32): the seeded tokens are the CPU's, the whole-row path's and
    # the fp32 pick's
    Vq, B = 151936, 256
    g = torch.Generator().manual_seed(31)
    logits = (torch.randn(B, Vq, generator=g) * 2).to(dtype)
    params = [SamplingParams(**CANDIDATE_CASES[0])] * B
    prompts, outs = token_lists(B, 64, seed=32, V=Vq), token_lists(B, 16, seed=33, V=Vq)
    seeds = [7 * i + 3 for i in range(B)]
    gpu = Sampler(Vq, "cuda").sample(logits.cuda(), params, prompts, outs, seeds).token_ids
    assert gpu == Sampler(Vq, "cpu").sample(logits, params, prompts, outs, seeds).token_ids
    assert gpu == whole_rows("cuda", V=Vq).sample(logits.cuda(), params, prompts, outs, seeds).token_ids
    fine = Sampler(Vq, "cuda")
    fine.coarse_select = False
    assert gpu == fine.sample(logits.cuda(), params, prompts, outs, seeds).token_ids
    for i in (0, 77, 255):
        alone = Sampler(Vq, "cuda").sample(logits[i:i + 1].cuda(), params[:1], prompts[i:i + 1], outs[i:i + 1],
                                           seeds[i:i + 1]).token_ids
        assert alone == [gpu[i]]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_sampler_matches_cpu_for_seeded_and_greedy_rows():
    B = 8
    logits = rand_logits(B, seed=21)
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=i) if i % 3 else SamplingParams(temperature=0)
        for i in range(B)
    ]
    params[1] = SamplingParams(temperature=1.0, top_k=10, repetition_penalty=1.2, logprobs=3, seed=1)
    params[3] = SamplingParams(temperature=0, logit_bias={5: 100.0, int(logits[3].argmax()): -100.0})
    params[4] = SamplingParams(temperature=0.9, seed=4, logit_bias={7: 3.0, 9: -2.0})
    prompts, outs = token_lists(B, 12, seed=22), token_lists(B, 5, seed=23)
    seeds = [p.seed for p in params]
    cpu = Sampler(V, "cpu").sample(logits, params, prompts, outs, seeds)
    gpu = Sampler(V, "cuda").sample(logits.cuda(), params, prompts, outs, seeds)
    assert gpu.token_ids == cpu.token_ids
    assert gpu.token_ids_gpu.is_cuda
    assert gpu.logprobs == pytest.approx(cpu.logprobs, abs=1e-4)


def test_the_sampler_takes_its_argmax_from_the_triton_kernel_on_cuda_only():
    from pageserve.engine import sampler as sampler_mod

    assert Sampler(V, "cpu")._argmax is sampler_mod._torch_argmax
    if torch.cuda.is_available():
        from pageserve.kernels.argmax import argmax_rows

        assert Sampler(V, "cuda")._argmax is argmax_rows
        # a greedy batch over a vocabulary-sized row: the kernel's tokens are torch's
        logits = torch.randn(3, 151936, device="cuda")
        out = Sampler(151936, "cuda").sample(logits, [SamplingParams(temperature=0)] * 3, [[1]] * 3, [[]] * 3,
                                             [None] * 3)
        assert out.token_ids == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logit_bias_and_bans_never_write_the_callers_logits(dtype):
    # the engine hands the sampler a view of the decode graphs' shared buffer (bf16 since session 29):
    # the bias and the min_tokens ban work on a copy, made once, and give the tokens of fp32 logits
    logits = rand_logits(4, seed=31).to(dtype)
    before = logits.clone()
    params = [SamplingParams(temperature=0, logit_bias={3: 50.0}, min_tokens=5, stop_token_ids=[9]),
              SamplingParams(temperature=0.8, logit_bias={5: 50.0}), SamplingParams(temperature=0, min_tokens=2,
              stop_token_ids=[int(logits[2].argmax())]), SamplingParams(temperature=0)]
    prompts, outs = token_lists(4, 6, seed=2), [[], [], [], []]
    got = Sampler(V, "cpu").sample(logits, params, prompts, outs, [1, 2, 3, 4])
    assert torch.equal(logits, before)
    assert got.token_ids == Sampler(V, "cpu").sample(logits.float(), params, prompts, outs, [1, 2, 3, 4]).token_ids
    assert got.token_ids[0] == 3 and got.token_ids[2] != int(logits[2].argmax())


# --------------------------------------------------------------- structured-output masks
MASK_V = 1000
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def random_bits(g: np.random.Generator, rows: int, vocab: int = MASK_V) -> np.ndarray:
    """[rows, words] int32 masks of vocab tokens, each token allowed with probability 0.3."""
    allowed = g.random((rows, (vocab + 31) // 32 * 32)) < 0.3
    allowed[:, vocab:] = False
    return np.packbits(allowed, axis=1, bitorder="little").view(np.int32)


def allowed_of(bits: np.ndarray, vocab: int = MASK_V) -> np.ndarray:
    """The reference unpacking: bit t % 32 of word t // 32, read one token at a time."""
    return np.array([[(int(row[t // 32]) >> (t % 32)) & 1 for t in range(vocab)] for row in bits], dtype=bool)


@pytest.mark.parametrize("device", DEVICES)
def test_unpack_token_bits_matches_a_bit_by_bit_reading(device):
    g = np.random.default_rng(0)
    for vocab in (1, 31, 32, 33, MASK_V):
        bits = random_bits(g, 3, vocab)
        bits[0, 0] = -1  # every bit of a word set, the sign bit included
        got = unpack_token_bits(torch.from_numpy(bits).to(device), vocab).cpu().numpy()
        np.testing.assert_array_equal(got, allowed_of(bits, vocab))


@pytest.mark.parametrize("device", DEVICES)
def test_sampler_keeps_guided_rows_inside_their_masks_and_leaves_the_others_alone(device):
    g = np.random.default_rng(1)
    sampler = Sampler(MASK_V, device, eos_token_ids=[7], seed=0)
    logits = (torch.randn(6, MASK_V, generator=torch.Generator().manual_seed(2)) * 3).to(device)
    params = [SamplingParams(temperature=t, seed=s) for t, s in
              ((0, None), (0.9, 1), (0, None), (1.2, 5), (0.7, 9), (0, None))]
    rows = [0, 1, 3]
    bits = random_bits(g, len(rows))
    allowed = allowed_of(bits)
    masks = TokenMasks(rows, bits)
    seeds = [p.seed for p in params]
    for trial in range(20):
        out = sampler.sample(logits, params, [[1]] * 6, [[]] * 6, seeds, [trial] * 6, masks).token_ids
        plain = sampler.sample(logits, params, [[1]] * 6, [[]] * 6, seeds, [trial] * 6).token_ids
        for j, r in enumerate(rows):
            assert allowed[j, out[r]], (trial, r, out[r])
        assert out[4] == plain[4]  # seeded, unguided: the same draw with or without the others' masks
        assert out[2] == plain[2] == logits[2].cpu().argmax().item() and out[5] == plain[5]
    masked = logits[0].cpu().masked_fill(~torch.from_numpy(allowed[0]), float("-inf"))
    assert out[0] == masked.argmax().item()


@pytest.mark.parametrize("device", DEVICES)
def test_min_tokens_bans_go_into_the_mask_unless_the_grammar_may_only_end(device):
    sampler = Sampler(MASK_V, device, eos_token_ids=[7], seed=0)
    logits = torch.zeros(2, MASK_V)
    logits[:, 7] = 10.0  # eos is by far the likeliest
    logits = logits.to(device)
    both = np.zeros((2, (MASK_V + 31) // 32), dtype=np.int32)
    both[0, 0] = (1 << 7) | (1 << 3)  # eos or token 3
    both[1, 0] = 1 << 7  # eos alone: the grammar is complete
    params = [SamplingParams(temperature=0, min_tokens=5)] * 2
    out = sampler.sample(logits, params, [[1]] * 2, [[]] * 2, [None] * 2, [0, 0], TokenMasks([0, 1], both)).token_ids
    assert out == [3, 7]


# --------------------------------------------------------------- vLLM's allowed_token_ids and bad_words
@pytest.mark.parametrize("device", DEVICES)
def test_allowed_token_ids_keep_exactly_their_logits_whatever_the_ids(device):
    # each request's ids become mask words once (kept on its params) and go through the guided rows' mask path:
    # fresh random sets with duplicates, ids on a word's sign bit (31, 63) and at the vocabulary's end, ids past it
    # (dropped), a row without them between; the kept logits keep their bits, every other one is -inf
    g = np.random.default_rng(5)
    Vt = 200
    logits = torch.randn(4, Vt, generator=torch.Generator().manual_seed(6)).to(device)
    sets = [[31, 63, 31, Vt - 1, Vt + 5], g.integers(0, Vt, 40).tolist(), None, [0, 32, 199]]
    params = [SamplingParams(temperature=0.7, seed=1, allowed_token_ids=a) for a in sets]
    sampler = Sampler(Vt, device, seed=0)
    for _ in range(2):  # the second step reads the cached words
        got = sampler._process(logits, params, [[1]] * 4, [[]] * 4)[0].cpu()
        for i, a in enumerate(sets):
            keep = torch.ones(Vt, dtype=torch.bool) if a is None else torch.zeros(Vt, dtype=torch.bool)
            if a is not None:
                keep[[t for t in a if t < Vt]] = True
            want = logits[i].cpu().float().masked_fill(~keep, float("-inf"))
            assert torch.equal(got[i], want), i
    assert params[0]._allowed_words is not None and params[2]._allowed_words is None


@pytest.mark.parametrize("device", DEVICES)
def test_allowed_token_ids_and_bad_words_ban_what_they_should_and_nothing_else(device):
    sampler = Sampler(V, device, seed=0)
    logits = rand_logits(4, seed=9).to(device)
    order = logits.cpu().argsort(dim=-1, descending=True).tolist()  # each row's tokens, likeliest first
    allowed = SamplingParams(temperature=0, allowed_token_ids=[order[0][5], order[0][9]])
    one_token = SamplingParams(temperature=0, bad_words=["x"])
    one_token._bad_words_ids = [[order[1][0]]]  # a one-token word: always banned
    two_token = SamplingParams(temperature=0, bad_words=["x y"])
    two_token._bad_words_ids = [[42, order[2][0]]]  # banned only right after 42
    params = [allowed, one_token, two_token, two_token]
    outputs = [[1], [1], [7, 42], [42, 7]]
    out = sampler.sample(logits, params, [[1]] * 4, outputs, [None] * 4).token_ids
    assert out == [order[0][5], order[1][1], order[2][1], order[3][0]]
    for p in params:
        assert not sampler._all_plain_greedy([p], [0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("kind", ["penalties", "penalties_pending", "sampled_filters", "bias_bans_logprobs", "guided"])
def test_on_the_gpu_the_sampler_launches_a_step_without_waiting_for_the_device(kind):
    """The sampler runs between the forward's launch and the landing: a call in it that waits for the device (an
    ``.item()``, a ``nonzero``, a copy to the host) puts the forward's whole time on the host's clock. Session 47's
    structured stage (H100, 3B shape, 256 rows): a penalised step's sample launch took 3.4-4.4 ms of host time
    against plain's 0.5, and its wait for the device fell from 1.3-1.8 ms to 0.2. This finds any such call."""
    from pageserve.engine.sequence import TokenHistory

    B, V, dev = 64, 151_936, torch.device("cuda")
    g = np.random.default_rng(5)
    sampler = Sampler(V, dev, eos_token_ids=[2], seed=0)
    prompts = [g.integers(0, V, 300).tolist() for _ in range(B)]
    outs = [g.integers(0, V, 40).tolist() for _ in range(B)]
    histories = [TokenHistory(p, o) for p, o in zip(prompts, outs)]
    pen = dict(repetition_penalty=1.05, frequency_penalty=0.2, presence_penalty=0.1)
    params = {
        "penalties": [SamplingParams(temperature=0, **pen)] * B,
        "penalties_pending": [SamplingParams(temperature=0.7, seed=3, **pen)] * B,
        "sampled_filters": [SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.05, seed=i) for i in range(B)],
        "bias_bans_logprobs": [SamplingParams(temperature=0, logit_bias={5: 2.0}, min_tokens=60, max_tokens=100,
                                              logprobs=3)] * B,
        "guided": [SamplingParams(temperature=0)] * B,
    }[kind]
    masks = TokenMasks(list(range(0, B, 2)), random_bits(g, B // 2, V)) if kind == "guided" else None
    pending = (torch.arange(B, device=dev), list(range(B))) if kind == "penalties_pending" else None
    logits = torch.randn(B, V, device=dev, dtype=torch.bfloat16)
    seeds = [p.seed for p in params]

    def call():
        return sampler.sample(logits, params, prompts, outs, seeds, [len(o) for o in outs], masks,
                              histories if kind.startswith("penalties") else None, pending)

    want = call().token_ids  # first calls compile kernels and fill caches, which may wait
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = call()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.token_ids == want  # and the step is the same step


def test_the_sampling_bench_runs_every_mode_and_variant_to_max_tokens_and_records_them(tmp_path):
    """scripts/sampling_bench.py on a random-weight shape on the CPU: each mode (and its whole-row, fine, torchrace,
    torchtopk, torchpen, copypen and heavy variants) yields exactly max_tokens tokens a request, so the modes run the
    same steps, and the record holds the ratios and the sampler's op profiles."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, str(root / "scripts/sampling_bench.py"), "--out", str(tmp_path), "--device", "cpu",
                    "--model", "smollm2-135m", "--requests", "3", "--prompt-len", "8", "--max-tokens", "3",
                    "--rounds", "1", "--profile-calls", "1"], check=True, cwd=root, capture_output=True)
    record = json.loads((tmp_path / "sampling_bench.json").read_text())
    names = {"plain", "penalised", "penalised/heavy", "penalised/torchpen", "penalised/copypen", "sampled", "sampled/whole", "sampled/fine",
             "sampled/torchrace", "sampled/torchtopk", "qwen_default", "qwen_default/whole", "qwen_default/fine",
             "qwen_default/torchrace", "qwen_default/torchtopk", "qwen_default/torchpen", "qwen_default/copypen",
             "qwen_default/heavy",
             "sampled_seeded", "sampled_seeded/whole", "sampled_seeded/fine", "sampled_seeded/torchrace",
             "sampled_seeded/torchtopk"}
    assert set(record["ratio_to_plain"]) == names
    assert {r["mode"] for r in record["runs"]} == names
    assert all(r["output_tokens"] == 3 * 3 for r in record["runs"])
    assert all(p.get("calls") == 1 for p in record["sampler_profiles"].values())
    assert record["git_commit"]
