"""Structured outputs and tool calls through the live server (127.0.0.1, SmolLM2's real weights),
driven by the official ``openai`` client: response_format, vLLM's structured_outputs and guided_*
fields, tool_choice named / required / auto (the hermes parser) / none, streamed and not, and the
chat template seeing the tools and earlier calls."""
import json
import re

import httpx
import pytest
from openai import BadRequestError, OpenAI

pytest.importorskip("llguidance")

MODEL = "smollm2-135m-instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
# what a hermes-style model writes to call a tool: forced here with a regex, so "auto" has a call to find
HERMES_CALL = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
# a template that shows the tools and an earlier call as it receives them
TOOLS_TEMPLATE = ("{% for t in tools or [] %}[tool {{ t.function.name }}]{% endfor %}"
                  "{% for m in messages %}<<{{ m.role }}|{{ m.content }}"
                  "{% for c in m.tool_calls or [] %}|call {{ c.function.name }} {{ c.function.arguments | tojson }}"
                  "{% endfor %}{% if m.tool_call_id %}|answers {{ m.tool_call_id }}{% endif %}>>{% endfor %}"
                  "{% if add_generation_prompt %}ASSISTANT:{% endif %}")


@pytest.fixture(scope="module")
def servers(start_server):
    """(a plain server, one with --enable-auto-tool-choice --tool-call-parser hermes and the tools template)."""
    pair = start_server(), start_server(enable_auto_tool_choice=True, tool_call_parser="hermes",
                                        chat_template=TOOLS_TEMPLATE)
    yield pair
    for srv in pair:
        srv.stop()


def client(srv) -> OpenAI:
    return OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=120)


def test_response_format_json_schema_and_json_object(servers):
    c = client(servers[0])
    msgs = [{"role": "user", "content": "Describe a cat named Tom, 3 years old, as JSON."}]
    r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=40, temperature=0, response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    person = json.loads(r.choices[0].message.content)
    assert set(person) == {"name", "age"} and isinstance(person["age"], int), person
    assert r.choices[0].finish_reason == "stop"
    msgs = [{"role": "user", "content": 'Give me a JSON object with a key "colour" set to "red".'}]
    r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=40, temperature=0,
                                  response_format={"type": "json_object"})
    assert json.loads(r.choices[0].message.content) == {"colour": "red"}


def test_structured_outputs_and_guided_fields_on_both_routes_streamed_or_not(servers):
    c = client(servers[0])
    regex = r"[0-9]{3}-[0-9]{4}"
    for extra in ({"structured_outputs": {"regex": regex}}, {"guided_regex": regex}):
        r = c.completions.create(model=MODEL, prompt="Call me at", max_tokens=20, temperature=0.9, seed=2,
                                 extra_body=extra)
        assert re.fullmatch(regex, r.choices[0].text), r.choices[0].text
        chunks = c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=20, stream=True, extra_body=extra)
        assert re.fullmatch(regex, "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices))
    r = c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, n=3, temperature=1.0, seed=5,
                                  extra_body={"guided_choice": ["sunny", "rainy"]})
    assert {ch.message.content for ch in r.choices} <= {"sunny", "rainy"}


def test_named_tool_choice_gives_that_call_with_arguments_of_its_schema(servers):
    c = client(servers[0])
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = c.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=named,
                                  max_tokens=30, temperature=0)
    msg = r.choices[0].message
    assert msg.content is None and len(msg.tool_calls) == 1, msg
    call = msg.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert set(json.loads(call.function.arguments)) == {"city"}
    assert r.choices[0].finish_reason == "stop"  # OpenAI's reason for a named choice
    cut = c.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=named,
                                    max_tokens=3, temperature=0)
    assert cut.choices[0].finish_reason == "length" and cut.choices[0].message.content is None
    partial = cut.choices[0].message.tool_calls[0].function.arguments  # the text as far as it got, uncompacted
    assert partial.startswith("{") and json.dumps(json.loads(call.function.arguments)) != partial
    chunks = list(c.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=named,
                                            max_tokens=30, temperature=0, stream=True))
    deltas = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
    assert deltas[0].id and deltas[0].function.name == "get_weather" and all(d.index == 0 for d in deltas)
    assert json.loads("".join(d.function.arguments for d in deltas)) == json.loads(call.function.arguments)


def test_required_tool_choice_gives_one_or_more_calls_among_the_tools(servers):
    c = client(servers[0])
    for stream in (False, True):
        kw = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required", max_tokens=60,
                  temperature=0)
        if stream:
            chunks = list(c.chat.completions.create(stream=True, **kw))
            calls = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
            finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1]
        else:
            r = c.chat.completions.create(**kw)
            calls, finish = r.choices[0].message.tool_calls, r.choices[0].finish_reason
        assert calls and finish == "tool_calls", (calls, finish)
        for i, call in enumerate(calls):
            assert call.function.name in ("get_weather", "get_time") and isinstance(
                json.loads(call.function.arguments), dict)
            assert not stream or call.index == i


def test_auto_tool_choice_reads_hermes_calls_from_the_text(servers):
    c = client(servers[1])
    force = {"structured_outputs": {"regex": re.escape(HERMES_CALL)}}
    r = c.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=60, extra_body=force)
    msg = r.choices[0].message
    assert msg.content == "Sure." and r.choices[0].finish_reason == "tool_calls"
    assert [(t.function.name, json.loads(t.function.arguments)) for t in msg.tool_calls] == [
        ("get_weather", {"city": "Paris"})]
    chunks = list(c.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=60,
                                            extra_body=force, stream=True))
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    assert "".join(d.content or "" for d in deltas).strip() == "Sure."
    calls = [tc for d in deltas for tc in d.tool_calls or []]
    assert [(t.function.name, json.loads(t.function.arguments)) for t in calls] == [("get_weather", {"city": "Paris"})]
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"
    # without a call in the text, auto answers plain content
    r = c.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=5, extra_body={
        "guided_choice": ["It is sunny."]})
    assert r.choices[0].message.content == "It is sunny." and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"


def test_the_template_sees_the_tools_and_earlier_calls_as_objects(servers):
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = httpx.post(servers[1].url + "/tokenize", json={"messages": history, "tools": [WEATHER, TIME]}, timeout=60)
    assert r.status_code == 200, r.text
    text = httpx.post(servers[1].url + "/detokenize", json={"tokens": r.json()["tokens"]}, timeout=60).json()["prompt"]
    assert text == ('[tool get_weather][tool get_time]<<user|What is the weather in Paris?>>'
                    '<<assistant||call get_weather {"city": "Paris"}>><<tool|sunny|answers call_1>>ASSISTANT:')


@pytest.mark.parametrize("server_index,extra,why", [
    (0, {"tools": [WEATHER]}, "--enable-auto-tool-choice"),  # auto, the default with tools, is off
    (0, {"tool_choice": "required"}, "needs tools"),
    (1, {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among"),
    (1, {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "constrains the output"),
    (0, {"tools": [{"type": "retrieval"}]}, "tools"),
    (0, {"messages": ASK + [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}]},
     "not JSON"),
])
def test_bad_tool_requests_are_refused(servers, server_index, extra, why):
    with pytest.raises(BadRequestError, match=re.escape(why)):
        client(servers[server_index]).chat.completions.create(**{"model": MODEL, "messages": ASK, "max_tokens": 2,
                                                                 **extra})
    # tool_choice "none" with tools is plain text, auto or not
    r = client(servers[0]).chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="none",
                                                   max_tokens=3, temperature=0)
    assert isinstance(r.choices[0].message.content, str) and not r.choices[0].message.tool_calls


def test_auto_tool_choice_with_the_llama3_json_parser(start_server):
    srv = start_server(enable_auto_tool_choice=True, tool_call_parser="llama3_json")
    try:
        force = {"structured_outputs": {"regex": re.escape('{"name": "get_weather", "parameters": {"city": "Paris"}}')}}
        kw = dict(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=40, extra_body=force)
        r = client(srv).chat.completions.create(**kw)
        assert r.choices[0].message.content is None and r.choices[0].finish_reason == "tool_calls"
        assert [(t.function.name, json.loads(t.function.arguments)) for t in r.choices[0].message.tool_calls] == [
            ("get_weather", {"city": "Paris"})]
        chunks = [ch.choices[0].delta for ch in client(srv).chat.completions.create(stream=True, **kw) if ch.choices]
        calls = [tc for d in chunks for tc in d.tool_calls or []]
        assert [(t.function.name, json.loads(t.function.arguments)) for t in calls] == [("get_weather", {"city": "Paris"})]
    finally:
        srv.stop()


THINKING = "<think>\nThe user asks about Paris.\n</think>\n\n"


def test_a_reasoning_parser_splits_the_think_part_off_streamed_or_not_and_before_the_tool_parser(start_server):
    srv = start_server(reasoning_parser="qwen3", enable_auto_tool_choice=True, tool_call_parser="hermes")
    try:
        c = client(srv)
        force = {"structured_outputs": {"regex": re.escape(THINKING + "It is sunny.")}}
        r = c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=40, extra_body=force)
        msg = r.choices[0].message
        assert (msg.reasoning_content, msg.content) == ("The user asks about Paris.", "It is sunny.")
        chunks = [ch.choices[0].delta for ch in c.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=40, extra_body=force, stream=True) if ch.choices]
        assert "".join(getattr(d, "reasoning_content", None) or "" for d in chunks).strip() == msg.reasoning_content
        assert "".join(d.content or "" for d in chunks) == "It is sunny."
        # the think part first, then the hermes call in the answer
        force = {"structured_outputs": {"regex": re.escape(THINKING + HERMES_CALL)}}
        r = c.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=80, extra_body=force)
        msg = r.choices[0].message
        assert msg.reasoning_content == "The user asks about Paris." and msg.content == "Sure."
        assert [t.function.name for t in msg.tool_calls] == ["get_weather"] and r.choices[0].finish_reason == "tool_calls"
        # a reply without a think part is all content
        r = c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, extra_body={"guided_choice": ["Sunny."]})
        assert (r.choices[0].message.reasoning_content, r.choices[0].message.content) == (None, "Sunny.")
    finally:
        srv.stop()
