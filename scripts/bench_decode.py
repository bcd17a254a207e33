"""Decoder benchmark (issue 3): our AR loop vs HF generate(), the untrained drafters, chain vs tree.

    python scripts/bench_decode.py [--max-new-tokens 128] [--threads 1] [--limit N]

On the bundled target and its dev prompts, greedy, in one run:
1. tokens/s of our AR loop vs HF `generate()` (the ratio must be >= 0.9);
2. τ and tokens/s of early-exit:1..4 and layer skipping, each as a chain and as a dynamic tree;
3. HF assisted generation with `assistant_early_exit=K` (a chain of --draft-len, like ours);
4. where the time goes: draft / verify / commit per round.

Every configuration decodes prompt i before any decodes prompt i+1, in a rotating order, so a
shared machine's changing load hits all of them alike. Nothing here is hard-coded: every figure
is measured by this run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from decode.generate import encode_prompt  # noqa: E402
from decode.harness.evaluate import make_run  # noqa: E402
from decode.harness.prompts import load_prompts, render_turn  # noqa: E402
from decode.harness.runs import EvalConfig  # noqa: E402
from decode.metrics import GenStats  # noqa: E402
from decode.target import Target  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Row:
    """One configuration: a SPEC decoded with one tree shape; stats summed over prompts."""

    label: str
    spec: str
    tree: str
    runner: object = None
    stats: GenStats = field(default_factory=GenStats)
    outputs: list[list[int]] = field(default_factory=list)


def configs(args) -> list[tuple[str, str, str]]:
    """(label, SPEC, tree) in table order: AR, HF generate, our drafters x shapes, HF assisted early exit."""
    out = [("ar (ours)", "ar", "chain"), ("hf generate()", "hf-generate", "chain")]
    ours = [f"early-exit:{k}" for k in args.early_exit] + [f"skip:{s}" for s in args.skip]
    for spec in ours:
        out.append((f"{spec} chain", spec, "chain"))
        out.append((f"{spec} tree", spec, args.dynamic))
    out += [(f"hf assisted early_exit={k}", f"hf-assisted:early-exit:{k}", "chain") for k in args.early_exit]
    return out


def run_all(rows: list[Row], prompts: list, target: Target, cfg: EvalConfig) -> None:
    """Decode every prompt with every row, prompt by prompt, rotating which row goes first."""
    for i, ids in enumerate(tqdm(prompts, desc="prompts", file=sys.stderr, dynamic_ncols=True)):
        for j in range(len(rows)):
            row = rows[(i + j) % len(rows)]
            gen = row.runner.run(ids, cfg.max_new_tokens, cfg.sampling, cfg.seed)
            row.stats = row.stats.merge(gen.stats)
            row.outputs.append(gen.tokens)


def ms(seconds: float, rounds: int) -> str:
    return f"{1000 * seconds / rounds:7.2f}" if rounds else f"{'-':>7}"


def report(rows: list[Row], n_prompts: int) -> None:
    ar, hf = rows[0], rows[1]
    ar_tps, hf_tps = ar.stats.tokens_per_s, hf.stats.tokens_per_s
    ratio = ar_tps / hf_tps
    print(
        f"\nAR loop: ours {ar_tps:.1f} tok/s vs HF generate() {hf_tps:.1f} tok/s -> ratio {ratio:.2f} "
        f"({'OK' if ratio >= 0.9 else 'TOO SLOW'}: must be >= 0.90)\n"
    )
    head = (
        f"{'configuration':<30} {'tau':>6} {'tok/s':>7} {'vs AR':>6} {'vs HF':>6} {'same':>5} "
        f"{'passes':>6} {'d.pass':>6} {'nodes':>5} | {'draft':>7} {'verify':>7} {'commit':>7} ms/round "
        f"| {'prefill':>7} ms/prompt"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        s = r.stats
        same = "yes" if r.outputs == ar.outputs else "NO"
        nodes = f"{s.draft_nodes / s.rounds:5.1f}" if s.draft_nodes and r.runner.kind == "draftsmith" else f"{'-':>5}"
        split = (
            f"{ms(s.draft_s, s.rounds)} {ms(s.verify_s, s.rounds)} {ms(s.commit_s, s.rounds)}         "
            f"| {ms(s.prefill_s, n_prompts)}"
            if r.runner.kind == "draftsmith"
            else f"{'-':>7} {'-':>7} {'-':>7}          | {'-':>7}"
        )
        print(
            f"{r.label:<30} {s.tau:6.3f} {s.tokens_per_s:7.1f} {s.tokens_per_s / ar_tps:6.2f} "
            f"{s.tokens_per_s / hf_tps:6.2f} {same:>5} {s.target_passes:6d} {s.drafter_passes:6d} {nodes} | {split}"
        )
    print(
        "\ntau = new tokens / target passes (prefill counted, AR = 1); d.pass = drafter forward calls; "
        "nodes = mean draft-tree size;\nHF rows: passes counted with forward hooks, no per-round split. "
        "'same' = token-identical to our AR on every prompt."
    )
    ours = [r for r in rows if r.runner.kind == "draftsmith" and r.stats.rounds]
    print("\nwhere the time goes (share of wall time):")
    for r in ours:
        s = r.stats
        parts = {"prefill": s.prefill_s, "draft": s.draft_s, "verify": s.verify_s, "commit": s.commit_s}
        other = s.wall_s - sum(parts.values())
        shares = "  ".join(f"{k} {100 * v / s.wall_s:4.1f}%" for k, v in parts.items())
        print(f"  {r.label:<28} {shares}  loop {100 * other / s.wall_s:4.1f}%")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(REPO / "recipes/targets/stories260K"))
    ap.add_argument("--prompts", default=str(REPO / "recipes/prompts/stories_dev.txt"))
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--draft-len", type=int, default=8)
    ap.add_argument("--dynamic", default="dynamic:topk=4,depth=6,nodes=24", help="the tree shape beside the chain")
    ap.add_argument("--early-exit", type=int, nargs="+", default=[1, 2, 3, 4], metavar="K")
    ap.add_argument("--skip", nargs="+", default=["2", "3", "2,3"], metavar="I,J", help="layer sets to skip")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: the tiny target gains nothing from more)")
    ap.add_argument("--limit", type=int, default=None, help="only the first N prompts")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.set_num_threads(args.threads)

    target = Target.load(args.target)
    convs = load_prompts(args.prompts, args.limit)
    prompts = [encode_prompt(target, *render_turn(target.tokenizer, c.turns[:1], [])) for c in convs]
    cfg = EvalConfig(max_new_tokens=args.max_new_tokens, draft_len=args.draft_len)
    rows = [
        Row(label, spec, tree, make_run(spec, target, replace(cfg, tree=tree))) for label, spec, tree in configs(args)
    ]
    print(
        f"target {args.target} ({target.num_layers} layers, hidden {target.hidden_size}); {len(prompts)} prompts "
        f"from {args.prompts}; {args.max_new_tokens} new tokens, greedy; chain k={args.draft_len}, tree "
        f"{args.dynamic}; torch {torch.__version__}, {torch.get_num_threads()} thread(s); "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    )
    for row in rows:  # untimed warm-up: lazy initialisation, allocator
        row.runner.run(prompts[0], 8, cfg.sampling, cfg.seed)
    start = time.perf_counter()
    run_all(rows, prompts, target, cfg)
    report(rows, len(prompts))
    print(
        f"\nbenchmark wall time {time.perf_counter() - start:.0f} s; load average at the end {os.getloadavg()[0]:.1f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
