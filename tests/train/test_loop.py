"""The training loop: tiny recipes train, export and reload; resume is exact; bad runs stop cleanly;
2 CPU ranks match 1 rank with gradient accumulation 2; DeepSpeed ZeRO-2 runs on CPU."""

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

from train.checkpoints import checkpoints
from train.config import load_recipe
from train.evaluation import simulated_tau
from train.loop import NonFiniteLoss, lr_factor

REPO = Path(__file__).resolve().parents[2]
KINDS = ["eagle3", "eagle1", "medusa", "layerskip"]


def recipe_overrides(regen: Path, run_dir: Path, kind: str, steps: int = 6, **train) -> list[str]:
    """A tiny online recipe on the bundled target: 48 sampled stories of 24 tokens."""
    out = [f"target={REPO / 'recipes/targets/stories260K'}", f"run_dir={run_dir}", f"drafter.kind={kind}",
           "data.max_length=40", "data.held_out=0.1", "data.regenerate.enabled=true",
           f"data.regenerate.out_dir={regen}", "data.regenerate.num_samples=48", "data.regenerate.max_new_tokens=24",
           "data.regenerate.stop_ids=[1]", "features.mode=online", "drafter.eagle3.ttt_steps=2",
           "drafter.eagle3.draft_vocab_size=128", f"train.steps={steps}", "train.batch_size=4", "train.lr=3e-3",
           "train.warmup_steps=2", "train.eval_every=0", "train.eval_batches=2", "train.save_every=0",
           "train.log_every=1", "train.report_to=none", "train.threads=1", "train.sim_eval_prompts=2",
           "train.sim_prompt_len=8", "train.sim_max_new_tokens=16"]
    return out + [f"train.{k}={v}" for k, v in train.items()]


def write_recipe(tmp: Path) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    p = tmp / "tiny.yaml"
    p.write_text(f"target: {REPO / 'recipes/targets/stories260K'}\n")
    return p


@pytest.fixture(scope="module")
def regen(tmp_path_factory):
    """Regenerated stories shared by every run of this module (regeneration is resumable and cached)."""
    return tmp_path_factory.mktemp("regen")


def run(tmp: Path, overrides: list[str]) -> Path:
    from train.__main__ import run as train_run

    train_run(load_recipe(write_recipe(tmp), overrides))
    return Path(load_recipe(write_recipe(tmp), overrides).run_dir)


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


def crash_at(monkeypatch, at: int) -> None:
    """The loop raises KeyboardInterrupt when it reaches step `at` (a simulated crash after step at's checkpoint)."""
    from train import loop

    real = loop.LossModule.forward

    def dies(self, batch, step):
        if step == at:
            raise KeyboardInterrupt("simulated crash")
        return real(self, batch, step)

    monkeypatch.setattr(loop.LossModule, "forward", dies)


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


def test_bad_recipes_fail_before_work(tmp_path, regen):
    with pytest.raises(ValueError, match="drafter.kind is not set"):
        run(tmp_path, [o for o in recipe_overrides(regen, tmp_path / "r", "medusa") if not o.startswith("drafter.kind")])
    with pytest.raises(ValueError, match="out of range"):
        run(tmp_path, recipe_overrides(regen, tmp_path / "r", "layerskip") + ["drafter.layerskip.exits=[2, 7]"])
    with pytest.raises(FileNotFoundError):
        run(tmp_path, recipe_overrides(regen, tmp_path / "r", "medusa") + [f"target={tmp_path / 'nope'}"])


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
    one = run(tmp_path / "one", recipe_overrides(regen, tmp_path / "one/run", "eagle1", steps=4, grad_accum=2,
                                                 batch_size=2))
    ov = recipe_overrides(regen, tmp_path / "two/run", "eagle1", steps=4, batch_size=2)
    p = _launch(["--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
                 "--dynamo_backend", "no", "-m", "train", str(recipe), *ov], {"ACCELERATE_USE_CPU": "true"})
    assert p.returncode == 0, p.stderr[-3000:]
    assert "2 process(es), MULTI_CPU" in p.stdout
    a, b = _losses(one), _losses(tmp_path / "two/run")
    assert len(a) == len(b) == 4
    assert a == pytest.approx(b, rel=1e-4, abs=1e-5)


def test_deepspeed_zero2_on_cpu(tmp_path, regen):
    recipe = write_recipe(tmp_path)
    ov = recipe_overrides(regen, tmp_path / "ds/run", "medusa", steps=3, batch_size=2)
    p = _launch(["--config_file", str(REPO / "recipes/accelerate/deepspeed_zero2.yaml"), "--num_processes", "1",
                 "--mixed_precision", "no", "-m", "train", str(recipe), *ov],
                _ds_env())
    assert p.returncode == 0, p.stderr[-3000:]
    assert "DEEPSPEED" in p.stdout
    assert len(_losses(tmp_path / "ds/run")) == 3
    assert (tmp_path / "ds/run/export/model.safetensors").exists()



def _shard_files(ckpt: Path) -> list[str]:
    """The per-rank model shard files of a sharded checkpoint (FSDP's DCP directory, or ZeRO-3's partitions)."""
    return sorted(f.name for f in [*ckpt.glob("pytorch_model_fsdp_0/*.distcp"), *ckpt.glob("pytorch_model/*model_states.pt")])


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
    return {"DS_ACCELERATOR": "cpu",
            "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache/torch_extensions"))}


SHARDED = {  # accelerate launch arguments, distributed type, one model shard file per rank
    "fsdp": (["--config_file", "recipes/accelerate/fsdp_cpu_2proc.yaml"], "FSDP", ["__0_0.distcp", "__1_0.distcp"]),
    "zero3": (["--config_file", "recipes/accelerate/deepspeed_zero3.yaml", "--num_processes", "2",
               "--mixed_precision", "no"], "DEEPSPEED",
              ["zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt"]),
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
    one = run(tmp_path / "one", recipe_overrides(regen, tmp_path / "one/run", "eagle1", steps=6, grad_accum=2, **common))
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
    outs = [generate(target, m.drafter(name=n), ids, 24, shape=Shape("chain", k=4))
            for m, n in ((exported, "export"), (before, "checkpoint"))]
    assert outs[0].tokens == outs[1].tokens
    assert outs[0].stats.accepted_lengths == outs[1].stats.accepted_lengths


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
        run(tmp_path / "x", [o for o in base if o != "drafter.kind=eagle3"]
            + ["drafter.kind=medusa", f"train.init_from={trained / 'export'}"])
    with pytest.raises(ValueError, match="do not fit this recipe's eagle3 drafter"):
        run(tmp_path / "x", base + ["drafter.eagle3.draft_vocab_size=64", f"train.init_from={trained / 'export'}"])
    with pytest.raises(FileNotFoundError, match="train.init_from"):
        run(tmp_path / "x", base + [f"train.init_from={tmp_path / 'nope'}"])
