"""EAGLE-3 on a frozen target: low/mid/high capture ids fused by fc, a draft layer over [RMSNorm(e); RMSNorm(h)],
its own LM head over a reduced draft vocabulary, trained with training-time test (DESIGN §4).

EAGLE-3.1's switches, as vLLM 0.32's llama_eagle3.py computes them: `fc_norm` (an RMSNorm per captured state
before fc) and `norm_output` (`advance` hands the post-norm state on, and `head` reads it without a second norm).

The rows, the unroll and decoding it shares with EAGLE-1 live in drafters/trainable/eagle.py (`EagleBase`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

import torch
from torch import Tensor, nn

from decode.runtime import Packed, PackedLinear
from decode.target import Target
from drafters.trainable.draft_layer import LayerSizes, RMSNorm
from drafters.trainable.eagle import EagleBase
from drafters.trainable.lk import lk_losses
from drafters.trainable.losses import (
    distill_rows,
    gather_rows,
    loss_metrics,
    masked_mean,
    next_valid,
    step_weights,
    teacher_argmax,
)
from drafters.trainable.noise import check_noise
from drafters.trainable.target_layer import check_draft_layer, eagle3_layer


def default_capture_ids(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low/mid/high capture ids: (2, L//2, L-3) (vLLM/speculators), spread for shallow targets.

    Below 7 layers that formula repeats or reorders ids, so use three ids spread over 1..L-1.
    """
    L = num_layers
    if L >= 7:
        return (2, L // 2, L - 3)
    return tuple(sorted({max(1, round(1 + i * (L - 2) / 2)) for i in range(3)})) if L > 1 else (0,)


def build_draft_vocab(token_counts: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """The n most frequent target tokens (ties: lower id first), in id order.

    token_counts [V] -> d2t [n] long (target id = draft id + d2t[draft id]), t2d [V] bool (in the draft vocab).
    """
    v = token_counts.numel()
    if not 1 <= n <= v:
        raise ValueError(f"draft vocabulary size {n} must be in 1..{v} (the target's vocabulary)")
    order = torch.sort(token_counts.double().view(-1).cpu(), descending=True, stable=True).indices
    ids = order[:n].sort().values
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(n), t2d


@dataclass
class Eagle3Config:
    """EAGLE-3: capture ids, draft vocabulary, draft-layer width and training-time test."""

    capture_ids: tuple[int, ...] = ()  # target hidden ids fused by fc; () = default_capture_ids(L)
    draft_vocab_size: int = 32000  # rows of the drafter's LM head, capped at the target's vocabulary
    intermediate_size: int = 0  # FFN width of the draft layer; 0 = the target's
    ttt_steps: int = 7  # training-time test: steps unrolled on the drafter's own states (K)
    step_decay: float = 0.8  # loss weight decay^k of unrolled step k (1.0: equal weights, speculators)
    noise: Literal["none", "gaussian", "uniform", "relative"] = "none"  # noise on the capture states, training only
    noise_std: float = 0.05  # gaussian: std; uniform: half-width; relative: x*(1+N(0,std²)); speculators: gaussian 0.05
    freeze_head: bool = False  # LM head rows and final norm stay the target's copies, frozen (speculators)
    fc_norm: bool = False  # EAGLE-3.1: an RMSNorm on each captured state before fc (vLLM `fc_norm.{i}`)
    norm_output: bool = False  # EAGLE-3.1: the state fed to the next step is post-norm, not pre-norm
    # the draft layer's type: llama = EAGLE-3's Llama layer; target = the target's own (a Qwen3 target's adds
    # QK-norm; a Llama/Mistral target's is llama), drafters/trainable/target_layer.py
    draft_layer: Literal["llama", "target"] = "llama"

    def __post_init__(self) -> None:
        check_noise(self.noise, self.noise_std)
        check_draft_layer(self.draft_layer)
        if not self.step_decay >= 0:
            raise ValueError(f"step_decay must be >= 0, got {self.step_decay}")

    def resolved(self, num_layers: int, vocab_size: int) -> Eagle3Config:
        """Defaults filled in for a target, checked (capture ids in range)."""
        ids = tuple(int(i) for i in self.capture_ids) or default_capture_ids(num_layers)
        bad = [i for i in ids if not 0 <= i < num_layers]
        if bad:
            raise ValueError(
                f"EAGLE-3 capture ids {bad} out of range 0..{num_layers - 1} for a "
                f"{num_layers}-layer target (hidden ids: 0 = embeddings, i = output of layer i)"
            )
        if self.ttt_steps < 1:
            raise ValueError(f"ttt_steps must be >= 1, got {self.ttt_steps}")
        return replace(self, capture_ids=ids, draft_vocab_size=min(self.draft_vocab_size, vocab_size))

    def feature_ids(self, num_layers: int) -> tuple[int, ...]:
        """Hidden ids a training batch needs: the capture ids, and L for the target's distribution."""
        ids = tuple(self.capture_ids) or default_capture_ids(num_layers)
        return tuple(sorted(set(ids) | {num_layers}))


class Eagle3(EagleBase):
    """EAGLE-3: fuses low/mid/high target features, trained with the training-time test."""

    kind = "eagle3"

    def __init__(
        self,
        target: Target,
        config: Eagle3Config | None = None,
        token_counts: Tensor | None = None,
        seed: int = 0,
        rank: int = 0,
    ) -> None:
        """token_counts [V]: target-token frequencies of the training data, for the draft vocabulary
        (None: the first N ids, fine for tests or when the vocabulary is not reduced); seed, rank: of
        the training noise."""
        super().__init__(target, seed, rank)
        self.config = cfg = (config or Eagle3Config()).resolved(target.num_layers, target.vocab_size)
        sizes = LayerSizes.of(target.config, cfg.intermediate_size)
        H, n = sizes.hidden, cfg.draft_vocab_size
        if token_counts is None:
            token_counts = torch.arange(target.vocab_size, 0, -1)
        if token_counts.numel() != target.vocab_size:
            raise ValueError(
                f"token_counts has {token_counts.numel()} entries, the target's vocabulary {target.vocab_size}"
            )
        d2t, t2d = build_draft_vocab(token_counts, n)
        with torch.device(target.device):
            self.fc = nn.Linear(len(cfg.capture_ids) * H, H, bias=False)
            # one norm per capture id (its own scale: a low layer's states are far smaller than a high one's)
            self.fc_norm = nn.ModuleList(RMSNorm(H, sizes.eps) for _ in cfg.capture_ids) if cfg.fc_norm else None
            self.midlayer = eagle3_layer(sizes, cfg.draft_layer, getattr(target.config, "model_type", None))
            self.norm = RMSNorm(H, sizes.eps)
            self.lm_head = nn.Linear(H, n, bias=False)
        self.register_buffer("d2t", d2t.to(target.device))
        self.register_buffer("t2d", t2d.to(target.device))
        with torch.no_grad():  # start from the target's own head, restricted to the draft vocabulary
            self.lm_head.weight.copy_(target.lm_head.weight[self.draft_ids])
            self.norm.weight.copy_(target.norm.weight)
        if cfg.freeze_head:  # not trained: the optimizer only sees parameters that require grad
            self.lm_head.requires_grad_(False)
            self.norm.requires_grad_(False)
        self.default_depth = cfg.ttt_steps

    @property
    def draft_ids(self) -> Tensor:
        """Target id of each draft-vocabulary entry. [N]"""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    @property
    def decode_hidden_ids(self) -> tuple[int, ...]:
        return tuple(self.config.capture_ids)

    def project(self, hidden: dict[int, Tensor]) -> Tensor:
        """fc over the concatenated capture states (fc_norm: each normed first, as vLLM's combine_hidden_states
        norms each H-wide chunk). {id: [.., H]} -> [.., H]"""
        parts = [hidden[i].to(self.dtype) for i in self.config.capture_ids]  # each [.., H]
        if self.fc_norm is not None:
            parts = [norm(p) for norm, p in zip(self.fc_norm, parts)]
        return self.fc(torch.cat(parts, dim=-1))

    def advance(self, x: Tensor, emb: Tensor, positions: Tensor, ctx) -> Tensor:
        """The draft layer: x, emb [B, T, H] at positions [B, T] -> the state fed back [B, T, H]: the pre-norm
        output, or with norm_output the post-norm one (vLLM: `hidden_states if norm_output else hidden_prenorm`).
        The unroll and the decoder both feed back what this returns, so training and decoding agree."""
        cos, sin = self.target.rotary_emb(x, positions)
        out = self.midlayer(x, cos, sin, ctx, emb)
        return self.norm(out) if self.config.norm_output else out

    def head(self, h: Tensor) -> Tensor:
        """Draft-vocabulary logits of states from `advance`. [.., H] -> [.., N]"""
        return self.lm_head(h if self.config.norm_output else self.norm(h))  # norm_output: h is normed already

    def decode_head(self) -> Callable[[Tensor], Tensor]:
        """head() for decoding: the same product over the LM head packed once for one-row calls
        (decode.runtime.Packed; the draft head is wide, 16k x 576 on the chat target: stored [in, out])."""
        head = self.lm_head  # a PackedLinear already in a decode copy (decode.runtime.packed_copy)
        with torch.no_grad():
            packed = head.packed if isinstance(head, PackedLinear) else Packed.of([head], keep_rows=True)
        return lambda h: packed(h if self.config.norm_output else self.norm(h))

    def step_vocab(self) -> Tensor | None:
        """Target id of each logit column [N] for decode.tree.grow; None when the draft vocabulary is the
        target's whole vocabulary (the columns are the ids)."""
        return None if self.d2t.numel() == self.t2d.numel() else self.draft_ids

    def to_target(self, draft: Tensor) -> Tensor:
        return draft + self.d2t[draft]

    def loss(self, batch: dict, step: int = 0) -> tuple[Tensor, dict[str, float]]:
        """Training-time test: sum_k decay^k soft-CE(step k, P restricted to the draft vocabulary), or with
        train.loss=lk each step's LK loss (drafters/trainable/lk.py).

        Rows whose target argmax lies outside the draft vocabulary are skipped (SpecForge does the same):
        the drafter cannot propose that token, so the row only teaches it a distorted distribution.
        """
        L = self.target.num_layers
        argmax = teacher_argmax(batch, self.target.lm_head, L)
        valid = next_valid(batch) & self.t2d[argmax]  # [B, T]: P_t is a target the draft vocabulary can reach
        states = self.unroll_states(batch, self.config.ttt_steps, self.noise_generator(step))
        # 1. Only rows with a loss go through the draft head (in chat data 54% of a padded batch are prompt
        #    and padding rows, which have none). The teacher rows t' (valid) are every step's targets; step k's
        #    prediction of P_t' sits at row t' - k - 1 (k+1 tokens ahead), absent when that is < 0.
        b, t = valid.nonzero(as_tuple=True)  # [M] each
        logits, present = [], []
        for k, h in enumerate(states):
            src = t - (k + 1)
            present.append((src >= 0)[None])  # [1, M]
            logits.append(self.head(h[b, src.clamp(min=0)])[None])  # [1, M, N]
        # 2. step k against P_t' restricted to the draft vocabulary (softmax over it = renormalised), the
        #    teacher built once per chunk of rows for all steps
        taught, lm_head, obj = gather_rows(batch, b, t, L), self.target.lm_head, self.objective
        if obj.lk:  # α reads P's own probabilities of the draft vocabulary, its KL term the renormalised ones
            losses, alphas = lk_losses(logits, present, taught, lm_head, L, obj, self.draft_ids)
        else:
            rows = distill_rows(logits, [0] * len(logits), taught, lm_head, L, "soft_ce", self.draft_ids)
            losses, alphas = [masked_mean(ce, v) for ce, v in zip(rows, present)], []
        want = argmax[b, t][None]  # [1, M]
        accs = [masked_mean((self.to_target(lg.argmax(-1)) == want).float(), v) for lg, v in zip(logits, present)]
        total = sum(w * lo for w, lo in zip(step_weights(len(losses), self.config.step_decay), losses))
        terms = {**loss_metrics("lk" if obj.lk else "ce", losses), **loss_metrics("alpha", alphas)}
        return total, {"loss": float(total.detach()), **terms, **loss_metrics("acc", accs)}
