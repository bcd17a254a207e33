"""Streamed targets: keep what drafting needs resident, stream the other layers from CPU RAM or disk.

A target bigger than memory runs with accelerate's big-model inference. A device map says which
modules live on the execution device and which are offloaded; `from_pretrained(device_map=...)`
hands it to `accelerate.dispatch_model`, which leaves offloaded weights on the meta device and
attaches an `AlignDevicesHook` to their submodules. Each hook loads its weights just before the
module runs and drops them after, so every target pass re-reads the streamed layers (from a CPU
state dict, or memory-mapped from safetensors files on disk). `Target.run_layers` calls each layer
module directly, so the hooks fire for our hand-run layers exactly as inside `model.forward`; the
KV cache is allocated from the key states a layer produces, i.e. on the execution device.

The placement (`plan_placement`):
1. always resident: embeddings, rotary embedding, final norm, LM head, and layers [0, K) where K is
   the deepest target layer a drafter runs (early-exit:K, LayerSkip), so drafting never streams;
2. then layers K, K+1, ... stay resident while they fit in --max-memory (a weight budget);
3. the remaining layers go to "cpu" or "disk" and stream on every pass.
Without --max-memory an offload mode keeps only step 1 resident: streaming is forced.

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
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from decode.loading import DTYPES, local_config, resolve_model_path
from decode.precision import resolve_dtype
from decode.target import Target

OFFLOAD_MODES = ("none", "cpu", "disk")


class OffloadError(ValueError):
    """An offload setting that cannot work: a budget too small for the resident set, an unwritable folder."""


@dataclass
class OffloadConfig:
    """Where the target's weights live while decoding (the --offload, --max-memory, --offload-dir, --device flags)."""

    mode: str = "none"  # none | cpu | disk: where the layers that are not resident go
    max_memory: str | None = None  # weight budget on the execution device, e.g. "8GiB"; None = resident set only
    offload_dir: str | None = None  # disk mode: folder for weights accelerate must re-save (default: a temp folder)
    device: str = "cpu"  # execution device: every layer runs here (cuda:0 on a GPU host)


@dataclass
class Placement:
    """A device map and what it costs: weight bytes kept on the execution device and streamed per pass."""

    mode: str
    device: str
    device_map: dict[str, str]
    resident_layers: list[int]
    streamed_layers: list[int]
    resident_bytes: int
    streamed_bytes: int
    offload_dir: str | None = None
    budget_bytes: int | None = None
    notes: list[str] = field(default_factory=list)

    def summary(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        layers = f", layers {spans(self.resident_layers)}" if self.resident_layers else ""
        res = f"resident {fmt_bytes(self.resident_bytes)} (embeddings, norm, LM head{layers})"
        if not self.streamed_layers:
            return f"[offload {self.mode}] on {self.device}: {res}; nothing streamed"
        return (f"[offload {self.mode}] on {self.device}: {res}; streamed every pass {fmt_bytes(self.streamed_bytes)} "
                f"(layers {spans(self.streamed_layers)}) from {self.mode}" + "".join(f"; {n}" for n in self.notes))


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


def spans(ids: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5' ('none' when empty)."""
    out: list[str] = []
    for i in ids:
        if out and int(out[-1].split("-")[-1]) == i - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{i}"
        else:
            out.append(str(i))
    return ",".join(out) or "none"


def parse_size(text: str, what: str = "--max-memory") -> int:
    """'8GiB', '500MB', '1e9' or a byte count -> bytes (accelerate's units: GiB = 2**30, GB = 10**9)."""
    from accelerate.utils import convert_file_size_to_int

    s = text.strip()
    try:
        return int(float(s)) if s.replace(".", "", 1).replace("e", "", 1).isdigit() else convert_file_size_to_int(s)
    except ValueError:
        raise OffloadError(f"{what} {text!r}: expected a size like 8GiB, 500MB or a byte count") from None


def execution_device(name: str) -> str:
    dev = torch.device(name)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise OffloadError(f"--device {name}: no CUDA device is visible; use --device cpu")
        return f"cuda:{dev.index or 0}"
    return str(dev)


def empty_model(name_or_path: str | os.PathLike, dtype: str = "float32") -> nn.Module:
    """The model's modules on the meta device (sizes and names only, no weights read): a model dir or a config.json."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    p = Path(name_or_path)
    config = AutoConfig.from_pretrained(str(p) if p.is_file() else resolve_model_path(name_or_path))
    with init_empty_weights():
        return AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype])


def module_names(model: nn.Module) -> tuple[list[str], list[str]]:
    """Device-map keys: the modules besides the decoder layers (embeddings, rotary, norm, head) and one per layer."""
    if not hasattr(model, "model") or not hasattr(model.model, "layers"):
        raise OffloadError(f"{type(model).__name__} lacks model.model.layers: cannot plan which layers to stream")
    inner = [f"model.{n}" for n, _ in model.model.named_children() if n != "layers"]
    outer = [n for n, _ in model.named_children() if n != "model"]
    return inner + outer, [f"model.layers.{i}" for i in range(len(model.model.layers))]


def plan_placement(model: nn.Module, offload: OffloadConfig, resident_layers: int = 0,
                   dtype: torch.dtype | None = None) -> Placement:
    """Which modules stay on the execution device and which stream (module docstring, steps 1-3)."""
    from accelerate.utils import compute_module_sizes

    if offload.mode not in OFFLOAD_MODES:
        raise OffloadError(f"--offload {offload.mode!r}: expected one of {', '.join(OFFLOAD_MODES)}")
    device = execution_device(offload.device)
    sizes = compute_module_sizes(model, dtype=dtype)
    base, layers = module_names(model)
    n_layers = len(layers)
    k = max(0, min(resident_layers, n_layers))
    size = {name: sizes.get(name, 0) for name in base + layers}  # a tied LM head is counted once, under the embeddings
    budget = parse_size(offload.max_memory) if offload.max_memory else None
    base_bytes = sum(size[n] for n in base)
    need = base_bytes + sum(size[n] for n in layers[:k])

    # 1. the resident set must fit; mode none keeps everything, so everything must fit.
    if offload.mode == "none":
        total = need + sum(size[n] for n in layers[k:])
        if budget is not None and total > budget:
            raise OffloadError(f"the target's weights need {fmt_bytes(total)} but --max-memory is {offload.max_memory}: "
                               "add --offload disk (or cpu) to stream the layers that do not fit")
        resident = list(range(n_layers))
    else:
        if budget is not None and need > budget:
            raise OffloadError(
                f"--max-memory {offload.max_memory} cannot hold the resident drafting set: embeddings, norm and "
                f"LM head ({fmt_bytes(base_bytes)}) + layers 0..{k - 1} the drafter runs "
                f"({fmt_bytes(need - base_bytes)}) = {fmt_bytes(need)}; raise --max-memory to at least "
                f"{fmt_bytes(need)} or use a drafter that runs fewer target layers")
        # 2. fill the budget with the next layers, in order; 3. the rest streams.
        left = budget - need if budget is not None else 0
        resident = list(range(k))
        for i in range(k, n_layers):
            if size[layers[i]] > left:
                break
            left -= size[layers[i]]
            resident.append(i)
    streamed = [i for i in range(n_layers) if i not in resident]
    device_map = {n: device for n in base}
    device_map.update({layers[i]: device if i in resident else offload.mode for i in range(n_layers)})
    return Placement(offload.mode, device, device_map, resident, streamed,
                     base_bytes + sum(size[layers[i]] for i in resident), sum(size[layers[i]] for i in streamed),
                     budget_bytes=budget)


def check_offload_dir(path: str | None) -> str:
    """A folder accelerate can write offloaded weights to (a fresh temp folder when none is given)."""
    folder = Path(path) if path else Path(tempfile.mkdtemp(prefix="draftsmith-offload-"))
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise OffloadError(f"--offload-dir {folder} is not writable ({e.strerror or e}): point it at a folder you "
                           "can write, preferably on a fast local disk") from e
    return str(folder)


def load_target(name_or_path: str | os.PathLike, dtype: str = "float32", attn: str = "sdpa",
                offload: OffloadConfig | None = None, resident_layers: int = 0) -> Target:
    """Load a target with its layers placed per `offload`; `resident_layers` = K layers drafting runs (never streamed)."""
    offload = offload or OffloadConfig()
    dtype = resolve_dtype(dtype, execution_device(offload.device), local_config(name_or_path))
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} not one of {sorted(DTYPES)} or 'auto'")
    if offload.mode == "none" and offload.max_memory is None:
        return Target.load(name_or_path, dtype=dtype, attn=attn, device=execution_device(offload.device))
    # 1. plan on an empty (meta) copy of the model: sizes only, no weights read.
    placement = plan_placement(empty_model(name_or_path, dtype), offload, resident_layers, DTYPES[dtype])
    if not placement.streamed_layers:
        target = Target.load(name_or_path, dtype=dtype, attn=attn, device=placement.device)
        target.placement = placement
        return target
    # 2. disk: fail now, not halfway through loading, if the offload folder cannot be written.
    if offload.mode == "disk":
        placement.offload_dir = check_offload_dir(offload.offload_dir)
    # 3. accelerate loads the resident weights, leaves the streamed ones on meta and hooks their modules.
    target = Target.load(name_or_path, dtype=dtype, attn=attn, device_map=placement.device_map,
                         offload_folder=placement.offload_dir)
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
        placement.notes.append("cpu execution device: streamed layers are reloaded from a CPU state dict each pass "
                               "(hook cost only, no copy)")
    if offload.mode == "disk":
        files = streamed_files(target)
        folder = Path(placement.offload_dir)
        own = [f for f in files if not Path(f).resolve().is_relative_to(folder.resolve())]
        placement.notes.append(f"disk: streamed from {len(files)} file(s)" + (
            ", the checkpoint's own safetensors (accelerate maps them in place, no copy)" if own else
            " re-saved in --offload-dir"))
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
    g.add_argument("--offload", choices=OFFLOAD_MODES, default="none",
                   help="where target layers that are not resident live; they are re-read every pass")
    g.add_argument("--max-memory", default=None,
                   help="weight budget on the execution device (e.g. 8GiB); embeddings, norm, LM head and the "
                        "drafter's layers always stay, then layers in order while they fit. Default with "
                        "--offload: only that resident set (all other layers stream)")
    g.add_argument("--offload-dir", default=None,
                   help="--offload disk: folder for weights accelerate must re-save (default: a temp folder)")
    g.add_argument("--device", default="cpu", help="execution device: cpu or cuda:N")


def offload_config_from_args(args: argparse.Namespace) -> OffloadConfig:
    return OffloadConfig(args.offload, args.max_memory, args.offload_dir, args.device)


def load_target_from_args(args: argparse.Namespace, resident_layers: int = 0) -> Target:
    """The target named by --target/--dtype/--attn, placed per the offload flags (add_decode_args + add_offload_args)."""
    return load_target(args.target, args.dtype, args.attn, offload_config_from_args(args), resident_layers)


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """K and V for one token in every layer."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * torch.finfo(dtype).bits // 8


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m decode.offload",
                                 description="Plan a streamed target and estimate the cost of one pass (no weights read).")
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
    print(f"layers: {len(p.resident_layers)} of {n} resident, {len(p.streamed_layers)} streamed; "
          f"KV cache {fmt_bytes(kv_bytes_per_token(model.config, DTYPES[args.dtype]))} per token")
    print("| disk bandwidth | estimated target pass (streamed bytes / bandwidth) |\n|---|---|")
    for bw in args.bandwidth.split(","):
        print(f"| {bw}/s | {p.streamed_bytes / parse_size(bw, '--bandwidth'):.1f} s (estimate) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
