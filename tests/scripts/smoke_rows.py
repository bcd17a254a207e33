"""The smoke rows of tests/scripts/test_smoke.py: for each script in scripts/, the argv that runs it at a tiny size.

Each row is a function (tmp dir, chat target dir) -> (argv after the script name, a string its output must
contain), registered under the script's file name with `@row`. Rows run against the bundled stories260K target,
or the tiny random chat target where a script needs a chat template.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STORIES = str(REPO / "recipes/targets/stories260K")
STORY_PROMPTS = str(REPO / "recipes/prompts/stories_dev.txt")
RECIPES = str(REPO / "recipes/stories260K")
SHELL = ["demo", "test", "_env.sh"]

Row = Callable[[Path, Path], tuple[list[str], str]]
ROWS: dict[str, Row] = {}


def row(script: str) -> Callable[[Row], Row]:
    """Registers a function as the smoke row of scripts/`script`."""

    def register(fn: Row) -> Row:
        ROWS[script] = fn
        return fn

    return register


def scripts() -> list[str]:
    """The runnable Python scripts: scripts/*.py with a `__main__` block."""
    return sorted(
        p.name for p in (REPO / "scripts").iterdir() if p.suffix == ".py" and '__name__ == "__main__"' in p.read_text()
    )


# --- inputs the rows share (each written into the test's tmp dir) -------------------------------


def one_prompt(tmp: Path) -> Path:
    p = tmp / "one.txt"
    p.write_text("Once upon a time\n")
    return p


def questions() -> list[str]:
    return [json.loads(x)["turns"][0] for x in (REPO / "recipes/data/mt_bench_question.jsonl").read_text().splitlines()]


def chats(tmp: Path) -> Path:
    """Conversations with answers: the first 10 MT-bench questions, answered by themselves."""
    p = tmp / "chats.jsonl"
    rows = (
        {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": q}]} for q in questions()[:10]
    )
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def two_questions(tmp: Path) -> Path:
    """Two MT-bench questions of two categories, as a prompt file."""
    qs = questions()
    p = tmp / "two.jsonl"
    p.write_text(
        "".join(
            json.dumps({"question_id": i, "category": c, "turns": [q]}) + "\n"
            for i, (c, q) in enumerate([("writing", qs[0]), ("coding", qs[1])])
        )
    )
    return p


def tiny_run(tmp: Path) -> Path:
    """A 4-step EAGLE-3 run on the bundled story target, checkpoints at steps 2 and 4 kept."""
    from tests.train.loop_runs import recipe_overrides, run

    return run(
        tmp / "tiny",
        recipe_overrides(
            tmp / "regen", tmp / "tiny/run", "eagle3", steps=4, save_every=2, keep_checkpoints=5, sim_eval_prompts=0
        ),
    )


# --- one row per script -------------------------------------------------------------------------


@row("answer_repetition.py")
def answer_repetition(tmp, chat):
    return ["--target", str(chat), str(chats(tmp)), "--n", "2", "--cap", "8"], "repeated 2-grams"


@row("bench.py")
def bench(tmp, chat):
    return ["--prompts", str(one_prompt(tmp)), *"--max-new-tokens 4 --drafter ar --drafter early-exit:2".split()], (
        "early-exit:2"
    )


@row("bench_block_loss.py")
def bench_block_loss(tmp, chat):  # the story DSpark recipe over a 64-token draft vocabulary, 2 anchors
    argv = "--synthetic --seq-len 24 --draft-vocab 64 --anchors 2 --batches 1 --batch-size 2".split()
    return ["--target", str(chat), "--recipe", f"{RECIPES}/dspark.yaml", *argv], "logZ ms"


@row("bench_chat.py")
def bench_chat(tmp, chat):
    argv = "--suite mt-bench --limit 1 --first-turn-only --max-new-tokens 4 --untrained early-exit:1".split()
    return ["--target", str(chat), *argv], "early-exit:1"


@row("bench_decode.py")
def bench_decode(tmp, chat):
    return ["--limit", "1", "--max-new-tokens", "4", "--early-exit", "1", "--skip", "2"], "early-exit:1"


@row("bench_features.py")
def bench_features(tmp, chat):
    return ["--stories", "4", "--max-new-tokens", "8", "--cli", "--out", str(tmp / "bf")], "bytes per token"


@row("bench_loss_rows.py")
def bench_loss_rows(tmp, chat):
    return [
        "--target",
        str(chat),
        "--recipes",
        RECIPES,
        "--synthetic",
        "--seq-len",
        "16",
        "--batches",
        "1",
        "--batch-size",
        "2",
    ], "loss rows"


@row("bench_pipeline.py")
def bench_pipeline(tmp, chat):
    # the chat target: its regeneration contexts go through the chat template
    return [
        "--target",
        str(chat),
        "--recipes",
        RECIPES,
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
    ], "train step layerskip"


@row("bench_policies.py")
def bench_policies(tmp, chat):
    return [
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
    ], "prompt-lookup"


@row("bench_regen.py")
def bench_regen(tmp, chat):
    return [
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
    ], "float32"


@row("bench_shapes.py")
def bench_shapes(tmp, chat):
    return [
        "early-exit:1",
        "--target",
        str(chat),
        "--shapes",
        "chain:2",
        "dynamic:topk=2,depth=1,nodes=2",
        "--per-category",
        "1",
        "--max-new-tokens",
        "4",
        "--prompts",
        str(two_questions(tmp)),
    ], "dynamic:topk=2,depth=1,nodes=2"


@row("bench_streamed.py")
def bench_streamed(tmp, chat):
    return [
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
    ], "ar"


@row("bench_train.py")
def bench_train(tmp, chat):
    overrides = [
        "data.regenerate.num_samples=24",
        "data.regenerate.max_new_tokens=16",
        "train.steps=2",
        "train.batch_size=4",
        "train.eval_every=0",
        "train.save_every=0",
        "train.sim_eval_prompts=1",
        "train.sim_max_new_tokens=4",
    ]
    return [
        "--kinds",
        "medusa",
        "--out",
        str(tmp / "bt"),
        "--max-new-tokens",
        "4",
        "--limit",
        "1",
        "--overrides",
        *overrides,
    ], "medusa"


@row("bench_train_step.py")
def bench_train_step(tmp, chat):
    return ["--target", str(chat), "--recipes", RECIPES, "--seqs", "2", "--seq-len", "12", "--steps", "1"], "cached"


@row("demo.py")
def demo(tmp, chat):
    return ["--help"], "usage"


@row("distill_story_qwen3.py")
def distill_story_qwen3(tmp, chat):  # a 1-layer Qwen3, 2 steps on 8 stories of 12 tokens
    return ["--out", str(tmp / "q"), *"--layers 1 --samples 8 --held-out 4 --length 12 --steps 2".split()], "top-1"


@row("draft_vocab_coverage.py")
def draft_vocab_coverage(tmp, chat):
    return ["--target", str(chat), "--source", str(chats(tmp)), "--n", "10", "--sizes", "32", "64"], "held-out coverage"


@row("estimate.py")
def estimate(tmp, chat):
    return ["--config", str(REPO / "tests/data/smollm2-135m-config.json"), "--seq", "64"], "eagle3"


@row("learning_curve.py")
def learning_curve(tmp, chat):
    # a tiny training run with two checkpoints kept, against itself as the base: no lever
    return [
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
    ], "(base)"


@row("profile_round.py")
def profile_round(tmp, chat):
    sizes = ["--limit", "1", "--max-new-tokens", "4", "--tokens", "1,2", "--prefix", "8", "--top", "2"]
    return ["ar", "--target", str(chat), *sizes], "ar"


@row("bench_gemm.py")
def bench_gemm(tmp, chat):
    return ["--target", str(chat), "--rows", "1,3"], "lm_head"


@row("bench_peers.py")
def bench_peers(tmp, chat):
    out = ["--out", str(tmp / "peers"), "--no-vllm"]
    return ["early-exit:1", "--target", str(chat), "--limit", "1", "--max-new-tokens", "4", *out], "AR (HF modules)"


@row("paired.py")
def paired(tmp, chat):  # two rows over two prompts, τ 2 and 1.5 vs 1 and 1.5: Δ +0.500 ± 0.500
    def r(spec, taus):
        ps = [{"id": str(i), "mean_accepted_tokens": t} for i, t in enumerate(taus)]
        return {"spec": spec, "mean_accepted_tokens": sum(taus) / 2, "tokens_per_s": 1.0, "prompts": ps}

    (tmp / "report.json").write_text(json.dumps({"drafters": [r("a/export", [2, 1.5]), r("b/export", [1, 1.5])]}))
    return [str(tmp / "report.json"), "--pair", "a/export", "b/export"], "Δ τ +0.500 ± 0.500 (2 prompts)"
