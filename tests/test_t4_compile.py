"""Every Triton kernel the engine launches on a T4 (sm_75, fp16), at the configs its own selection code picks
there, compiled for sm_75 on this machine (no GPU needed): it compiles, fits 64 KB of shared memory, holds no
bf16 or Hopper-only instruction, and does not spill (scripts/t4_compile_audit.py says which launches and why)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_kernels_sass import _tools_present

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not _tools_present(), reason="this Triton wheel ships no NVIDIA backend tools")
def test_every_engine_kernel_compiles_for_a_t4_within_its_shared_memory():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "t4_compile_audit.py"), "--check"], capture_output=True,
                       text=True, env=env, timeout=900)
    assert p.returncode == 0, p.stdout[-20000:] + p.stderr[-5000:]
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("[")]
    # the three modes, both models, and the kernels each mode's T4 path launches
    for mode in ("[default]", "[deterministic]", "[int8]"):
        assert any(ln.startswith(mode) for ln in lines), mode
    for kernel in ("_gemv_kernel", "_rms_norm_kernel", "_rope_kv_kernel", "_decode_split_kernel", "_prefill_kernel",
                   "_POINTER_KERNELS", "_split_kernel", "_argmax_partial_kernel", "_stage_decode_kernel",
                   "_dequant_kernel", "_apply_token_bitmask_kernel"):
        assert any(f": {kernel}" in ln for ln in lines), kernel
