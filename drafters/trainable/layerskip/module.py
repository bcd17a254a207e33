"""LayerSkip on a frozen target: trained early-exit heads, optionally with LoRA on the early layers or a trained
copy of them (DESIGN §4).

The verifier stays the original model, so decoding stays lossless. Three modes:
- `exit_head`: per exit layer E a head = RMSNorm (initialised from the target's final norm) + an
  optional low-rank adapter (up-projection zero-init), then the frozen LM head. Untrained, exit E is
  exactly `early-exit:E`. Layers < E are untouched, so drafting runs them on the target's own KV
  cache and verification reuses that KV (drafters/sources/early_exit.py, LayerReuse). Training reads the
  target's states at the exit ids from the batch; several exits train at once with LayerSkip's
  exit-loss scales and rotational/gradual curricula (objective.py).
- `lora`: peft LoRA on layers[:E] plus the exit head. The adapters are injected into the target's
  modules but are *off* except inside `adapters_on()` (drafting and training; lora.py), so the target's own
  forward (prefill, verification, feature extraction) is the plain model. The adapted layers compute
  other KV than the target's, so the drafter keeps its own KV cache (no reuse). One LoRA drafter per
  target instance.
- `full`: a trainable copy of layers[:E] plus the exit head (early.py): the LayerSkip paper's trained early
  layers, kept apart from the frozen target; its own KV cache like `lora`; the copy is in the checkpoint.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import torch
from torch import Tensor, nn

from decode.target import Target
from drafters.common import LMDrafter
from drafters.sources.early_exit import early_exit
from drafters.trainable.layerskip.config import LayerSkipConfig
from drafters.trainable.layerskip.early import copy_layers, early_states
from drafters.trainable.layerskip.heads import ExitHead, exit_logits
from drafters.trainable.layerskip.lora import LoraAdapters
from drafters.trainable.layerskip.objective import chain_accuracy, exit_loss
from drafters.trainable.lk import KL


class LayerSkip(nn.Module):
    """Exit heads (and LoRA adapters or copied early layers) on a frozen target; `module(batch, step)` is the
    training loss."""

    kind = "layerskip"
    objective = KL  # the exit loss's objective (train.loss; lk.use_objective sets it)

    def __init__(self, target: Target, config: LayerSkipConfig | None = None) -> None:
        super().__init__()
        self.target = target  # a plain attribute: the frozen target is not part of this module
        for piece in (target.embed_tokens, target.lm_head, target.norm, target.layers):
            piece.requires_grad_(False)
        self.config = cfg = (config or LayerSkipConfig()).resolved(target.num_layers, target.vocab_size)
        eps = float(getattr(target.config, "rms_norm_eps", 1e-6))
        with torch.device(target.device):
            self.exits = nn.ModuleDict(
                {str(e): ExitHead(target.norm.weight.float(), eps, cfg.adapter_rank) for e in cfg.exits}
            )
        self.adapters, self.early = None, None
        if cfg.mode == "full":
            self.early = copy_layers(target, cfg.draft_exit)
        if cfg.mode == "lora":
            self.adapters = LoraAdapters(
                target.model,
                cfg.draft_exit,
                cfg.lora_rank,
                cfg.lora_alpha,
                cfg.lora_dropout,
                cfg.lora_targets,
                cfg.lora_layers,
            )
            self.lora = self.adapters.modules  # registered here so optimizers, DDP and .train()/.to() see them

    def adapters_on(self) -> AbstractContextManager[None]:
        """LoRA active in the target's early layers (no-op in exit_head mode); off again afterwards."""
        return self.adapters.on() if self.adapters is not None else nullcontext()

    def save_adapter(self, out: Path, state: dict[str, torch.Tensor] | None = None) -> None:
        self.adapters.save(out, state)

    def load_adapter(self, path: Path) -> None:
        self.adapters.load(path)

    def feature_ids(self, num_layers: int | None = None) -> tuple[int, ...]:
        return self.config.feature_ids(num_layers or self.target.num_layers)

    def exit_logits(self, exit_id: int, h: Tensor) -> Tensor:
        """Exit head + frozen LM head on pre-norm layer-E states [.., H] -> logits [.., V]."""
        return exit_logits(self.exits[str(exit_id)], self.target.lm_head, h)

    def exit_states(self, batch: dict, exit_id: int) -> Tensor:
        """Layer-E states [B, T, H]: the batch's (exit_head mode), the adapted layers' (lora mode) or the copied
        layers' (full mode); the last two with layer dropout while training."""
        dropout = self.config.layer_dropout if self.training else 0.0
        if self.early is not None:
            return early_states(self.target, batch, exit_id, dropout, layers=self.early)
        if self.adapters is None:
            return batch["hidden"][exit_id]
        return self.adapters.early_states(self.target, batch, dropout)

    def forward(self, batch: dict, step: int = 0) -> tuple[Tensor, dict[str, float]]:
        """= loss(batch, step); call the module itself so DDP/accelerate wrappers see the forward."""
        return self.loss(batch, step)

    def loss(self, batch: dict, step: int = 0) -> tuple[Tensor, dict[str, float]]:
        """Early-exit loss over the exits the curriculum turns on (objective.exit_loss)."""
        t = self.target
        return exit_loss(
            self.config, batch, step, t.lm_head, t.num_layers, self.exit_logits, self.exit_states, self.objective
        )

    @torch.no_grad()
    def position_accuracy(self, batch: dict, depth: int | None = None, topk: int = 1) -> list[float]:
        """The draft exit's chain accuracy per position 1..depth (objective.chain_accuracy)."""
        t = self.target
        return chain_accuracy(
            self.config,
            batch,
            depth or self.config.eval_depth,
            topk,
            t.lm_head,
            t.num_layers,
            self.exit_logits,
            self.exit_states,
        )

    def drafter(self, name: str | None = None):
        """exit_head: early exit at draft_exit with this head, reusing the target's KV; lora, full: own cache."""
        self.eval()
        name = name or f"{self.kind}:{self.config.draft_exit}"
        E = self.config.draft_exit
        if self.config.mode == "exit_head":
            return early_exit(self.target, E, reuse=True, head=lambda h: self.exit_logits(E, h), name=name)
        return own_layers_exit(self, name)


def own_layers_exit(module: LayerSkip, name: str) -> LMDrafter:
    """LayerSkip-LoRA / -full drafting: layers[:E] with the adapters on (or the copied layers) + the exit head,
    on the drafter's own KV cache."""
    t, E, layers = module.target, module.config.draft_exit, module.early
    dtype = t.dtype if layers is None else next(layers.parameters()).dtype  # full: the copy's (decoding casts it)

    def run(ids: Tensor, positions: Tensor, mask: Tensor | None, cache) -> tuple[Tensor, Tensor]:
        with module.adapters_on():
            h, _ = t.run_layers(
                t.embed(ids).to(dtype), 0, E, cache, positions, None if mask is None else mask.to(dtype), layers=layers
            )
        return module.exit_logits(E, h)[0], h[0]  # [T, V], [T, D]

    return LMDrafter(name, run, t.dtype, t.device, t.num_layers, shared=False)
