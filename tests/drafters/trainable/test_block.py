"""Block drafters (DFlash, DSpark): keys, configs, the multi-anchor masks, training, and training = decoding."""

from __future__ import annotations

import pytest
import torch

from drafters.trainable.block_drafter import ContextKV, block_rows_fn
from drafters.trainable.block_loss import anchor_states
from drafters.trainable.block_ops import (
    anchor_candidates,
    anchor_mask,
    batch_layout,
    block_rows,
    position_weights,
    sample_anchors,
)
from drafters.trainable.dflash import DFlash, DFlashConfig
from drafters.trainable.dspark import DSpark, DSparkConfig
from drafters.trainable.lk import Objective, use_objective
from tests.drafters.batches import chat_like_batch, fit, make_batch, random_sequences, sharp_target

KINDS = {"dflash": (DFlash, DFlashConfig), "dspark": (DSpark, DSparkConfig)}


def build(kind: str, target, **cfg):
    """A random-init block drafter, its Markov head (DSpark) moved off its zero init so it matters."""
    cls, config = KINDS[kind]
    torch.manual_seed(0)
    m = cls(target, config(**{"block_size": 4, "anchors": 6, **cfg}))
    if kind == "dspark":
        with torch.no_grad():
            m.markov.proj.weight.normal_(0, 0.5)
    return m


def test_keys_defaults_and_feature_ids(tiny):
    m = DFlash(tiny)
    layer = {f"layers.0.{k}.weight" for k in ("input_layernorm", "post_attention_layernorm")}
    layer |= {f"layers.0.self_attn.{p}_proj.weight" for p in "qkvo"}
    layer |= {f"layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
    assert set(m.state_dict()) == {"fc.weight", "hidden_norm.weight", "norm.weight", "mask_embedding"} | layer
    assert m.config.block_size == 8 and m.config.capture_ids == (1, 2, 3)
    assert m.feature_ids() == (1, 2, 3, tiny.num_layers) and m.decode_hidden_ids == (1, 2, 3)
    assert m.fc.weight.shape == (tiny.hidden_size, 3 * tiny.hidden_size)
    assert not any(p.requires_grad for p in tiny.lm_head.parameters())  # the target's head: shared, frozen
    s = DSpark(tiny, DSparkConfig(num_layers=2, mask_token_id=7))
    assert s.config.markov_rank == tiny.hidden_size  # 256 capped at D
    assert (s.config.ce_weight, s.config.l1_weight, s.config.position_decay, s.config.gamma) == (0.1, 0.9, True, 4.0)
    keys = set(s.state_dict())
    assert "mask_embedding" not in keys and "layers.1.mlp.up_proj.weight" in keys
    assert {"markov.embed.weight", "markov.proj.weight", "conf_head.weight", "conf_head.bias"} <= keys
    assert s.markov.embed.weight.shape == (tiny.vocab_size, tiny.hidden_size)


def test_bad_configs_are_refused(tiny):
    with pytest.raises(ValueError, match="block_size 1: a block needs the anchor and at least 1 masked"):
        DFlashConfig(block_size=1)
    with pytest.raises(ValueError, match="mask_token_id 128 is outside the target's vocabulary 0..127"):
        DFlash(tiny, DFlashConfig(mask_token_id=128))
    with pytest.raises(ValueError, match="mask_token_id -2 is outside"):
        DSpark(tiny, DSparkConfig(mask_token_id=-2))
    with pytest.raises(ValueError, match=r"capture ids \[9\] out of range"):
        DFlash(tiny, DFlashConfig(capture_ids=(1, 9)))
    with pytest.raises(ValueError, match="markov_rank"):
        DSparkConfig(markov_rank=0)


def test_anchor_candidates_rows_and_mask_respect_packing():
    # one row: sequence 1 = tokens 0..4, sequence 2 = tokens 5..7, then padding; token 0 and 5 untrained
    seg = torch.tensor([[1, 1, 1, 1, 1, 2, 2, 2, 0]])
    loss = torch.tensor([[0, 1, 1, 1, 1, 0, 1, 1, 0]], dtype=torch.bool)
    _, pos = batch_layout({"attention_mask": seg})
    assert pos.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 0]]
    cand = anchor_candidates(seg, pos, loss)  # context before it, next token trained in the same sequence
    assert cand.nonzero()[:, 1].tolist() == [1, 2, 3, 6]
    anchors, present = sample_anchors(cand, 6, torch.Generator().manual_seed(0))
    assert anchors.tolist() == [sorted(anchors[0].tolist())] and int(present.sum()) == 4
    assert set(anchors[0][present[0]].tolist()) == {1, 2, 3, 6}
    rows, valid = block_rows(torch.tensor([[3, 6]]), torch.tensor([[True, True]]), seg, loss, 3)
    assert rows.tolist() == [[[3, 4, 5], [6, 7, 8]]]
    assert valid.tolist() == [[[False, True, False], [False, True, False]]]  # 5: the next sequence; 8: padding
    m = anchor_mask(torch.tensor([[3, 6]]), seg, 2, torch.float32)[0, 0] == 0  # [4, 9 + 4] allowed
    assert m[:2, :9].nonzero()[:, 1].unique().tolist() == [0, 1, 2]  # anchor 3: its sequence's positions < 3
    assert m[2:, :9].nonzero()[:, 1].unique().tolist() == [5]  # anchor 6: position 5 only
    assert m[:, 9:].tolist() == [[True, True, False, False]] * 2 + [[False, False, True, True]] * 2
    assert position_weights(3, True, 2.0) == pytest.approx([1.0, 0.6065307, 0.3678794])
    assert position_weights(3, False, 2.0) == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_the_training_pass_equals_the_decoding_pass(tiny, kind, qk_norm):
    """A multi-anchor training pass gives each block the states the drafter computes when decoding at that
    anchor, its context cache built from the target's states in two steps (as rounds append them); with QK-norm
    (the layer vLLM's DFlash builds) the context keys are normed alike on both paths."""
    m = build(kind, tiny, qk_norm=qk_norm).eval()
    ids = random_sequences(tiny, 1, 14, seed=2)
    batch = make_batch(tiny, ids, m.feature_ids())
    anchors = torch.tensor([[3, 7, 11]])
    h_train = anchor_states(m, batch, anchors)[0]  # [A, K, D]
    for a, p in enumerate(anchors[0].tolist()):
        d = m.drafter()
        d.ctx, d.anchor = ContextKV(), int(ids[0, p])
        for lo, hi in ((0, p // 2), (p // 2, p)):
            d.pending.append(m.fuse({i: batch["hidden"][i][0, lo:hi] for i in m.decode_hidden_ids}))
            if lo == 0:
                d.states()  # the first rows are projected and cached before the rest arrive
        assert d.ctx.n == p // 2
        torch.testing.assert_close(d.states(), h_train[a, 1:], rtol=1e-5, atol=1e-5)
        assert d.ctx.n == p and d.forward_passes == 2


def test_dspark_rows_condition_on_the_previous_token_and_carry_confidence(tiny):
    m = build("dspark", tiny).eval()
    h = torch.randn(3, tiny.hidden_size)
    rows = block_rows_fn(m, h)
    lp_a, conf_a = rows([0, 1], [5, 5])
    lp_b, conf_b = rows([0, 1], [5, 9])
    assert torch.equal(lp_a[0], lp_b[0]) and not torch.allclose(lp_a[1], lp_b[1])
    assert conf_a.shape == (2,) and bool(((conf_a > 0) & (conf_a < 1)).all()) and conf_a[1] != conf_b[1]
    with torch.no_grad():  # the Markov term added in logit space = the head run on norm(h) + P E[prev]
        m.markov.proj.weight.normal_()
        z = m.head_states(h[[2, 0, 1]], torch.tensor([4, 5, 9]))
        lp, conf = block_rows_fn(m, h)([2, 0, 1], [4, 5, 9])
    torch.testing.assert_close(lp, torch.log_softmax(m.logits(z).float(), -1), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(conf, m.confidence(z))
    flash = build("dflash", tiny).eval()
    lp, conf = block_rows_fn(flash, h)([2, 0], [1, 2])
    assert conf is None and torch.allclose(lp.exp().sum(-1), torch.ones(2))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_loss_decreases(family, kind):
    t = sharp_target(family)
    m = build(kind, t).train()
    batch = make_batch(t, random_sequences(t, 2, 16), m.feature_ids())
    before = m.position_accuracy(batch)[0]
    losses = fit(m, batch, steps=30)
    assert losses[-1] < 0.7 * losses[0], losses
    assert m.position_accuracy(batch)[0] > before  # the held-out anchors (eval mode draws its own) improve too


def test_the_loss_terms_and_resume_determinism(tiny):
    """Anchors are drawn per (seed, rank, step, call): the same step's loss twice is identical, another step
    draws other anchors; ce labels, l1 (acceptance) and position decay each show in the metrics."""
    batch = chat_like_batch(tiny, DFlash(tiny).feature_ids())
    m = build("dflash", tiny, ce_weight=0.5, l1_weight=2.0, position_decay=True).train()
    a, metrics = m(batch, 3)
    b, _ = build("dflash", tiny, ce_weight=0.5, l1_weight=2.0, position_decay=True).train()(batch, 3)
    assert torch.equal(a, b) and {"kl_1", "alpha_1", "acc_3"} <= set(metrics) and "kl_4" not in metrics
    w = position_weights(3, True, 4.0)
    per = [0.5 * metrics[f"kl_{i}"] + 2.0 * (1 - metrics[f"alpha_{i}"]) for i in (1, 2, 3)]
    assert float(a.detach()) == pytest.approx(sum(x * y for x, y in zip(w, per)) / sum(w), rel=1e-5)
    c, _ = m(batch, 4)
    assert not torch.equal(a, c)
    ce = build("dflash", tiny, loss="ce").train()
    assert "ce_1" in ce(batch, 0)[1]
    with pytest.raises(ValueError, match=r"drafter\.dflash\.loss=ce trains on token labels"):
        use_objective(ce, Objective("lk"))


@pytest.mark.parametrize("kind", KINDS)
def test_trains_with_lk(tiny, kind):
    m = build(kind, tiny).train()
    use_objective(m, Objective("lk"))
    loss, metrics = m(chat_like_batch(tiny, m.feature_ids()), 0)
    loss.backward()
    assert torch.isfinite(loss) and any(k.startswith("lk_") for k in metrics)
    assert all(0 < v <= 1 for k, v in metrics.items() if k.startswith("alpha_"))
    assert ("conf_bce" in metrics) == (kind == "dspark")
