"""The fast runtime's fp32 CPU kernels (decode/gemm_avx2.cpp): the small-M GEMM over packed weights, and the small
ops around it (RMSNorm, SiLU-gate, rotary embedding in place), built with torch's C++ extension loader.

Built on first use (about 40 s; cached under torch's extensions directory, keyed by the source's hash), only on
an x86 CPU with AVX2 and FMA. Where it cannot be built or run, `kernel()` says why once and returns None, and
decode.runtime multiplies through aten instead: the kernel is a speed lever, never a requirement.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from functools import cache
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor

from decode.precision import cpu_flags

SOURCE = Path(__file__).with_name("gemm_avx2.cpp")
OFF = "DRAFTSMITH_GEMM"  # =aten: never build or use the kernel


@cache
def kernel() -> ModuleType | None:
    """The compiled module (pack, gemm, rms_norm, silu_mul, rope_), or None with the reason printed once to stderr."""
    if os.environ.get(OFF) == "aten":
        return None
    missing = {"avx2", "fma"} - cpu_flags()
    if missing:
        return None  # not an x86 CPU with AVX2 + FMA: aten's products are what there is
    from torch.utils.cpp_extension import load_inline

    src = SOURCE.read_text()
    name = "draftsmith_gemm_" + hashlib.sha256(src.encode()).hexdigest()[:10]
    t0 = time.perf_counter()
    try:
        mod = load_inline(
            name,
            cpp_sources=[src],
            functions=["pack", "gemm", "rms_norm", "silu_mul", "rope_"],
            extra_cflags=["-O3", "-mavx2", "-mfma"],
        )
    except Exception as e:  # no compiler, no headers: decode through aten rather than fail
        print(f"note: the AVX2 decode GEMM did not build ({type(e).__name__}); using aten's products", file=sys.stderr)
        return None
    took = time.perf_counter() - t0
    if took > 5:
        print(f"note: built the AVX2 decode GEMM in {took:.0f} s (cached for later runs)", file=sys.stderr)
    return mod


def usable(w: Tensor) -> bool:
    """Whether the kernel may multiply by this weight: fp32, on the CPU, and the kernel built."""
    return w.dtype == torch.float32 and w.device.type == "cpu" and kernel() is not None


def pack(w: Tensor) -> Tensor:
    """w [N, K] -> column panels [ceil(N / 16), K, 16] (zero-padded)."""
    return kernel().pack(w.detach())


def fused(t: Tensor) -> bool:
    """Whether the kernel's small ops (rms_norm, silu_mul, rope_) may run on this activation."""
    return t.dtype == torch.float32 and t.device.type == "cpu" and kernel() is not None


def gemm(x: Tensor, panels: Tensor, n: int) -> Tensor:
    """x [.., K] @ w.T -> [.., n] through the panels of `pack(w)`."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    return kernel().gemm(rows, panels, n).reshape(*x.shape[:-1], n)
