"""EAGLE-1 / EAGLE-3 modules: shapes and keys, the draft vocabulary, training, and decode == training-time unroll."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from decode.generate import generate
from decode.target import Target
from decode.tree import Shape
from drafters.trainable.eagle import Eagle1
from drafters.trainable.eagle3 import Eagle3, Eagle3Config, build_draft_vocab, default_capture_ids
from tests.drafters.batches import chat_like_batch, fit, make_batch, random_sequences, record_rounds, sharp_target

QWEN3_14B = Path(__file__).resolve().parents[2] / "data" / "qwen3-14b-config.json"
EAGLE3_KEYS = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} | {
    f"midlayer.{k}.weight"
    for k in (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
        "input_layernorm",
        "hidden_norm",
        "post_attention_layernorm",
    )
}


def test_build_draft_vocab_keeps_most_frequent_in_id_order():
    counts = torch.tensor([5, 0, 9, 9, 1, 7])
    d2t, t2d = build_draft_vocab(counts, 3)
    ids = torch.arange(3) + d2t
    assert ids.tolist() == [2, 3, 5]
    assert t2d.tolist() == [False, False, True, True, False, True]
    d2t, _ = build_draft_vocab(torch.tensor([1, 0, 0, 0]), 2)  # ties broken by the lower id
    assert (torch.arange(2) + d2t).tolist() == [0, 1]
    with pytest.raises(ValueError, match="draft vocabulary size"):
        build_draft_vocab(counts, 7)


def test_default_capture_ids():
    assert default_capture_ids(40) == (2, 20, 37)
    assert default_capture_ids(32) == (2, 16, 29)
    assert default_capture_ids(5) == (1, 2, 4)  # shallow targets: distinct ids spread over 1..L-1
    assert default_capture_ids(4) == (1, 2, 3)


def test_eagle3_keys_shapes_and_frozen_target(tiny):
    counts = torch.zeros(tiny.vocab_size)
    counts[[7, 3, 90, 11]] = torch.tensor([4.0, 3.0, 2.0, 1.0])
    m = Eagle3(tiny, Eagle3Config(draft_vocab_size=4), token_counts=counts)
    sd = m.state_dict()
    assert set(sd) == EAGLE3_KEYS
    H = tiny.hidden_size
    assert sd["fc.weight"].shape == (H, 3 * H)
    assert sd["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * H
    assert sd["lm_head.weight"].shape == (4, H)
    assert m.draft_ids.tolist() == [3, 7, 11, 90]
    assert torch.equal(sd["lm_head.weight"], tiny.lm_head.weight[[3, 7, 11, 90]])  # starts from the target's rows
    target_params = {id(p) for p in tiny.model.parameters()}
    assert all(p.requires_grad and id(p) not in target_params for p in m.parameters())
    assert not any(p.requires_grad for p in tiny.model.parameters())
    assert m.feature_ids() == (1, 2, 3, 4) and m.decode_hidden_ids == (1, 2, 3)


def test_eagle1_keys(tiny):
    m = Eagle1(tiny)
    keys = set(m.state_dict())
    assert {"fc.weight", "fc.bias", "layers.0.self_attn.q_proj.weight", "layers.0.mlp.down_proj.weight"} <= keys
    assert not any("embed" in k or "lm_head" in k for k in keys)
    assert m.feature_ids() == (tiny.num_layers,)


def test_eagle3_out_of_range_capture_ids(tiny):
    with pytest.raises(ValueError, match="capture ids"):
        Eagle3(tiny, Eagle3Config(capture_ids=(1, 2, tiny.num_layers)))


def qwen3_14b_on_meta() -> Target:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(**{k: v for k, v in json.loads(QWEN3_14B.read_text()).items() if k != "architectures"})
    with torch.device("meta"):
        model = Qwen3ForCausalLM(cfg)
    return Target(model.eval().requires_grad_(False))


def test_eagle3_at_qwen3_14b_sizes_on_meta():
    target = qwen3_14b_on_meta()
    m = Eagle3(target)
    assert m.config.capture_ids == (2, 20, 37) and m.config.draft_vocab_size == 32000
    shapes = {k: tuple(v.shape) for k, v in m.state_dict().items()}
    assert set(shapes) == EAGLE3_KEYS
    assert shapes["fc.weight"] == (5120, 15360)
    assert shapes["midlayer.self_attn.q_proj.weight"] == (5120, 10240)
    assert shapes["midlayer.self_attn.k_proj.weight"] == (1024, 10240)
    assert shapes["midlayer.self_attn.o_proj.weight"] == (5120, 5120)
    assert shapes["midlayer.mlp.gate_proj.weight"] == (17408, 5120)
    assert shapes["lm_head.weight"] == (32000, 5120)
    assert shapes["d2t"] == (32000,) and shapes["t2d"] == (151936,)
    # fc 78.6M + attention 99.6M + MLP 267.4M + norms 20k + draft LM head 163.8M
    assert sum(p.numel() for p in m.parameters()) == 609_505_280


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_loss_decreases(kind, family):
    torch.manual_seed(0)
    t = sharp_target(family)
    m = Eagle3(t, Eagle3Config(draft_vocab_size=64, ttt_steps=3)) if kind == "eagle3" else Eagle1(t)
    batch = make_batch(t, random_sequences(t, 2, 16), m.feature_ids())
    losses = fit(m, batch)
    assert losses[-1] < 0.8 * losses[0], losses


def test_padding_rows_do_not_change_real_rows(tiny):
    """A right-padded row's real tokens get the same logits as the same row unpadded (the mask works)."""
    torch.manual_seed(0)
    m = Eagle3(tiny, Eagle3Config(draft_vocab_size=64, ttt_steps=2))
    ids = random_sequences(tiny, 1, 12)
    padded = torch.cat([ids, torch.zeros(1, 4, dtype=torch.long)], dim=1)
    am = torch.cat([torch.ones(1, 12), torch.zeros(1, 4)], dim=1).long()
    full = m.unroll(make_batch(tiny, ids, m.feature_ids()), 2)
    pad = m.unroll(make_batch(tiny, padded, m.feature_ids(), attention_mask=am), 2)
    for (a, _), (b, _) in zip(full, pad):
        assert torch.allclose(a[:, :10], b[:, :10], atol=1e-5)


@pytest.mark.parametrize("kind", ["eagle1", "eagle3", "target"])
def test_chain_decoding_equals_training_unroll(tiny, kind):
    """Every round's greedy chain = the argmax chain of the training-time unroll at the root row.

    The decoder's cached rows + tree rows must see exactly what unrolled step k sees (step-0 rows
    causally, the row's own earlier steps), so this checks the KV bookkeeping across rounds too.
    """
    torch.manual_seed(1)
    e3 = Eagle3Config(draft_vocab_size=96, draft_layer="target" if kind == "target" else "llama")  # target: QK-norm
    m = Eagle1(tiny) if kind == "eagle1" else Eagle3(tiny, e3)
    drafter = m.drafter()
    rounds = record_rounds(drafter)
    prompt = torch.tensor([1, 5, 9, 33, 17, 4])
    emitted: list[list[int]] = []
    contexts = []
    inner = drafter.propose

    def propose(budget):  # the context a round drafts from: prompt + everything emitted so far
        contexts.append(prompt.tolist() + [t for chunk in emitted for t in chunk])
        return inner(budget)

    drafter.propose = propose
    generate(tiny, drafter, prompt, 24, shape=Shape("chain", k=3), on_tokens=emitted.append)
    assert len(rounds) >= 4
    for context, tree in zip(contexts, rounds):
        if not tree.size:
            continue
        seq = torch.tensor([context + tree.tokens.tolist()])
        steps = m.unroll(make_batch(tiny, seq, m.feature_ids()), tree.size)
        root = len(context) - 2  # row (feature of the last committed position, pending token)
        chain = [int(m.to_target(logits[0, root].argmax())) for logits, _ in steps]
        assert chain == tree.tokens.tolist()


def all_rows_loss(m: Eagle3, batch: dict) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The training-time test loss with the draft head over every row of the batch (the loss's plain form):
    step k's logits at row t against P_{t+k+1}, masked by ahead(valid, k+1)."""
    from drafters.trainable.losses import ahead, distill_rows, masked_mean, next_valid, step_weights, teacher_argmax

    L = m.target.num_layers
    argmax = teacher_argmax(batch, m.target.lm_head, L)
    valid = next_valid(batch) & m.t2d[argmax]
    steps = [lg for lg, _ in m.unroll(batch, m.config.ttt_steps)]
    rows = distill_rows(steps, [k + 1 for k in range(len(steps))], batch, m.target.lm_head, L, "soft_ce", m.draft_ids)
    losses = [masked_mean(ce, ahead(valid, k + 1, False)) for k, ce in enumerate(rows)]
    accs = [
        masked_mean((m.to_target(lg.argmax(-1)) == ahead(argmax, k + 1, -1)).float(), ahead(valid, k + 1, False))
        for k, lg in enumerate(steps)
    ]
    return sum(w * lo for w, lo in zip(step_weights(len(losses), m.config.step_decay), losses)), accs


@pytest.mark.parametrize("source", ["hidden", "topk"])
def test_loss_on_loss_rows_only_equals_the_all_rows_loss(tiny, source):
    """Eagle3.loss runs the draft head only on rows that carry a loss (not on prompt or padding rows): its
    value, accuracies and gradients equal the loss computed with the head over every row. The batch has a
    prompt (loss_mask 0), right padding, rows whose argmax lies outside the draft vocabulary, and 3 TTT steps."""
    torch.manual_seed(0)
    m = Eagle3(tiny, Eagle3Config(draft_vocab_size=48, ttt_steps=3, noise="none", freeze_head=False))
    batch = chat_like_batch(tiny, m.feature_ids())
    if source == "topk":
        tk = torch.softmax(tiny.lm_head(batch["hidden"][tiny.num_layers]), -1).topk(5, -1)
        batch.update(topk_ids=tk.indices, topk_probs=tk.values)
    assert 0 < int((batch["loss_mask"].bool() & ~m.t2d[batch["input_ids"]]).sum())  # out-of-vocabulary targets exist
    ref, ref_accs = all_rows_loss(m, batch)
    ref_grads = torch.autograd.grad(ref, [p for p in m.parameters() if p.requires_grad])
    got, metrics = m.loss(batch)
    grads = torch.autograd.grad(got, [p for p in m.parameters() if p.requires_grad])
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    assert [metrics[f"acc_{k + 1}"] for k in range(3)] == pytest.approx([float(a) for a in ref_accs], abs=1e-6)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)
    assert any(g.abs().sum() > 0 for g in grads)


def test_eagle1_loss_on_loss_rows_only_equals_the_all_rows_loss(tiny):
    """Eagle1.loss (regression + soft-CE) on the rows that carry a loss only = over every row, masked."""
    from drafters.trainable.losses import ahead, distill_rows, masked_mean, next_valid, smooth_l1

    torch.manual_seed(0)
    m = Eagle1(tiny)
    batch = chat_like_batch(tiny, m.feature_ids())
    L = tiny.num_layers
    v = ahead(next_valid(batch), 1, False)
    ((logits, f_hat),) = m.unroll(batch, 1)
    reg = masked_mean(smooth_l1(f_hat, ahead(batch["hidden"][L], 1)), v)
    (ce,) = distill_rows([logits], [1], batch, tiny.lm_head, L, "soft_ce")
    ref = reg + m.config.ce_weight * masked_mean(ce, v)
    params = [p for p in m.parameters() if p.requires_grad]
    ref_grads = torch.autograd.grad(ref, params)
    got, metrics = m.loss(batch)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    assert metrics["regression"] == pytest.approx(float(reg.detach()), rel=1e-5)
    for g, r in zip(torch.autograd.grad(got, params), ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)
