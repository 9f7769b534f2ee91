"""Engine decode-step time with each TritonOps decode switch off and on (one model, graphs
re-captured per setting). The GPU session runs this to decide the switches' defaults.

    python scripts/decode_switches.py --out /tmp/out            # H200: qwen2.5-3b, bf16, batch 1 and 64
    python scripts/decode_switches.py --tiny --batches 1 --steps 2   # CPU smoke (interpreter)

Prints ms per step per setting and writes <out>/decode_switches.json.
"""
from __future__ import annotations

import argparse
import gc
import json
import os

import torch

from pageserve.lab.decode_bench import decode_step_ms, graph_replay_ms
from pageserve.model.triton_ops import TritonOps
from pageserve.kernels.gemv import device_config_path, parse_configs
from pageserve.engine.llm import LLM

SETTINGS = {  # TritonOps switches; each runs with the GEMV shape heuristic and with the tuned configs
    "all_off": {"fuse_rope_kv": False, "fuse_silu_down": False},
    "fuse_rope_kv": {"fuse_rope_kv": True, "fuse_silu_down": False},
    "fuse_silu_down": {"fuse_rope_kv": False, "fuse_silu_down": True},
    "rope_kv_silu_down": {"fuse_rope_kv": True, "fuse_silu_down": True, "pdl": False},
    # + programmatic dependent launch of the decode kernels over <= 8 rows (kernels/_util.py);
    # the default. (A variant where the GEMV prefetched its weights into L2 before waiting
    # measured slower, 2.64 vs 2.20 ms at batch 1: kernels/NOTES.md.)
    "pdl": {"fuse_rope_kv": True, "fuse_silu_down": True, "pdl": True},
}
TUNED = ("all_off", "rope_kv_silu_down", "pdl")  # also run with tuned GEMV configs


def build_llm(args) -> LLM:
    cuda = torch.cuda.is_available()
    common = dict(device="cuda" if cuda else "cpu", block_size=16, max_num_seqs=max(args.batches),
                  max_model_len=2048, enforce_eager=True, use_triton=True)
    if not args.tiny:
        return LLM(args.model, dtype="bfloat16" if cuda else "float32", seed=0, **common)
    from pageserve.model.config import ModelConfig
    from pageserve.model.decoder import Decoder

    cfg = ModelConfig(architecture="qwen2", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=2048, attention_bias=True,
                      eos_token_ids=[0])
    model = Decoder(cfg).to(common["device"])
    model.init_dummy_weights(seed=0, std=0.3)
    return LLM.from_model(model.eval(), dtype="float32", num_blocks=256, **common)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    ap.add_argument("--model", default="qwen2.5-3b")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer random model (CPU smoke run)")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--gemv-configs", default=None,
                    help="GEMV configs for the tuned settings: a kernels bench JSON (e.g. the sweep_m1 part's); "
                         "default: the package's file for this GPU")
    ap.add_argument("--only", default=None,
                    help="comma-separated setting names to run (tuned ones as tuned_<name>); default: all")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run the settings this many times in turn (the spread between rounds is the noise)")
    args = ap.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    llm = build_llm(args)
    runner = llm.engine.runner
    figures: dict = {}
    tuned_path = args.gemv_configs or str(device_config_path(torch.cuda.get_device_name())) if torch.cuda.is_available() \
        else args.gemv_configs
    settings = [(name, sw, False) for name, sw in SETTINGS.items()]
    if tuned_path and os.path.exists(tuned_path):
        settings += [("tuned_" + name, SETTINGS[name], True) for name in TUNED]
    else:
        print(f"no tuned GEMV configs ({tuned_path}): the tuned settings are skipped")
    if args.only:
        keep = set(args.only.split(","))
        settings = [s for s in settings if s[0] in keep]
    rounds = [(f"{name}_r{r}" if args.repeat > 1 else name, sw, tuned)
              for r in range(args.repeat) for name, sw, tuned in settings]
    for name, switches, tuned in rounds:
        configs: dict = {}
        if tuned:
            with open(tuned_path) as f:
                configs = parse_configs(json.load(f))
            print(f"{name}: {len(configs)} tuned GEMV configs from {tuned_path}", flush=True)
        ops = TritonOps(tuned_configs=configs, **{"pdl": False, **switches})
        runner.graphs = None
        gc.collect()
        runner.ops = ops
        runner.model.set_ops(ops)
        runner.enable_graphs()  # captures on CUDA; bookkeeping mode on the CPU
        for bs in args.batches:
            ms = decode_step_ms(llm, bs, args.context, args.steps, vocab_size=min(512, runner.cfg.vocab_size))
            figures[f"batch{bs}_{name}_ms_per_step"] = ms
            replay = graph_replay_ms(runner, bs)
            if replay is not None:
                figures[f"batch{bs}_{name}_replay_ms"] = replay
            print(f"{name:22s} batch {bs:3d}: {ms:8.3f} ms/step, graph replay alone {replay} ms", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "decode_switches.json"), "w") as f:
        json.dump({"settings": SETTINGS, "tuned_configs": tuned_path, "context": args.context, "figures": figures}, f,
                  indent=2)


if __name__ == "__main__":
    main()
