import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from pageserve.engine.detokenizer import IncrementalDetokenizer

CORPUS = [
    "héllo wörld 日本語 🙂 the quick brown fox jumps over the lazy dog",
    "Ünïcödé text: naïve café, Straße, 東京タワー, emoji 🚀🙂👍 and plain ASCII.",
    "Stop here. STOP now! END of the line, and then some more words.",
] * 10


def train(pre_tokenizer, decoder, alphabet):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizer, decoder
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=alphabet, special_tokens=["<|end|>"]
    )
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|end|>", clean_up_tokenization_spaces=False
    )


@pytest.fixture(scope="module")
def byte_bpe():
    return train(
        pre_tokenizers.ByteLevel(add_prefix_space=False),
        decoders.ByteLevel(),
        pre_tokenizers.ByteLevel.alphabet(),
    )


@pytest.fixture(scope="module")
def metaspace_bpe():
    # SentencePiece-like: decode strips the leading '▁' of the first token, so a token
    # decodes differently alone than after another one
    return train(pre_tokenizers.Metaspace(), decoders.Metaspace(), [])


def byte_token_ids(tok, text):
    """One token per UTF-8 byte: multi-byte characters split across tokens."""
    vocab = tok.get_vocab()
    mapping = _gpt2_byte_map()
    return [vocab[mapping[b]] for b in text.encode("utf-8")]


def _gpt2_byte_map():
    """ByteLevel's byte -> vocabulary character map: printable bytes map to themselves,
    the rest to chr(256 + i) in order."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return chars


def stream(detok, ids):
    pieces = [detok.add(t) for t in ids]
    return pieces, detok.flush()


def test_streamed_text_equals_full_decode_for_random_token_sequences(byte_bpe):
    rng = random.Random(0)
    prompt = byte_bpe.encode("héllo wörld", add_special_tokens=False)
    for _ in range(60):
        ids = [rng.randrange(len(byte_bpe)) for _ in range(rng.randrange(1, 30))]
        for skip in (True, False):
            d = IncrementalDetokenizer(byte_bpe, prompt, skip_special_tokens=skip)
            pieces, tail = stream(d, ids)
            want = byte_bpe.decode(ids, skip_special_tokens=skip)
            assert "".join(pieces) + tail == want
            assert d.text == want


def test_multibyte_characters_are_never_emitted_half_done(byte_bpe):
    text = "日本語 🙂 naïve 👍"
    ids = byte_token_ids(byte_bpe, text)
    assert byte_bpe.decode(ids) == text
    assert len(ids) == len(text.encode())  # really one byte per token
    d = IncrementalDetokenizer(byte_bpe, [])
    pieces, tail = stream(d, ids)
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text and tail == ""
    assert sum(1 for p in pieces if p) == len(text)  # one piece per completed character


def test_suffix_decode_differs_from_full_decode_leading_space_kept(metaspace_bpe):
    tok = metaspace_bpe
    prompt = tok.encode("the quick", add_special_tokens=False)
    out = tok.encode("brown fox jumps", add_special_tokens=False)
    assert tok.decode(out) == "brown fox jumps"  # alone: leading space dropped
    d = IncrementalDetokenizer(tok, prompt)
    pieces, tail = stream(d, out)
    assert "".join(pieces) + tail == " brown fox jumps"
    full = tok.decode(prompt + out)
    assert full == tok.decode(prompt) + d.text


def test_random_streams_match_decode_after_prompt_for_metaspace(metaspace_bpe):
    tok = metaspace_bpe
    rng = random.Random(1)
    prompt = tok.encode("Stop here.", add_special_tokens=False)
    for _ in range(40):
        ids = [rng.randrange(1, len(tok)) for _ in range(rng.randrange(1, 20))]
        d = IncrementalDetokenizer(tok, prompt)
        pieces, tail = stream(d, ids)
        assert tok.decode(prompt) + "".join(pieces) + tail == tok.decode(prompt + ids)


def stop_case(tok, text, stop, include=False):
    ids = byte_token_ids(tok, text)  # byte tokens: every stop string spans tokens
    d = IncrementalDetokenizer(tok, [], stop=stop, include_stop_str_in_output=include)
    pieces, stopped_at = [], None
    for i, t in enumerate(ids):
        pieces.append(d.add(t))
        if d.stopped and stopped_at is None:
            stopped_at = i
    d.stopped_at = stopped_at
    return d, pieces, d.flush()


def test_stop_string_spanning_tokens_is_cut_and_nothing_after_is_emitted(byte_bpe):
    d, pieces, tail = stop_case(byte_bpe, "hello wörld STOP and more text", "STOP")
    assert d.stopped and d.stop_reason == "STOP"
    assert d.text == "hello wörld "
    assert "".join(pieces) + tail == "hello wörld "
    # everything after the match: add() returns nothing
    assert d.stopped_at == len("hello wörld STOP".encode()) - 1  # at the token ending "STOP"
    assert "".join(pieces[: d.stopped_at + 1]) == d.text
    assert all(p == "" for p in pieces[d.stopped_at + 1 :]) and tail == ""
    assert d.add(5) == ""


def test_stop_string_made_of_multibyte_characters(byte_bpe):
    d, pieces, tail = stop_case(byte_bpe, "abc 日本語 def", "本語")
    assert d.text == "abc 日" and "".join(pieces) + tail == "abc 日"


def test_include_stop_str_in_output_keeps_the_stop_string(byte_bpe):
    d, pieces, tail = stop_case(byte_bpe, "one two END three", ["END"], include=True)
    assert d.text == "one two END"
    assert "".join(pieces) + tail == "one two END"


def test_earliest_of_several_stop_strings_wins(byte_bpe):
    d, pieces, tail = stop_case(byte_bpe, "aaa xyz bbb abc", ["abc", "xyz", "zz"])
    assert d.stop_reason == "xyz" and d.text == "aaa "


def test_possible_stop_prefix_is_held_back_until_resolved(byte_bpe):
    ids = byte_token_ids(byte_bpe, "Hi ENx")
    d = IncrementalDetokenizer(byte_bpe, [], stop=["END"])
    got = [d.add(t) for t in ids]
    # 'E' and 'EN' could start "END": held back; 'x' resolves it
    assert got == ["H", "i", " ", "", "", "ENx"]
    assert d.pending_text() == ""
    ids2 = byte_token_ids(byte_bpe, "Hi EN")
    d2 = IncrementalDetokenizer(byte_bpe, [], stop=["END"])
    assert "".join(d2.add(t) for t in ids2) == "Hi "
    assert d2.pending_text() == "EN"
    assert d2.flush() == "EN" and not d2.stopped


def test_streamed_pieces_never_contain_text_that_is_later_cut(byte_bpe):
    rng = random.Random(2)
    alphabet = "ab \n"
    for _ in range(80):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 25)))
        stops = ["ab\n", "b b", "\n\n"]
        d, pieces, tail = stop_case(byte_bpe, text, stops)
        streamed = "".join(pieces)
        assert d.text.startswith(streamed)
        assert streamed + tail == d.text
        cuts = [text.find(s) for s in stops if s in text]
        assert d.text == (text[: min(cuts)] if cuts else text)


def test_special_tokens_shown_only_when_not_skipped(byte_bpe):
    eos = byte_bpe.eos_token_id
    ids = byte_bpe.encode("hi", add_special_tokens=False) + [eos]
    shown = IncrementalDetokenizer(byte_bpe, [], skip_special_tokens=False)
    hidden = IncrementalDetokenizer(byte_bpe, [], skip_special_tokens=True)
    assert "".join(shown.add(t) for t in ids) + shown.flush() == "hi<|end|>"
    assert "".join(hidden.add(t) for t in ids) + hidden.flush() == "hi"
