"""decode/precision.py: `auto` means bf16 exactly where the hardware computes it natively."""

from __future__ import annotations

from decode.precision import bf16_reason_from, cpu_flags, resolve_dtype


def test_bf16_is_native_only_with_the_hardware_feature():
    assert bf16_reason_from("cpu", {"avx2", "avx512f", "avx512_bf16"}) == "cpu has avx512_bf16"
    assert bf16_reason_from("cpu", {"avx512_bf16", "amx_bf16", "amx_tile"}) == "cpu has amx_bf16"
    assert bf16_reason_from("cpu", {"avx2", "avx512f"}) is None  # emulated bf16 gains nothing
    assert bf16_reason_from("cuda", set(), cuda_bf16=True) == "cuda supports bf16"
    assert bf16_reason_from("cuda", set(), cuda_bf16=False) is None
    assert bf16_reason_from("mps", {"avx512_bf16"}) is None


def test_auto_resolves_and_explicit_values_stay():
    assert resolve_dtype("auto", "cpu has avx512_bf16") == ("bfloat16", "cpu has avx512_bf16")
    assert resolve_dtype("auto", None) == ("float32", "no native bf16 here")
    assert resolve_dtype("float32", "cpu has avx512_bf16") == ("float32", "requested")


def test_cpu_flags_reads_the_flags_line(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx512_bf16\nbugs\t\t: spectre\n")
    assert cpu_flags(info) == {"fpu", "sse2", "avx512_bf16"}
    assert cpu_flags(tmp_path / "missing") == set()
