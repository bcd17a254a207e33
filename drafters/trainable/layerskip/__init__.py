"""LayerSkip on a frozen target (DESIGN §4): the module (module.py) with its exit heads (heads.py), its LoRA
wiring (lora.py), its own early layers (early.py), its exit loss and curriculum (objective.py), and its config (config.py)."""

from drafters.trainable.layerskip.config import LayerSkipConfig
from drafters.trainable.layerskip.module import LayerSkip, own_layers_exit

__all__ = ["LayerSkip", "LayerSkipConfig", "own_layers_exit"]
