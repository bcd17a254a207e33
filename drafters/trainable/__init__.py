"""The trainable drafters (EAGLE-1/3, Medusa, LayerSkip) on a frozen target: their modules, their training
objectives (losses.py) and the drafters that decode with them."""
