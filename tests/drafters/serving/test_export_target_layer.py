"""EAGLE-3 with a Qwen3 target's own layer (`draft_layer: target`, QK-norm) in both serving layouts: the names
vLLM 0.32 picks qwen3_eagle3.py by (SGLang layout: `Eagle3Qwen3ForCausalLM`; speculators: the layer config's
model_type qwen3), the exact key sets with `self_attn.{q,k}_norm.weight`, import back with identical drafts, and
refusals of a QK-norm layer on another target or without its norms."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from decode.target import Target
from drafters.registry import make_drafter
from drafters.serving.checkpoint import native_meta
from drafters.serving.engine_dirs import load_eagle3
from drafters.serving.export import export
from drafters.serving.layouts.formats import check_export, plan, planned_shapes
from tests.conftest import tiny_model
from tests.drafters.batches import build, make_batch, random_sequences
from tests.drafters.serving import export_cases
from tests.drafters.serving.export_cases import drafts, qwen3_14b_facts, run_dir
from tests.drafters.serving.test_export_eagle3 import LAYER
from tests.drafters.serving.test_export_golden import QWEN3_14B_EAGLE3
from tests.drafters.trainable.test_eagle import qwen3_14b_on_meta

target_dir = export_cases.target_dir  # the module-scoped fixture: a tiny random Qwen3 target directory
QK_NORM = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")
PREFIX = {"eagle3": "midlayer.", "speculators": "layers.0."}


@pytest.mark.parametrize("fmt", ["eagle3", "speculators"])
def test_qwen3_layer_export_import_gives_identical_drafts(tmp_path, target_dir, fmt):
    target = Target.load(target_dir)
    m = build("eagle3-target", target)
    out = export(run_dir(tmp_path, m, target_dir), fmt, tmp_path / fmt)
    cfg = json.loads((out / "config.json").read_text())
    state = load_file(str(out / "model.safetensors"))
    p = PREFIX[fmt]
    assert set(state) == {p + k for k in LAYER + QK_NORM} | {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"}
    assert torch.equal(state[p + "self_attn.q_norm.weight"], m.midlayer.self_attn.q_norm.weight)
    assert torch.equal(state[p + "self_attn.k_norm.weight"], m.midlayer.self_attn.k_norm.weight)
    if fmt == "eagle3":  # vLLM's registry.py: Eagle3Qwen3ForCausalLM -> qwen3_eagle3.Eagle3Qwen3ForCausalLM
        assert cfg["architectures"] == ["Eagle3Qwen3ForCausalLM"] and cfg["model_type"] == "qwen3"
    else:  # vLLM's speculators converter: transformer_layer_config.model_type qwen3 -> Eagle3Qwen3ForCausalLM
        assert cfg["architectures"] == ["Eagle3Speculator"]
        assert cfg["transformer_layer_config"]["model_type"] == "qwen3"
    imported = load_eagle3(out, target)
    assert imported.config.draft_layer == "target"
    assert all(torch.equal(v, imported.state_dict()[k]) for k, v in m.state_dict().items())
    batch = make_batch(target, random_sequences(target, 2, 10), m.feature_ids())
    for (a, _), (b, _) in zip(m.unroll(batch, 3), imported.unroll(batch, 3)):
        assert torch.equal(a, b)
    assert drafts(m.drafter(), target) == drafts(make_drafter(str(out), target), target)
    card = (out / "README.md").read_text()  # SGLang 0.5.23 has no Qwen3 EAGLE-3 class: the card says vLLM
    assert (
        "sglang.launch_server" not in card and "has no EAGLE-3 drafter with a Qwen3 layer: serve it with vLLM" in card
    )


def test_the_llama_layer_still_exports_as_llama(tmp_path, target_dir):
    m = build("eagle3", Target.load(target_dir))  # draft_layer: llama (the default) on the same Qwen3 target
    cfg = json.loads((export(run_dir(tmp_path, m, target_dir), "eagle3", tmp_path / "e") / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"


@pytest.mark.parametrize("fmt", ["eagle3", "speculators"])
def test_qwen3_14b_qwen3_layer_golden_and_the_gate(fmt):
    """At Qwen3-14B sizes on the meta device: the Llama golden plus two [128] norms; the exporter's exact key-set
    check refuses the layout without them."""
    from drafters.trainable.eagle3 import Eagle3, Eagle3Config

    m = Eagle3(qwen3_14b_on_meta(), Eagle3Config(draft_layer="target"))
    native = {k: tuple(v.shape) for k, v in m.state_dict().items()}
    facts = qwen3_14b_facts()
    cfg, sources = plan(fmt, native_meta(m, target_id="Qwen/Qwen3-14B"), list(native), facts)
    shapes = planned_shapes(sources, native, facts)
    p = PREFIX[fmt]
    golden = {k.replace("midlayer.", p): v for k, v in QWEN3_14B_EAGLE3.items()} | {p + k: (128,) for k in QK_NORM}
    assert shapes == golden
    check_export(fmt, cfg, shapes, facts)
    without = {k: v for k, v in shapes.items() if k != p + "self_attn.k_norm.weight"}
    with pytest.raises(ValueError, match=rf"key {p}self_attn\.k_norm\.weight is missing \(expected shape \[128\]\)"):
        check_export(fmt, cfg, without, facts)


def test_a_qwen3_layer_on_a_llama_target_is_refused(tmp_path, target_dir):
    """The directory names a QK-norm layer: on a Llama target (same sizes) the import says so, not a key error."""
    target = Target.load(target_dir)
    out = export(run_dir(tmp_path, build("eagle3-target", target), target_dir), "speculators", tmp_path / "s")
    llama = Target(tiny_model("llama", seed=3))
    with pytest.raises(ValueError, match=r"the draft layer is a qwen3 decoder layer, the target a llama"):
        load_eagle3(out, llama)


def test_a_qwen3_layer_without_its_norms_is_refused(tmp_path, target_dir):
    target = Target.load(target_dir)
    out = export(run_dir(tmp_path, build("eagle3-target", target), target_dir), "eagle3", tmp_path / "e")
    state = load_file(str(out / "model.safetensors"))
    del state["midlayer.self_attn.q_norm.weight"]
    save_file(state, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match=r"midlayer\.self_attn\.q_norm\.weight"):
        load_eagle3(out, target)
