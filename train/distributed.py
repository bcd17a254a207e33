"""accelerate around the training loop: the Accelerator a recipe asks for, batches onto this process's
device, and an FSDP-sharded drafter's full parameters when something outside its forward needs them.

`make_accelerator` settles precision (`train.mixed_precision`, `auto`: bf16 where native), gradient
accumulation (one continuous micro-batch stream across epochs), trackers (`train.report_to`) and, on CPU
ranks launched with FSDP, the switch accelerate itself leaves out (`fsdp_on_cpu`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from decode.precision import resolve_dtype
from train.config import TrainConfig

if TYPE_CHECKING:
    from accelerate import Accelerator


def make_accelerator(cfg: TrainConfig, run_dir: Path) -> Accelerator:
    """The run's Accelerator: precision, accumulation, trackers and logs under `run_dir`."""
    from accelerate import Accelerator, PartialState
    from accelerate.state import AcceleratorState
    from accelerate.utils import (
        DistributedDataParallelKwargs,
        DistributedType,
        GradientAccumulationPlugin,
        ProjectConfiguration,
    )

    log_with = None if cfg.report_to == "none" else cfg.report_to
    if cfg.report_to == "wandb":
        os.environ.setdefault("WANDB_MODE", "offline")  # never phone home unless the user asks
        os.environ.setdefault("WANDB_DIR", str(run_dir))
    # step_scheduler_with_optimizer=False: accelerate would otherwise advance the schedule once per
    # process per step (it assumes the lr was tuned for one process); the schedule is per optimizer step.
    # an unresolved `auto` (train() called directly, not through `python -m train`): bf16 where native
    auto = (
        resolve_dtype("auto", PartialState().device) == "bfloat16"
    )  # decode.target's one rule (no config: a big model)
    mixed = cfg.mixed_precision if cfg.mixed_precision != "auto" else "bf16" if auto else "no"
    if AcceleratorState._shared_state.get("_mixed_precision") not in (None, mixed):
        # a second run in this process (tests, a notebook) with another precision: accelerate's state is a
        # process-wide singleton that refuses the change, so drop it (the process state itself is kept)
        AcceleratorState._reset_state()
    # sync_with_dataloader=False: an optimizer step is always grad_accum micro-batches of one continuous
    # stream that runs across epochs (accelerate would otherwise cut a step short at each epoch's end), so
    # optimizer step s reads micro-batches s*grad_accum .. and a resume can find them by arithmetic.
    accum = GradientAccumulationPlugin(num_steps=cfg.grad_accum, sync_with_dataloader=False)
    acc = Accelerator(
        gradient_accumulation_plugin=accum,
        mixed_precision=mixed,
        step_scheduler_with_optimizer=False,
        log_with=log_with,
        # curricula and layer dropout leave some drafter parameters unused in a step
        kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)],
        project_config=ProjectConfiguration(project_dir=str(run_dir), logging_dir=str(run_dir / "logs")),
    )
    if (
        os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true"
        and acc.distributed_type == DistributedType.MULTI_CPU
    ):
        fsdp_on_cpu(acc)
    return acc


def fsdp_on_cpu(acc: Accelerator) -> None:
    """Turn a MULTI_CPU (gloo) accelerator into an FSDP2 one, before anything is prepared.

    accelerate 1.15 sets FSDP only on GPU-class devices: on CPU ranks AcceleratorState keeps MULTI_CPU
    and drops the plugin, so an FSDP launch silently trains with DDP. torch's FSDP2 (`fully_shard`) does
    run on gloo, and accelerate's FSDP code paths (prepare, clip, save/load_state, get_state_dict) have
    nothing GPU-specific, so the state is switched here, with the plugin the launcher's FSDP_* env describes.
    """
    from accelerate import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin()
    if plugin.fsdp_version != 2:
        raise ValueError(
            "FSDP on CPU ranks needs fsdp_version: 2 in the accelerate config "
            "(see recipes/accelerate/fsdp_cpu_2proc.yaml)"
        )
    if acc.mixed_precision != "no":
        plugin.set_mixed_precision(acc.mixed_precision)
    acc.state.fsdp_plugin = plugin
    acc.state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP  # as AcceleratorState itself syncs it


def to_device(batch: Any, device: torch.device) -> Any:
    """Every tensor of a (nested dict) batch on `device`; anything else as it is."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


@contextmanager
def full_params(model: nn.Module) -> Iterator[None]:
    """Inside: every FSDP2 unit of `model` holds its full (all-gathered) parameters, so the drafter's
    methods can run outside the wrapped forward (evaluation). A no-op for unsharded models. Collective:
    every rank must enter it."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in units:
        m.unshard()
    try:
        yield
    finally:
        for m in units:
            m.reshard()
