"""``/v1/responses`` (OpenAI's Responses API) through the official ``openai`` client, live on 127.0.0.1 over
SmolLM2's real weights: the same text as the chat route for the same conversation, the streamed event
sequence, function calls, ``text.format``, and what it refuses."""
import json
import re

import pytest
from openai import BadRequestError, OpenAI

from pageserve.serve.responses import ResponsesRequest

MODEL = "smollm2-135m-instruct"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                          "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def client(start_server):
    srv = start_server()
    yield OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=120)
    srv.stop()


def test_a_response_is_the_chat_reply_to_the_same_conversation(client):
    chat = client.chat.completions.create(model=MODEL, max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is the capital of France?"}])
    r = client.responses.create(model=MODEL, instructions="Answer briefly.", input="What is the capital of France?",
                                max_output_tokens=12, temperature=0)
    assert r.output_text == chat.choices[0].message.content and r.object == "response"
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    # a message list, with a developer message as the system one
    again = client.responses.create(model=MODEL, max_output_tokens=12, temperature=0, input=[
        {"role": "developer", "content": "Answer briefly."},
        {"role": "user", "content": [{"type": "input_text", "text": "What is the capital of France?"}]}])
    assert again.output_text == r.output_text


def test_max_output_tokens_makes_it_incomplete(client):
    r = client.responses.create(model=MODEL, input="Tell me a long story.", max_output_tokens=3, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3


def test_the_streamed_events_build_the_same_response(client):
    kw = dict(model=MODEL, input="Say hello.", max_output_tokens=10, temperature=0)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete" if whole.status == "incomplete" else "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text


def test_function_calls_named_and_required_streamed_or_not(client):
    r = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER], temperature=0,
                                tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=30)
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert set(json.loads(call.arguments)) == {"city"}
    with client.responses.stream(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER], temperature=0,
                                 tool_choice="required", max_output_tokens=40) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    assert final.output and all(o.type == "function_call" and o.name == "get_weather" for o in final.output)


def test_text_format_json_schema(client):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    r = client.responses.create(model=MODEL, input="Describe Tom the cat, 3 years old, as JSON.", temperature=0,
                                max_output_tokens=40, text={"format": {"type": "json_schema", "name": "p", "schema": schema}})
    assert set(json.loads(r.output_text)) == {"name", "age"}


def test_function_call_items_become_the_chat_history():
    req = ResponsesRequest(input=[
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": "rain"}], instructions="Be brief.")
    assert req.messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain"}]
    chat = req.to_chat_request()
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "tool", "tool"]


def test_a_reasoning_parser_gives_a_reasoning_item_before_the_message(start_server):
    srv = start_server(reasoning_parser="qwen3")
    try:
        c = OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=120)
        force = {"structured_outputs": {"regex": re.escape("<think>\nParis, in June.\n</think>\n\nIt is sunny.")}}
        kw = dict(model=MODEL, input="What is the weather in Paris?", max_output_tokens=40, extra_body=force)
        r = c.responses.create(**kw)
        assert [o.type for o in r.output] == ["reasoning", "message"] and r.output_text == "It is sunny."
        assert r.output[0].content[0].text == "Paris, in June."
        events = list(c.responses.create(stream=True, **kw))
        thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        assert thought.strip() == "Paris, in June." and events[-1].type == "response.completed"
        assert [o.type for o in events[-1].response.output] == ["reasoning", "message"]
        assert events[-1].response.output_text == "It is sunny."
        # reasoning tokens: the reply's tokens up to the one that completes </think>, on both routes
        greedy = dict(kw, temperature=0)
        chat = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": kw["input"]}], max_tokens=40,
                                         temperature=0, logprobs=True, extra_body=force)
        pieces = [t.token for t in chat.choices[0].logprobs.content]
        want = next(k for k in range(1, len(pieces) + 1) if "</think>" in "".join(pieces[:k]))
        assert 0 < want < chat.usage.completion_tokens
        assert chat.usage.completion_tokens_details.reasoning_tokens == want
        assert c.responses.create(**greedy).usage.output_tokens_details.reasoning_tokens == want
        # an earlier turn's reasoning item, handed back, is dropped
        again = c.responses.create(model=MODEL, max_output_tokens=5, temperature=0, input=[
            {"role": "user", "content": "Hi"}, r.output[0].model_dump(exclude_none=True),
            {"role": "assistant", "content": "It is sunny."}, {"role": "user", "content": "Thanks"}])
        assert again.status in ("completed", "incomplete")
    finally:
        srv.stop()


@pytest.mark.parametrize("extra,why", [
    ({"previous_response_id": "resp_1"}, "stores no responses"),
    ({"background": True}, "background"),
    ({"tools": [{"type": "web_search"}]}, "only function tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "only text"),
    ({"truncation": "auto"}, "truncation"),
    ({"input": [{"type": "image_generation_call", "id": "x"}]}, "not supported"),
    ({"tool_choice": "required"}, "needs tools"),
])
def test_what_it_cannot_do_is_refused(client, extra, why):
    with pytest.raises(BadRequestError, match=why):
        client.responses.create(**{"model": MODEL, "input": "hi", "max_output_tokens": 2, **extra})
