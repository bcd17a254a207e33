"""A native drafter directory from one of a run's training checkpoints (`python -m train.snapshot`).

The loop exports only its last step (RUN_DIR/export). A learning curve, or picking an earlier step that
decoded better, needs the drafter of step N as a directory every decoder entry point loads
(`draftsmith evaluate --drafter DIR`, scripts/bench_chat.py, drafters.export for vLLM/SGLang):

    python -m train.snapshot RUN_DIR [--step N] [--out DIR]      (default: the newest checkpoint, RUN_DIR/snapshots/step_N)

1. read the run's resolved recipe (RUN_DIR/config.yaml) and build an empty drafter of its kind on the target;
2. load the checkpoint's weights (accelerate's model.safetensors, keys prefixed `drafter.`), every key
   required — EAGLE-3's draft-vocabulary maps (d2t, t2d) are buffers in it, so the training data is not read;
3. write the native checkpoint atomically (drafters.serving.checkpoint.save_drafter), as the loop's export.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from decode.errors import UserError, run_cli
from decode.target import Target
from drafters.serving.checkpoint import new_drafter, save_drafter
from train.checkpoints import CKPT_PREFIX, checkpoints
from train.config import load_recipe, to_dict

PREFIX = "drafter."  # train/loop.py wraps the drafter in a module whose attribute is `drafter`


def uses_lora(recipe) -> bool:
    """A LayerSkip-LoRA drafter: it adapts the target's own layers, one drafter per loaded target."""
    return recipe.drafter.kind == "layerskip" and recipe.drafter.layerskip.mode == "lora"


def find_step(run_dir: Path, step: int | None) -> Path:
    """The checkpoint directory of `step` (None: the newest), or an error listing the steps there are."""
    found = checkpoints(run_dir)
    if not found:
        raise UserError(f"{run_dir}: no training checkpoints under {run_dir / 'checkpoints'} (is it a run directory?)")
    if step is None:
        return found[-1]
    for p in found:
        if p.name == f"{CKPT_PREFIX}{step}":
            return p
    steps = ", ".join(p.name[len(CKPT_PREFIX) :] for p in found)
    raise UserError(f"{run_dir}: no checkpoint of step {step}; there are steps {steps}")


def snapshot(
    run_dir: str | Path, step: int | None = None, out: str | Path | None = None, target: Target | None = None
) -> Path:
    """Write the native drafter of `step`'s checkpoint (None: the newest) to `out`; returns `out`.

    `target`: the run's target, already loaded (saves a reload when many steps are exported); a LayerSkip-LoRA
    run always loads its own, since its drafter injects peft adapters into the target it is built on."""
    from safetensors.torch import load_file

    run_dir = Path(run_dir)
    ckpt = find_step(run_dir, step)
    if not (run_dir / "config.yaml").is_file():
        raise UserError(f"{run_dir}/config.yaml is missing: not a run directory written by `python -m train`")
    recipe = load_recipe(run_dir / "config.yaml")
    if target is None or uses_lora(recipe):
        target = Target.load(recipe.target, dtype="float32")
    # 1. an empty drafter of the recipe's kind and settings (the weights come next, so no token counts needed).
    module = new_drafter(recipe.drafter.kind, target, recipe.drafter.selected())
    # 2. the checkpoint's weights, every key required.
    weights = ckpt / "model.safetensors"
    if not weights.is_file():
        raise UserError(
            f"{weights} is missing (a sharded FSDP/ZeRO-3 checkpoint? export its final step from "
            f"{run_dir / 'export'} instead)"
        )
    raw = load_file(str(weights))
    state = {k.removeprefix(PREFIX): v for k, v in raw.items() if k.startswith(PREFIX)}
    missing, extra = module.load_state_dict(state, strict=False)
    if missing or extra:
        raise UserError(
            f"{weights}: keys do not match the run's {recipe.drafter.kind} drafter (missing "
            f"{sorted(missing)[:5]}, unexpected {sorted(extra)[:5]}): was config.yaml edited?"
        )
    # 3. the native directory, atomically.
    out = Path(out) if out else run_dir / "snapshots" / ckpt.name
    return save_drafter(module, out, recipe=to_dict(recipe), target_id=recipe.target)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m train.snapshot", description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", help="a training run directory (config.yaml, checkpoints/)")
    ap.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the newest)")
    ap.add_argument("--out", default=None, help="output directory (default RUN_DIR/snapshots/step_N)")
    args = ap.parse_args(argv)
    print(snapshot(args.run_dir, args.step, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
