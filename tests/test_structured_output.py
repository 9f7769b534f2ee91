"""Structured outputs: the params' checks, and the engine over SmolLM2's real weights keeping its
output to a JSON schema, a regex, a choice and a grammar, without touching the requests beside it.
(The sampler's masks: tests/test_sampler.py.)"""
import json
import os
import re

import pytest
import torch

pytest.importorskip("llguidance")

from pageserve.engine.llm import LLM  # noqa: E402
from pageserve.engine.sampler import Sampler  # noqa: E402
from pageserve.engine.sampling_params import SamplingParams  # noqa: E402
from pageserve.engine.structured_output import (GrammarCompiler, StructuredOutputsParams,  # noqa: E402
                                                is_byte_level_vocab, llguidance_tokenizer_json)


def test_structured_outputs_params_are_checked():
    assert StructuredOutputsParams.of({"json": '{"type": "object"}'}).json == {"type": "object"}
    for bad, why in (({}, "exactly one"), ({"regex": "a", "choice": ["a"]}, "exactly one"),
                     ({"json": "{"}, "not valid JSON"), ({"choice": []}, "non-empty list"), ({"choice": [1]}, "choice"),
                     ({"pattern": "a"}, "unknown keys"), ({"json": [1]}, "must be an object")):
        with pytest.raises(ValueError, match=why):
            StructuredOutputsParams.of(bad)
    with pytest.raises(ValueError, match="structured outputs"):
        SamplingParams(structured_outputs="json")


@pytest.fixture(scope="module")
def llm(smollm2):
    return LLM("smollm2-135m-instruct", loaded=smollm2, device="cpu", dtype="float32", num_blocks=256)


def chat(llm, text: str) -> str:
    return llm.tokenizer.hf.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                               add_generation_prompt=True)


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}


def test_engine_output_matches_each_kind_of_constraint(llm):
    prompt = chat(llm, "Describe a cat named Tom, 3 years old, as JSON.")
    cases = [
        ({"json": PERSON}, lambda t: set(json.loads(t)) == {"name", "age"} and isinstance(json.loads(t)["age"], int)),
        ({"regex": r"[0-9]{3}-[0-9]{4}"}, lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t)),
        ({"choice": ["yes", "no", "maybe"]}, lambda t: t in ("yes", "no", "maybe")),
        ({"grammar": 'start: "a" "b"+ "c"'}, lambda t: re.fullmatch("ab+c", t)),
        ({"grammar": 'root ::= "x" [0-9] [0-9]'}, lambda t: re.fullmatch("x[0-9]{2}", t)),  # GBNF
    ]
    params = [SamplingParams(temperature=t, seed=3, max_tokens=40, structured_outputs=so)
              for so, _ in cases for t in (0, 1.0)]
    outs = llm.generate([prompt] * len(params), params, use_tqdm=False)
    for i, out in enumerate(outs):
        so, ok = cases[i // 2]
        c = out.outputs[0]
        assert c.finish_reason == "stop" and ok(c.text), (so, c.text, c.finish_reason)
        # the grammar's end finishes the sequence at once: no eos step after it
        assert llm.tokenizer.hf.decode(c.token_ids) == c.text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the engine on CUDA: the Triton mask kernel, pinned words")
def test_on_the_gpu_guided_penalised_and_plain_rows_share_steps_and_keep_their_constraints():
    # the default model's real weights in bf16 on CUDA (PAGESERVE_TEST_MODEL: the carried GGUF), async scheduling:
    # each kind of constraint, penalised rows beside them (no landing before their sampling), a plain row; the
    # masks' words filled into pinned memory and applied by kernels/token_bitmask.py
    import os

    from pageserve.model.loader import load_model

    loaded = load_model(os.environ.get("PAGESERVE_TEST_MODEL") or "smollm2-135m-instruct", device="cuda",
                        dtype="bfloat16")
    gpu = LLM("smollm2-135m-instruct", loaded=loaded, device="cuda", dtype="bfloat16", num_blocks=512)
    prompt = chat(gpu, "Describe a cat named Tom, 3 years old, as JSON.")
    cases = [({"json": PERSON}, lambda t: set(json.loads(t)) == {"name", "age"}),
             ({"regex": r"[0-9]{3}-[0-9]{4}"}, lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t)),
             ({"choice": ["yes", "no", "maybe"]}, lambda t: t in ("yes", "no", "maybe")),
             ({"grammar": 'start: "a" "b"+ "c"'}, lambda t: re.fullmatch("ab+c", t))]
    params = [SamplingParams(temperature=t, seed=5, max_tokens=40, structured_outputs=so) for so, _ in cases
              for t in (0, 1.0)]
    params += [SamplingParams(temperature=0, max_tokens=40, repetition_penalty=1.3, frequency_penalty=0.5),
               SamplingParams(temperature=0.8, seed=2, max_tokens=40, presence_penalty=1.0),
               SamplingParams(temperature=0, max_tokens=40)]
    outs = gpu.generate([prompt] * len(params), params, use_tqdm=False)
    assert gpu.engine.grammar.pin_masks
    for i, (so, ok) in enumerate(cases):
        for c in (outs[2 * i].outputs[0], outs[2 * i + 1].outputs[0]):
            assert c.finish_reason == "stop" and ok(c.text), (so, c.text)
    assert all(len(o.outputs[0].token_ids) > 0 for o in outs[len(cases) * 2:])
    # penalised rows alone, every request the same length: async and sync run the same batches, so the same
    # kernels, and the newest token read from the device must count as the landed one does
    pen = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.5, frequency_penalty=f)
           for f in (0.0, 0.7, 1.4)]
    prompts = [chat(gpu, q) for q in ("Count to ten.", "Name a colour.", "Say hello.")]
    sync = LLM("smollm2-135m-instruct", loaded=loaded, device="cuda", dtype="bfloat16", num_blocks=512,
               async_scheduling=False)
    want = [o.outputs[0].token_ids for o in sync.generate(prompts, pen, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in gpu.generate(prompts, pen, use_tqdm=False)] == want


def test_json_object_is_an_object_and_guided_requests_leave_their_neighbours_alone(llm):
    prompts = [chat(llm, "List three colours."), chat(llm, "Say hello."), chat(llm, 'Give me a JSON object with a key "colour" set to "red".')]
    free = [SamplingParams(temperature=0, max_tokens=12), SamplingParams(temperature=0.8, seed=4, max_tokens=12)]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts[:2], free, use_tqdm=False)]
    guided = SamplingParams(temperature=0, max_tokens=40, structured_outputs={"json_object": True})
    outs = llm.generate(prompts, free + [guided], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[:2]] == alone
    text = outs[2].outputs[0].text
    assert json.loads(text) == {"colour": "red"} and outs[2].outputs[0].finish_reason == "stop", text


def test_n_samples_each_follow_the_constraint_and_async_matches_sync(smollm2, llm):
    prompt = chat(llm, "Pick a number.")
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=10, structured_outputs={"regex": "[1-9][0-9]?"})
    got = [c.text for c in llm.generate([prompt], params, use_tqdm=False)[0].outputs]
    assert all(re.fullmatch("[1-9][0-9]?", t) for t in got), got
    sync = LLM("smollm2-135m-instruct", loaded=smollm2, device="cpu", dtype="float32", num_blocks=256,
               async_scheduling=False)
    assert [c.text for c in sync.generate([prompt], params, use_tqdm=False)[0].outputs] == got


def test_a_constraint_that_does_not_compile_is_refused_before_anything_is_queued(llm):
    engine = llm.engine
    with pytest.raises(ValueError, match="does not compile"):
        engine.add_request("bad", "hi", SamplingParams(structured_outputs={"regex": "("}))
    assert not engine.has_unfinished_requests() and "bad" not in engine.requests
    out = llm.generate(["hi"], SamplingParams(max_tokens=3, structured_outputs={"choice": ["ok"]}), use_tqdm=False)
    assert out[0].outputs[0].text == "ok"


def test_a_token_the_grammar_rejects_fails_that_request_alone(llm, monkeypatch):
    """If a token outside the grammar ever lands (here: the sampler made to drop the masks), that
    request finishes with "error" and the one beside it is untouched."""
    prompts = [chat(llm, "Say hello."), chat(llm, "Say hello.")]
    free = SamplingParams(temperature=0, max_tokens=6)
    alone = llm.generate(prompts[:1], free, use_tqdm=False)[0].outputs[0].token_ids
    real = Sampler.sample
    monkeypatch.setattr(Sampler, "sample", lambda self, *a: real(self, *a[:6]))
    guided = SamplingParams(temperature=0, max_tokens=6, structured_outputs={"choice": ["zzzz"]})
    outs = llm.generate(prompts, [free, guided], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == alone and outs[0].outputs[0].finish_reason == "length"
    assert outs[1].outputs[0].finish_reason == "error"


# texts whose tokens hold GPT-2's "Ġ" (a space) and "Ċ" (a newline), and a constraint each satisfies
SPACED = ("[1, 2, 3, ", {"json": {"type": "array", "minItems": 1280, "items": {"type": "integer"}}})
NEWLINED = ('{\n  "colour": "red",\n  "n": 1', {"json_object": True})


def consumes(hf_tokenizer, vocab_size: int, eos: list[int], text: str, params: dict) -> None:
    """A matcher built through ``GrammarCompiler`` takes the tokens of ``text`` without error."""
    matcher = GrammarCompiler(hf_tokenizer, vocab_size, eos).matcher(StructuredOutputsParams.of(params))
    ids = hf_tokenizer.encode(text, add_special_tokens=False)
    assert matcher.consume_tokens(ids) and not matcher.is_error(), (text, matcher.get_error())


def test_step_masks_writes_every_word_so_its_buffer_needs_no_zeroing(smollm2):
    # GrammarCompiler.step_masks fills an uninitialised (pinned, on CUDA) buffer: llguidance must write every word of
    # every guided row. Checked on garbage against a zeroed fill, inside a string and after an integer, at a model
    # vocabulary wider than the tokenizer's (the extra ids banned), with an unguided row between
    import numpy as np

    from pageserve.engine.structured_output import _import_llguidance

    llg = _import_llguidance()
    hf = smollm2.tokenizer.hf
    c = GrammarCompiler(hf, smollm2.config.vocab_size + 100, smollm2.tokenizer.eos_token_ids)
    schema = {"type": "array", "items": {"type": "string"}}
    matchers = [c.matcher(StructuredOutputsParams.of({"json": schema})) for _ in range(3)]
    matchers[1].consume_tokens(hf.encode('["ab', add_special_tokens=False))
    matchers[2] = c.matcher(StructuredOutputsParams.of({"regex": "[0-9]+"}))
    masks = c.step_masks([matchers[0], None, matchers[1], matchers[2]])
    assert masks.rows == [0, 2, 3]
    assert np.shares_memory(masks.tensor.numpy(), masks.bits)  # what the sampler copies is what llguidance wrote
    for fill in (0, -7):
        bits = np.full_like(masks.bits, fill)
        llg.numpy.fill_next_token_bitmask_par(c._executor, [(m, i) for i, m in enumerate(matchers)], bits)
        assert np.array_equal(bits, masks.bits), fill
    assert masks.bits.any() and not (masks.bits == -1).all()


def test_the_default_models_spaces_and_newlines_are_bytes_to_the_grammar(smollm2):
    """SmolLM2's byte-level tokens map to their bytes ("Ġ" is a space, "Ċ" a newline): with
    transformers 5.17's GGUF conversion llguidance read "Ġ" as the UTF-8 of "Ġ" ("byte 'Ä' fails
    parse") and guided outputs held no space or newline."""
    hf = smollm2.tokenizer.hf
    assert is_byte_level_vocab(hf.backend_tokenizer.get_vocab(with_added_tokens=False))
    for text, params in (SPACED, NEWLINED):
        assert any({"Ġ", "Ċ"} & set(t) for t in hf.convert_ids_to_tokens(hf.encode(text, add_special_tokens=False)))
        consumes(hf, smollm2.config.vocab_size, smollm2.tokenizer.eos_token_ids, text, params)


def test_a_byte_level_vocab_behind_a_byte_fallback_decoder_is_read_as_bytes(smollm2):
    """The shape transformers 5.17 gives SmolLM2's GGUF tokenizer: a byte-level vocabulary behind a
    decoder with ByteFallback before ByteLevel, which llguidance alone reads as ByteFallback. The
    compiler hands llguidance a plain ByteLevel decoder instead, on a copy."""
    import copy

    from tokenizers import decoders

    hf = copy.deepcopy(smollm2.tokenizer.hf)
    mixed = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse(), decoders.Replace("▁", " "),
                               decoders.ByteLevel()])
    hf.backend_tokenizer.decoder = mixed
    assert json.loads(llguidance_tokenizer_json(hf))["decoder"]["type"] == "ByteLevel"
    for text, params in (SPACED, NEWLINED):
        consumes(hf, smollm2.config.vocab_size, smollm2.tokenizer.eos_token_ids, text, params)
    assert repr(hf.backend_tokenizer.decoder) == repr(mixed)  # the tokenizer itself is untouched
    # a SentencePiece vocabulary ("▁" for a space, <0x..> byte tokens) is left to llguidance as it is
    assert not is_byte_level_vocab({"▁the": 0, "a": 1, "<0x0A>": 2, "Ġ": 3})
    assert not is_byte_level_vocab({"▁the": 0, "a": 1, "Ġ": 2})


def test_the_cost_benchmark_runs_every_mode_to_the_same_length(tmp_path):
    """scripts/structured_bench.py's promise: every mode's requests yield exactly max_tokens tokens, so the
    modes run the same steps (the guided ones inside the schema's array)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    model = os.environ.get("PAGESERVE_TEST_MODEL") or "smollm2-135m-instruct"  # the GPU machine: a carried copy
    subprocess.run([sys.executable, str(root / "scripts/structured_bench.py"), "--out", str(tmp_path), "--device", "cpu",
                    "--model", model,
                    "--dtype", "float32", "--requests", "3", "--max-tokens", "5", "--rounds", "1", "--every", "2",
                    "--num-blocks", "64"], check=True, cwd=root, capture_output=True)
    record = json.loads((tmp_path / "structured_bench.json").read_text())
    assert {r["mode"] for r in record["runs"]} == {"plain", "plain_sync", "penalised", "guided_some", "guided_all"}
    for r in record["runs"]:
        assert r["lengths"] == [5] and r["not_length_capped"] == 0 and r["output_tokens"] == 15, r
        assert r["first_text"].startswith("[") or not r["mode"].startswith("guided"), r
    assert record["ratio_to_plain"]["plain"] == 1.0 and record["git_commit"]
