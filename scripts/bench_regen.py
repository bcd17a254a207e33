"""Regeneration (self-distillation) throughput: new tokens/s of train.data.regen for target dtypes x batch sizes.

The same prompts (ShareGPT opening turns, the target's chat template) are answered under every
setting, in one run, the settings interleaved over `--rounds` so a change in the machine's load
hits all of them alike; the load average is printed beside the table.

    python scripts/bench_regen.py [--target DIR] [--prompts FILE] [--n 32] [--max-new-tokens 64] \
        [--dtypes float32 bfloat16] [--batch-sizes 8 16 32] [--threads 2] [--rounds 1]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from decode.target import Target
from train.data.identity import data_home
from train.data.regen import start_prefix
from train.data.regen_engines import sample
from train.data.sources import DataConfig, RegenConfig, load_records
from train.data.tokens import has_template, render

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(REPO / "recipes/targets/smollm2-135m-instruct"))
    ap.add_argument("--prompts", default=None, help="default: $DRAFTSMITH_DATA/sharegpt/first_turns.jsonl")
    ap.add_argument("--n", type=int, default=32, help="prompts answered per setting")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1, help="repeat the whole grid, interleaved")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    prompts = args.prompts or str(data_home() / "sharegpt" / "first_turns.jsonl")
    recs = load_records(DataConfig(source=prompts, max_records=args.n))
    rows = [recs[i] for i in range(len(recs))]
    targets = {d: Target.load(args.target, dtype=d) for d in args.dtypes}
    tok = next(iter(targets.values())).tokenizer

    # the contexts regeneration builds: the chat template with the generation prompt (a target without
    # one: the start token + the prompt's tokens, the plain rule), shortest first
    def context(r: dict) -> list[int]:
        first = [m for m in r["messages"] if m["role"] == "user"][:1] or [{"role": "user", "content": r["text"]}]
        if has_template(tok):
            return list(tok(render(tok, first, True, {}), add_special_tokens=False)["input_ids"])
        return start_prefix(tok) + list(tok(first[0]["content"], add_special_tokens=False)["input_ids"])

    contexts = sorted(map(context, rows), key=len)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    results: dict[tuple[str, int], list[tuple[int, float]]] = {}
    load0 = os.getloadavg()
    for _ in range(args.rounds):
        for d, target in targets.items():
            stop = sorted((target.eos_ids | {tok.eos_token_id}) - {None})
            for b in args.batch_sizes:
                cfg = RegenConfig(
                    enabled=True, max_new_tokens=args.max_new_tokens, temperature=args.temperature, batch_size=b
                )
                t0 = time.perf_counter()
                new = sum(
                    len(g)
                    for a in range(0, len(contexts), b)
                    for g in sample(target, contexts[a : a + b], cfg, stop, pad)
                )
                dt = time.perf_counter() - t0
                results.setdefault((d, b), []).append((new, dt))
                print(
                    f"[{d} batch {b}] {new} new tokens in {dt:.1f} s = {new / dt:.1f} tok/s "
                    f"(load {os.getloadavg()[0]:.1f})",
                    flush=True,
                )
    load1 = os.getloadavg()
    print(
        f"{len(rows)} opening turns, <= {args.max_new_tokens} new tokens each, temperature "
        f"{args.temperature}, {args.threads} threads, {args.rounds} round(s); load average "
        f"{load0[0]:.1f} before, {load1[0]:.1f} after"
    )
    print(f"{'target dtype':<13} {'batch':>5} {'new tokens':>10} {'seconds':>8} {'tok/s':>7}")
    for (d, b), rs in results.items():
        new, dt = sum(r[0] for r in rs), sum(r[1] for r in rs)
        print(f"{d:<13} {b:>5} {new:>10} {dt:>8.1f} {new / dt:>7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
