"""The real-chat-model table: MT-bench and Spec-Bench on SmolLM2-135M-Instruct, every row measured in one run.

Rows: our `ar`, the untrained `early-exit:4` / `early-exit:8` (the mission's first-4/8-layer baseline),
`prompt-lookup`, `lookahead`, each trained drafter given as an argument (chain k=8, a dynamic
tree, and `--tree auto`: the shape decode.harness.autoshape predicts fastest, its prediction beside the measurement), and HF `generate()` / HF prompt lookup as peers. Columns: τ, tokens/s, speedup vs our AR
(with its spread), matches_ar, and the projected speedup at a 20 s target pass (a streamed 14B).

Timing is **interleaved** (decode.harness.evaluate.interleaved) so that a change in the shared machine's
load cannot pass for a speedup: conversation by conversation every row decodes it back to back, the
row order rotated per conversation; the table gives each row's overall tokens/s over AR's and the
median [min, max] of the per-conversation ratios (the spread).

    python scripts/bench_chat.py [--target DIR] [--suite mt-bench|spec-bench|both] [--limit N]
        [--per-category N] [--first-turn-only] [--max-new-tokens N] [--dtype auto|float32|bfloat16] [--threads 1]
        [--tree dynamic:topk=8,depth=6,nodes=24] [--workers N] [--out DIR] [TRAINED_DRAFTER_DIR ...]

--workers N deals the conversations to N processes of one thread each (decode.harness.workers), each interleaving
as above: the whole machine, every row under the same load.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

from decode.errors import missing_target
from decode.harness.divergence import print_divergences
from decode.harness.evaluate import evaluate, make_run
from decode.harness.prompts import Conversation, first_per_category, load_prompts
from decode.harness.report import write_report
from decode.harness.runs import EvalConfig
from decode.target import Target

REPO = Path(__file__).resolve().parents[1]
SUITES = {
    "mt-bench": REPO / "recipes/data/mt_bench_question.jsonl",
    "spec-bench": REPO / "recipes/data/spec_bench_question.jsonl",
}
UNTRAINED = ["early-exit:4", "early-exit:8", "prompt-lookup", "lookahead"]
CHAT_TARGET = REPO / "recipes/targets/smollm2-135m-instruct"
SHIPPED = REPO / "recipes/smollm2-135m/drafters/eagle3"  # the trained chat drafter in the repo (EAGLE-3 layout, bf16)
PEERS = ["hf-generate", "hf-prompt-lookup"]


def row_specs(untrained: list[str], trained: list[str], tree: str) -> list[str]:
    """AR first, then the untrained rows, each trained drafter as a chain, a tree and auto, then the HF peers."""
    specs = ["ar", *untrained]
    for d in trained:
        specs += [d, f"{d}@{tree}", f"{d}@auto"]
    return specs + PEERS


def print_table(report: dict, title: str, file=sys.stdout) -> None:
    print(title, file=file)
    print(
        f"{'row':<52} {'tau':>6} {'tok/s':>7} {'vs AR':>6} {'spread (median [min, max])':>27} {'= AR':>5} {'@20s':>6}",
        file=file,
    )
    for d in report["drafters"]:
        r = d["speedup_vs_ar_per_conversation"]
        spread = f"{statistics.median(r):.2f} [{min(r):.2f}, {max(r):.2f}]" if r else "-"
        same = {True: "yes", False: "NO", None: "-"}[d["matches_ar"]]
        proj = f"{d['cost_model'][0]['speedup_vs_ar']:.2f}" if d["cost_model"] else "-"  # HF: no drafting split
        name = d["name"].replace(str(REPO) + "/", "")
        print(
            f"{name:<52} {d['mean_accepted_tokens']:>6.3f} {d['tokens_per_s']:>7.1f} {d['speedup_vs_ar']:>6.2f} "
            f"{spread:>27} {same:>5} {proj:>6}",
            file=file,
        )


def print_categories(report: dict, file=sys.stdout) -> None:
    """τ per category (Spec-Bench's six tasks; MT-bench's eight)."""
    cats = list(dict.fromkeys(c for d in report["drafters"] for c in d["per_category"]))
    print(f"\n{'tau per category':<52} " + " ".join(f"{c[:11]:>11}" for c in cats), file=file)
    for d in report["drafters"]:
        name = d["name"].replace(str(REPO) + "/", "")
        print(
            f"{name:<52} "
            + " ".join(
                f"{d['per_category'][c]['mean_accepted_tokens']:>11.3f}" if c in d["per_category"] else f"{'-':>11}"
                for c in cats
            ),
            file=file,
        )


def print_auto(report: dict, file=sys.stdout) -> None:
    """--tree auto rows: the shape chosen, predicted vs measured τ and speedup."""
    rows = [d for d in report["drafters"] if d.get("auto")]
    if rows:
        print(
            f"\n{'auto row':<52} {'shape':<34} {'tau pred':>8} {'meas':>6} {'speedup pred':>12} {'meas':>6}", file=file
        )
    for d in rows:
        a, name = d["auto"], d["name"].replace(str(REPO) + "/", "")
        pred = (
            (f"{a['predicted_tau']:>8.2f}", f"{a['predicted_speedup_vs_ar']:>12.2f}")
            if a["predicted_tau"]
            else (f"{'-':>8}", f"{'-':>12}")
        )
        print(
            f"{name:<52} {a['shape']:<34} {pred[0]} {a['measured_tau']:>6.2f} {pred[1]} "
            f"{a['measured_speedup_vs_ar']:>6.2f}",
            file=file,
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "drafters",
        nargs="*",
        help="trained drafter directories (native or exported); none on the "
        "chat target: the shipped one, " + str(SHIPPED.relative_to(REPO)),
    )
    ap.add_argument("--target", default=str(CHAT_TARGET))
    ap.add_argument("--suite", choices=["mt-bench", "spec-bench", "both"], default="both")
    ap.add_argument("--limit", type=int, default=None, help="only the first N conversations of each suite")
    ap.add_argument(
        "--per-category",
        type=int,
        default=None,
        metavar="N",
        help="only the first N conversations of each category (a cheaper run that still covers them all)",
    )
    ap.add_argument("--first-turn-only", action="store_true", help="MT-bench: decode only the first turn")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--draft-len", type=int, default=8)
    ap.add_argument("--tree", default="dynamic:topk=8,depth=6,nodes=24", help="the trained drafters' tree row")
    ap.add_argument("--untrained", nargs="*", default=UNTRAINED, metavar="SPEC", help="the untrained rows")
    ap.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="auto: bfloat16 where the hardware has it (greedy rows may then leave AR's at near-ties: "
        "reported with AR's top-2 margin); float32 for token-identical rows",
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--runtime", choices=["fast", "hf"], default="fast", help="the target's runtime (decode.runtime)")
    ap.add_argument(
        "--workers",
        type=int,
        default=1,
        help="deal the conversations to N processes of 1 thread each (decode.harness.workers; N <= cores)",
    )
    ap.add_argument("--out", default=None, help="write report.json/report.md/plots per suite under this directory")
    args = ap.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        ap.error("--limit must be >= 1")
    if args.threads < 1:
        ap.error(f"--threads {args.threads}: must be >= 1")
    if args.workers < 1 or (args.workers > 1 and args.threads != 1):
        ap.error("--workers must be >= 1, and workers run 1 thread each (leave --threads at 1)")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # HF assisted generation warns on every drafting call
    torch.set_num_threads(args.threads)
    if missing_target(args.target):
        return 2
    target = Target.load(args.target, args.runtime, dtype=args.dtype)
    dtype = str(target.dtype).removeprefix("torch.")
    print(f"dtype: {dtype}" + (" (auto)" if args.dtype == "auto" else ""), file=sys.stderr)
    cfg = EvalConfig(max_new_tokens=args.max_new_tokens, draft_len=args.draft_len)
    if not args.drafters and Path(args.target).resolve() == CHAT_TARGET.resolve() and SHIPPED.is_dir():
        args.drafters = [str(SHIPPED)]  # the trained drafter made for this target
    specs = row_specs(args.untrained, args.drafters, args.tree)
    runners = [(s, make_run(s, target, cfg)) for s in specs]  # every SPEC resolved before anything runs
    suites = ["mt-bench", "spec-bench"] if args.suite == "both" else [args.suite]
    for suite in suites:
        convs = load_prompts(SUITES[suite], args.limit)
        if args.per_category:
            convs = first_per_category(convs, args.per_category)
        if args.first_turn_only:
            convs = [Conversation(c.id, c.category, c.turns[:1]) for c in convs]
        meta = {"target": args.target, "prompts": str(SUITES[suite]), "dtype": dtype, "runtime": args.runtime}
        report = evaluate(
            target,
            runners,
            convs,
            cfg,
            [20.0],
            meta,
            run_dir=str(Path(args.out) / suite) if args.out else None,
            workers=args.workers,
        )
        if args.out:
            write_report(report, Path(args.out) / suite)
        turns = "first turns" if args.first_turn_only else "all turns"
        print_table(
            report,
            f"\n{suite}: {len(convs)} conversations ({report['settings']['turns']} turns, "
            f"{turns}), {args.max_new_tokens} new tokens, greedy, {dtype}, {args.threads} thread(s)"
            f"{f' x {args.workers} workers' if args.workers > 1 else ''}; "
            f"chain k={args.draft_len} unless @tree; interleaved timing",
        )
        print_categories(report)
        print_auto(report)
        print_divergences(report)
    print(
        "\nvs AR: total tokens/s over our AR's in the same run; spread: that ratio per conversation. "
        "@20s: projected speedup vs AR at a 20 s target pass (measured tau and drafting cost)."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
