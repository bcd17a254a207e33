"""EAGLE-3's serving layouts (SGLang's `eagle3`, vLLM's `speculators`) exported from a tiny drafter and imported
back with identical drafts; published-style directories; the engine rules (issue 13): full vocabulary,
capture-id order and convention, embeddings."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from decode.target import Target
from drafters.registry import make_drafter
from drafters.serving.engine_dirs import load_eagle3
from drafters.serving.export import export, main
from tests.drafters.batches import build, make_batch, random_sequences
from tests.drafters.serving import export_cases
from tests.drafters.serving.export_cases import drafts, run_dir

target_dir = export_cases.target_dir  # the module-scoped fixture: a tiny random Qwen3 target directory
LAYER = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "input_layernorm.weight",
    "hidden_norm.weight",
    "post_attention_layernorm.weight",
)


@pytest.mark.parametrize("fmt", ["eagle3", "speculators"])
def test_eagle3_export_import_gives_identical_drafts(tmp_path, target_dir, fmt):
    target = Target.load(target_dir)
    m = build("eagle3", target)
    out = export(run_dir(tmp_path, m, target_dir), fmt, tmp_path / fmt)
    cfg = json.loads((out / "config.json").read_text())
    keys = set(load_file(str(out / "model.safetensors")))
    prefix = "midlayer." if fmt == "eagle3" else "layers.0."
    assert keys == {prefix + k for k in LAYER} | {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"}
    hf_ids = list(m.config.capture_ids)
    if fmt == "eagle3":
        assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
        assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in hf_ids]  # SGLang's offset
        assert cfg["max_position_embeddings"] == target.max_positions and cfg["tie_word_embeddings"] is False
    else:
        assert cfg["architectures"] == ["Eagle3Speculator"] and cfg["speculators_model_type"] == "eagle3"
        assert cfg["eagle_aux_hidden_state_layer_ids"] == hf_ids and cfg["norm_before_residual"] is False
        assert cfg["speculators_config"]["verifier"]["name_or_path"] == str(target_dir)
        assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == m.config.ttt_steps
    assert cfg["draft_vocab_size"] == m.config.draft_vocab_size
    imported = load_eagle3(out, target)
    assert imported.config.capture_ids == m.config.capture_ids
    assert all(torch.equal(v, imported.state_dict()[k]) for k, v in m.state_dict().items())
    batch = make_batch(target, random_sequences(target, 2, 10), m.feature_ids())
    for (a, _), (b, _) in zip(m.unroll(batch, 3), imported.unroll(batch, 3)):  # the proposals' distributions
        assert torch.equal(a, b)
    via_registry = make_drafter(str(out), target)  # `--drafter DIR`
    assert via_registry.name == str(out)
    assert drafts(m.drafter(), target) == drafts(via_registry, target)


def test_published_style_eagle3_dir_loads(tmp_path, target_dir, capsys):
    """EAGLE-3 releases may carry the target's embedding and a shorter max_position_embeddings: both load
    (the embedding is the target's anyway; max positions only caps an engine's context), with a warning."""
    target = Target.load(target_dir)
    m = build("eagle3", target)
    out = export(run_dir(tmp_path, m, target_dir), "eagle3", tmp_path / "e")
    state = load_file(str(out / "model.safetensors"))
    save_file({**state, "embed_tokens.weight": target.embed_tokens.weight.clone()}, str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 64}))
    d = make_drafter(str(out), target)
    assert "warning: max_position_embeddings is 64, the target's is 512" in capsys.readouterr().err
    assert drafts(m.drafter(), target) == drafts(d, target)
    (out / "config.json").write_text(json.dumps({**cfg, "rope_theta": 5e5}))
    with pytest.raises(ValueError, match="rope_theta is 500000, the target's is 10000"):
        make_drafter(str(out), target)


def test_cli_reports_the_capture_id_offset(tmp_path, target_dir, capsys):
    from decode.cli import main as draftsmith

    m = build("eagle3", Target.load(target_dir))
    assert (
        draftsmith(
            ["export", str(run_dir(tmp_path, m, target_dir)), "--format", "eagle3", "--out", str(tmp_path / "e")]
        )
        == 0
    )
    ids = list(m.config.capture_ids)
    out = capsys.readouterr()
    assert f"HF hidden-state ids {ids}; eagle_aux_hidden_state_layer_ids are sglang's (HF ids - 1)" in out.out
    assert (
        "warning: this directory is for sglang: vllm would capture other layers (re-export with --engine vllm "
        "or --format speculators)" in out.err
    )


# --- the engine rules (issue 13): full vocabulary, capture-id order and convention, embeddings -------------


@pytest.mark.parametrize("fmt", ["eagle3", "speculators"])
def test_full_vocab_export_has_no_draft_vocab_keys(tmp_path, target_dir, fmt):
    """vLLM has no draft_id_to_target_id for a full draft vocabulary and refuses d2t/t2d then."""
    from drafters.trainable.eagle3 import Eagle3, Eagle3Config

    target = Target.load(target_dir)
    torch.manual_seed(0)
    m = Eagle3(target, Eagle3Config(draft_vocab_size=target.vocab_size, ttt_steps=2))
    out = export(run_dir(tmp_path, m, target_dir), fmt, tmp_path / fmt)
    assert not {"d2t", "t2d"} & set(load_file(str(out / "model.safetensors")))
    imported = load_eagle3(out, target)  # import fills in the identity mapping
    assert torch.equal(imported.d2t, m.d2t) and torch.equal(imported.t2d, m.t2d)
    assert drafts(m.drafter(), target) == drafts(make_drafter(str(out), target), target)


@pytest.mark.parametrize("fmt", ["eagle3", "speculators"])
def test_unsorted_capture_ids_are_permuted_at_export(tmp_path, target_dir, fmt):
    """Engines fuse captured states in layer order: the export lists the ids ascending and permutes fc's
    input blocks to match, and the exported drafter drafts exactly as the native one."""
    from drafters.trainable.eagle3 import Eagle3, Eagle3Config

    target = Target.load(target_dir)
    torch.manual_seed(0)
    m = Eagle3(
        target,
        Eagle3Config(capture_ids=(3, 1, 2), draft_vocab_size=64, ttt_steps=2),
        token_counts=torch.randint(0, 100, (target.vocab_size,)),
    )
    with torch.no_grad():
        m.fc.weight.normal_(0, 0.3)  # blocks that differ, so a wrong order changes the drafts
    out = export(run_dir(tmp_path, m, target_dir), fmt, tmp_path / fmt)
    cfg = json.loads((out / "config.json").read_text())
    ids = (
        cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        if fmt == "eagle3"
        else cfg["eagle_aux_hidden_state_layer_ids"]
    )
    assert ids == ([0, 1, 2] if fmt == "eagle3" else [1, 2, 3])
    fc = load_file(str(out / "model.safetensors"))["fc.weight"]
    blocks = m.fc.weight.chunk(3, dim=1)
    assert torch.equal(fc, torch.cat([blocks[1], blocks[2], blocks[0]], dim=1))
    imported = load_eagle3(out, target)
    assert imported.config.capture_ids == (1, 2, 3)
    assert drafts(m.drafter(), target) == drafts(imported.drafter(), target)


def test_with_embeddings_writes_the_targets_embedding(tmp_path, target_dir, capsys):
    target = Target.load(target_dir)
    m = build("eagle3", target)
    assert main([str(run_dir(tmp_path, m, target_dir)), "--format", "speculators", "--out", str(tmp_path / "a")]) == 0
    assert "add --with-embeddings to load it with speculators" in capsys.readouterr().out
    out = export(run_dir(tmp_path, m, target_dir), "speculators", tmp_path / "s", with_embeddings=True)
    assert torch.equal(load_file(str(out / "model.safetensors"))["embed_tokens.weight"], target.embed_tokens.weight)
    assert drafts(m.drafter(), target) == drafts(make_drafter(str(out), target), target)
    with pytest.raises(ValueError, match="--with-embeddings is for the EAGLE-3 layouts"):
        export(
            run_dir(tmp_path, build("medusa", target), target_dir), "medusa-vllm", tmp_path / "m", with_embeddings=True
        )


def test_four_capture_ids_tell_vllm_the_fc_width_in_the_speculators_layout(tmp_path, target_dir):
    """vLLM's speculators converter keeps only `transformer_layer_config` (+ the algorithm's fields), and its
    llama_eagle3.py sizes fc from `num_aux_hidden_states` there (3 when absent): the export writes it, and a
    config that lacks it for other than three ids is refused with the fix."""
    from drafters.serving.layouts import speculators
    from drafters.serving.layouts.rules import TargetFacts
    from drafters.trainable.eagle3 import Eagle3, Eagle3Config

    target = Target.load(target_dir)
    torch.manual_seed(0)
    m = Eagle3(target, Eagle3Config(capture_ids=(0, 1, 2, 3), draft_vocab_size=64, ttt_steps=2))
    out = export(run_dir(tmp_path, m, target_dir), "speculators", tmp_path / "spec")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["transformer_layer_config"]["num_aux_hidden_states"] == 4
    assert load_file(str(out / "model.safetensors"))["fc.weight"].shape[1] == 4 * target.hidden_size
    facts = TargetFacts.of(json.loads((target_dir / "config.json").read_text()), str(target_dir))
    assert not speculators.problems(cfg, facts)
    del cfg["transformer_layer_config"]["num_aux_hidden_states"]
    (bad,) = speculators.problems(cfg, facts)
    assert bad.what == "4 capture ids but transformer_layer_config.num_aux_hidden_states is None"
    assert "set it to 4" in bad.fix
    assert drafts(m.drafter(), target) == drafts(load_eagle3(out, target).drafter(), target)
