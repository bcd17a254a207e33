"""Streamed targets: keep what drafting needs resident, stream the other layers from CPU RAM or disk.

A target bigger than memory runs with accelerate's big-model inference. A device map says which
modules live on the execution device and which are offloaded; `from_pretrained(device_map=...)`
hands it to `accelerate.dispatch_model`, which leaves offloaded weights on the meta device and
attaches an `AlignDevicesHook` to their submodules. Each hook loads its weights just before the
module runs and drops them after, so every target pass re-reads the streamed layers (from a CPU
state dict, or memory-mapped from safetensors files on disk). `Target.run_layers` calls each layer
module directly, so the hooks fire for our hand-run layers exactly as inside `model.forward`; the
KV cache is allocated from the key states a layer produces, i.e. on the execution device.

The placement (which layers stay resident, which stream) is decode.placement's `plan_placement`;
this module loads a target with it, offers the command-line flags, and measures.

For a safetensors checkpoint, transformers points the disk offload index at the checkpoint's own
files (no copy); --offload-dir receives only weights it must re-save (other formats, converted
weights). On a CPU-only host accelerate treats "cpu" placement as resident (the execution device
*is* the CPU), so `--offload cpu` attaches accelerate's `cpu_offload` hooks to the streamed layers
itself: the same per-pass load/drop path a GPU host runs, without the PCIe copy.

    python -m decode.offload --config qwen3-14b-config.json --dtype bfloat16 --max-memory 8GiB \\
        --resident-layers 4 --offload disk --bandwidth 0.5GB,1.5GB,3GB
prints the placement and the estimated cost of one target pass at each disk bandwidth.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from decode.loading import DTYPES, local_config
from decode.placement import (
    OFFLOAD_MODES,
    OffloadConfig,
    OffloadError,
    empty_model,
    execution_device,
    fmt_bytes,
    parse_size,
    plan_placement,
)
from decode.precision import resolve_dtype
from decode.target import Target

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def check_offload_dir(path: str | None) -> str:
    """A folder accelerate can write offloaded weights to (a fresh temp folder when none is given)."""
    folder = Path(path) if path else Path(tempfile.mkdtemp(prefix="draftsmith-offload-"))
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise OffloadError(
            f"--offload-dir {folder} is not writable ({e.strerror or e}): point it at a folder you "
            "can write, preferably on a fast local disk"
        ) from e
    return str(folder)


def load_target(
    name_or_path: str | os.PathLike,
    dtype: str = "float32",
    attn: str = "sdpa",
    offload: OffloadConfig | None = None,
    resident_layers: int = 0,
    runtime: str = "fast",
) -> Target:
    """Load a target with its layers placed per `offload`; `resident_layers` = K layers drafting runs (never streamed).
    runtime: fast | hf (decode.runtime; a target with streamed layers always runs HF's modules)."""
    offload = offload or OffloadConfig()
    dtype = resolve_dtype(dtype, execution_device(offload.device), local_config(name_or_path))
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} not one of {sorted(DTYPES)} or 'auto'")
    if offload.mode == "none" and offload.max_memory is None:
        return Target.load(name_or_path, runtime, dtype=dtype, attn=attn, device=execution_device(offload.device))
    # 1. plan on an empty (meta) copy of the model: sizes only, no weights read.
    placement = plan_placement(empty_model(name_or_path, dtype), offload, resident_layers, DTYPES[dtype])
    if not placement.streamed_layers:
        target = Target.load(name_or_path, runtime, dtype=dtype, attn=attn, device=placement.device)
        target.placement = placement
        return target
    # 2. disk: fail now, not halfway through loading, if the offload folder cannot be written.
    if offload.mode == "disk":
        placement.offload_dir = check_offload_dir(offload.offload_dir)
    # 3. accelerate loads the resident weights, leaves the streamed ones on meta and hooks their modules.
    target = Target.load(
        name_or_path, dtype=dtype, attn=attn, device_map=placement.device_map, offload_folder=placement.offload_dir
    )
    # 4. resident modules drop their hooks: with one execution device a hook there only re-sends inputs that
    #    are already in place, and it ran on every draft step (early exit drafted ~1.5x slower with them).
    from accelerate.hooks import remove_hook_from_module

    for name, dev in placement.device_map.items():
        if dev == placement.device:
            remove_hook_from_module(target.model.get_submodule(name), recurse=True)
    # 5. CPU-only host: dispatch_model kept "cpu" layers resident; hook them so they stream like on a GPU host.
    if offload.mode == "cpu" and placement.device == "cpu":
        from accelerate import cpu_offload

        for i in placement.streamed_layers:
            cpu_offload(target.layers[i], execution_device=torch.device("cpu"))
        placement.notes.append(
            "cpu execution device: streamed layers are reloaded from a CPU state dict each pass "
            "(hook cost only, no copy)"
        )
    if offload.mode == "disk":
        files = streamed_files(target)
        folder = Path(placement.offload_dir)
        own = [f for f in files if not Path(f).resolve().is_relative_to(folder.resolve())]
        placement.notes.append(
            f"disk: streamed from {len(files)} file(s)"
            + (
                ", the checkpoint's own safetensors (accelerate maps them in place, no copy)"
                if own
                else " re-saved in --offload-dir"
            )
        )
        if offload.offload_dir is None and not any(folder.iterdir()):
            folder.rmdir()  # our temp folder, unused: nothing needed re-saving
            placement.offload_dir = None
    target.placement = placement
    return target


def streamed_files(target: Target) -> list[str]:
    """The files the streamed layers are read from each pass (disk mode; empty otherwise)."""
    files: set[str] = set()
    for module in target.model.modules():
        hook = getattr(module, "_hf_hook", None)
        for h in getattr(hook, "hooks", [hook]):
            wm = getattr(h, "weights_map", None) if getattr(h, "offload", False) else None
            wm = getattr(wm, "dataset", wm)  # PrefixedDataset -> OffloadedWeightsLoader
            for info in (getattr(wm, "index", None) or {}).values():
                if info.get("safetensors_file"):
                    files.add(info["safetensors_file"])
            if getattr(wm, "save_folder", None):
                files.update(str(p) for p in Path(wm.save_folder).glob("*.dat"))
    return sorted(files)


def drop_page_cache(paths: list[str]) -> None:
    """Ask the OS to evict these files from its page cache, so the next read really goes to disk."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# --- command-line options shared by decode.generate, decode.harness.evaluate and feature extraction ----------------


def add_offload_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("streamed target (accelerate big-model inference)")
    g.add_argument(
        "--offload",
        choices=OFFLOAD_MODES,
        default="none",
        help="where target layers that are not resident live; they are re-read every pass",
    )
    g.add_argument(
        "--max-memory",
        default=None,
        help="weight budget on the execution device (e.g. 8GiB); embeddings, norm, LM head and the "
        "drafter's layers always stay, then layers in order while they fit. Default with "
        "--offload: only that resident set (all other layers stream)",
    )
    g.add_argument(
        "--offload-dir",
        default=None,
        help="--offload disk: folder for weights accelerate must re-save (default: a temp folder)",
    )
    g.add_argument("--device", default="cpu", help="execution device: cpu or cuda:N")


def offload_config_from_args(args: argparse.Namespace) -> OffloadConfig:
    return OffloadConfig(args.offload, args.max_memory, args.offload_dir, args.device)


def load_target_from_args(args: argparse.Namespace, resident_layers: int = 0) -> Target:
    """The target named by --target/--dtype/--attn, placed per the offload flags (add_decode_args + add_offload_args)."""
    runtime = getattr(args, "runtime", "fast")
    return load_target(args.target, args.dtype, args.attn, offload_config_from_args(args), resident_layers, runtime)


def kv_bytes_per_token(config: PretrainedConfig, dtype: torch.dtype) -> int:
    """K and V for one token in every layer."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * torch.finfo(dtype).bits // 8


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m decode.offload",
        description="Plan a streamed target and estimate the cost of one pass (no weights read).",
    )
    ap.add_argument("--config", required=True, help="a model directory or its config.json")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--resident-layers", type=int, default=0, help="K layers the drafter runs (early-exit:K)")
    ap.add_argument("--bandwidth", default="0.5GB,1.5GB,3GB", help="disk read bandwidths per second, comma-separated")
    add_offload_args(ap)
    args = ap.parse_args(argv)
    model = empty_model(args.config, args.dtype)
    try:
        p = plan_placement(model, offload_config_from_args(args), args.resident_layers, DTYPES[args.dtype])
    except OffloadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    n = len(p.resident_layers) + len(p.streamed_layers)
    print(p.describe())
    print(
        f"layers: {len(p.resident_layers)} of {n} resident, {len(p.streamed_layers)} streamed; "
        f"KV cache {fmt_bytes(kv_bytes_per_token(model.config, DTYPES[args.dtype]))} per token"
    )
    print("| disk bandwidth | estimated target pass (streamed bytes / bandwidth) |\n|---|---|")
    for bw in args.bandwidth.split(","):
        print(f"| {bw}/s | {p.streamed_bytes / parse_size(bw, '--bandwidth'):.1f} s (estimate) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
