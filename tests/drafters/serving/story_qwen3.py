"""A tiny random Qwen3 target vLLM's CPU build can run (head_dim 32 >= its minimum; stories260K's is 8),
with the bundled stories260K tokenizer and vocabulary (512), so the tiny recipes train on it with `target=DIR`.
A trained one of the same shape is bundled: recipes/targets/stories-qwen3 (scripts/distill_story_qwen3.py).

    python -m tests.drafters.serving.story_qwen3 OUT_DIR
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch

from scripts.distill_story_qwen3 import STORIES, TOKENIZER_FILES, story_qwen3_config


def make_story_qwen3(out: str | Path, layers: int = 10, hidden: int = 128, seed: int = 0) -> Path:
    """Save a random Qwen3 (hidden 128, 4 heads of 32, 2 kv heads, 10 layers, vocab 512) with the stories tokenizer."""
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = story_qwen3_config(layers, hidden)  # the bundled stories-qwen3's shape, untrained
    out = Path(out)
    Qwen3ForCausalLM(cfg).eval().save_pretrained(out)
    for f in TOKENIZER_FILES:
        shutil.copy2(STORIES / f, out / f)
    return out


if __name__ == "__main__":
    print(make_story_qwen3(sys.argv[1]))
