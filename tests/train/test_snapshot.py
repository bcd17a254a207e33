"""train.snapshot: an intermediate training checkpoint as a native drafter directory (the last step's equals
the loop's own export, bit for bit), and the cumulative trained-token count the loop logs and resumes."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from decode.errors import UserError
from decode.generate import generate
from decode.target import Target
from decode.tree import Shape
from drafters.registry import make_drafter
from tests.conftest import REPO
from tests.train.loop_runs import crash_at, recipe_overrides, run
from train.snapshot import snapshot


@pytest.fixture(scope="module")
def regen(tmp_path_factory):
    """Regenerated stories shared by this module's runs."""
    return tmp_path_factory.mktemp("regen")


@pytest.mark.parametrize("kind", ["eagle3", "layerskip"])
def test_snapshot_of_the_last_step_is_the_export(tmp_path, regen, kind):
    extra = ["drafter.layerskip.mode=lora", "drafter.layerskip.lora_rank=2"] if kind == "layerskip" else []
    run_dir = run(
        tmp_path, recipe_overrides(regen, tmp_path / "run", kind, steps=4, save_every=2, keep_checkpoints=5) + extra
    )
    out = snapshot(run_dir, 4, tmp_path / "snap4")
    a, b = load_file(str(out / "model.safetensors")), load_file(str(run_dir / "export/model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    early = load_file(str(snapshot(run_dir, 2, tmp_path / "snap2") / "model.safetensors"))
    assert any(not torch.equal(early[k], a[k]) for k in a if a[k].is_floating_point())  # step 2 is another drafter
    # the snapshot decodes exactly as the export does (the LoRA adapter, if any, came along)
    x = torch.tensor([1, 403, 407, 261, 378])
    outs = []
    for d in (out, run_dir / "export"):  # a fresh target each: a LoRA drafter adapts the target it loads on
        target = Target.load(str(REPO / "recipes/targets/stories260K"), dtype="float32")
        outs.append(generate(target, make_drafter(str(d), target), x, 12, shape=Shape("chain", k=3)).tokens)
    assert outs[0] == outs[1]
    with pytest.raises(UserError, match="no checkpoint of step 3; there are steps 2, 4"):
        snapshot(run_dir, 3)
    with pytest.raises(UserError, match="no training checkpoints"):
        snapshot(tmp_path)


def test_trained_tokens_count_up_and_survive_a_resume(tmp_path, regen, monkeypatch):
    full = run(tmp_path / "a", recipe_overrides(regen, tmp_path / "a/run", "medusa", steps=6, save_every=2))
    rows = [json.loads(x) for x in (full / "metrics.jsonl").read_text().splitlines()]
    seen = [r["trained_tokens"] for r in rows if "loss" in r]
    assert len(seen) == 6 and all(b > a for a, b in zip([0, *seen], seen))  # strictly increasing from 0
    crash_at(monkeypatch, 5)
    ov = recipe_overrides(regen, tmp_path / "b/run", "medusa", steps=6, save_every=2)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "b", ov)
    monkeypatch.undo()
    resumed = run(tmp_path / "b", ov)
    rows_b = [json.loads(x) for x in (resumed / "metrics.jsonl").read_text().splitlines()]
    assert [r["trained_tokens"] for r in rows_b if "loss" in r] == seen
