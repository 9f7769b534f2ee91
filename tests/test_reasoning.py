"""The reasoning parsers: ``<think>…</think>`` split from the answer, whole and streamed in any pieces."""
import random

import pytest

from pageserve.serve.reasoning import REASONING_PARSERS

TEXTS = {
    "thinks": "<think>\nThe user asks 2+2. That is 4.\n</think>\n\nIt is 4.",
    "thinks with a < inside": "<think>a < b, and <thin is no tag</think>The answer: a<b.",
    "cut short while thinking": "<think>Let me think about th",
    "no thinking": "It is 4, and <think> later is just text.",
    "opened by the template (R1)": "The user wants 4.\n</think>\n\n4.",
    "only a tag start": "<thi",
}
EXPECTED = {
    "qwen3": {
        "thinks": ("The user asks 2+2. That is 4.", "It is 4."),
        "thinks with a < inside": ("a < b, and <thin is no tag", "The answer: a<b."),
        "cut short while thinking": ("Let me think about th", None),
        "no thinking": (None, "It is 4, and <think> later is just text."),
        "opened by the template (R1)": (None, "The user wants 4.\n</think>\n\n4."),
        "only a tag start": (None, "<thi"),
    },
    "deepseek_r1": {
        "thinks": ("The user asks 2+2. That is 4.", "It is 4."),
        "thinks with a < inside": ("a < b, and <thin is no tag", "The answer: a<b."),
        "cut short while thinking": ("Let me think about th", None),
        "no thinking": ("It is 4, and <think> later is just text.", None),
        "opened by the template (R1)": ("The user wants 4.", "4."),
        "only a tag start": ("<thi", None),
    },
}


def streamed(parser, text, cuts):
    stream, reasoning, content = parser.streamer(), "", ""
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    for piece in pieces:
        r, c = stream.feed(piece)
        reasoning, content = reasoning + r, content + c
    r, c = stream.finish()
    return (reasoning + r).strip() or None, (content + c) or None


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
@pytest.mark.parametrize("case", sorted(TEXTS))
def test_whole_and_streamed_in_any_pieces_give_the_same_split(name, case):
    parser = REASONING_PARSERS[name]()
    text = TEXTS[case]
    assert parser.split(text) == EXPECTED[name][case]
    rng = random.Random(case)
    splits = [list(range(1, len(text))), []] + [sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 6))))
                                                for _ in range(20)]
    for cuts in splits:
        assert streamed(parser, text, cuts) == EXPECTED[name][case], cuts


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
@pytest.mark.parametrize("key", sorted(TEXTS))
def test_reasoning_tokens_count_the_reply_up_to_the_token_that_completes_the_end_tag(name, key):
    from pageserve.serve.reasoning import END, reasoning_token_count

    parser, text = REASONING_PARSERS[name](), TEXTS[key]
    rng = random.Random(key)
    for _ in range(20):  # "tokens" of random lengths, so the tag is split across tokens in every way
        pieces, i = [], 0
        while i < len(text):
            n = rng.randint(1, 6)
            pieces.append(text[i:i + n])
            i += n
        ids = list(range(len(pieces)))
        count = reasoning_token_count(parser, lambda xs: "".join(pieces[x] for x in xs), ids)
        reasoning, _ = EXPECTED[name][key]
        if END in text and reasoning is not None:
            ends = [k for k in range(1, len(pieces) + 1) if END in "".join(pieces[:k])]
            assert count == ends[0]
        else:
            assert count == (len(pieces) if reasoning is not None else 0)
    assert reasoning_token_count(parser, lambda xs: "", []) == 0
