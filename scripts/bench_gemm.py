"""The decode runtime's products, one lever at a time: a target's linear shapes at the row counts decoding uses.

    python scripts/bench_gemm.py [--target DIR] [--dtype float32] [--threads 1] [--rows 1,2,4,8,16,25]

For each distinct linear shape of the target (q/k/v and gate/up fused as decode.runtime fuses them, the LM head),
every layer's matrix in turn (streamed from memory as a pass reads them), alternated, median of 8 sweeps:
- `F.linear` on the `[out, in]` weight (what HF's modules run);
- `x @ w` on a `[in, out]` copy (the runtime's layout for wide matrices where the kernel is not used);
- decode.gemm's kernel over packed panels (fp32 on an AVX2 CPU; `-` where it is not available).
Prints ms per sweep (all layers), the kernel's speedup over the better aten layout, and each cost against one row.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from decode import gemm  # noqa: E402
from decode.errors import missing_target  # noqa: E402
from decode.target import Target  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def sweep_ms(calls: list[Callable[[], object]], repeats: int = 8) -> float:
    """Median ms of running every call once, after one warm-up sweep."""
    for c in calls:
        c()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for c in calls:
            c()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def groups(target: Target) -> dict[str, list[torch.Tensor]]:
    """Shape name -> every layer's weight of it, fused as the runtime fuses them (plus the LM head)."""
    out: dict[str, list[torch.Tensor]] = {}
    for layer in target.layers:
        a, m = layer.self_attn, layer.mlp
        fused = {
            "qkv": torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
            "o": a.o_proj.weight,
            "gate_up": torch.cat([m.gate_proj.weight, m.up_proj.weight]),
            "down": m.down_proj.weight,
        }
        for name, w in fused.items():
            out.setdefault(f"{name} {w.shape[0]} x {w.shape[1]}", []).append(w.detach())
    w = target.lm_head.weight.detach()
    out[f"lm_head {w.shape[0]} x {w.shape[1]}"] = [w]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(REPO / "recipes/targets/smollm2-135m-instruct"))
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="1,2,4,8,16,25")
    args = ap.parse_args(argv)
    if args.threads < 1:
        ap.error("--threads must be >= 1")
    torch.set_num_threads(args.threads)
    if missing_target(args.target):
        return 2
    target = Target.load(args.target, "hf", dtype=args.dtype)
    rows = [int(r) for r in args.rows.split(",")]
    have_kernel = gemm.usable(target.lm_head.weight)
    print(
        f"{Path(args.target).name}, {args.dtype}, {args.threads} thread(s); ms per sweep over every layer's matrix; "
        f"kernel: {'decode.gemm (AVX2)' if have_kernel else 'not available here'}"
    )
    print(
        f"{'shape (matrices)':<28} {'rows':>4} {'F.linear':>9} {'x @ w':>8} {'kernel':>8} {'gain':>6} {'vs 1 row':>9}"
    )
    with torch.inference_mode():
        for name, ws in groups(target).items():
            wts = [w.t().contiguous() for w in ws]
            panels = [gemm.pack(w) for w in ws] if have_kernel else []
            one = None
            for m in rows:
                x = torch.randn(m, ws[0].shape[1], dtype=ws[0].dtype)
                n = ws[0].shape[0]
                lin = sweep_ms([lambda w=w, x=x: F.linear(x, w) for w in ws])
                tr = sweep_ms([lambda w=w, x=x: x @ w for w in wts])
                ker = sweep_ms([lambda p=p, x=x, n=n: gemm.gemm(x, p, n) for p in panels]) if panels else None
                best = ker if ker is not None else min(lin, tr)
                one = one or best
                gain = f"{min(lin, tr) / ker:.2f}" if ker is not None else "-"
                kcell = f"{ker:.2f}" if ker is not None else "-"
                label = f"{name} ({len(ws)})"
                print(f"{label:<28} {m:>4} {lin:>9.2f} {tr:>8.2f} {kcell:>8} {gain:>6} {best / one:>9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
