"""scripts/distill_story_qwen3.py: a few steps write a whole Qwen3 target directory (weights, the stories
tokenizer, a model card with its held-out figures) that loads as a target; an occupied --out is refused."""

from __future__ import annotations

import json

import pytest

from decode.target import Target
from scripts.distill_story_qwen3 import main


def test_a_short_distillation_writes_a_loadable_qwen3_target(tmp_path):
    out = tmp_path / "sq3"
    argv = ["--out", str(out), "--layers", "2", "--samples", "16", "--held-out", "8", "--length", "24"]
    assert main(argv + ["--steps", "3", "--batch-size", "4", "--eval-every", "2", "--threads", "1"]) == 0
    target = Target.load(out)
    assert target.config.model_type == "qwen3" and target.num_layers == 2 and target.vocab_size == 512
    assert target.tokenizer is not None and target.tokenizer.decode(target.tokenizer.encode("Once upon")) != ""
    card = (out / "README.md").read_text()
    made = json.loads((out / "distill.json").read_text())
    assert "--steps 3" in card and f"KL {made['held_out_kl']:.4f}" in card and "out" not in made["args"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".stories-qwen3-")]  # no temporary left
    with pytest.raises(SystemExit, match="exists and is not empty"):
        main(argv)
