"""EAGLE-3's `draft_layer: target`: the target's own decoder-layer type (Qwen3: QK-norm) as the draft layer —
HF's layer computed exactly, the keys vLLM loads, `llama` and a Llama target's `target` unchanged, refusals."""

from __future__ import annotations

import pytest
import torch

from decode.kvcache import KVCache
from decode.masks import causal_mask
from drafters.trainable.draft_layer import CacheContext, LayerSizes, UnrollContext
from drafters.trainable.eagle3 import Eagle3, Eagle3Config
from drafters.trainable.target_layer import QKNormDraftLayer, layer_type
from tests.conftest import tiny_target
from tests.drafters.trainable.test_eagle import EAGLE3_KEYS

QK_NORM_KEYS = {"midlayer.self_attn.q_norm.weight", "midlayer.self_attn.k_norm.weight"}


def test_qk_norm_layer_computes_hfs_qwen3_decoder_layer():
    """Unfused (no [e; h] input), the draft layer with a Qwen3 layer's weights is that layer: the q/k norms sit
    where HF's Qwen3Attention puts them (per head, after projection, before rope), in decoding and in training."""
    target = tiny_target("qwen3", seed=4)
    hf = target.layers[1]
    with torch.no_grad():  # norms off their ones, so a misplaced or missing norm shows
        hf.self_attn.q_norm.weight.uniform_(0.5, 1.5)
        hf.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    ours = QKNormDraftLayer(LayerSizes.of(target.config), fused=False)
    ours.load_state_dict(hf.state_dict())  # strict: the same key names, q_norm/k_norm included
    h = torch.randn(1, 7, target.hidden_size)
    pos = torch.arange(7).view(1, -1)
    cos, sin = target.rotary_emb(h, pos)
    mask = causal_mask(0, 7, h.dtype, "cpu")
    with torch.no_grad():
        want = hf(h, attention_mask=mask, position_ids=pos, position_embeddings=(cos, sin))
        want = want[0] if isinstance(want, tuple) else want
        decoded = ours(h, cos, sin, CacheContext(KVCache(1), mask))
        trained = ours(h, cos, sin, UnrollContext(mask))
    assert torch.allclose(decoded, want, atol=1e-5) and torch.allclose(trained, want, atol=1e-5)


def test_qwen3_target_layer_adds_the_qk_norms():
    target = tiny_target("qwen3")
    m = Eagle3(target, Eagle3Config(draft_vocab_size=64, draft_layer="target"))
    shapes = {k: tuple(v.shape) for k, v in m.state_dict().items()}
    assert set(shapes) == EAGLE3_KEYS | QK_NORM_KEYS
    d = target.config.head_dim
    assert shapes["midlayer.self_attn.q_norm.weight"] == shapes["midlayer.self_attn.k_norm.weight"] == (d,)
    assert m.midlayer.self_attn.q_norm.eps == target.config.rms_norm_eps


def test_the_qk_norms_train():
    from tests.drafters.batches import fit, make_batch, random_sequences, sharp_target

    torch.manual_seed(0)
    target = sharp_target("qwen3")
    m = Eagle3(target, Eagle3Config(draft_vocab_size=64, ttt_steps=3, draft_layer="target"))
    before = m.midlayer.self_attn.q_norm.weight.detach().clone()
    losses = fit(m, make_batch(target, random_sequences(target, 2, 16), m.feature_ids()))
    assert losses[-1] < 0.85 * losses[0], losses
    assert not torch.equal(m.midlayer.self_attn.q_norm.weight, before)  # in the optimizer, with gradients


@pytest.mark.parametrize("family,draft_layer", [("qwen3", "llama"), ("llama", "target"), ("llama", "llama")])
def test_llama_layers_are_todays_bit_for_bit(family, draft_layer):
    """`llama` (the default) on any target, and `target` on a Llama target, draw today's weights in today's order."""
    from drafters.trainable.draft_layer import DraftLayer

    target = tiny_target(family)
    torch.manual_seed(5)
    m = Eagle3(target, Eagle3Config(draft_vocab_size=64, draft_layer=draft_layer))
    torch.manual_seed(5)
    default = Eagle3(target, Eagle3Config(draft_vocab_size=64))
    assert type(m.midlayer) is DraftLayer and set(m.state_dict()) == EAGLE3_KEYS
    assert all(torch.equal(v, default.state_dict()[k]) for k, v in m.state_dict().items())


def test_layer_types_and_refusals():
    assert [layer_type("target", t) for t in ("llama", "mistral", "qwen3")] == ["llama", "llama", "qwen3"]
    assert layer_type("llama", "gemma2") == "llama"  # EAGLE-3's own layer fits every target
    with pytest.raises(ValueError, match=r"draft_layer must be one of \['llama', 'target'\], got 'foo'"):
        Eagle3Config(draft_layer="foo")
    for model_type in ("qwen2", "gemma2", None):
        with pytest.raises(ValueError, match=rf"decoder layer of a {model_type!r} target .*llama, mistral, qwen3"):
            layer_type("target", model_type)


def test_target_layer_on_an_unsupported_target_is_refused():
    """A Qwen2 target: its q/k/v biases are what the draft layer cannot hold."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from decode.target import Target

    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4)
    target = Target(Qwen2ForCausalLM(cfg).eval().requires_grad_(False))
    with pytest.raises(ValueError, match=r"'qwen2' target \(it builds those of llama, mistral, qwen3 targets\)"):
        Eagle3(target, Eagle3Config(draft_vocab_size=32, draft_layer="target"))
    assert Eagle3(target, Eagle3Config(draft_vocab_size=32)).kind == "eagle3"  # EAGLE-3's own layer still fits
