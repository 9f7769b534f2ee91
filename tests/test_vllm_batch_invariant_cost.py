"""lab.determinism.vllm_batch_invariant_cost: one vLLM process per setting, the ratios, failures kept out."""
from pageserve.lab.determinism import vllm_batch_invariant_cost


def fake_run_peer(results):
    calls = []

    def run(engine, model, workloads, out, decode, engine_args, env, **kw):
        calls.append({"engine": engine, "env": env, "engine_args": engine_args, "workloads": workloads, **kw})
        res = results[env["VLLM_BATCH_INVARIANT"]]
        if isinstance(res, Exception):
            raise res
        return res

    return run, calls


def rec(w1, b1, b64):
    return {"offline": {"w1": {"total_tok_s": w1}}, "decode": {"1": {"decode_ms": b1}, "64": {"decode_ms": b64}},
            "errors": {}}


def test_both_settings_run_in_their_own_process_and_give_ratios():
    run, calls = fake_run_peer({"0": rec(70000.0, 2.8, 3.4), "1": rec(35000.0, 4.2, 6.8)})
    figs = vllm_batch_invariant_cost(run, "qwen2.5-3b", {"w1": {}}, {"batches": [1, 64]}, "/tmp", {"max_model_len": 4096},
                                     timeout_s=5)
    assert [c["env"] for c in calls] == [{"VLLM_BATCH_INVARIANT": "0"}, {"VLLM_BATCH_INVARIANT": "1"}]
    assert all(c["engine"] == "vllm" and c["engine_args"] == {"max_model_len": 4096, "enable_prefix_caching": False}
               and c["timeout_s"] == 5 for c in calls)
    assert figs["vllm_det_w1_ratio"] == 0.5
    assert abs(figs["vllm_det_batch1_ratio"] - 1.5) < 1e-12 and figs["vllm_det_batch64_ratio"] == 2.0
    assert figs["vllm_default_w1_total_tok_s"] == 70000.0


def test_a_failing_setting_is_logged_and_leaves_no_ratio():
    logged = []
    run, _ = fake_run_peer({"0": rec(70000.0, 2.8, 3.4), "1": RuntimeError("batch invariance needs FLASH_ATTN")})
    figs = vllm_batch_invariant_cost(run, "m", {"w1": {}}, {"batches": [1]}, "/tmp", log=logged.append)
    assert "vllm_default_w1_total_tok_s" in figs and not any("ratio" in k for k in figs)
    assert "FLASH_ATTN" in logged[0]
