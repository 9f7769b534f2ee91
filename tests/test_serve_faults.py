"""Server failure paths with injected faults: auth, a full queue, one request failing, a
failing engine step, the tunnel's refusal and offline failure, and the CLI's flags."""
import asyncio
import json
import threading

import httpx
import pytest
from openai import AuthenticationError, OpenAI

from pageserve.engine.config import EngineConfig

MODEL = "smollm2-135m-instruct"


def post(server, body, path="/v1/completions", key=None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.url + path, json={"model": MODEL, **body}, headers=headers, timeout=120)


def blocks_used(server, key=None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    text = httpx.get(server.url + "/metrics", headers=headers).text
    line = next(l for l in text.splitlines() if l.startswith("pageserve_kv_blocks_used{"))
    return float(line.rsplit(" ", 1)[1])


def test_api_key_is_required_except_on_health(start_server):
    srv = start_server(api_key="s3cret", num_blocks=32)
    try:
        with pytest.raises(AuthenticationError):
            OpenAI(base_url=srv.base_url, api_key="wrong", max_retries=0).models.list()
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "Hi"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(srv.url + "/metrics").status_code == 401
        assert httpx.get(srv.url + "/health").status_code == 200
        ok = OpenAI(base_url=srv.base_url, api_key="s3cret", max_retries=0)
        assert ok.completions.create(model=MODEL, prompt="Hi", max_tokens=2).usage.completion_tokens == 2
    finally:
        srv.stop()


def test_a_browser_page_may_call_a_keyed_server_from_another_origin_unless_origins_are_restricted(start_server):
    preflight = {"Origin": "https://ui.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    srv = start_server(api_key="s3cret", num_blocks=32)
    try:
        # the preflight carries no key: it is answered before the key is asked for
        r = httpx.options(srv.url + "/v1/chat/completions", headers=preflight)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
        r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1},
                       headers={"Origin": "https://ui.example", "Authorization": "Bearer s3cret"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "Hi"}, headers={"Origin": "https://ui.example"})
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "*"  # the page can read why
    finally:
        srv.stop()
    srv = start_server(api_key="s3cret", num_blocks=32, allowed_origins=["https://ok.example"])
    try:
        assert httpx.options(srv.url + "/v1/completions", headers=preflight).status_code == 400
        r = httpx.options(srv.url + "/v1/completions", headers={**preflight, "Origin": "https://ok.example"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://ok.example"
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def small(start_server):
    """One running slot and one waiting slot: the third concurrent request is refused."""
    srv = start_server(max_num_seqs=1, max_waiting_requests=1, num_blocks=64)
    yield srv
    srv.stop()


def test_queue_full_answers_503_and_recovers(small):
    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            body = {"model": MODEL, "prompt": "Tell me a story", "max_tokens": 200, "ignore_eos": True,
                    "stream": True}
            opened = []
            for _ in range(2):  # one runs, one waits
                req = client.build_request("POST", small.url + "/v1/completions", json=body)
                resp = await client.send(req, stream=True)
                assert resp.status_code == 200
                opened.append(resp)
            third = await client.post(small.url + "/v1/completions", json={**body, "stream": False})
            for resp in opened:
                await resp.aclose()
            return third

    third = asyncio.run(main())
    assert third.status_code == 503
    err = third.json()["error"]
    assert err["code"] == "queue_full" and "max_waiting_requests=1" in err["message"]
    r = post(small, {"prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200


def test_one_failing_request_fails_alone(small, monkeypatch):
    llm = small.app.state.engine.engine
    original = llm._append_token

    def append(seq, tok, *args):
        if seq.prompt_token_ids[:3] == [7, 7, 7]:
            raise RuntimeError("injected fault in one request")
        return original(seq, tok, *args)

    monkeypatch.setattr(llm, "_append_token", append)
    results = {}

    def run(name, prompt):
        results[name] = post(small, {"prompt": prompt, "max_tokens": 4})

    threads = [threading.Thread(target=run, args=("victim", [7, 7, 7, 8])),
               threading.Thread(target=run, args=("bystander", "The weather today"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results["victim"].status_code == 500
    assert results["victim"].json()["error"]["type"] == "server_error"
    assert results["bystander"].status_code == 200
    assert results["bystander"].json()["usage"]["completion_tokens"] == 4
    assert post(small, {"prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_a_failing_step_fails_in_flight_requests_with_500_then_serves_again(small, monkeypatch):
    llm = small.app.state.engine.engine
    original = llm.runner.execute
    calls = {"n": 0}

    def execute(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected device fault")
        return original(*args, **kwargs)

    monkeypatch.setattr(llm.runner, "execute", execute)
    r = post(small, {"prompt": "Hello there", "max_tokens": 8, "ignore_eos": True})
    assert r.status_code == 500 and "injected device fault" in r.json()["error"]["message"]
    # streamed: the headers are out, so the failure arrives as an error event before [DONE]
    calls["n"] = 0
    s = post(small, {"prompt": "Hello there", "max_tokens": 8, "ignore_eos": True, "stream": True})
    events = [l[6:] for l in s.text.splitlines() if l.startswith("data: ")]
    assert events[-1] == "[DONE]" and "error" in json.loads(events[-2])
    assert blocks_used(small) == 0
    r = post(small, {"prompt": "Hello again", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert small.app.state.engine.num_step_failures == 2


# ------------------------------------------------------------------------ tunnel
def test_tunnel_refuses_without_an_api_key():
    from pageserve.serve.tunnel import TunnelError, open_tunnel

    with pytest.raises(TunnelError, match="API key"):
        open_tunnel(8000, None)


def test_serve_with_tunnel_and_no_key_exits_before_loading(capsys):
    from pageserve.cli import main

    assert main(["serve", "--tunnel"]) == 2
    assert "--api-key" in capsys.readouterr().err


def test_api_key_auto_generates_distinct_keys():
    from pageserve.serve.tunnel import resolve_api_key

    a, b = resolve_api_key("auto"), resolve_api_key("auto")
    assert a != b and len(a) >= 32
    assert resolve_api_key("mine") == "mine" and resolve_api_key(None) is None


def test_offline_tunnel_fails_in_one_line_and_the_server_keeps_running(small, monkeypatch):
    import pycloudflared

    from pageserve.serve import tunnel

    def offline(*args, **kwargs):
        raise OSError("cloudflared download failed: [Errno -3] Temporary failure in name resolution\nmore detail")

    monkeypatch.setattr(pycloudflared, "try_cloudflare", offline)
    with pytest.raises(tunnel.TunnelError) as e:
        tunnel.open_tunnel(small.port, "key")
    message = str(e.value)
    assert "\n" not in message and "name resolution" in message and f"127.0.0.1:{small.port}" in message
    assert httpx.get(small.url + "/health").status_code == 200


# ------------------------------------------------------------------------ the CLI
def test_every_engine_config_field_is_a_serve_flag():
    from pageserve.cli import build_parser
    from pageserve.serve.cli import engine_config_from_args

    parser = build_parser()
    assert engine_config_from_args(parser.parse_args(["serve"])).enable_prefix_caching is True  # on by default
    args = parser.parse_args(["serve", "--no-async-scheduling", "--no-enable-prefix-caching", "--num-blocks", "64",
                              "--max-model-len", "none", "--triton-options", '{"fuse": true}', "--port", "0"])
    cfg = engine_config_from_args(args)
    assert cfg.async_scheduling is False and cfg.enable_prefix_caching is False
    assert cfg.num_blocks == 64 and cfg.max_model_len is None and cfg.triton_options == {"fuse": True}
    help_text = parser._subparsers._group_actions[0].choices["serve"].format_help()
    for name in EngineConfig.field_names():
        assert "--" + name.replace("_", "-") in help_text
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--triton-options", "[1]"])


def test_serve_server_flags_parse_and_a_bad_one_stops_before_the_model_loads(capsys):
    from pageserve.cli import build_parser, main

    args = build_parser().parse_args(["serve", "--allowed-origins", '["https://a.example"]', "--enable-auto-tool-choice",
                                      "--tool-call-parser", "hermes"])
    assert args.allowed_origins == ["https://a.example"] and args.tool_call_parser == "hermes"
    for bad, why in ((["--allowed-origins", '"*"'], "JSON list"), (["--enable-auto-tool-choice"], "tool_call_parser")):
        assert main(["serve", "--model", "no-such-model", *bad]) == 2
        assert why in capsys.readouterr().err


# ------------------------------------------------------------------------ no tokenizer
def test_a_model_without_tokenizer_answers_with_token_ids():
    from pageserve.serve.api import build_app
    from pageserve.serve.background import build_engine, start_server_in_background

    engine = build_engine(model="smollm2-135m", device="cpu", dtype="float32", num_blocks=32, max_model_len=256)
    srv = start_server_in_background(build_app(engine))
    try:
        body = {"model": "smollm2-135m", "prompt": [[5, 6, 7], [8, 9]], "max_tokens": 3, "ignore_eos": True,
                "temperature": 0}
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60).json()
        assert [c["text"] for c in r["choices"]] == ["", ""]
        assert all(len(c["token_ids"]) == 3 for c in r["choices"])
        s = httpx.post(srv.url + "/v1/completions", json={**body, "stream": True}, timeout=60)
        chunks = [json.loads(l[6:]) for l in s.text.splitlines() if l.startswith("data: {")]
        streamed = {0: [], 1: []}
        for c in chunks:
            for choice in c["choices"]:
                streamed[choice["index"]] += choice["token_ids"]
        assert streamed == {c["index"]: c["token_ids"] for c in r["choices"]}
        assert httpx.post(srv.url + "/v1/completions", json={**body, "prompt": "text"}).status_code == 400
        chat = httpx.post(srv.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
        assert chat.status_code == 400
    finally:
        srv.stop()


def test_serve_args_turn_engine_config_keywords_into_the_generated_flags():
    from pageserve.serve.background import serve_args
    from pageserve.serve.cli import add_engine_config_args, engine_config_from_args
    import argparse

    kw = dict(block_size=32, enable_prefix_caching=True, enforce_eager=False, num_blocks=None,
              triton_options={"pdl": False}, max_model_len=1024, cuda_graph_sizes=[1, 8, 24])
    argv = serve_args(**kw)
    assert "--no-enforce-eager" in argv and "--enable-prefix-caching" in argv
    p = argparse.ArgumentParser()
    add_engine_config_args(p)
    cfg = engine_config_from_args(p.parse_args(argv))
    for k, v in kw.items():
        assert getattr(cfg, k) == v, k
    with pytest.raises(TypeError, match="not an EngineConfig field"):
        serve_args(no_such_knob=1)
