"""LayerSkip on a frozen target: trained early-exit heads, optionally with LoRA on the early layers (DESIGN §4).

The verifier stays the original model, so decoding stays lossless. Two modes:
- `exit_head`: per exit layer E a head = RMSNorm (initialised from the target's final norm) + an
  optional low-rank adapter (up-projection zero-init), then the frozen LM head. Untrained, exit E is
  exactly `early-exit:E`. Layers < E are untouched, so drafting runs them on the target's own KV
  cache and verification reuses that KV (drafters/early_exit.py, LayerReuse). Training reads the
  target's states at the exit ids from the batch; several exits train at once with LayerSkip's
  exit-loss scales and rotational/gradual curricula (drafters/losses.py).
- `lora`: peft LoRA on layers[:E] plus the exit head. The adapters are injected into the target's
  modules but are *off* except inside `adapters_on()` (drafting and training), so the target's own
  forward (prefill, verification, feature extraction) is the plain model. The adapted layers compute
  other KV than the target's, so the drafter keeps its own KV cache (no reuse). One LoRA drafter per
  target instance.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import Tensor, nn

from decode.target import Target
from drafters.common import LMDrafter
from drafters.draft_layer import RMSNorm, causal_padding_mask
from drafters.early_exit import early_exit
from drafters.losses import (
    ahead,
    conditional_accuracy,
    exit_curriculum,
    exit_loss_scales,
    hard_ce,
    in_topk,
    kl_to,
    layer_dropout_rates,
    masked_mean,
    next_valid,
    target_distribution,
)

ADAPTER = "draftsmith_layerskip"  # peft adapter name inside the target's modules
PEFT_PREFIX = "base_model.model."  # key prefix of a standard peft adapter directory


@dataclass
class LayerSkipConfig:
    """LayerSkip: mode, exits, exit heads, the exit loss and its curriculum, LoRA settings."""

    mode: str = "exit_head"  # exit_head | lora
    exits: tuple[int, ...] = ()  # exits trained (exit E runs layers [0, E)); () = 1..L-1 (exit_head), draft_exit (lora)
    draft_exit: int = 0  # exit used for drafting; 0 = max(1, L // 4)
    adapter_rank: int = 0  # low-rank adapter inside each exit head; 0 = RMSNorm only
    loss: str = "kl"  # kl (to the target's next-token distribution, self-distillation) | ce (token labels)
    scale: str = "sum"  # LayerSkip exit-loss scale: uniform | linear | sum | sqrt | inv | inv_sqrt
    curriculum: str = "none"  # none | rotational | gradual
    rotation_every: int = 2  # rotational: every n-th exit on, the pattern rolling one exit per step
    curriculum_steps: int = 1000  # gradual: the run length the schedule is spread over
    gradual_fraction: float = 0.5  # gradual: all exits on from this fraction of curriculum_steps
    lora_rank: int = 8  # lora mode: LoRA rank on layers[:draft_exit]
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    layer_dropout: float = 0.0  # lora mode: max rate of LayerSkip's layer dropout over layers[:draft_exit]
    eval_depth: int = 8  # draft positions `position_accuracy` reports by default

    def resolved(self, num_layers: int, vocab_size: int) -> LayerSkipConfig:
        """Defaults filled in for a target and checked (exits in 1..L-1, draft_exit among them)."""
        if self.mode not in ("exit_head", "lora"):
            raise ValueError(f"LayerSkip mode {self.mode!r} not one of ['exit_head', 'lora']")
        if self.loss not in ("ce", "kl"):
            raise ValueError(f"LayerSkip loss {self.loss!r} not one of ['ce', 'kl']")
        L = num_layers
        draft = self.draft_exit or max(1, L // 4)
        exits = tuple(sorted({int(e) for e in self.exits})) or (tuple(range(1, L)) if self.mode == "exit_head" else (draft,))
        bad = [e for e in (*exits, draft) if not 1 <= e < L]
        if bad:
            raise ValueError(f"LayerSkip exits {bad} out of range 1..{L - 1} for a {L}-layer target "
                             "(exit E runs layers [0, E))")
        if draft not in exits:
            raise ValueError(f"draft_exit {draft} is not among the trained exits {list(exits)}")
        if self.mode == "lora" and exits != (draft,):
            raise ValueError(f"lora mode trains one exit (draft_exit {draft}), got exits {list(exits)}")
        return replace(self, exits=exits, draft_exit=draft)

    def feature_ids(self, num_layers: int) -> tuple[int, ...]:
        """Hidden ids a training batch needs: the exit states (exit_head mode) and L for the target's P."""
        cfg = self.resolved(num_layers, 0)
        return tuple(sorted({*cfg.exits, num_layers})) if cfg.mode == "exit_head" else (num_layers,)


class ExitHead(nn.Module):
    """RMSNorm (+ z + up(down(z)), up zero-init) before the frozen LM head."""

    def __init__(self, norm_weight: Tensor, eps: float, rank: int) -> None:
        super().__init__()
        H = norm_weight.numel()
        self.norm = RMSNorm(H, eps)
        with torch.no_grad():
            self.norm.weight.copy_(norm_weight)
        if rank:
            self.down = nn.Linear(H, rank, bias=False)
            self.up = nn.Linear(rank, H, bias=False)
            nn.init.zeros_(self.up.weight)

    def forward(self, h: Tensor) -> Tensor:
        z = self.norm(h)
        return z + self.up(self.down(z)) if hasattr(self, "up") else z


class LayerSkip(nn.Module):
    """Exit heads (and LoRA adapters) on a frozen target; `module(batch, step)` is the training loss."""

    kind = "layerskip"

    def __init__(self, target: Target, config: LayerSkipConfig | None = None) -> None:
        super().__init__()
        self.target = target  # a plain attribute: the frozen target is not part of this module
        for piece in (target.embed_tokens, target.lm_head, target.norm, target.layers):
            piece.requires_grad_(False)
        self.config = cfg = (config or LayerSkipConfig()).resolved(target.num_layers, target.vocab_size)
        eps = float(getattr(target.config, "rms_norm_eps", 1e-6))
        with torch.device(target.device):
            self.exits = nn.ModuleDict({str(e): ExitHead(target.norm.weight.float(), eps, cfg.adapter_rank)
                                        for e in cfg.exits})
        self._lora_layers: list[nn.Module] = []
        if cfg.mode == "lora":
            self._inject_lora()

    # --- LoRA ----------------------------------------------------------------------------------

    def _inject_lora(self) -> None:
        """Inject peft LoRA into layers[:draft_exit] of the target, off by default; register its weights here."""
        from peft import LoraConfig, inject_adapter_in_model
        from peft.tuners.lora import LoraLayer

        model, cfg = self.target.model, self.config
        if getattr(model, "peft_config", None):
            raise ValueError("this target already carries peft adapters (another LoRA drafter?): "
                             "load a fresh target for each LayerSkip-LoRA drafter")
        self.lora_config = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                                      target_modules=list(cfg.lora_targets), layers_pattern="layers",
                                      layers_to_transform=list(range(cfg.draft_exit)))
        inject_adapter_in_model(self.lora_config, model, adapter_name=ADAPTER)
        found = [(n, m) for n, m in model.named_modules() if isinstance(m, LoraLayer)]
        if not found:
            raise ValueError(f"LoRA targets {list(cfg.lora_targets)} match no module in layers[:{cfg.draft_exit}]")
        self._lora_layers = [m for _, m in found]
        # registered here so optimizers, DDP and .train()/.to() see them; saved as a peft adapter dir
        self.lora = nn.ModuleDict({n.replace(".", "__"): nn.ModuleDict(
            {"A": m.lora_A[ADAPTER], "B": m.lora_B[ADAPTER], "dropout": m.lora_dropout[ADAPTER]}) for n, m in found})
        self._set_adapters(False)

    def _set_adapters(self, on: bool) -> None:
        # the flag peft's forward reads, set directly: peft's enable_adapters also flips requires_grad on the
        # adapter weights, which ZeRO-3's partitioned parameters refuse (and ours stay trainable throughout)
        for layer in self._lora_layers:
            layer._disable_adapters = not on
        for p in self.lora.parameters():
            if not p.requires_grad:
                p.requires_grad_(True)

    @contextmanager
    def adapters_on(self) -> Iterator[None]:
        """LoRA active in the target's early layers (no-op in exit_head mode); off again afterwards."""
        if not self._lora_layers:
            yield
            return
        self._set_adapters(True)
        try:
            yield
        finally:
            self._set_adapters(False)

    def save_adapter(self, out: Path, state: dict[str, torch.Tensor] | None = None) -> None:
        """A standard peft adapter directory (adapter_config.json + adapter_model.safetensors). `state`: this
        module's full state dict when its own tensors are shards (FSDP, ZeRO-3): the `lora.*` entries are
        written from it, since peft would read the local shards."""
        from peft import get_peft_model_state_dict
        from safetensors.torch import save_file

        out.mkdir(parents=True, exist_ok=True)
        self.lora_config.save_pretrained(str(out))
        if state is None:
            tensors = get_peft_model_state_dict(self.target.model, adapter_name=ADAPTER)
        else:  # lora.<module name, dots as __>.<A|B>.weight -> <module name>.lora_<A|B>.weight (peft's key)
            tensors = {}
            for k, v in state.items():
                if k.startswith("lora."):
                    name, ab, rest = k.removeprefix("lora.").split(".", 2)
                    tensors[f"{name.replace('__', '.')}.lora_{ab}.{rest}"] = v
        save_file({PEFT_PREFIX + k: v.detach().contiguous().cpu() for k, v in tensors.items()},
                  str(out / "adapter_model.safetensors"))

    def load_adapter(self, path: Path) -> None:
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        state = {k.removeprefix(PEFT_PREFIX): v for k, v in load_file(str(path / "adapter_model.safetensors")).items()}
        result = set_peft_model_state_dict(self.target.model, state, adapter_name=ADAPTER)
        expected = {k for k in self.target.model.state_dict() if f".{ADAPTER}." in k}
        if result.unexpected_keys or len(state) != len(expected):
            raise ValueError(f"{path}: adapter keys do not match this LoRA config "
                             f"({len(state)} saved, {len(expected)} expected; unexpected {result.unexpected_keys[:3]})")
        self._set_adapters(False)

    # --- forward pieces ----------------------------------------------------------------------------

    def feature_ids(self, num_layers: int | None = None) -> tuple[int, ...]:
        return self.config.feature_ids(num_layers or self.target.num_layers)

    def exit_logits(self, exit_id: int, h: Tensor) -> Tensor:
        """Exit head + frozen LM head on pre-norm layer-E states [.., H] -> logits [.., V]."""
        head = self.target.lm_head
        z = self.exits[str(exit_id)](h.to(self.exits[str(exit_id)].norm.weight.dtype))
        return head(z.to(head.weight.dtype))

    def early_states(self, batch: dict) -> Tensor:
        """lora mode: layers[:draft_exit] with adapters on (and layer dropout when training). -> [B, T, H]"""
        ids, am = batch["input_ids"], batch["attention_mask"]
        if bool((am[:, 1:] > am[:, :-1]).any()):
            raise ValueError("LayerSkip lora mode needs right-padded batches (attention_mask 1...1 0...0)")
        t, E = self.target, self.config.draft_exit
        skip = frozenset()
        if self.training and self.config.layer_dropout > 0:
            rates = torch.tensor(layer_dropout_rates(E, self.config.layer_dropout))
            skip = frozenset(torch.nonzero(torch.rand(E) < rates).view(-1).tolist())
        positions = torch.arange(ids.shape[1], device=t.device)
        with self.adapters_on():
            h, _ = t.run_layers(t.embed_tokens(ids.to(t.device)), 0, E, None, positions,
                                causal_padding_mask(am.to(t.device), t.dtype), skip=skip)
        return h

    def forward(self, batch: dict, step: int = 0) -> tuple[Tensor, dict[str, float]]:
        """= loss(batch, step); call the module itself so DDP/accelerate wrappers see the forward."""
        return self.loss(batch, step)

    def loss(self, batch: dict, step: int = 0) -> tuple[Tensor, dict[str, float]]:
        """Early-exit loss: sum over the exits the curriculum turns on of scale_E * loss_E (KL or CE)."""
        cfg, L = self.config, self.target.num_layers
        valid = next_valid(batch)
        probs, argmax = target_distribution(batch, self.target.lm_head, L)
        on = exit_curriculum(cfg.curriculum, step, len(cfg.exits), cfg.curriculum_steps, cfg.rotation_every,
                             cfg.gradual_fraction)
        scales = exit_loss_scales(cfg.exits, cfg.scale, on)
        total, metrics = 0.0, {}
        for e, scale, active in zip(cfg.exits, scales, on):
            if not active:
                continue
            h = self.early_states(batch) if cfg.mode == "lora" else batch["hidden"][e]
            logits = self.exit_logits(e, h)
            per_row = kl_to(logits, probs) if cfg.loss == "kl" else hard_ce(logits, ahead(batch["input_ids"], 1))
            loss_e = masked_mean(per_row, valid)
            total = total + scale * loss_e
            metrics[f"{cfg.loss}_exit{e}"] = float(loss_e.detach())
            metrics[f"acc_exit{e}"] = float(masked_mean((logits.argmax(-1) == argmax).float(), valid))
        return total, {"loss": float(total.detach()), **metrics}

    @torch.no_grad()
    def position_accuracy(self, batch: dict, depth: int | None = None, topk: int = 1) -> list[float]:
        """Chain accuracy of the draft exit per position 1..depth, conditional on earlier positions being right.

        Position k of a chain rooted at row t is the exit's prediction at row t+k-1 given the tokens
        before it, as when decoding. Exact when the batch's tokens are the target's greedy output
        (self-distilled data): then accepted drafts are exactly the batch's tokens.
        """
        cfg = self.config
        _, argmax = target_distribution(batch, self.target.lm_head, self.target.num_layers)
        h = self.early_states(batch) if cfg.mode == "lora" else batch["hidden"][cfg.draft_exit]
        correct = in_topk(self.exit_logits(cfg.draft_exit, h), argmax, topk)
        valid = next_valid(batch)
        depth = depth or cfg.eval_depth
        return conditional_accuracy([ahead(correct, k, False) for k in range(depth)],
                                    [ahead(valid, k, False) for k in range(depth)])

    def drafter(self, name: str | None = None):
        """exit_head: early exit at draft_exit with this head, reusing the target's KV; lora: own cache."""
        self.eval()
        name = name or f"{self.kind}:{self.config.draft_exit}"
        E = self.config.draft_exit
        if self.config.mode == "exit_head":
            return early_exit(self.target, E, reuse=True, head=lambda h: self.exit_logits(E, h), name=name)
        return lora_exit(self, name)


def lora_exit(module: LayerSkip, name: str) -> LMDrafter:
    """LayerSkip-LoRA drafting: layers[:E] with adapters on + the exit head, on the drafter's own KV cache."""
    t, E = module.target, module.config.draft_exit

    def run(ids: Tensor, positions: Tensor, mask: Tensor | None, cache) -> tuple[Tensor, Tensor]:
        with module.adapters_on():
            h, _ = t.run_layers(t.embed(ids), 0, E, cache, positions, mask)
        return module.exit_logits(E, h)[0], h[0]  # [T, V], [T, D]

    return LMDrafter(name, run, t.dtype, t.device, t.num_layers, shared=False)
