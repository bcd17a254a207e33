"""Tiny training runs for the loop's tests (test_loop*.py, test_levers.py, test_snapshot.py, ...): a recipe on
the bundled stories260K target with online features and regenerated stories, run in this process."""

from __future__ import annotations

from pathlib import Path

import pytest

from train.config import load_recipe

REPO = Path(__file__).resolve().parents[2]


def recipe_overrides(regen: Path, run_dir: Path, kind: str, steps: int = 6, **train) -> list[str]:
    """A tiny online recipe on the bundled target: 48 sampled stories of 24 tokens."""
    out = [
        f"target={REPO / 'recipes/targets/stories260K'}",
        f"run_dir={run_dir}",
        f"drafter.kind={kind}",
        "data.max_length=40",
        "data.held_out=0.1",
        "data.regenerate.enabled=true",
        f"data.regenerate.out_dir={regen}",
        "data.regenerate.num_samples=48",
        "data.regenerate.max_new_tokens=24",
        "data.regenerate.stop_ids=[1]",
        "features.mode=online",
        "drafter.eagle3.ttt_steps=2",
        "drafter.eagle3.draft_vocab_size=128",
        f"train.steps={steps}",
        "train.batch_size=4",
        "train.lr=3e-3",
        "train.warmup_steps=2",
        "train.eval_every=0",
        "train.eval_batches=2",
        "train.save_every=0",
        "train.log_every=1",
        "train.report_to=none",
        "train.threads=1",
        "train.sim_eval_prompts=2",
        "train.sim_prompt_len=8",
        "train.sim_max_new_tokens=16",
    ]
    return out + [f"train.{k}={v}" for k, v in train.items()]


def write_recipe(tmp: Path) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    p = tmp / "tiny.yaml"
    p.write_text(f"target: {REPO / 'recipes/targets/stories260K'}\n")
    return p


@pytest.fixture(scope="module")
def regen(tmp_path_factory):
    """Regenerated stories shared by every run of a test module that takes this fixture (regeneration is
    resumable and cached)."""
    return tmp_path_factory.mktemp("regen")


def run(tmp: Path, overrides: list[str]) -> Path:
    from train.__main__ import run as train_run

    train_run(load_recipe(write_recipe(tmp), overrides))
    return Path(load_recipe(write_recipe(tmp), overrides).run_dir)


def crash_at(monkeypatch, at: int) -> None:
    """The loop raises KeyboardInterrupt when it reaches step `at` (a simulated crash after step at's checkpoint)."""
    from train import loop

    real = loop.LossModule.forward

    def dies(self, batch, step):
        if step == at:
            raise KeyboardInterrupt("simulated crash")
        return real(self, batch, step)

    monkeypatch.setattr(loop.LossModule, "forward", dies)
