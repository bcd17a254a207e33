"""DSpark's loss terms (KL + acceptance α): the old four passes of the head, one pass, and the stored log-normaliser.

DSpark trains on 0.1 x KL + 0.9 x (1 - α) over the block rows with a loss, α over a draft vocabulary reading the
target's own probabilities of its tokens. Three forms of the same terms, on the same rows of a chat feature cache,
alternated (a shared machine's load hits them alike), forward and backward:
- "four passes" (the code until 2026-12-07): KL over the draft vocabulary (one pass of its rows of the LM head), α
  from the mass of the draft vocabulary (a pass over the whole vocabulary and another over the draft rows, then the
  draft rows again; `old_mass` keeps that code);
- "one pass": one pass of the whole head gives both (drafters/trainable/lk.py overlap_rows without `logz`);
- "logZ": the target's per-row log-normaliser stored in the feature cache (train/features.py, `logz`), so P's own
  probabilities need only the draft rows (overlap_rows with `logz`; computed here from the cached states when
  an older cache lacks it).
Then the whole DSpark training step (module.loss as it is, fwd + bwd) at the same anchor counts, without and
with `logz` in the batch.

    python scripts/bench_block_loss.py [--cache DIR | --synthetic] [--anchors 16,64] [--batches 4] [--threads 1]
--cache: a feature cache of the chat recipes (default: the newest for the target); --synthetic: random sequences
(smoke runs); --draft-vocab N: the recipe's draft_vocab_size replaced (the vocabulary: these batches' N most
frequent tokens).
Prints ms per form, the ratios, the largest difference of the terms relative to their largest value (rounding
only), and ms per whole step.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import Tensor
from torch.nn import functional as F

from decode.errors import missing_target
from decode.target import Target
from drafters.trainable.block_loss import block_states
from drafters.trainable.dspark import DSpark
from drafters.trainable.lk import _OverlapRows, overlap_rows
from drafters.trainable.losses import CHUNK_ELEMENTS, chunk_rows, distill_rows, gather_rows, head_rows, teacher_probs
from train.config import load_recipe

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as `python scripts/...`: the checkout's helper modules import as scripts.*
from scripts.bench_loss_rows import add_batch_args, load_batches  # noqa: E402


def logsumexp_rows(x: Tensor, w: Tensor, bias: Tensor | None) -> Tensor:
    """logsumexp_v of x @ w[v] + bias[v], a block of w's rows at a time (the old code). [R, H] -> [R] fp32"""
    block = max(1, CHUNK_ELEMENTS // max(1, x.shape[0]))
    out = torch.full((x.shape[0],), -math.inf, device=x.device)
    for a in range(0, w.shape[0], block):
        out = torch.logaddexp(
            out, F.linear(x, w[a : a + block], None if bias is None else bias[a : a + block]).float().logsumexp(-1)
        )
    return out


@torch.no_grad()
def old_mass(taught: dict, head: torch.nn.Linear, num_layers: int, vocab: Tensor) -> Tensor:
    """P_t(vocab) at every row as the old code built it: logsumexp over the draft rows, then over all. -> [1, M]"""
    x = taught["hidden"][num_layers][0].to(head.weight.dtype)  # [M, H]
    w_d, b_d = head_rows(head, vocab)
    return (logsumexp_rows(x, w_d, b_d) - logsumexp_rows(x, head.weight, head.bias)).exp()[None]


def four_passes(logits: Tensor, taught: dict, m: DSpark) -> tuple[Tensor, Tensor]:
    """KL and α as before: distill_rows' V' teacher for KL; old_mass + a second V' teacher for α."""
    head, L, vocab = m.target.lm_head, m.target.num_layers, m.draft_ids
    (kl,) = distill_rows([logits], [0], taught, head, L, "kl", vocab)
    mass = old_mass(taught, head, L, vocab)
    rows = head_rows(head, vocab)

    def teacher(a: int, b: int) -> tuple[Tensor, Tensor]:
        p = teacher_probs(taught, head, L, a, b, vocab, rows)
        return p, p * mass[:, a:b, None]

    (alpha,) = _OverlapRows.apply(teacher, chunk_rows(1, logits.shape[-1]), False, logits)
    return kl, alpha


def one_pass(logits: Tensor, taught: dict, m: DSpark) -> tuple[Tensor, Tensor]:
    (alpha,), (kl,) = overlap_rows([logits], taught, m.target.lm_head, m.target.num_layers, m.draft_ids, with_kl=True)
    return kl, alpha


def loss_rows(m: DSpark, batch: dict) -> tuple[Tensor, dict]:
    """The student logits [1, M, N] (leaf, requires grad) and the teacher rows of a step's block positions."""
    with torch.no_grad():
        h, rows, valid = block_states(m, batch, m.anchor_generator(0))
        b, a, i = valid.nonzero(as_tuple=True)
        src = rows[b, a, i] - 1
        logits = m.logits(m.head_states(h[b, a, i], batch["input_ids"][b, src]))[None]
    return logits.detach().requires_grad_(), gather_rows(batch, b, src, m.target.num_layers)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(REPO / "recipes/targets/smollm2-135m-instruct"))
    ap.add_argument("--recipe", default=str(REPO / "recipes/smollm2-135m/dspark.yaml"))
    ap.add_argument("--draft-vocab", type=int, default=None, help="draft_vocab_size (default: the recipe's)")
    ap.add_argument("--anchors", default="16,64")
    add_batch_args(ap, batches=4)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if missing_target(args.target):
        return 2
    target = Target.load(args.target, dtype="float32")
    base = load_recipe(Path(args.recipe)).drafter.dspark
    if args.draft_vocab is not None:
        base = dataclasses.replace(base, draft_vocab_size=args.draft_vocab)
    loaded = load_batches(
        args, target, list(base.resolved(target.num_layers, target.vocab_size).feature_ids(target.num_layers))
    )
    if loaded is None:
        return 2
    source, batches = loaded
    tokens = torch.cat([b["input_ids"][b["attention_mask"].bool()] for b in batches])
    counts = torch.bincount(tokens, minlength=target.vocab_size)  # the draft vocabulary of these batches' tokens
    print(
        f"{args.target}, float32, {args.threads} thread(s); {len(batches)} batches of {args.batch_size} from {source}"
    )
    print(
        f"{'anchors':>7} {'rows':>6} {'4 passes ms':>12} {'1 pass ms':>10} {'logZ ms':>8} {'1 / logZ':>8} "
        f"{'rel. Δ':>9} {'step ms':>8} {'step, logZ':>10}"
    )
    for batch in batches:  # what a cache built since 2026-12-07 stores
        if "logz" not in batch:
            h = batch["hidden"][target.num_layers]
            head = target.lm_head
            batch["logz"] = logsumexp_rows(h.flatten(0, 1), head.weight, head.bias).view(h.shape[:2])
    for n in (int(a) for a in args.anchors.split(",")):
        torch.manual_seed(0)
        m = DSpark(target, dataclasses.replace(base, anchors=n), token_counts=counts).train()
        times: dict[str, list[float]] = {"four": [], "one": [], "logz": [], "step": [], "step_logz": []}
        diff, count = 0.0, 0
        for j, batch in enumerate(batches):
            logits, taught = loss_rows(m, batch)
            plain = {"hidden": taught["hidden"]}
            outs = {}
            for form, fn, rows in (("four", four_passes, plain), ("one", one_pass, plain), ("logz", one_pass, taught)):
                t0 = time.perf_counter()
                kl, alpha = fn(logits, rows, m)
                (kl.sum() + alpha.sum()).backward()
                logits.grad = None
                if j:
                    times[form].append(time.perf_counter() - t0)
                outs[form] = torch.cat([kl, alpha], -1)
            for form in ("one", "logz"):
                rel = (outs[form] - outs["four"]).abs().max() / outs["four"].abs().max()
                diff = max(diff, float(rel))
            count = logits.shape[1]
            for key, b in (("step", {k: v for k, v in batch.items() if k != "logz"}), ("step_logz", batch)):
                t0 = time.perf_counter()
                m(b, j)[0].backward()
                m.zero_grad(set_to_none=True)
                if j:
                    times[key].append(time.perf_counter() - t0)
        four, one, lz, step, step_lz = (1000 * statistics.median(times[k]) for k in times)
        print(
            f"{n:>7} {count:>6} {four:>12.0f} {one:>10.0f} {lz:>8.0f} {one / lz:>7.2f}x {diff:>9.1e} "
            f"{step:>8.0f} {step_lz:>10.0f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
