"""The M = 1 GEMV's K loop, compiled for sm_90 on this machine (no GPU needed): no shared-memory
shuffle and no barrier in it, int8 weights included (scripts/gemv_sass.py says why it matters), and
the int8 conversion in PTX costs fewer instructions than the same arithmetic in Triton ops."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _tools_present() -> bool:
    try:
        import triton
    except ImportError:
        return False
    return (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump").exists()


def _check(script: str) -> subprocess.CompletedProcess:
    """``scripts/<script> --check`` in a process of its own, compiling (TRITON_INTERPRET off); it must pass."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / script), "--check"], capture_output=True, text=True,
                       env=env, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    return p


@pytest.mark.skipif(not _tools_present(), reason="this Triton wheel ships no NVIDIA backend tools")
def test_gemv_k_loop_has_no_barrier_or_shared_memory_for_bf16_and_int8_weights():
    p = _check("gemv_sass.py")
    lines = [ln for ln in p.stdout.splitlines() if "instructions a loop trip" in ln]
    # bf16 once, each int8 case with the PTX and the Triton-ops conversion (--check: PTX has fewer)
    assert len(lines) == 9 and all("BAR 0, STS 0, LDS 0" in ln for ln in lines), p.stdout


def test_int8_gemv_reads_the_same_values_in_either_vector_width():
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from pageserve.kernels.gemv import weight_vector
    from pageserve.kernels.gemv_int8 import gemv_int8
    from pageserve.kernels.reference import quantize_int8

    assert weight_vector(2, True) == 8 and weight_vector(4, True) == 4
    assert weight_vector(2, False) == 0 and weight_vector(2, True, match_x=False) == 0
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(11)
    x = torch.randn(1, 300, generator=g).to(device)
    q, s = quantize_int8(torch.randn(70, 300, generator=g).to(device))
    ref = torch.nn.functional.linear(x.double(), (q.double() * s.double()[:, None]))
    for match_x in (True, False):
        got = gemv_int8(x, q, s, match_x=match_x)
        assert ((got.double() - ref).norm() / ref.norm()).item() < 1e-5, match_x


@pytest.mark.skipif(not _tools_present(), reason="this Triton wheel ships no NVIDIA backend tools")
def test_rope_in_the_decode_attention_costs_no_program_an_sm_at_the_engines_launches():
    # folded in after the key loop, the newest token's k and v stayed live through it: 154 registers a thread
    # against 111 at the split rule's 200-row launch, 3 programs an SM instead of 4 (scripts/decode_regs.py)
    p = _check("decode_regs.py")
    assert p.stdout.count("programs an SM") == 8, p.stdout  # four launches, with and without RoPE


_RELEASE_PTX = r'''
import importlib, sys
sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[1] + "/scripts")
from gemv_sass import compile_sm90
mi = importlib.import_module("pageserve.kernels.matmul_invariant")
kernel = mi._POINTER_KERNELS[1]
args = ["x_ptr", "w_ptr", "bias_ptr", "out_ptr", "M", "N", "K", "stride_xm", "stride_wn", "stride_om"]
for late in (False, True):
    const = dict(HAS_BIAS=False, BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, GROUP_M=8, PREC="ieee", UPCAST=0,
                 USE_PDL=True, SILU_MUL=True, LATE_RELEASE=late, SWAP_AB=False)
    sig = {n: "i32" for n in args}
    sig.update(x_ptr="*bf16", w_ptr="*bf16", bias_ptr="*bf16", out_ptr="*bf16", **{n: "constexpr" for n in const})
    ptx = compile_sm90(kernel, sig, const, {}, 4, 4).asm["ptx"]
    wait, release = ptx.find("griddepcontrol.wait"), ptx.find("griddepcontrol.launch_dependents")
    print(late, wait, release, ptx.find("mma.sync"), ptx.rfind("mma.sync"), ptx.find("st.global"))
'''


@pytest.mark.skipif(not _tools_present(), reason="this Triton wheel ships no NVIDIA backend tools")
def test_the_invariant_matmul_releases_the_next_kernel_where_asked():
    # pdl_release "top": wait, then release, before the first MMA; "after_loop": wait before the first MMA,
    # release after the last one and before the first store (the SiLU·mul epilogue's tile, sm_90 PTX)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-c", _RELEASE_PTX, str(ROOT)], capture_output=True, text=True, env=env,
                       timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = {ln.split()[0]: [int(v) for v in ln.split()[1:]] for ln in p.stdout.splitlines()}
    wait, release, first_mma, last_mma, store = rows["False"]
    assert 0 <= wait < release < first_mma < last_mma < store, rows
    wait, release, first_mma, last_mma, store = rows["True"]
    assert 0 <= wait < first_mma < last_mma < release < store, rows
