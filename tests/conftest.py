"""Shared fixtures. Keep this small: fixtures that several test files reuse."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct (real weights, from the default model's GGUF) in fp32 on the
    CPU, as a ``pageserve.loader.LoadedModel`` (model, config, tokenizer, source)."""
    from pageserve.loader import load_model

    return load_model("smollm2-135m-instruct", device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def smollm2_hf(smollm2):
    """The transformers LlamaForCausalLM twin of ``smollm2`` (same weights, fp32, CPU)."""
    from pageserve.hf_reference import build_hf_model

    return build_hf_model(smollm2.model)
