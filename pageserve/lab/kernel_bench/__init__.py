"""Correctness at full size and speed against the measured ceilings, for every kernel.

On the H200: ``python -m pageserve.lab.kernel_bench --out <dir>`` runs the checks in bf16, fp16
and fp32 at the 3B shapes, measures the ceilings and times every kernel as GPU time (calls back
to back in one CUDA graph), writes ``<dir>/kernels_bench.json`` and prints a table.
``--parts sweep_m1`` runs the GEMV config sweep at M = 1. One module per job:

- ``checks``      every kernel vs its float64 reference, per dtype (``lab/kernel_checks.py``)
- ``timing``      CUDA-graph timing with an eager fallback; weights rotated out of L2
- ``ceilings``    copy / read bandwidth and bf16 matmul TFLOP/s, measured in the same run
- ``throughput``  the elementwise kernels and prefill attention at their defaults
- ``sweeps``      decode-attention and GEMV config sweeps (GEMV vs cuBLAS, the M = 1 sweep)
- ``switches``    the TritonOps decode switches, kernel by kernel
- ``run``         all parts in one call (``run_benchmarks``) and the record's figures
- ``shapes``      the Qwen2.5-3B shapes measured

Nothing is imported here, so ``__main__`` can switch Triton's CPU interpreter on before the
kernels are first imported. The notebook 05_triton_kernels calls the same functions.
"""
