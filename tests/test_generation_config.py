"""The model's generation_config.json sampling defaults (``EngineConfig.generation_config``), as
vLLM's ``--generation-config`` applies them: a request's unset fields take them, set ones keep
their own; "none" ignores the file; a folder path reads that folder (and caps max_tokens)."""
from __future__ import annotations

import json
import logging

import httpx
import pytest
import torch

from pageserve.engine.config import EngineConfig
from pageserve.engine.llm import LLM
from pageserve.engine.llm_engine import LLMEngine
from pageserve.engine.sampling_params import SamplingParams
from pageserve.model.loader import load_model
from pageserve.serve.api import build_app
from pageserve.serve.background import start_server_in_background
from pageserve.serve.bench_client import run_load_sync

# Qwen2.5-3B-Instruct's file, plus a max_new_tokens
FILE_DEFAULTS = dict(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05, max_new_tokens=12)
EXPECTED = dict(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05, max_tokens=12)
ENGINE = dict(device="cpu", dtype="float32", num_blocks=64, max_model_len=256)
HI = [{"role": "user", "content": "Say hi"}]


def sampling(p: SamplingParams) -> dict:
    return {k: getattr(p, k) for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens")}


PAGESERVE_OWN = sampling(SamplingParams(max_tokens=None))  # temperature 1, no truncation, no penalty


def save_checkpoint(folder, tokenizer, **generation):
    """A 2-layer random Qwen2 saved by transformers (config, safetensors, generation_config.json)
    with ``tokenizer`` beside it."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    model = transformers.Qwen2ForCausalLM(cfg)
    model.generation_config = transformers.GenerationConfig(bos_token_id=1, eos_token_id=2, do_sample=True, **generation)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smollm2):
    folder = save_checkpoint(tmp_path_factory.mktemp("qwen_like"), smollm2.tokenizer.hf, **FILE_DEFAULTS)
    assert json.loads((folder / "generation_config.json").read_text())["top_k"] == 20  # what transformers wrote
    return folder


@pytest.fixture(scope="module")
def serve():
    """Start a server over a new engine (``EngineConfig`` keywords); returns it and the list of
    ``SamplingParams`` the engine receives, one per ``add_request``."""
    servers = []

    def start(**config):
        engine = LLMEngine(EngineConfig(**(ENGINE | config)), stream_outputs=True)
        seen = []
        add = engine.add_request

        def recording(request_id, prompt, params=None, arrival_time=None, **kw):
            seen.append(params)
            return add(request_id, prompt, params, arrival_time, **kw)

        engine.add_request = recording
        servers.append(start_server_in_background(build_app(engine), host="127.0.0.1", port=0))
        return servers[-1], seen

    yield start
    for server in servers:
        server.stop()


@pytest.fixture(scope="module")
def auto_server(serve, model_dir):
    return serve(model=str(model_dir))


def post(server, path, body) -> dict:
    r = httpx.post(server.base_url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


# ------------------------------------------------------------------------ the server
def test_chat_request_without_sampling_fields_gets_the_files_defaults(auto_server):
    server, seen = auto_server
    seen.clear()
    reply = post(server, "/chat/completions", {"messages": HI})
    assert sampling(seen[0]) == EXPECTED | {"min_p": 0.0}  # the file has no min_p: pageserve's own
    assert reply["usage"]["completion_tokens"] <= 12


def test_chat_request_that_sets_the_fields_keeps_its_own(auto_server):
    server, seen = auto_server
    seen.clear()
    own = dict(temperature=0.0, top_p=1.0, top_k=5, min_p=0.1, repetition_penalty=1.0)
    post(server, "/chat/completions", {"messages": HI, **own, "max_completion_tokens": 30})
    post(server, "/chat/completions", {"messages": HI, "temperature": 1.3, "max_tokens": 3})
    assert sampling(seen[0]) == own | {"max_tokens": 30}
    assert sampling(seen[1]) == EXPECTED | {"temperature": 1.3, "max_tokens": 3, "min_p": 0.0}


def test_completions_keep_openai_max_tokens_16_over_max_new_tokens(auto_server):
    # vLLM's CompletionRequest has max_tokens=16 as its field default, so the file's max_new_tokens
    # never reaches /v1/completions unless the request sends max_tokens: null
    server, seen = auto_server
    seen.clear()
    post(server, "/completions", {"prompt": [5, 6, 7]})
    post(server, "/completions", {"prompt": [5, 6, 7], "max_tokens": None})
    assert sampling(seen[0]) == EXPECTED | {"max_tokens": 16, "min_p": 0.0}
    assert seen[1].max_tokens == 12


def test_bench_client_runs_plain_greedy_whatever_the_files_defaults(auto_server):
    server, seen = auto_server
    seen.clear()
    load = run_load_sync(server.base_url, [[5, 6, 7]], max_tokens=4)
    assert load.results[0].ok
    assert sampling(seen[0]) == dict(temperature=0.0, top_p=1.0, top_k=-1, min_p=0.0, repetition_penalty=1.0,
                                     max_tokens=4)


@pytest.mark.parametrize("choice", ["none", "vllm"])
def test_generation_config_none_ignores_the_file(serve, model_dir, choice):
    server, seen = serve(model=str(model_dir), generation_config=choice)
    post(server, "/chat/completions", {"messages": HI, "max_tokens": 2})
    assert sampling(seen[0]) == PAGESERVE_OWN | {"max_tokens": 2}


def test_generation_config_folder_is_read_and_its_max_new_tokens_caps_every_request(serve, model_dir, tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.3, "min_p": 0.05,
                                                                 "max_new_tokens": 5, "do_sample": False}))
    server, seen = serve(model=str(model_dir), generation_config=str(tmp_path))
    post(server, "/chat/completions", {"messages": HI})
    post(server, "/chat/completions", {"messages": HI, "max_tokens": 50, "temperature": 0.9})
    # the folder replaces the model's own file: its top_k / top_p / repetition_penalty are not used
    assert sampling(seen[0]) == PAGESERVE_OWN | dict(temperature=0.3, min_p=0.05, max_tokens=5)
    assert (seen[1].temperature, seen[1].max_tokens) == (0.9, 5)  # vLLM: a folder's max_new_tokens is a limit


# ------------------------------------------------------------------------ the offline API
def test_llm_generate_without_params_uses_the_files_defaults_and_explicit_params_win(model_dir, monkeypatch):
    llm = LLM(str(model_dir), **ENGINE)
    seen = []
    add = llm.engine.add_request
    monkeypatch.setattr(llm.engine, "add_request", lambda rid, prompt, p=None, **kw: (seen.append(p), add(rid, prompt, p, **kw)))
    out = llm.generate([5, 6, 7], use_tqdm=False)
    llm.chat(HI, use_tqdm=False)
    llm.generate([5, 6, 7], SamplingParams(max_tokens=3), use_tqdm=False)
    assert sampling(seen[0]) == sampling(seen[1]) == EXPECTED | {"min_p": 0.0}
    assert len(out[0].outputs[0].token_ids) <= 12
    assert sampling(seen[2]) == PAGESERVE_OWN | {"max_tokens": 3}  # a SamplingParams is taken as given


def test_start_up_logs_one_line_naming_the_defaults_and_none_without_them(model_dir, caplog):
    with caplog.at_level(logging.INFO, logger="pageserve.engine.llm_engine"):
        LLMEngine(EngineConfig(model=str(model_dir), **ENGINE))
    lines = [r.getMessage() for r in caplog.records if "generation_config.json" in r.getMessage()]
    assert len(lines) == 1
    assert all(f"{k}={v}" in lines[0] for k, v in EXPECTED.items()), lines[0]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pageserve.engine.llm_engine"):
        LLMEngine(EngineConfig(model=str(model_dir), generation_config="none", **ENGINE))
    assert not [r for r in caplog.records if "generation_config" in r.getMessage()]


# ------------------------------------------------------------------------ models with none, bad values
def test_gguf_default_and_random_weight_models_have_no_defaults(smollm2, model_dir, tmp_path):
    from test_loading import tiny_hf_model, write_gguf

    gguf = tmp_path / "model.gguf"
    write_gguf(gguf, tiny_hf_model("llama"))
    (tmp_path / "generation_config.json").write_text(json.dumps(FILE_DEFAULTS))  # beside it, never read
    assert load_model(str(gguf), device="cpu", dtype="float32").sampling_defaults == {}
    assert smollm2.sampling_defaults == {}  # the default model (a GGUF converted to a folder)
    # random weights of a config.json whose folder holds the sampling fields: not read either
    assert load_model(f"dummy:{model_dir / 'config.json'}", device="cpu").sampling_defaults == {}
    engine = LLMEngine.from_model(smollm2.model, EngineConfig(**ENGINE), smollm2.tokenizer)
    assert (engine.sampling_defaults, engine.max_tokens_limit) == ({}, None)


@pytest.mark.parametrize("value,why", [
    ("/no/such/folder", r"'auto', 'none' \(alias 'vllm'\) or a folder.*/no/such/folder/generation_config\.json"),
    ("Auto", r"'auto', 'none' \(alias 'vllm'\) or a folder.*'Auto'"),
    (None, r"'auto', 'none' \(alias 'vllm'\) or a folder.*None"),
])
def test_bad_generation_config_value_is_a_clear_error(value, why):
    with pytest.raises(ValueError, match=why):
        EngineConfig(generation_config=value)


def test_a_value_sampling_params_refuses_names_the_file(smollm2, tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 0.0}))
    with pytest.raises(ValueError, match=r"generation_config\.json: SamplingParams\.top_p must be in \(0, 1\]"):
        LLMEngine.from_model(smollm2.model, EngineConfig(generation_config=str(tmp_path), **ENGINE))


def test_serve_flag_exists_and_the_generate_cli_keeps_its_own_greedy_defaults(model_dir):
    import argparse

    from pageserve.cli import _build_engine, build_parser
    from pageserve.serve.cli import add_serve_parser, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--generation-config", "none", "--device", "cpu"])
    assert engine_config_from_args(args).generation_config == "none"
    engine = _build_engine(build_parser().parse_args(["generate", "hi", "--model", str(model_dir), "--device", "cpu"]))
    assert engine.sampling_defaults == {}  # every sampling flag has a default of its own
