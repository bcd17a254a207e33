"""Learning curves: decoded τ and acceptance by depth of a run's drafter at each saved step, on MT-bench.

Train with a constant learning rate (after warm-up) and keep every checkpoint; then the drafter at step s
is the drafter of an s-step run, and one run gives the whole curve:

    # (a) optimizer steps at fixed data: many epochs over the recipe's 1,024 answers
    python -m train recipes/smollm2-135m/eagle3.yaml run_dir=runs/lc/e3-steps train.steps=2000 \\
        train.schedule=constant train.save_every=125 train.keep_checkpoints=20 train.eval_every=0 train.sim_eval_prompts=0
    # (b) training tokens at a fixed number of epochs (one): a single pass over more answers; the
    #     checkpoint after N trained tokens is a one-epoch run over a random N-token subset (FINDINGS.md,
    #     "The tokens axis"). Beside it ("More epochs over less data vs one pass over more"): the same steps
    #     over a fixed 993 of those answers (train.max_sequences=993), more passes over less data against
    #     one pass over more at each step
    python -m train recipes/smollm2-135m/eagle3.yaml run_dir=runs/2026-12-04-e3-pass data.max_records=5376 \\
        train.steps=1300 train.schedule=constant train.save_every=80 train.keep_checkpoints=20 ...
    python scripts/learning_curve.py runs/2026-12-04-e3-pass --steps 80,160,320,640,1300 --out runs/2026-12-04-eval-pass
    # a lever ablation: one run per lever; --base labels each run with the settings it changes
    python scripts/learning_curve.py runs/abl/base runs/abl/noise-none --base runs/abl/base --chains 8 --out runs/abl/curves

For every (run, step): the native drafter (train.snapshot), then greedy decoding of MT-bench first turns
(`--per-category` of each of the 8 categories) as chains of each `--chains` length and the `--tree`, with
τ and acceptance by depth (P(accepted >= d), decode.metrics). Each point is appended to OUT/points.jsonl
as it finishes, so a rerun skips what is done; OUT/curve.md (the table) and OUT/curve.png (τ against
steps and against trained tokens, and depth-2 / depth-1 against steps) are rewritten at the end; with
`--base RUN`, each run is labelled by the settings it changes against RUN (the table's "changes" column, and
its paired τ difference to RUN's point with the standard error over prompts) and
OUT/levers.png shows each run's last point as τ bars; when levers ran at several seeds (`seed=N` overrides),
OUT/seeds.md pools each lever's seeds: mean τ (min–max), Δ to the base's mean, inside the seed spread or not,
and each seed's Δ paired with the base run of that seed (OUT/seeds.png plots those).
Each point stores its run's config, so a committed points.jsonl can serve a later ablation on the same data: `--reference FILE` joins its points (never
re-evaluated) and `--base NAME` may name one of its runs:

    python scripts/learning_curve.py runs/2026-12-03-ttt5 \\
        --reference recipes/smollm2-135m/curves/2026-12-02-levers-noise.points.jsonl \\
        --base abl-base --chains 8 --out runs/2026-12-03-levers

This file is the command line and its flow (runs and checkpoints in, decoding, points out); the points'
labels, statistics and table are in scripts/curve_points.py, the figures in scripts/curve_plot.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from decode.generate import encode_prompt, generate
from decode.harness.prompts import Conversation, first_per_category, load_prompts, render_turn
from decode.metrics import GenStats
from decode.sampling import SamplingConfig
from decode.target import Target
from decode.tree import parse_shape
from drafters.registry import make_drafter
from train.checkpoints import CKPT_PREFIX, RUN_STATE, checkpoints
from train.config import load_recipe
from train.snapshot import snapshot, uses_lora

REPO = Path(__file__).resolve().parents[1]
# run as `python scripts/learning_curve.py`, sys.path starts at scripts/ itself: the checkout makes its helper
# modules importable as scripts.*
sys.path.insert(0, str(REPO))
# paired_delta is not used here; kept importable from this script (tests/scripts/test_learning_curve.py reads it)
from scripts.curve_plot import plot, plot_levers, plot_seed_pairs  # noqa: E402
from scripts.curve_points import lever, read_references, seed_pairs, seed_table, write_table  # noqa: E402
from scripts.curve_points import paired_delta as paired_delta  # noqa: E402

MT_BENCH = REPO / "recipes/data/mt_bench_question.jsonl"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "runs",
        nargs="*",
        help="training run directories (checkpoints kept at the curve's steps); none: re-tabulate --reference",
    )
    ap.add_argument("--out", required=True, help="points.jsonl, curve.md and curve.png go here")
    ap.add_argument(
        "--steps",
        default="",
        help="comma-separated steps to evaluate where a run saved them (default: every saved one)",
    )
    ap.add_argument("--prompts", default=str(MT_BENCH), help="a prompt file (decode.harness.prompts forms)")
    ap.add_argument("--per-category", type=int, default=2, help="first N conversations of each category")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--chains", default="3,8", help="chain lengths k")
    ap.add_argument("--tree", default="dynamic:topk=8,depth=6,nodes=24")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--base",
        default="",
        help="a run directory, or the name of a --reference run: label each run "
        "with the settings it changes against this one (a lever ablation)",
    )
    ap.add_argument(
        "--reference",
        action="append",
        default=[],
        metavar="POINTS",
        help="an earlier points.jsonl (e.g. a committed one) whose points join the table and plots; "
        "repeatable. For an ablation against another run, trained earlier on the same data",
    )
    args = ap.parse_args(argv)
    if not args.runs and not args.reference:
        ap.error("give training run directories, or --reference points files to tabulate again")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    wanted = [int(s) for s in args.steps.split(",") if s.strip()]
    chains = [int(k) for k in args.chains.split(",") if k.strip()]
    shapes = {**{f"chain-{k}": "chain" for k in chains}, "tree": args.tree}
    draft_len_of = {f"chain-{k}": k for k in chains}
    # 1. what to evaluate, and what an earlier run of this script already did.
    plan = []
    for run in map(Path, args.runs):
        saved = [int(p.name[len(CKPT_PREFIX) :]) for p in checkpoints(run)]
        if not saved:
            print(f"error: {run}: no checkpoints (train with train.keep_checkpoints large enough)", file=sys.stderr)
            return 2
        plan += [(run, s) for s in pick_steps(saved, wanted)]
    log = out / "points.jsonl"
    points = known_points(log, args.reference, plan, args.runs)
    done = {(p["run"], p["step"]) for p in points}
    fill_trained_tokens(points, args.runs)
    base = base_config(args.base, points) if args.base else None
    if base is not None:
        label_levers(points, base, args.runs)
    todo = [(run, step) for run, step in plan if (run.name, step) not in done]
    if todo:  # 2. one target for every point; each drafter decodes the same first turns.
        convs = first_per_category(load_prompts(args.prompts), args.per_category)
        target = Target.load(run_target(Path(args.runs[0])), dtype=args.dtype)
        ids = prompts(target, convs)
        print(
            f"{len(todo)} of {len(plan)} points to decode ({len(points)} read), {len(convs)} prompts x "
            f"{args.max_new_tokens} tokens, {target.dtype}, shapes {shapes}",
            file=sys.stderr,
        )
    for run, step in todo:
        point = evaluate_point(run, step, target, ids, shapes, draft_len_of, args, base)
        points.append(point)
        with log.open("a") as f:
            f.write(json.dumps(point) + "\n")
        print(
            f"{run.name} step {step}: " + ", ".join(f"{k} {v['tau']:.3f}" for k, v in point["shapes"].items()),
            file=sys.stderr,
        )
    # 3. the table and the figure.
    print(write_table(points, list(shapes), out / "curve.md"))
    plot(points, list(shapes), out / "curve.png")
    if base is not None:
        plot_levers([p for p in points if "lever" in p], list(shapes), out / "levers.png")
        if seeds := seed_table(points, list(shapes)):  # levers run at several seeds: Δ against the seed spread
            (out / "seeds.md").write_text(seeds)
            if pairs := seed_pairs(points, list(shapes)):  # per-prompt τ of a base at each seed
                plot_seed_pairs(pairs, list(shapes), out / "seeds.png")
            print(seeds)
    print(
        f"wrote {out / 'curve.md'} and {out / 'curve.png'}" + (" and levers.png" if base is not None else ""),
        file=sys.stderr,
    )
    return 0


# --- step 1: the plan and the points already known ---------------------------------------------------------


def pick_steps(available: list[int], wanted: list[int] | None) -> list[int]:
    """The steps to evaluate: those of `wanted` this run saved (several runs may share one list), or every
    saved step; none of them saved is an error."""
    if not wanted:
        return available
    chosen = [s for s in wanted if s in available]
    if not chosen:
        raise SystemExit(f"error: none of steps {wanted} has a checkpoint (saved: {available}); choose from those")
    return chosen


def known_points(log: Path, references: list[str], plan: list[tuple[Path, int]], runs: list[str]) -> list[dict]:
    """The points an earlier call of this script wrote to OUT/points.jsonl, then those of the --reference files
    whose run is none of this call's (this call's runs win)."""
    points = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    own = {p["run"] for p in points} | {run.name for run, _ in plan}
    return points + [p for p in read_references(references) if p["run"] not in own]


def run_named(runs: list[str], name: str) -> Path | None:
    """The first of this call's run directories with that name, None for a run only a points file knows."""
    return next((Path(r) for r in runs if Path(r).name == name), None)


def fill_trained_tokens(points: list[dict], runs: list[str]) -> None:
    """A count the run's checkpoints hold but an older version of this script did not read: filled in place."""
    for p in points:
        run = run_named(runs, p["run"])
        if p.get("trained_tokens") is None and run is not None:
            p["trained_tokens"] = trained_tokens(run, p["step"])


def label_levers(points: list[dict], base: dict, runs: list[str]) -> None:
    """Each point's `lever` against the --base of this call (a stored label from another --base is replaced)."""
    for p in points:
        run = run_named(runs, p["run"])
        config = yaml_of(run) if run is not None else p.get("config")
        if config is not None:
            p["lever"] = lever(config, base)


def trained_tokens(run_dir: Path, step: int) -> int | None:
    """Trained (loss-masked) tokens seen by `step`: the checkpoint's own count (train/checkpoints.py keeps it in
    draftsmith_state.json), else the metrics.jsonl row of that step; None for runs older than the count."""
    state = run_dir / "checkpoints" / f"{CKPT_PREFIX}{step}" / RUN_STATE
    if state.exists() and "trained_tokens" in (s := json.loads(state.read_text())):
        return s["trained_tokens"]
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return next((r["trained_tokens"] for r in rows if r.get("step") == step and "trained_tokens" in r), None)


def base_config(base: str, points: list[dict]) -> dict:
    """--base: a run directory's config.yaml, else the stored config of the reference run of that name."""
    if Path(base, "config.yaml").exists() or "/" in base:
        return yaml_of(Path(base))
    config = next((p.get("config") for p in points if p["run"] == base and p.get("config")), None)
    if config is None:
        raise SystemExit(f"error: --base {base}: neither a run directory nor a --reference run with a stored config")
    return config


def yaml_of(run: Path) -> dict:
    """A run's resolved config (its config.yaml); a directory without one is an error that says so."""
    import yaml

    path = run / "config.yaml"
    if not path.exists():
        raise SystemExit(f"error: {run} has no config.yaml: pass a training run directory")
    return yaml.safe_load(path.read_text())


def run_target(run: Path) -> str:
    """The target directory a run trained on (its config.yaml's `target`)."""
    return yaml_of(run)["target"]


# --- step 2: decoding --------------------------------------------------------------------------------------


def prompts(target: Target, convs: list[Conversation]) -> list[torch.Tensor]:
    """Each conversation's first turn, rendered with the target's chat template. Each [1, T]."""
    out = []
    for c in convs:
        text, special = render_turn(target.tokenizer, c.turns[:1], [])
        out.append(encode_prompt(target, text, special))
    return out


def evaluate_point(
    run: Path,
    step: int,
    target: Target,
    ids: list[torch.Tensor],
    shapes: dict[str, str],
    draft_len_of: dict[str, int],
    args: argparse.Namespace,
    base: dict | None,
) -> dict:
    """One point: the run's drafter at `step` (a native snapshot) decoded on every prompt in every shape, with
    the run's config and what the point was measured under."""
    snap = snapshot(run, step, run / "snapshots" / f"{CKPT_PREFIX}{step}", target)
    # a LayerSkip-LoRA drafter adapts the target it is built on: a fresh target for each of those
    t = Target.load(run_target(run), dtype=args.dtype) if uses_lora(load_recipe(run / "config.yaml")) else target
    res = decode_point(t, snap, ids, shapes, args.max_new_tokens, draft_len_of)
    config = yaml_of(run)  # stored: the points file describes its runs, and a later --reference reads it
    return {
        "run": run.name,
        "step": step,
        "trained_tokens": trained_tokens(run, step),
        "shapes": res,
        "config": config,
        **({"lever": lever(config, base)} if base is not None else {}),
        "prompts": len(ids),
        "max_new_tokens": args.max_new_tokens,
        "dtype": str(target.dtype),
    }


def decode_point(
    target: Target,
    drafter_dir: Path,
    ids: list[torch.Tensor],
    shapes: dict[str, str],
    max_new_tokens: int,
    draft_len_of: dict[str, int],
) -> dict[str, dict]:
    """τ and acceptance by depth of one drafter for each named shape, over all prompts (greedy)."""
    drafter = make_drafter(str(drafter_dir), target)
    out = {}
    for name, tree in shapes.items():
        shape = parse_shape(tree, draft_len_of.get(name, 8))
        total, per_prompt = GenStats(), []
        for x in ids:
            stats = generate(target, drafter, x, max_new_tokens, SamplingConfig(), shape).stats
            total = total.merge(stats)
            per_prompt.append(stats.tau)
        out[name] = {
            "tau": total.tau,
            "by_depth": total.acceptance_by_depth,
            "new_tokens": total.new_tokens,
            "per_prompt": per_prompt,
        }
    return out


if __name__ == "__main__":
    sys.exit(main())
