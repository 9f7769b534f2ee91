"""The engine thread's step timings: every new metric appears in /metrics and moves after a
request, /v1/engine_stats summarises them, and the timing adds no host-device sync."""
import re
import traceback

import httpx
import pytest
import torch

from pageserve.engine.config import EngineConfig
from pageserve.engine.llm_engine import LLMEngine
from pageserve.engine.sampling_params import SamplingParams
from pageserve.model.decoder import Decoder

MODEL = "smollm2-135m-instruct"

# (name as exposed, labels it must carry)
STEP_METRICS = [
    ('pageserve_step_seconds_count', 'kind="decode"'),
    ('pageserve_step_seconds_count', 'kind="mixed"'),
    ('pageserve_step_host_seconds_count', ""),
    ('pageserve_step_host_seconds_sum', ""),
    ('pageserve_step_launch_offcpu_seconds_count', ""),
    ('pageserve_step_wait_seconds_count', ""),
    ('pageserve_postprocess_seconds_sum', ""),
    ('pageserve_engine_overhead_seconds_count', ""),
    ('pageserve_step_batch_size_sum', ""),
    ('pageserve_engine_idle_seconds_total', ""),
    ('pageserve_engine_commands_seconds_total', ""),
]


def read(text: str, name: str, label: str) -> float:
    m = re.search(rf"^{name}\{{[^}}]*{re.escape(label)}[^}}]*\}} ([0-9.e+-]+)$", text, re.M)
    assert m, f"{name}{{{label}}} missing from /metrics"
    return float(m.group(1))


@pytest.fixture(scope="module")
def server(start_server):
    srv = start_server()
    yield srv
    srv.stop()


def completion(server, max_tokens=6):
    r = httpx.post(server.base_url + "/completions", timeout=120,
                   json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": max_tokens, "stream": True})
    assert r.status_code == 200


@pytest.mark.parametrize("name,label", STEP_METRICS)
def test_step_metric_appears_and_moves_after_a_request(server, name, label):
    before = read(httpx.get(server.url + "/metrics").text, name, label)
    completion(server)
    after = read(httpx.get(server.url + "/metrics").text, name, label)
    assert after > before


def test_switch_interval_is_exported(server):
    import sys

    text = httpx.get(server.url + "/metrics").text
    assert read(text, "pageserve_switch_interval_seconds", "") == pytest.approx(sys.getswitchinterval())


def test_engine_stats_summarises_the_steps_since_a_mark(server):
    mark = httpx.get(server.base_url + "/engine_stats").json()["num_records"]
    completion(server, max_tokens=8)
    s = httpx.get(server.base_url + "/engine_stats", params={"since": mark}).json()
    assert s["count"] >= 8 and s["num_records"] >= mark + s["count"]
    assert 0 < s["mixed_step_frac"] < 1  # the prompt's prefill, then decodes
    for key in ("decode.total_ms_p50", "host_ms_p50", "post_ms_p50", "wait_ms_p50", "launch_offcpu_ms_p50"):
        assert s[key] >= 0, key
    assert s["decode.total_ms_p50"] > 0 and s["switch_interval_s"] > 0
    assert s["engine"]["num_mixed_steps"] >= 1 and s["engine"]["host_time_s"] > 0
    empty = httpx.get(server.base_url + "/engine_stats", params={"since": s["num_records"]}).json()
    assert empty["count"] == 0


# ------------------------------------------------------------------------ no new syncs
# Every call that can make the host wait for the device, by the function that calls it.
# Pinned from the stepping path before the timing was added: a new caller (in llm_engine,
# step_stats or async_engine especially) fails here.
_SYNC_POINTS = [
    (torch.Tensor, "item"), (torch.Tensor, "tolist"), (torch.Tensor, "cpu"), (torch.Tensor, "numpy"),
    (torch.cuda, "synchronize"), (torch.cuda.Event, "synchronize"), (torch.cuda.Event, "query"),
    (torch.cuda.Stream, "synchronize"),
]


def test_step_timing_adds_no_host_device_sync(tiny_qwen2_config, monkeypatch):
    torch.manual_seed(0)
    model = Decoder(tiny_qwen2_config).eval()
    engine = LLMEngine.from_model(model, EngineConfig(model="tiny", device="cpu", dtype="float32", num_blocks=64,
                                                      block_size=16, max_num_seqs=8, seed=0))
    callers: set[tuple[str, str]] = set()

    def spy(owner, name):
        original = getattr(owner, name)

        def wrapped(*args, **kwargs):
            frame = traceback.extract_stack(limit=2)[0]
            callers.add((frame.filename.rsplit("/", 1)[-1], frame.name))
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapped)

    for owner, name in _SYNC_POINTS:
        spy(owner, name)
    for i in range(3):
        engine.add_request(f"r{i}", list(range(10 + i, 30 + i)), SamplingParams(max_tokens=6, ignore_eos=True))
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        assert engine.last_step.kind in ("decode", "mixed")
    assert steps >= 6
    # on the CPU the one reader is the sampled tokens' landing (one per step, as before)
    assert callers == {("sampler.py", "_parse")}, callers
