"""`python -m train RECIPE.yaml [key=value ...]` (also under `accelerate launch -m train ...`).

1. load the recipe (typed, dotted overrides, unknown keys rejected) and the frozen target;
2. fill the feature ids the drafter needs, load the data (offline cache, fingerprint-checked, or
   online features computed inside the step);
3. build the drafter (EAGLE-3's draft vocabulary from the training data's token counts);
4. run the accelerate loop (train/loop.py) and export the native checkpoint to RUN_DIR/export.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch


def token_counts(dataset, vocab_size: int, limit: int = 20000) -> torch.Tensor:
    """Target-token frequencies over (up to `limit`) training sequences. [V]"""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for i in range(min(len(dataset), limit)):
        ids = dataset[i]["input_ids"]
        counts += torch.bincount(ids[ids < vocab_size], minlength=vocab_size)
    return counts


def build_drafter(recipe, target, train_ds) -> torch.nn.Module:
    """The trainable drafter module the recipe names, on the frozen target."""
    from drafters.checkpoint import drafter_kinds

    cls, _ = drafter_kinds()[recipe.drafter.kind]
    cfg = recipe.drafter.selected()
    if recipe.drafter.kind == "eagle3":
        return cls(target, cfg, token_counts=token_counts(train_ds, target.vocab_size))
    return cls(target, cfg)


def run(recipe) -> int:
    from accelerate import PartialState

    from drafters.checkpoint import save_drafter
    from train.config import to_dict, with_feature_ids
    from train.dataset import training_data
    from train.features import Dist, load_target
    from train.fetch import prepare
    from train.loop import train

    if not recipe.drafter.kind:
        raise ValueError("drafter.kind is not set: choose eagle3 | eagle1 | medusa | layerskip (e.g. drafter.kind=eagle3)")
    # 1. processes first. Plain CPU ranks need cpu=True (accelerate 1.15 forms no CPU ranks without it);
    # DeepSpeed (also on CPU with DS_ACCELERATOR=cpu) must get a plain PartialState: cpu=True would
    # turn it into MULTI_CPU, and a pre-set backend breaks the Accelerator's state.
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true"
    cpu = os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes") or not torch.cuda.is_available()
    state = PartialState() if deepspeed else PartialState(cpu=cpu)
    dist = Dist(state.process_index, state.num_processes, state.wait_for_everyone)
    with state.main_process_first():  # a fetchable target or `fetch:` data source is fetched once, on first use
        recipe = prepare(recipe)
    torch.manual_seed(recipe.seed)
    if recipe.train.threads:
        torch.set_num_threads(recipe.train.threads)
    target = load_target(recipe, state.device)
    # 2. data: offline features are checked against this recipe and target before any training.
    recipe = with_feature_ids(recipe, target.num_layers)
    train_ds, featurize = training_data(recipe, target, "train", dist, recipe.train.pack_length)
    eval_ds, _ = training_data(recipe, target, "eval", dist, recipe.train.pack_length)
    # 3. the drafter, then 4. the loop.
    drafter = build_drafter(recipe, target, train_ds).to(state.device)
    recipe_dict = to_dict(recipe)
    train(recipe, drafter, target, train_ds, eval_ds, featurize,
          export_fn=lambda d, out: save_drafter(d, out, recipe=recipe_dict, target_id=recipe.target))
    return 0


def main(argv: list[str] | None = None) -> int:
    from train.config import load_recipe

    ap = argparse.ArgumentParser(prog="python -m train", description=__doc__.splitlines()[0])
    ap.add_argument("recipe", help="recipe YAML")
    ap.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. train.steps=100 target=DIR")
    args = ap.parse_args(argv)
    return run(load_recipe(args.recipe, args.overrides))


if __name__ == "__main__":
    from decode.errors import run_cli

    sys.exit(run_cli(main))
