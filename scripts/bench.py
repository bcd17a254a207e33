"""The benchmark table: every drafter and the HF peers on the same prompts, measured in one run.

Per drafter: τ, tokens/s, speedup vs our AR loop and vs HF `generate()`, matches_ar, and the
projected speedup at a target-pass cost of 20 s (a streamed 14B target) and 25 ms (a GPU), from
the measured τ and drafting cost (decode/harness/report.py states the formula). Trained drafters are
taken from runs/demo/ (run scripts/demo first) when present.

    python scripts/bench.py [--prompts FILE] [--max-new-tokens N] [--drafter SPEC ...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from decode.harness.evaluate import evaluate, prepare
from decode.harness.prompts import load_prompts
from decode.harness.runs import EvalConfig
from decode.target import Target

REPO = Path(__file__).resolve().parents[1]
TREE = "dynamic:topk=8,depth=6,nodes=60"


def default_drafters() -> list[str]:
    specs = [
        "hf-generate",
        "early-exit:1",
        "early-exit:2",
        f"early-exit:2@{TREE}",
        "skip:2",
        "prompt-lookup",
        "lookahead",
        "hf-assisted:early-exit:2",
        "hf-prompt-lookup",
    ]
    for kind in ("layerskip", "medusa", "eagle3"):
        d = REPO / "runs/demo" / kind / "export"
        if d.is_dir():
            specs += [str(d), f"{d}@{TREE}"]
    return specs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(REPO / "recipes/targets/stories260K"))
    ap.add_argument("--prompts", default=str(REPO / "recipes/prompts/stories_dev.txt"))
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--drafter", action="append", help="SPECs (default: untrained, HF peers, runs/demo drafters)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # HF assisted generation warns on every drafting call
    torch.set_num_threads(args.threads)
    target = Target.load(args.target)
    convs = load_prompts(args.prompts)
    cfg = EvalConfig(max_new_tokens=args.max_new_tokens)
    report = evaluate(
        target,
        prepare(target, args.drafter or default_drafters(), cfg),
        convs,
        cfg,
        pass_costs=[20.0, 0.025],
        progress=False,
    )
    rows = report["drafters"]
    hf = next((d for d in rows if d["name"] == "hf-generate"), None)
    print(
        f"target {args.target}; {len(convs)} prompts, {args.max_new_tokens} new tokens, greedy, chain k=8 unless @tree; "
        f"torch threads {args.threads}\n"
    )
    print(f"{'drafter':<48} {'tau':>6} {'tok/s':>7} {'vs AR':>6} {'vs HF':>6} {'= AR':>5} {'@20s':>6} {'@25ms':>6}")
    for d in rows:
        name = d["name"].replace(str(REPO) + "/", "")
        vs_hf = d["tokens_per_s"] / hf["tokens_per_s"] if hf else float("nan")
        proj = [f"{r['speedup_vs_ar']:.2f}" for r in d["cost_model"]] if d["cost_model"] else ["-", "-"]  # HF: no split
        same = {True: "yes", False: "NO", None: "-"}[d["matches_ar"]]
        print(
            f"{name:<48} {d['mean_accepted_tokens']:>6.3f} {d['tokens_per_s']:>7.1f} {d['speedup_vs_ar']:>6.2f} "
            f"{vs_hf:>6.2f} {same:>5} {proj[0]:>6} {proj[1]:>6}"
        )
    print("\n@20s / @25ms: projected speedup vs AR if one target pass cost that much (measured tau and drafting cost)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
