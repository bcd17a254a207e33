"""Where a streamed target's weights live: the device map, and what it keeps resident and streams.

`plan_placement` decides, on an empty (meta) copy of the model so no weight is read:
1. always resident: embeddings, rotary embedding, final norm, LM head, and layers [0, K) where K is
   the deepest target layer a drafter runs (early-exit:K, LayerSkip), so drafting never streams;
2. then layers K, K+1, ... stay resident while they fit in --max-memory (a weight budget);
3. the remaining layers go to "cpu" or "disk" and stream on every pass.
Without --max-memory an offload mode keeps only step 1 resident: streaming is forced.

decode.offload loads a target with this placement (accelerate big-model inference) and runs
`python -m decode.offload`.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from decode.loading import DTYPES, resolve_model_path

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
        return (
            f"[offload {self.mode}] on {self.device}: {res}; streamed every pass {fmt_bytes(self.streamed_bytes)} "
            f"(layers {spans(self.streamed_layers)}) from {self.mode}" + "".join(f"; {n}" for n in self.notes)
        )


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


def plan_placement(
    model: nn.Module, offload: OffloadConfig, resident_layers: int = 0, dtype: torch.dtype | None = None
) -> Placement:
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
            raise OffloadError(
                f"the target's weights need {fmt_bytes(total)} but --max-memory is {offload.max_memory}: "
                "add --offload disk (or cpu) to stream the layers that do not fit"
            )
        resident = list(range(n_layers))
    else:
        if budget is not None and need > budget:
            raise OffloadError(
                f"--max-memory {offload.max_memory} cannot hold the resident drafting set: embeddings, norm and "
                f"LM head ({fmt_bytes(base_bytes)}) + layers 0..{k - 1} the drafter runs "
                f"({fmt_bytes(need - base_bytes)}) = {fmt_bytes(need)}; raise --max-memory to at least "
                f"{fmt_bytes(need)} or use a drafter that runs fewer target layers"
            )
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
    return Placement(
        offload.mode,
        device,
        device_map,
        resident,
        streamed,
        base_bytes + sum(size[layers[i]] for i in resident),
        sum(size[layers[i]] for i in streamed),
        budget_bytes=budget,
    )
