"""The demo: AR vs untrained early exit (and friends) on the bundled story target, as a table.

Greedy, the dev prompts, 128 new tokens. Every row must reproduce AR token for token.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from decode.generate import encode_prompt, generate
from decode.target import Target
from decode.tree import Shape
from drafters.registry import make_drafter

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(REPO / "recipes/targets/stories260K"))
    ap.add_argument("--prompts", default=str(REPO / "recipes/prompts/stories_dev.txt"))
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest for the tiny target)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = Target.load(args.target)
    prompts = [encode_prompt(target, line) for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    rows = [("ar", Shape("chain", k=0)), ("early-exit:1", Shape("chain", k=8)), ("early-exit:2", Shape("chain", k=8)),
            ("early-exit:2", Shape("dynamic", topk=4, depth=6, nodes=24)), ("skip:2", Shape("chain", k=8))]
    ref, ref_time = None, None
    print(f"{'drafter':<16}{'tree':<9}{'tau':>6}{'tok/s':>9}{'speedup':>9}  matches_ar")
    for spec, shape in rows:
        outs, t0, new, passes = [], time.perf_counter(), 0, 0
        for ids in prompts:
            g = generate(target, make_drafter(spec, target), ids, args.max_new_tokens, shape=shape)
            outs.append(g.tokens)
            new, passes = new + g.stats.new_tokens, passes + g.stats.target_passes
        wall = time.perf_counter() - t0
        ref, ref_time = (outs, wall) if ref is None else (ref, ref_time)
        print(f"{spec:<16}{shape.kind:<9}{new / passes:>6.2f}{new / wall:>9.1f}{ref_time / wall:>8.2f}x  {outs == ref}")


if __name__ == "__main__":
    main()
