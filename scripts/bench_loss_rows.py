"""A drafter's training step with its heads on the rows that carry a loss vs on every row, side by side.

A padded chat batch is mostly rows without a loss: prompt rows (loss_mask 0) and the padding up to the batch's
longest sequence. On the chat recipes' data (1,022 self-distilled ShareGPT answers, batches of 4) only 46%
of a batch's rows carry a loss (68% are real tokens). Since 2026-12-02 the EAGLE-3, Medusa and LayerSkip
losses run their LM heads (16k-49k rows per token) on the loss rows only; before, every row went through
them and the loss masked the result. Both forms are computed here on the same batches, alternated batch by
batch (a shared machine's load hits them alike): `loss rows` is the drafters' loss as it is, `all rows` the
same loss written over every row (drafters/trainable tests prove the two equal in value and gradient).

    python scripts/bench_loss_rows.py [--cache DIR | --synthetic] [--target DIR] [--kinds eagle3,medusa,layerskip]
        [--batches 6] [--batch-size 4] [--threads 1]
--cache: a feature cache of the chat recipes (default: the newest $DRAFTSMITH_DATA/features/<target>-* entry);
--synthetic: random sequences with a 30% prompt and lengths 40-100% of --seq-len instead (for smoke runs).
Prints ms per fwd+bwd step per form, the ratio, the losses (equal up to rounding) and the loss-row share.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from decode.errors import missing_target
from decode.target import Target
from drafters.serving.checkpoint import drafter_kinds
from drafters.trainable.layerskip.schedules import exit_curriculum, exit_loss_scales
from drafters.trainable.losses import (
    ahead,
    distill_rows,
    hard_ce,
    masked_mean,
    next_valid,
    step_weights,
    teacher_argmax,
)
from train.batch import collate
from train.cache import FeatureCache
from train.config import load_recipe
from train.data.identity import data_home
from train.features import compute_features

REPO = Path(__file__).resolve().parents[1]
STEP = 1000  # the training step both forms are told (LayerSkip's curriculum: the exits on at this step)


def eagle3_all_rows(m, batch: dict, step: int) -> torch.Tensor:
    """EAGLE-3's training-time test with the draft head over every row: step k's logits at row t against
    P_{t+k+1}, masked by ahead(valid, k+1)."""
    L = m.target.num_layers
    valid = next_valid(batch) & m.t2d[teacher_argmax(batch, m.target.lm_head, L)]
    logits = [m.head(h) for h in m.unroll_states(batch, m.config.ttt_steps, m.noise_generator(0))]
    rows = distill_rows(logits, [k + 1 for k in range(len(logits))], batch, m.target.lm_head, L, "soft_ce", m.draft_ids)
    losses = [masked_mean(ce, ahead(valid, k + 1, False)) for k, ce in enumerate(rows)]
    return sum(w * lo for w, lo in zip(step_weights(len(losses), m.config.step_decay), losses))


def medusa_all_rows(m, batch: dict, step: int) -> torch.Tensor:
    """Medusa's loss with every head over every row (head k at row t against x_{t+k+2} / P_{t+k+1})."""
    L, valid = m.target.num_layers, next_valid(batch)
    heads = m.head_logits(batch["hidden"][L])
    if m.config.loss == "ce":
        rows = [hard_ce(lg, ahead(batch["input_ids"], k + 2)) for k, lg in enumerate(heads)]
    else:
        rows = distill_rows(heads, [k + 1 for k in range(len(heads))], batch, m.target.lm_head, L, "kl")
    losses = [masked_mean(r, ahead(valid, k + 1, False)) for k, r in enumerate(rows)]
    return sum(w * lo for w, lo in zip(step_weights(len(losses), m.config.step_decay), losses))


def layerskip_all_rows(m, batch: dict, step: int) -> torch.Tensor:
    """LayerSkip's exit loss (the exits its curriculum turns on at `step`) with each exit's head over every row."""
    L, valid, c = m.target.num_layers, next_valid(batch), m.config
    on = exit_curriculum(c.curriculum, step, len(c.exits), c.curriculum_steps, c.rotation_every, c.gradual_fraction)
    total = 0.0
    for e, s, active in zip(c.exits, exit_loss_scales(c.exits, c.scale, on), on):
        if not active:
            continue
        logits = m.exit_logits(e, m.exit_states(batch, e))
        rows = (
            distill_rows([logits], [0], batch, m.target.lm_head, L, "kl")[0]
            if c.loss == "kl"
            else hard_ce(logits, ahead(batch["input_ids"], 1))
        )
        total = total + s * masked_mean(rows, valid)
    return total


ALL_ROWS = {"eagle3": eagle3_all_rows, "medusa": medusa_all_rows, "layerskip": layerskip_all_rows}


def cache_batches(cache_dir: Path, n: int, size: int, seed: int) -> list[dict]:
    """n batches of `size` training sequences drawn at random from a feature cache, collated as the trainer does."""
    cache = FeatureCache.open(cache_dir)
    rng = random.Random(seed)
    picks = [rng.sample(range(cache.index["n_train"]), size) for _ in range(n)]
    return [collate([cache.sequence(i) for i in p]) for p in picks]


def synthetic_batches(target: Target, n: int, size: int, seq_len: int, hidden_ids: list[int], seed: int) -> list[dict]:
    """Random sequences of 40-100% of seq_len, right-padded, the first 30% of each a prompt (no loss)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        lens = torch.randint(int(0.4 * seq_len), seq_len + 1, (size,), generator=g).tolist()
        ids = torch.randint(3, target.vocab_size, (size, max(lens)), generator=g)
        am = torch.zeros_like(ids)
        lm = torch.zeros_like(ids, dtype=torch.bool)
        for r, n_r in enumerate(lens):
            am[r, :n_r] = 1
            lm[r, int(0.3 * n_r) : n_r] = True
        out.append(
            {
                "input_ids": ids,
                "attention_mask": am,
                "loss_mask": lm,
                "position_ids": torch.arange(ids.shape[1]).expand(size, -1),
                **compute_features(target, ids, am, hidden_ids),
            }
        )
    return out


def default_cache(target: str) -> Path | None:
    found = sorted((data_home() / "features").glob(f"{Path(target).name}-*"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def add_batch_args(ap: argparse.ArgumentParser, batches: int) -> None:
    """The flags that pick a benchmark's batches (a feature cache or random ones) and its threads."""
    ap.add_argument("--cache", default=None, help="feature cache directory (default: the newest for the target)")
    ap.add_argument("--synthetic", action="store_true", help="random batches instead of a feature cache")
    ap.add_argument("--seq-len", type=int, default=300, help="--synthetic: the longest sequence")
    ap.add_argument("--batches", type=int, default=batches, help="timed batches per form (after one warm-up)")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)


def load_batches(args: argparse.Namespace, target: Target, hidden_ids: list[int]) -> tuple[str, list[dict]] | None:
    """(their source, --batches + 1 batches: the first warms up) as add_batch_args' flags say; None (the error
    printed) when there is no feature cache."""
    if args.synthetic:
        return "synthetic", synthetic_batches(target, args.batches + 1, args.batch_size, args.seq_len, hidden_ids, 0)
    cache = Path(args.cache) if args.cache else default_cache(args.target)
    if cache is None or not cache.is_dir():
        print(
            f"error: no feature cache {cache or ''}; build one (python -m train.features "
            "recipes/smollm2-135m/eagle3.yaml) or pass --synthetic",
            file=sys.stderr,
        )
        return None
    return str(cache), cache_batches(cache, args.batches + 1, args.batch_size, 0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(REPO / "recipes/targets/smollm2-135m-instruct"))
    ap.add_argument(
        "--recipes", default=str(REPO / "recipes/smollm2-135m"), help="the drafters' settings come from here"
    )
    ap.add_argument("--kinds", default="eagle3,medusa,layerskip")
    add_batch_args(ap, batches=6)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if missing_target(args.target):
        return 2
    target = Target.load(args.target, dtype="float32")
    kinds = args.kinds.split(",")
    configs = {k: getattr(load_recipe(Path(args.recipes) / f"{k}.yaml").drafter, k) for k in kinds}
    hidden_ids = sorted({i for cfg in configs.values() for i in cfg.feature_ids(target.num_layers)})
    loaded = load_batches(args, target, hidden_ids)
    if loaded is None:
        return 2
    source, batches = loaded
    rows = sum(b["attention_mask"].numel() for b in batches)
    taught = sum(int(next_valid(b).sum()) for b in batches)
    print(
        f"{args.target}, float32, {args.threads} thread(s); {len(batches)} batches of {args.batch_size} from "
        f"{source}; rows with a loss: {taught / rows:.0%} of {rows}"
    )
    print(f"{'drafter':<10} {'form':<9} {'ms/step':>9} {'vs all':>7} {'mean loss':>12}")
    for kind in kinds:
        cls, _ = drafter_kinds()[kind]
        torch.manual_seed(0)
        drafter = cls(target, configs[kind]).eval()  # eval: no training noise, so both forms see the same inputs
        forms = {
            "loss rows": lambda b, m=drafter: m.loss(b, STEP)[0],
            "all rows": lambda b, m=drafter, f=ALL_ROWS[kind]: f(m, b, STEP),
        }
        times: dict[str, list[float]] = {f: [] for f in forms}
        losses: dict[str, list[float]] = {f: [] for f in forms}
        for i, batch in enumerate(batches):
            for form, loss_fn in forms.items():
                t0 = time.perf_counter()
                out = loss_fn(batch)
                out.backward()
                drafter.zero_grad(set_to_none=True)
                if i:  # batch 0 warms up
                    times[form].append(time.perf_counter() - t0)
                    losses[form].append(float(out.detach()))
        base = statistics.median(times["all rows"])
        for form, ts in times.items():
            ms = statistics.median(ts)
            print(f"{kind:<10} {form:<9} {1000 * ms:>9.0f} {base / ms:>6.2f}x {statistics.mean(losses[form]):>12.5f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
