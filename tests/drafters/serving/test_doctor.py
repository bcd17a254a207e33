"""`draftsmith doctor`: OK for a drafter on its own target; each injected mismatch is caught and named, with a fix."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from decode.cli import main as draftsmith
from decode.target import Target
from drafters.serving.checkpoint import save_drafter
from drafters.serving.doctor import diagnose, main
from drafters.serving.export import export
from tests.conftest import STORIES, tiny_model
from tests.drafters.batches import build

FORMATS = {"native": "eagle3", "eagle3": "eagle3", "speculators": "eagle3", "medusa-vllm": "medusa"}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    """A tiny Qwen3 target dir, a wider and a smaller-vocabulary one, and a drafter in every layout."""
    root = tmp_path_factory.mktemp("doctor")
    for name, kw in {"target": {}, "wide": {"hidden": 48}, "small_vocab": {"vocab": 96}}.items():
        tiny_model("qwen3", seed=3, **kw).save_pretrained(root / name)
    target = Target.load(root / "target")
    out = {"target": root / "target", "wide": root / "wide", "small_vocab": root / "small_vocab"}
    for kind in ("eagle3", "medusa", "layerskip-lora"):
        save_drafter(build(kind, Target.load(root / "target")), root / f"native-{kind}", target_id=str(root / "target"))
        out[f"native-{kind}"] = root / f"native-{kind}"
    for fmt in ("eagle3", "speculators", "medusa-vllm"):
        src = out["native-medusa" if fmt == "medusa-vllm" else "native-eagle3"]
        out[fmt] = export(src, fmt, root / fmt, target=str(root / "target"))
    assert target.vocab_size == 128
    return out


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_config(path: Path, edit) -> None:
    cfg = json.loads((path / "config.json").read_text())
    edit(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    "layout", ["native-eagle3", "native-medusa", "native-layerskip-lora", "eagle3", "speculators", "medusa-vllm"]
)
def test_ok_on_its_own_target(dirs, capsys, layout):
    assert main([str(dirs[layout]), "--target", str(dirs["target"])]) == 0
    out = capsys.readouterr().out
    assert "OK: fits target" in out and "problem" not in out


def test_sglang_summary_shows_both_id_conventions(dirs, capsys):
    assert draftsmith(["doctor", str(dirs["eagle3"]), "--target", str(dirs["target"])]) == 0
    assert "capture ids (HF) [1, 2, 3] = SGLang [0, 1, 2]" in capsys.readouterr().out


SGLANG_INJECTIONS = {  # name -> (config edit, the problem's text)
    "capture id": (
        lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[0, 1, 5]),
        "capture ids [5] out of range -1..2 for a 4-layer target (SGLang ids = HF hidden-state ids - 1)",
    ),
    "max positions": (
        lambda c: c.update(max_position_embeddings=2048),
        "max_position_embeddings is 2048, the target's is 512",
    ),
    "rope theta": (lambda c: c.update(rope_theta=5e5), "rope_theta is 500000, the target's is 10000"),
    "rope scaling": (
        lambda c: c.update(rope_scaling={"rope_type": "linear", "factor": 2.0}),
        "rope_scaling is {'rope_type': 'linear', 'factor': 2.0}, the target's is None",
    ),
    "head dim": (lambda c: c.update(head_dim=16), "head_dim is 16, the target's is 8"),
    "kv heads": (lambda c: c.update(num_key_value_heads=4), "num_key_value_heads is 4, the target's is 2"),
    "tied head": (lambda c: c.update(tie_word_embeddings=True), "tie_word_embeddings is true"),
}


@pytest.mark.parametrize("name", list(SGLANG_INJECTIONS))
def test_injected_config_mismatch_is_caught(dirs, tmp_path, capsys, name):
    edit, problem = SGLANG_INJECTIONS[name]
    bad = copy(dirs["eagle3"], tmp_path / "bad")
    edit_config(bad, edit)
    assert main([str(bad), "--target", str(dirs["target"])]) == 1
    out = capsys.readouterr().out
    assert problem in out and "fix:" in out and "OK" not in out


def test_speculators_capture_ids_use_vllm_convention(dirs, tmp_path):
    bad = copy(dirs["speculators"], tmp_path / "bad")
    edit_config(bad, lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 2, 4]))
    whats = [p.what for p in diagnose(bad, str(dirs["target"])).problems]
    assert whats == ["capture ids [4] out of range 0..3 for a 4-layer target (vLLM ids = HF hidden-state ids)"]
    edit_config(bad, lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 2, 3], norm_before_residual=True))
    assert [p.what for p in diagnose(bad, str(dirs["target"])).problems] == ["norm_before_residual is True"]


@pytest.mark.parametrize("layout", ["eagle3", "speculators", "medusa-vllm", "native-eagle3", "native-medusa"])
@pytest.mark.parametrize(
    "other,problem",
    [
        (
            "wide",
            {
                "engine": "hidden_size is 32, the target's is 48",
                "native": "hidden_size: drafter trained for 32, target has 48",
            },
        ),
        (
            "small_vocab",
            {
                "engine": "vocab_size is 128, the target's is 96",
                "native": "vocab_size: drafter trained for 128, target has 96",
            },
        ),
    ],
)
def test_other_target_is_caught(dirs, capsys, layout, other, problem):
    assert main([str(dirs[layout]), "--target", str(dirs[other])]) == 1
    assert problem["native" if layout.startswith("native") else "engine"] in capsys.readouterr().out


def test_native_capture_ids_out_of_range(dirs, tmp_path):
    bad = copy(dirs["native-eagle3"], tmp_path / "bad")
    edit_config(bad, lambda c: c.update(capture_ids=[1, 2, 9]))
    whats = [p.what for p in diagnose(bad, str(dirs["target"])).problems]
    assert whats == ["capture ids [9] out of range 0..3 for a 4-layer target (HF hidden-state ids)"]


@pytest.mark.parametrize(
    "layout,key",
    [
        ("eagle3", "midlayer.self_attn.q_proj.weight"),
        ("native-medusa", "blocks.2.layers.1.weight"),
        ("medusa-vllm", "lm_heads.1.weight"),
    ],
)
@pytest.mark.parametrize("how", ["extra", "missing", "shape"])
def test_tampered_weights_name_the_key(dirs, tmp_path, layout, key, how):
    bad = copy(dirs[layout], tmp_path / "bad")
    state = load_file(str(bad / "model.safetensors"))
    if how == "extra":
        key = "blocks.9.layers.0.weight" if "medusa" in layout else "midlayer.extra.weight"
        state[key] = torch.zeros(2)
        want = f"unexpected key {key}"
    elif how == "missing":
        del state[key]
        want = f"key {key} is missing"
    else:
        state[key] = torch.zeros(3, 3)
        want = f"key {key} has shape [3, 3]"
    save_file(state, str(bad / "model.safetensors"))
    whats = [p.what for p in diagnose(bad, str(dirs["target"])).problems]
    assert len(whats) == 1 and want in whats[0]


def test_default_capture_ids_are_a_note(dirs, tmp_path):
    """Releases without eagle_config get SGLang's default ids (2, L//2, L-3) as HF ids: a note, not a problem."""
    d = copy(dirs["eagle3"], tmp_path / "d")
    edit_config(d, lambda c: c.pop("eagle_config"))
    rep = diagnose(d, str(dirs["target"]))
    assert not rep.problems and "capture ids (HF) [2, 2, 1] = SGLang [1, 1, 0] (engine default)" in rep.summary
    assert any("names no capture ids" in n for n in rep.notes)


def test_embedding_copy_is_a_note_not_a_problem(dirs, tmp_path):
    d = copy(dirs["eagle3"], tmp_path / "d")
    state = load_file(str(d / "model.safetensors"))
    save_file({**state, "embed_tokens.weight": torch.zeros(128, 32)}, str(d / "model.safetensors"))
    rep = diagnose(d, str(dirs["target"]))
    assert not rep.problems and any("embed_tokens.weight is in the file" in n for n in rep.notes)


def test_tokenizer_identity(tmp_path):
    """stories260K has a tokenizer: exports ship it, and a drafter with another vocabulary is caught."""
    from drafters.trainable.eagle3 import Eagle3, Eagle3Config

    target = Target.load(STORIES)
    native = save_drafter(
        Eagle3(target, Eagle3Config(draft_vocab_size=128)), tmp_path / "native", target_id=str(STORIES)
    )
    exported = export(native, "eagle3", tmp_path / "eagle3")
    assert (exported / "tokenizer.json").is_file()
    for d in (native, exported):
        assert not diagnose(d, str(STORIES)).problems
    tok = json.loads((exported / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    word = next(w for w in vocab if len(w) > 3)
    vocab[word + "x"] = vocab.pop(word)
    (exported / "tokenizer.json").write_text(json.dumps(tok))
    edit_config(native, lambda c: c["target"].update(tokenizer="0123456789abcdef"))
    for d, where in (
        (native, "the tokenizer it was trained with"),
        (exported, "the tokenizer shipped with the drafter"),
    ):
        whats = [p.what for p in diagnose(d, str(STORIES)).problems]
        assert whats == [f"tokenizer: {where} differs from the target's (vocabulary or special ids)"]


def test_unreadable_input_exits_2(tmp_path, dirs, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    assert main([str(tmp_path), "--target", str(dirs["target"])]) == 2
    assert "no layout draftsmith knows" in capsys.readouterr().err
    assert main([str(tmp_path / "nowhere"), "--target", str(dirs["target"])]) == 2


# --- the three silent engine defects of issue 13, each on a directory crafted to have it ---------------------


def test_full_vocab_with_draft_vocab_keys_is_flagged(dirs, tmp_path, capsys):
    from drafters.trainable.eagle3 import Eagle3, Eagle3Config

    target = Target.load(dirs["target"])
    native = save_drafter(
        Eagle3(target, Eagle3Config(draft_vocab_size=128, ttt_steps=2)), tmp_path / "n", target_id=str(dirs["target"])
    )
    good = export(native, "speculators", tmp_path / "good", target=str(dirs["target"]))
    assert not diagnose(good, str(dirs["target"])).problems
    bad = copy(good, tmp_path / "bad")
    state = load_file(str(bad / "model.safetensors"))
    save_file(
        {**state, "d2t": torch.zeros(128, dtype=torch.long), "t2d": torch.ones(128, dtype=torch.bool)},
        str(bad / "model.safetensors"),
    )
    assert main([str(bad), "--target", str(dirs["target"])]) == 1
    out = capsys.readouterr().out
    assert "d2t/t2d are in the file, but the draft vocabulary is the whole target vocabulary: vLLM refuses them" in out
    assert "fix: delete d2t and t2d" in out and "unexpected key" not in out


def test_unsorted_capture_ids_are_flagged(dirs, tmp_path, capsys):
    bad = copy(dirs["speculators"], tmp_path / "bad")
    edit_config(bad, lambda c: c.update(eagle_aux_hidden_state_layer_ids=[3, 1, 2]))
    assert main([str(bad), "--target", str(dirs["target"])]) == 1
    out = capsys.readouterr().out
    assert "capture ids [3, 1, 2] are not ascending: engines concatenate the captured states in layer order" in out
    assert "fix: re-export with draftsmith export" in out


def test_sglang_ids_without_engine_are_flagged(dirs, tmp_path, capsys):
    """An eagle3 directory with explicit ids that no one says are SGLang's: vLLM would read them one layer low."""
    bad = copy(dirs["eagle3"], tmp_path / "bad")
    edit_config(bad, lambda c: c.pop("draftsmith"))
    assert main([str(bad), "--target", str(dirs["target"])]) == 1
    out = capsys.readouterr().out
    assert (
        "eagle_aux_hidden_state_layer_ids [0, 1, 2] are read by SGLang as HF hidden-state ids [1, 2, 3] but by "
        "vLLM as [0, 1, 2]"
    ) in out
    assert "fix: for vLLM export --format speculators (or --format eagle3 --engine vllm)" in out
    assert not diagnose(dirs["eagle3"], str(dirs["target"])).problems  # draftsmith's own export says whose ids


def test_missing_embedding_is_a_warning_with_its_fix(dirs):
    rep = diagnose(dirs["speculators"], str(dirs["target"]))
    assert not rep.problems
    assert any(
        n.startswith("warning: no embed_tokens.weight: speculators 0.9.0 leaves embed_tokens uninitialised")
        and "--with-embeddings" in n
        for n in rep.notes
    )
