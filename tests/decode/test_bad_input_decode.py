"""The bad-input sweep (tests/bad_input.py) of `draftsmith generate`: a damaged target directory, nonsense
decoding options, --drafter SPECs out of range and static tree files that are not trees. A damaged drafter
directory is in tests/drafters/test_bad_input_drafters.py."""

from __future__ import annotations

import pytest

from tests.bad_input import (
    Case,
    base_fixture,  # noqa: F401 - the `base` fixture (the shared inputs), found by name
    check_case,
    copy,
    gen,
    lines,
    registrar,
    truncate,
)

CASES: dict[str, Case] = {}
case = registrar(CASES)


# --- decode: damaged target files -------------------------------------------------------------


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
    (
        "tree_dynamic_unknown_key",
        ("--tree", "dynamic:width=3"),
        r"--tree 'dynamic:width=3': option 'width=3' not one of",
    ),
    ("tree_dynamic_not_int", ("--tree", "dynamic:topk=many"), r"--tree 'dynamic:topk=many': topk needs an integer"),
    ("tree_unknown_kind", ("--tree", "bushy"), r"--tree 'bushy': expected chain \| static:FILE \| dynamic"),
    ("policy_unknown", ("--policy", "greedy"), r"--policy 'greedy': available policies are"),
    ("policy_threshold_p_2", ("--policy", "threshold:p=2"), r"--policy threshold:p=2\.0: p must be in \[0, 1\]"),
    (
        "policy_option_not_int",
        ("--policy", "learning:max=x"),
        r"--policy 'learning:max=x': max needs an integer, got 'x'",
    ),
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
    return gen(
        base, drafter="prompt-lookup:ngram=x"
    ), r"drafter 'prompt-lookup:ngram=x': ngram needs an integer, got 'x'"


@case
def drafter_early_exit_out_of_range(tmp, base):
    return gen(base, drafter="early-exit:9"), r"early-exit:9: K must be in 1\.\.4 for a 5-layer target"


# --- decode: static tree files ----------------------------------------------------------------


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


# --- the sweep over this file's cases ---------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input(name, tmp_path, base, capsys):
    check_case(CASES[name], tmp_path, base, capsys)
