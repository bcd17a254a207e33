"""Bad input, swept: every CLI meets damaged files, malformed records, nonsense options and unwritable or
full outputs the way a user would hand them over.

Each case builds one bad input under tmp_path and runs the command as `draftsmith CMD ...` does
(decode.cli.main, in-process; a file-size limit stands in for a full disk). It must
exit 2 with ONE `error: ...` line that names the file (and line) or the option, no traceback, and leave
every file on disk as it was (no half-written output, earlier outputs untouched).

Checked by hand as root, where chmod cannot take write permission away: --out or run_dir on a read-only
tmpfs gives `error: --out DIR: cannot write in MOUNT (Read-only file system); point --out at a directory you
can write`, and a full 64 KiB tmpfs gives `error: --out DIR: disk full (No space left on device); nothing
was written: ...` with the earlier report.json intact.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import resource
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from decode.cli import main as draftsmith
from tests.conftest import STORIES

# id -> build(tmp, base) -> (argv of `draftsmith`, regex the error line must match)
Case = Callable[[Path, Path], tuple[list[str], str]]
CASES: dict[str, Case] = {}
FULL_DISK: dict[str, Case] = {}  # run under a small RLIMIT_FSIZE
# the only files a case may change (relative to tmp_path): a run records its resolved recipe before resuming
MAY_CHANGE = {"train_checkpoint_truncated": {"run/config.yaml"}}
# ... and (relative to the shared inputs) the data home's use stamp of the feature cache it opened
MAY_STAMP = {"train_checkpoint_truncated": {"cache/.last_used.json"}}


def case(fn: Case, table: dict[str, Case] = CASES) -> Case:
    table[fn.__name__] = fn
    return fn


def full_disk(fn: Case) -> Case:
    return case(fn, FULL_DISK)


# --- shared inputs (built once; cases copy what they damage) ------------------------------------

@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """target/ (the bundled stories target), eagle1/ (a native checkpoint for it), data.jsonl, a feature
    cache and a training run with a checkpoint."""
    from decode.target import Target
    from drafters.serving.checkpoint import new_drafter, save_drafter

    root = tmp_path_factory.mktemp("base")
    shutil.copytree(STORIES, root / "target")
    torch.manual_seed(0)
    save_drafter(new_drafter("eagle1", Target.load(root / "target"), {}), root / "eagle1",
                 target_id=str(root / "target"))
    stories = [" ".join(["Tom had a red ball and he liked to play with it in the park."] * (1 + i % 3))
               for i in range(24)]
    (root / "data.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in stories))
    (root / "recipe.yaml").write_text(f"target: {root / 'target'}\n")
    assert draftsmith(["features", str(root / "recipe.yaml"), *train_overrides(root, root / "run")]) == 0
    assert draftsmith(["train", str(root / "recipe.yaml"), *train_overrides(root, root / "run")]) == 0
    assert (root / "run" / "checkpoints" / "step_2" / "model.safetensors").is_file()
    return root


def train_overrides(base: Path, run_dir: Path, **extra: str) -> list[str]:
    """A 2-step eagle1 recipe on data.jsonl (offline features, a checkpoint at step 2)."""
    kw = {"run_dir": str(run_dir), "data.source": str(base / "data.jsonl"), "data.max_length": "24",
          "data.held_out": "0.2", "drafter.kind": "eagle1", "features.dtype": "fp32", "features.cache_dir":
          str(base / "cache"), "train.steps": "2", "train.batch_size": "4", "train.save_every": "2",
          "train.eval_every": "0", "train.eval_batches": "1", "train.report_to": "none", "train.threads": "1", **extra}
    return [f"{k}={v}" for k, v in kw.items()]


def gen(base: Path, *opts: str, drafter: str = "ar", target: Path | None = None) -> list[str]:
    return ["generate", "--target", str(target or base / "target"), "--drafter", drafter, "--prompt", "Once",
            "--max-new-tokens", "4", *opts]


def ev(base: Path, prompts: Path, out: Path, *opts: str) -> list[str]:
    return ["evaluate", "--target", str(base / "target"), "--drafter", "ar", "--prompts", str(prompts),
            "--max-new-tokens", "4", "--no-warmup", "--out", str(out), *opts]


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def truncate(path: Path, keep: int = 100) -> None:
    path.write_bytes(path.read_bytes()[:keep])


def rewrite_json(path: Path, edit: Callable[[dict], None]) -> None:
    d = json.loads(path.read_text())
    edit(d)
    path.write_text(json.dumps(d))


def retensor(path: Path, edit: Callable[[dict], None]) -> None:
    state = load_file(str(path))
    edit(state)
    save_file(state, str(path))


def lines(tmp: Path, name: str, *rows: str) -> Path:
    p = tmp / name
    p.write_text("".join(r + "\n" for r in rows))
    return p


# --- decode: damaged drafter and target files ---------------------------------------------------

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
    return gen(base, drafter=str(d)), r"d/config\.json: Eagle1Config: intermediate_size must be an integer \(like the default 0\), got 'big'"


@case
def drafter_tensor_wrong_shape(tmp, base):
    d = copy(base / "eagle1", tmp / "d")
    retensor(d / "model.safetensors", lambda s: s.update({"fc.weight": torch.zeros(3, 3)}))
    return gen(base, drafter=str(d)), r"d/model\.safetensors: tensor shapes differ from the config's: \['fc\.weight"


@case
def drafter_tensor_wrong_dtype(tmp, base):
    d = copy(base / "eagle1", tmp / "d")
    retensor(d / "model.safetensors", lambda s: s.update({"fc.weight": s["fc.weight"].to(torch.int32)}))
    return gen(base, drafter=str(d)), r"d/model\.safetensors: tensors of the wrong kind of dtype .*fc\.weight torch\.int32"


@case
def truncated_target_weights(tmp, base):
    t = copy(base / "target", tmp / "t")
    truncate(t / "model.safetensors")
    return gen(base, target=t), r"t/model\.safetensors: not a readable safetensors file"


@case
def target_config_bad_json(tmp, base):
    t = copy(base / "target", tmp / "t")
    (t / "config.json").write_text('{"model_type": "llama",,}')
    return gen(base, target=t), r"t/config\.json:1: not valid JSON"


@case
def target_without_config(tmp, base):
    t = copy(base / "target", tmp / "t")
    (t / "config.json").unlink()
    return gen(base, target=t), r"t exists but has no config\.json: point --target at a model directory"


# --- decode: nonsense options (all fail before the target loads) --------------------------------

def option_case(name: str, opts: tuple[str, ...], want: str) -> None:
    def build(tmp, base):
        return gen(base, *opts), want
    build.__name__ = name
    case(build)


for _name, _opts, _want in [
    ("tree_dynamic_topk_0", ("--tree", "dynamic:topk=0"), r"--tree 'dynamic:topk=0': topk must be >= 1, got 0"),
    ("tree_dynamic_depth_negative", ("--tree", "dynamic:depth=-1"), r"--tree 'dynamic:depth=-1': depth must be >= 1"),
    ("tree_dynamic_nodes_0", ("--tree", "dynamic:nodes=0"), r"--tree 'dynamic:nodes=0': nodes must be >= 1"),
    ("tree_dynamic_unknown_key", ("--tree", "dynamic:width=3"), r"--tree 'dynamic:width=3': option 'width=3' not one of"),
    ("tree_dynamic_not_int", ("--tree", "dynamic:topk=many"), r"--tree 'dynamic:topk=many': topk needs an integer"),
    ("tree_unknown_kind", ("--tree", "bushy"), r"--tree 'bushy': expected chain \| static:FILE \| dynamic"),
    ("policy_unknown", ("--policy", "greedy"), r"--policy 'greedy': available policies are"),
    ("policy_threshold_p_2", ("--policy", "threshold:p=2"), r"--policy threshold:p=2\.0: p must be in \[0, 1\]"),
    ("policy_option_not_int", ("--policy", "learning:max=x"), r"--policy 'learning:max=x': max needs an integer, got 'x'"),
    ("draft_len_0", ("--draft-len", "0"), r"--draft-len 0: a chain needs at least 1 token"),
    ("temperature_negative", ("--temperature", "-1"), r"--temperature -1\.0: must be >= 0"),
    ("top_p_0", ("--temperature", "1", "--top-p", "0"), r"--top-p 0\.0: must be in \(0, 1\]"),
    ("top_p_above_1", ("--temperature", "1", "--top-p", "1.5"), r"--top-p 1\.5: must be in \(0, 1\]"),
    ("top_k_negative", ("--top-k", "-3"), r"--top-k -3: must be >= 0"),
    ("max_new_tokens_0", ("--max-new-tokens", "0"), r"--max-new-tokens 0: must be >= 1"),
    ("max_new_tokens_negative", ("--max-new-tokens", "-5"), r"--max-new-tokens -5: must be >= 1"),
    ("target_pass_s_0", ("--target-pass-s", "0"), r"--target-pass-s must be > 0, got 0"),
    ("dtype_unknown", ("--dtype", "float8"), r"dtype 'float8' not one of \['bf16', 'bfloat16'"),
]:
    option_case(_name, _opts, _want)


@case
def drafter_option_not_int(tmp, base):
    return gen(base, drafter="prompt-lookup:ngram=x"), r"drafter 'prompt-lookup:ngram=x': ngram needs an integer, got 'x'"


@case
def drafter_early_exit_out_of_range(tmp, base):
    return gen(base, drafter="early-exit:9"), r"early-exit:9: K must be in 1\.\.4 for a 5-layer target"


@case
def engine_drafter_index_without_weight_map(tmp, base):
    d = tmp / "d"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    (d / "model.safetensors.index.json").write_text('{"metadata": {}}')
    return gen(base, drafter=str(d)), r"d/model\.safetensors\.index\.json: no 'weight_map' object; download or export"


@case
def tree_static_missing_file(tmp, base):
    return gen(base, "--tree", f"static:{tmp / 'nope.json'}"), r"--tree static:FILE needs a json file .*nope\.json"


@case
def tree_static_bad_json(tmp, base):
    f = lines(tmp, "tree.json", "[[0], [1],", "  [0 0]]")
    return gen(base, "--tree", f"static:{f}"), r"tree\.json:2: not valid JSON .*e\.g\. \[\[0\], \[1\], \[0, 0\]\]"


@case
def tree_static_missing_parent(tmp, base):
    f = lines(tmp, "tree.json", "[[0], [1, 0]]")
    return gen(base, "--tree", f"static:{f}"), r"tree\.json: path \[1, 0\] has no parent path \[1\]; add it"


@case
def tree_static_not_ranks(tmp, base):
    f = lines(tmp, "tree.json", '[[0], [0, "a"], [-1]]')
    return gen(base, "--tree", f"static:{f}"), r"tree\.json: not a list of non-empty lists of ranks >= 0"


# --- evaluate: prompt files and --out ------------------------------------------------------------

@case
def prompts_jsonl_first_line_not_json(tmp, base):
    p = lines(tmp, "p.jsonl", "What is 2+2?", '{"turns": 5}')
    return ev(base, p, tmp / "out"), r"p\.jsonl:1: not valid JSON .*one JSON object per line"


@case
def prompts_jsonl_turns_not_a_list(tmp, base):
    p = lines(tmp, "p.jsonl", '{"turns": 5}')
    return ev(base, p, tmp / "out"), r"p\.jsonl:1: 'turns' must be a non-empty list of non-empty strings"


@case
def prompts_jsonl_bad_later_line(tmp, base):
    p = lines(tmp, "p.jsonl", '{"prompt": "Once"}', '{"prompt": "Then",', '{"prompt": 3}')
    return ev(base, p, tmp / "out"), r"p\.jsonl:2: not valid JSON"


@case
def prompts_missing(tmp, base):
    return ev(base, tmp / "p.jsonl", tmp / "out"), r"prompt file not found: .*p\.jsonl"


@case
def prompts_not_utf8(tmp, base):
    p = tmp / "p.txt"
    p.write_bytes(b"Once upon\n\xff\xfe a time\n")
    return ev(base, p, tmp / "out"), r"p\.txt: not a UTF-8 text file"


@case
def evaluate_out_is_a_file(tmp, base):
    (tmp / "out").write_text("mine\n")
    return ev(base, lines(tmp, "p.txt", "Once"), tmp / "out"), r"--out .*out is a file, not a directory"


@case
def evaluate_out_under_a_file(tmp, base):
    (tmp / "f").write_text("mine\n")
    return ev(base, lines(tmp, "p.txt", "Once"), tmp / "f" / "out"), r"--out .*f/out: .*f is a file, not a directory"


@case
def evaluate_out_no_permission(tmp, base):
    if os.geteuid() == 0:
        pytest.skip("root writes anywhere: a read-only mount shows the same message (see the module docstring)")
    (tmp / "ro").mkdir(mode=0o500)
    return ev(base, lines(tmp, "p.txt", "Once"), tmp / "ro" / "out"), \
        r"--out .*ro/out: cannot write in .*ro \(Permission denied\); point --out at a directory you can write"


@full_disk
def evaluate_out_disk_full(tmp, base):
    out = tmp / "out"
    out.mkdir()
    (out / "report.json").write_text('{"an earlier": "report"}\n')
    return ev(base, lines(tmp, "p.txt", "Once"), out), r"--out .*out: disk full .*nothing was written"


# --- export and doctor --------------------------------------------------------------------------

@case
def export_truncated_weights(tmp, base):
    d = copy(base / "eagle1", tmp / "d")
    truncate(d / "model.safetensors")
    return ["export", str(d), "--format", "native", "--out", str(tmp / "x")], \
        r"d/model\.safetensors: not a readable safetensors file"


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
    return ["export", str(base / "eagle1"), "--format", "native", "--out", str(tmp / "x")], \
        r"--out .*x: disk full .*nothing was written: free some space"


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


# --- training: recipes, data, feature cache, checkpoints ----------------------------------------

def train(tmp: Path, base: Path, cmd: str = "train", yaml: str | None = None, **extra: str | None) -> list[str]:
    """`draftsmith CMD r.yaml` with train_overrides (an override given as None is left out)."""
    r = tmp / "r.yaml"
    r.write_text(yaml if yaml is not None else f"target: {base / 'target'}\n")
    return [cmd, str(r), *[o for o in train_overrides(base, tmp / "run", **extra) if not o.endswith("=None")]]


@case
def recipe_malformed_yaml(tmp, base):
    return train(tmp, base, yaml=f"target: {base / 'target'}\ntrain:\n  steps: [1\n  lr: 3\n"), \
        r"r\.yaml:\d: not valid YAML .*fix that line"


@case
def recipe_wrong_type(tmp, base):
    return train(tmp, base, yaml=f"target: {base / 'target'}\ntrain:\n  lr: fast\n"), r"r\.yaml: .*train\.lr"


@case
def recipe_unknown_key(tmp, base):
    return train(tmp, base, yaml=f"target: {base / 'target'}\ntrain:\n  stepz: 3\n"), \
        r"unknown key 'train\.stepz'; did you mean 'train\.steps'"


@case
def run_dir_is_a_file(tmp, base):
    (tmp / "run").write_text("mine\n")
    return train(tmp, base), r"run_dir .*run is a file, not a directory"


@case
def data_jsonl_bad_line(tmp, base):
    d = lines(tmp, "d.jsonl", '{"text": "Once upon a time"}', '{"text": "no end', '{"text": "x"}')
    return train(tmp, base, "features", **{"data.source": str(d), "features.cache_dir": str(tmp / "c")}), \
        r"d\.jsonl:2: not valid JSON .*fix or remove the record"


@case
def sharegpt_unknown_speaker(tmp, base):
    d = lines(tmp, "d.jsonl", json.dumps({"conversations": [{"from": "human", "value": "hi"},
                                                            {"from": "robot", "value": "hello"}]}))
    return train(tmp, base, "features", **{"data.source": str(d), "features.cache_dir": str(tmp / "c")}), \
        r"d\.jsonl row 0, conversations\[1\]: unknown speaker 'robot'"


@case
def sharegpt_missing_value(tmp, base):
    d = lines(tmp, "d.jsonl", json.dumps({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt"}]}))
    return train(tmp, base, "features", **{"data.source": str(d), "features.cache_dir": str(tmp / "c")}), \
        r"d\.jsonl row 0, conversations\[1\]: missing field 'value'"


@case
def feature_shard_truncated(tmp, base):
    c = copy(base / "cache", tmp / "c")
    truncate(c / "shard_00000.safetensors")
    return train(tmp, base, **{"features.cache_dir": str(c)}), \
        r"feature shard .*c/shard_00000\.safetensors is unreadable .*delete it and rerun"


@case
def feature_index_corrupt(tmp, base):
    c = copy(base / "cache", tmp / "c")
    truncate(c / "index.json", 50)
    return train(tmp, base, **{"features.cache_dir": str(c)}), r"c/index\.json is unreadable .*delete .*c and rerun"


@case
def train_checkpoint_truncated(tmp, base):
    run = copy(base / "run", tmp / "run")
    truncate(run / "checkpoints" / "step_2" / "model.safetensors")
    return train(tmp, base, **{"train.steps": "4"}), \
        r"checkpoint .*run/checkpoints/step_2 is unreadable .*delete it to resume from the one before"


# --- training: every setting out of its range, refused before any work (train/settings.py) ---------

def setting_case(name: str, overrides: dict[str, str], want: str, cmd: str = "train") -> None:
    def build(tmp, base):
        return train(tmp, base, cmd, **overrides), want
    build.__name__ = name
    case(build)


for _name, _over, _want in [
    # the cases of issue 20, as a new user tried them
    ("train_mixed_precision_off", {"train.mixed_precision": "off"},
     r"'train\.mixed_precision': Invalid value 'off', expected one of \['auto', 'no', 'bf16'\]; set train\.mixed_precision to one of"),
    ("train_grad_accum_0", {"train.grad_accum": "0"}, r"train\.grad_accum=0: must be an integer >= 1 .*set train\.grad_accum=1 or more"),
    ("train_threads_negative", {"train.threads": "-3"}, r"train\.threads=-3: must be an integer >= 0"),
    ("train_steps_0", {"train.steps": "0"}, r"train\.steps=0: trains nothing .*or train\.eval_only=true"),
    ("train_lr_negative", {"train.lr": "-1"}, r"train\.lr=-1\.0: must be a number > 0\.0 .*set train\.lr to a positive"),
    ("eagle3_ttt_steps_0", {"drafter.eagle3.ttt_steps": "0"}, r"drafter\.eagle3\.ttt_steps=0: must be an integer >= 1"),
    # the rest of train.*
    ("train_steps_negative", {"train.steps": "-5"}, r"train\.steps=-5: must be an integer >= 0"),
    ("train_batch_size_0", {"train.batch_size": "0"}, r"train\.batch_size=0: must be an integer >= 1"),
    ("train_beta2_1", {"train.beta2": "1"}, r"train\.beta2=1\.0: must be in \[0, 1\)"),
    ("train_weight_decay_negative", {"train.weight_decay": "-0.1"}, r"train\.weight_decay=-0\.1: must be a number >= 0\.0"),
    ("train_min_lr_ratio_2", {"train.min_lr_ratio": "2"}, r"train\.min_lr_ratio=2\.0: must be in \[0, 1\]"),
    ("train_warmup_negative", {"train.warmup_steps": "-1"}, r"train\.warmup_steps=-1: must be an integer >= 0"),
    ("train_max_grad_norm_negative", {"train.max_grad_norm": "-1"}, r"train\.max_grad_norm=-1\.0: must be a number >= 0"),
    ("train_eval_batches_0", {"train.eval_batches": "0"}, r"train\.eval_batches=0: must be an integer >= 1"),
    ("train_keep_checkpoints_0", {"train.keep_checkpoints": "0"}, r"train\.keep_checkpoints=0: must be an integer >= 1"),
    ("train_log_every_0", {"train.log_every": "0"}, r"train\.log_every=0: must be an integer >= 1"),
    ("train_save_every_negative", {"train.save_every": "-2"}, r"train\.save_every=-2: must be an integer >= 0"),
    ("train_sim_chain_0", {"train.sim_chain": "0"}, r"train\.sim_chain=0: must be an integer >= 1"),
    ("train_sim_tree_unknown", {"train.sim_tree": "bushy"}, r"train\.sim_tree=bushy: must be a tree shape: chain \|"),
    ("train_sim_prompts_missing", {"train.sim_prompts": "/no/such/prompts.txt"},
     r"train\.sim_prompts=/no/such/prompts\.txt: must be an existing file .*point it at a file that exists"),
    ("train_resume_missing", {"train.resume": "/no/such/step_4"}, r"train\.resume=/no/such/step_4: must be auto \| never \|"),
    ("train_pack_length_short", {"train.pack_length": "8"}, r"train\.pack_length=8: must be 0 or >= data\.max_length \(24\)"),
    ("train_report_to_unknown", {"train.report_to": "mlflow"}, r"'train\.report_to': Invalid value 'mlflow'"),
    ("train_eval_only_not_bool", {"train.eval_only": "maybe"}, r"'train\.eval_only': Value 'maybe' is not a valid bool"),
    # data.*
    ("data_max_length_1", {"data.max_length": "1"}, r"data\.max_length=1: must be an integer >= 2"),
    ("data_held_out_1", {"data.held_out": "1"}, r"data\.held_out=1\.0: must be in \[0, 1\)"),
    ("data_max_records_negative", {"data.max_records": "-1"}, r"data\.max_records=-1: must be an integer >= 0"),
    ("data_overflow_unknown", {"data.overflow": "wrap"}, r"'data\.overflow': Invalid value 'wrap'"),
    ("regen_top_p_0", {"data.regenerate.top_p": "0"}, r"data\.regenerate\.top_p=0\.0: must be in \(0, 1\]"),
    ("regen_temperature_negative", {"data.regenerate.temperature": "-1"}, r"data\.regenerate\.temperature=-1\.0"),
    ("regen_batch_size_0", {"data.regenerate.batch_size": "0"}, r"data\.regenerate\.batch_size=0: must be an integer >= 1"),
    ("regen_stop_ids_negative", {"data.regenerate.stop_ids": "[1, -2]"},
     r"data\.regenerate\.stop_ids=\[1, -2\]: must be a list of values each an integer >= 0"),
    # features.*
    ("features_target_dtype_unknown", {"features.target_dtype": "float8"}, r"features\.target_dtype=float8: must be auto \(bf16 where it pays\) or a dtype name"),
    ("features_attn_unknown", {"features.attn": "flash"}, r"features\.attn=flash: must be one of \['sdpa', 'eager'\]"),
    ("features_topk_negative", {"features.topk": "-1"}, r"features\.topk=-1: must be an integer >= 0"),
    ("features_shard_size_0", {"features.shard_size": "0"}, r"features\.shard_size=0: must be an integer >= 1"),
    ("features_hidden_ids_negative", {"features.hidden_ids": "[-1]"}, r"features\.hidden_ids=\[-1\]: must be a list"),
    ("features_dtype_unknown", {"features.dtype": "int8"}, r"'features\.dtype': Invalid value 'int8'"),
    # each drafter section
    ("eagle3_draft_vocab_0", {"drafter.eagle3.draft_vocab_size": "0"}, r"drafter\.eagle3\.draft_vocab_size=0"),
    ("eagle3_step_decay_0", {"drafter.eagle3.step_decay": "0"}, r"drafter\.eagle3\.step_decay=0\.0: must be in \(0, 1\]"),
    ("eagle1_feature_noise_negative", {"drafter.eagle1.feature_noise": "-0.5"}, r"drafter\.eagle1\.feature_noise=-0\.5"),
    ("eagle1_ce_weight_negative", {"drafter.eagle1.ce_weight": "-1"}, r"drafter\.eagle1\.ce_weight=-1\.0: must be a number >= 0"),
    ("medusa_num_heads_0", {"drafter.medusa.num_heads": "0"}, r"drafter\.medusa\.num_heads=0: must be an integer >= 1"),
    ("medusa_loss_unknown", {"drafter.medusa.loss": "mse"}, r"drafter\.medusa\.loss=mse: must be one of \['ce', 'kl'\]"),
    ("layerskip_mode_unknown", {"drafter.layerskip.mode": "fully"}, r"drafter\.layerskip\.mode=fully: must be one of"),
    ("layerskip_lora_dropout_1", {"drafter.layerskip.lora_dropout": "1"}, r"drafter\.layerskip\.lora_dropout=1\.0: must be in \[0, 1\)"),
    ("layerskip_curriculum_unknown", {"drafter.layerskip.curriculum": "random"}, r"drafter\.layerskip\.curriculum=random"),
    ("layerskip_exits_0", {"drafter.layerskip.exits": "[0, 2]"}, r"drafter\.layerskip\.exits=\[0, 2\]: must be a list"),
    ("drafter_kind_unknown", {"drafter.kind": "hydra"}, r"'drafter\.kind': Invalid value 'hydra'"),
    ("seed_negative", {"seed": "-1"}, r"seed=-1: must be an integer >= 0"),
    # the same checks under `draftsmith features`
    ("features_cmd_batch_size_0", {"features.batch_size": "0"}, r"features\.batch_size=0: must be an integer >= 1"),
]:
    setting_case(_name, _over, rf"override '[^']*': {_want}" if not _want.startswith("'") else _want,
                 "features" if _name.startswith("features_cmd") else "train")


@case
def recipe_setting_out_of_range(tmp, base):
    """A value from the recipe file, not an override: the error names the file."""
    return train(tmp, base, yaml=f"target: {base / 'target'}\ntrain:\n  grad_accum: 0\n", **{"train.grad_accum": None}), \
        r"r\.yaml: train\.grad_accum=0: must be an integer >= 1"


# --- the sweep ------------------------------------------------------------------------------------

def snapshot(*roots: Path) -> dict[str, str]:
    """Every file and directory under roots: path -> size and content hash (or 'dir')."""
    out = {}
    for root in roots:
        for p in sorted(root.rglob("*")):
            out[str(p)] = "dir" if p.is_dir() else f"{p.stat().st_size}:{hashlib.sha1(p.read_bytes()).hexdigest()}"
    return out


def check_error(rc: int, err: str, want: str) -> None:
    assert rc == 2, err
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "\n" not in errors[0], err
    assert err.strip().splitlines()[-1] == errors[0], err  # the error is the last word
    assert re.search(want, errors[0]), f"{want!r} not in {errors[0]!r}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input(name, tmp_path, base, capsys):
    argv, want = CASES[name](tmp_path, base)
    before = snapshot(tmp_path, base)
    capsys.readouterr()
    rc = draftsmith(argv)
    check_error(rc, capsys.readouterr().err, want)
    after = snapshot(tmp_path, base)
    for rel in MAY_CHANGE.get(name, ()):
        before.pop(str(tmp_path / rel)), after.pop(str(tmp_path / rel))
    for rel in MAY_STAMP.get(name, ()):
        before.pop(str(base / rel), None), after.pop(str(base / rel))
    assert after == before


@pytest.mark.parametrize("name", sorted(FULL_DISK))
def test_full_disk(name, tmp_path, base, capsys):
    """A full disk while writing --out, simulated by a 16 KiB file-size limit (writes fail with EFBIG, which
    reads as ENOSPC does; Python ignores SIGXFSZ). The limit is lifted again right after the command."""
    argv, want = FULL_DISK[name](tmp_path, base)
    before = snapshot(tmp_path, base)
    capsys.readouterr()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (16 * 1024, hard))
    try:
        rc = draftsmith(argv)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    check_error(rc, capsys.readouterr().err, want)
    assert snapshot(tmp_path, base) == before


def test_the_sweep_is_wide():
    assert len(CASES) + len(FULL_DISK) >= 100


def test_a_bad_setting_exits_2_from_the_command_line(tmp_path, base):
    """The same refusal through a real `python -m train` process: exit status 2, one error line, no run dir."""
    import subprocess
    import sys

    argv = train(tmp_path, base, **{"train.grad_accum": "0"})[1:]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    p = subprocess.run([sys.executable, "-m", "train", *argv], capture_output=True, text=True, env=env, timeout=300)
    check_error(p.returncode, p.stderr, r"train\.grad_accum=0: must be an integer >= 1")
    assert not (tmp_path / "run").exists()
