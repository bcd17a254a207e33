"""The training loop: tiny recipes train, export and reload; the lr schedule; bad recipes stop before any
work; bf16 autocast keeps fp32 master weights; 2 CPU ranks match 1 rank with gradient accumulation 2;
DeepSpeed ZeRO-2 runs on CPU; (slow) FSDP2 and ZeRO-3 shard, resume and export.
Resume and checkpoints: test_loop_resume.py; evaluation-only runs and warm starts: test_loop_eval.py."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.train import loop_runs
from tests.train.loop_runs import REPO, recipe_overrides, run, write_recipe
from train.evaluation import simulated_tau
from train.loop import lr_factor

KINDS = ["eagle3", "eagle1", "medusa", "layerskip", "dflash", "dspark"]
regen = loop_runs.regen  # the module-scoped fixture: regenerated stories shared by the runs of this file


def test_schedule_and_simulated_tau():
    from train.loop import TrainConfig

    cfg = TrainConfig(steps=110, warmup_steps=10, schedule="cosine", min_lr_ratio=0.1)
    assert lr_factor(0, cfg) == pytest.approx(0.1) and lr_factor(9, cfg) == pytest.approx(1.0)
    assert lr_factor(10, cfg) == pytest.approx(1.0) and lr_factor(110, cfg) == pytest.approx(0.1)
    assert lr_factor(60, cfg) == pytest.approx(0.55)
    assert simulated_tau([1.0, 1.0]) == 3.0 and simulated_tau([0.5, 0.5]) == pytest.approx(1.75)


@pytest.mark.parametrize("kind", KINDS)
def test_tiny_recipe_trains_exports_and_reloads(tmp_path, regen, kind):
    from decode.generate import encode_prompt, generate
    from decode.target import Target
    from decode.tree import Shape
    from drafters.registry import make_drafter
    from drafters.sources.ar import ARDrafter

    run_dir = run(tmp_path, recipe_overrides(regen, tmp_path / "run", kind))
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 7))
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in rows if "loss" in r)
    final = json.loads((run_dir / "final_eval.json").read_text())
    assert final["eval/tf_tau_chain"] >= 1.0 and final["eval/tf_tau_tree"] >= final["eval/tf_tau_chain"] - 1e-9
    assert final["eval/sim_prompts"] == 2 and final["eval/sim_matches_ar"] == 1.0
    assert 1.0 <= final["eval/sim_tau_chain"] <= 9.0 and 1.0 <= final["eval/sim_tau_tree"] <= 7.0
    export = run_dir / "export"
    assert (export / "config.json").exists() and (export / "model.safetensors").exists()
    assert json.loads((export / "config.json").read_text())["draftsmith_drafter"] == kind
    # reloaded twice from the export: identical drafts, and lossless against AR
    target = Target.load(REPO / "recipes/targets/stories260K")
    ids = encode_prompt(target, "Once upon a time")
    ref = generate(target, ARDrafter(), ids, 24)
    outs = [generate(target, make_drafter(str(export), target), ids, 24, shape=Shape("chain", k=4)) for _ in range(2)]
    assert outs[0].tokens == outs[1].tokens == ref.tokens
    assert outs[0].stats.accepted_lengths == outs[1].stats.accepted_lengths


def test_bad_recipes_fail_before_work(tmp_path, regen):
    with pytest.raises(ValueError, match="drafter.kind is not set"):
        run(
            tmp_path, [o for o in recipe_overrides(regen, tmp_path / "r", "medusa") if not o.startswith("drafter.kind")]
        )
    with pytest.raises(ValueError, match="out of range"):
        run(tmp_path, recipe_overrides(regen, tmp_path / "r", "layerskip") + ["drafter.layerskip.exits=[2, 7]"])
    with pytest.raises(FileNotFoundError):
        run(tmp_path, recipe_overrides(regen, tmp_path / "r", "medusa") + [f"target={tmp_path / 'nope'}"])


def test_the_lk_loss_reaches_the_drafter_through_the_loop(tmp_path, regen):
    """train.loss=lk: the loop hands the objective to the drafter, whose rows log each step's LK loss and its
    acceptance α (EAGLE-3's reduced draft vocabulary: α against the target's own probabilities)."""
    ov = recipe_overrides(regen, tmp_path / "run", "eagle3", steps=3, loss="lk", sim_eval_prompts=0)
    rows = [json.loads(x) for x in (run(tmp_path, ov) / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "loss" in r]
    assert [r["step"] for r in trained] == [1, 2, 3] and all(torch.isfinite(torch.tensor(r["loss"])) for r in trained)
    for r, k in ((r, k) for r in trained for k in (1, 2)):
        assert 0.0 < r[f"train/alpha_{k}"] <= 1.0 and f"train/lk_{k}" in r and f"train/ce_{k}" not in r, r


@pytest.mark.parametrize("first", ["no", "bf16"])
def test_bf16_autocast_keeps_fp32_weights_and_optimizer_state(tmp_path, first):
    """train.mixed_precision=bf16: the drafter's forward runs in bf16 under autocast while its weights,
    gradients and AdamW state stay fp32 (the master copy); a run of another precision in the same process
    before it (`first`) does not block it."""
    from train.distributed import make_accelerator
    from train.loop import TrainConfig

    make_accelerator(TrainConfig(mixed_precision=first, report_to="none"), tmp_path)
    acc = make_accelerator(TrainConfig(mixed_precision="bf16", report_to="none"), tmp_path)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.SiLU(), torch.nn.Linear(16, 8))
    seen = []
    model[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    with acc.autocast():
        out = model(torch.randn(4, 8))
    assert seen == [torch.bfloat16]  # (accelerate hands the output back in fp32)
    acc.backward(out.float().pow(2).mean())
    opt.step()
    params = list(acc.unwrap_model(model).parameters())
    assert {p.dtype for p in params} == {p.grad.dtype for p in params} == {torch.float32}
    state = [v for s in opt.state_dict()["state"].values() for v in s.values() if v.numel() > 1]
    assert state and {v.dtype for v in state} == {torch.float32}


# --- across processes: accelerate launch on CPU ranks ---------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(args: list[str], env_extra: dict[str, str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **env_extra}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", str(_free_port()), *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(x)["loss"] for x in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]


def test_two_cpu_ranks_match_one_rank_with_accumulation(tmp_path, regen):
    recipe = write_recipe(tmp_path)
    # regenerate once, single process, so both runs read the same stories
    one = run(
        tmp_path / "one", recipe_overrides(regen, tmp_path / "one/run", "eagle1", steps=4, grad_accum=2, batch_size=2)
    )
    ov = recipe_overrides(regen, tmp_path / "two/run", "eagle1", steps=4, batch_size=2)
    p = _launch(
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
            "-m",
            "train",
            str(recipe),
            *ov,
        ],
        {"ACCELERATE_USE_CPU": "true"},
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert "2 process(es), MULTI_CPU" in p.stdout
    a, b = _losses(one), _losses(tmp_path / "two/run")
    assert len(a) == len(b) == 4
    assert a == pytest.approx(b, rel=1e-4, abs=1e-5)


def test_deepspeed_zero2_on_cpu(tmp_path, regen):
    recipe = write_recipe(tmp_path)
    ov = recipe_overrides(regen, tmp_path / "ds/run", "medusa", steps=3, batch_size=2)
    p = _launch(
        [
            "--config_file",
            str(REPO / "recipes/accelerate/deepspeed_zero2.yaml"),
            "--num_processes",
            "1",
            "--mixed_precision",
            "no",
            "-m",
            "train",
            str(recipe),
            *ov,
        ],
        _ds_env(),
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert "DEEPSPEED" in p.stdout
    assert len(_losses(tmp_path / "ds/run")) == 3
    assert (tmp_path / "ds/run/export/model.safetensors").exists()


def _shard_files(ckpt: Path) -> list[str]:
    """The per-rank model shard files of a sharded checkpoint (FSDP's DCP directory, or ZeRO-3's partitions)."""
    return sorted(
        f.name for f in [*ckpt.glob("pytorch_model_fsdp_0/*.distcp"), *ckpt.glob("pytorch_model/*model_states.pt")]
    )


def _sharded_weights(ckpt: Path, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The drafter's full weights from a sharded checkpoint, read in this one process (our own files:
    DeepSpeed's reader unpickles them)."""
    if (ckpt / "pytorch_model_fsdp_0").is_dir():
        import torch.distributed.checkpoint as dcp

        full = {f"drafter.{k}": torch.empty_like(v) for k, v in like.items()}
        dcp.load({"model": full}, checkpoint_id=str(ckpt / "pytorch_model_fsdp_0"))
    else:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        full = get_fp32_state_dict_from_zero_checkpoint(str(ckpt))
    return {k.removeprefix("drafter."): v for k, v in full.items()}


def _ds_env() -> dict[str, str]:
    # an already set TORCH_EXTENSIONS_DIR wins: venvs sharing one build cache rebuild each other's ops
    return {
        "DS_ACCELERATOR": "cpu",
        "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache/torch_extensions")),
    }


SHARDED = {  # accelerate launch arguments, distributed type, one model shard file per rank
    "fsdp": (["--config_file", "recipes/accelerate/fsdp_cpu_2proc.yaml"], "FSDP", ["__0_0.distcp", "__1_0.distcp"]),
    "zero3": (
        ["--config_file", "recipes/accelerate/deepspeed_zero3.yaml", "--num_processes", "2", "--mixed_precision", "no"],
        "DEEPSPEED",
        ["zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt"],
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("backend", SHARDED)
def test_sharded_two_cpu_ranks_match_accumulation_resume_and_export(tmp_path, regen, backend):
    """FSDP2 (recipes/accelerate/fsdp_cpu_2proc.yaml) and DeepSpeed ZeRO-3 on 2 CPU ranks: 1 process's step
    losses with accumulation 2; a sharded checkpoint a relaunched run resumes from; an export of the full weights."""
    from decode.generate import encode_prompt, generate
    from decode.target import Target
    from decode.tree import Shape
    from drafters.serving.checkpoint import load_drafter

    args, dist_type, shard_files = SHARDED[backend]
    recipe = write_recipe(tmp_path)
    # a constant lr, so a 4-step run resumed to 6 steps follows the 6-step run exactly
    common = {"batch_size": 2, "schedule": "constant", "save_every": 2}
    one = run(
        tmp_path / "one", recipe_overrides(regen, tmp_path / "one/run", "eagle1", steps=6, grad_accum=2, **common)
    )
    two = tmp_path / "two/run"

    def launch(steps: int) -> str:
        ov = recipe_overrides(regen, two, "eagle1", steps=steps, **common)
        p = _launch([*args, "-m", "train", str(recipe), *ov], _ds_env() if backend == "zero3" else {})
        assert p.returncode == 0, p.stderr[-3000:]
        assert f"2 process(es), {dist_type}" in p.stdout
        return p.stdout

    launch(4)
    assert _shard_files(two / "checkpoints/step_4") == shard_files  # one model shard a rank
    assert "resumed from" in launch(6)  # resume=auto: from step_4, steps 5 and 6
    a, b = _losses(one), _losses(two)
    print(f"\n{'step':>4}  {'1 proc, accum 2':>15}  {backend + ', 2 ranks':>15}  {'abs diff':>8}")  # shown with -s
    print("\n".join(f"{i:>4}  {x:>15.6f}  {y:>15.6f}  {abs(x - y):>8.1e}" for i, (x, y) in enumerate(zip(a, b), 1)))
    assert len(a) == len(b) == 6
    assert a == pytest.approx(b, rel=1e-4, abs=1e-5)
    # the export holds the full weights: those of the last sharded checkpoint, bit for bit, and (up to
    # float reassociation) those of the 1-process run; it loads and drafts exactly as the checkpoint's weights
    target = Target.load(REPO / "recipes/targets/stories260K")
    exported = load_drafter(two / "export", target)
    before = load_drafter(two / "export", target)
    before.load_state_dict(_sharded_weights(two / "checkpoints/step_6", exported.state_dict()))
    ref = load_file(str(one / "export/model.safetensors"))
    for k, v in exported.state_dict().items():
        assert torch.equal(v, before.state_dict()[k]), k
        torch.testing.assert_close(v, ref[k], atol=1e-5, rtol=1e-4)
    ids = encode_prompt(target, "Once upon a time")
    outs = [
        generate(target, m.drafter(name=n), ids, 24, shape=Shape("chain", k=4))
        for m, n in ((exported, "export"), (before, "checkpoint"))
    ]
    assert outs[0].tokens == outs[1].tokens
    assert outs[0].stats.accepted_lengths == outs[1].stats.accepted_lengths
