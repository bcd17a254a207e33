"""LayerSkip's settings: mode, exits, exit heads, the exit loss and its curriculum, LoRA (DESIGN §4)."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass
class LayerSkipConfig:
    """LayerSkip: mode, exits, exit heads, the exit loss and its curriculum, LoRA settings."""

    mode: str = "exit_head"  # exit_head | lora | full (a trainable copy of layers[:draft_exit])
    exits: tuple[int, ...] = ()  # exits trained (exit E runs layers [0, E)); () = 1..L-1 (exit_head), draft_exit (else)
    draft_exit: int = 0  # exit used for drafting; 0 = max(1, L // 4)
    adapter_rank: int = 0  # low-rank adapter inside each exit head; 0 = RMSNorm only
    loss: str = "kl"  # kl (to the target's next-token distribution, self-distillation) | ce (token labels)
    scale: str = "sum"  # LayerSkip exit-loss scale: uniform | linear | sum | sqrt | inv | inv_sqrt
    curriculum: str = "none"  # none | rotational | gradual
    rotation_every: int = 2  # rotational: every n-th exit on, the pattern rolling one exit per step
    curriculum_steps: int = 1000  # gradual: the run length the schedule is spread over
    gradual_fraction: float = 0.5  # gradual: all exits on from this fraction of curriculum_steps
    lora_rank: int = 8  # lora mode: LoRA rank on layers[:draft_exit]
    lora_layers: tuple[
        int, ...
    ] = ()  # lora mode: the layers adapted, each < draft_exit; () = all of layers[:draft_exit]
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    layer_dropout: float = 0.0  # lora/full mode: max rate of LayerSkip's layer dropout over layers[:draft_exit]
    eval_depth: int = 8  # draft positions `position_accuracy` reports by default

    def resolved(self, num_layers: int, vocab_size: int) -> LayerSkipConfig:
        """Defaults filled in for a target and checked (exits in 1..L-1, draft_exit among them)."""
        if self.mode not in ("exit_head", "lora", "full"):
            raise ValueError(f"LayerSkip mode {self.mode!r} not one of ['exit_head', 'lora', 'full']")
        if self.loss not in ("ce", "kl"):
            raise ValueError(f"LayerSkip loss {self.loss!r} not one of ['ce', 'kl']")
        L = num_layers
        draft = self.draft_exit or max(1, L // 4)
        exits = tuple(sorted({int(e) for e in self.exits})) or (
            tuple(range(1, L)) if self.mode == "exit_head" else (draft,)
        )
        bad = [e for e in (*exits, draft) if not 1 <= e < L]
        if bad:
            raise ValueError(
                f"LayerSkip exits {bad} out of range 1..{L - 1} for a {L}-layer target (exit E runs layers [0, E))"
            )
        if draft not in exits:
            raise ValueError(f"draft_exit {draft} is not among the trained exits {list(exits)}")
        if self.mode != "exit_head" and exits != (draft,):
            raise ValueError(f"{self.mode} mode trains one exit (draft_exit {draft}), got exits {list(exits)}")
        if self.lora_rank < 1 or self.adapter_rank < 0:
            raise ValueError(f"lora_rank must be >= 1 and adapter_rank >= 0, got {self.lora_rank}, {self.adapter_rank}")
        layers = tuple(sorted({int(i) for i in self.lora_layers}))
        if any(not 0 <= i < draft for i in layers):
            raise ValueError(
                f"lora_layers {list(self.lora_layers)} must lie in 0..{draft - 1} (the layers below draft_exit {draft})"
            )
        return replace(self, exits=exits, draft_exit=draft, lora_layers=layers)

    def feature_ids(self, num_layers: int) -> tuple[int, ...]:
        """Hidden ids a training batch needs: the exit states (exit_head mode) and L for the target's P."""
        cfg = self.resolved(num_layers, 0)
        return tuple(sorted({*cfg.exits, num_layers})) if cfg.mode == "exit_head" else (num_layers,)
