"""The training loop's evaluation-only runs (train.eval_only) and warm starts (train.init_from, from a native
export or an engine layout)."""

from __future__ import annotations

import json

import pytest

from tests.train import loop_runs
from tests.train.loop_runs import recipe_overrides, run

regen = loop_runs.regen  # the module-scoped fixture: regenerated stories shared by the runs of this file


def test_eval_only_evaluates_without_training_or_export(tmp_path, regen):
    """train.steps=0 is refused (tests/test_bad_input.py) unless train.eval_only=true asks for evaluation alone:
    then the drafter (untrained here; the newest checkpoint when there is one) is evaluated, nothing more."""
    run_dir = run(tmp_path, recipe_overrides(regen, tmp_path / "run", "medusa", steps=0, eval_only="true"))
    final = json.loads((run_dir / "final_eval.json").read_text())
    assert final["step"] == 0 and final["eval/sim_prompts"] == 2 and "eval/loss" in final
    assert not (run_dir / "export").exists() and not (run_dir / "checkpoints").exists()


def test_init_from_starts_from_a_trained_drafter_native_or_engine_layout(tmp_path, regen):
    """train.init_from: the run starts from a trained drafter's weights. With eval_only, a run warm-started from
    an export (native, or the SGLang EAGLE-3 layout) evaluates exactly as the run that trained it, while the
    untrained drafter evaluates differently; a drafter of another kind or shape, or no directory, is refused."""
    from drafters.serving.export import export

    trained = run(tmp_path / "a", recipe_overrides(regen, tmp_path / "a/run", "eagle3", steps=8))
    engine = export(trained / "export", "eagle3", tmp_path / "engine", dtype="float32")
    ref = json.loads((trained / "final_eval.json").read_text())
    fresh = run(tmp_path / "u", recipe_overrides(regen, tmp_path / "u/run", "eagle3", steps=0, eval_only="true"))
    assert json.loads((fresh / "final_eval.json").read_text())["eval/loss"] != pytest.approx(ref["eval/loss"], rel=1e-3)
    for name, src in (("native", trained / "export"), ("engine", engine)):
        ov = recipe_overrides(regen, tmp_path / name / "run", "eagle3", steps=0, eval_only="true", init_from=src)
        got = json.loads((run(tmp_path / name, ov) / "final_eval.json").read_text())
        assert got["eval/loss"] == pytest.approx(ref["eval/loss"], rel=1e-5), name
        assert got["eval/sim_tau_chain"] == pytest.approx(ref["eval/sim_tau_chain"]), name
    base = recipe_overrides(regen, tmp_path / "x/run", "eagle3", steps=2)
    with pytest.raises(ValueError, match="is a eagle3 drafter; this recipe trains medusa"):
        run(
            tmp_path / "x",
            [o for o in base if o != "drafter.kind=eagle3"]
            + ["drafter.kind=medusa", f"train.init_from={trained / 'export'}"],
        )
    with pytest.raises(ValueError, match="do not fit this recipe's eagle3 drafter"):
        run(tmp_path / "x", base + ["drafter.eagle3.draft_vocab_size=64", f"train.init_from={trained / 'export'}"])
    with pytest.raises(FileNotFoundError, match="train.init_from"):
        run(tmp_path / "x", base + [f"train.init_from={tmp_path / 'nope'}"])
