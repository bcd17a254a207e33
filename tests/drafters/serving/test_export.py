"""Export to serving layouts and import back: identical drafts for every kind and format, golden Qwen3-14B
layouts built on the meta device, and refusals (unfit formats, foreign targets, tampered files)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from decode.generate import generate
from decode.target import Target
from decode.tree import Shape
from drafters.registry import make_drafter
from drafters.serving import export as export_mod
from drafters.serving.checkpoint import load_drafter, native_meta, save_drafter
from drafters.serving.engine_dirs import load_eagle3
from drafters.serving.export import export, main
from drafters.serving.layouts.formats import check_export, plan, planned_shapes
from drafters.serving.layouts.rules import TargetFacts
from tests.conftest import tiny_model
from tests.drafters.batches import KINDS, build, make_batch, random_sequences, record_rounds
from tests.drafters.trainable.test_eagle import QWEN3_14B, qwen3_14b_on_meta

PROMPT = torch.tensor([1, 5, 9, 33, 17, 4, 60])
SHAPES = (Shape("chain", k=3), Shape("dynamic", topk=3, depth=3, nodes=8))
LAYER = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
         "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight",
         "hidden_norm.weight", "post_attention_layernorm.weight")


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    """A tiny random Qwen3 target saved as a model directory (exports read its config and LM head)."""
    out = tmp_path_factory.mktemp("target")
    tiny_model("qwen3", seed=3).save_pretrained(out)
    return out


def run_dir(tmp: Path, module, target_dir: Path) -> Path:
    save_drafter(module, tmp / "run" / "export", target_id=str(target_dir))
    return tmp / "run"


def drafts(drafter, target: Target) -> list:
    """Every round's tree (tokens, parents) and the output, for each draft shape."""
    out = []
    for shape in SHAPES:
        rounds = record_rounds(drafter)
        tokens = generate(target, drafter, PROMPT, 12, shape=shape).tokens
        out.append(([(t.tokens.tolist(), t.parents.tolist()) for t in rounds], tokens))
        del drafter.propose  # unwrap record_rounds for the next shape
    return out


# --- round trips ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_native_export_round_trip(tmp_path, target_dir, kind):
    target = Target.load(target_dir)
    m = build(kind, target)
    out = export(run_dir(tmp_path, m, target_dir), "native", tmp_path / "native")
    files = ["README.md", "config.json", "model.safetensors"]  # README.md: the model card (test_model_card.py)
    assert sorted(p.name for p in out.iterdir()) == sorted(files + ["adapter"] * (kind == "layerskip-lora"))
    fresh = Target.load(target_dir)  # a LoRA drafter injects into its target: load the copy on a new one
    loaded = load_drafter(out, fresh)
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in m.state_dict().items())
    assert drafts(m.drafter(), target) == drafts(loaded.drafter(), fresh)


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


@pytest.mark.parametrize("per_head,once", [(False, False), (False, True), (True, False)],
                         ids=["shared-copies", "shared-once", "per-head"])
def test_medusa_vllm_round_trip(tmp_path, target_dir, per_head, once):
    from drafters.trainable.medusa import Medusa, MedusaConfig

    target = Target.load(target_dir)
    torch.manual_seed(0)
    m = Medusa(target, MedusaConfig(num_heads=3, num_layers=2, per_head_vocab=per_head))
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # trained-looking, and per-head matrices unlike the target's
    out = export(run_dir(tmp_path, m, target_dir), "medusa-vllm", tmp_path / "medusa", shared_head_once=once)
    cfg = json.loads((out / "config.json").read_text())
    state = load_file(str(out / "model.safetensors"))
    heads = [0] if once else [0, 1, 2]
    assert set(state) == {f"blocks.{k}.layers.{j}.{w}" for k in range(3) for j in range(2) for w in ("weight", "bias")} \
        | {f"lm_heads.{k}.weight" for k in heads}
    assert (cfg["num_heads"], cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == (3, 2, 32, 128)
    assert cfg["medusa_fc_bias"] is True and cfg.get("original_lm_head", False) is once
    if not per_head:  # vLLM reads a head per Medusa head: copies of the target's
        assert all(torch.equal(state[f"lm_heads.{k}.weight"], target.lm_head.weight) for k in heads)
    imported = make_drafter(str(out), target)
    assert imported.m.config.per_head_vocab is per_head
    assert drafts(m.drafter(), target) == drafts(imported, target)


def test_dtype_cast_keeps_index_tensors(tmp_path, target_dir):
    m = build("eagle3", Target.load(target_dir))
    out = export(run_dir(tmp_path, m, target_dir), "eagle3", tmp_path / "bf16", dtype="bfloat16")
    state = load_file(str(out / "model.safetensors"))
    assert state["fc.weight"].dtype == torch.bfloat16 and state["d2t"].dtype == torch.long
    assert state["t2d"].dtype == torch.bool
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


# --- golden layouts at Qwen3-14B sizes (meta device: no weights) -----------------------------------------

QWEN3_14B_EAGLE3 = {  # what SGLang's LlamaForCausalLMEagle3 loads for Qwen3-14B with a 32k draft vocabulary
    "midlayer.self_attn.q_proj.weight": (5120, 10240), "midlayer.self_attn.k_proj.weight": (1024, 10240),
    "midlayer.self_attn.v_proj.weight": (1024, 10240), "midlayer.self_attn.o_proj.weight": (5120, 5120),
    "midlayer.mlp.gate_proj.weight": (17408, 5120), "midlayer.mlp.up_proj.weight": (17408, 5120),
    "midlayer.mlp.down_proj.weight": (5120, 17408), "midlayer.input_layernorm.weight": (5120,),
    "midlayer.hidden_norm.weight": (5120,), "midlayer.post_attention_layernorm.weight": (5120,),
    "fc.weight": (5120, 15360), "norm.weight": (5120,), "lm_head.weight": (32000, 5120), "d2t": (32000,),
    "t2d": (151936,),
}


def qwen3_14b_facts() -> TargetFacts:
    return TargetFacts.of(json.loads(QWEN3_14B.read_text()), "Qwen/Qwen3-14B")


@pytest.mark.parametrize("fmt", ["eagle3", "speculators"])
def test_qwen3_14b_eagle3_golden_layout(fmt):
    from drafters.trainable.eagle3 import Eagle3

    m = Eagle3(qwen3_14b_on_meta())
    native = {k: tuple(v.shape) for k, v in m.state_dict().items()}
    cfg, sources = plan(fmt, native_meta(m, target_id="Qwen/Qwen3-14B"), list(native), qwen3_14b_facts())
    shapes = planned_shapes(sources, native, qwen3_14b_facts())
    golden = QWEN3_14B_EAGLE3 if fmt == "eagle3" else {
        k.replace("midlayer.", "layers.0."): v for k, v in QWEN3_14B_EAGLE3.items()}
    assert shapes == golden
    check_export(fmt, cfg, shapes, qwen3_14b_facts())  # the exporter's own gate passes
    layer = cfg if fmt == "eagle3" else cfg["transformer_layer_config"]
    assert {k: layer[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                  "head_dim", "intermediate_size", "vocab_size", "max_position_embeddings",
                                  "rope_theta", "rope_scaling", "rms_norm_eps", "tie_word_embeddings")} == {
        "hidden_size": 5120, "num_hidden_layers": 1, "num_attention_heads": 40, "num_key_value_heads": 8,
        "head_dim": 128, "intermediate_size": 17408, "vocab_size": 151936, "max_position_embeddings": 40960,
        "rope_theta": 1e6, "rope_scaling": None, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
    assert cfg["draft_vocab_size"] == 32000
    if fmt == "eagle3":  # (2, 20, 37) is both engines' default: no ids, which SGLang and vLLM both read right
        assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
        assert cfg["eagle_config"] == {"use_aux_hidden_state": True} and "engine" not in cfg["draftsmith"]
    else:
        assert cfg["architectures"] == ["Eagle3Speculator"] and cfg["eagle_aux_hidden_state_layer_ids"] == [2, 20, 37]
        assert cfg["speculators_config"]["verifier"] == {"name_or_path": "Qwen/Qwen3-14B",
                                                         "architectures": ["Qwen3ForCausalLM"]}


def test_qwen3_14b_medusa_vllm_golden_layout():
    from drafters.trainable.medusa import Medusa

    m = Medusa(qwen3_14b_on_meta())  # 4 heads, 1 ResBlock, the target's shared head
    native = {k: tuple(v.shape) for k, v in m.state_dict().items()}
    cfg, sources = plan("medusa-vllm", native_meta(m), list(native), qwen3_14b_facts())
    shapes = planned_shapes(sources, native, qwen3_14b_facts())
    golden = {}
    for k in range(4):
        golden |= {f"blocks.{k}.layers.0.weight": (5120, 5120), f"blocks.{k}.layers.0.bias": (5120,),
                   f"lm_heads.{k}.weight": (151936, 5120)}
    assert shapes == golden
    assert (cfg["num_heads"], cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == (4, 1, 5120, 151936)
    check_export("medusa-vllm", cfg, shapes, qwen3_14b_facts())


def test_export_gate_names_what_is_wrong():
    from drafters.trainable.eagle3 import Eagle3

    facts = qwen3_14b_facts()
    m = Eagle3(qwen3_14b_on_meta())
    native = {k: tuple(v.shape) for k, v in m.state_dict().items()}
    cfg, sources = plan("eagle3", native_meta(m), list(native), facts)
    shapes = planned_shapes(sources, native, facts)
    with pytest.raises(ValueError, match="unexpected key embed_tokens.weight"):
        check_export("eagle3", cfg, {**shapes, "embed_tokens.weight": (151936, 5120)}, facts)
    with pytest.raises(ValueError, match="key midlayer.hidden_norm.weight is missing"):
        check_export("eagle3", cfg, {k: v for k, v in shapes.items() if k != "midlayer.hidden_norm.weight"}, facts)
    with pytest.raises(ValueError, match="lacks max_position_embeddings"):
        check_export("eagle3", {k: v for k, v in cfg.items() if k != "max_position_embeddings"}, shapes, facts)
    with pytest.raises(ValueError, match="max_position_embeddings is 2048, the target's is 40960"):
        check_export("eagle3", {**cfg, "max_position_embeddings": 2048}, shapes, facts)


# --- refusals -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind,fmt", [("eagle1", "eagle3"), ("layerskip", "medusa-vllm"), ("medusa", "speculators"),
                                      ("eagle3", "medusa-vllm")])
def test_unfit_format_is_a_clear_error(tmp_path, target_dir, capsys, kind, fmt):
    m = build(kind, Target.load(target_dir))
    assert main([str(run_dir(tmp_path, m, target_dir)), "--format", fmt, "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert f"format {fmt!r} does not fit a {m.kind} drafter" in err and "exports as:" in err
    assert not (tmp_path / "x").exists()


def test_cli_reports_the_capture_id_offset(tmp_path, target_dir, capsys):
    from decode.cli import main as draftsmith

    m = build("eagle3", Target.load(target_dir))
    assert draftsmith(["export", str(run_dir(tmp_path, m, target_dir)), "--format", "eagle3",
                       "--out", str(tmp_path / "e")]) == 0
    ids = list(m.config.capture_ids)
    out = capsys.readouterr()
    assert f"HF hidden-state ids {ids}; eagle_aux_hidden_state_layer_ids are sglang's (HF ids - 1)" in out.out
    assert "warning: this directory is for sglang: vllm would capture other layers (re-export with --engine vllm " \
           "or --format speculators)" in out.err


def test_run_dir_without_export_and_foreign_target(tmp_path, target_dir):
    (tmp_path / "unfinished" / "checkpoints").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="finish the run"):
        export(tmp_path / "unfinished", "native", tmp_path / "x")
    src = run_dir(tmp_path, build("eagle3", Target.load(target_dir)), target_dir)
    other = tmp_path / "other"
    tiny_model("qwen3", hidden=48).save_pretrained(other)
    with pytest.raises(ValueError, match="(?s)trained for another target.*hidden_size: drafter trained for 32, target has 48"):
        export(src, "eagle3", tmp_path / "x", target=str(other))


def tamper(path: Path, how: str, key: str) -> str:
    """Rewrite a safetensors file with one key added / removed / reshaped; returns the expected message."""
    state = load_file(str(path))
    if how == "extra":
        state["embed_tokens.weight"] = torch.zeros(2, 2)
        msg = "unexpected key embed_tokens.weight"
    elif how == "missing":
        del state[key]
        msg = f"key {key} is missing"
    else:
        state[key] = torch.zeros(3, 3)
        msg = f"key {key} has shape \\[3, 3\\]"
    save_file(state, str(path))
    return msg


@pytest.mark.parametrize("how", ["extra", "missing", "shape"])
def test_tampered_native_checkpoint_is_not_exported(tmp_path, target_dir, how):
    src = run_dir(tmp_path, build("eagle3", Target.load(target_dir)), target_dir)
    msg = tamper(src / "export" / "model.safetensors", how, "midlayer.hidden_norm.weight")
    with pytest.raises(ValueError, match=msg):
        export(src, "eagle3", tmp_path / "x")
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("fmt,key", [("eagle3", "midlayer.self_attn.k_proj.weight"), ("speculators", "layers.0.mlp.up_proj.weight"),
                                     ("medusa-vllm", "blocks.1.layers.0.weight")])
@pytest.mark.parametrize("how", ["extra", "missing", "shape"])
def test_tampered_export_is_refused_on_import(tmp_path, target_dir, fmt, key, how):
    target = Target.load(target_dir)
    kind = "medusa" if fmt == "medusa-vllm" else "eagle3"
    out = export(run_dir(tmp_path, build(kind, target), target_dir), fmt, tmp_path / fmt)
    if how == "extra" and fmt != "medusa-vllm":
        key = "midlayer.extra.weight" if fmt == "eagle3" else "layers.0.extra.weight"
        state = load_file(str(out / "model.safetensors"))
        state[key] = torch.zeros(2)
        save_file(state, str(out / "model.safetensors"))
        msg = f"unexpected key {key}"
    else:  # (embed_tokens.weight is the one extra key EAGLE-3 imports tolerate: engines use the target's)
        msg = tamper(out / "model.safetensors", how, key)
    with pytest.raises(ValueError, match=msg):
        make_drafter(str(out), target)


def test_pickled_weights_are_refused(tmp_path, target_dir):
    target = Target.load(target_dir)
    out = export(run_dir(tmp_path, build("eagle3", target), target_dir), "eagle3", tmp_path / "e")
    (out / "model.safetensors").rename(out / "pytorch_model.bin")
    with pytest.raises(ValueError, match="never unpickles"):
        make_drafter(str(out), target)


def test_export_is_atomic(tmp_path, target_dir, monkeypatch):
    src = run_dir(tmp_path, build("eagle3", Target.load(target_dir)), target_dir)
    out = export(src, "eagle3", tmp_path / "e")
    before = (out / "model.safetensors").read_bytes()

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(export_mod, "save_file", broken)
    with pytest.raises(ValueError, match=r"--out .*e: cannot write \(disk full\)"):  # a one-line user error
        export(src, "eagle3", tmp_path / "e", dtype="bfloat16")
    assert (out / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e", "run"]


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
    m = Eagle3(target, Eagle3Config(capture_ids=(3, 1, 2), draft_vocab_size=64, ttt_steps=2),
               token_counts=torch.randint(0, 100, (target.vocab_size,)))
    with torch.no_grad():
        m.fc.weight.normal_(0, 0.3)  # blocks that differ, so a wrong order changes the drafts
    out = export(run_dir(tmp_path, m, target_dir), fmt, tmp_path / fmt)
    cfg = json.loads((out / "config.json").read_text())
    ids = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] if fmt == "eagle3" \
        else cfg["eagle_aux_hidden_state_layer_ids"]
    assert ids == ([0, 1, 2] if fmt == "eagle3" else [1, 2, 3])
    fc = load_file(str(out / "model.safetensors"))["fc.weight"]
    blocks = m.fc.weight.chunk(3, dim=1)
    assert torch.equal(fc, torch.cat([blocks[1], blocks[2], blocks[0]], dim=1))
    imported = load_eagle3(out, target)
    assert imported.config.capture_ids == (1, 2, 3)
    assert drafts(m.drafter(), target) == drafts(imported.drafter(), target)


@pytest.mark.parametrize("engine,written", [("sglang", [2, 19, 36]), ("vllm", [3, 20, 37])])
def test_eagle3_layout_names_its_engine_for_other_ids(engine, written):
    """Non-default ids cannot be read alike by SGLang (HF id - 1) and vLLM (HF ids): written for one, tagged."""
    from drafters.serving.layouts.formats import problems
    from drafters.serving.layouts.rules import capture_ids_hf
    from drafters.trainable.eagle3 import Eagle3, Eagle3Config

    facts = qwen3_14b_facts()
    m = Eagle3(qwen3_14b_on_meta(), Eagle3Config(capture_ids=(3, 20, 37)))
    native = {k: tuple(v.shape) for k, v in m.state_dict().items()}
    cfg, sources = plan("eagle3", native_meta(m), list(native), facts, engine=engine)
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == written and cfg["draftsmith"]["engine"] == engine
    assert capture_ids_hf("eagle3", cfg, 40) == ([3, 20, 37], True)
    assert not problems("eagle3", cfg, planned_shapes(sources, native, facts), facts)


def test_with_embeddings_writes_the_targets_embedding(tmp_path, target_dir, capsys):
    target = Target.load(target_dir)
    m = build("eagle3", target)
    assert main([str(run_dir(tmp_path, m, target_dir)), "--format", "speculators", "--out", str(tmp_path / "a")]) == 0
    assert "add --with-embeddings to load it with speculators" in capsys.readouterr().out
    out = export(run_dir(tmp_path, m, target_dir), "speculators", tmp_path / "s", with_embeddings=True)
    assert torch.equal(load_file(str(out / "model.safetensors"))["embed_tokens.weight"], target.embed_tokens.weight)
    assert drafts(m.drafter(), target) == drafts(make_drafter(str(out), target), target)
    with pytest.raises(ValueError, match="--with-embeddings is for the EAGLE-3 layouts"):
        export(run_dir(tmp_path, build("medusa", target), target_dir), "medusa-vllm", tmp_path / "m",
               with_embeddings=True)
