"""Resume is exact from any point, for every drafter kind: a tiny recipe that spans more than 3 epochs
(5 micro-batches an epoch, 2 per optimizer step, so steps straddle epoch ends) is SIGKILLed three times
at seeded random points — mid-accumulation, right after a complete checkpoint, inside a later epoch — and
rerun each time with the same recipe. The final export must equal the uninterrupted run's bit for bit and
every step's logged loss must appear once, equal to the uninterrupted run's (both runs do the same float
operations in the same order on one thread, so no tolerance is needed). Periodic held-out and simulated-τ
evaluation are on, and EAGLE-1's feature noise, LayerSkip's layer dropout and LoRA dropout draw from the
training RNG, so an evaluation that shifted that stream, or a resume that lost it, would show.

The uninterrupted run and the last, finishing rerun run in this process; the killed ones in forked
children of it (imports and lazy loads paid once; the kill is a real SIGKILL from the DRAFTSMITH_KILL_AT
hook, train/killpoint.py; one torch thread, so no OpenMP pool crosses the fork). ~5 s a kind.
The 2-rank FSDP / ZeRO-3 variant is marked slow.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[2]
STEPS, ACCUM, SAVE_EVERY, MICRO_PER_EPOCH = 8, 2, 2, 5
KINDS = {  # id -> (drafter overrides, features mode): offline and online both covered
    "eagle1": (["drafter.kind=eagle1", "drafter.eagle1.feature_noise=0.2"], "offline"),
    "eagle3": (["drafter.kind=eagle3", "drafter.eagle3.ttt_steps=2", "drafter.eagle3.draft_vocab_size=128"], "online"),
    "eagle3_levers": (  # every EAGLE-3 lever at once, on the bundled Qwen3 (so the draft layer has QK-norm)
        [
            "drafter.kind=eagle3",
            "drafter.eagle3.ttt_steps=2",
            "drafter.eagle3.draft_vocab_size=128",
            "drafter.eagle3.fc_norm=true",
            "drafter.eagle3.norm_output=true",
            "drafter.eagle3.draft_layer=target",
            "drafter.eagle3.capture_ids=[1,2,3,4,5]",
            "train.loss=lk",
        ],
        "offline",
    ),
    "medusa": (["drafter.kind=medusa", "drafter.medusa.num_heads=2"], "offline"),
    "dflash": (["drafter.kind=dflash", "drafter.dflash.block_size=4", "drafter.dflash.anchors=4"], "online"),
    "dspark": (  # anchors drawn per step and micro-batch, the Markov and confidence heads
        [
            "drafter.kind=dspark",
            "drafter.dspark.block_size=4",
            "drafter.dspark.anchors=4",
            "drafter.dspark.markov_rank=8",
        ],
        "offline",
    ),
    "layerskip_exits": (["drafter.kind=layerskip", "drafter.layerskip.curriculum=rotational"], "offline"),
    "layerskip_lora": (
        [
            "drafter.kind=layerskip",
            "drafter.layerskip.mode=lora",
            "drafter.layerskip.lora_rank=2",
            "drafter.layerskip.lora_dropout=0.1",
            "drafter.layerskip.layer_dropout=0.2",
        ],
        "online",
    ),
    "layerskip_copied_layers": (
        [
            "drafter.kind=layerskip",
            "drafter.layerskip.mode=full",
            "drafter.layerskip.draft_exit=2",
            "drafter.layerskip.layer_dropout=0.2",
        ],
        "offline",
    ),
}


QWEN3_KINDS = {"eagle3_levers"}  # trained on recipes/targets/stories-qwen3; the others on stories260K


def target_of(kind: str) -> str:
    return "stories-qwen3" if kind in QWEN3_KINDS else "stories260K"


def overrides(home: Path, run_dir: Path, kind: str) -> list[str]:
    """24 regenerated stories, 20 for training: batch 4 -> 5 micro-batches an epoch, 16 in the run (3.2 epochs)."""
    drafter, mode = KINDS[kind]
    target = target_of(kind)
    return [
        f"target={REPO / 'recipes/targets' / target}",
        f"run_dir={run_dir}",
        *drafter,
        "data.max_length=24",
        "data.held_out=0.17",
        "data.regenerate.enabled=true",
        f"data.regenerate.out_dir={home / ('regen-' + target)}",  # one regeneration a target
        "data.regenerate.num_samples=24",
        "data.regenerate.max_new_tokens=20",
        "data.regenerate.stop_ids=[1]",
        f"features.mode={mode}",
        "features.dtype=fp32",
        f"train.steps={STEPS}",
        "train.batch_size=4",
        f"train.grad_accum={ACCUM}",
        "train.lr=3e-3",
        "train.warmup_steps=2",
        f"train.save_every={SAVE_EVERY}",
        "train.keep_checkpoints=1",
        "train.log_every=1",
        "train.eval_every=3",
        "train.eval_batches=1",
        "train.sim_eval_prompts=1",
        "train.sim_periodic_prompts=1",
        "train.sim_prompt_len=6",
        "train.sim_max_new_tokens=6",
        "train.report_to=none",
        "train.threads=1",
    ]


def train_run(home: Path, run_dir: Path, kind: str) -> int:
    """`python -m train` with these overrides, in this process, the environment as it is."""
    from train.__main__ import run
    from train.config import load_recipe

    recipe = home / "tiny.yaml"
    recipe.write_text(f"target: {REPO / 'recipes/targets/stories260K'}\n")
    return run(load_recipe(recipe, overrides(home, run_dir, kind)))


def run_here(home: Path, run_dir: Path, kind: str) -> int:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DRAFTSMITH_DATA", str(home / "data"))
        mp.delenv("DRAFTSMITH_KILL_AT", raising=False)
        return train_run(home, run_dir, kind)


def run_killed(home: Path, run_dir: Path, kind: str, kill_at: str) -> int:
    """The same in a forked child that SIGKILLs itself at `kill_at`; its exit (-9 when killed)."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.environ.update(DRAFTSMITH_DATA=str(home / "data"), DRAFTSMITH_KILL_AT=kill_at)
            torch.set_num_threads(1)
            code = train_run(home, run_dir, kind)
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def kill_points(kind: str) -> list[str]:
    """Three seeded random kill points, in run order: after an odd micro-batch (mid-accumulation), right
    after a complete checkpoint at a later step, after a micro-batch inside epoch 2 or 3."""
    rng = random.Random(f"resume-property:{kind}")
    saves = [s for s in range(SAVE_EVERY, STEPS, SAVE_EVERY) if s * ACCUM < 11]  # checkpoints in epochs 1-2
    mid = rng.choice([m for m in range(3, max(saves) * ACCUM) if m % ACCUM])  # one has a checkpoint after it
    saved = rng.choice([s for s in saves if s * ACCUM > mid])
    late = rng.randrange(max(2 * MICRO_PER_EPOCH, saved * ACCUM) + 1, STEPS * ACCUM)
    return [f"train.micro:{mid}", f"train.saved:{saved}", f"train.micro:{late}"]


def losses(run_dir: Path) -> list[tuple[int, float]]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows if "loss" in r]


def assert_identical(ref: Path, got: Path) -> None:
    assert losses(got) == losses(ref)  # every step once, bit-equal losses
    assert [s for s, _ in losses(ref)] == list(range(1, STEPS + 1))
    a, b = load_file(str(ref / "export/model.safetensors")), load_file(str(got / "export/model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k}: max |delta| {float((a[k] - b[k]).abs().max())}"
    adapters = sorted(ref.glob("export/*/adapter_model.safetensors"))
    for p in adapters:  # LoRA: the peft adapter directory too
        x, y = load_file(str(p)), load_file(str(got / p.relative_to(ref)))
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    """One data home for every kind: the stories are regenerated once a target, feature caches built once a kind."""
    return tmp_path_factory.mktemp("resume_home")


@pytest.mark.parametrize("kind", KINDS)
def test_killed_three_times_resumes_bit_for_bit(home, tmp_path, kind):
    assert run_here(home, tmp_path / "ref", kind) == 0
    assert (
        home / f"regen-{target_of(kind)}/.last_used.json"
    ).exists()  # the data home records the use (`draftsmith data ls`)
    for i, point in enumerate(kill_points(kind)):
        assert run_killed(home, tmp_path / "run", kind, point) == -signal.SIGKILL, f"kill {i} at {point} did not happen"
    assert run_here(home, tmp_path / "run", kind) == 0
    assert_identical(tmp_path / "ref", tmp_path / "run")


def test_kill_points_cover_the_three_cases():
    for kind in [*KINDS, *(f"a-future-kind-{i}" for i in range(200))]:  # any name draws valid points
        mid, saved, late = (int(p.split(":")[1]) for p in kill_points(kind))
        assert mid % ACCUM and saved * ACCUM > mid and late // MICRO_PER_EPOCH >= 2 and late > saved * ACCUM


# --- the slow variant: 2 CPU ranks, sharded ------------------------------------------------------

SHARDED = {  # accelerate launch arguments and environment for 2 CPU ranks
    "ddp": (
        [
            "--multi_gpu",
            "--num_processes",
            "2",
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
        ],
        {"ACCELERATE_USE_CPU": "true"},
    ),
    "fsdp": (["--config_file", str(REPO / "recipes/accelerate/fsdp_cpu_2proc.yaml")], {}),
    "zero3": (
        [
            "--config_file",
            str(REPO / "recipes/accelerate/deepspeed_zero3.yaml"),
            "--num_processes",
            "2",
            "--mixed_precision",
            "no",
        ],
        {"DS_ACCELERATOR": "cpu"},
    ),
}


def launch(home: Path, run_dir: Path, kind: str, backend: str, kill_at: str = "") -> int:
    args, extra = SHARDED[backend]
    env = {
        **os.environ,
        **extra,
        "DRAFTSMITH_DATA": str(home / "data"),
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache/torch_extensions")),
    }
    env.pop("DRAFTSMITH_KILL_AT", None)
    if kill_at:
        env["DRAFTSMITH_KILL_AT"] = kill_at
    recipe = home / "tiny.yaml"
    recipe.write_text(f"target: {REPO / 'recipes/targets/stories260K'}\n")
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        *args,
        "-m",
        "train",
        str(recipe),
        *overrides(home, run_dir, kind),
        "train.batch_size=2",
    ]
    with (run_dir.parent / f"{run_dir.name}.log").open("a") as log:
        return subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=900).returncode


@pytest.mark.slow
@pytest.mark.parametrize("backend", SHARDED)
@pytest.mark.parametrize("kind", ["eagle1", "layerskip_lora"])
def test_two_sharded_ranks_killed_resume_bit_for_bit(home, tmp_path, kind, backend):
    """2 ranks (DDP, FSDP2 or ZeRO-3), batch 2 a rank: killed mid-accumulation and right after a checkpoint (the
    launcher takes the other rank down), resumed, equal to the uninterrupted 2-rank run — LoRA's adapter,
    saved from the gathered (possibly sharded) parameters, included."""
    assert launch(home, tmp_path / "ref", kind, backend) == 0, (tmp_path / "ref.log").read_text()[-3000:]
    for point in kill_points(kind)[:2]:
        assert launch(home, tmp_path / "run", kind, backend, point) != 0
    assert launch(home, tmp_path / "run", kind, backend) == 0, (tmp_path / "run.log").read_text()[-3000:]
    assert_identical(tmp_path / "ref", tmp_path / "run")


def test_evaluation_leaves_the_training_rng_streams_alone():
    import numpy as np

    from train.evaluation import rng_untouched

    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    want = torch.rand(2), random.random(), np.random.rand()
    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    with rng_untouched():  # what an evaluation might draw
        torch.rand(5), random.random(), np.random.rand(4)
    got = torch.rand(2), random.random(), np.random.rand()
    assert torch.equal(got[0], want[0]) and got[1:] == want[1:]
