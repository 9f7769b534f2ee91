"""Tensor parallelism on the CPU: 2 gloo processes against one (phase 06c).

The model is split over ranks (heads, MLP width, vocabulary); rank 0 runs the engine and
the workers follow its steps. In fp32 the shards differ from one process only in the
order of the all-reduce's additions, so logits agree to ~1e-6 and greedy text is equal.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import torch

from pageserve.engine.config import EngineConfig
from pageserve.engine.llm import LLM
from pageserve.engine.sampling_params import SamplingParams
from pageserve.lab.parallel_checks import prompt_logits
from pageserve.model.config import SHIPPED_CONFIGS, ModelConfig
from pageserve.model.loader import build_decoder
from pageserve.model.parallel import check_tp_divisible, vocab_shard

REPO = Path(__file__).resolve().parents[1]
# 4 query heads / 2 KV heads split over 2 ranks; an odd vocabulary exercises the padded last shard
TINY = ModelConfig(architecture="qwen2", vocab_size=1001, hidden_size=64, intermediate_size=128, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=16, attention_bias=True, tie_word_embeddings=False,
                   max_position_embeddings=256)


def tiny_model(cfg: ModelConfig = TINY, std: float = 0.15):
    m = build_decoder(cfg, torch.device("cpu"), torch.float32, 256)
    m.init_dummy_weights(seed=0, std=std)  # a larger std than the default: varied greedy text
    return m


def prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(torch.randint(3, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
# a small token budget: prompts are chunked and mixed with decodes (the non-steady fill path)
ENGINE = dict(device="cpu", dtype="float32", num_blocks=128, max_num_batched_tokens=48, max_num_seqs=8)


@pytest.fixture(scope="module")
def tiny_pair():
    model = tiny_model()
    one = LLM.from_model(model, **ENGINE)
    two = LLM.from_model(model, tensor_parallel_size=2, **ENGINE)
    yield one, two
    two.shutdown()


def test_two_gloo_ranks_give_the_logits_of_one_process(tiny_pair):
    one, two = tiny_pair
    ps = prompts(4, TINY.vocab_size)
    a, b = prompt_logits(one, ps), prompt_logits(two, ps)
    assert a.shape == b.shape == (sum(map(len, ps)), TINY.vocab_size)
    rel = ((b - a).norm() / a.norm()).item()
    assert rel <= 1e-5, rel


def test_greedy_generation_at_tp2_is_token_identical_to_tp1(tiny_pair):
    one, two = tiny_pair
    ps = prompts(8, TINY.vocab_size, seed=1)
    a = [o.outputs[0].token_ids for o in one.generate(ps, GREEDY, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in two.generate(ps, GREEDY, use_tqdm=False)]
    assert len({t for seq in a for t in seq}) > 8  # the text is not one repeated token
    assert a == b
    assert two.engine.block_manager.num_free_blocks == two.engine.runner.num_blocks


def test_the_callers_model_stays_whole_after_a_tp_engine_is_built(tiny_pair):
    one, two = tiny_pair
    assert one.engine.model.layers[0].self_attn.num_heads == TINY.num_heads
    shard = two.engine.model
    assert shard.layers[0].self_attn.num_heads == 2 and shard.cfg.num_kv_heads == 1
    assert two.engine.runner.kv_cache.shape[4] == 1  # the paged cache holds this rank's KV head only
    assert shard.embed_tokens.weight.shape[0] == vocab_shard(TINY.vocab_size, 0, 2)[1] == 501


def test_shutdown_stops_the_workers_and_frees_the_process_group(tiny_pair):
    import torch.distributed as dist

    llm = tiny_pair[1]  # last use of the module's pair: one TP engine per process at a time
    pids = list(llm.engine.runner.workers.pids)
    llm.shutdown()
    assert not dist.is_initialized()
    assert not [p for p in pids if _alive(p)]
    llm.shutdown()  # idempotent


def test_qwen05b_shape_random_weights_tp2_token_identical(tmp_path):
    # Qwen2.5-0.5B's shape (14 query / 2 KV heads, vocab 151,936, tied head), 4 of its 24
    # layers to keep CI short; loaded by name on every rank (same seed: the same full tensors)
    hf = json.loads((SHIPPED_CONFIGS / "qwen2.5-0.5b.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(hf, num_hidden_layers=4)))
    kw = dict(device="cpu", dtype="float32", num_blocks=64, max_model_len=128, max_num_seqs=4)
    ps = prompts(4, 151936, seed=2)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs, logits = [], []
    for tp in (1, 2):
        llm = LLM(f"dummy:{tmp_path / 'config.json'}", tensor_parallel_size=tp, **kw)
        logits.append(prompt_logits(llm, ps[:2]))
        outs.append([o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)])
        llm.shutdown()
        del llm
    assert ((logits[1] - logits[0]).norm() / logits[0].norm()).item() <= 1e-5
    assert outs[0] == outs[1]


def test_sizes_that_split_a_head_are_rejected_with_the_head_counts():
    smol = ModelConfig.shipped("smollm2-135m")  # 9 query heads, 3 KV heads: the default model's shape
    with pytest.raises(ValueError, match=r"num_attention_heads=9, num_key_value_heads=3"):
        check_tp_divisible(smol, 2)
    check_tp_divisible(smol, 3)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(tensor_parallel_size=0, device="cpu")
    odd = ModelConfig(architecture="llama", vocab_size=64, hidden_size=48, intermediate_size=96, num_layers=1,
                      num_heads=3, num_kv_heads=3, head_dim=16)
    with pytest.raises(ValueError, match="does not divide"):  # before any worker starts
        LLM.from_model(tiny_model(odd), tensor_parallel_size=2, device="cpu", dtype="float32", num_blocks=8)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_killing_the_parent_leaves_no_worker_behind():
    script = textwrap.dedent("""
        import sys, time, torch
        from pageserve.engine.llm import LLM
        from pageserve.model.config import SHIPPED_CONFIGS, ModelConfig
        from pageserve.model.loader import build_decoder
        if __name__ == "__main__":
            cfg = ModelConfig(architecture="llama", vocab_size=128, hidden_size=32, intermediate_size=64,
                              num_layers=1, num_heads=2, num_kv_heads=2, head_dim=16)
            m = build_decoder(cfg, torch.device("cpu"), torch.float32, 64); m.init_dummy_weights(0)
            llm = LLM.from_model(m, tensor_parallel_size=2, device="cpu", dtype="float32", num_blocks=8)
            print("WORKERS", *llm.engine.runner.workers.pids, flush=True)
            time.sleep(600)
    """)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = ""
        deadline = time.monotonic() + 90
        while not line.startswith("WORKERS") and time.monotonic() < deadline:
            line = parent.stdout.readline()
            assert line or parent.poll() is None, "the parent exited before starting its workers"
        pids = [int(p) for p in line.split()[1:]]
        assert pids and all(_alive(p) for p in pids)
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
    deadline = time.monotonic() + 15
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in pids if _alive(p)], "workers outlived their killed parent"


def test_generate_and_serve_take_a_tensor_parallel_size_flag():
    from pageserve.cli import build_parser

    args = build_parser().parse_args(["generate", "hi", "--tensor-parallel-size", "2"])
    assert args.tensor_parallel_size == 2
    args = build_parser().parse_args(["serve", "--tensor-parallel-size", "2"])
    assert args.tensor_parallel_size == 2
    for cmd in (["generate", "hi"], ["serve"]):
        assert build_parser().parse_args([*cmd, "--disable-custom-all-reduce"]).disable_custom_all_reduce is True
        assert build_parser().parse_args(cmd).disable_custom_all_reduce is False


def test_tp_shutdown_frees_the_graphs_before_the_group_teardown():
    """NCCL's communicator destroy never returns while a graph holding its collectives lives
    (hung on two H200s): rank 0 must drop its graphs before tearing the group down."""
    from pageserve.engine import tensor_parallel as tp

    order = []

    class Graphs:
        def release(self):
            order.append("graphs released")

    class Workers:
        def shutdown(self):
            order.append("group torn down")

    runner = object.__new__(tp.TPModelRunner)
    runner.graphs, runner.workers = Graphs(), Workers()
    runner.shutdown()
    assert order == ["graphs released", "group torn down"]
    assert runner.graphs is None and runner.workers is None
    runner.shutdown()  # idempotent
    assert len(order) == 2
