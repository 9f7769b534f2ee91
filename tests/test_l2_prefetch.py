"""The L2 weight prefetch (kernels/l2_prefetch.py): its plan and grid, its switches, and that the
decoder hands it the weights the layer reads next. The kernel itself is inline PTX, which the CPU
interpreter cannot run: its GPU test (logits unchanged in a graphed decode loop) is in
tests/test_cuda_graphs.py."""
from __future__ import annotations

import pytest
import torch

from pageserve.kernels.l2_prefetch import LINE, l2_prefetch, prefetch_grid, prefetch_plan
from pageserve.model.decoder import Decoder
from pageserve.model.ops import TorchOps
from pageserve.model.quant import QuantizedWeight, quantize_model
from pageserve.model.triton_ops import TritonOps


def test_the_plan_spends_the_budget_on_the_tensors_in_order():
    a, b, c = torch.zeros(10, 64, dtype=torch.bfloat16), torch.zeros(300, dtype=torch.int8), torch.zeros(64)
    # a: 1,280 bytes = 10 lines; b: 300 bytes = 3 lines (the last one partial); c: 256 bytes = 2 lines
    assert prefetch_plan([a, b, c], 10**6) == [10, 3, 2]
    assert prefetch_plan([a, b, c], 12 * LINE) == [10, 2, 0]
    assert prefetch_plan([a, b, c], 5 * LINE + 1) == [5, 0, 0]
    assert prefetch_plan([a, b, c], 0) == [0, 0, 0]
    with pytest.raises(ValueError, match="not contiguous"):
        prefetch_plan([a.t()], 10**6)


@pytest.mark.parametrize("lines,sms", [(1, 132), (409, 132), (65_536, 132), (262_144, 132), (10**7, 132), (5000, 4)])
def test_the_grid_covers_every_line_with_about_one_program_an_sm(lines, sms):
    per, programs = prefetch_grid(lines, sms)
    assert per & (per - 1) == 0 and 256 <= per <= 8192  # a power of two: tl.arange's length
    assert per * programs >= lines > per * (programs - 1)
    if 256 < per < 8192:
        assert programs <= sms


def test_bad_arguments_are_refused_and_cpu_tensors_ask_for_nothing():
    w = torch.zeros(8, 8)
    with pytest.raises(ValueError, match="evict"):
        l2_prefetch([w], 1024, evict="first")
    with pytest.raises(ValueError, match="1 to 3 tensors"):
        l2_prefetch([w] * 4, 1024)
    with pytest.raises(ValueError, match="1 to 3 tensors"):
        l2_prefetch([], 1024)
    assert l2_prefetch([w], 1024) is None  # CPU: nothing to launch
    with pytest.raises(ValueError, match="l2_prefetch_mb"):
        TritonOps(tuned_configs=False, l2_prefetch_mb=-1)
    with pytest.raises(ValueError, match="l2_prefetch_evict"):
        TritonOps(tuned_configs=False, l2_prefetch_evict="first")


@pytest.mark.parametrize("quantized", [False, True])
def test_the_ops_ask_for_the_weights_tensors_up_to_their_row_limit(tiny_qwen2_config, monkeypatch, quantized):
    import pageserve.model.triton_ops as triton_ops

    launched = []
    monkeypatch.setattr(triton_ops, "l2_prefetch", lambda tensors, budget, rows, **kw: launched.append(
        (tensors, budget, rows, kw)))
    model = Decoder(tiny_qwen2_config)
    model.init_dummy_weights(seed=0)
    if quantized:
        quantize_model(model, "int8")
    layer = model.layers[0]
    weights = (layer.self_attn.o_proj.weight, layer.mlp.gate_up_proj.weight, layer.mlp.down_proj.weight)
    ops = TritonOps(tuned_configs=False, l2_prefetch_mb=1, l2_prefetch_max_rows=4, l2_prefetch_evict="last")
    for rows in (1, 4, 5):
        ops.prefetch_weights(torch.zeros(rows, 8), weights)
    TritonOps(tuned_configs=False).prefetch_weights(torch.zeros(1, 8), weights)  # off by default
    assert [r for _, _, r, _ in launched] == [1, 4]  # 5 rows: over the limit
    for tensors, budget, _, kw in launched:
        # a quantized weight's int8 matrix (its bytes are what the product reads)
        want = [w.qweight if quantized else w for w in weights]
        assert len(tensors) == 3 and all(t is w for t, w in zip(tensors, want))
        assert all(t.dtype == (torch.int8 if quantized else torch.float32) for t in tensors)
        assert (budget, kw["evict"], kw["before_wait"]) == (2**20, "last", False)


def test_the_decoder_layer_hands_the_hint_to_its_ops(tiny_qwen2_config):
    # the layer's own forward calls prefetch_weights once per layer with the step's rows
    model = Decoder(tiny_qwen2_config)
    model.init_dummy_weights(seed=0)
    seen = []

    class Hinted(TorchOps):
        def prefetch_weights(self, x, weights):
            seen.append((x.shape[0], tuple(w.shape for w in weights)))

    model.set_ops(Hinted())

    class NoCache:
        def attend(self, layer, q, k, v, scale):
            return q.repeat_interleave(1, dim=1)  # values do not matter here, only the calls

    positions = torch.arange(3)
    with torch.no_grad():
        model(torch.arange(3), positions, NoCache())
    cfg = tiny_qwen2_config
    want = ((cfg.hidden_size, cfg.q_size), (2 * cfg.intermediate_size, cfg.hidden_size),
            (cfg.hidden_size, cfg.intermediate_size))
    assert seen == [(3, want)] * cfg.num_layers
