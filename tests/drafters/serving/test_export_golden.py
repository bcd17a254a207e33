"""Golden serving layouts at Qwen3-14B sizes, planned on the meta device (no weights): EAGLE-3 in both layouts,
Medusa for vLLM; the exporter's gate names what is wrong; non-default capture ids are written for one engine."""

from __future__ import annotations

import pytest

from drafters.serving.checkpoint import native_meta
from drafters.serving.layouts.formats import check_export, plan, planned_shapes
from tests.drafters.serving.export_cases import qwen3_14b_facts
from tests.drafters.trainable.test_eagle import qwen3_14b_on_meta

QWEN3_14B_EAGLE3 = {  # what SGLang's LlamaForCausalLMEagle3 loads for Qwen3-14B with a 32k draft vocabulary
    "midlayer.self_attn.q_proj.weight": (5120, 10240),
    "midlayer.self_attn.k_proj.weight": (1024, 10240),
    "midlayer.self_attn.v_proj.weight": (1024, 10240),
    "midlayer.self_attn.o_proj.weight": (5120, 5120),
    "midlayer.mlp.gate_proj.weight": (17408, 5120),
    "midlayer.mlp.up_proj.weight": (17408, 5120),
    "midlayer.mlp.down_proj.weight": (5120, 17408),
    "midlayer.input_layernorm.weight": (5120,),
    "midlayer.hidden_norm.weight": (5120,),
    "midlayer.post_attention_layernorm.weight": (5120,),
    "fc.weight": (5120, 15360),
    "norm.weight": (5120,),
    "lm_head.weight": (32000, 5120),
    "d2t": (32000,),
    "t2d": (151936,),
}


@pytest.mark.parametrize("fmt", ["eagle3", "speculators"])
def test_qwen3_14b_eagle3_golden_layout(fmt):
    from drafters.trainable.eagle3 import Eagle3

    m = Eagle3(qwen3_14b_on_meta())
    native = {k: tuple(v.shape) for k, v in m.state_dict().items()}
    cfg, sources = plan(fmt, native_meta(m, target_id="Qwen/Qwen3-14B"), list(native), qwen3_14b_facts())
    shapes = planned_shapes(sources, native, qwen3_14b_facts())
    golden = (
        QWEN3_14B_EAGLE3
        if fmt == "eagle3"
        else {k.replace("midlayer.", "layers.0."): v for k, v in QWEN3_14B_EAGLE3.items()}
    )
    assert shapes == golden
    check_export(fmt, cfg, shapes, qwen3_14b_facts())  # the exporter's own gate passes
    layer = cfg if fmt == "eagle3" else cfg["transformer_layer_config"]
    assert {
        k: layer[k]
        for k in (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
            "max_position_embeddings",
            "rope_theta",
            "rope_scaling",
            "rms_norm_eps",
            "tie_word_embeddings",
        )
    } == {
        "hidden_size": 5120,
        "num_hidden_layers": 1,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 17408,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rope_theta": 1e6,
        "rope_scaling": None,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
    }
    assert cfg["draft_vocab_size"] == 32000
    if fmt == "eagle3":  # (2, 20, 37) is both engines' default: no ids, which SGLang and vLLM both read right
        assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
        assert cfg["eagle_config"] == {"use_aux_hidden_state": True} and "engine" not in cfg["draftsmith"]
    else:
        assert cfg["architectures"] == ["Eagle3Speculator"] and cfg["eagle_aux_hidden_state_layer_ids"] == [2, 20, 37]
        assert cfg["speculators_config"]["verifier"] == {
            "name_or_path": "Qwen/Qwen3-14B",
            "architectures": ["Qwen3ForCausalLM"],
        }


def test_qwen3_14b_medusa_vllm_golden_layout():
    from drafters.trainable.medusa import Medusa

    m = Medusa(qwen3_14b_on_meta())  # 4 heads, 1 ResBlock, the target's shared head
    native = {k: tuple(v.shape) for k, v in m.state_dict().items()}
    cfg, sources = plan("medusa-vllm", native_meta(m), list(native), qwen3_14b_facts())
    shapes = planned_shapes(sources, native, qwen3_14b_facts())
    golden = {}
    for k in range(4):
        golden |= {
            f"blocks.{k}.layers.0.weight": (5120, 5120),
            f"blocks.{k}.layers.0.bias": (5120,),
            f"lm_heads.{k}.weight": (151936, 5120),
        }
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
