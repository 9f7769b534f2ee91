"""The hardware ceilings every kernel figure is read against, measured in the same run:
device-to-device copy and pure read bandwidth (GB/s), bf16 matmul (TFLOP/s)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .timing import eager_ms


@triton.jit
def _read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    base = tl.program_id(0).to(tl.int64) * BLOCK * ITERS
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(ITERS):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, axis=0))


def measure_ceilings(gib: float = 2.0) -> dict:
    """Measured on this device, in this run: device-to-device copy (read + write GB/s), a pure
    read (the best of torch.sum and a streaming Triton reduction), a bf16 8192^3 matmul."""
    n = int(gib * 2**30) // 2
    a = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    b = torch.empty_like(a)
    res = {}
    t = eager_ms(lambda: b.copy_(a))
    res["copy_gbps"] = 2 * a.numel() * 2 / t / 1e6
    t = eager_ms(lambda: a.sum(dtype=torch.float32))
    res["read_torch_sum_gbps"] = a.numel() * 2 / t / 1e6
    BLOCK, ITERS = 4096, 16
    part = torch.empty(triton.cdiv(n, BLOCK * ITERS), device="cuda", dtype=torch.float32)
    t = eager_ms(lambda: _read_kernel[(part.numel(),)](a, part, n, BLOCK=BLOCK, ITERS=ITERS, num_warps=8))
    res["read_triton_gbps"] = a.numel() * 2 / t / 1e6
    res["read_gbps"] = max(res["read_torch_sum_gbps"], res["read_triton_gbps"])
    del a, b
    m = 8192
    x = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    t = eager_ms(lambda: x @ y)
    res["matmul_bf16_tflops"] = 2 * m**3 / t / 1e9
    return res
