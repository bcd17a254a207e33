"""Draft shapes side by side: one drafter as chains and dynamic trees, interleaved with AR on the same chat prompts.

Where `--tree auto` predicts a shape from calibrated acceptance and the pass-cost curve, this measures the
candidates directly: for each shape, τ, tokens/s over AR's in the same run, and the milliseconds a round spends
drafting and verifying (the decoder's own clocks). Timing is interleaved (decode.harness.evaluate.interleaved):
conversation by conversation every row decodes it back to back, the order rotated.

    python scripts/bench_shapes.py [DRAFTER] [--shapes chain:8 dynamic:topk=4,depth=1,nodes=4 ...]
        [--target DIR] [--per-category 1] [--max-new-tokens 64] [--dtype auto|float32|bfloat16] [--threads 1]

DRAFTER defaults to the shipped chat drafter (recipes/smollm2-135m/drafters/eagle3); a shape `chain:K` is a chain
of K, anything else a `--tree` spec.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from decode.errors import missing_target
from decode.harness.evaluate import interleaved, make_run
from decode.harness.prompts import Conversation, first_per_category, load_prompts
from decode.harness.report import total_stats
from decode.harness.runs import EvalConfig
from decode.target import Target

REPO = Path(__file__).resolve().parents[1]
SHAPES = [
    "chain:8",
    "dynamic:topk=2,depth=1,nodes=2",
    "dynamic:topk=4,depth=1,nodes=4",
    "dynamic:topk=8,depth=1,nodes=8",
    "dynamic:topk=2,depth=2,nodes=4",
    "dynamic:topk=4,depth=2,nodes=8",
    "dynamic:topk=8,depth=6,nodes=24",
]


def row_spec(drafter: str, shape: str) -> tuple[str, int]:
    """(SPEC@TREE, chain length) for one shape: `chain:K` is a chain of K (the default tree), else a --tree spec."""
    if shape.startswith("chain:"):
        return drafter, int(shape.removeprefix("chain:"))
    return f"{drafter}@{shape}", 8


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "drafter",
        nargs="?",
        default=str(REPO / "recipes/smollm2-135m/drafters/eagle3"),
        help="a drafter SPEC or directory (default: the shipped chat drafter)",
    )
    ap.add_argument("--shapes", nargs="+", default=SHAPES, help="chain:K or --tree specs")
    ap.add_argument("--target", default=str(REPO / "recipes/targets/smollm2-135m-instruct"))
    ap.add_argument("--prompts", default=str(REPO / "recipes/data/mt_bench_question.jsonl"))
    ap.add_argument("--per-category", type=int, default=1, help="first turns per category")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if missing_target(args.target):
        return 2
    target = Target.load(args.target, dtype=args.dtype)
    convs = first_per_category(load_prompts(args.prompts, None), args.per_category)
    convs = [Conversation(c.id, c.category, c.turns[:1]) for c in convs]
    runners = [("ar", make_run("ar", target, EvalConfig(max_new_tokens=args.max_new_tokens)))]
    for shape in args.shapes:
        spec, k = row_spec(args.drafter, shape)
        runners.append((shape, make_run(spec, target, EvalConfig(max_new_tokens=args.max_new_tokens, draft_len=k))))
    cfg = EvalConfig(max_new_tokens=args.max_new_tokens)
    runs, _ = interleaved(target, runners, convs, cfg)
    print(
        f"{args.drafter}, {str(target.dtype).removeprefix('torch.')}, {args.threads} thread(s); {len(convs)} "
        f"first turns x {args.max_new_tokens} new tokens, greedy, interleaved"
    )
    print(f"{'shape':<34} {'tau':>6} {'tok/s':>7} {'vs AR':>6} {'draft ms':>9} {'verify ms':>10}  (a round)")
    ar_rate = None
    for run in runs:
        s = total_stats(run.turns)
        ar_rate = ar_rate or s.tokens_per_s
        rounds = s.rounds or 1
        print(
            f"{run.spec:<34} {s.tau:>6.3f} {s.tokens_per_s:>7.1f} {s.tokens_per_s / ar_rate:>6.2f} "
            f"{1e3 * s.draft_s / rounds:>9.1f} {1e3 * s.verify_s / rounds:>10.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
