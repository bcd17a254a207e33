"""The optimizers of a run: AdamW, or Muon for the drafter's weight matrices and AdamW for the rest.

`train.optimizer: muon` follows the usual Muon practice (Keller Jordan's Muon, speculators): Muon
orthogonalises the updates of 2-D weight matrices only; biases, norms, vectors and the vocabulary
matrices (embeddings, LM heads: their rows are per-token, not a linear map to orthogonalise) stay
on AdamW. Muon runs with `adjust_lr_fn="match_rms_adamw"` (Moonshot's "Muon is Scalable"), which scales
its update to AdamW's RMS, so both optimizers take the same `train.lr`, `train.weight_decay` and the
same schedule: the loop steps one LambdaLR per optimizer, each with the same lr factor.

Parameters that do not require grad (a frozen EAGLE-3 head, the frozen target) are in no optimizer.

Muon's Newton-Schulz iteration runs in bf16 in torch; on a device without bf16 arithmetic (a CPU with AVX2
only) bf16 matmuls are emulated, and there it took most of an EAGLE-3 step on the chat target (34 s a step with
torch's Muon, ~10 s with this one). `Muon` below is torch's optimizer with the iteration in fp32 on such devices (bf16 elsewhere: the same
update as torch.optim.Muon, bit for bit).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim._muon import _adjust_lr

from decode.precision import has_bf16
from train.config import TrainConfig

# 2-D parameters that stay on AdamW: vocabulary matrices (per-token rows), by parameter name
ADAMW_MATRIX_NAMES = ("lm_head", "embed")
# distributed types whose optimizer handling (one DeepSpeed engine optimizer, FSDP's sharded DTensors)
# this two-optimizer setup is not tested with
MUON_UNSUPPORTED = ("DEEPSPEED", "FSDP", "MEGATRON_LM", "XLA")


def muon_split(named: Iterable[tuple[str, nn.Parameter]]) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(Muon's parameters, AdamW's): Muon takes the trainable 2-D matrices (both dims > 1) that are not
    embeddings or LM heads; AdamW everything else that trains."""
    muon, adamw = [], []
    for name, p in named:
        if not p.requires_grad:
            continue
        matrix = p.ndim == 2 and min(p.shape) > 1 and not any(s in name for s in ADAMW_MATRIX_NAMES)
        (muon if matrix else adamw).append(p)
    return muon, adamw


def newton_schulz(
    update: Tensor, coefficients: tuple[float, float, float], steps: int, eps: float, dtype: torch.dtype
) -> Tensor:
    """Muon's orthogonalisation of an update [m, n], torch.optim.Muon's quintic iteration computed in `dtype`:
    1. scale to spectral norm <= 1 (by the Frobenius norm); 2. `steps` times X <- aX + (bA + cA^2)X with A = XX^T
    (on the wide orientation, so A is the smaller Gram matrix)."""
    a, b, c = coefficients
    x = update.to(dtype)
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


class Muon(torch.optim.Muon):
    """torch.optim.Muon (its arguments, state and checkpoints) with the Newton-Schulz iteration in `ns_dtype`."""

    def __init__(self, params, ns_dtype: torch.dtype = torch.bfloat16, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure=None):
        """torch.optim.Muon's step: Nesterov momentum, the orthogonalised update, decoupled weight decay."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params: list[Tensor] = []
            grads: list[Tensor] = []
            bufs: list[Tensor] = []
            self._init_group(group, params, grads, bufs)
            lr, momentum = group["lr"], group["momentum"]
            for p, g, buf in zip(params, grads, bufs):
                buf.lerp_(g, 1 - momentum)
                update = g.lerp(buf, momentum) if group["nesterov"] else buf
                update = newton_schulz(update, group["ns_coefficients"], group["ns_steps"], group["eps"], self.ns_dtype)
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(update, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], p.shape))
        return loss


def make_optimizers(drafter: nn.Module, cfg: TrainConfig, distributed_type: str = "NO") -> list[torch.optim.Optimizer]:
    """The run's optimizers over the drafter's trainable parameters: [AdamW] or [Muon, AdamW] (either may be
    absent when it has no parameters). distributed_type: accelerate's (`acc.distributed_type.value`)."""
    named = [(n, p) for n, p in drafter.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError("the drafter has no trainable parameters")

    def adamw(params: Sequence[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay)

    if cfg.optimizer == "adamw":
        return [adamw([p for _, p in named])]
    if cfg.optimizer != "muon":
        raise ValueError(f"train.optimizer {cfg.optimizer!r} not one of ['adamw', 'muon']")
    if distributed_type in MUON_UNSUPPORTED:
        raise ValueError(
            f"train.optimizer=muon is supported on one process and DDP, not {distributed_type}: "
            "use train.optimizer=adamw there"
        )
    muon, rest = muon_split(named)
    opts: list[torch.optim.Optimizer] = []
    if muon:
        ns_dtype = torch.bfloat16 if has_bf16(muon[0].device) else torch.float32
        opts.append(
            Muon(muon, ns_dtype=ns_dtype, lr=cfg.lr, weight_decay=cfg.weight_decay, adjust_lr_fn="match_rms_adamw")
        )
    if rest:
        opts.append(adamw(rest))
    return opts


class Chain:
    """Several optimizers (or lr schedulers) driven as one: the loop's `opt.step()`, `opt.zero_grad()`,
    `sched.step()` and `sched.get_last_lr()` reach each of them, in order."""

    def __init__(self, items: Sequence[Any]) -> None:
        self.items = list(items)

    def step(self) -> None:
        for x in self.items:
            x.step()

    def zero_grad(self) -> None:
        for x in self.items:
            x.zero_grad()

    def get_last_lr(self) -> list[float]:
        return [lr for x in self.items for lr in x.get_last_lr()]
