"""LK losses: train a drafter on its acceptance rate instead of KL (`train.loss: lk`).

Samarin et al., "LK Losses: Direct Acceptance Rate Optimization for Speculative Decoding", arXiv 2602.23881
(https://nebius.com/blog/posts/lk-losses); the definitions below follow the authors' own implementation,
SpecForge `specforge/core/lk_loss.py` (sgl-project/SpecForge pull request 492).

Speculative sampling accepts the drafter's token at row t with probability
    α_t = Σ_x min(p_t(x), q_t(x)) = 1 - TV(p_t, q_t)
(p_t: the target's next-token distribution, q_t = softmax of the drafter's logits). KL and α share their
optimum (q = p), but a small drafter cannot reach it, and the lowest KL it can reach need not be its highest
α. Two losses over a step's (or head's, or exit's) valid rows:
- `alpha`:  LK^α = mean_t -log α_t. Its gradient is TV's scaled by 1/α_t, which keeps it from vanishing
  while the drafter is far off (1 - α's does).
- `lambda`: LK^λ = λ · mean_t KL(p_t || q_t) + (1 - λ) · mean_t (1 - α_t), λ = kl_scale · exp(-η · sg(ᾱ)),
  ᾱ the rows' mean acceptance (no gradient through λ): KL's strong gradient while acceptance is low,
  the acceptance rate itself as it rises (η = 3: λ ≈ 0.09 at ᾱ = 0.8).
With a reduced draft vocabulary (EAGLE-3) the KL term reads p renormalised over it, as the KL path does,
while α reads the target's own probabilities of those tokens (SpecForge's `target_p_on_draft`): a drafted
token is verified against the full target, so tokens outside the draft vocabulary are acceptance lost.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from drafters.trainable.losses import chunk_rows, head_rows, masked_mean, own_probs, teacher_probs

VARIANTS = ("lambda", "alpha")
ALPHA_FLOOR = 1e-12  # -log α floors α here: a row with no overlap at all (α = 0) has no direction to move


@dataclass(frozen=True)
class Objective:
    """What a drafter's distillation term optimises: the recipe's train.loss and its LK settings."""

    loss: str = "kl"  # kl: each drafter's own KL / soft CE | lk: the LK loss `variant`
    variant: str = "lambda"  # lk: lambda (KL blended into the acceptance rate) | alpha (-log acceptance)
    eta: float = 3.0  # lambda: η, how fast the KL weight decays as acceptance grows (the paper's 3)
    kl_scale: float = 1.0  # lambda: the KL weight at zero acceptance (SpecForge's kl_scale)

    def __post_init__(self) -> None:
        if self.loss not in ("kl", "lk"):
            raise ValueError(f"loss {self.loss!r} not one of ['kl', 'lk']")
        if self.variant not in VARIANTS:
            raise ValueError(f"LK variant {self.variant!r} not one of {list(VARIANTS)}")
        if not (self.eta >= 0 and 0 <= self.kl_scale <= 1):  # λ in [0, 1]: a blend, acceptance never pushed down
            raise ValueError(f"LK needs eta >= 0 and kl_scale in [0, 1], got {self.eta}, {self.kl_scale}")

    @classmethod
    def of(cls, train) -> Objective:
        """From a recipe's train section (train.loss, train.lk_variant, train.lk_eta, train.lk_kl_scale)."""
        return cls(train.loss, train.lk_variant, train.lk_eta, train.lk_kl_scale)

    @property
    def lk(self) -> bool:
        return self.loss == "lk"


KL = Objective()  # the default: every drafter's own KL / soft CE, untouched


def label_conflict(kind: str) -> str:
    """Why `lk` is refused for a drafter trained on token labels (drafter.<kind>.loss=ce), and the fix."""
    return (
        f"train.loss=lk trains on the target's next-token distributions, but drafter.{kind}.loss=ce trains on "
        f"token labels (where LK's -log α would be CE itself); set drafter.{kind}.loss=kl, or train.loss=kl"
    )


def use_objective(module: nn.Module, objective: Objective) -> None:
    """Train `module` with `objective`; `lk` is refused where the drafter trains on token labels."""
    if objective.lk and getattr(module.config, "loss", "kl") == "ce":
        raise ValueError(label_conflict(module.kind))
    module.objective = objective


# --- per-row acceptance (and KL) against the target, a chunk of rows at a time -----------------------


class _OverlapRows(torch.autograd.Function):
    """Per-row acceptance α (and KL(p || q)) of several logits [B, T, V'] against a teacher built a chunk of rows
    at a time, as losses._DistillRows does for KL: the gradient of each output is written chunk by chunk during
    the forward in the logits' dtype, so neither the teacher nor q in fp32 is kept for the backward.

    ∂α/∂q_v = g_v = [q_v < p_v] (a tie counts p: α has a kink there, and 0 is one of its subgradients), and
    through the softmax ∂α/∂l = q ⊙ (g - <g, q>); KL's is q · Σp - p.
    """

    @staticmethod
    def forward(ctx, teacher: Callable[[int, int], tuple[Tensor, Tensor]], chunk: int, with_kl: bool, *logits):
        b, T, _ = logits[0].shape
        alphas = [x.new_zeros(b, T, dtype=torch.float32) for x in logits]
        g_alpha = [torch.empty_like(x) for x in logits]
        kls = [x.new_zeros(b, T, dtype=torch.float32) for x in logits] if with_kl else []
        g_kl = [torch.empty_like(x) for x in logits] if with_kl else []
        for a in range(0, T, chunk):
            c = min(chunk, T - a)
            p, p_own = teacher(a, a + c)  # [B, c, V'] fp32: renormalised over V' (KL), the target's own (α)
            for i, x in enumerate(logits):
                logq = torch.log_softmax(x[:, a : a + c].float(), dim=-1)
                q = logq.exp()
                alphas[i][:, a : a + c] = torch.minimum(p_own, q).sum(-1)
                q_below = q * (q < p_own)  # q ⊙ g
                g_alpha[i][:, a : a + c] = q_below - q * q_below.sum(-1, keepdim=True)
                if with_kl:
                    kls[i][:, a : a + c] = (torch.xlogy(p, p) - p * logq).sum(-1)
                    g_kl[i][:, a : a + c] = q * p.sum(-1, keepdim=True) - p
        ctx.n = len(logits)
        ctx.save_for_backward(*g_alpha, *g_kl)
        return (*alphas, *kls)

    @staticmethod
    def backward(ctx, *grad_rows: Tensor) -> tuple[Tensor | None, ...]:
        saved, n = ctx.saved_tensors, ctx.n
        grads = [saved[i] * grad_rows[i][..., None].to(saved[i].dtype) for i in range(n)]
        for i in range(len(saved) - n):  # the KL outputs' share
            grads[i] = grads[i] + saved[n + i] * grad_rows[n + i][..., None].to(saved[n + i].dtype)
        return None, None, None, *grads


def overlap_rows(
    logits: Sequence[Tensor],
    batch: dict,
    lm_head: nn.Linear,
    num_layers: int,
    vocab_ids: Tensor | None = None,
    with_kl: bool = False,
    chunk: int | None = None,
) -> tuple[list[Tensor], list[Tensor]]:
    """Per-row α_t of each drafter output logits[i] [B, T, V'] against the target's P_t (and KL(P_t || q_t) over
    V' when `with_kl`), P built `chunk` rows at a time as losses.distill_rows does. V' = `vocab_ids` (None: the
    whole vocabulary); α reads P's own probabilities of V', KL reads P renormalised over V'. A batch with the
    target's log-normaliser `logz` (feature caches store it) needs only V' rows of the head for P's own
    probabilities; without it one pass of the whole head gives them.
    -> ([B, T] fp32 α per output, [B, T] fp32 KL per output or [])
    """
    b, _, v = logits[0].shape
    whole = lm_head.weight.shape[0]
    partial = vocab_ids is not None and vocab_ids.numel() < whole
    logz = partial and "logz" in batch and "topk_ids" not in batch  # the whole vocabulary's normaliser is stored
    rows = None if "topk_ids" in batch else head_rows(lm_head, vocab_ids if logz or not partial else None)

    def teacher(start: int, stop: int) -> tuple[Tensor, Tensor]:
        # a draft vocabulary: α reads the target's own probabilities of V', KL those renormalised over V'; from the
        # stored log-normaliser (V' rows of the head), else from one pass of the whole head
        if logz:
            own = own_probs(batch, rows, num_layers, start, stop)
        else:
            p = teacher_probs(batch, lm_head, num_layers, start, stop, None if partial else vocab_ids, rows)
            if not partial:
                return p, p
            own = p[..., vocab_ids]  # [B, c, V'] fp32
        return own / own.sum(-1, keepdim=True).clamp(min=1e-12), own

    out = _OverlapRows.apply(teacher, chunk or chunk_rows(b, whole if partial and not logz else v), with_kl, *logits)
    return list(out[: len(logits)]), list(out[len(logits) :])


# --- the losses -------------------------------------------------------------------------------------


def lk_loss(alpha: Tensor, kl: Tensor | None, valid: Tensor, objective: Objective) -> Tensor:
    """One output's LK loss over its valid rows: alpha [B, T], kl [B, T] (lambda only), valid [B, T] bool."""
    if objective.variant == "alpha":
        return masked_mean(-torch.log(alpha.clamp(min=ALPHA_FLOOR)), valid)
    lam = objective.kl_scale * torch.exp(-objective.eta * masked_mean(alpha, valid).detach())
    return lam * masked_mean(kl, valid) + (1 - lam) * masked_mean(1 - alpha, valid)


def lk_losses(
    logits: Sequence[Tensor],
    valid: Sequence[Tensor],
    batch: dict,
    lm_head: nn.Linear,
    num_layers: int,
    objective: Objective,
    vocab_ids: Tensor | None = None,
) -> tuple[list[Tensor], list[Tensor]]:
    """Each output's LK loss and mean acceptance ᾱ (for the metrics) over its valid rows: logits[i]
    [B, T, V'] at row t against P_t, valid[i] [B, T]. -> ([scalar loss], [scalar ᾱ, no gradient])"""
    alphas, kls = overlap_rows(logits, batch, lm_head, num_layers, vocab_ids, objective.variant == "lambda")
    kls = kls or [None] * len(alphas)
    losses = [lk_loss(a, kl, v, objective) for a, kl, v in zip(alphas, kls, valid)]
    return losses, [masked_mean(a, v).detach() for a, v in zip(alphas, valid)]
