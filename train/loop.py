"""The training loop on accelerate: one frozen target, one trainable drafter, a run directory.

A run directory holds the resolved config (config.yaml), metrics (metrics.jsonl), accelerate
checkpoints (checkpoints/step_N: optimizer, scheduler, RNG and the drafter's weights, written to a
temporary name and renamed; train/checkpoints.py) and the final native export (export/).
`resume=auto` continues from the newest checkpoint, so a killed-and-resumed run logs what an
uninterrupted one does. Launch with `python -m train RECIPE.yaml` or `accelerate launch -m train ...`.
"""

from __future__ import annotations

import json
import math
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from decode.errors import UserError
from decode.precision import resolve_dtype
from drafters.trainable.losses import simulated_chain_tau as simulated_tau
from train.checkpoints import (
    drop_unfinished_checkpoints,
    load_checkpoint,
    resume_point,
    rewind_metrics,
    save_checkpoint,
)
from train.config import TrainConfig, dump_config
from train.dataset import make_loader
from train.killpoint import kill_point
from train.optim import Chain, make_optimizers
from train.simeval import CACHE_NAME as SIM_CACHE
from train.simeval import load_or_build, prompt_set, sim_eval


class NonFiniteLoss(RuntimeError):
    """The loss became NaN/inf; the run stops keeping the last good checkpoint."""


# --- small pure functions ---------------------------------------------------------------


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Multiplier of the peak lr at optimizer step `step`: warmup, then cosine/linear/constant decay."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    frac = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
    decay = 0.5 * (1 + math.cos(math.pi * frac)) if cfg.schedule == "cosine" else 1 - frac
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * decay


# --- the loop ---------------------------------------------------------------------------


class LossModule(nn.Module):
    """Wraps a drafter so DDP/DeepSpeed see `forward(batch, step) -> (loss, metrics)` as the forward."""

    def __init__(self, drafter: nn.Module) -> None:
        super().__init__()
        self.drafter = drafter

    def forward(self, batch: dict[str, Any], step: int) -> tuple[torch.Tensor, dict[str, float]]:
        # through __call__ (drafter.forward = loss): FSDP may shard the drafter as its own unit, and its
        # all-gather hooks run only when the module is called
        return self.drafter(batch, step)


def make_accelerator(cfg: TrainConfig, run_dir: Path):
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
    auto = resolve_dtype("auto", PartialState().device) == "bfloat16"  # decode.target's one rule (no config: a big model)
    mixed = cfg.mixed_precision if cfg.mixed_precision != "auto" else "bf16" if auto else "no"
    if AcceleratorState._shared_state.get("_mixed_precision") not in (None, mixed):
        # a second run in this process (tests, a notebook) with another precision: accelerate's state is a
        # process-wide singleton that refuses the change, so drop it (the process state itself is kept)
        AcceleratorState._reset_state()
    # sync_with_dataloader=False: an optimizer step is always grad_accum micro-batches of one continuous
    # stream that runs across epochs (accelerate would otherwise cut a step short at each epoch's end), so
    # optimizer step s reads micro-batches s*grad_accum .. and a resume can find them by arithmetic.
    accum = GradientAccumulationPlugin(num_steps=cfg.grad_accum, sync_with_dataloader=False)
    acc = Accelerator(gradient_accumulation_plugin=accum, mixed_precision=mixed,
                      step_scheduler_with_optimizer=False, log_with=log_with,
                      # curricula and layer dropout leave some drafter parameters unused in a step
                      kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)],
                      project_config=ProjectConfiguration(project_dir=str(run_dir), logging_dir=str(run_dir / "logs")))
    if os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true" and acc.distributed_type == DistributedType.MULTI_CPU:
        fsdp_on_cpu(acc)
    return acc


def fsdp_on_cpu(acc) -> None:
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
        raise ValueError("FSDP on CPU ranks needs fsdp_version: 2 in the accelerate config "
                         "(see recipes/accelerate/fsdp_cpu_2proc.yaml)")
    if acc.mixed_precision != "no":
        plugin.set_mixed_precision(acc.mixed_precision)
    acc.state.fsdp_plugin = plugin
    acc.state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP  # as AcceleratorState itself syncs it


@contextmanager
def rng_untouched():
    """Inside: anything may draw from the global RNGs (torch, python, numpy); after, they are as before.
    Evaluation runs inside it, so turning it on, off or changing its size never shifts the training
    streams (EAGLE's feature noise, LayerSkip's layer dropout, LoRA dropout)."""
    import random

    import numpy as np

    saved = torch.get_rng_state(), random.getstate(), np.random.get_state()
    try:
        yield
    finally:
        torch.set_rng_state(saved[0])
        random.setstate(saved[1])
        np.random.set_state(saved[2])


@contextmanager
def full_params(model: nn.Module):
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


def to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


@torch.no_grad()
def evaluate(drafter: nn.Module, loader, featurize, device: torch.device, cfg: TrainConfig) -> dict[str, Any]:
    """Held-out loss, top-1 / top-w accuracy per draft position, and the teacher-forced chain and tree τ estimate."""
    was = drafter.training
    drafter.eval()
    losses, acc1, accw, n = [], None, None, 0
    for i, batch in enumerate(loader):
        if i >= cfg.eval_batches:
            break
        batch = featurize(to_device(batch, device))
        loss, _ = drafter.loss(batch, 0)
        losses.append(float(loss))
        a1 = drafter.position_accuracy(batch)
        aw = drafter.position_accuracy(batch, topk=cfg.tree_width)
        acc1 = a1 if acc1 is None else [x + y for x, y in zip(acc1, a1)]
        accw = aw if accw is None else [x + y for x, y in zip(accw, aw)]
        n += 1
    drafter.train(was)
    if not n:
        return {}
    acc1, accw = [a / n for a in acc1], [a / n for a in accw]
    return {"eval/loss": sum(losses) / n, "eval/acc_by_position": acc1, f"eval/top{cfg.tree_width}_by_position": accw,
            "eval/tf_tau_chain": simulated_tau(acc1), "eval/tf_tau_tree": simulated_tau(accw)}


def evaluate_all(drafter: nn.Module, target, loader, featurize, device: torch.device, cfg: TrainConfig,
                 sim_items: list, n_prompts: int) -> dict[str, Any]:
    """`evaluate` plus the decoding-faithful τ on the first n_prompts of the sim-eval set (train/simeval.py)."""
    out: dict[str, Any] = {}
    if loader is not None:
        t0 = time.perf_counter()
        out = {**evaluate(drafter, loader, featurize, device, cfg), "eval/tf_s": time.perf_counter() - t0}
    return {**out, **sim_eval(drafter, target, sim_items[:n_prompts], cfg)}


def train(recipe, drafter: nn.Module, target, train_ds, eval_ds, featurize, export_fn) -> Path:
    """Run the recipe's optimisation; returns the export directory. `export_fn(drafter, dir, state)` writes
    the native format (`state`: the drafter's full state dict, gathered from every rank)."""
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm

    cfg: TrainConfig = recipe.train
    run_dir = Path(recipe.run_dir)
    acc = make_accelerator(cfg, run_dir)
    set_seed(recipe.seed)
    main = acc.is_main_process
    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
        dump_config(recipe, run_dir / "config.yaml")
        print(f"[train] {acc.num_processes} process(es), {acc.distributed_type.value}, device {acc.device}, "
              f"mixed precision {acc.mixed_precision}; run dir {run_dir}")

    # 1. data, optimizer, schedule; accelerate shards batches across processes.
    loader = make_loader(train_ds, cfg.batch_size, recipe.seed, shuffle=True, drop_last=True, num_workers=cfg.num_workers)
    eval_loader = make_loader(eval_ds, cfg.batch_size, recipe.seed, shuffle=False) if len(eval_ds) else None
    # the decoding-faithful eval set: held-out prompts + the target's greedy continuations, cached per run
    sim_items = load_or_build(run_dir / SIM_CACHE, target, prompt_set(cfg, target, eval_ds), cfg.sim_max_new_tokens,
                              write=main)
    evaluates = eval_loader is not None or bool(sim_items)
    if len(loader) == 0:
        raise ValueError(f"{len(train_ds)} training sequences make no full batch of {cfg.batch_size}: "
                         "lower train.batch_size or add data")
    # AdamW, or Muon + AdamW (train/optim.py): one schedule each, the same lr factor; stepped as one (Chain)
    opts = make_optimizers(drafter, cfg, acc.distributed_type.value)
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: lr_factor(s, cfg)) for o in opts]
    model, *prepared = acc.prepare(LossModule(drafter), *opts, loader, *scheds)
    opt, loader, sched = Chain(prepared[: len(opts)]), prepared[len(opts)], Chain(prepared[len(opts) + 1:])
    if acc.gradient_accumulation_steps != cfg.grad_accum:  # a DeepSpeed config's own number wins at prepare
        raise UserError(f"train.grad_accum={cfg.grad_accum} but the DeepSpeed config sets gradient_accumulation_steps "
                        f"{acc.gradient_accumulation_steps}; set it to auto in the accelerate config file (as in "
                        "recipes/accelerate/deepspeed_zero3.yaml) so the recipe decides")
    if acc.is_main_process and cfg.report_to != "none":
        acc.init_trackers(recipe.name or "draftsmith", config={"recipe": str(recipe.name)})

    # 2. resume: accelerate restores optimizer, scheduler, RNG and weights; skip the consumed batches.
    # Checkpoints are written only at optimizer-step boundaries (never mid-accumulation): a run killed
    # mid-accumulation redoes that step's micro-batches from the last checkpoint.
    step, window, seen = 0, [], 0  # seen: trained (loss-masked) tokens so far, all ranks: the x axis of a tokens curve
    resume_from = resume_point(cfg.resume, run_dir)
    if resume_from is not None:
        step, window, seen = load_checkpoint(acc, resume_from)  # window: the losses the next logged row averages
        if main:
            print(f"[train] resumed from {resume_from} at step {step}")
    log_path = run_dir / "metrics.jsonl"
    if main:
        drop_unfinished_checkpoints(run_dir)
        rewind_metrics(log_path, resume_from)

    def save(at: int) -> None:
        save_checkpoint(acc, run_dir, at, log_path, window, seen, cfg.keep_checkpoints)

    # 3. the loop: one stream of micro-batches, epoch after epoch (epoch e's order a pure function of
    # (seed, e), train/dataset.py), cut into optimizer steps of grad_accum micro-batches each.
    micro = step * cfg.grad_accum  # micro-batches consumed so far
    epoch, skip = divmod(micro, len(loader))
    bar = tqdm(total=cfg.steps, initial=step, disable=not main, desc="train", dynamic_ncols=True)
    t0, tokens = time.perf_counter(), 0
    model.train()
    while step < cfg.steps and not cfg.eval_only:
        loader.set_epoch(epoch)
        batches = acc.skip_first_batches(loader, skip) if skip else loader
        skip = 0
        for batch in batches:
            batch = featurize(to_device(batch, acc.device))
            with acc.accumulate(model):
                with acc.autocast():
                    loss, metrics = model(batch, step)
                bad = acc.reduce(torch.tensor(0.0 if torch.isfinite(loss) else 1.0, device=acc.device), "sum")
                if float(bad) > 0:
                    raise NonFiniteLoss(f"non-finite loss at step {step} (metrics {metrics}); the last good "
                                        f"checkpoint is kept in {run_dir / 'checkpoints'} — lower train.lr or "
                                        "check the data, then rerun with resume=auto")
                acc.backward(loss)
                if acc.sync_gradients and cfg.max_grad_norm > 0:
                    acc.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
                opt.step()
                if acc.sync_gradients:
                    sched.step()
                opt.zero_grad()
            window.append(float(acc.reduce(loss.detach(), "mean")))
            n_trained = int(acc.reduce(batch["loss_mask"].sum().detach(), "sum"))
            tokens, seen = tokens + n_trained, seen + n_trained
            micro += 1
            kill_point("train.micro", micro)  # test hook: a kill after micro-batch N (mid-accumulation or not)
            if not acc.sync_gradients:
                continue
            # 4. bookkeeping once per optimizer step.
            step += 1
            bar.update(1)
            if step % cfg.log_every == 0 or step == cfg.steps:
                dt = time.perf_counter() - t0
                row = {"step": step, "loss": sum(window) / len(window), "lr": sched.get_last_lr()[0],
                       "tokens_per_s": tokens / dt if dt > 0 else 0.0,
                       "trained_tokens": seen, **{f"train/{k}": v for k, v in metrics.items()}}
                bar.set_postfix(loss=f"{row['loss']:.4f}", tok_s=f"{row['tokens_per_s']:.0f}")
                _log(acc, log_path, row, step, main)
                window, tokens, t0 = [], 0, time.perf_counter()
            if evaluates and cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps:
                with full_params(model), rng_untouched():
                    _log(acc, log_path, {"step": step, **evaluate_all(acc.unwrap_model(model).drafter, target,
                                                                       eval_loader, featurize, acc.device, cfg,
                                                                       sim_items, cfg.sim_periodic_prompts)},
                         step, main)
            if cfg.save_every and step % cfg.save_every == 0 and step < cfg.steps:
                save(step)
            if step >= cfg.steps:
                break
        epoch += 1
    bar.close()

    # 5. final checkpoint, evaluation and native export (the checkpoint first: a rerun after a kill in
    # the evaluation or export resumes at the last step and redoes only those).
    if not cfg.eval_only:
        save(step)
    final = {"step": step}
    if evaluates:
        with full_params(model), rng_untouched():
            final.update(evaluate_all(acc.unwrap_model(model).drafter, target, eval_loader, featurize, acc.device,
                                      cfg, sim_items, len(sim_items)))
        _log(acc, log_path, final, step, main)
    export_dir = run_dir / "export"
    # the full weights: every rank joins the gather (FSDP shards, ZeRO-3 partitions; ZeRO-3 returns None
    # off the main process); the main process writes
    state = {} if cfg.eval_only else {k.removeprefix("drafter."): v for k, v in (acc.get_state_dict(model) or {}).items()}
    if main and cfg.eval_only:  # train.eval_only: the evaluation is the result; nothing trained, nothing exported
        (run_dir / "final_eval.json").write_text(json.dumps(final, indent=2))
        print(f"[train] eval_only: evaluated the drafter of step {step}; see {run_dir / 'final_eval.json'}")
    elif main:
        export_fn(acc.unwrap_model(model).drafter, export_dir, state)
        (run_dir / "final_eval.json").write_text(json.dumps(final, indent=2))
        print(f"[train] done: {step} steps; drafter exported to {export_dir}")
        if "eval/loss" in final:
            print(f"[train] held-out: loss {final['eval/loss']:.4f}; teacher-forced tau estimate chain "
                  f"{final['eval/tf_tau_chain']:.2f}, tree {final['eval/tf_tau_tree']:.2f}")
        if "eval/sim_tau_chain" in final:
            print(f"[train] simulated tau (decoding {final['eval/sim_prompts']} held-out prompts, greedy, "
                  f"{cfg.sim_max_new_tokens} new tokens): chain k={cfg.sim_chain} {final['eval/sim_tau_chain']:.2f}, "
                  f"tree {cfg.sim_tree} {final['eval/sim_tau_tree']:.2f}")
    acc.wait_for_everyone()
    acc.end_training()
    return export_dir


def _log(acc, path: Path, row: dict[str, Any], step: int, main: bool) -> None:
    if not main:
        return
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")
    scalars = {k: v for k, v in row.items() if isinstance(v, (int, float)) and k != "step"}
    if acc.trackers:
        acc.log(scalars, step=step)
