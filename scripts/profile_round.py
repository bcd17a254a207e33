"""Where a speculative round's time goes on a real target: draft, verify, commit, and the ops inside them.

For each drafter SPEC and each target runtime (--runtimes hf,fast: HF's modules before, decode.runtime's packed
layers after), on the same chat prompts (MT-bench first turns, the chat template applied):
1. phase split from the decoder's own clocks (GenStats): ms per round in draft / verify / commit, and
   the prefill, with the mean number of tokens a verify pass covers;
2. the verify pass cost vs tokens (decode.costmodel's curve, after a chat-length prefix), so a tree
   size can be read against what it costs, and the verify step with the LM head on every row (how
   the decoder verified before) vs on the visited rows only (decode.verify.LazyRows), alternated;
3. the body's linears by shape against the rows they cover, hot (one weight matrix over and over: it stays in
   cache) vs streamed (every layer's matrix of that shape in turn, as a pass reads them), with the bytes per
   second the streamed figure implies — whether a pass is bound by weight streaming or by the gemm itself;
4. the top ops by self CPU time (torch.profiler over one more generation), grouped by input shape —
   the LM head over 49k words, attention, the MLP matmuls, mask and cache bookkeeping.

    python scripts/profile_round.py [--target DIR] [--dtype float32|bfloat16] [--threads 1] [--limit 2]
        [--max-new-tokens 64] [--top 12] [--runtimes hf,fast] [SPEC ...]     (default SPECs: ar early-exit:8)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from decode.costmodel import format_curve, measure_pass_cost
from decode.errors import missing_target
from decode.generate import encode_prompt
from decode.harness.evaluate import make_run
from decode.harness.prompts import load_prompts, render_turn
from decode.harness.runs import EvalConfig
from decode.metrics import GenStats
from decode.passes import forward_tree
from decode.target import RUNTIMES, Target
from decode.tree import DraftTree
from decode.verify import LazyRows, verify_greedy

REPO = Path(__file__).resolve().parents[1]


def phase_row(name: str, stats: list[GenStats]) -> str:
    """One line: rounds, ms per round per phase, verified tokens per pass, τ, tokens/s."""
    tot = stats[0]
    for s in stats[1:]:
        tot = tot.merge(s)
    rounds = tot.rounds or 1
    ms = [1000 * x / rounds for x in (tot.draft_s, tot.verify_s, tot.commit_s)]
    other = 1000 * (tot.wall_s - tot.prefill_s - tot.draft_s - tot.verify_s - tot.commit_s) / rounds
    return (
        f"{name:<44} {tot.rounds:>6} {ms[0]:>8.1f} {ms[1]:>8.1f} {ms[2]:>8.1f} {other:>7.1f} "
        f"{1000 * tot.prefill_s / len(stats):>8.0f} {tot.draft_nodes / rounds + 1:>8.1f} {tot.tau:>5.2f} "
        f"{tot.tokens_per_s:>7.1f}"
    )


@torch.inference_mode()
def head_ab(target: Target, n: int, prefix: int, repeats: int = 5) -> tuple[float, float]:
    """Median seconds of pass + greedy verification of a chain of n - 1 random drafts, the LM head on every
    row vs through LazyRows (random drafts are rejected at once: the root row alone is visited)."""
    g = torch.Generator().manual_seed(0)
    cache = target.new_cache()
    target.prefill(torch.randint(target.vocab_size, (prefix,), generator=g), cache)
    tree = DraftTree.chain(torch.randint(target.vocab_size, (n - 1,), generator=g))
    times: dict[bool, list[float]] = {False: [], True: []}
    for r in range(2 * repeats + 2):
        lazy = bool(r % 2)
        t0 = time.perf_counter()
        out = forward_tree(target, 1, tree, cache, logits=not lazy)
        if lazy:
            verify_greedy(tree, LazyRows(lambda h: target.head(h).argmax(-1), out.last))
        else:
            verify_greedy(tree, out.logits.argmax(-1))
        if r >= 2:  # the first pair warms up
            times[lazy].append(time.perf_counter() - t0)
        cache.crop(prefix)
    return statistics.median(times[False]), statistics.median(times[True])


@torch.inference_mode()
def linear_costs(target: Target, rows: tuple[int, ...], repeats: int = 5) -> list[tuple[str, int, float, float, float]]:
    """Per distinct body linear shape and row count: (shape, rows, hot µs, streamed µs, streamed GB/s).

    Each sweep runs as many products as there are layers with that shape: hot, the first layer's matrix every time
    (it stays in cache); streamed, every layer's matrix once, so its weights come from memory the way a pass reads
    them. Sweeps alternate; each figure is the median sweep over `repeats`, divided by the layers."""
    by_shape: dict[tuple[int, int], list[torch.Tensor]] = {}
    for layer in target.layers:
        for m in layer.modules():
            if isinstance(m, torch.nn.Linear):
                by_shape.setdefault(tuple(m.weight.shape), []).append(m.weight)
    out = []
    for (o, i), ws in by_shape.items():
        for n in rows:
            x = torch.randn(n, i, dtype=ws[0].dtype)
            sweeps: dict[str, list[float]] = {"hot": [], "streamed": []}
            for r in range(2 * repeats + 2):
                kind = "streamed" if r % 2 else "hot"
                mats = ws if kind == "streamed" else [ws[0]] * len(ws)
                t0 = time.perf_counter()
                for w in mats:
                    torch.nn.functional.linear(x, w)
                if r >= 2:  # the first pair warms up
                    sweeps[kind].append((time.perf_counter() - t0) / len(ws))
            hot, streamed = statistics.median(sweeps["hot"]), statistics.median(sweeps["streamed"])
            out.append(
                (
                    f"{o} x {i} ({len(ws)})",
                    n,
                    1e6 * hot,
                    1e6 * streamed,
                    ws[0].numel() * ws[0].element_size() / streamed / 1e9,
                )
            )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("specs", nargs="*", default=["ar", "early-exit:8"], help="drafter SPECs (SPEC@TREE allowed)")
    ap.add_argument("--target", default=str(REPO / "recipes/targets/smollm2-135m-instruct"))
    ap.add_argument("--prompts", default=str(REPO / "recipes/data/mt_bench_question.jsonl"))
    ap.add_argument("--limit", type=int, default=2, help="conversations (first turns) to decode per SPEC")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", default="1,2,4,8,16,25,32,64", help="verified-token counts for the pass-cost curve")
    ap.add_argument("--prefix", type=int, default=256, help="cached tokens before the timed passes")
    ap.add_argument("--top", type=int, default=12, help="ops listed per SPEC")
    ap.add_argument("--runtimes", default="hf,fast", help="target runtimes to compare (decode.runtime), alternated")
    args = ap.parse_args(argv)
    if args.threads < 1:
        ap.error("--threads must be >= 1")
    runtimes = args.runtimes.split(",")
    if not runtimes or any(r not in RUNTIMES for r in runtimes):
        ap.error(f"--runtimes {args.runtimes!r}: a comma-separated list of {RUNTIMES}")
    torch.set_num_threads(args.threads)
    if missing_target(args.target):
        return 2
    base = Target.load(args.target, runtimes[0], dtype=args.dtype)
    targets = {r: base if r == runtimes[0] else Target(base.model, base.tokenizer, r) for r in runtimes}
    cfg = EvalConfig(max_new_tokens=args.max_new_tokens)
    runners = [(f"{s} [{r}]", make_run(s, t, cfg)) for s in args.specs for r, t in targets.items()]
    convs = load_prompts(args.prompts, args.limit)
    prompts = [encode_prompt(base, *render_turn(base.tokenizer, c.turns, [])) for c in convs]
    print(
        f"{args.target}, {args.dtype}, {args.threads} thread(s); {len(prompts)} prompts x {args.max_new_tokens} "
        f"new tokens, greedy, chain k={cfg.draft_len} unless @tree"
    )

    # 1. phase split from the decoder's clocks (one warm-up generation first).
    print(
        f"\n{'ms per round':<44} {'rounds':>6} {'draft':>8} {'verify':>8} {'commit':>8} {'other':>7} "
        f"{'prefill':>8} {'tok/pass':>7} {'tau':>5} {'tok/s':>7}"
    )
    stats: dict[str, list[GenStats]] = {spec: [] for spec, _ in runners}
    for _, r in runners:
        r.run(prompts[0], 8, cfg.sampling, 0)
    for p in prompts:  # prompt by prompt, every row in turn: a shared machine's load hits them alike
        for spec, r in runners:
            stats[spec].append(r.run(p, args.max_new_tokens, cfg.sampling, 0).stats)
    for spec, _ in runners:
        print(phase_row(spec, stats[spec]))
    print("other: the loop's own bookkeeping (policy, stats, emit) per round; prefill: ms per prompt")

    # 2. what a verify pass costs against the tokens it covers, per runtime.
    ns = tuple(int(x) for x in args.tokens.split(","))
    for r, target in targets.items():
        curve = measure_pass_cost(target, ns, prefix=args.prefix, repeats=3)
        print(f"\n[{r}] verify pass cost after {args.prefix} cached tokens:\n{format_curve(curve)}")
    target = targets[runtimes[-1]]

    # 2b. the verify step with the LM head over every row (before) vs the visited rows only (now), alternated.
    print(
        f"\n[{runtimes[-1]}] {'verify step (ms), alternated':<30} {'head on all rows':>17} {'visited rows only':>18} {'saved':>6}"
    )
    for n in ns:
        full, lazy = head_ab(target, n, args.prefix)
        print(f"{n:>3} verified tokens{'':<14} {1000 * full:>17.1f} {1000 * lazy:>18.1f} {1 - lazy / full:>6.0%}")

    # 3. the body's linears: streaming-bound (streamed >> hot) or gemm-bound (streamed ~ hot)?
    print(f"\n{'body linear (matrices)':<24} {'rows':>5} {'hot us':>8} {'streamed us':>12} {'streamed GB/s':>14}")
    for shape, n, hot, streamed, gbs in linear_costs(target, (1, 2, 4, 8)):
        print(f"{shape:<24} {n:>5} {hot:>8.0f} {streamed:>12.0f} {gbs:>14.1f}")

    # 4. the ops inside one generation per SPEC.
    for spec, r in runners:
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            r.run(prompts[0], args.max_new_tokens, cfg.sampling, 0)
        table = prof.key_averages(group_by_input_shape=True).table(
            sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=28, max_shapes_column_width=60
        )
        print(f"\n{spec}: top {args.top} ops by self CPU time over one {args.max_new_tokens}-token generation\n{table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
