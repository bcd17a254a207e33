"""EAGLE-3.1's norms in the engine layouts: `fc_norm` / `norm_output` written where vLLM 0.32 reads them (the top
level of config.json in both layouts: llama_eagle3.py reads `config.fc_norm` / `config.norm_output`, and
speculators' converter, configs/speculators/algos.py, copies them from the top level), the weights under the names
its load_weights maps (`fc_norm.{i}.weight`, one per captured state in layer order), imported back with identical
drafts; a config and weights that disagree are refused."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from decode.target import Target
from drafters.registry import make_drafter
from drafters.serving.checkpoint import load_drafter, save_drafter
from drafters.serving.engine_dirs import load_eagle3
from drafters.serving.export import export
from drafters.serving.layouts.formats import expected_shapes
from tests.drafters.batches import build, make_batch, random_sequences
from tests.drafters.serving import export_cases
from tests.drafters.serving.export_cases import drafts, run_dir
from tests.drafters.trainable.test_eagle3_norms import eagle3, rms

target_dir = export_cases.target_dir  # the module-scoped fixture: a tiny random Qwen3 target directory


def vllm_combine(aux: torch.Tensor, state: dict[str, torch.Tensor], eps: float) -> torch.Tensor:
    """vLLM 0.32 Eagle3LlamaForCausalLM.combine_hidden_states with fc_norm, on an exported file's tensors: the
    captured states concatenated in layer order [.., n*H], chunked back into n, each normed with its own
    `fc_norm.{i}.weight`, concatenated again, then fc."""
    n = sum(k.startswith("fc_norm.") for k in state)
    chunks = aux.chunk(n, dim=-1)
    normed = [rms(c, state[f"fc_norm.{i}.weight"], eps) for i, c in enumerate(chunks)]
    return torch.cat(normed, -1) @ state["fc.weight"].T


@pytest.mark.parametrize("ids", [(), (3, 1, 2)], ids=["default-ids", "unsorted-ids"])
@pytest.mark.parametrize("fmt", ["eagle3", "speculators"])
def test_export_import_with_both_norms(tmp_path, target_dir, fmt, ids):
    target = Target.load(target_dir)
    m = eagle3(target, capture_ids=ids, fc_norm=True, norm_output=True)
    out = export(run_dir(tmp_path, m, target_dir), fmt, tmp_path / fmt)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["fc_norm"] is True and cfg["norm_output"] is True  # top level, where vLLM reads both
    assert "fc_norm" not in cfg.get("transformer_layer_config", {})  # the converter would overwrite it there
    state = load_file(str(out / "model.safetensors"))
    assert set(state) == set(expected_shapes(fmt, cfg)) and {f"fc_norm.{i}.weight" for i in range(3)} <= set(state)
    # vLLM's fused input from the exported tensors = ours: each norm went with its capture id's block of fc
    batch = make_batch(target, random_sequences(target, 2, 8), m.feature_ids())
    aux = torch.cat([batch["hidden"][i] for i in sorted(m.config.capture_ids)], -1)
    torch.testing.assert_close(vllm_combine(aux, state, target.config.rms_norm_eps), m.project(batch["hidden"]))
    imported = load_eagle3(out, target)
    assert (imported.config.fc_norm, imported.config.norm_output) == (True, True)
    assert imported.config.capture_ids == tuple(sorted(m.config.capture_ids))
    for (a, _), (b, _) in zip(m.unroll(batch, 3), imported.unroll(batch, 3)):
        torch.testing.assert_close(a, b)  # equal bit for bit with ascending ids; permuted fc sums in another order
    assert drafts(m.drafter(), target) == drafts(make_drafter(str(out), target), target)


@pytest.mark.parametrize("option", ["fc_norm", "norm_output"])
def test_each_norm_alone_round_trips(tmp_path, target_dir, option):
    target = Target.load(target_dir)
    m = eagle3(target, **{option: True})
    out = export(run_dir(tmp_path, m, target_dir), "speculators", tmp_path / "s")
    cfg = json.loads((out / "config.json").read_text())
    assert {k for k in ("fc_norm", "norm_output") if k in cfg} == {option}
    imported = load_eagle3(out, target)
    assert all(torch.equal(v, imported.state_dict()[k]) for k, v in m.state_dict().items())
    assert drafts(m.drafter(), target) == drafts(imported.drafter(), target)


def test_a_drafter_without_the_norms_exports_as_before(tmp_path, target_dir):
    m = build("eagle3", Target.load(target_dir))
    for fmt in ("eagle3", "speculators"):
        out = export(run_dir(tmp_path, m, target_dir), fmt, tmp_path / fmt)
        assert not {"fc_norm", "norm_output"} & set(json.loads((out / "config.json").read_text()))
        assert not any(k.startswith("fc_norm") for k in load_file(str(out / "model.safetensors")))


def test_config_and_weights_that_disagree_are_refused(tmp_path, target_dir):
    """A native config claiming fc_norm without its weights (and the reverse), and an engine directory whose config
    names fc_norm without the tensors: each refused, naming the switch or the missing keys."""
    target = Target.load(target_dir)
    native = save_drafter(build("eagle3", target), tmp_path / "n")
    meta = json.loads((native / "config.json").read_text())
    (native / "config.json").write_text(json.dumps({**meta, "config": {**meta["config"], "fc_norm": True}}))
    with pytest.raises(ValueError, match=r"missing \['fc_norm\.0\.weight'.*config\.json says fc_norm=true and the"):
        load_drafter(native, target)
    normed = save_drafter(eagle3(target, fc_norm=True), tmp_path / "f")
    meta = json.loads((normed / "config.json").read_text())
    (normed / "config.json").write_text(json.dumps({**meta, "config": {**meta["config"], "fc_norm": False}}))
    with pytest.raises(ValueError, match=r"unexpected \['fc_norm\.0\.weight'.*says fc_norm=false"):
        load_drafter(normed, target)
    out = export(run_dir(tmp_path, eagle3(target, fc_norm=True), target_dir), "eagle3", tmp_path / "e")
    state = load_file(str(out / "model.safetensors"))
    save_file({k: v for k, v in state.items() if not k.startswith("fc_norm")}, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match=r"key fc_norm\.0\.weight is missing \(expected shape \[32\]\)"):
        make_drafter(str(out), target)
