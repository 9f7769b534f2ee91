"""Streaming detokenization on the real default tokenizer (SmolLM2's byte-level BPE): the
concatenated pieces equal one decode of all the tokens, character for character, across
UTF-8 boundaries that fall inside tokens."""
import random

import pytest

from pageserve.model.default_model import default_model_dir
from pageserve.engine.detokenizer import IncrementalDetokenizer

HARD_STRINGS = [
    "日本語のテキストと中文字符，한국어 문장도。",
    "family 👨‍👩‍👧‍👦, flag 🏳️‍🌈, thumbs 👍🏽, keycap 1️⃣ and 🧬🦀",
    "combining: e\u0301 n\u0303 a\u030a Z\u0351\u0352\u0357 vs é ñ å",
    "rare code points: 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𓀀 \U0010fffd \u200b zero-width",
    "mixed: naïve café — «quotes» ½ ∑ ∫ 🙂 done.",
]


@pytest.fixture(scope="module")
def hf_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model_dir()))


def stream(tok, prompt_ids, ids, **kw):
    det = IncrementalDetokenizer(tok, prompt_ids, **kw)
    pieces = [det.add(t) for t in ids]
    pieces.append(det.flush())
    return pieces, det


@pytest.mark.parametrize("text", HARD_STRINGS)
def test_streamed_pieces_join_to_the_whole_decode(hf_tokenizer, text):
    ids = hf_tokenizer.encode(text, add_special_tokens=False)
    prompt = hf_tokenizer.encode("Repeat after me:", add_special_tokens=False)
    pieces, det = stream(hf_tokenizer, prompt, ids)
    whole = hf_tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert "".join(pieces) == whole == text
    assert all("\ufffd" not in p for p in pieces)  # never a half character on the wire


def test_single_bytes_of_multibyte_characters_are_held_until_complete(hf_tokenizer):
    # the tokenizer splits these characters across tokens: at least one token alone is not valid UTF-8
    ids = hf_tokenizer.encode("日本語 🙂", add_special_tokens=False)
    assert any(hf_tokenizer.decode([t]) == "\ufffd" or hf_tokenizer.decode([t]).endswith("\ufffd") for t in ids)
    pieces, _ = stream(hf_tokenizer, [], ids)
    assert "".join(pieces) == "日本語 🙂"
    assert all("\ufffd" not in p for p in pieces)


@pytest.mark.parametrize("seed", range(6))
def test_random_token_ids_stream_to_the_whole_decode(hf_tokenizer, seed):
    rng = random.Random(seed)
    vocab = len(hf_tokenizer)
    prompt = [rng.randrange(vocab) for _ in range(3)]
    ids = [rng.randrange(vocab) for _ in range(60)]
    pieces, _ = stream(hf_tokenizer, prompt, ids)
    whole = hf_tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert "".join(pieces) == whole


@pytest.mark.parametrize("seed", range(3))
def test_random_byte_tokens_stream_to_the_whole_decode(hf_tokenizer, seed):
    # only single-byte tokens: UTF-8 sequences cut at every possible place, invalid ones too
    vocab = hf_tokenizer.get_vocab()
    byte_tokens = [i for tok, i in vocab.items() if len(tok) == 1]
    rng = random.Random(seed)
    ids = [rng.choice(byte_tokens) for _ in range(80)]
    pieces, _ = stream(hf_tokenizer, [], ids)
    assert "".join(pieces) == hf_tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def test_stop_string_spanning_a_multibyte_boundary_is_never_streamed(hf_tokenizer):
    text = "before 🙂🙂 after"
    ids = hf_tokenizer.encode(text, add_special_tokens=False)
    pieces, det = stream(hf_tokenizer, [], ids, stop=["🙂🙂"])
    assert "".join(pieces) == "before "
    assert det.stop_reason == "🙂🙂"
