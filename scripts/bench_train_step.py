"""Where a drafter's training step goes with the target's teacher: three ways to get it, timed side by side.

Every drafter loss needs the target's next-token argmax over its whole vocabulary at every row, and the
distillation losses its distribution over the (draft) vocabulary. On the chat target that is an LM head of
49,152 x 576 per row — as much work as the drafter's own step. One run, the same batch, the variants
alternated step by step (a shared machine's load hits them alike):

1. `before`: the teacher as it was scored until 2026-12-02 — row chunks of the batch ([B, c, H] slices,
   which torch.matmul runs as a bmm against the head broadcast B times, re-reading the whole head per chunk);
2. `blocked`: drafters.trainable.losses today on a cache without a stored argmax — the argmax a vocabulary
   block at a time over all rows (the head read once), the teacher rows as one flat matmul;
3. `cached`: a feature cache built today stores the target's argmax (train/features.py): nothing to score.
Then the optimizer step of `train.optimizer=muon` over each drafter's matrices: torch.optim.Muon (Newton-Schulz
in bf16, emulated on a CPU without bf16 arithmetic) vs train.optim.Muon with the iteration in fp32.

    python scripts/bench_train_step.py [--target DIR] [--kinds eagle3,medusa,layerskip] [--seqs 4] [--seq-len 300]
        [--steps 3] [--threads 1] [--dtype float32|bfloat16]
Prints ms per step per variant and the ratios to `before` (losses differ a little: the recipes draw new training
noise each call, and a flat matmul rounds unlike a bmm).
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

import drafters.trainable.losses as losses
from decode.errors import missing_target
from decode.target import Target
from drafters.serving.checkpoint import drafter_kinds
from train.config import TrainConfig, load_recipe
from train.features import compute_features
from train.optim import Muon, muon_split

REPO = Path(__file__).resolve().parents[1]
MODULES = {
    "eagle3": "drafters.trainable.eagle3",
    "medusa": "drafters.trainable.medusa",
    "layerskip": "drafters.trainable.layerskip.objective",
}


@torch.no_grad()
def argmax_before(batch: dict, lm_head: torch.nn.Linear, num_layers: int, budget: int = losses.CHUNK_ELEMENTS):
    """The previous teacher_argmax: row chunks [B, c, H] of the batch through the whole head."""
    h = batch["hidden"][num_layers]
    chunk = losses.chunk_rows(h.shape[0], lm_head.weight.shape[0], budget)
    return torch.cat(
        [lm_head(h[:, a : a + chunk].to(lm_head.weight.dtype)).argmax(-1) for a in range(0, h.shape[1], chunk)], 1
    )


def probs_before(
    batch: dict, lm_head: torch.nn.Linear, num_layers: int, start: int, stop: int, vocab_ids=None, rows=None
):
    """The previous teacher_probs (hidden-state source): F.linear on the [B, c, H] row slice."""
    h = batch["hidden"][num_layers]
    end = min(stop, h.shape[1])
    w, bias = rows or losses.head_rows(lm_head, vocab_ids)
    with torch.no_grad():
        probs = torch.softmax(F.linear(h[:, start:end].to(w.dtype), w, bias).float(), dim=-1)
    if end < stop:
        probs = torch.cat([probs, probs.new_zeros(probs.shape[0], stop - max(end, start), probs.shape[-1])], 1)
    return probs


def variants(kind: str) -> dict[str, Callable[[], None]]:
    """Each variant as a switch: sets the module functions the loss calls (and says whether the batch keeps its argmax)."""
    mod = sys.modules[MODULES[kind]]
    new_argmax, new_probs = losses.teacher_argmax, losses.teacher_probs

    def use(argmax, probs):
        mod.teacher_argmax, losses.teacher_probs = argmax, probs

    return {
        "before": lambda: use(argmax_before, probs_before),
        "blocked": lambda: use(new_argmax, new_probs),
        "cached": lambda: use(new_argmax, new_probs),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(REPO / "recipes/targets/smollm2-135m-instruct"))
    ap.add_argument(
        "--recipes", default=str(REPO / "recipes/smollm2-135m"), help="the drafters' settings come from here"
    )
    ap.add_argument("--kinds", default="eagle3,medusa,layerskip")
    ap.add_argument("--seqs", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=300)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per variant (after one warm-up round)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the target's dtype")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if missing_target(args.target):
        return 2
    target = Target.load(args.target, dtype=args.dtype)
    L = target.num_layers
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, target.vocab_size, (args.seqs, args.seq_len), generator=g)
    am = torch.ones_like(ids)
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[:, 0] = False
    kinds = args.kinds.split(",")
    configs = {k: getattr(load_recipe(Path(args.recipes) / f"{k}.yaml").drafter, k) for k in kinds}
    hidden_ids = sorted({i for cfg in configs.values() for i in cfg.feature_ids(L)})
    cached = {
        "input_ids": ids,
        "attention_mask": am,
        "position_ids": torch.arange(args.seq_len).expand(args.seqs, -1),
        "loss_mask": mask,
        **compute_features(target, ids, am, hidden_ids),
    }
    scored = {k: v for k, v in cached.items() if k != "argmax"}
    print(f"{args.target}, {args.dtype}, {args.threads} thread(s); {args.seqs} x {args.seq_len} tokens a step")
    print(f"{'drafter':<10} {'variant':<8} {'ms/step':>9} {'vs before':>9} {'loss':>12}")
    for kind in kinds:
        cls, _ = drafter_kinds()[kind]
        torch.manual_seed(0)
        drafter = cls(target, configs[kind]).train()
        switch = variants(kind)
        times: dict[str, list[float]] = {v: [] for v in switch}
        loss: dict[str, float] = {}
        for r in range(args.steps + 1):
            for v, use in switch.items():
                use()
                batch = cached if v == "cached" else scored
                t0 = time.perf_counter()
                out, _ = drafter(batch, 0)
                out.backward()
                drafter.zero_grad(set_to_none=True)
                if r:  # round 0 warms up
                    times[v].append(time.perf_counter() - t0)
                loss[v] = float(out.detach())
        switch["blocked"]()  # leave the modules as they were
        base = statistics.median(times["before"])
        for v, ts in times.items():
            ms = statistics.median(ts)
            print(f"{kind:<10} {v:<8} {1000 * ms:>9.0f} {base / ms:>8.2f}x {loss[v]:>12.5f}")
        muon_rows(kind, drafter, args.steps)
    return 0


def muon_rows(kind: str, drafter: torch.nn.Module, steps: int) -> None:
    """ms per optimizer step of Muon over the drafter's matrices: torch's (bf16 iteration) vs ours in fp32."""
    params, _ = muon_split(drafter.named_parameters())
    if not params:
        return
    cfg = TrainConfig()
    kw = dict(lr=cfg.lr, weight_decay=cfg.weight_decay, adjust_lr_fn="match_rms_adamw")
    opts = {
        "torch Muon (bf16 Newton-Schulz)": torch.optim.Muon(params, **kw),
        "fp32 Newton-Schulz (train.optim.Muon)": Muon(params, ns_dtype=torch.float32, **kw),
    }
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    times: dict[str, list[float]] = {k: [] for k in opts}
    for r in range(steps + 1):
        for name, opt in opts.items():
            t0 = time.perf_counter()
            opt.step()
            if r:
                times[name].append(time.perf_counter() - t0)
    base = statistics.median(times["torch Muon (bf16 Newton-Schulz)"])
    for name, ts in times.items():
        ms = statistics.median(ts)
        print(f"{kind:<10} optimizer step, {name}: {1000 * ms:.0f} ms ({base / ms:.2f}x)")


if __name__ == "__main__":
    sys.exit(main())
