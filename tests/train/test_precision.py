"""`auto` precision for training: the frozen target and the drafter's autocast follow decode.precision.resolve_dtype
(bf16 where the hardware has it and the model is big enough to gain), and the run says what it chose."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import decode.precision
from train.config import load_recipe
from train.features import resolve_precision

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def cpu(monkeypatch):
    """Set this machine's CPU flags for the test."""

    def set_flags(*flags: str) -> None:
        monkeypatch.setattr(decode.precision, "cpu_flags", lambda: set(flags))  # the one rule reads them there

    return set_flags


def recipe_for(tmp_path: Path, target: Path, *overrides: str):
    p = tmp_path / "r.yaml"
    p.write_text(f"target: {target}\n")
    return load_recipe(p, list(overrides))


@pytest.fixture
def chat_sized(tmp_path) -> Path:
    """A directory with SmolLM2-135M's config.json (135M parameters: big enough for bf16)."""
    d = tmp_path / "smollm2"
    d.mkdir()
    shutil.copy(REPO / "tests/data/smollm2-135m-config.json", d / "config.json")
    return d


def test_auto_is_bf16_for_a_big_model_on_bf16_hardware(tmp_path, cpu, chat_sized):
    cpu("avx2", "avx512_bf16")
    r, line = resolve_precision(recipe_for(tmp_path, chat_sized))
    assert (r.features.target_dtype, r.train.mixed_precision) == ("bfloat16", "bf16")
    assert line == "precision: bf16 (cpu has avx512_bf16)"
    cpu("avx2")
    r, line = resolve_precision(recipe_for(tmp_path, chat_sized))
    assert (r.features.target_dtype, r.train.mixed_precision) == ("float32", "no")
    assert line == "precision: fp32 (no bf16 in hardware)"


def test_auto_keeps_a_tiny_model_in_fp32_and_requests_win(tmp_path, cpu, chat_sized):
    cpu("avx512_bf16", "amx_bf16")
    r, line = resolve_precision(recipe_for(tmp_path, REPO / "recipes/targets/stories260K"))
    assert (r.features.target_dtype, r.train.mixed_precision) == ("float32", "no")
    assert line == "precision: fp32 (bf16 in hardware, but fp32 is faster for a model under 16M parameters)"
    r, line = resolve_precision(recipe_for(tmp_path, chat_sized, "features.target_dtype=float32"))
    assert (r.features.target_dtype, r.train.mixed_precision) == ("float32", "bf16")
    assert line == "precision: target fp32 (requested), drafter bf16 (cpu has amx_bf16)"


@pytest.mark.parametrize("kind", ["eagle3", "eagle1", "medusa", "layerskip", "dflash", "dspark"])
def test_each_drafter_trains_under_bf16_autocast_on_a_bf16_target(kind):
    """What `precision: bf16` runs: a bf16 frozen target, the drafter's step under bf16 autocast — a finite
    loss, fp32 weights and gradients, and a loss within bf16's reach of the all-fp32 one."""
    import torch

    from decode.target import Target
    from drafters.serving.checkpoint import drafter_kinds
    from tests.drafters.batches import make_batch, random_sequences

    cls, config = drafter_kinds()[kind]
    losses = {}
    for dtype in ("float32", "bfloat16"):
        target = Target.load(REPO / "recipes/targets/stories260K", dtype=dtype)
        torch.manual_seed(0)
        m = cls(target, config()).train()
        batch = make_batch(target, random_sequences(target, 2, 24), m.feature_ids())
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
            loss, _ = m(batch, 0)
        loss.backward()
        trained = [p for p in m.parameters() if p.requires_grad]
        assert torch.isfinite(loss) and {p.dtype for p in trained} == {torch.float32}
        assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in trained)
        losses[dtype] = float(loss)
    assert losses["bfloat16"] == pytest.approx(losses["float32"], rel=0.05)
