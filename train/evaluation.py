"""Evaluation during training: held-out loss and accuracy, the teacher-forced τ estimate, and the
decoding-faithful simulated τ (train/simeval.py), run so that the training streams never notice.

The loop evaluates every `train.eval_every` optimizer steps (on `sim_periodic_prompts` prompts) and once
at the end (on all `sim_eval_prompts`); both go through `Evaluator`, inside `rng_untouched` (evaluation
draws from the global RNGs) and `full_params` (a sharded drafter's methods need its whole weights).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from decode.target import Target
from drafters.trainable.losses import simulated_chain_tau as simulated_tau
from train.config import TrainConfig
from train.dataset import make_loader
from train.distributed import to_device
from train.simeval import CACHE_NAME as SIM_CACHE
from train.simeval import load_or_build, prompt_set, sim_eval


@contextmanager
def rng_untouched() -> Iterator[None]:
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


@torch.no_grad()
def evaluate(
    drafter: nn.Module,
    loader: DataLoader,
    featurize: Callable[[dict[str, Any]], dict[str, Any]],
    device: torch.device,
    cfg: TrainConfig,
) -> dict[str, Any]:
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
    return {
        "eval/loss": sum(losses) / n,
        "eval/acc_by_position": acc1,
        f"eval/top{cfg.tree_width}_by_position": accw,
        "eval/tf_tau_chain": simulated_tau(acc1),
        "eval/tf_tau_tree": simulated_tau(accw),
    }


@dataclass
class Evaluator:
    """What a run evaluates on, fixed for the run: held-out batches (None: no held-out data) and the
    decoding-faithful eval set (held-out prompts + the target's greedy continuations)."""

    target: Target
    loader: DataLoader | None
    featurize: Callable[[dict[str, Any]], dict[str, Any]]
    device: torch.device
    cfg: TrainConfig
    sim_items: list[dict[str, list[int]]]

    @classmethod
    def for_run(
        cls,
        target: Target,
        eval_ds: Dataset,
        featurize: Callable[[dict[str, Any]], dict[str, Any]],
        device: torch.device,
        cfg: TrainConfig,
        seed: int,
        run_dir: Path,
        main: bool,
    ) -> Evaluator:
        loader = make_loader(eval_ds, cfg.batch_size, seed, shuffle=False) if len(eval_ds) else None
        # the decoding-faithful eval set, cached per run (the main process writes it)
        sim_items = load_or_build(
            run_dir / SIM_CACHE, target, prompt_set(cfg, target, eval_ds), cfg.sim_max_new_tokens, write=main
        )
        return cls(target, loader, featurize, device, cfg, sim_items)

    @property
    def enabled(self) -> bool:
        return self.loader is not None or bool(self.sim_items)

    def __call__(self, drafter: nn.Module, n_prompts: int) -> dict[str, Any]:
        """`evaluate` plus the decoding-faithful τ on the first n_prompts of the sim-eval set (train/simeval.py)."""
        out: dict[str, Any] = {}
        if self.loader is not None:
            t0 = time.perf_counter()
            out = {
                **evaluate(drafter, self.loader, self.featurize, self.device, self.cfg),
                "eval/tf_s": time.perf_counter() - t0,
            }
        return {**out, **sim_eval(drafter, self.target, self.sim_items[:n_prompts], self.cfg)}


def print_final(final: dict[str, Any], cfg: TrainConfig) -> None:
    """The final evaluation's τ lines, for whichever evaluations ran."""
    if "eval/loss" in final:
        print(
            f"[train] held-out: loss {final['eval/loss']:.4f}; teacher-forced tau estimate chain "
            f"{final['eval/tf_tau_chain']:.2f}, tree {final['eval/tf_tau_tree']:.2f}"
        )
    if "eval/sim_tau_chain" in final:
        print(
            f"[train] simulated tau (decoding {final['eval/sim_prompts']} held-out prompts, greedy, "
            f"{cfg.sim_max_new_tokens} new tokens): chain k={cfg.sim_chain} {final['eval/sim_tau_chain']:.2f}, "
            f"tree {cfg.sim_tree} {final['eval/sim_tau_tree']:.2f}"
        )
