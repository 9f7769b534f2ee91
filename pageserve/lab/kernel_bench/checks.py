"""The correctness sweep: every kernel against its float64 reference, for each dtype.

Small shapes on the CPU interpreter, the 3B shapes on the GPU (``kernel_checks.full_size_checks``).
A kernel that raises is recorded and the sweep goes on.
"""
from __future__ import annotations

import traceback

import torch

from .. import kernel_checks as checks
from .shapes import DTYPE_NAMES


def small_checks(dtype, device="cpu", seed=0) -> dict:
    """Small shapes (the CPU interpreter's size): name -> thunk returning a relative error."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "paged_decode_attn": lambda: checks.check_decode([0, 1, 16, 33, 70], 16, 2, 128, 16, dtype, device, gen,
                                                         num_splits=3),
        "paged_prefill_attn": lambda: checks.check_prefill([5, 1, 20, 1, 0], [40, 33, 20, 1, 0], 16, 2, 128, 16,
                                                           dtype, device, gen, pad_tokens=2),
        "write_kv": lambda: checks.check_write_kv([5, 1, 20], [40, 33, 20], 2, 128, 16, dtype, device, gen),
        "rms_norm": lambda: checks.check_rms_norm(4, 2048, dtype, device, gen),
        "add_rms_norm": lambda: checks.check_add_rms_norm(4, 2048, dtype, device, gen),
        "silu_and_mul": lambda: checks.check_silu_and_mul(4, 1024, dtype, device, gen),
        "rotary": lambda: checks.check_rotary(4, 16, 2, 128, dtype, device, gen),
        "gemv_m1": lambda: checks.check_gemv(1, 96, 512, dtype, device, gen),
        "gemv_m4": lambda: checks.check_gemv(4, 96, 512, dtype, device, gen),
        "gemv_nosplit_m1": lambda: checks.check_gemv(1, 96, 512, dtype, device, gen, split_k="never"),
        "gemv_nosplit_m4": lambda: checks.check_gemv(4, 96, 512, dtype, device, gen, split_k="never"),
        "silu_mul_gemv_m1": lambda: checks.check_silu_mul_gemv(1, 96, 512, dtype, device, gen),
        "silu_mul_gemv_m4": lambda: checks.check_silu_mul_gemv(4, 96, 512, dtype, device, gen),
        "rotary_write_kv": lambda: checks.check_rotary_write_kv([5, 1, 20], [40, 33, 20], 16, 2, 128, 16,
                                                                dtype, device, gen),
        "rope_decode_attn": lambda: checks.rope_decode_err([0, 1, 16, 33, 70], 16, 2, 128, 16, dtype, device, gen,
                                                           num_splits=3),
    }


def run_checks(dtypes=(torch.bfloat16,), full: bool | None = None, seed: int = 0) -> dict:
    """Every kernel vs its reference for each dtype. Returns ``{<kernel>_<dtype>_rel_err: float}``
    plus ``<kernel>_<dtype>_error`` (the exception text) for any that raised, and
    ``<kernel>_<dtype>_pass`` (1/0 against checks.TOLERANCE)."""
    cuda = torch.cuda.is_available()
    full = cuda if full is None else full
    device = "cuda" if cuda else "cpu"
    out: dict = {}
    for dtype in dtypes:
        dn = DTYPE_NAMES[dtype]
        table = (checks.full_size_checks(dtype, device, torch.Generator().manual_seed(seed)) if full
                 else small_checks(dtype, device, seed))
        for name, thunk in table.items():
            key = f"{name}_{dn}"
            try:
                err = float(thunk())
                out[f"{key}_rel_err"] = err
                out[f"{key}_pass"] = int(err <= checks.TOLERANCE[dtype])
            except Exception as e:  # record and go on: one broken kernel must not hide the rest
                out[f"{key}_error"] = f"{type(e).__name__}: {e}"[:2000]
                out[f"{key}_pass"] = 0
                traceback.print_exc()
            if cuda:
                torch.cuda.synchronize()
    return out
