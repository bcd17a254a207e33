"""Export to serving layouts and import back: the native round trip for every drafter kind, Medusa's vLLM
layout, a dtype cast that keeps index tensors, and a bf16 native copy. EAGLE-3's layouts: test_export_eagle3.py; golden Qwen3-14B
layouts on the meta device: test_export_golden.py; refusals (unfit formats, foreign targets, tampered files,
failed writes): test_export_refusals.py."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from decode.target import Target
from drafters.registry import make_drafter
from drafters.serving.checkpoint import load_drafter
from drafters.serving.export import export
from tests.drafters.batches import KINDS, build
from tests.drafters.serving import export_cases
from tests.drafters.serving.export_cases import drafts, run_dir

target_dir = export_cases.target_dir  # the module-scoped fixture: a tiny random Qwen3 target directory


# --- round trips ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_native_export_round_trip(tmp_path, target_dir, kind):
    target = Target.load(target_dir)
    m = build(kind, target)
    out = export(run_dir(tmp_path, m, target_dir), "native", tmp_path / "native")
    files = ["README.md", "config.json", "model.safetensors"]  # README.md: the model card (test_model_card.py)
    assert sorted(p.name for p in out.iterdir()) == sorted(files + ["adapter"] * (kind == "layerskip-lora"))
    fresh = Target.load(target_dir)  # a LoRA drafter injects into its target: load the copy on a new one
    loaded = load_drafter(out, fresh)
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in m.state_dict().items())
    assert drafts(m.drafter(), target) == drafts(loaded.drafter(), fresh)


def test_native_export_in_bf16_halves_the_file_and_loads(tmp_path, target_dir):
    """A native copy to ship: floating tensors saved in bf16 (half the bytes), loaded back into the fp32 module as
    their bf16 values; the checkpoint's config is untouched."""
    target = Target.load(target_dir)
    m = build("eagle3", target)
    src = run_dir(tmp_path, m, target_dir)
    full = export(src, "native", tmp_path / "fp32")
    half = export(src, "native", tmp_path / "bf16", dtype="bfloat16")
    assert (half / "config.json").read_text() == (full / "config.json").read_text()
    state, before = load_file(str(half / "model.safetensors")), load_file(str(full / "model.safetensors"))
    assert all(
        v.dtype == (torch.bfloat16 if before[k].is_floating_point() else before[k].dtype) for k, v in state.items()
    )
    size = (half / "model.safetensors").stat().st_size
    assert size < 0.6 * (full / "model.safetensors").stat().st_size
    loaded = load_drafter(half, target)
    assert all(torch.equal(v.bfloat16().float(), loaded.state_dict()[k]) for k, v in m.state_dict().items())


@pytest.mark.parametrize(
    "per_head,once", [(False, False), (False, True), (True, False)], ids=["shared-copies", "shared-once", "per-head"]
)
def test_medusa_vllm_round_trip(tmp_path, target_dir, per_head, once):
    from drafters.trainable.medusa import Medusa, MedusaConfig

    target = Target.load(target_dir)
    torch.manual_seed(0)
    m = Medusa(target, MedusaConfig(num_heads=3, num_layers=2, per_head_vocab=per_head))
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # trained-looking, and per-head matrices unlike the target's
    out = export(run_dir(tmp_path, m, target_dir), "medusa-vllm", tmp_path / "medusa", shared_head_once=once)
    cfg = json.loads((out / "config.json").read_text())
    state = load_file(str(out / "model.safetensors"))
    heads = [0] if once else [0, 1, 2]
    assert set(state) == {
        f"blocks.{k}.layers.{j}.{w}" for k in range(3) for j in range(2) for w in ("weight", "bias")
    } | {f"lm_heads.{k}.weight" for k in heads}
    assert (cfg["num_heads"], cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == (3, 2, 32, 128)
    assert cfg["medusa_fc_bias"] is True and cfg.get("original_lm_head", False) is once
    if not per_head:  # vLLM reads a head per Medusa head: copies of the target's
        assert all(torch.equal(state[f"lm_heads.{k}.weight"], target.lm_head.weight) for k in heads)
    imported = make_drafter(str(out), target)
    assert imported.m.config.per_head_vocab is per_head
    assert drafts(m.drafter(), target) == drafts(imported, target)


def test_dtype_cast_keeps_index_tensors(tmp_path, target_dir):
    m = build("eagle3", Target.load(target_dir))
    out = export(run_dir(tmp_path, m, target_dir), "eagle3", tmp_path / "bf16", dtype="bfloat16")
    state = load_file(str(out / "model.safetensors"))
    assert state["fc.weight"].dtype == torch.bfloat16 and state["d2t"].dtype == torch.long
    assert state["t2d"].dtype == torch.bool
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
