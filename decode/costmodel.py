"""Target-pass cost vs number of verified tokens, measured on a loaded target (offload placement included).

Speculative decoding pays off when verifying n tokens costs little more than verifying one. With
a resident target on a GPU that holds until compute saturates; with streamed layers the pass is
dominated by re-reading weights and the curve is nearly flat far further. The `stopping` policy
and the evaluate report's projections read the measured curve (`cost_at`), not a constant.

    python -m decode.costmodel --target MODEL_DIR [--offload disk ...] --out pass_cost.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from decode.passes import forward_tree
from decode.target import Target
from decode.tree import DraftTree

DEFAULT_TOKENS = (1, 8, 32, 64)
KIND = "draftsmith-pass-cost"


@torch.inference_mode()
def measure_pass_cost(
    target: Target,
    tokens: tuple[int, ...] = DEFAULT_TOKENS,
    prefix: int = 32,
    repeats: int = 3,
    before_pass: Callable[[], None] | None = None,
    seed: int = 0,
    reduce: Callable[[list[float]], float] = statistics.median,
) -> dict[int, float]:
    """Seconds of one verification pass over n tokens (the pending root + a chain of n - 1 drafts), reduced
    over `repeats` timings (median; `min` where a shared machine's pre-emptions should not count).

    1. prefill `prefix` random tokens once; 2. one untimed warm-up pass per n; 3. `repeats` rounds, each
    timing one pass per n in a rotated order — so a stretch of load on a shared machine falls on every n
    alike, not on the n that happened to be measured then (measured before: the chat target's 1-row pass
    read 47 ms in one curve and 25 ms in the next). Each pass goes through `decode.passes.forward_tree` (the
    decoder's own verification path: layers over every row, the LM head on the root row — decode.generate
    applies it only to the rows it visits) and is cropped back to the prefix. `before_pass` runs untimed
    before each pass (e.g. `drop_page_cache` for cold-disk numbers).
    """
    if min(tokens) < 1 or prefix < 1:
        raise ValueError(f"token counts {tokens} and prefix {prefix} must be >= 1")
    if prefix + max(tokens) > target.max_positions:
        raise ValueError(f"prefix {prefix} + {max(tokens)} tokens exceeds the model's {target.max_positions} positions")
    g = torch.Generator().manual_seed(seed)
    vocab = target.vocab_size
    cache = target.new_cache()
    target.prefill(torch.randint(vocab, (prefix,), generator=g), cache)
    ns = sorted(set(tokens))
    passes = {
        n: (int(torch.randint(vocab, (1,), generator=g)), DraftTree.chain(torch.randint(vocab, (n - 1,), generator=g)))
        for n in ns
    }

    def one_pass(n: int) -> float:
        if before_pass is not None:
            before_pass()
        root, tree = passes[n]
        t0 = time.perf_counter()
        out = forward_tree(target, root, tree, cache, logits=False)
        target.head(out.last[:1])  # the decoder's verifier runs the LM head on the rows it visits only
        if target.device.type == "cuda":
            torch.cuda.synchronize(target.device)
        dt = time.perf_counter() - t0
        cache.crop(prefix)
        return dt

    for n in ns:  # warm-up
        one_pass(n)
    times: dict[int, list[float]] = {n: [] for n in ns}
    for r in range(repeats):
        for n in ns[r % len(ns) :] + ns[: r % len(ns)]:
            times[n].append(one_pass(n))
    return {n: reduce(times[n]) for n in ns}


def cost_at(curve: dict[int, float], n: float) -> float:
    """Seconds for a pass over n tokens: piecewise-linear between measured points, the end slopes beyond them."""
    xs = sorted(curve)
    if len(xs) == 1:
        return curve[xs[0]]
    if n <= xs[0]:
        a, b = xs[0], xs[1]
    elif n >= xs[-1]:
        a, b = xs[-2], xs[-1]
    else:
        b = next(x for x in xs if x >= n)
        a = xs[xs.index(b) - 1]
    slope = (curve[b] - curve[a]) / (b - a)
    return max(0.0, curve[a] + slope * (n - a))


def save_curve(path: str | Path, curve: dict[int, float], meta: dict | None = None) -> None:
    """json: {"kind", "seconds_by_tokens": {"1": s, ...}, **meta} (meta: target, offload placement, ...)."""
    doc = {"kind": KIND, "seconds_by_tokens": {str(n): s for n, s in sorted(curve.items())}, **(meta or {})}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(doc, indent=2) + "\n")


def load_curve(path: str | Path) -> dict[int, float]:
    doc = json.loads(Path(path).read_text())
    if doc.get("kind") != KIND:
        raise ValueError(
            f"{path} is not a pass-cost file (kind {doc.get('kind')!r}); make one with python -m decode.costmodel"
        )
    return {int(n): float(s) for n, s in doc["seconds_by_tokens"].items()}


def format_curve(curve: dict[int, float]) -> str:
    """A markdown table: tokens, ms per pass, and the cost relative to one token (1.00 = flat)."""
    one = curve[min(curve)]
    rows = [f"| {n} | {1000 * s:.2f} | {s / one:.2f} |" for n, s in sorted(curve.items())]
    return "\n".join(["| verified tokens | ms / pass | vs 1 token |", "|---|---|---|", *rows])


def main(argv: list[str] | None = None) -> int:
    from decode.offload import add_offload_args, drop_page_cache, load_target_from_args, streamed_files

    ap = argparse.ArgumentParser(prog="python -m decode.costmodel", description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True, help="model directory or hub id")
    ap.add_argument("--dtype", default="auto", help="auto (bfloat16 where the hardware has it) | float32 | bfloat16")
    ap.add_argument("--attn", default="sdpa", help="attention implementation: sdpa | eager")
    add_offload_args(ap)  # (not decode.generate's add_decode_args: generate's --tree auto imports this module)
    ap.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)), help="verified-token counts to time")
    ap.add_argument("--resident-layers", type=int, default=0, help="K first layers kept resident (early-exit:K)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--cold",
        action="store_true",
        help="disk mode: evict the streamed files from the page cache before every pass (true disk reads)",
    )
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    ap.add_argument("--out", required=True, help="json file to write")
    args = ap.parse_args(argv)
    if args.threads < 0:
        ap.error(f"--threads {args.threads}: must be >= 1 (or 0 for torch's default)")
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_target_from_args(args, args.resident_layers)
    files = streamed_files(target) if args.cold else []
    if args.cold and not files:
        raise SystemExit("--cold needs --offload disk with streamed layers (nothing is read from disk otherwise)")
    before = (lambda: drop_page_cache(files)) if files else None
    curve = measure_pass_cost(
        target, tuple(int(x) for x in args.tokens.split(",")), repeats=args.repeats, before_pass=before
    )
    placement = target.placement.summary() if target.placement is not None else {"mode": "none"}
    save_curve(
        args.out,
        curve,
        {
            "target": args.target,
            "dtype": str(target.dtype).removeprefix("torch."),
            "cold_page_cache": bool(files),
            "threads": torch.get_num_threads(),
            "placement": placement,
        },
    )
    print(format_curve(curve))
    return 0


if __name__ == "__main__":
    sys.exit(main())
