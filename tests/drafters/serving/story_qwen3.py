"""A tiny random Qwen3 target vLLM's CPU build can run (head_dim 32 >= its minimum; stories260K's is 8),
with the bundled stories260K tokenizer and vocabulary (512), so the tiny recipes train on it with `target=DIR`.

    python -m tests.drafters.serving.story_qwen3 OUT_DIR
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch

STORIES = Path(__file__).resolve().parents[3] / "recipes" / "targets" / "stories260K"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json")


def make_story_qwen3(out: str | Path, layers: int = 10, hidden: int = 128, seed: int = 0) -> Path:
    """Save a random Qwen3 (hidden 128, 4 heads of 32, 2 kv heads, 10 layers, vocab 512) with the stories tokenizer."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=512,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    out = Path(out)
    Qwen3ForCausalLM(cfg).eval().save_pretrained(out)
    for f in TOKENIZER_FILES:
        shutil.copy2(STORIES / f, out / f)
    return out


if __name__ == "__main__":
    print(make_story_qwen3(sys.argv[1]))
