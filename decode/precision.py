"""Which dtype `auto` means: bf16 where the hardware has it and the model is big enough to gain from it.

One rule for the whole project (decoding, feature extraction, training's autocast), so every stage agrees.
"""

from __future__ import annotations

from pathlib import Path

import torch


def cpu_flags() -> set[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo; empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def has_bf16(device: str | torch.device = "cpu") -> bool:
    """bf16 arithmetic in hardware: a CUDA device with bf16, or a CPU with avx512_bf16 or AMX-bf16."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return dev.type == "cpu" and bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


# Below this many parameters a model's fp32 weights stay in the CPU's caches and a decode step is latency-bound:
# bf16 kernels then cost more per call than they save (stories260K: a 1-token verify pass 1.11 ms in bf16 vs
# 0.63 in fp32, one MLP matmul 26 vs 2 us); above it, bf16 halves the bytes each step streams (SmolLM2-135M:
# AR 35 vs 25 tok/s).
MIN_BF16_PARAMS = 16_000_000


def approx_params(config: dict) -> int:
    """Parameters of a decoder-only LM from its config.json: embeddings + per layer attention and MLP."""
    h, layers = int(config.get("hidden_size", 0)), int(config.get("num_hidden_layers", 0))
    inter = int(config.get("intermediate_size", 4 * h))
    return int(config.get("vocab_size", 0)) * h + layers * (4 * h * h + 3 * h * inter)


def resolve_dtype(dtype: str, device: str | torch.device = "cpu", config: dict | None = None) -> str:
    """`auto` -> bfloat16 where the hardware has bf16 (about 4x fp32's GEMM rate on this CPU) and the model is
    big enough to gain from it (`config`: its config.json; None = assume so), else float32.

    Lossless tests and bit-exact comparisons pin float32: bf16 greedy output can leave AR's at near-ties.
    """
    if dtype != "auto":
        return dtype
    small = config is not None and torch.device(device).type == "cpu" and approx_params(config) < MIN_BF16_PARAMS
    return "bfloat16" if has_bf16(device) and not small else "float32"


def bf16_reason(device: str | torch.device, config: dict | None) -> str:
    """Why `auto` chose what it did for this model on this device (decode.precision.resolve_dtype's rule)."""
    if not has_bf16(device):
        return "no bf16 in hardware"
    if resolve_dtype("auto", device, config) == "float32":
        return f"bf16 in hardware, but fp32 is faster for a model under {MIN_BF16_PARAMS // 1_000_000}M parameters"
    if torch.device(device).type == "cuda":
        return "cuda has bf16"
    return "cpu has " + next(f for f in ("amx_bf16", "avx512_bf16") if f in cpu_flags())
