"""The bad-input sweep (tests/bad_input.py) of drafter directories: damaged native checkpoints and engine
layouts met by `draftsmith generate`, and `draftsmith export` / `draftsmith doctor` on damaged drafters or
unwritable output."""

from __future__ import annotations

import json

import pytest
import torch

from tests.bad_input import (
    Case,
    base_fixture,  # noqa: F401 - the `base` fixture (the shared inputs), found by name
    check_case,
    check_full_disk,
    copy,
    gen,
    registrar,
    retensor,
    rewrite_json,
    truncate,
)

CASES: dict[str, Case] = {}
FULL_DISK: dict[str, Case] = {}  # run under a small RLIMIT_FSIZE
case, full_disk = registrar(CASES), registrar(FULL_DISK)


# --- generate: damaged drafter files ----------------------------------------------------------


@case
def truncated_drafter_weights(tmp, base):
    d = copy(base / "eagle1", tmp / "d")
    truncate(d / "model.safetensors")
    return gen(base, drafter=str(d)), r"d/model\.safetensors: not a readable safetensors file .*copy or export it again"


@case
def drafter_config_bad_json(tmp, base):
    d = copy(base / "eagle1", tmp / "d")
    (d / "config.json").write_text('{"draftsmith_drafter": "eagle1",\n  "config": {,}}')
    return gen(base, drafter=str(d)), r"d/config\.json:2: not valid JSON .*re-export the drafter"


@case
def drafter_config_wrong_kind(tmp, base):
    d = copy(base / "eagle1", tmp / "d")
    rewrite_json(d / "config.json", lambda m: m.update(draftsmith_drafter="gpt5"))
    return gen(base, drafter=str(d)), r"d: drafter kind 'gpt5' unknown to this version"


@case
def drafter_config_missing_sections(tmp, base):
    d = copy(base / "eagle1", tmp / "d")
    rewrite_json(d / "config.json", lambda m: m.pop("target"))
    return gen(base, drafter=str(d)), r"d/config\.json lacks its 'config' or 'target\.fingerprint' section: re-export"


@case
def drafter_config_wrong_type(tmp, base):
    d = copy(base / "eagle1", tmp / "d")
    rewrite_json(d / "config.json", lambda m: m["config"].update(intermediate_size="big"))
    return gen(
        base, drafter=str(d)
    ), r"d/config\.json: Eagle1Config: intermediate_size must be an integer \(like the default 0\), got 'big'"


@case
def drafter_tensor_wrong_shape(tmp, base):
    d = copy(base / "eagle1", tmp / "d")
    retensor(d / "model.safetensors", lambda s: s.update({"fc.weight": torch.zeros(3, 3)}))
    return gen(base, drafter=str(d)), r"d/model\.safetensors: tensor shapes differ from the config's: \['fc\.weight"


@case
def drafter_tensor_wrong_dtype(tmp, base):
    d = copy(base / "eagle1", tmp / "d")
    retensor(d / "model.safetensors", lambda s: s.update({"fc.weight": s["fc.weight"].to(torch.int32)}))
    return gen(
        base, drafter=str(d)
    ), r"d/model\.safetensors: tensors of the wrong kind of dtype .*fc\.weight torch\.int32"


def native_eagle3(tmp, base, **config):
    """A native EAGLE-3 checkpoint on the shared target (the shared inputs hold an EAGLE-1 one)."""
    from decode.target import Target
    from drafters.serving.checkpoint import new_drafter, save_drafter

    m = new_drafter("eagle3", Target.load(base / "target"), {"draft_vocab_size": 64, **config})
    return save_drafter(m, tmp / "d", target_id=str(base / "target"))


@case
def drafter_config_fc_norm_without_weights(tmp, base):
    d = native_eagle3(tmp, base)
    rewrite_json(d / "config.json", lambda m: m["config"].update(fc_norm=True))
    return gen(base, drafter=str(d)), (
        r"d/model\.safetensors: keys do not match a eagle3 drafter of this config \(missing \['fc_norm\.0\.weight'.*"
        r"config\.json says fc_norm=true and the weights say otherwise; re-export the drafter"
    )


@case
def drafter_config_norm_output_not_a_boolean(tmp, base):
    d = native_eagle3(tmp, base)
    rewrite_json(d / "config.json", lambda m: m["config"].update(norm_output="yes"))
    return gen(base, drafter=str(d)), r"d/config\.json: Eagle3Config: norm_output must be true or false .*got 'yes'"


@case
def drafter_config_draft_layer_unknown(tmp, base):
    d = native_eagle3(tmp, base)
    rewrite_json(d / "config.json", lambda m: m["config"].update(draft_layer="qwen3"))
    return gen(base, drafter=str(d)), (
        r"d/config\.json: draft_layer must be one of \['llama', 'target'\], got 'qwen3'; re-export the drafter"
    )


@case
def engine_drafter_index_without_weight_map(tmp, base):
    d = tmp / "d"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    (d / "model.safetensors.index.json").write_text('{"metadata": {}}')
    return gen(base, drafter=str(d)), r"d/model\.safetensors\.index\.json: no 'weight_map' object; download or export"


# --- export and doctor --------------------------------------------------------------------------


@case
def export_truncated_weights(tmp, base):
    d = copy(base / "eagle1", tmp / "d")
    truncate(d / "model.safetensors")
    return [
        "export",
        str(d),
        "--format",
        "native",
        "--out",
        str(tmp / "x"),
    ], r"d/model\.safetensors: not a readable safetensors file"


@case
def export_config_bad_json(tmp, base):
    d = copy(base / "eagle1", tmp / "d")
    (d / "config.json").write_text("{")
    return ["export", str(d), "--format", "native", "--out", str(tmp / "x")], r"d/config\.json:1: not valid JSON"


@case
def export_out_is_a_file(tmp, base):
    (tmp / "x").write_text("mine\n")
    return ["export", str(base / "eagle1"), "--format", "native", "--out", str(tmp / "x")], r"--out .*x is a file"


@full_disk
def export_out_disk_full(tmp, base):
    return [
        "export",
        str(base / "eagle1"),
        "--format",
        "native",
        "--out",
        str(tmp / "x"),
    ], r"--out .*x: disk full .*nothing was written: free some space"


@case
def doctor_truncated_weights(tmp, base):
    d = copy(base / "eagle1", tmp / "d")
    truncate(d / "model.safetensors")
    return ["doctor", str(d), "--target", str(base / "target")], r"d/model\.safetensors: not a readable safetensors"


@case
def doctor_engine_config_bad_json(tmp, base):
    d = tmp / "d"
    d.mkdir()
    (d / "config.json").write_text('{"architectures": ["LlamaForCausalLMEagle3"]\n')
    return ["doctor", str(d), "--target", str(base / "target")], r"d/config\.json:2: not valid JSON"


# --- the sweep over this file's cases ---------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input(name, tmp_path, base, capsys):
    check_case(CASES[name], tmp_path, base, capsys)


@pytest.mark.parametrize("name", sorted(FULL_DISK))
def test_full_disk(name, tmp_path, base, capsys):
    """A full disk while writing --out (check_full_disk: a 16 KiB file-size limit)."""
    check_full_disk(FULL_DISK[name], tmp_path, base, capsys)
