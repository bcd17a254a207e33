"""The bad-input sweep (tests/bad_input.py) of `draftsmith train` and `draftsmith features`: malformed recipes,
data records and feature caches, a truncated checkpoint, and every setting out of its range (train/settings.py),
refused before any work; and the same refusal through a real `python -m train` process."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.bad_input import (
    Case,
    base_fixture,  # noqa: F401 - the `base` fixture (the shared inputs), found by name
    check_case,
    check_error,
    copy,
    lines,
    registrar,
    rewrite_json,
    train_overrides,
    truncate,
)

CASES: dict[str, Case] = {}
case = registrar(CASES)

# the only files a case may change (relative to tmp_path): a run records its resolved recipe before resuming
MAY_CHANGE = {"train_checkpoint_truncated": {"run/config.yaml"}}
# ... and (relative to the shared inputs) the data home's use stamp of the feature cache it opened
MAY_STAMP = {"train_checkpoint_truncated": {"cache/.last_used.json"}}


# --- training: recipes, data, feature cache, checkpoints ----------------------------------------


def train(tmp: Path, base: Path, cmd: str = "train", yaml: str | None = None, **extra: str | None) -> list[str]:
    """`draftsmith CMD r.yaml` with train_overrides (an override given as None is left out)."""
    r = tmp / "r.yaml"
    r.write_text(yaml if yaml is not None else f"target: {base / 'target'}\n")
    return [cmd, str(r), *[o for o in train_overrides(base, tmp / "run", **extra) if not o.endswith("=None")]]


@case
def recipe_malformed_yaml(tmp, base):
    return train(
        tmp, base, yaml=f"target: {base / 'target'}\ntrain:\n  steps: [1\n  lr: 3\n"
    ), r"r\.yaml:\d: not valid YAML .*fix that line"


@case
def recipe_wrong_type(tmp, base):
    return train(tmp, base, yaml=f"target: {base / 'target'}\ntrain:\n  lr: fast\n"), r"r\.yaml: .*train\.lr"


@case
def recipe_unknown_key(tmp, base):
    return train(
        tmp, base, yaml=f"target: {base / 'target'}\ntrain:\n  stepz: 3\n"
    ), r"unknown key 'train\.stepz'; did you mean 'train\.steps'"


@case
def run_dir_is_a_file(tmp, base):
    (tmp / "run").write_text("mine\n")
    return train(tmp, base), r"run_dir .*run is a file, not a directory"


@case
def data_jsonl_bad_line(tmp, base):
    d = lines(tmp, "d.jsonl", '{"text": "Once upon a time"}', '{"text": "no end', '{"text": "x"}')
    return train(
        tmp, base, "features", **{"data.source": str(d), "features.cache_dir": str(tmp / "c")}
    ), r"d\.jsonl:2: not valid JSON .*fix or remove the record"


@case
def sharegpt_unknown_speaker(tmp, base):
    d = lines(
        tmp,
        "d.jsonl",
        json.dumps({"conversations": [{"from": "human", "value": "hi"}, {"from": "robot", "value": "hello"}]}),
    )
    return train(
        tmp, base, "features", **{"data.source": str(d), "features.cache_dir": str(tmp / "c")}
    ), r"d\.jsonl row 0, conversations\[1\]: unknown speaker 'robot'"


@case
def sharegpt_missing_value(tmp, base):
    d = lines(tmp, "d.jsonl", json.dumps({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt"}]}))
    return train(
        tmp, base, "features", **{"data.source": str(d), "features.cache_dir": str(tmp / "c")}
    ), r"d\.jsonl row 0, conversations\[1\]: missing field 'value'"


@case
def feature_shard_truncated(tmp, base):
    c = copy(base / "cache", tmp / "c")
    truncate(c / "shard_00000.safetensors")
    return train(
        tmp, base, **{"features.cache_dir": str(c)}
    ), r"feature shard .*c/shard_00000\.safetensors is unreadable .*delete it and rerun"


@case
def feature_index_corrupt(tmp, base):
    c = copy(base / "cache", tmp / "c")
    truncate(c / "index.json", 50)
    return train(tmp, base, **{"features.cache_dir": str(c)}), r"c/index\.json is unreadable .*delete .*c and rerun"


@case
def train_checkpoint_truncated(tmp, base):
    run = copy(base / "run", tmp / "run")
    truncate(run / "checkpoints" / "step_2" / "model.safetensors")
    return train(
        tmp, base, **{"train.steps": "4"}
    ), r"checkpoint .*run/checkpoints/step_2 is unreadable .*delete it to resume from the one before"


# --- training: every setting out of its range, refused before any work (train/settings.py) ---------


def setting_case(name: str, overrides: dict[str, str], want: str, cmd: str = "train") -> None:
    def build(tmp, base):
        return train(tmp, base, cmd, **overrides), want

    build.__name__ = name
    case(build)


for _name, _over, _want in [
    # the cases of issue 20, as a new user tried them
    (
        "train_mixed_precision_off",
        {"train.mixed_precision": "off"},
        r"'train\.mixed_precision': Invalid value 'off', expected one of \['auto', 'no', 'bf16'\]; set train\.mixed_precision to one of",
    ),
    (
        "train_grad_accum_0",
        {"train.grad_accum": "0"},
        r"train\.grad_accum=0: must be an integer >= 1 .*set train\.grad_accum=1 or more",
    ),
    ("train_threads_negative", {"train.threads": "-3"}, r"train\.threads=-3: must be an integer >= 0"),
    ("train_steps_0", {"train.steps": "0"}, r"train\.steps=0: trains nothing .*or train\.eval_only=true"),
    (
        "train_lr_negative",
        {"train.lr": "-1"},
        r"train\.lr=-1\.0: must be a number > 0\.0 .*set train\.lr to a positive",
    ),
    ("eagle3_ttt_steps_0", {"drafter.eagle3.ttt_steps": "0"}, r"drafter\.eagle3\.ttt_steps=0: must be an integer >= 1"),
    # the rest of train.*
    ("train_steps_negative", {"train.steps": "-5"}, r"train\.steps=-5: must be an integer >= 0"),
    ("train_batch_size_0", {"train.batch_size": "0"}, r"train\.batch_size=0: must be an integer >= 1"),
    ("train_beta2_1", {"train.beta2": "1"}, r"train\.beta2=1\.0: must be in \[0, 1\)"),
    (
        "train_weight_decay_negative",
        {"train.weight_decay": "-0.1"},
        r"train\.weight_decay=-0\.1: must be a number >= 0\.0",
    ),
    ("train_min_lr_ratio_2", {"train.min_lr_ratio": "2"}, r"train\.min_lr_ratio=2\.0: must be in \[0, 1\]"),
    ("train_warmup_negative", {"train.warmup_steps": "-1"}, r"train\.warmup_steps=-1: must be an integer >= 0"),
    (
        "train_max_grad_norm_negative",
        {"train.max_grad_norm": "-1"},
        r"train\.max_grad_norm=-1\.0: must be a number >= 0",
    ),
    ("train_eval_batches_0", {"train.eval_batches": "0"}, r"train\.eval_batches=0: must be an integer >= 1"),
    (
        "train_keep_checkpoints_0",
        {"train.keep_checkpoints": "0"},
        r"train\.keep_checkpoints=0: must be an integer >= 1",
    ),
    ("train_log_every_0", {"train.log_every": "0"}, r"train\.log_every=0: must be an integer >= 1"),
    ("train_save_every_negative", {"train.save_every": "-2"}, r"train\.save_every=-2: must be an integer >= 0"),
    ("train_sim_chain_0", {"train.sim_chain": "0"}, r"train\.sim_chain=0: must be an integer >= 1"),
    ("train_sim_tree_unknown", {"train.sim_tree": "bushy"}, r"train\.sim_tree=bushy: must be a tree shape: chain \|"),
    (
        "train_sim_prompts_missing",
        {"train.sim_prompts": "/no/such/prompts.txt"},
        r"train\.sim_prompts=/no/such/prompts\.txt: must be an existing file .*point it at a file that exists",
    ),
    (
        "train_resume_missing",
        {"train.resume": "/no/such/step_4"},
        r"train\.resume=/no/such/step_4: must be auto \| never \|",
    ),
    (
        "train_pack_length_short",
        {"train.pack_length": "8"},
        r"train\.pack_length=8: must be 0 or >= data\.max_length \(24\)",
    ),
    ("train_report_to_unknown", {"train.report_to": "mlflow"}, r"'train\.report_to': Invalid value 'mlflow'"),
    (
        "train_eval_only_not_bool",
        {"train.eval_only": "maybe"},
        r"'train\.eval_only': Value 'maybe' is not a valid bool",
    ),
    (
        "train_loss_unknown",
        {"train.loss": "foo"},
        r"'train\.loss': Invalid value 'foo', expected one of \['kl', 'lk'\]; set train\.loss to one of them",
    ),
    ("train_lk_variant_unknown", {"train.lk_variant": "tv"}, r"'train\.lk_variant': Invalid value 'tv'"),
    ("train_lk_eta_negative", {"train.lk_eta": "-1"}, r"train\.lk_eta=-1\.0: must be a number >= 0\.0"),
    ("train_lk_kl_scale_2", {"train.lk_kl_scale": "2"}, r"train\.lk_kl_scale=2\.0: must be in \[0, 1\]"),
    (
        "train_loss_lk_with_token_labels",
        {"drafter.kind": "medusa", "train.loss": "lk"},
        r"train\.loss=lk trains on the target's .*drafter\.medusa\.loss=ce trains on token labels.*set drafter\.medusa\.loss=kl",
    ),
    # data.*
    ("data_max_length_1", {"data.max_length": "1"}, r"data\.max_length=1: must be an integer >= 2"),
    ("data_held_out_1", {"data.held_out": "1"}, r"data\.held_out=1\.0: must be in \[0, 1\)"),
    ("data_max_records_negative", {"data.max_records": "-1"}, r"data\.max_records=-1: must be an integer >= 0"),
    ("data_overflow_unknown", {"data.overflow": "wrap"}, r"'data\.overflow': Invalid value 'wrap'"),
    ("regen_top_p_0", {"data.regenerate.top_p": "0"}, r"data\.regenerate\.top_p=0\.0: must be in \(0, 1\]"),
    ("regen_temperature_negative", {"data.regenerate.temperature": "-1"}, r"data\.regenerate\.temperature=-1\.0"),
    (
        "regen_batch_size_0",
        {"data.regenerate.batch_size": "0"},
        r"data\.regenerate\.batch_size=0: must be an integer >= 1",
    ),
    (
        "regen_stop_ids_negative",
        {"data.regenerate.stop_ids": "[1, -2]"},
        r"data\.regenerate\.stop_ids=\[1, -2\]: must be a list of values each an integer >= 0",
    ),
    # features.*
    (
        "features_target_dtype_unknown",
        {"features.target_dtype": "float8"},
        r"features\.target_dtype=float8: must be auto \(bf16 where it pays\) or a dtype name",
    ),
    ("features_attn_unknown", {"features.attn": "flash"}, r"features\.attn=flash: must be one of \['sdpa', 'eager'\]"),
    ("features_topk_negative", {"features.topk": "-1"}, r"features\.topk=-1: must be an integer >= 0"),
    ("features_shard_size_0", {"features.shard_size": "0"}, r"features\.shard_size=0: must be an integer >= 1"),
    ("features_hidden_ids_negative", {"features.hidden_ids": "[-1]"}, r"features\.hidden_ids=\[-1\]: must be a list"),
    ("features_dtype_unknown", {"features.dtype": "int8"}, r"'features\.dtype': Invalid value 'int8'"),
    # each drafter section
    ("eagle3_draft_vocab_0", {"drafter.eagle3.draft_vocab_size": "0"}, r"drafter\.eagle3\.draft_vocab_size=0"),
    (
        "eagle3_step_decay_0",
        {"drafter.eagle3.step_decay": "0"},
        r"drafter\.eagle3\.step_decay=0\.0: must be in \(0, 1\]",
    ),
    (
        "eagle1_feature_noise_negative",
        {"drafter.eagle1.feature_noise": "-0.5"},
        r"drafter\.eagle1\.feature_noise=-0\.5",
    ),
    (
        "eagle1_ce_weight_negative",
        {"drafter.eagle1.ce_weight": "-1"},
        r"drafter\.eagle1\.ce_weight=-1\.0: must be a number >= 0",
    ),
    ("medusa_num_heads_0", {"drafter.medusa.num_heads": "0"}, r"drafter\.medusa\.num_heads=0: must be an integer >= 1"),
    (
        "medusa_loss_unknown",
        {"drafter.medusa.loss": "mse"},
        r"drafter\.medusa\.loss=mse: must be one of \['ce', 'kl'\]",
    ),
    ("layerskip_mode_unknown", {"drafter.layerskip.mode": "fully"}, r"drafter\.layerskip\.mode=fully: must be one of"),
    (
        "layerskip_lora_dropout_1",
        {"drafter.layerskip.lora_dropout": "1"},
        r"drafter\.layerskip\.lora_dropout=1\.0: must be in \[0, 1\)",
    ),
    (
        "layerskip_curriculum_unknown",
        {"drafter.layerskip.curriculum": "random"},
        r"drafter\.layerskip\.curriculum=random",
    ),
    ("layerskip_exits_0", {"drafter.layerskip.exits": "[0, 2]"}, r"drafter\.layerskip\.exits=\[0, 2\]: must be a list"),
    ("drafter_kind_unknown", {"drafter.kind": "hydra"}, r"'drafter\.kind': Invalid value 'hydra'"),
    # EAGLE-3.1's norms belong to EAGLE-3's fc: a drafter without one has no such key
    ("medusa_fc_norm_unknown", {"drafter.medusa.fc_norm": "true"}, r"unknown key 'drafter\.medusa\.fc_norm'"),
    (
        "layerskip_norm_output_unknown",
        {"drafter.layerskip.norm_output": "true"},
        r"unknown key 'drafter\.layerskip\.norm_output'",
    ),
    (
        "eagle3_fc_norm_not_a_bool",
        {"drafter.eagle3.fc_norm": "maybe"},
        r"'drafter\.eagle3\.fc_norm': Value 'maybe' is not",
    ),
    (
        "eagle3_draft_layer_unknown",
        {"drafter.eagle3.draft_layer": "foo"},
        r"'drafter\.eagle3\.draft_layer': Invalid value 'foo', expected one of \['llama', 'target'\]",
    ),
    ("seed_negative", {"seed": "-1"}, r"seed=-1: must be an integer >= 0"),
    # the same checks under `draftsmith features`
    ("features_cmd_batch_size_0", {"features.batch_size": "0"}, r"features\.batch_size=0: must be an integer >= 1"),
]:
    setting_case(
        _name,
        _over,
        rf"override '[^']*': {_want}" if not _want.startswith("'") else _want,
        "features" if _name.startswith("features_cmd") else "train",
    )


@case
def recipe_setting_out_of_range(tmp, base):
    """A value from the recipe file, not an override: the error names the file."""
    return train(
        tmp, base, yaml=f"target: {base / 'target'}\ntrain:\n  grad_accum: 0\n", **{"train.grad_accum": None}
    ), r"r\.yaml: train\.grad_accum=0: must be an integer >= 1"


@case
def eagle3_target_layer_on_a_qwen2_target(tmp, base):
    """`draft_layer: target` on a target whose layer type the draft layer cannot be (Qwen2: q/k/v biases):
    refused as soon as the target is loaded, before any data or feature is built."""
    t = copy(base / "target", tmp / "qwen2")
    rewrite_json(t / "config.json", lambda d: d.update(model_type="qwen2", architectures=["Qwen2ForCausalLM"]))
    over = {"target": str(t), "drafter.kind": "eagle3", "drafter.eagle3.draft_layer": "target"}
    return train(tmp, base, **over), (
        r"drafter\.eagle3\.draft_layer=target: draftsmith cannot build the decoder layer of a 'qwen2' target "
        r"\(it builds those of llama, mistral, qwen3 targets\); set drafter\.eagle3\.draft_layer=llama"
    )


# --- the sweep over this file's cases ---------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input(name, tmp_path, base, capsys):
    check_case(CASES[name], tmp_path, base, capsys, MAY_CHANGE.get(name, ()), MAY_STAMP.get(name, ()))


def test_a_bad_setting_exits_2_from_the_command_line(tmp_path, base):
    """The same refusal through a real `python -m train` process: exit status 2, one error line, no run dir."""
    import subprocess
    import sys

    argv = train(tmp_path, base, **{"train.grad_accum": "0"})[1:]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    p = subprocess.run([sys.executable, "-m", "train", *argv], capture_output=True, text=True, env=env, timeout=300)
    check_error(p.returncode, p.stderr, r"train\.grad_accum=0: must be an integer >= 1")
    assert not (tmp_path / "run").exists()
