"""LayerSkip's LoRA wiring (mode `lora`): peft LoRA injected into the target's layers[:E], *off* except
inside `on()` (drafting and training), so the target's own forward (prefill, verification, feature
extraction) is the plain model. Saved as a standard peft adapter directory. One LoRA drafter per target."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from torch import Tensor, nn

from decode.target import Target
from drafters.trainable.layerskip.early import early_states

ADAPTER = "draftsmith_layerskip"  # peft adapter name inside the target's modules
PEFT_PREFIX = "base_model.model."  # key prefix of a standard peft adapter directory


class LoraAdapters:
    """The adapters in a target model's first `layers` layers (or only those in `only`); `modules` holds
    their weights for registering."""

    def __init__(
        self,
        model: nn.Module,
        layers: int,
        rank: int,
        alpha: int,
        dropout: float,
        targets: tuple[str, ...],
        only: tuple[int, ...] = (),
    ) -> None:
        from peft import LoraConfig, inject_adapter_in_model
        from peft.tuners.lora import LoraLayer

        if getattr(model, "peft_config", None):
            raise ValueError(
                "this target already carries peft adapters (another LoRA drafter?): "
                "load a fresh target for each LayerSkip-LoRA drafter"
            )
        self.model, self.n_layers = model, layers
        self.config = LoraConfig(
            r=rank,
            lora_alpha=alpha,
            lora_dropout=dropout,
            target_modules=list(targets),
            layers_pattern="layers",
            layers_to_transform=list(only or range(layers)),
        )
        inject_adapter_in_model(self.config, model, adapter_name=ADAPTER)
        found = [(n, m) for n, m in model.named_modules() if isinstance(m, LoraLayer)]
        if not found:
            raise ValueError(f"LoRA targets {list(targets)} match no module in layers[:{layers}]")
        self.layers = [m for _, m in found]
        self.modules = nn.ModuleDict(
            {
                n.replace(".", "__"): nn.ModuleDict(
                    {"A": m.lora_A[ADAPTER], "B": m.lora_B[ADAPTER], "dropout": m.lora_dropout[ADAPTER]}
                )
                for n, m in found
            }
        )
        self.set(False)

    def set(self, on: bool) -> None:
        # the flag peft's forward reads, set directly: peft's enable_adapters also flips requires_grad on the
        # adapter weights, which ZeRO-3's partitioned parameters refuse (and ours stay trainable throughout)
        for layer in self.layers:
            layer._disable_adapters = not on
        for p in self.modules.parameters():
            if not p.requires_grad:
                p.requires_grad_(True)

    @contextmanager
    def on(self) -> Iterator[None]:
        """LoRA active in the target's early layers; off again afterwards."""
        self.set(True)
        try:
            yield
        finally:
            self.set(False)

    def early_states(self, target: Target, batch: dict, layer_dropout: float) -> Tensor:
        """The target's layers[:E] with the adapters on over a right-padded batch (early.early_states). -> [B, T, H]"""
        with self.on():
            return early_states(target, batch, self.n_layers, layer_dropout)

    def save(self, out: Path, state: dict[str, Tensor] | None = None) -> None:
        """A standard peft adapter directory (adapter_config.json + adapter_model.safetensors). `state`: the
        drafter's full state dict when its own tensors are shards (FSDP, ZeRO-3): the `lora.*` entries are
        written from it, since peft would read the local shards."""
        from peft import get_peft_model_state_dict
        from safetensors.torch import save_file

        out.mkdir(parents=True, exist_ok=True)
        self.config.save_pretrained(str(out))
        if state is None:
            tensors = get_peft_model_state_dict(self.model, adapter_name=ADAPTER)
        else:  # lora.<module name, dots as __>.<A|B>.weight -> <module name>.lora_<A|B>.weight (peft's key)
            tensors = {}
            for k, v in state.items():
                if k.startswith("lora."):
                    name, ab, rest = k.removeprefix("lora.").split(".", 2)
                    tensors[f"{name.replace('__', '.')}.lora_{ab}.{rest}"] = v
        save_file(
            {PEFT_PREFIX + k: v.detach().contiguous().cpu() for k, v in tensors.items()},
            str(out / "adapter_model.safetensors"),
        )

    def load(self, path: Path) -> None:
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        state = {k.removeprefix(PEFT_PREFIX): v for k, v in load_file(str(path / "adapter_model.safetensors")).items()}
        result = set_peft_model_state_dict(self.model, state, adapter_name=ADAPTER)
        expected = {k for k in self.model.state_dict() if f".{ADAPTER}." in k}
        if result.unexpected_keys or len(state) != len(expected):
            raise ValueError(
                f"{path}: adapter keys do not match this LoRA config "
                f"({len(state)} saved, {len(expected)} expected; unexpected {result.unexpected_keys[:3]})"
            )
        self.set(False)
