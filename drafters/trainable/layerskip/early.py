"""LayerSkip's own early layers (modes `lora` and `full`): the layer-E states of a training batch, and mode
`full`'s trainable copy of the target's layers[:E].

Mode `full` is the LayerSkip paper's setting (the early layers themselves trained for the exit) on a frozen
target: the copy starts equal to the target's layers, so the untrained drafter is exactly `early-exit:E`;
verification keeps the target's own layers, so decoding stays lossless. Like LoRA, the copy computes other
KV than the target's, so the drafter keeps its own KV cache.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from decode.target import Target
from drafters.trainable.draft_layer import causal_padding_mask
from drafters.trainable.layerskip.schedules import layer_dropout_rates


def copy_layers(target: Target, n: int) -> nn.ModuleList:
    """Trainable fp32 copies of the target's layers[:n] (decoding casts them to the target's dtype)."""
    if any(p.numel() == 0 for p in target.layers[:n].parameters()):
        raise ValueError(
            "the target's layers are partitioned (ZeRO-3/FSDP): LayerSkip mode full copies them "
            "whole; train it with DDP or ZeRO-1/2, or use mode lora"
        )
    layers = nn.ModuleList(without_lora(copy.deepcopy(target.layers[i])) for i in range(n)).float()
    return layers.requires_grad_(True)


def without_lora(layer: nn.Module) -> nn.Module:
    """`layer` with any peft LoRA wrapper replaced by the module it wraps: a LoRA LayerSkip drafter loaded
    earlier on the same target (a benchmark comparing the two modes) leaves its wrappers in the target's
    layers, and a copy must hold the plain weights only."""
    for name, module in list(layer.named_modules()):
        base = getattr(module, "base_layer", None)
        if name and isinstance(base, nn.Module):
            parent, _, child = name.rpartition(".")
            setattr(layer.get_submodule(parent) if parent else layer, child, base)
    return layer


def early_states(
    target: Target, batch: dict, n: int, layer_dropout: float, layers: nn.ModuleList | None = None
) -> Tensor:
    """Layers[:n] (the target's, or `layers` in their place) over a right-padded batch, each skipped at
    LayerSkip's layer-dropout rate for its depth (max `layer_dropout`; 0 = none). -> [B, T, H]"""
    ids, am = batch["input_ids"], batch["attention_mask"]
    if bool((am[:, 1:] > am[:, :-1]).any()):
        raise ValueError(
            f"LayerSkip {'full' if layers is not None else 'lora'} mode needs right-padded batches "
            "(attention_mask 1...1 0...0)"
        )
    skip = frozenset()
    if layer_dropout > 0:
        rates = torch.tensor(layer_dropout_rates(n, layer_dropout))
        skip = frozenset(torch.nonzero(torch.rand(n) < rates).view(-1).tolist())
    positions = torch.arange(ids.shape[1], device=target.device)
    h = target.embed_tokens(ids.to(target.device))
    dtype = h.dtype if layers is None else next(layers.parameters()).dtype
    h, _ = target.run_layers(
        h.to(dtype), 0, n, None, positions, causal_padding_mask(am.to(target.device), dtype), skip=skip, layers=layers
    )
    return h
