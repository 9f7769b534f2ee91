"""The tool-call parsers (hermes, llama3_json): whole-text extraction, and streaming that agrees with
it under any splitting of the text into deltas."""
import json
import random
import re

from pageserve.serve.tools import TOOL_PARSERS, HermesToolParser, Llama3JsonToolParser, ToolCall, new_call_id

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TIME = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>'


def extract(text):
    return HermesToolParser().extract(text)


def stream(text, sizes=None, parser=HermesToolParser):
    """All events of ``text`` fed in deltas of the given sizes (cycled), then finish()."""
    s = parser().streamer()
    events, pos, k = [], 0, 0
    while pos < len(text):
        n = sizes[k % len(sizes)] if sizes else len(text)
        events += s.feed(text[pos:pos + n])
        pos, k = pos + n, k + 1
    events += s.finish()
    assert all(isinstance(e, (str, ToolCall)) for e in events)
    assert all(e != "" for e in events)
    assert s.saw_calls == any(isinstance(e, ToolCall) for e in events)
    return events


def content_and_calls(events):
    content = "".join(e for e in events if isinstance(e, str))
    calls = [(c.name, json.loads(c.arguments)) for c in events if isinstance(c, ToolCall)]
    return content, calls


def random_splits(text, seed, count=30):
    rng = random.Random(seed)
    for _ in range(count):
        yield [rng.randint(1, 7) for _ in range(rng.randint(1, 5))]


def test_single_call():
    content, calls = extract(WEATHER)
    assert content is None
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Paris"}')]


def test_multiple_calls_keep_their_order():
    content, calls = extract(WEATHER + "\n" + TIME + "\n")
    assert content is None
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[1].arguments) == {"tz": "Europe/Paris"}


def test_content_before_calls_is_stripped():
    content, calls = extract("Let me check the weather.\n\n" + WEATHER)
    assert content == "Let me check the weather."
    assert [c.name for c in calls] == ["get_weather"]


def test_parameters_key_is_accepted_as_arguments():
    _, calls = extract('<tool_call>{"name": "f", "parameters": {"x": 1}}</tool_call>')
    assert [(c.name, c.arguments) for c in calls] == [("f", '{"x": 1}')]


def test_missing_arguments_become_empty_object():
    _, calls = extract('<tool_call>{"name": "now"}</tool_call>')
    assert [(c.name, c.arguments) for c in calls] == [("now", "{}")]


def test_arguments_written_as_json_text_are_decoded():
    _, calls = extract('<tool_call>{"name": "f", "arguments": "{\\"x\\": [1, 2]}"}</tool_call>')
    assert [(c.name, c.arguments) for c in calls] == [("f", '{"x": [1, 2]}')]


def test_nested_unicode_and_angle_brackets_in_arguments():
    args = {"q": {"expr": "a < b && c <tool> d", "list": [1, {"k": None}]}, "city": "Zürich 東京 🙂"}
    _, calls = extract("<tool_call>" + json.dumps({"name": "f", "arguments": args}) + "</tool_call>")
    assert len(calls) == 1
    assert json.loads(calls[0].arguments) == args
    assert "Zürich 東京 🙂" in calls[0].arguments  # ensure_ascii=False
    assert calls[0].arguments == json.dumps(args, ensure_ascii=False)


def test_no_calls_returns_text_unchanged():
    assert extract("  Just an answer.\n") == ("  Just an answer.\n", [])
    assert extract("") == ("", [])


def test_malformed_json_falls_back_to_whole_text():
    text = "Sure.\n" + WEATHER + '\n<tool_call>\n{"name": "f", "arguments": {</tool_call>'
    assert extract(text) == (text, [])


def test_block_without_string_name_is_not_a_call():
    for block in ('{"arguments": {}}', '{"name": 3, "arguments": {}}', '["f"]', '{"name": "f", "arguments": [1]}'):
        text = "<tool_call>" + block + "</tool_call>"
        assert extract(text) == (text, [])


def test_unterminated_last_block_that_parses_is_a_call():
    content, calls = extract("Checking.\n" + WEATHER + '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n')
    assert content == "Checking."
    assert [c.name for c in calls] == ["get_weather", "get_time"]


def test_unterminated_last_block_that_does_not_parse_falls_back():
    text = WEATHER + '\n<tool_call>\n{"name": "get_ti'
    assert extract(text) == (text, [])


def test_content_between_calls_is_kept():
    content, calls = extract("A" + WEATHER + "\n middle \n" + TIME + "\n end\n")
    assert content == "A\n middle\n end"
    assert len(calls) == 2


def test_call_ids_are_unique_and_openai_shaped():
    ids = [new_call_id() for _ in range(200)] + [c.id for c in extract(WEATHER + TIME)[1]]
    assert len(set(ids)) == len(ids)
    assert all(re.fullmatch(r"call_[0-9a-zA-Z]{24}", i) for i in ids)


def test_registry_names_the_hermes_parser():
    assert TOOL_PARSERS["hermes"] is HermesToolParser
    assert HermesToolParser.name == "hermes"


WELL_FORMED = [
    WEATHER,
    "Let me look that up: a < b, <tool and <toolbox> are not tags.\n" + WEATHER + "\n" + TIME + "\n",
    "First " + WEATHER + "\n then some words \n" + TIME + "\n\n",
    'Unterminated <tool_cal> and <<tool_call>{"name": "f", "parameters": {"s": "x < y </tool"}}\n',
    "no calls at all, but <tool_ and < and </tool_call> and a trailing <tool_c",
    "",
]


def test_streaming_agrees_with_extract_under_random_splits():
    for seed, text in enumerate(WELL_FORMED):
        want_content, want_calls = extract(text)
        want_calls = [(c.name, json.loads(c.arguments)) for c in want_calls]
        whole = content_and_calls(stream(text))
        for sizes in [[1], *random_splits(text, seed)]:
            content, calls = content_and_calls(stream(text, sizes))
            assert (content, calls) == whole, (text, sizes)
            assert calls == want_calls
            if want_calls:
                assert (content.strip() or None) == want_content
            else:
                assert content == want_content


def test_streaming_sends_content_before_the_tag_arrives():
    s = HermesToolParser().streamer()
    assert s.feed("Hello, ") == ["Hello, "]
    assert s.feed("world <to") == ["world "]  # "<to" may start the tag
    assert s.feed("ol") == []
    assert s.feed("_call>{\"name\": \"f\"") == []
    [call] = s.feed("}</tool_call>")
    assert (call.name, call.arguments) == ("f", "{}")
    assert s.saw_calls
    assert s.feed("\n") == []
    assert s.finish() == []


def test_streaming_held_prefix_that_is_not_a_tag_comes_through_intact():
    text = "a < b and <toolbox>"
    for sizes in ([1], [2], [3, 1], [len(text)]):
        events = stream(text, sizes)
        assert "".join(events) == text
    s = HermesToolParser().streamer()
    assert s.feed("x <tool") == ["x "]
    assert s.finish() == ["<tool"]


def test_streaming_drops_whitespace_between_and_after_calls_only():
    events = stream(WEATHER + "\n\n" + TIME + "\n  \n", [1])
    assert [type(e) for e in events] == [ToolCall, ToolCall]
    events = stream("  Hi\n" + WEATHER + "\n\nBye \n", [1])
    assert "".join(e for e in events if isinstance(e, str)) == "  Hi\n\n\nBye"


def test_streaming_malformed_block_comes_through_as_raw_content():
    bad = '<tool_call>\n{"name": "f", "arguments": {oops}}\n</tool_call>'
    text = "Trying: " + bad + " done"
    for sizes in ([1], [5, 2], [len(text)]):
        events = stream(text, sizes)
        assert "".join(events) == text
        assert all(isinstance(e, str) for e in events)


def test_streaming_malformed_block_after_a_call_is_content_and_the_call_stays():
    bad = '<tool_call>{"name": }</tool_call>'
    events = stream(WEATHER + "\n" + bad, [4])
    assert isinstance(events[0], ToolCall) and events[0].name == "get_weather"
    assert "".join(e for e in events[1:]) == "\n" + bad


def test_streaming_finish_turns_an_open_block_into_a_call_or_raw_text():
    s = HermesToolParser().streamer()
    assert s.feed('ok <tool_call>{"name": "f", "arguments": {"a": 1}}') == ["ok "]
    [call] = s.finish()
    assert (call.name, call.arguments) == ("f", '{"a": 1}')
    s = HermesToolParser().streamer()
    assert s.feed('ok <tool_call>{"name": "f", "argu') == ["ok "]
    assert s.finish() == ['<tool_call>{"name": "f", "argu']
    assert not s.saw_calls


# llama3_json: the whole reply is calls, or it is content

LLAMA_WEATHER = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
LLAMA_TIME = '{"name": "get_time", "parameters": {"tz": "Europe/Paris"}}'


def llama_extract(text):
    return Llama3JsonToolParser().extract(text)


def names_and_args(calls):
    return [(c.name, c.arguments) for c in calls]


def test_llama3_single_call():
    content, calls = llama_extract(LLAMA_WEATHER)
    assert content is None
    assert names_and_args(calls) == [("get_weather", '{"city": "Paris"}')]


def test_llama3_python_tag_and_surrounding_whitespace_are_dropped():
    for text in ("<|python_tag|>" + LLAMA_WEATHER, "\n <|python_tag|>" + LLAMA_WEATHER + "\n", "<|python_tag|>\n" + LLAMA_WEATHER):
        content, calls = llama_extract(text)
        assert content is None, text
        assert names_and_args(calls) == [("get_weather", '{"city": "Paris"}')]


def test_llama3_calls_separated_by_semicolons_keep_their_order():
    for sep in (";", "; ", " ;\n", "\n;\n\n"):
        content, calls = llama_extract("<|python_tag|>" + LLAMA_WEATHER + sep + LLAMA_TIME + sep + '{"name": "now"}')
        assert content is None, sep
        assert names_and_args(calls) == [("get_weather", '{"city": "Paris"}'),
                                         ("get_time", '{"tz": "Europe/Paris"}'), ("now", "{}")]
    calls = llama_extract(LLAMA_WEATHER + ";" + LLAMA_WEATHER)[1]
    assert calls[0].id != calls[1].id


def test_llama3_arguments_key_is_accepted_as_parameters():
    _, calls = llama_extract('{"name": "f", "arguments": {"x": [1, 2]}}')
    assert names_and_args(calls) == [("f", '{"x": [1, 2]}')]


def test_llama3_semicolon_and_braces_inside_a_string_argument():
    args = {"sql": "SELECT 1; DROP TABLE t; -- } {", "city": "Zürich 東京"}
    text = json.dumps({"name": "query", "parameters": args}, ensure_ascii=False) + "; " + LLAMA_TIME
    content, calls = llama_extract(text)
    assert content is None
    assert [c.name for c in calls] == ["query", "get_time"]
    assert calls[0].arguments == json.dumps(args, ensure_ascii=False)


def test_llama3_plain_text_is_content_unchanged():
    for text in ("The weather in Paris is sunny.", "  Hi there\n", "", "  \n", "<|python", "; {}"):
        assert llama_extract(text) == (text, []), text


def test_llama3_text_starting_with_a_brace_that_is_not_calls_is_content_whole():
    for text in ("{not json", '{"a": 1}', '{"name": 3, "parameters": {}}', '{"name": "f", "parameters": [1]}',
                 LLAMA_WEATHER + " and that is the call.", LLAMA_WEATHER + ";", LLAMA_WEATHER + ";;" + LLAMA_TIME,
                 LLAMA_WEATHER + " " + LLAMA_TIME, LLAMA_WEATHER + ", " + LLAMA_TIME,
                 LLAMA_WEATHER + "; {oops}", "<|python_tag|>print(1)"):
        assert llama_extract(text) == (text, []), text


def test_llama3_prose_that_mentions_a_call_object_later_is_content():
    text = "To call it, send " + LLAMA_WEATHER + "; then " + LLAMA_TIME
    assert llama_extract(text) == (text, [])


def test_llama3_reply_cut_short_is_content_whole():
    """A reply cut by max_tokens does not parse, so all of it (a finished first call too) is content."""
    for text in (LLAMA_WEATHER[:-3], LLAMA_WEATHER + "; " + LLAMA_TIME[:20], "<|python_tag|>" + LLAMA_WEATHER + ";"):
        assert llama_extract(text) == (text, []), text
        assert stream(text, [1], Llama3JsonToolParser) == [text]


def test_llama3_registry_has_both_parsers_by_name():
    assert TOOL_PARSERS["hermes"] is HermesToolParser
    assert TOOL_PARSERS["llama3_json"] is Llama3JsonToolParser
    assert all(TOOL_PARSERS[name]().name == name for name in ("hermes", "llama3_json"))


LLAMA_CASES = [
    LLAMA_WEATHER,
    "<|python_tag|>" + LLAMA_WEATHER,
    "\n  <|python_tag|>" + LLAMA_WEATHER + ";\n" + LLAMA_TIME + "\n",
    '{"name": "f", "arguments": {"s": "a; b } ; {\\"c\\": 1}"}} ; {"name": "g"}',
    "The answer is 42.",
    "  \n Indented answer with { braces } and <|python_tag|> later",
    " <|pyth",
    "<|python!",
    "{not json",
    LLAMA_WEATHER + " and prose after it",
    "To call it, send " + LLAMA_WEATHER,
    "",
    "   ",
]


def test_llama3_streaming_agrees_with_extract_under_random_splits():
    for seed, text in enumerate(LLAMA_CASES):
        want_content, want_calls = llama_extract(text)
        want = ("" if want_calls else want_content, [(c.name, json.loads(c.arguments)) for c in want_calls])
        for sizes in [None, [1], *random_splits(text, 100 + seed)]:
            events = stream(text, sizes, Llama3JsonToolParser)
            assert content_and_calls(events) == want, (text, sizes)
            if want_calls:
                assert all(isinstance(e, ToolCall) for e in events)


def test_llama3_streaming_passes_content_through_once_decided():
    s = Llama3JsonToolParser().streamer()
    assert s.feed("\n ") == []  # leading whitespace is held until the reply shows what it is
    assert s.feed("<|py") == []  # could still be <|python_tag|>
    assert s.feed("x") == ["\n <|pyx"]
    assert s.feed(" {") == [" {"]
    assert s.feed('"name": "f"}') == ['"name": "f"}']
    assert s.finish() == []
    assert not s.saw_calls


def test_llama3_streaming_holds_a_possible_call_until_finish():
    s = Llama3JsonToolParser().streamer()
    for delta in ("<|python", "_tag|>", '{"name": "f", ', '"parameters": {"a": 1}}', "; ", '{"name": "g"}'):
        assert s.feed(delta) == []
    assert not s.saw_calls
    events = s.finish()
    assert names_and_args(events) == [("f", '{"a": 1}'), ("g", "{}")]
    assert s.saw_calls
    s = Llama3JsonToolParser().streamer()
    assert s.feed("{not") == [] and s.feed(" json") == []
    assert s.finish() == ["{not json"]
    assert not s.saw_calls
