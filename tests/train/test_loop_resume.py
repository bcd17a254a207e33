"""The training loop's checkpoints: a run killed after a checkpoint resumes exactly; a non-finite loss stops
the run and keeps the last checkpoint, with no export."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.train import loop_runs
from tests.train.loop_runs import crash_at, recipe_overrides, run
from train.checkpoints import checkpoints
from train.loop import NonFiniteLoss

regen = loop_runs.regen  # the module-scoped fixture: regenerated stories shared by the runs of this file


def test_resume_continues_exactly(tmp_path, regen, monkeypatch):
    full = run(tmp_path / "a", recipe_overrides(regen, tmp_path / "a/run", "medusa", steps=6, save_every=2))
    # the same run killed after step 4's checkpoint, then resumed
    crash_at(monkeypatch, 4)
    ov = recipe_overrides(regen, tmp_path / "b/run", "medusa", steps=6, save_every=2)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "b", ov)
    assert [p.name for p in checkpoints(tmp_path / "b/run")] == ["step_2", "step_4"]
    monkeypatch.undo()  # the crash hook off: resume
    resumed = run(tmp_path / "b", ov)
    a, b = load_file(str(full / "export/model.safetensors")), load_file(str(resumed / "export/model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=1e-5)


def test_non_finite_loss_stops_and_keeps_last_checkpoint(tmp_path, regen, monkeypatch):
    from train import loop

    real = loop.LossModule.forward

    def nan_at_3(self, batch, step):
        loss, m = real(self, batch, step)
        return (loss * float("nan") if step == 3 else loss), m

    monkeypatch.setattr(loop.LossModule, "forward", nan_at_3)
    with pytest.raises(NonFiniteLoss, match="non-finite loss at step 3"):
        run(tmp_path, recipe_overrides(regen, tmp_path / "run", "eagle1", steps=6, save_every=2))
    assert [p.name for p in checkpoints(tmp_path / "run")] == ["step_2"]
    assert not (tmp_path / "run/export").exists()
