"""Scripts cannot rot: every script in scripts/ runs end to end at a tiny size (its own CLI flags), in process.

Each runs its `main()` with a patched argv against the bundled stories260K target (or the tiny random chat
target where a script needs a chat template), checks the exit status and one line of its output. The shell
scripts (demo: the long job; test: the suite itself; _env.sh) are only parsed (`bash -n`), and demo.py
only shows its help.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
STORIES = str(REPO / "recipes/targets/stories260K")
STORY_PROMPTS = str(REPO / "recipes/prompts/stories_dev.txt")
SHELL = ["demo", "test", "_env.sh"]


def smoke_args(name: str, tmp: Path, chat: Path, build: bool = True) -> tuple[list[str], str] | None:
    """(argv after the script name, a string its output must contain) for a tiny run of `name`; with
    build=False, None for a row that must first train something (the row's existence is all that is asked)."""
    one_prompt = tmp / "one.txt"
    one_prompt.write_text("Once upon a time\n")
    chats = tmp / "chats.jsonl"  # conversations with answers (the MT-bench questions, answered by themselves)
    questions = [
        json.loads(x)["turns"][0]
        for x in (REPO / "recipes/data/mt_bench_question.jsonl").read_text().splitlines()
    ]
    chats.write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": q}]})
            + "\n"
            for q in questions[:10]
        )
    )
    (tmp / "two.jsonl").write_text("".join(json.dumps({"question_id": i, "category": c, "turns": [q]}) + "\n"
                                           for i, (c, q) in enumerate([("writing", questions[0]), ("coding", questions[1])])))
    table = {
        "bench.py": (
            [
                "--prompts",
                str(one_prompt),
                "--max-new-tokens",
                "4",
                "--drafter",
                "ar",
                "--drafter",
                "early-exit:2",
            ],
            "early-exit:2",
        ),
        "bench_chat.py": (
            [
                "--target",
                str(chat),
                "--suite",
                "mt-bench",
                "--limit",
                "1",
                "--first-turn-only",
                "--max-new-tokens",
                "4",
                "--untrained",
                "early-exit:1",
            ],
            "early-exit:1",
        ),
        "bench_shapes.py": (
            ["early-exit:1", "--target", str(chat), "--shapes", "chain:2", "dynamic:topk=2,depth=1,nodes=2",
             "--per-category", "1", "--max-new-tokens", "4", "--prompts", str(tmp / "two.jsonl")],
            "dynamic:topk=2,depth=1,nodes=2",
        ),
        "bench_decode.py": (
            ["--limit", "1", "--max-new-tokens", "4", "--early-exit", "1", "--skip", "2"],
            "early-exit:1",
        ),
        "bench_features.py": (
            ["--stories", "4", "--max-new-tokens", "8", "--cli", "--out", str(tmp / "bf")],
            "bytes per token",
        ),
        "bench_pipeline.py": (  # the chat target: its regeneration contexts go through the chat template
            [
                "--target",
                str(chat),
                "--recipes",
                str(REPO / "recipes/stories260K"),
                "--gemm-sizes",
                "32",
                "--regen-prompts",
                "2",
                "--max-new-tokens",
                "4",
                "--regen-batch",
                "2",
                "--seqs",
                "2",
                "--seq-len",
                "12",
                "--steps",
                "1",
                "--skip",
                "vllm",
                "--out",
                str(tmp / "bp.json"),
            ],
            "train step layerskip",
        ),
        "bench_policies.py": (
            [
                "--limit",
                "1",
                "--max-new-tokens",
                "4",
                "--story-tokens",
                "8",
                "--long-tokens",
                "8",
                "--lookup-tokens",
                "2",
            ],
            "prompt-lookup",
        ),
        "bench_regen.py": (
            [
                "--target",
                STORIES,
                "--prompts",
                STORY_PROMPTS,
                "--n",
                "2",
                "--max-new-tokens",
                "4",
                "--dtypes",
                "float32",
                "--batch-sizes",
                "2",
                "--threads",
                "1",
            ],
            "float32",
        ),
        "bench_streamed.py": (
            [
                "--num-prompts",
                "1",
                "--max-new-tokens",
                "4",
                "--tree",
                "chain",
                "--tokens",
                "1,4",
                "--repeats",
                "1",
                "--runs",
                "1",
                "--wide-hidden",
                "0",
                "--out",
                str(tmp / "bs"),
            ],
            "ar",
        ),
        "bench_train.py": (
            [
                "--kinds",
                "medusa",
                "--out",
                str(tmp / "bt"),
                "--max-new-tokens",
                "4",
                "--limit",
                "1",
                "--overrides",
                "data.regenerate.num_samples=24",
                "data.regenerate.max_new_tokens=16",
                "train.steps=2",
                "train.batch_size=4",
                "train.eval_every=0",
                "train.save_every=0",
                "train.sim_eval_prompts=1",
                "train.sim_max_new_tokens=4",
            ],
            "medusa",
        ),
        "demo.py": (["--help"], "usage"),
        "answer_repetition.py": (["--target", str(chat), str(chats), "--n", "2", "--cap", "8"], "repeated 2-grams"),
        "draft_vocab_coverage.py": (
            ["--target", str(chat), "--source", str(chats), "--n", "10", "--sizes", "32", "64"],
            "held-out coverage",
        ),
        "bench_train_step.py": (
            ["--target", str(chat), "--recipes", str(REPO / "recipes/stories260K"), "--seqs", "2", "--seq-len", "12",
             "--steps", "1"],
            "cached",
        ),
        "bench_loss_rows.py": (
            ["--target", str(chat), "--recipes", str(REPO / "recipes/stories260K"), "--synthetic", "--seq-len", "16",
             "--batches", "1", "--batch-size", "2"],
            "loss rows",
        ),
        "estimate.py": (
            ["--config", str(REPO / "tests/data/smollm2-135m-config.json"), "--seq", "64"],
            "eagle3",
        ),
        "profile_round.py": (
            [
                "ar",
                "--target",
                str(chat),
                "--limit",
                "1",
                "--max-new-tokens",
                "4",
                "--tokens",
                "1,2",
                "--prefix",
                "8",
                "--top",
                "2",
            ],
            "ar",
        ),
        "learning_curve.py": lambda: (  # lazily: it needs a tiny training run with two checkpoints kept
            [
                str(tiny_run(tmp)),
                "--out",
                str(tmp / "lc"),
                "--prompts",
                STORY_PROMPTS,
                "--per-category",
                "2",
                "--max-new-tokens",
                "4",
                "--chains",
                "2,8",
                "--tree",
                "dynamic:topk=2,depth=2,nodes=3",
                "--dtype",
                "float32",
                "--base",
                str(tmp / "tiny/run"),
            ],
            "(base)",  # the run against itself: no lever
        ),
    }
    entry = table[name]
    return (entry() if build else None) if callable(entry) else entry


def tiny_run(tmp: Path) -> Path:
    """A 4-step EAGLE-3 run on the bundled story target, checkpoints at steps 2 and 4 kept."""
    from tests.train.test_loop import recipe_overrides, run

    return run(tmp / "tiny", recipe_overrides(tmp / "regen", tmp / "tiny/run", "eagle3", steps=4, save_every=2,
                                              keep_checkpoints=5, sim_eval_prompts=0))


def scripts() -> list[str]:
    return sorted(p.name for p in (REPO / "scripts").iterdir() if p.suffix == ".py")


def test_every_script_has_a_smoke_test(tmp_path):
    """A new script must get its row in smoke_args (this fails until it does)."""
    missing = []
    for name in scripts():
        try:
            smoke_args(name, tmp_path, tmp_path, build=False)
        except KeyError:
            missing.append(name)
    shell = sorted(p.name for p in (REPO / "scripts").iterdir() if p.suffix != ".py")
    assert not missing and shell == sorted(SHELL), (missing, shell)


@pytest.mark.parametrize("name", scripts())
def test_script_runs_at_a_tiny_size(name, tmp_path, chat_target_dir, monkeypatch, capsys):
    argv, expect = smoke_args(name, tmp_path, chat_target_dir)
    spec = importlib.util.spec_from_file_location(
        f"_smoke_{name.removesuffix('.py')}", REPO / "scripts" / name
    )
    module = importlib.util.module_from_spec(spec)
    threads = torch.get_num_threads()
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up there
    monkeypatch.setattr(sys, "argv", [name, *argv])
    monkeypatch.chdir(REPO)
    try:
        spec.loader.exec_module(module)  # importing it: a stale import fails here
        try:
            rc = module.main()
        except SystemExit as e:  # argparse --help, or a script's own exit
            rc = e.code
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert rc in (0, None), out[-2000:]
    assert expect in out, out[-2000:]


@pytest.mark.parametrize("name", SHELL)
def test_shell_script_parses(name):
    res = subprocess.run(["bash", "-n", str(REPO / "scripts" / name)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
