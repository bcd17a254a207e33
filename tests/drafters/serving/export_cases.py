"""Helpers for the export tests (test_export*.py): a tiny saved target, a finished run directory, the drafts a
drafter makes for a fixed prompt, and the Qwen3-14B facts the golden layouts are checked against."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from decode.generate import generate
from decode.target import Target
from decode.tree import Shape
from drafters.serving.checkpoint import save_drafter
from drafters.serving.layouts.rules import TargetFacts
from tests.conftest import tiny_model
from tests.drafters.batches import record_rounds
from tests.drafters.trainable.test_eagle import QWEN3_14B

PROMPT = torch.tensor([1, 5, 9, 33, 17, 4, 60])
SHAPES = (Shape("chain", k=3), Shape("dynamic", topk=3, depth=3, nodes=8))


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    """A tiny random Qwen3 target saved as a model directory (exports read its config and LM head)."""
    out = tmp_path_factory.mktemp("target")
    tiny_model("qwen3", seed=3).save_pretrained(out)
    return out


def run_dir(tmp: Path, module, target_dir: Path) -> Path:
    save_drafter(module, tmp / "run" / "export", target_id=str(target_dir))
    return tmp / "run"


def drafts(drafter, target: Target) -> list:
    """Every round's tree (tokens, parents) and the output, for each draft shape."""
    out = []
    for shape in SHAPES:
        rounds = record_rounds(drafter)
        tokens = generate(target, drafter, PROMPT, 12, shape=shape).tokens
        out.append(([(t.tokens.tolist(), t.parents.tolist()) for t in rounds], tokens))
        del drafter.propose  # unwrap record_rounds for the next shape
    return out


def qwen3_14b_facts() -> TargetFacts:
    return TargetFacts.of(json.loads(QWEN3_14B.read_text()), "Qwen/Qwen3-14B")
