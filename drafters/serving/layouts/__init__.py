"""Serving-engine layouts of a trained drafter (DESIGN §5): one file per engine layout (sglang_eagle3.py,
speculators.py, medusa_vllm.py), the decoder layer both EAGLE-3 layouts carry (eagle3_layer.py), the rules
they share (rules.py), and the formats by name (formats.py)."""
