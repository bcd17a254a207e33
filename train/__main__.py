"""`python -m train RECIPE.yaml [key=value ...]` (also under `accelerate launch -m train ...`).

One command does the whole job; rerun it after any interruption and it continues where it stopped:
1. load the recipe (typed, dotted overrides, unknown keys rejected) and the frozen target;
2. fill the feature ids the drafter needs and prepare the data, building what is missing with the
   same resumable code as `python -m train.features`: regenerated samples (train/data/regen.py), then
   (features.mode=offline) the feature cache (train/features.py). Both live under the data home
   ($DRAFTSMITH_DATA, default ~/.cache/draftsmith/data) in directories keyed by target + settings, so
   a rerun — from any folder — reuses them; an explicit out_dir/cache_dir that holds something else is
   an error naming what differs;
3. build the drafter (EAGLE-3's draft vocabulary from the training data's token counts);
4. run the accelerate loop (train/loop.py; resume=auto continues from the newest checkpoint) and
   export the native checkpoint to RUN_DIR/export.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch

from decode.errors import check_out_dir, run_cli
from drafters.serving.checkpoint import drafter_kinds, save_drafter
from drafters.trainable.target_layer import layer_type
from train.config import load_recipe, to_dict, with_feature_ids
from train.data.fetch import prepare
from train.data.pipeline import Dist, prepare_data
from train.dataset import training_data
from train.features import build_cache, load_target, resolve_precision
from train.loop import train


def token_counts(dataset, vocab_size: int, limit: int = 20000) -> torch.Tensor:
    """Target-token frequencies over (up to `limit`) training sequences. [V]"""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for i in range(min(len(dataset), limit)):
        ids = dataset[i]["input_ids"]
        counts += torch.bincount(ids[ids < vocab_size], minlength=vocab_size)
    return counts


def build_drafter(recipe, target, train_ds, rank: int = 0) -> torch.nn.Module:
    """The trainable drafter module the recipe names, on the frozen target (EAGLE's training noise seeded
    from the run seed and this process's rank)."""
    cls, _ = drafter_kinds()[recipe.drafter.kind]
    cfg = recipe.drafter.selected()
    if recipe.drafter.kind == "eagle3":
        return cls(target, cfg, token_counts=token_counts(train_ds, target.vocab_size), seed=recipe.seed, rank=rank)
    if recipe.drafter.kind in ("dflash", "dspark"):  # anchors drawn per step; a draft vocabulary from the data
        counts = token_counts(train_ds, target.vocab_size) if cfg.draft_vocab_size else None
        return cls(target, cfg, seed=recipe.seed, rank=rank, token_counts=counts)
    if recipe.drafter.kind == "eagle1":  # its training noise
        return cls(target, cfg, seed=recipe.seed, rank=rank)
    return cls(target, cfg)


def warm_start(drafter: torch.nn.Module, path: str, target) -> None:
    """Copy a trained drafter's weights into `drafter` (train.init_from): same kind, same keys and shapes,
    same captured states; anything else is refused, naming it, because the weights would mean something else."""
    from pathlib import Path

    from drafters.serving.engine_dirs import load_module

    if not Path(path).is_dir():
        raise FileNotFoundError(
            f"train.init_from={path}: no such directory (give an export/ or a shipped drafter "
            "directory such as recipes/smollm2-135m/drafters/eagle3)"
        )
    source = load_module(Path(path), target)
    if source.kind != drafter.kind:
        raise ValueError(f"train.init_from={path} is a {source.kind} drafter; this recipe trains {drafter.kind}")
    mine, theirs = drafter.config, source.config
    if getattr(mine, "capture_ids", None) != getattr(theirs, "capture_ids", None):
        raise ValueError(
            f"train.init_from={path} fuses hidden ids {theirs.capture_ids}, this recipe "
            f"{mine.capture_ids}: set drafter.{drafter.kind}.capture_ids to match"
        )
    want, have = drafter.state_dict(), source.state_dict()
    bad = sorted(set(want) ^ set(have)) + [
        f"{k} {tuple(have[k].shape)} vs {tuple(v.shape)}"
        for k, v in want.items()
        if k in have and have[k].shape != v.shape
    ]
    if bad:
        raise ValueError(
            f"train.init_from={path}: its weights do not fit this recipe's {drafter.kind} drafter "
            f"({bad[:4]}); set the recipe's drafter section as the source was trained (its config.json)"
        )
    drafter.load_state_dict(have)  # the draft vocabulary (d2t/t2d) comes with the weights it indexes
    print(f"[train] weights from {path}", flush=True)


def run(recipe) -> int:
    from accelerate import PartialState

    if not recipe.drafter.kind:
        raise ValueError(
            "drafter.kind is not set: choose eagle3 | eagle1 | medusa | layerskip | dflash | dspark (e.g. drafter.kind=eagle3)"
        )
    check_out_dir(recipe.run_dir, "run_dir")  # before the target loads: an unwritable run_dir fails at once
    # 1. processes first. Plain CPU ranks (DDP, and FSDP: see train/distributed.py fsdp_on_cpu) need cpu=True
    # (accelerate 1.15 forms no CPU ranks without it); DeepSpeed (also on CPU with DS_ACCELERATOR=cpu) must
    # not get it: cpu=True would turn it into MULTI_CPU.
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true"
    cpu = os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes") or not torch.cuda.is_available()
    if deepspeed:
        # without a backend accelerate 1.15 lets DeepSpeed form the CPU ranks but records none: every rank
        # believes it is alone, and DeepSpeed refuses the batch sizes ("train_batch_size is not equal to
        # micro_batch_per_gpu * gradient_acc_step * world_size 2 != 2 * 1 * 2"); naming gloo records them
        state = PartialState(backend="gloo") if cpu else PartialState()
    else:
        state = PartialState(cpu=cpu)
    dist = Dist(state.process_index, state.num_processes, state.wait_for_everyone)
    given_source = recipe.data.source  # `fetch:NAME` as written: what config.yaml and the checkpoint record
    with state.main_process_first():  # a fetchable target or `fetch:` data source is fetched once, on first use
        recipe = prepare(recipe)
    torch.manual_seed(recipe.seed)
    if recipe.train.threads:
        torch.set_num_threads(recipe.train.threads)
    recipe, line = resolve_precision(recipe, state.device)  # `auto`: bf16 where the hardware has it
    if state.is_main_process:
        print(line, flush=True)
    target = load_target(recipe, state.device)
    if recipe.drafter.kind == "eagle3":  # a draft layer of a type this target's cannot give: refused before any data
        layer_type(recipe.drafter.eagle3.draft_layer, getattr(target.config, "model_type", None))
    if recipe.drafter.kind in ("dflash", "dspark"):  # a mask token or capture id this target lacks: before any data
        recipe.drafter.selected().resolved(target.num_layers, target.vocab_size)
    # 2. data: regenerated samples and (offline) features are built when missing, reused when present
    # and refused when they were made from something else — all before any training.
    recipe = with_feature_ids(recipe, target.num_layers)
    target.check_hidden_ids(recipe.features.hidden_ids)
    data = prepare_data(recipe, target, dist)
    cache = build_cache(recipe, target, data, dist) if recipe.features.mode == "offline" else None
    train_ds, featurize = training_data(recipe, target, "train", dist, recipe.train.pack_length, data, cache)
    eval_ds, _ = training_data(recipe, target, "eval", dist, recipe.train.pack_length, data, cache)
    if recipe.train.max_sequences and state.is_main_process:  # the draft vocabulary is counted on these too
        print(
            f"[train] train.max_sequences: training on the first {recipe.train.max_sequences} train sequences "
            f"(held-out split unchanged)",
            flush=True,
        )
    # 3. the drafter, then 4. the loop.
    drafter = build_drafter(recipe, target, train_ds, state.process_index).to(state.device)
    if recipe.train.init_from:
        warm_start(drafter, recipe.train.init_from, target)
    # the run's record names a fetched source by its `fetch:` name, not this machine's path, so a shipped
    # drafter's config.json and a run's config.yaml rerun anywhere (the caches are keyed by content, not path)
    recorded = dataclasses.replace(recipe, data=dataclasses.replace(recipe.data, source=given_source))
    recipe_dict = to_dict(recorded)
    train(
        recipe,
        drafter,
        target,
        train_ds,
        eval_ds,
        featurize,
        export_fn=lambda d, out, state: save_drafter(d, out, recipe=recipe_dict, target_id=recipe.target, state=state),
        record=recorded,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m train", description=__doc__.splitlines()[0])
    ap.add_argument("recipe", help="recipe YAML")
    ap.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. train.steps=100 target=DIR")
    args = ap.parse_args(argv)
    return run(load_recipe(args.recipe, args.overrides))


if __name__ == "__main__":
    sys.exit(run_cli(main))
