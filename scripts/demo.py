"""The demo: train drafters on the bundled story target, export them, evaluate against the baselines.

1. train LayerSkip, Medusa and EAGLE-3 with the tiny recipes (recipes/stories260K/*.yaml) on
   stories the target samples itself (online features: nothing cached);
2. export: the native checkpoints land in runs/demo/<kind>/export; EAGLE-3 is also exported to
   the SGLang layout and evaluated from there (import round trip);
3. evaluate on the dev prompts, greedy, 128 new tokens: AR, the untrained early exits
   (early-exit:1 and :2 are the bundled target's counterparts of the first 4/8 of Qwen3-14B's 40
   layers), prompt lookup, and the trained drafters as chains and trees. Every row must match AR.
Writes runs/demo/report.{json,md} and plots, and prints the table.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TARGET = "recipes/targets/stories260K"
TREE = "dynamic:topk=8,depth=6,nodes=60"


def sh(*cmd: str) -> None:
    print("$ " + " ".join(cmd), flush=True)
    subprocess.run([sys.executable, *cmd], cwd=REPO, check=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/demo")
    ap.add_argument(
        "--steps",
        type=int,
        nargs=3,
        default=[300, 300, 600],
        metavar=("LAYERSKIP", "MEDUSA", "EAGLE3"),
        help="training steps per drafter",
    )
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--skip-train", action="store_true", help="reuse the drafters already in --out")
    args = ap.parse_args()
    out = Path(args.out)
    t0 = time.perf_counter()

    # 1. train (each run exports its native checkpoint to RUN_DIR/export)
    kinds = dict(zip(["layerskip", "medusa", "eagle3"], args.steps))
    if not args.skip_train:
        for kind, steps in kinds.items():
            sh(
                "-m",
                "train",
                f"recipes/stories260K/{kind}.yaml",
                f"run_dir={out / kind}",
                "features.mode=online",
                f"train.steps={steps}",
                "train.eval_every=0",
                "train.save_every=0",
                "train.log_every=50",
            )
    t_train = time.perf_counter() - t0

    # 2. export EAGLE-3 to the SGLang layout and evaluate the imported copy too
    drafters = [
        "early-exit:1",
        "early-exit:2",
        f"early-exit:2@{TREE}",
        "prompt-lookup",
        f"{out / 'layerskip/export'}",
        f"{out / 'medusa/export'}",
        f"{out / 'medusa/export'}@{TREE}",
        f"{out / 'eagle3/export'}",
        f"{out / 'eagle3/export'}@{TREE}",
    ]
    sh("-m", "drafters.export", str(out / "eagle3"), "--format", "eagle3", "--out", str(out / "eagle3-sglang"))
    drafters.append(f"{out / 'eagle3-sglang'}@{TREE}")

    # 3. evaluate everything on the same prompts
    # float32: the demo's table says every row matches AR, which only fp32 holds token for token (bf16 can
    # leave AR at near-ties); `--dtype auto` would pick bf16 on hardware that has it
    cmd = [
        "-m",
        "decode.harness.evaluate",
        "--target",
        TARGET,
        "--prompts",
        "recipes/prompts/stories_dev.txt",
        "--max-new-tokens",
        str(args.max_new_tokens),
        "--threads",
        "1",
        "--dtype",
        "float32",
        "--out",
        str(out),
    ]
    for d in drafters:
        cmd += ["--drafter", d]
    sh(*cmd)
    print(
        f"\ndemo: training {t_train / 60:.1f} min, total {(time.perf_counter() - t0) / 60:.1f} min; "
        f"report in {out / 'report.md'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
