"""The README's first command, ``pageserve generate "…"``: a streamed reply from the engine,
and for every bad input one line on stderr and exit status 2 — never a traceback."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pageserve.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_generate_streams_a_reply_from_the_engine_and_its_stats(capsys):
    assert main(["generate", "What is the capital of France?", "--max-tokens", "8", "--device", "cpu"]) == 0
    captured = capsys.readouterr()
    assert "Paris" in captured.out  # SmolLM2-135M-Instruct answers this one greedily
    stats = captured.err.strip().splitlines()[-1]
    assert "new tokens (stop)" in stats and "tok/s" in stats and "nan" not in stats  # the engine's finish reason


def test_generate_with_speculative_tokens_gives_the_same_reply_and_reports_its_drafts(capsys):
    prompt = "Repeat exactly: the cat sat on the mat, the cat sat on the mat."
    assert main(["generate", prompt, "--max-tokens", "24", "--device", "cpu"]) == 0
    plain = capsys.readouterr().out
    assert main(["generate", prompt, "--max-tokens", "24", "--device", "cpu", "--speculative-tokens", "3"]) == 0
    captured = capsys.readouterr()
    assert captured.out == plain
    assert re.search(r"drafts [1-9]\d*/\d+ accepted", captured.err.strip().splitlines()[-1])


def test_generate_sampling_flags_reach_the_engine(capsys):
    # --stop ends the reply before the stop text; the same --seed gives the same sampled text
    assert main(["generate", "What is the capital of France?", "--device", "cpu", "--stop", "Paris"]) == 0
    out = capsys.readouterr().out
    assert "France" in out and "Paris" not in out
    sampled = ["generate", "Write a word.", "--device", "cpu", "--max-tokens", "6", "--temperature", "1.5",
               "--top-k", "50", "--top-p", "0.95", "--min-p", "0.01", "--repetition-penalty", "1.1", "--seed", "7"]
    texts = []
    for _ in range(2):
        assert main(sampled) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and texts[0].strip()


BAD_INPUTS = {
    "prompt longer than the context": (["generate", "word " * 9000, "--device", "cpu"], "max_model_len"),
    "--max-tokens 0": (["generate", "hi", "--max-tokens", "0"], "--max-tokens"),
    "--max-tokens -5": (["generate", "hi", "--max-tokens", "-5"], "--max-tokens"),
    "bad --top-p": (["generate", "hi", "--top-p", "2"], "--top-p"),
    "unknown model": (["generate", "hi", "--model", "no-such-model-anywhere", "--device", "cpu"], "no-such-model-anywhere"),
    "bad dtype": (["generate", "hi", "--dtype", "float8", "--device", "cpu"], "float8"),
    "missing file": (["generate", "hi", "--model", "/nonexistent/dir/model.gguf", "--device", "cpu"], "model.gguf"),
    "hub id with no network": (["generate", "hi", "--model", "someorg/some-model", "--device", "cpu"], "someorg/some-model"),
    "cuda without CUDA": (["generate", "hi", "--device", "cuda" if not torch.cuda.is_available() else "cuda:99"], "cuda"),
    "unknown device": (["generate", "hi", "--device", "gpu"], "gpu"),
    "deterministic with int8": (["generate", "hi", "--device", "cpu", "--deterministic", "--quantization", "int8"],
                                "deterministic"),
}


def test_every_bad_input_is_one_line_on_stderr_and_exit_status_2():
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    procs = {
        name: subprocess.Popen([sys.executable, "-m", "pageserve.cli", *argv], cwd=ROOT, env=env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for name, (argv, _) in BAD_INPUTS.items()
    }
    failures = []
    for name, p in procs.items():
        out, err = p.communicate(timeout=300)
        lines = err.strip().splitlines()
        want = BAD_INPUTS[name][1]
        if p.returncode != 2 or len(lines) != 1 or "Traceback" in err or want not in lines[0] or "error" not in lines[0]:
            failures.append(f"{name}: rc={p.returncode}, stderr={err!r}")
    assert not failures, "\n".join(failures)


def test_version_flag():
    r = subprocess.run([sys.executable, "-m", "pageserve.cli", "--version"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.startswith("pageserve ")


# ----------------------------------------------------------------------------- the library says the same

def test_library_raises_clear_value_errors():
    from pageserve.engine.config import EngineConfig
    from pageserve.engine.llm import LLM
    from pageserve.model.loader import ModelLoadError, load_model

    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"'cuda'.*device cpu"):
            LLM("dummy:smollm2-135m", device="cuda")
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        EngineConfig(dtype="float8")
    with pytest.raises(ModelLoadError, match="unknown model 'no-such-model'"):
        load_model("no-such-model", device="cpu")
    assert issubclass(ModelLoadError, ValueError)


def test_generate_none_is_a_value_error(tiny_qwen2_config):
    from pageserve.engine.llm import LLM
    from pageserve.model.decoder import Decoder

    model = Decoder(tiny_qwen2_config)
    model.init_dummy_weights(seed=0)
    llm = LLM.from_model(model.eval(), device="cpu", dtype="float32", num_blocks=16, max_model_len=64)
    with pytest.raises(ValueError, match="prompts must be"):
        llm.generate(None)
    with pytest.raises(ValueError, match="prompt must be a string or a list of token ids"):
        llm.generate([None])
    assert llm.engine.num_unfinished_requests == 0  # a rejected batch leaves nothing behind


def test_generate_takes_vllm_prompt_dicts_and_refuses_other_keys(tiny_qwen2_config):
    from pageserve import BeamSearchParams, SamplingParams
    from pageserve.engine.llm import LLM
    from pageserve.model.decoder import Decoder

    model = Decoder(tiny_qwen2_config)
    model.init_dummy_weights(seed=0)
    llm = LLM.from_model(model.eval(), device="cpu", dtype="float32", num_blocks=16, max_model_len=64)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    ids = [3, 1, 4, 1, 5]
    want = llm.generate([ids], greedy)[0].outputs[0].token_ids
    assert llm.generate({"prompt_token_ids": ids}, greedy)[0].outputs[0].token_ids == want
    assert [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": ids}, ids], greedy)] == [want, want]
    beams = BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True)
    assert [c.token_ids for c in llm.beam_search({"prompt_token_ids": ids}, beams)[0].outputs] == \
        [c.token_ids for c in llm.beam_search([ids], beams)[0].outputs]
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate({"prompt_token_ids": ids, "multi_modal_data": {}}, greedy)
    assert llm.engine.num_unfinished_requests == 0
