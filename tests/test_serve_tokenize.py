"""The server's /tokenize and /detokenize routes and its chat-template options (vLLM's
``--chat-template`` and a request's ``chat_template_kwargs``), live on 127.0.0.1."""
import httpx
import pytest
from openai import BadRequestError, OpenAI

from pageserve.serve.api import load_chat_template

MODEL = "smollm2-135m-instruct"
HI = [{"role": "user", "content": "Say hi"}]
# a template that shows what it was given: each message as "<role>|<content>", and a variable the
# request may pass (chat_template_kwargs), so a test can see which template rendered the prompt
MARKER_TEMPLATE = ("{% for m in messages %}<<{{ m.role }}|{{ m.content }}>>{% endfor %}"
                   "{% if shout %}SHOUT{% endif %}{% if add_generation_prompt %}ASSISTANT:{% endif %}")


@pytest.fixture(scope="module")
def servers(start_server, tmp_path_factory):
    """(a server with the tokenizer's own template, one started with --chat-template's file and
    --enable-tokenizer-info-endpoint)."""
    path = tmp_path_factory.mktemp("template") / "chat.jinja"
    path.write_text(MARKER_TEMPLATE)
    pair = start_server(), start_server(chat_template=str(path), enable_tokenizer_info=True)
    yield pair
    for srv in pair:
        srv.stop()


@pytest.fixture
def server(servers):
    return servers[0]


@pytest.fixture
def templated(servers):
    return servers[1]


def post(server, route, body):
    return httpx.post(server.url + route, json=body, timeout=60)


def test_tokenize_a_prompt_gives_the_ids_completions_would_encode(server, smollm2):
    tok = smollm2.tokenizer
    r = post(server, "/tokenize", {"model": MODEL, "prompt": "Paged attention, in brief"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tok.encode("Paged attention, in brief")
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 1024
    strs = post(server, "/tokenize", {"prompt": "Paged attention", "return_token_strs": True}).json()["token_strs"]
    assert strs == tok.hf.convert_ids_to_tokens(tok.encode("Paged attention"))


def test_tokenize_messages_counts_the_chat_prompt_the_server_runs(server, client_for, smollm2):
    ids = post(server, "/tokenize", {"messages": HI}).json()["tokens"]
    assert ids == smollm2.tokenizer.apply_chat_template(HI)
    # the count is the prompt the chat route charges for
    usage = client_for(server).chat.completions.create(model=MODEL, messages=HI, max_tokens=1, temperature=0).usage
    assert usage.prompt_tokens == len(ids)
    no_prompt = post(server, "/tokenize", {"messages": HI, "add_generation_prompt": False}).json()["tokens"]
    assert len(no_prompt) < len(ids)


def test_detokenize_inverts_tokenize(server):
    text = "Continuous batching keeps the GPU busy."
    ids = post(server, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()["tokens"]
    assert post(server, "/detokenize", {"tokens": ids}).json() == {"prompt": text}


@pytest.mark.parametrize("route,body,param", [
    ("/tokenize", {"prompt": "x", "messages": HI}, "prompt"),
    ("/tokenize", {}, "prompt"),
    ("/detokenize", {"tokens": [1, -1]}, "tokens"),
    ("/detokenize", {"tokens": [10 ** 9]}, "tokens"),
    ("/tokenize", {"messages": HI, "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
])
def test_tokenize_routes_refuse_bad_input_with_a_400(server, route, body, param):
    r = post(server, route, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_tokenize_routes_answer_404_for_another_model(server):
    r = post(server, "/tokenize", {"model": "nope", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_chat_template_flag_replaces_the_tokenizers_template(templated, client_for, smollm2):
    ids = post(templated, "/tokenize", {"messages": HI}).json()["tokens"]
    expected = "<<user|Say hi>>ASSISTANT:"
    assert ids == smollm2.tokenizer.encode(expected, add_special_tokens=False)
    usage = client_for(templated).chat.completions.create(model=MODEL, messages=HI, max_tokens=1,
                                                          temperature=0).usage
    assert usage.prompt_tokens == len(ids)


def test_chat_template_kwargs_reach_the_template(templated, client_for, smollm2):
    ids = post(templated, "/tokenize", {"messages": HI, "chat_template_kwargs": {"shout": True}}).json()["tokens"]
    assert ids == smollm2.tokenizer.encode("<<user|Say hi>>SHOUTASSISTANT:", add_special_tokens=False)
    client = client_for(templated)
    plain = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=1, temperature=0).usage
    shout = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=1, temperature=0,
                                           extra_body={"chat_template_kwargs": {"shout": True}}).usage
    assert shout.prompt_tokens > plain.prompt_tokens
    with pytest.raises(BadRequestError, match="chat_template_kwargs"):
        client.chat.completions.create(model=MODEL, messages=HI, max_tokens=1,
                                       extra_body={"chat_template_kwargs": {"add_generation_prompt": False}})


def test_load_chat_template_takes_a_file_or_template_text_and_refuses_anything_else(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text(MARKER_TEMPLATE)
    assert load_chat_template(str(f)) == MARKER_TEMPLATE
    assert load_chat_template(MARKER_TEMPLATE) == MARKER_TEMPLATE
    assert load_chat_template(None) is None
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        load_chat_template(str(tmp_path / "missing.jinja"))


def test_serve_refuses_a_mistyped_chat_template_before_loading_the_model(tmp_path, capsys):
    from pageserve.cli import main

    # a model path that does not exist: the template's error must come first
    assert main(["serve", "--model", str(tmp_path / "no-model"), "--chat-template", str(tmp_path / "x.jinja")]) == 2
    assert "neither a file nor a Jinja template" in capsys.readouterr().err


@pytest.fixture(scope="module")
def client_for():
    return lambda srv: OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=120)


def test_tokenizer_info_is_off_by_default_and_serves_what_a_remote_tokenizer_needs(server, templated, smollm2):
    assert httpx.get(server.url + "/tokenizer_info").status_code == 404
    info = httpx.get(templated.url + "/tokenizer_info").json()
    hf = smollm2.tokenizer.hf
    assert info["eos_token"] == hf.eos_token and info["bos_token"] == hf.bos_token
    assert info["chat_template"] == MARKER_TEMPLATE and info["model_max_length"] == 1024
    # lm-evaluation-harness's check before it tokenizes through the server: /tokenize without special tokens
    ids = post(templated, "/tokenize", {"prompt": "test", "add_special_tokens": False}).json()["tokens"]
    assert ids == smollm2.tokenizer.encode("test", add_special_tokens=False)


def test_version_route_names_the_installed_package(server):
    from pageserve.cli import version

    r = httpx.get(server.url + "/version")
    assert r.status_code == 200 and r.json() == {"version": version()}


PREFILL = [{"role": "user", "content": "What is the capital of France?"},
           {"role": "assistant", "content": "The capital of France is"}]


def test_continue_final_message_leaves_the_last_message_open_and_echo_leads_with_it(server, client_for, smollm2):
    tok = smollm2.tokenizer
    ids = post(server, "/tokenize", {"messages": PREFILL, "add_generation_prompt": False,
                                     "continue_final_message": True}).json()["tokens"]
    closed = tok.hf.apply_chat_template(PREFILL, tokenize=False)
    opened = tok.decode(ids, skip_special_tokens=False)
    assert opened.endswith("The capital of France is") and closed.startswith(opened) and closed != opened
    client = client_for(server)
    kw = dict(model=MODEL, messages=PREFILL, max_tokens=4, temperature=0,
              extra_body={"add_generation_prompt": False, "continue_final_message": True})
    plain = client.chat.completions.create(**kw).choices[0].message.content
    assert plain == " Paris."  # the open sentence, finished
    echoed = client.chat.completions.create(**{**kw, "extra_body": {**kw["extra_body"], "echo": True}})
    assert echoed.choices[0].message.content == "The capital of France is" + plain
    chunks = [c for c in client.chat.completions.create(**{**kw, "extra_body": {**kw["extra_body"], "echo": True}},
                                                        stream=True) if c.choices]
    assert chunks[0].choices[0].delta.content == "The capital of France is"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "The capital of France is" + plain
    # echo repeats only an assistant's last message
    hi = client.chat.completions.create(model=MODEL, messages=PREFILL[:1], max_tokens=3, temperature=0,
                                        extra_body={"echo": True}).choices[0].message.content
    assert not hi.startswith("What is")


def test_continue_final_message_and_a_generation_prompt_together_are_refused(server):
    for route in ("/tokenize", "/v1/chat/completions"):
        r = post(server, route, {"model": MODEL, "messages": PREFILL, "continue_final_message": True})
        assert r.status_code == 400 and "add_generation_prompt" in r.json()["error"]["message"], r.text
