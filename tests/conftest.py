"""Shared fixtures. Keep this small: fixtures that several test files reuse."""
from __future__ import annotations

import os

import pytest
import torch

# Without a GPU the Triton kernels run on Triton's CPU interpreter. The flag is read when a
# kernel is decorated, so it is set here, before any test module imports triton
# (pageserve.kernels itself changes no process-wide state).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct (real weights, from the default model's GGUF) in fp32 on the
    CPU, as a ``pageserve.model.loader.LoadedModel`` (model, config, tokenizer, source).
    ``$PAGESERVE_TEST_MODEL``: a local copy of that GGUF (the GPU machine has no package index
    to fetch it from; scripts/h200_run.sh points it at the carried one)."""
    from pageserve.model.loader import load_model

    return load_model(os.environ.get("PAGESERVE_TEST_MODEL") or "smollm2-135m-instruct", device="cpu",
                      dtype="float32")


@pytest.fixture(scope="module")
def one_torch_thread():
    """The CPU reference path runs many tiny ops per sequence and layer; on a 2-core machine
    shared with other work, two intra-op threads spin against each other and run ~10x
    slower than one. A module that wants it: ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``
    (restored after that module)."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


@pytest.fixture(scope="session")
def smollm2_hf(smollm2):
    """The transformers LlamaForCausalLM twin of ``smollm2`` (same weights, fp32, CPU)."""
    from pageserve.lab.hf_reference import build_hf_model

    return build_hf_model(smollm2.model)


@pytest.fixture(scope="session")
def tiny_qwen2_config():
    """A 2-layer random-weight Qwen2 shape (q/k/v bias, GQA 2) for fast engine tests."""
    from pageserve.model.config import ModelConfig

    return ModelConfig(
        architecture="qwen2", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512, attention_bias=True,
        eos_token_ids=[0],
    )



@pytest.fixture(scope="session")
def start_server(smollm2):
    """Start a live server on a free 127.0.0.1 port over ``smollm2`` (a new engine and app per
    call; keywords: ``api_key``, ``max_waiting_requests``, ``max_request_bytes``, ``chat_template``,
    ``enable_tokenizer_info``, ``enable_auto_tool_choice``, ``tool_call_parser``, ``allowed_origins``, ``reasoning_parser``, ``lora_modules``,
    ``loaded`` (another model than ``smollm2``), ``EngineConfig`` fields). Every server still running stops at the end of the session."""
    from pageserve.serve.api import build_app
    from pageserve.serve.background import build_engine, start_server_in_background

    servers = []

    def start(api_key=None, max_waiting_requests=None, max_request_bytes=None, chat_template=None,
              enable_tokenizer_info=False, enable_auto_tool_choice=False, tool_call_parser=None, allowed_origins=None,
              reasoning_parser=None, lora_modules=None, loaded=None, **config):
        cfg = dict(model="smollm2-135m-instruct", device="cpu", dtype="float32", num_blocks=256, max_model_len=1024)
        engine = build_engine(loaded or smollm2, **(cfg | config))
        app = build_app(engine, api_key=api_key, max_waiting_requests=max_waiting_requests,
                        max_request_bytes=max_request_bytes, chat_template=chat_template,
                        enable_tokenizer_info=enable_tokenizer_info,
                        enable_auto_tool_choice=enable_auto_tool_choice, tool_call_parser=tool_call_parser,
                        allowed_origins=allowed_origins, reasoning_parser=reasoning_parser, lora_modules=lora_modules)
        server = start_server_in_background(app, host="127.0.0.1", port=0, api_key=api_key)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()
