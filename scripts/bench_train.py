"""Quality bar of the tiny recipes: train each, then decode with it against the untrained early exit.

For each recipe in recipes/stories260K/{eagle3,eagle1,medusa,layerskip}.yaml: build its feature
cache and train it (as subprocesses, timed, peak RSS measured per process), then one evaluation
on the dev prompts (greedy, 128 new tokens): every trained drafter as a chain (k=8) and a dynamic
tree, next to early-exit:2 (the exit LayerSkip drafts from) with the same shapes. matches_ar must
be true on every row. Last, each recipe's simulated τ (the training eval's decoding-faithful
figure, train/simeval.py, on held-out prompts) next to the τ decoded here on the dev prompts.

    python scripts/bench_train.py                 # train + evaluate (about 20-30 min on 2 busy cores)
    python scripts/bench_train.py --skip-train    # evaluate the drafters already in runs/
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KINDS = ["eagle3", "eagle1", "medusa", "layerskip"]
TREE = "dynamic:topk=8,depth=6,nodes=60"


def timed(cmd: list[str]) -> tuple[float, float]:
    """Run a subprocess; (wall seconds, peak RSS in MiB of that process)."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as err:  # a file, not a pipe: progress bars would fill a pipe and block
        proc = subprocess.Popen([sys.executable, *cmd], cwd=REPO, stdout=subprocess.DEVNULL, stderr=err, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            err.seek(0)
            raise SystemExit(f"failed: {' '.join(cmd)}\n{err.read()[-2000:]}")
    return time.perf_counter() - t0, usage.ru_maxrss / 1024


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", nargs="+", default=KINDS)
    ap.add_argument("--skip-train", action="store_true")
    ap.add_argument("--out", default="runs/bench_train")
    ap.add_argument(
        "--overrides",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="recipe overrides for every run (e.g. train.steps=2 for a smoke run)",
    )
    ap.add_argument("--max-new-tokens", type=int, default=128, help="tokens decoded per dev prompt")
    ap.add_argument("--limit", type=int, default=None, help="only the first N dev prompts")
    args = ap.parse_args()
    rows, sims, nan = [], {}, float("nan")
    out = Path(args.out)
    for kind in args.kinds:
        recipe = f"recipes/stories260K/{kind}.yaml"
        run_dir = REPO / out / kind
        # a fresh run of the recipe as written: the regenerated stories are shared (data home), the feature
        # cache goes into the run dir, so every run measures its extraction
        where = [f"run_dir={out / kind}", f"features.cache_dir={out / kind / 'features'}", *args.overrides]
        if not args.skip_train:
            if run_dir.exists():
                shutil.rmtree(run_dir)
            fs, fmem = timed(["-m", "train.features", recipe, *where])
            ts, tmem = timed(["-m", "train", recipe, *where])
        else:
            fs = fmem = ts = tmem = float("nan")
        metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        tok_s = [m["tokens_per_s"] for m in metrics if "tokens_per_s" in m]
        final = json.loads((run_dir / "final_eval.json").read_text())
        rows.append(
            (
                kind,
                fs,
                fmem,
                ts,
                tmem,
                sum(tok_s) / max(1, len(tok_s)),
                final.get("eval/tf_tau_chain", nan),
                final.get("eval/tf_tau_tree", nan),
                final.get("eval/sim_s", nan),
            )
        )
        sims[kind] = (final.get("eval/sim_tau_chain", nan), final.get("eval/sim_tau_tree", nan))

    print("\n## training (tiny recipes, bundled target, 1 thread each)")
    print(
        f"{'recipe':<10} {'features s':>10} {'peak MiB':>9} {'train s':>8} {'peak MiB':>9} {'train tok/s':>12} "
        f"{'tf tau chain':>13} {'tf tau tree':>12} {'sim eval s':>11}"
    )
    for r in rows:
        print(
            f"{r[0]:<10} {r[1]:>10.1f} {r[2]:>9.0f} {r[3]:>8.1f} {r[4]:>9.0f} {r[5]:>12.0f} {r[6]:>13.2f} {r[7]:>12.2f} "
            f"{r[8]:>11.1f}"
        )

    drafters = ["early-exit:2", f"early-exit:2@{TREE}"]
    for kind in args.kinds:
        drafters += [f"{args.out}/{kind}/export", f"{args.out}/{kind}/export@{TREE}"]
    cmd = [
        sys.executable,
        "-m",
        "decode.harness.evaluate",
        "--target",
        "recipes/targets/stories260K",
        "--prompts",
        "recipes/prompts/stories_dev.txt",
        "--max-new-tokens",
        str(args.max_new_tokens),
        "--threads",
        "1",
        "--dtype",
        "float32",
        "--out",
        str(out / "eval"),
    ] + (["--limit", str(args.limit)] if args.limit else [])
    for d in drafters:
        cmd += ["--drafter", d]
    print(f"\n## decoding (dev prompts, greedy, {args.max_new_tokens} new tokens; chain k=8 and {TREE})", flush=True)
    subprocess.run(cmd, cwd=REPO, check=True, stderr=subprocess.DEVNULL)
    decoded = {
        d["spec"]: d["mean_accepted_tokens"]
        for d in json.loads((REPO / out / "eval/report.json").read_text())["drafters"]
    }
    print("\n## simulated tau (end of training: decoding held-out prompts) vs decoded tau (dev prompts)")
    print(
        f"{'recipe':<10} {'sim chain':>9} {'dec chain':>9} {'rel diff':>8} {'sim tree':>9} {'dec tree':>9} {'rel diff':>8}"
    )
    for kind, (sc, st) in sims.items():
        dc, dt = decoded[f"{args.out}/{kind}/export"], decoded[f"{args.out}/{kind}/export@{TREE}"]
        print(f"{kind:<10} {sc:>9.2f} {dc:>9.2f} {(sc - dc) / dc:>+8.1%} {st:>9.2f} {dt:>9.2f} {(st - dt) / dt:>+8.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
