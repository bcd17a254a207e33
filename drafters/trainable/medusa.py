"""Medusa: K heads on the target's last hidden state, each guessing one token further ahead (DESIGN §4).

Head k (k = 0..K-1) reads h_t, the target's post-norm state at position t (hidden id L, the one that
produced x_{t+1}), and predicts x_{t+k+2}: ResBlocks (x + SiLU(Wx + b), W zero-init; with b zero too
every head starts as the target's own next-token head) -> a vocabulary projection: `head: shared`, the
target's frozen LM head (a 152k-vocabulary head per Medusa head would be 778M parameters each for
Qwen3-14B), or `head: copied`, a trainable copy per head. Key names follow vLLM's Medusa layout:
`blocks.{k}.layers.{l}.*`, `lm_heads.{k}.weight` (only with copied heads; shared heads are exported from the target).

Decoding: one drafter pass per round computes every head's log-probs at the newest target state;
the chain takes each head's argmax (or draws from it when sampling); static trees rank each head's
top-k (Medusa's choice lists); the dynamic tree ranks paths by cumulative head log-probs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import torch
from torch import Tensor, nn

from decode.protocol import Budget, TargetStep
from decode.target import Target
from decode.tree import DraftTree, Shape, grow
from drafters.common import sampler
from drafters.trainable.lk import KL, lk_losses
from drafters.trainable.losses import (
    ahead,
    conditional_accuracy,
    distill_rows,
    gather_rows,
    hard_ce,
    in_topk,
    loss_metrics,
    masked_mean,
    next_valid,
    step_weights,
    teacher_argmax,
)


@dataclass
class MedusaConfig:
    """Medusa heads: count, ResBlock depth, vocabulary projection and loss."""

    num_heads: int = 4  # K heads; head k predicts the token k+2 positions ahead of its state
    num_layers: int = 1  # ResBlocks per head
    head: Literal["shared", "copied"] = (
        "shared"  # vocabulary projection: the target's frozen LM head | a trainable copy per head
    )
    per_head_vocab: bool = False  # old spelling of head=copied (kept so old configs load; resolved keeps both in step)
    residual_init: Literal["medusa", "identity"] = (
        "medusa"  # medusa: W = 0, b default (Medusa-1's code); identity: b = 0 too
    )
    loss: str = "ce"  # ce (token labels) | kl (to the target's own next-token distributions)
    step_decay: float = 0.8  # loss weight decay^k of head k

    def __post_init__(self) -> None:
        if self.head not in ("shared", "copied"):
            raise ValueError(f"Medusa head {self.head!r} not one of ['shared', 'copied']")
        if self.residual_init not in ("medusa", "identity"):
            raise ValueError(f"Medusa residual_init {self.residual_init!r} not one of ['medusa', 'identity']")

    def resolved(self, num_layers: int, vocab_size: int) -> MedusaConfig:
        if self.num_heads < 1 or self.num_layers < 1:
            raise ValueError(
                f"Medusa needs num_heads >= 1 and num_layers >= 1, got {self.num_heads}, {self.num_layers}"
            )
        if self.loss not in ("ce", "kl"):
            raise ValueError(f"Medusa loss {self.loss!r} not one of ['ce', 'kl']")
        copied = self.head == "copied" or self.per_head_vocab
        return replace(self, head="copied" if copied else "shared", per_head_vocab=copied)

    def feature_ids(self, num_layers: int) -> tuple[int, ...]:
        """Hidden ids a training batch needs: the post-norm last state L."""
        return (num_layers,)


class ResBlocks(nn.Module):
    """x + SiLU(W x + b), `num_layers` times; W starts at zero (Medusa), b too when `zero_bias` (exactly x)."""

    def __init__(self, hidden: int, num_layers: int, zero_bias: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(hidden, hidden) for _ in range(num_layers)])
        for layer in self.layers:
            nn.init.zeros_(layer.weight)
            if zero_bias:  # SiLU(0) = 0: the block is the identity until trained
                nn.init.zeros_(layer.bias)

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = x + nn.functional.silu(layer(x))
        return x


class Medusa(nn.Module):
    """K Medusa heads over a frozen target; `module(batch, step)` is the training loss."""

    kind = "medusa"
    objective = KL  # the distillation term's objective (train.loss; lk.use_objective sets it)

    def __init__(self, target: Target, config: MedusaConfig | None = None) -> None:
        super().__init__()
        self.target = target  # a plain attribute: the frozen target is not part of this module
        target.lm_head.requires_grad_(False)
        self.config = cfg = (config or MedusaConfig()).resolved(target.num_layers, target.vocab_size)
        H, V = target.hidden_size, target.vocab_size
        with torch.device(target.device):
            zero_bias = cfg.residual_init == "identity"
            self.blocks = nn.ModuleList([ResBlocks(H, cfg.num_layers, zero_bias) for _ in range(cfg.num_heads)])
            if cfg.head == "copied":
                self.lm_heads = nn.ModuleList([nn.Linear(H, V, bias=False) for _ in range(cfg.num_heads)])
                with torch.no_grad():
                    for head in self.lm_heads:
                        head.weight.copy_(target.lm_head.weight)

    @property
    def dtype(self) -> torch.dtype:
        return self.blocks[0].layers[0].weight.dtype

    def feature_ids(self, num_layers: int | None = None) -> tuple[int, ...]:
        return self.config.feature_ids(num_layers or self.target.num_layers)

    def head_modules(self) -> list[nn.Linear]:
        """Each head's LM head: its own copy, or the target's (shared, frozen)."""
        if self.config.head == "copied":
            return list(self.lm_heads)
        return [self.target.lm_head] * self.config.num_heads

    def one_head(self, block: nn.Module, lm_head: nn.Linear, h: Tensor) -> Tensor:
        """One head's logits from target states. [.., H] -> [.., V]"""
        z = block(h.to(self.dtype))
        return lm_head(z.to(lm_head.weight.dtype))

    def head_logits(self, h: Tensor, heads: int | None = None) -> Tensor:
        """The first `heads` heads' logits (all by default) from target states h [.., H]. -> [K, .., V]"""
        return torch.stack(
            [self.one_head(block, lm_head, h) for block, lm_head in zip(self.blocks[:heads], self.head_modules())]
        )

    def forward(self, batch: dict, step: int = 0) -> tuple[Tensor, dict[str, float]]:
        """= loss(batch, step); call the module itself so DDP/accelerate wrappers see the forward."""
        return self.loss(batch, step)

    def loss(self, batch: dict, step: int = 0) -> tuple[Tensor, dict[str, float]]:
        """sum_k decay^k loss_k; head k at row t: CE vs x_{t+k+2}, or KL to the target's P_{t+k+1} (with
        train.loss=lk the LK loss against P_{t+k+1}; lk.use_objective refuses it with loss=ce)."""
        L = self.target.num_layers
        argmax = teacher_argmax(batch, self.target.lm_head, L)
        # Only rows with a loss go through the heads (in chat data 54% of a padded batch are prompt and
        # padding rows, which have none). Head k's prediction of P_t' (t' a trained row) comes from row t' - k - 1.
        b, t = next_valid(batch).nonzero(as_tuple=True)  # [M] each: the teacher rows
        h = batch["hidden"][L]
        heads, present = [], []
        for k, (block, lm_head) in enumerate(zip(self.blocks, self.head_modules())):
            src = t - (k + 1)
            present.append((src >= 0)[None])  # [1, M]
            heads.append(self.one_head(block, lm_head, h[b, src.clamp(min=0)])[None])  # [1, M, V]
        alphas = []
        if self.objective.lk:  # the acceptance rate against P_t' (drafters/trainable/lk.py)
            taught = gather_rows(batch, b, t, L)
            losses, alphas = lk_losses(heads, present, taught, self.target.lm_head, L, self.objective)
        elif self.config.loss == "ce":  # against the next token x_{t'+1}
            label = batch["input_ids"][b, t + 1][None]
            losses = [masked_mean(hard_ce(logits, label), v) for logits, v in zip(heads, present)]
        else:  # against P_t', built a chunk of rows at a time
            rows = distill_rows(heads, [0] * len(heads), gather_rows(batch, b, t, L), self.target.lm_head, L, "kl")
            losses = [masked_mean(per_row, v) for per_row, v in zip(rows, present)]
        want = argmax[b, t][None]
        accs = [masked_mean((logits.argmax(-1) == want).float(), v) for logits, v in zip(heads, present)]
        total = sum(w * lo for w, lo in zip(step_weights(len(losses), self.config.step_decay), losses))
        return total, {
            "loss": float(total.detach()),
            **loss_metrics("lk" if self.objective.lk else self.config.loss, losses),
            **loss_metrics("alpha", alphas),
            **loss_metrics("acc", accs),
        }

    def draft_logits(self, h: Tensor, heads: int) -> Tensor:
        """Decoding: the first `heads` heads' logits at one target state h [H]. -> [K, V]

        A shared head is applied as W @ z^T, which reads the 49k-row head once for all K rows; F.linear's
        gemm reads it once per row at so few rows (fp32, 1 thread, a 49,152 x 576 head: 19 vs 56 ms at K = 4).
        """
        if self.config.head == "copied":
            return self.head_logits(h, heads)
        w, bias = self.target.lm_head.weight, self.target.lm_head.bias
        z = torch.stack([block(h.to(self.dtype)) for block in self.blocks[:heads]])  # [K, H]
        logits = (w @ z.to(w.dtype).T).T
        return logits if bias is None else logits + bias

    @torch.no_grad()
    def position_accuracy(self, batch: dict, depth: int | None = None, topk: int = 1) -> list[float]:
        """Head k's top-k agreement with the target's argmax, conditional on heads < k being right."""
        L = self.target.num_layers
        argmax = teacher_argmax(batch, self.target.lm_head, L)
        valid = next_valid(batch)
        logits = self.head_logits(batch["hidden"][L], depth or None)
        correct = [in_topk(lg, ahead(argmax, k + 1, -1), topk) for k, lg in enumerate(logits)]
        return conditional_accuracy(correct, [ahead(valid, k + 1, False) for k in range(len(logits))])

    def drafter(self, name: str | None = None) -> MedusaDrafter:
        return MedusaDrafter(self.eval(), name or self.kind)


def capped_shape(shape: Shape, heads: int) -> Shape:
    """A shape no deeper than the number of heads (head k only knows depth k + 1)."""
    if shape.kind == "chain":
        return replace(shape, k=min(shape.k, heads))
    if shape.kind == "dynamic":
        return replace(shape, depth=min(shape.depth, heads))
    return replace(shape, choices=tuple(c for c in shape.choices if len(c) <= heads))


class MedusaDrafter:
    """Drafter protocol for a Medusa module: every head once per round at the newest target state."""

    def __init__(self, module: Medusa, name: str) -> None:
        self.m, self.name = module, name
        self.hidden_ids = (module.target.num_layers,)
        self.forward_passes = 0
        self.h: Tensor | None = None  # [H] the target state that produced the pending token

    def begin(self, prompt_ids: Tensor, step: TargetStep) -> None:
        self.accept(step)

    def accept(self, step: TargetStep) -> None:
        self.h = step.hidden[self.hidden_ids[0]][-1]

    @torch.no_grad()
    def propose(self, budget: Budget) -> DraftTree:
        shape = capped_shape(budget.shape, self.m.config.num_heads)
        if shape.max_depth == 0:
            return DraftTree.empty()
        # only the heads the shape reaches (a chain of 2 needs 2 of the 4)
        logp = torch.log_softmax(self.m.draft_logits(self.h, shape.max_depth), dim=-1, dtype=torch.float32)  # [K, V]
        self.forward_passes += 1
        depth: dict[int, int] = {-1: 0}  # tree node id (root = -1) -> depth

        def step(ids: list[int], tokens: list[int], parents: list[int]) -> Tensor:
            # a node's children come from the head one deeper, whatever the node's token was
            for i, p in zip(ids, parents):
                depth[i] = 0 if p == -2 else depth[p] + 1
            return logp[[depth[i] for i in ids]]

        return grow(step, 0, shape, sampler(budget))
