"""The training loop on accelerate: one frozen target, one trainable drafter, a run directory.

A run directory holds the resolved config (config.yaml), metrics (metrics.jsonl), accelerate
checkpoints (checkpoints/step_N: optimizer, scheduler, RNG and the drafter's weights, written to a
temporary name and renamed; train/checkpoints.py) and the final native export (export/).
`resume=auto` continues from the newest checkpoint, so a killed-and-resumed run logs what an
uninterrupted one does. Launch with `python -m train RECIPE.yaml` or `accelerate launch -m train ...`.

`train()` reads top to bottom in numbered steps; the pieces it calls follow it here, and two parts live
beside it: the Accelerator and device placement (train/distributed.py) and evaluation (train/evaluation.py).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from decode.errors import UserError
from drafters.trainable.lk import Objective, use_objective
from train.checkpoints import (
    drop_unfinished_checkpoints,
    load_checkpoint,
    resume_point,
    rewind_metrics,
    save_checkpoint,
)
from train.config import Recipe, TrainConfig, dump_config
from train.dataset import make_loader
from train.distributed import full_params, make_accelerator, to_device
from train.evaluation import Evaluator, print_final, rng_untouched
from train.killpoint import kill_point
from train.optim import Chain, make_optimizers

if TYPE_CHECKING:
    from accelerate import Accelerator
    from torch.utils.data import DataLoader, Dataset

    from decode.target import Target

# `export_fn(drafter, export_dir, state)` writes the native format (drafters/serving/checkpoint.py); its result is unused
ExportFn = Callable[[nn.Module, Path, dict[str, torch.Tensor]], object]


class NonFiniteLoss(RuntimeError):
    """The loss became NaN/inf; the run stops keeping the last good checkpoint."""


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Multiplier of the peak lr at optimizer step `step`: warmup, then cosine/linear/constant decay."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    frac = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
    decay = 0.5 * (1 + math.cos(math.pi * frac)) if cfg.schedule == "cosine" else 1 - frac
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * decay


class LossModule(nn.Module):
    """Wraps a drafter so DDP/DeepSpeed see `forward(batch, step) -> (loss, metrics)` as the forward."""

    def __init__(self, drafter: nn.Module) -> None:
        super().__init__()
        self.drafter = drafter

    def forward(self, batch: dict[str, Any], step: int) -> tuple[torch.Tensor, dict[str, float]]:
        # through __call__ (drafter.forward = loss): FSDP may shard the drafter as its own unit, and its
        # all-gather hooks run only when the module is called
        return self.drafter(batch, step)


def train(
    recipe: Recipe,
    drafter: nn.Module,
    target: Target,
    train_ds: Dataset,
    eval_ds: Dataset,
    featurize: Callable[[dict[str, Any]], dict[str, Any]],
    export_fn: ExportFn,
    record: Recipe | None = None,
) -> Path:
    """Run the recipe's optimisation; returns the export directory. `export_fn(drafter, dir, state)` writes
    the native format (`state`: the drafter's full state dict, gathered from every rank); `record` is the
    recipe config.yaml keeps (default `recipe`)."""
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm

    cfg: TrainConfig = recipe.train
    use_objective(drafter, Objective.of(cfg))  # train.loss: what the drafter's loss method optimises
    run_dir = Path(recipe.run_dir)
    acc = make_accelerator(cfg, run_dir)
    set_seed(recipe.seed)
    main = acc.is_main_process
    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
        dump_config(record or recipe, run_dir / "config.yaml")
        print(
            f"[train] {acc.num_processes} process(es), {acc.distributed_type.value}, device {acc.device}, "
            f"mixed precision {acc.mixed_precision}; run dir {run_dir}"
        )

    # 1. data, optimizer, schedule; accelerate shards batches across processes.
    loader = make_loader(
        train_ds, cfg.batch_size, recipe.seed, shuffle=True, drop_last=True, num_workers=cfg.num_workers
    )
    evals = Evaluator.for_run(target, eval_ds, featurize, acc.device, cfg, recipe.seed, run_dir, main)
    if len(loader) == 0:
        raise ValueError(
            f"{len(train_ds)} training sequences make no full batch of {cfg.batch_size}: "
            "lower train.batch_size or add data"
        )
    model, opt, loader, sched = prepare_optimisation(acc, drafter, loader, cfg)
    if acc.is_main_process and cfg.report_to != "none":
        acc.init_trackers(recipe.name or "draftsmith", config={"recipe": str(recipe.name)})

    # 2. resume: accelerate restores optimizer, scheduler, RNG and weights; skip the consumed batches.
    step, window, seen = resume(acc, cfg, run_dir)  # window: the losses the next row averages; seen: trained tokens
    log = MetricsLog(acc, run_dir / "metrics.jsonl", main)

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
            loss, metrics = micro_step(acc, model, opt, sched, batch, step, cfg, run_dir)
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
                row = train_row(step, window, sched.get_last_lr()[0], tokens, time.perf_counter() - t0, seen, metrics)
                bar.set_postfix(loss=f"{row['loss']:.4f}", tok_s=f"{row['tokens_per_s']:.0f}")
                log(row, step)
                window, tokens, t0 = [], 0, time.perf_counter()
            if evals.enabled and cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps:
                with full_params(model), rng_untouched():
                    log({"step": step, **evals(acc.unwrap_model(model).drafter, cfg.sim_periodic_prompts)}, step)
            if cfg.save_every and step % cfg.save_every == 0 and step < cfg.steps:
                save_checkpoint(acc, run_dir, step, log.path, window, seen, cfg.keep_checkpoints)
            if step >= cfg.steps:
                break
        epoch += 1
    bar.close()

    # 5. final checkpoint, evaluation and native export (the checkpoint first: a rerun after a kill in
    # the evaluation or export resumes at the last step and redoes only those).
    if not cfg.eval_only:
        save_checkpoint(acc, run_dir, step, log.path, window, seen, cfg.keep_checkpoints)
    return finish(acc, model, cfg, run_dir, step, evals, log, export_fn)


# --- the steps' parts, in the order train() uses them ------------------------------------------


def prepare_optimisation(
    acc: Accelerator, drafter: nn.Module, loader: DataLoader, cfg: TrainConfig
) -> tuple[nn.Module, Chain, DataLoader, Chain]:
    """(model, optimizer, loader, schedule) as accelerate prepared them for this process.

    AdamW, or Muon + AdamW (train/optim.py): one schedule each, the same lr factor; stepped as one (Chain).
    """
    opts = make_optimizers(drafter, cfg, acc.distributed_type.value)
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: lr_factor(s, cfg)) for o in opts]
    model, *prepared = acc.prepare(LossModule(drafter), *opts, loader, *scheds)
    opt, loader, sched = Chain(prepared[: len(opts)]), prepared[len(opts)], Chain(prepared[len(opts) + 1 :])
    if acc.gradient_accumulation_steps != cfg.grad_accum:  # a DeepSpeed config's own number wins at prepare
        raise UserError(
            f"train.grad_accum={cfg.grad_accum} but the DeepSpeed config sets gradient_accumulation_steps "
            f"{acc.gradient_accumulation_steps}; set it to auto in the accelerate config file (as in "
            "recipes/accelerate/deepspeed_zero3.yaml) so the recipe decides"
        )
    return model, opt, loader, sched


def resume(acc: Accelerator, cfg: TrainConfig, run_dir: Path) -> tuple[int, list[float], int]:
    """(step, window, seen) to go on from: zeros for a fresh run, else what the newest checkpoint holds.

    Checkpoints are written only at optimizer-step boundaries (never mid-accumulation): a run killed
    mid-accumulation redoes that step's micro-batches from the last checkpoint. The main process drops
    half-written checkpoints and the metrics rows logged after the one resumed from.
    """
    step, window, seen = 0, [], 0  # seen: trained (loss-masked) tokens so far, all ranks: the x axis of a tokens curve
    resume_from = resume_point(cfg.resume, run_dir)
    if resume_from is not None:
        step, window, seen = load_checkpoint(acc, resume_from)
        if acc.is_main_process:
            print(f"[train] resumed from {resume_from} at step {step}")
    if acc.is_main_process:
        drop_unfinished_checkpoints(run_dir)
        rewind_metrics(run_dir / "metrics.jsonl", resume_from)
    return step, window, seen


@dataclass
class MetricsLog:
    """RUN_DIR/metrics.jsonl, one JSON row per call (the main process writes), and each row's scalars to
    the trackers of train.report_to."""

    acc: Accelerator
    path: Path
    main: bool

    def __call__(self, row: dict[str, Any], step: int) -> None:
        if not self.main:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        scalars = {k: v for k, v in row.items() if isinstance(v, (int, float)) and k != "step"}
        if self.acc.trackers:
            self.acc.log(scalars, step=step)


def micro_step(
    acc: Accelerator,
    model: nn.Module,
    opt: Chain,
    sched: Chain,
    batch: dict[str, Any],
    step: int,
    cfg: TrainConfig,
    run_dir: Path,
) -> tuple[torch.Tensor, dict[str, float]]:
    """One micro-batch: forward under autocast, a non-finite loss on any rank stops the run, backward; at the
    last micro-batch of an optimizer step (accelerate's sync_gradients) also the clip, step and schedule."""
    with acc.accumulate(model):
        with acc.autocast():
            loss, metrics = model(batch, step)
        bad = acc.reduce(torch.tensor(0.0 if torch.isfinite(loss) else 1.0, device=acc.device), "sum")
        if float(bad) > 0:
            raise NonFiniteLoss(
                f"non-finite loss at step {step} (metrics {metrics}); the last good "
                f"checkpoint is kept in {run_dir / 'checkpoints'} — lower train.lr or "
                "check the data, then rerun with resume=auto"
            )
        acc.backward(loss)
        if acc.sync_gradients and cfg.max_grad_norm > 0:
            acc.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        opt.step()
        if acc.sync_gradients:
            sched.step()
        opt.zero_grad()
    return loss, metrics


def train_row(
    step: int, window: list[float], lr: float, tokens: int, dt: float, seen: int, metrics: dict[str, float]
) -> dict[str, Any]:
    """A metrics row: the loss averaged over the micro-batches since the last row, the lr, tokens/s over the
    `dt` seconds since then, trained tokens so far and the drafter's own metrics of the last micro-batch."""
    return {
        "step": step,
        "loss": sum(window) / len(window),
        "lr": lr,
        "tokens_per_s": tokens / dt if dt > 0 else 0.0,
        "trained_tokens": seen,
        **{f"train/{k}": v for k, v in metrics.items()},
    }


def finish(
    acc: Accelerator,
    model: nn.Module,
    cfg: TrainConfig,
    run_dir: Path,
    step: int,
    evals: Evaluator,
    log: MetricsLog,
    export_fn: ExportFn,
) -> Path:
    """The final evaluation (every sim-eval prompt) and the native export; returns the export directory."""
    main = acc.is_main_process
    final = {"step": step}
    if evals.enabled:
        with full_params(model), rng_untouched():
            final.update(evals(acc.unwrap_model(model).drafter, len(evals.sim_items)))
        log(final, step)
    export_dir = run_dir / "export"
    # the full weights: every rank joins the gather (FSDP shards, ZeRO-3 partitions; ZeRO-3 returns None
    # off the main process); the main process writes
    state = (
        {} if cfg.eval_only else {k.removeprefix("drafter."): v for k, v in (acc.get_state_dict(model) or {}).items()}
    )
    if main and cfg.eval_only:  # train.eval_only: the evaluation is the result; nothing trained, nothing exported
        (run_dir / "final_eval.json").write_text(json.dumps(final, indent=2))
        print(f"[train] eval_only: evaluated the drafter of step {step}; see {run_dir / 'final_eval.json'}")
    elif main:
        export_fn(acc.unwrap_model(model).drafter, export_dir, state)
        (run_dir / "final_eval.json").write_text(json.dumps(final, indent=2))
        print(f"[train] done: {step} steps; drafter exported to {export_dir}")
        print_final(final, cfg)
    acc.wait_for_everyone()
    acc.end_training()
    return export_dir
