"""LoRA adapters (``model/lora.py``, ``engine/lora.py``) on the CPU.

The reference is the adapter merged into a copy of the weights (W + s B A, ``lab.lora_reference``): a row
with an adapter must score every prompt token as the merged model does, and a row without one as the base
model does, whatever else shares its step. Then the scheduler's slot limit, the prefix cache's separation of
adapters, bad adapters and bad requests, the Triton kernels (interpreter), the deterministic mode, speculative
decoding, and the server's routes."""
from __future__ import annotations

import copy
import json
import os

import pytest
import torch

from pageserve.engine.llm import LLM
from pageserve.engine.lora import LoRARequest
from pageserve.engine.sampling_params import SamplingParams
from pageserve.lab.lora_reference import merged_model, write_peft_adapter
from pageserve.model.decoder import Decoder
from pageserve.model.lora import LoRAAdapter

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest: one intra-op thread for this module
# Triton launches on CPU tensors need the interpreter, which conftest turns on only where there is no GPU
CPU_TRITON = pytest.mark.skipif(torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="Triton on CPU tensors needs TRITON_INTERPRET=1 (the GPU tests cover CUDA)")
TRITON_PARAM = pytest.param(True, marks=CPU_TRITON, id="triton")


@pytest.fixture
def fused_lora(monkeypatch):
    """The fused layer path (``kernels/lora.py``), off by default since session 48: its tests turn it on."""
    from pageserve.model.lora import LoRASlots

    monkeypatch.setattr(LoRASlots, "USE_KERNELS", True)

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22], [20, 21, 22, 23],
           [40, 41, 42, 43, 44, 45, 46, 47, 48, 49]]
SCORE = SamplingParams(max_tokens=6, temperature=0, prompt_logprobs=0, logprobs=0)


@pytest.fixture(scope="module")
def base(tiny_qwen2_config):
    model = Decoder(tiny_qwen2_config)
    model.init_dummy_weights(seed=11)
    return model


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_qwen2_config):
    """Two adapters of different ranks and modules (one of them rsLoRA, one only on some layers' modules)."""
    root = tmp_path_factory.mktemp("lora")
    a = write_peft_adapter(root / "a", tiny_qwen2_config, rank=8, alpha=16, seed=1, std=0.2)
    b = write_peft_adapter(root / "b", tiny_qwen2_config, rank=4, alpha=8, seed=2, std=0.3,
                           modules=("q_proj", "v_proj", "down_proj"), layers=[1], config_extra={"use_rslora": True})
    return {"a": LoRARequest("a", 1, str(a)), "b": LoRARequest("b", 2, str(b))}


def reference(base, request, cfg):
    if request is None:
        return copy.deepcopy(base)
    return merged_model(base, LoRAAdapter.load(request.lora_path, cfg, 16))


def scores(out):
    """Each prompt token's logprob, then each generated token's."""
    prompt = [next(iter(d.values())) for d in out.prompt_logprobs[1:]]
    gen = out.outputs[0]
    return prompt + [d[t] for d, t in zip(gen.logprobs, gen.token_ids)], gen.token_ids


def lora_llm(base, **kw):
    return LLM.from_model(copy.deepcopy(base), device="cpu", num_blocks=64, enable_lora=True, **kw)


def assert_like_reference(outs, loras, base, cfg, atol=2e-5):
    for out, lora in zip(outs, loras):
        want = LLM.from_model(reference(base, lora, cfg), device="cpu", num_blocks=64)
        ref = want.generate([out.prompt_token_ids], SCORE, use_tqdm=False)[0]
        got_lp, got_ids = scores(out)
        ref_lp, ref_ids = scores(ref)
        assert got_ids == ref_ids, (lora, got_ids, ref_ids)
        assert got_lp == pytest.approx(ref_lp, abs=atol), lora


# ----------------------------------------------------------------------------- the adapter file
def test_an_adapter_reads_peft_names_and_scales(adapters, tiny_qwen2_config):
    a = LoRAAdapter.load(adapters["a"].lora_path, tiny_qwen2_config, max_rank=16)
    assert a.rank == 8 and a.scaling == 16 / 8
    assert len(a.weights) == 2 * 7 and a.weights[(1, "k_proj")][0].shape == (8, 64)
    b = LoRAAdapter.load(adapters["b"].lora_path, tiny_qwen2_config, max_rank=16)
    assert b.scaling == pytest.approx(8 / 2)  # rsLoRA: alpha / sqrt(r)
    assert set(b.weights) == {(1, "q_proj"), (1, "v_proj"), (1, "down_proj")}


@pytest.mark.parametrize("change, why", [
    ({"config": {"r": 32}}, "over max_lora_rank 16"),
    ({"config": {"rank_pattern": {"q_proj": 4}}}, "per-module ranks"),
    ({"config": {"use_dora": True}}, "DoRA"),
    ({"config": {"bias": "all"}}, "adapted biases"),
    ({"config": {"peft_type": "IA3"}}, "is not LORA"),
    ({"drop": "lora_B"}, "has only"),
    ({"rename": ("layers.1.", "layers.7.")}, "names layer 7"),
    ({"rename": ("mlp.down_proj", "mlp.fc9")}, "not supported"),
    ({"extra": "base_model.model.model.embed_tokens.lora_embedding_A"}, "not a decoder layer"),
    ({"shape": True}, "this model needs"),
    ({"no_config": True}, "no adapter_config.json"),
    ({"no_weights": True}, "no adapter_model"),
])
def test_an_adapter_this_engine_cannot_apply_exactly_is_refused_by_name(tmp_path, tiny_qwen2_config, change, why):
    from safetensors.torch import load_file, save_file

    folder = write_peft_adapter(tmp_path / "x", tiny_qwen2_config, rank=8)
    conf = json.loads((folder / "adapter_config.json").read_text())
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    if "config" in change:
        conf |= change["config"]
    if "drop" in change:
        tensors = {k: v for k, v in tensors.items() if not ("layers.0.self_attn.q_proj" in k and change["drop"] in k)}
    if "rename" in change:
        old, new = change["rename"]
        tensors = {k.replace(old, new): v for k, v in tensors.items()}
    if "extra" in change:
        tensors[change["extra"]] = torch.zeros(8, 256)
    if "shape" in change:
        key = next(k for k in tensors if "o_proj.lora_B" in k)
        tensors[key] = torch.zeros(63, 8)
    (folder / "adapter_config.json").write_text(json.dumps(conf))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    if "no_config" in change:
        (folder / "adapter_config.json").unlink()
    if "no_weights" in change:
        (folder / "adapter_model.safetensors").unlink()
    with pytest.raises(ValueError, match=why):
        LoRAAdapter.load(folder, tiny_qwen2_config, max_rank=16)


def test_a_hub_id_is_fetched_as_an_adapter_folder_and_a_failed_fetch_is_one_clear_error(tmp_path, tiny_qwen2_config,
                                                                                       monkeypatch):
    import huggingface_hub

    folder = write_peft_adapter(tmp_path / "hub", tiny_qwen2_config, rank=4)
    asked = []

    def fetched(repo_id, allow_patterns=None, **kw):
        asked.append((repo_id, allow_patterns))
        return str(folder)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fetched)
    assert LoRAAdapter.load("someone/sql-lora", tiny_qwen2_config, 16).rank == 4
    assert asked == [("someone/sql-lora", ["adapter_config.json", "adapter_model.safetensors", "adapter_model.bin"])]

    def offline(repo_id, **kw):
        raise OSError("offline\nmode")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ValueError, match="not a local folder, and the hub did not give it .OSError: offline mode"):
        LoRAAdapter.load("someone/sql-lora", tiny_qwen2_config, 16)


# ----------------------------------------------------------------------------- against merged weights
def test_rows_with_an_adapter_score_as_the_merged_model_and_rows_without_as_the_base(base, adapters, tiny_qwen2_config):
    llm = lora_llm(base, max_loras=2)
    loras = [adapters["a"], None, adapters["b"]]
    outs = llm.generate(PROMPTS, SCORE, use_tqdm=False, lora_request=loras)
    assert_like_reference(outs, loras, base, tiny_qwen2_config)
    # and the adapters changed something: a's scores are not the base model's
    plain = LLM.from_model(copy.deepcopy(base), device="cpu", num_blocks=64).generate(PROMPTS[:1], SCORE, use_tqdm=False)
    assert max(abs(x - y) for x, y in zip(scores(outs[0])[0], scores(plain[0])[0])) > 1e-2


def test_an_engine_with_lora_on_gives_requests_without_one_the_base_models_tokens(base):
    plain = LLM.from_model(copy.deepcopy(base), device="cpu", num_blocks=64).generate(PROMPTS, SCORE, use_tqdm=False)
    outs = lora_llm(base).generate(PROMPTS, SCORE, use_tqdm=False)
    for o, p in zip(outs, plain):
        assert scores(o)[1] == scores(p)[1]
        assert scores(o)[0] == pytest.approx(scores(p)[0], abs=2e-5)


def test_one_slot_runs_two_adapters_one_after_the_other(base, adapters, tiny_qwen2_config):
    llm = lora_llm(base, max_loras=1)
    manager = llm.engine.runner.lora
    seen = []
    assign = manager.assign

    def recording(ids):
        seen.append({i for i in ids if i is not None})
        return assign(ids)

    manager.assign = recording
    loras = [adapters["a"], adapters["b"], adapters["a"]]
    outs = llm.generate(PROMPTS, SCORE, use_tqdm=False, lora_request=loras)
    assert max(len(s) for s in seen) == 1  # never two adapters in one step
    assert {frozenset(s) for s in seen if s} == {frozenset({1}), frozenset({2})}
    assert manager.num_loads >= 2
    assert_like_reference(outs, loras, base, tiny_qwen2_config)


def test_the_least_recently_used_slot_is_the_one_reloaded(base, adapters, tiny_qwen2_config, tmp_path):
    c = write_peft_adapter(tmp_path / "c", tiny_qwen2_config, rank=2, seed=3)
    llm = lora_llm(base, max_loras=2)
    m = llm.engine.runner.lora
    for r in (adapters["a"], adapters["b"], LoRARequest("c", 3, str(c))):
        llm.engine.add_lora(r)
    assert m.assign([1, None]).tolist() == [0, -1]
    assert m.assign([2]).tolist() == [1]
    assert m.assign([1]).tolist() == [0]  # a used more recently than b
    assert m.assign([3, 1]).tolist() == [1, 0]  # c takes b's slot
    assert m.slot_ids == [1, 3] and m.num_loads == 3
    with pytest.raises(RuntimeError, match="3 LoRA adapters; there are 2 slots"):
        m.assign([1, 2, 3])


def test_the_prefix_cache_never_serves_one_adapters_blocks_to_another(base, adapters):
    llm = lora_llm(base, max_loras=2)
    prompt = list(range(3, 3 + 40))  # two full blocks and a part
    p = SamplingParams(max_tokens=2, temperature=0)

    def cached(lora):
        return llm.generate([prompt], p, use_tqdm=False, lora_request=lora)[0].metrics.num_cached_tokens

    assert cached(adapters["a"]) == 0
    assert cached(None) == 0  # the base model's K/V differ from a's
    assert cached(adapters["b"]) == 0
    assert cached(adapters["a"]) == 32  # a's own blocks, found again
    assert cached(None) == 32


def test_requests_with_an_adapter_survive_preemption_with_their_adapter(base, adapters, tiny_qwen2_config):
    llm = LLM.from_model(copy.deepcopy(base), device="cpu", num_blocks=9, block_size=4, max_num_seqs=3,
                         enable_lora=True, max_loras=2, enable_prefix_caching=False)
    loras = [adapters["a"], adapters["b"], None]
    p = SamplingParams(max_tokens=6, temperature=0, prompt_logprobs=0, logprobs=0)
    outs = llm.generate(PROMPTS, p, use_tqdm=False, lora_request=loras)
    assert llm.num_preemptions > 0
    assert_like_reference(outs, loras, base, tiny_qwen2_config)


# ----------------------------------------------------------------------------- bad input
def test_lora_requests_are_refused_clearly_and_leave_the_engine_as_it_was(base, adapters, tmp_path):
    off = LLM.from_model(copy.deepcopy(base), device="cpu", num_blocks=64)
    with pytest.raises(ValueError, match="without enable_lora"):
        off.generate(PROMPTS[:1], SCORE, use_tqdm=False, lora_request=adapters["a"])
    assert not off.engine.has_unfinished_requests()

    llm = lora_llm(base, max_lora_rank=4)
    with pytest.raises(ValueError, match="rank 8 is over max_lora_rank 4"):
        llm.generate(PROMPTS[:1], SCORE, use_tqdm=False, lora_request=adapters["a"])
    with pytest.raises(ValueError, match="no such folder"):
        llm.generate(PROMPTS[:1], SCORE, use_tqdm=False, lora_request=LoRARequest("gone", 5, str(tmp_path / "gone")))
    assert not llm.engine.has_unfinished_requests() and llm.engine.list_loras() == []
    llm.engine.add_lora(adapters["b"])
    with pytest.raises(ValueError, match="already 'b'"):
        llm.engine.add_lora(LoRARequest("b2", 2, adapters["a"].lora_path))
    with pytest.raises(ValueError, match="already loaded"):
        llm.engine.add_lora(LoRARequest("b", 9, adapters["a"].lora_path))
    assert llm.generate(PROMPTS[:1], SCORE, use_tqdm=False, lora_request=adapters["b"])[0].finished
    for bad, why in ([("", 1, "x"), "non-empty"], [("x", 0, "x"), "positive"], [("x", True, "x"), "positive"]):
        with pytest.raises(ValueError, match=why):
            LoRARequest(*bad)


def test_an_adapter_in_use_is_not_removed(base, adapters):
    llm = lora_llm(base)
    engine = llm.engine
    engine.add_request("r", PROMPTS[0], SamplingParams(max_tokens=3), lora_request=adapters["a"])
    with pytest.raises(ValueError, match="in use by 1 request"):
        engine.remove_lora(1)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.remove_lora(1) and not engine.remove_lora(1)
    assert engine.list_loras() == [] and engine.runner.lora.slot_ids == [None]


def test_lora_with_tensor_parallelism_is_refused():
    from pageserve.engine.config import EngineConfig

    with pytest.raises(ValueError, match="enable_lora with tensor_parallel_size"):
        EngineConfig(device="cpu", enable_lora=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="max_loras must be a positive integer"):
        EngineConfig(device="cpu", max_loras=0)


# ----------------------------------------------------------------------------- other paths
@CPU_TRITON
@pytest.mark.parametrize("fused", [False, True], ids=["reference_products", "fused_kernel"])
def test_the_triton_kernels_apply_adapters_as_the_reference(base, adapters, tiny_qwen2_config, fused, request):
    if fused:
        request.getfixturevalue("fused_lora")
    llm = lora_llm(base, max_loras=2, use_triton=True)
    assert any(layer.lora.fused_for(llm.engine.runner.ops) for layer in llm.engine.runner.model.layers) == fused
    loras = [adapters["a"], None, adapters["b"]]
    outs = llm.generate(PROMPTS, SCORE, use_tqdm=False, lora_request=loras)
    assert_like_reference(outs, loras, base, tiny_qwen2_config, atol=1e-4)


@pytest.mark.parametrize("use_triton", [None, TRITON_PARAM], ids=["torch", "triton"])
def test_the_deterministic_mode_keeps_an_adapters_rows_batch_invariant(base, adapters, use_triton):
    llm = lora_llm(base, max_loras=2, deterministic=True, use_triton=use_triton)
    assert llm.engine.runner.ops.name == {None: "torch-deterministic", True: "deterministic"}[use_triton]
    alone = llm.generate(PROMPTS[:1], SCORE, use_tqdm=False, lora_request=adapters["a"])[0]
    batched = llm.generate(PROMPTS, SCORE, use_tqdm=False, lora_request=[adapters["a"], adapters["b"], None])[0]
    assert scores(alone) == scores(batched)  # bit for bit


def test_speculative_decoding_with_an_adapter_accepts_the_adapters_tokens(base, adapters):
    """Oracle drafts (test_speculative's: the plain LoRA run's own next tokens) are all accepted only if the
    verify step applies the adapter to every draft row; the text is the plain LoRA run's."""
    from test_speculative import oracle

    p = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    loras = [adapters["a"], None, adapters["b"]]
    plain = [o.outputs[0].token_ids for o in lora_llm(base, max_loras=2).generate(PROMPTS, p, use_tqdm=False,
                                                                                     lora_request=loras)]
    llm = lora_llm(base, max_loras=2, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    oracle(llm, PROMPTS, plain, None)
    spec = llm.generate(PROMPTS, p, use_tqdm=False, lora_request=loras)
    assert [o.outputs[0].token_ids for o in spec] == plain
    stats = llm.get_stats()
    assert stats["spec_draft_tokens"] > 0 and stats["spec_acceptance_rate"] == 1.0


def test_engine_stats_name_the_running_and_waiting_adapters(base, adapters):
    llm = lora_llm(base, max_loras=1)
    engine = llm.engine
    engine.add_request("x", PROMPTS[0], SamplingParams(max_tokens=4), lora_request=adapters["a"])
    engine.add_request("y", PROMPTS[1], SamplingParams(max_tokens=4), lora_request=adapters["b"])
    engine.step()
    stats = engine.get_stats()
    assert stats["lora_running"] == ["a"] and stats["lora_waiting"] == ["b"] and stats["max_loras"] == 1
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.get_stats()["lora_loads"] == 2
    assert "lora_running" not in LLM.from_model(copy.deepcopy(base), device="cpu", num_blocks=16).get_stats()


@pytest.mark.usefixtures("fused_lora")
@pytest.mark.parametrize("use_triton", [None, TRITON_PARAM], ids=["torch", "triton"])
def test_graph_padding_rows_read_stale_slots_without_changing_real_rows(base, adapters, tiny_qwen2_config, use_triton):
    """The decode graphs' bookkeeping on the CPU (``capture=False``: static buffers and padding, run eagerly):
    a batch of 3 runs in the bucket of 4, whose 4th row reads whatever slot an earlier step left there (the
    Triton ops: the fused layer path, whose shrink kernel reads the slots buffer itself)."""
    llm = LLM.from_model(copy.deepcopy(base), device="cpu", num_blocks=64, enable_lora=True, max_loras=2,
                         async_scheduling=False, use_triton=use_triton)
    llm.engine.runner.enable_graphs(capture=False)
    loras = [adapters["b"], adapters["a"], None]
    outs = llm.generate(PROMPTS, SCORE, use_tqdm=False, lora_request=loras)
    assert llm.engine.runner.graphs is not None
    assert_like_reference(outs, loras, base, tiny_qwen2_config)


# ----------------------------------------------------------------------------- the server
@pytest.fixture(scope="module")
def smollm2_copy(smollm2):
    """Its own copy of the real model: a LoRA engine puts its slots on the model it serves."""
    from types import SimpleNamespace

    return SimpleNamespace(model=copy.deepcopy(smollm2.model), config=smollm2.config, tokenizer=smollm2.tokenizer,
                           source="copy")


@pytest.fixture(scope="module")
def smollm2_adapters(tmp_path_factory, smollm2):
    root = tmp_path_factory.mktemp("lora_smollm2")
    return {name: write_peft_adapter(root / name, smollm2.config, rank=8, alpha=16, seed=seed, std=0.2)
            for name, seed in (("terse", 5), ("verbose", 6))}


@pytest.fixture(scope="module")
def lora_server(start_server, smollm2_copy, smollm2_adapters):
    srv = start_server(loaded=smollm2_copy, enable_lora=True, max_loras=2,
                       lora_modules=[("terse", str(smollm2_adapters["terse"]))])
    yield srv
    srv.stop()


def completion(server, model, prompt="The capital of France is", max_tokens=8):
    import httpx

    r = httpx.post(server.base_url + "/completions", timeout=120,
                   json={"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    return r


def test_the_server_lists_its_adapters_and_runs_a_request_as_the_merged_model(lora_server, smollm2, smollm2_adapters):
    import httpx

    data = httpx.get(lora_server.base_url + "/models").json()["data"]
    assert [m["id"] for m in data] == ["smollm2-135m-instruct", "terse"]
    assert data[1]["parent"] == "smollm2-135m-instruct" and data[1]["root"] == str(smollm2_adapters["terse"])
    got = completion(lora_server, "terse").json()
    base = completion(lora_server, "smollm2-135m-instruct").json()
    assert got["model"] == "terse"
    adapter = LoRAAdapter.load(smollm2_adapters["terse"], smollm2.config, 16)
    ref = LLM.from_model(merged_model(smollm2.model, adapter), tokenizer=smollm2.tokenizer, device="cpu",
                         num_blocks=64)
    want = ref.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    assert got["choices"][0]["text"] == want[0].outputs[0].text
    assert got["choices"][0]["text"] != base["choices"][0]["text"]
    assert adapter.rank == 8
    r = completion(lora_server, "nope")
    assert r.status_code == 404 and "terse" in r.json()["error"]["message"]


def test_adapters_are_loaded_and_unloaded_while_serving(lora_server, smollm2_adapters, tmp_path):
    import httpx

    url = lora_server.url + "/v1"
    r = httpx.post(url + "/load_lora_adapter", json={"lora_name": "verbose", "lora_path": str(smollm2_adapters["verbose"])})
    assert r.status_code == 200 and "added" in r.text
    assert completion(lora_server, "verbose").status_code == 200
    assert "verbose" in [m["id"] for m in httpx.get(url + "/models").json()["data"]]
    for body, status, why in [
        ({"lora_name": "verbose", "lora_path": str(smollm2_adapters["verbose"])}, 400, "already served"),
        ({"lora_name": "smollm2-135m-instruct", "lora_path": str(smollm2_adapters["verbose"])}, 400, "already served"),
        ({"lora_name": "ghost", "lora_path": str(tmp_path / "none")}, 400, "no such folder"),
    ]:
        r = httpx.post(url + "/load_lora_adapter", json=body)
        assert r.status_code == status and why in r.json()["error"]["message"], r.text
    metrics = httpx.get(lora_server.url + "/metrics").text
    assert 'pageserve_lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""}' in metrics
    assert "pageserve_lora_slot_loads_total" in metrics
    r = httpx.post(url + "/unload_lora_adapter", json={"lora_name": "verbose"})
    assert r.status_code == 200 and "removed" in r.text
    assert completion(lora_server, "verbose").status_code == 404
    assert httpx.post(url + "/unload_lora_adapter", json={"lora_name": "verbose"}).status_code == 404
    assert completion(lora_server, "terse").status_code == 200  # the other one still serves


def test_a_server_without_lora_refuses_to_load_one(start_server, smollm2_adapters):
    import httpx

    srv = start_server()
    try:
        r = httpx.post(srv.url + "/v1/load_lora_adapter",
                       json={"lora_name": "terse", "lora_path": str(smollm2_adapters["terse"])})
        assert r.status_code == 400 and "--enable-lora" in r.json()["error"]["message"]
    finally:
        srv.stop()


def test_the_serve_command_takes_lora_modules_in_both_forms_and_a_bad_one_exits_with_its_reason(tmp_path, capsys):
    import argparse

    from pageserve.cli import main
    from pageserve.serve.cli import add_serve_parser

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--lora-modules", "a=/x/a", '{"name": "b", "path": "/x/b"}', "--max-loras", "2"])
    assert args.lora_modules == [("a", "/x/a"), ("b", "/x/b")] and args.max_loras == 2
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--lora-modules", "no-path"])
    assert main(["serve", "--device", "cpu", "--num-blocks", "16", "--lora-modules", f"ghost={tmp_path / 'none'}"]) == 2
    assert "no such folder" in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("fused", [False, True], ids=["reference_products", "fused_kernel"])
@pytest.mark.parametrize("dtype, atol", [("float32", 2e-3), ("bfloat16", None)])
def test_on_the_gpu_graphed_mixed_batches_apply_each_rows_adapter(base, adapters, tiny_qwen2_config, dtype, atol,
                                                                   fused, request):
    """The CUDA path as served: Triton kernels, decode and mixed-step graphs captured with the slots in them, async
    scheduling. fp32: every row within rounding of its merged reference. bf16 (no tight bound at this size): each
    adapter row nearer its own merged reference than the base model is."""
    kw = dict(device="cuda", num_blocks=128)
    dt = getattr(torch, dtype)

    def on_gpu(model):
        return model.to("cuda", dt)

    if fused:
        request.getfixturevalue("fused_lora")
    llm = LLM.from_model(on_gpu(copy.deepcopy(base)), enable_lora=True, max_loras=2, **kw)
    assert llm.engine.runner.graphs is not None and llm.engine.runner.ops.name == "triton"
    assert any(layer.lora.fused_for(llm.engine.runner.ops) for layer in llm.engine.runner.model.layers) == fused
    loras = [adapters["a"], None, adapters["b"]]
    outs = llm.generate(PROMPTS, SCORE, use_tqdm=False, lora_request=loras)
    for out, lora in zip(outs, loras):
        ref = LLM.from_model(on_gpu(reference(base, lora, tiny_qwen2_config)), **kw).generate(
            [out.prompt_token_ids], SCORE, use_tqdm=False)[0]
        got, want = scores(out)[0], scores(ref)[0]
        if atol is not None:
            assert got == pytest.approx(want, abs=atol), lora
        elif lora is not None:
            plain = LLM.from_model(on_gpu(copy.deepcopy(base)), **kw).generate([out.prompt_token_ids], SCORE,
                                                                                use_tqdm=False)[0]
            off_ref = max(abs(x - y) for x, y in zip(got, want))
            off_base = max(abs(x - y) for x, y in zip(got, scores(plain)[0]))
            assert off_ref < off_base / 4, (lora, off_ref, off_base)


def test_generate_with_lora_uses_the_adapter_and_a_bad_one_is_one_line(tmp_path, smollm2, capsys):
    from pageserve.cli import main

    folder = write_peft_adapter(tmp_path / "cli", smollm2.config, rank=4, alpha=8, seed=7, std=0.3)
    argv = ["generate", "What is the capital of France?", "--max-tokens", "8", "--device", "cpu"]
    assert main(argv) == 0
    plain = capsys.readouterr().out
    assert main(argv + ["--lora", str(folder)]) == 0
    adapted = capsys.readouterr().out
    ref = LLM.from_model(merged_model(smollm2.model, LoRAAdapter.load(folder, smollm2.config, 4)),
                         tokenizer=smollm2.tokenizer, device="cpu", num_blocks=64, generation_config="none")
    want = ref.chat([{"role": "user", "content": "What is the capital of France?"}],
                    SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)[0].outputs[0].text
    assert adapted.strip() == want.strip() and adapted != plain
    assert main(argv + ["--lora", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert "no such folder" in err and "Traceback" not in err


@pytest.mark.usefixtures("fused_lora")
@pytest.mark.parametrize("use_triton", [None, TRITON_PARAM], ids=["torch", "triton"])
def test_adapters_run_over_int8_weights_and_rows_without_one_are_the_int8_models(base, adapters, use_triton):
    """The adapter's product is added to whatever the base projection is, int8 weights included (vLLM serves LoRA
    over quantized models too): rows with no adapter are the int8 model's, rows with one differ from them (the
    Triton ops: the fused layer path over the int8 kernels)."""
    q = dict(device="cpu", num_blocks=64, quantization="int8", use_triton=use_triton)
    plain = LLM.from_model(copy.deepcopy(base), **q).generate(PROMPTS, SCORE, use_tqdm=False)
    llm = LLM.from_model(copy.deepcopy(base), enable_lora=True, **q)
    outs = llm.generate(PROMPTS, SCORE, use_tqdm=False, lora_request=[adapters["a"], None, None])
    assert scores(outs[1])[0] == pytest.approx(scores(plain[1])[0], abs=2e-5)
    assert max(abs(x - y) for x, y in zip(scores(outs[0])[0], scores(plain[0])[0])) > 1e-2
