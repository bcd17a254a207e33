"""Exports and imports that are refused, each with a clear message: unfit formats, a run without an export, a
foreign target, tampered or pickled weights; an export that fails to write leaves the old one untouched."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from decode.target import Target
from drafters.registry import make_drafter
from drafters.serving import export as export_mod
from drafters.serving.export import export, main
from tests.conftest import tiny_model
from tests.drafters.batches import build
from tests.drafters.serving import export_cases
from tests.drafters.serving.export_cases import run_dir

target_dir = export_cases.target_dir  # the module-scoped fixture: a tiny random Qwen3 target directory


@pytest.mark.parametrize(
    "kind,fmt",
    [("eagle1", "eagle3"), ("layerskip", "medusa-vllm"), ("medusa", "speculators"), ("eagle3", "medusa-vllm")],
)
def test_unfit_format_is_a_clear_error(tmp_path, target_dir, capsys, kind, fmt):
    m = build(kind, Target.load(target_dir))
    assert main([str(run_dir(tmp_path, m, target_dir)), "--format", fmt, "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert f"format {fmt!r} does not fit a {m.kind} drafter" in err and "exports as:" in err
    assert not (tmp_path / "x").exists()


def test_run_dir_without_export_and_foreign_target(tmp_path, target_dir):
    (tmp_path / "unfinished" / "checkpoints").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="finish the run"):
        export(tmp_path / "unfinished", "native", tmp_path / "x")
    src = run_dir(tmp_path, build("eagle3", Target.load(target_dir)), target_dir)
    other = tmp_path / "other"
    tiny_model("qwen3", hidden=48).save_pretrained(other)
    with pytest.raises(
        ValueError, match="(?s)trained for another target.*hidden_size: drafter trained for 32, target has 48"
    ):
        export(src, "eagle3", tmp_path / "x", target=str(other))


def tamper(path: Path, how: str, key: str) -> str:
    """Rewrite a safetensors file with one key added / removed / reshaped; returns the expected message."""
    state = load_file(str(path))
    if how == "extra":
        state["embed_tokens.weight"] = torch.zeros(2, 2)
        msg = "unexpected key embed_tokens.weight"
    elif how == "missing":
        del state[key]
        msg = f"key {key} is missing"
    else:
        state[key] = torch.zeros(3, 3)
        msg = f"key {key} has shape \\[3, 3\\]"
    save_file(state, str(path))
    return msg


@pytest.mark.parametrize("how", ["extra", "missing", "shape"])
def test_tampered_native_checkpoint_is_not_exported(tmp_path, target_dir, how):
    src = run_dir(tmp_path, build("eagle3", Target.load(target_dir)), target_dir)
    msg = tamper(src / "export" / "model.safetensors", how, "midlayer.hidden_norm.weight")
    with pytest.raises(ValueError, match=msg):
        export(src, "eagle3", tmp_path / "x")
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(
    "fmt,key",
    [
        ("eagle3", "midlayer.self_attn.k_proj.weight"),
        ("speculators", "layers.0.mlp.up_proj.weight"),
        ("medusa-vllm", "blocks.1.layers.0.weight"),
    ],
)
@pytest.mark.parametrize("how", ["extra", "missing", "shape"])
def test_tampered_export_is_refused_on_import(tmp_path, target_dir, fmt, key, how):
    target = Target.load(target_dir)
    kind = "medusa" if fmt == "medusa-vllm" else "eagle3"
    out = export(run_dir(tmp_path, build(kind, target), target_dir), fmt, tmp_path / fmt)
    if how == "extra" and fmt != "medusa-vllm":
        key = "midlayer.extra.weight" if fmt == "eagle3" else "layers.0.extra.weight"
        state = load_file(str(out / "model.safetensors"))
        state[key] = torch.zeros(2)
        save_file(state, str(out / "model.safetensors"))
        msg = f"unexpected key {key}"
    else:  # (embed_tokens.weight is the one extra key EAGLE-3 imports tolerate: engines use the target's)
        msg = tamper(out / "model.safetensors", how, key)
    with pytest.raises(ValueError, match=msg):
        make_drafter(str(out), target)


def test_pickled_weights_are_refused(tmp_path, target_dir):
    target = Target.load(target_dir)
    out = export(run_dir(tmp_path, build("eagle3", target), target_dir), "eagle3", tmp_path / "e")
    (out / "model.safetensors").rename(out / "pytorch_model.bin")
    with pytest.raises(ValueError, match="never unpickles"):
        make_drafter(str(out), target)


def test_export_is_atomic(tmp_path, target_dir, monkeypatch):
    src = run_dir(tmp_path, build("eagle3", Target.load(target_dir)), target_dir)
    out = export(src, "eagle3", tmp_path / "e")
    before = (out / "model.safetensors").read_bytes()

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(export_mod, "save_file", broken)
    with pytest.raises(ValueError, match=r"--out .*e: cannot write \(disk full\)"):  # a one-line user error
        export(src, "eagle3", tmp_path / "e", dtype="bfloat16")
    assert (out / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e", "run"]
