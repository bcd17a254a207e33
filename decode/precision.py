"""Which floating-point precision is fast on this machine: bf16 where the hardware computes it natively.

A CPU with avx512_bf16 or AMX computes a bf16 GEMM ~4x faster than fp32 (DESIGN §7: 105 vs 420-470
GFLOP/s per core here); a CPU without them emulates bf16 and gains nothing. On CUDA, bf16 needs
compute capability >= 8.0 (torch.cuda.is_bf16_supported). `auto` settings resolve through
`resolve_dtype`: bf16 where `bf16_reason` names the hardware feature, fp32 elsewhere.

The decision is a pure function of the CPU flags and the CUDA answer (`bf16_reason_from`), so tests
give it any machine; `bf16_reason` reads this one.
"""

from __future__ import annotations

from pathlib import Path

import torch

# CPU flags (as /proc/cpuinfo spells them) that mean native bf16 arithmetic, best first.
CPU_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


def cpu_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> set[str]:
    """The CPU feature flags of this machine (empty where /proc/cpuinfo is missing, e.g. macOS)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def bf16_reason_from(device_type: str, flags: set[str], cuda_bf16: bool = False) -> str | None:
    """Why bf16 is native on this device ("cpu has avx512_bf16"), or None when it is not."""
    if device_type == "cuda":
        return "cuda supports bf16" if cuda_bf16 else None
    if device_type == "cpu":
        have = [f for f in CPU_BF16_FLAGS if f in flags]
        return f"cpu has {have[0]}" if have else None
    return None


def bf16_reason(device: str | torch.device = "cpu") -> str | None:
    """`bf16_reason_from` for this machine's `device`."""
    kind = torch.device(device).type
    if kind == "cuda":
        return bf16_reason_from(kind, set(), torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    return bf16_reason_from(kind, cpu_flags() if kind == "cpu" else set())


def resolve_dtype(value: str, native: str | None) -> tuple[str, str]:
    """(dtype name, why) for a dtype setting: `auto` -> "bfloat16" when `native` (a `bf16_reason`) says bf16
    is native here, else "float32"; any other value is returned as given, "requested"."""
    if value != "auto":
        return value, "requested"
    return ("bfloat16", native) if native else ("float32", "no native bf16 here")
