"""TP=2 vs TP=1 on two GPUs, quickly: fp32 greedy identity through the CUDA-graph path, and
batch-1 decode ms/token in bf16. Usage: python scripts/tp_gpu_smoke.py [model]"""
import sys
import time

import torch

from pageserve.engine.llm import LLM
from pageserve.lab import bench
from pageserve.lab.parallel_checks import decode_ms_per_token, prompt_logits


def main(model: str = "qwen2.5-0.5b") -> None:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 150000, (64,), generator=g).tolist() for _ in range(8)]
    out, logits = {}, {}
    for dtype in ("float32", "bfloat16"):
        for tp in (1, 2):
            t0 = time.perf_counter()
            llm = LLM(model, tensor_parallel_size=tp, device="cuda", dtype=dtype, max_num_seqs=16, max_model_len=1024,
                      gpu_memory_utilization=0.5)
            start = time.perf_counter() - t0
            logits[tp, dtype] = prompt_logits(llm, prompts[:2]).cpu()
            res = llm.generate(prompts, bench.greedy_params(32), use_tqdm=False)
            out[tp, dtype] = [o.outputs[0].token_ids for o in res]
            ms = decode_ms_per_token(llm, 128, 64, 150000)
            print(f"{dtype} TP={tp}: start {start:.1f} s, graphs {llm.engine.runner.graphs is not None}, batch-1 {ms:.3f} ms/token", flush=True)
            llm.shutdown()
            del llm
            bench.free_device_memory()
    ref = logits[1, "float32"]
    print("fp32 greedy identical:", sum(a == b for a, b in zip(out[1, "float32"], out[2, "float32"])), "/ 8")
    print("fp32 logits rel diff:", ((logits[2, "float32"] - ref).norm() / ref.norm()).item())
    e1 = (logits[1, "bfloat16"] - ref).norm() / ref.norm()
    e2 = (logits[2, "bfloat16"] - ref).norm() / ref.norm()
    print("bf16 err ratio tp2/tp1:", (e2 / e1).item())


if __name__ == "__main__":
    main(*sys.argv[1:])
