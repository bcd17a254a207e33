"""Drafter losses, LayerSkip's exit-loss scales and curricula, and the eval accuracy, as small pure functions.

Conventions (the batch contract): tensors are position-aligned [B, T, ...]. P_t is the target's
next-token distribution at position t (it predicts token t+1); a loss predicting token t+1 from
position t counts where loss_mask[:, t+1] is set, so `next_valid(batch)[b, t]` = loss_mask[b, t+1].
A drafter row t that predicts k tokens ahead reads its targets with `ahead(x, k)` (x[:, t+k]).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

# --- alignment ------------------------------------------------------------------------------


def ahead(x: Tensor, k: int, fill: float | bool | int = 0) -> Tensor:
    """x[:, t + k] at row t, `fill` past the end. [B, T, ...] -> [B, T, ...]"""
    if k == 0:
        return x
    out = torch.full_like(x, fill)
    if k < x.shape[1]:
        out[:, : x.shape[1] - k] = x[:, k:]
    return out


def next_valid(batch: dict) -> Tensor:
    """[B, T] bool: position t's next-token prediction is trained (loss_mask and attention at t+1)."""
    m = batch["loss_mask"].bool() & batch["attention_mask"].bool()
    return ahead(m, 1, False)


# --- per-position losses ([..., V] -> [...]) --------------------------------------------------


def soft_ce(logits: Tensor, probs: Tensor) -> Tensor:
    """Cross-entropy against a soft target distribution: -sum_v p(v) log q(v)."""
    return -(probs * torch.log_softmax(logits.float(), dim=-1)).sum(-1)


def kl_to(logits: Tensor, probs: Tensor) -> Tensor:
    """KL(p || q) of the drafter's q = softmax(logits) from the target's p (0 where they agree)."""
    logq = torch.log_softmax(logits.float(), dim=-1)
    return (torch.xlogy(probs, probs) - probs * logq).sum(-1)


def hard_ce(logits: Tensor, labels: Tensor) -> Tensor:
    """Cross-entropy against token labels [...]."""
    return F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), reduction="none").view(labels.shape)


def smooth_l1(pred: Tensor, target: Tensor) -> Tensor:
    """EAGLE-1's feature regression, averaged over the feature dim. [..., D] -> [...]"""
    return F.smooth_l1_loss(pred.float(), target.float(), reduction="none").mean(-1)


def masked_mean(x: Tensor, valid: Tensor) -> Tensor:
    """Mean of x [B, T] over valid [B, T] rows (0 when none is valid, still differentiable)."""
    v = valid.to(x.dtype)
    return (x * v).sum() / v.sum().clamp(min=1.0)


def step_weights(n: int, decay: float = 0.8) -> list[float]:
    """decay^k for k = 0..n-1: later draft positions count less (EAGLE-3's TTT, Medusa's heads)."""
    return [decay**k for k in range(n)]


# --- the target's distribution (the teacher), a chunk of rows at a time ---------------------------
#
# P_t over a 49k-152k vocabulary for every row of a batch would be a [B, T, V] fp32 tensor (1.6 GB for
# 4 x 2048 rows of SmolLM2): the teacher is built `chunk` rows at a time, used by the loss at once and
# dropped. The student's gradient is kept in its logits' dtype (bf16 under autocast), not as fp32 saves.

CHUNK_ELEMENTS = 1 << 22  # teacher probabilities held at once (16 MB in fp32)


def chunk_rows(batch_size: int, vocab: int, budget: int = CHUNK_ELEMENTS) -> int:
    """Rows per chunk so that a [B, rows, V] fp32 block stays within `budget` elements (at least 1)."""
    return max(1, budget // max(1, batch_size * vocab))


def head_rows(lm_head: torch.nn.Linear, vocab_ids: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """The LM head's weight [V', H] and bias [V'] rows for `vocab_ids` (all of them when None)."""
    if vocab_ids is None:
        return lm_head.weight, lm_head.bias
    return lm_head.weight[vocab_ids], None if lm_head.bias is None else lm_head.bias[vocab_ids]


def teacher_probs(
    batch: dict,
    lm_head: torch.nn.Linear,
    num_layers: int,
    start: int,
    stop: int,
    vocab_ids: Tensor | None = None,
    rows: tuple[Tensor, Tensor | None] | None = None,
) -> Tensor:
    """P_t for rows start <= t < stop, over the vocabulary or the sub-vocabulary `vocab_ids` (renormalised);
    rows past the end of the batch are all-zero (as `ahead` fills). -> [B, stop - start, V'] fp32

    From the batch's top-k (`topk_ids`/`topk_probs` [B, T, k]) when present, else softmax of the frozen
    LM head on hidden[num_layers] (post-norm); `rows` = head_rows(lm_head, vocab_ids) when the caller has them.
    """
    src = batch["topk_ids"] if "topk_ids" in batch else batch["hidden"][num_layers]
    end = min(stop, src.shape[1])
    if "topk_ids" in batch:
        ids, p = batch["topk_ids"][:, start:end].long(), batch["topk_probs"][:, start:end].float()
        dense = torch.zeros(*ids.shape[:2], lm_head.weight.shape[0], dtype=torch.float32, device=ids.device)
        dense.scatter_(-1, ids, p)
        if vocab_ids is not None:
            dense = dense[..., vocab_ids]
        probs = dense / dense.sum(-1, keepdim=True).clamp(min=1e-12)
    else:
        h = batch["hidden"][num_layers][:, start:end]
        w, bias = rows or head_rows(lm_head, vocab_ids)  # softmax over V' rows = renormalised over V'
        with torch.no_grad():
            probs = torch.softmax(flat_linear(h.to(w.dtype), w, bias).float(), dim=-1)
    if end < stop:  # past the end: no next token, no distribution
        probs = torch.cat([probs, probs.new_zeros(probs.shape[0], stop - max(end, start), probs.shape[-1])], 1)
    return probs


def own_probs(batch: dict, rows: tuple[Tensor, Tensor | None], num_layers: int, start: int, stop: int) -> Tensor:
    """The target's own probabilities P_t(v) of the head rows `rows` (a draft vocabulary's) at rows start <= t <
    stop, from the batch's per-row log-normaliser `logz` [B, T] (logsumexp over the whole vocabulary, which
    feature caches store): exp(l_v - logz) reads only those rows of the head, not all V. Past the end: zeros.
    -> [B, stop - start, N] fp32"""
    h = batch["hidden"][num_layers][:, start:stop]
    w, bias = rows
    with torch.no_grad():
        own = (flat_linear(h.to(w.dtype), w, bias).float() - batch["logz"][:, start:stop, None].float()).exp()
    if own.shape[1] < stop - start:
        own = torch.cat([own, own.new_zeros(own.shape[0], stop - start - own.shape[1], own.shape[-1])], 1)
    return own


def flat_linear(x: Tensor, w: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear on [B, T, H] as one [B*T, H] matmul. [B, T, H] -> [B, T, V]

    A row slice x[:, a:b] of a batch is not contiguous, and torch.matmul runs it as a bmm against the
    weight broadcast B times: about 2x slower than one mm over the same rows (measured on an AVX2 CPU, fp32).
    """
    b, t, h = x.shape
    return F.linear(x.reshape(b * t, h), w, bias).view(b, t, -1)


ARGMAX_ROWS = 4096  # rows scored at once by teacher_argmax (their states stay in cache while the head streams)


@torch.no_grad()
def teacher_argmax(batch: dict, lm_head: torch.nn.Linear, num_layers: int, budget: int = CHUNK_ELEMENTS) -> Tensor:
    """The target's most likely next token at every row, over the full vocabulary. -> [B, T] long

    Scored a block of the vocabulary at a time over up to ARGMAX_ROWS rows at once, keeping a running
    maximum (the earlier block wins a tie, as argmax's first index): the head's weight is read once per
    4,096 rows, where chunks of a few rows re-read all of it (V x H) per chunk. A batch that carries the
    target's own `argmax` (feature caches store it) costs nothing.
    """
    if "argmax" in batch:
        return batch["argmax"].long()
    if "topk_ids" in batch:
        ids, p = batch["topk_ids"].long(), batch["topk_probs"]
        return ids.gather(-1, p.argmax(-1, keepdim=True)).squeeze(-1)
    h = batch["hidden"][num_layers]
    b, T, H = h.shape
    w, bias = lm_head.weight, lm_head.bias
    x = h.reshape(b * T, H).to(w.dtype)
    out = torch.empty(b * T, dtype=torch.long, device=h.device)
    for r in range(0, b * T, ARGMAX_ROWS):
        rows = x[r : r + ARGMAX_ROWS]
        block = max(1, budget // rows.shape[0])
        best = torch.full((rows.shape[0],), -math.inf, device=h.device)
        idx = torch.zeros(rows.shape[0], dtype=torch.long, device=h.device)
        for a in range(0, w.shape[0], block):
            logits = F.linear(rows, w[a : a + block], None if bias is None else bias[a : a + block]).float()
            i = logits.argmax(-1)
            m = logits.gather(-1, i[:, None]).squeeze(-1)
            better = m > best
            best, idx = torch.where(better, m, best), torch.where(better, i + a, idx)
        out[r : r + ARGMAX_ROWS] = idx
    return out.view(b, T)


def gather_rows(batch: dict, b: Tensor, t: Tensor, num_layers: int) -> dict:
    """The teacher's inputs at rows (b[i], t[i]) as a one-row batch: what teacher_probs and distill_rows read
    (the post-norm state, or the stored top-k). [M] indices -> {..: [1, M, ..]}"""
    if "topk_ids" in batch:
        return {"topk_ids": batch["topk_ids"][b, t][None], "topk_probs": batch["topk_probs"][b, t][None]}
    rows = {"hidden": {num_layers: batch["hidden"][num_layers][b, t][None]}}
    return rows | ({"logz": batch["logz"][b, t][None]} if "logz" in batch else {})


class _DistillRows(torch.autograd.Function):
    """Per-row soft-CE (or KL) of several logits [B, T, V'] against a teacher built a chunk of rows at a time.

    -sum_v p log softmax(l) has gradient softmax(l) * sum(p) - p: it is written chunk by chunk into one
    tensor per output in the logits' dtype during the forward, so neither the fp32 log-softmax nor the
    teacher is kept for the backward (and no per-chunk slice gradient is ever the size of the logits).
    """

    @staticmethod
    def forward(
        ctx, teacher: Callable[[int, int], Tensor], shifts: Sequence[int], chunk: int, kl: bool, *logits: Tensor
    ) -> tuple[Tensor, ...]:
        b, T, _ = logits[0].shape
        lo, hi = min(shifts), max(shifts)
        rows = [x.new_zeros(b, T, dtype=torch.float32) for x in logits]
        grads = [torch.empty_like(x) for x in logits]
        for a in range(0, T, chunk):
            c = min(chunk, T - a)
            probs = teacher(a + lo, a + c + hi)  # [B, c + hi - lo, V'] fp32
            for x, k, r, g in zip(logits, shifts, rows, grads):
                p = probs[:, k - lo : k - lo + c]
                logq = torch.log_softmax(x[:, a : a + c].float(), dim=-1)
                r[:, a : a + c] = -(p * logq).sum(-1) + (torch.xlogy(p, p).sum(-1) if kl else 0.0)
                g[:, a : a + c] = logq.exp_() * p.sum(-1, keepdim=True) - p
        ctx.save_for_backward(*grads)
        return tuple(rows)

    @staticmethod
    def backward(ctx, *grad_rows: Tensor) -> tuple[Tensor | None, ...]:
        grads = ctx.saved_tensors
        return None, None, None, None, *(g * gr[..., None].to(g.dtype) for g, gr in zip(grads, grad_rows))


def distill_rows(
    logits: Sequence[Tensor],
    shifts: Sequence[int],
    batch: dict,
    lm_head: torch.nn.Linear,
    num_layers: int,
    kind: str = "soft_ce",
    vocab_ids: Tensor | None = None,
    chunk: int | None = None,
) -> list[Tensor]:
    """Per-row losses of several drafter outputs against the target: logits[i] [B, T, V'] at row t against
    P_{t + shifts[i]}, by `soft_ce` (-sum p log q) or `kl` (KL(p || q)) — each equal to
    soft_ce/kl_to(logits[i], ahead(P, shifts[i])). P is built `chunk` rows at a time, once per chunk for
    all outputs (rows a + min(shifts) .. a + chunk + max(shifts)). -> [[B, T] fp32 per output]
    """
    if kind not in ("soft_ce", "kl"):
        raise ValueError(f"distillation loss {kind!r} not one of ['kl', 'soft_ce']")
    b, _, v = logits[0].shape
    rows = None if "topk_ids" in batch else head_rows(lm_head, vocab_ids)  # sliced once, not per chunk

    def teacher(start: int, stop: int) -> Tensor:
        return teacher_probs(batch, lm_head, num_layers, start, stop, vocab_ids, rows)

    return list(_DistillRows.apply(teacher, list(shifts), chunk or chunk_rows(b, v), kind == "kl", *logits))


def in_topk(logits: Tensor, want: Tensor, k: int = 1) -> Tensor:
    """Whether `want` [B, T] is among the top-k of logits [B, T, V] (k = 1: the argmax). -> [B, T] bool"""
    if k == 1:
        return logits.argmax(-1) == want
    return (logits.topk(min(k, logits.shape[-1]), dim=-1).indices == want[..., None]).any(-1)


def conditional_accuracy(correct: Sequence[Tensor], valid: Sequence[Tensor]) -> list[float]:
    """Top-1 accuracy per draft position k = 1..K, conditional on positions 1..k-1 being right.

    correct[k], valid[k]: [B, T] bool per root row. Position k counts rows valid at every position
    <= k whose earlier positions were all right, so prod_{j<=k} acc_j is the chance the first k
    draft tokens are all accepted, and the simulated chain τ is 1 + sum_k prod_{j<=k} acc_j.
    """
    out = []
    ok = torch.ones_like(correct[0], dtype=torch.bool)
    seen = torch.ones_like(correct[0], dtype=torch.bool)
    for c, v in zip(correct, valid):
        seen = seen & v.bool()
        denom = int((seen & ok).sum())
        ok = ok & c.bool()
        out.append(int((seen & ok).sum()) / denom if denom else 0.0)
    return out


def simulated_chain_tau(accuracy: Sequence[float]) -> float:
    """1 + sum_k prod_{j<=k} acc_j: the expected tokens per target pass of a chain this deep."""
    tau, run = 1.0, 1.0
    for a in accuracy:
        run *= a
        tau += run
    return tau


def loss_metrics(name: str, values: Sequence[Tensor]) -> dict[str, float]:
    """{name_1: v_1, ...} as floats for logging (positions counted from 1)."""
    return {f"{name}_{k + 1}": float(v.detach()) for k, v in enumerate(values)}
