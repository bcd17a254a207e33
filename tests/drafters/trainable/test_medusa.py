"""Medusa heads: keys (vLLM layout), shapes, training, and decoding from each head's argmax."""

from __future__ import annotations

import pytest
import torch

from decode.generate import generate
from decode.protocol import Budget
from decode.tree import Shape
from drafters.trainable.medusa import Medusa, MedusaConfig, capped_shape
from tests.drafters.batches import chat_like_batch, fit, make_batch, random_sequences, record_rounds, sharp_target


def test_keys_and_zero_init(tiny):
    m = Medusa(tiny, MedusaConfig(num_heads=3, num_layers=2))
    sd = m.state_dict()
    assert set(sd) == {f"blocks.{k}.layers.{j}.{p}" for k in range(3) for j in range(2) for p in ("weight", "bias")}
    assert all(float(sd[f"blocks.{k}.layers.{j}.weight"].abs().max()) == 0.0 for k in range(3) for j in range(2))
    own = Medusa(tiny, MedusaConfig(num_heads=2, per_head_vocab=True))
    assert own.state_dict()["lm_heads.1.weight"].shape == (tiny.vocab_size, tiny.hidden_size)
    assert torch.equal(own.state_dict()["lm_heads.0.weight"], tiny.lm_head.weight)
    assert m.feature_ids() == (tiny.num_layers,)


def test_bad_config(tiny):
    with pytest.raises(ValueError, match="loss"):
        Medusa(tiny, MedusaConfig(loss="mse"))


@pytest.mark.parametrize(
    "cfg",
    [MedusaConfig(loss="ce"), MedusaConfig(loss="kl", per_head_vocab=True, num_heads=2)],
    ids=["ce-shared-head", "kl-own-heads"],
)
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_loss_decreases(family, cfg):
    torch.manual_seed(0)
    t = sharp_target(family)
    m = Medusa(t, cfg)
    batch = make_batch(t, random_sequences(t, 2, 16), m.feature_ids())
    losses = fit(m, batch)
    assert losses[-1] < 0.8 * losses[0], losses


def test_capped_shape():
    assert capped_shape(Shape("chain", k=8), 4).k == 4
    assert capped_shape(Shape("dynamic", depth=6), 3).depth == 3
    assert capped_shape(Shape("static", choices=((0,), (0, 0), (0, 0, 0))), 2).choices == ((0,), (0, 0))


def test_chain_is_each_heads_argmax_at_the_newest_state(tiny):
    torch.manual_seed(0)
    m = Medusa(tiny, MedusaConfig(num_heads=3))
    with torch.no_grad():
        for block in m.blocks:
            block.layers[0].weight.normal_(0, 0.5)  # heads that differ from the target's own head
    drafter = m.drafter()
    rounds = record_rounds(drafter)
    prompt = torch.tensor([1, 5, 9, 33, 17, 4])
    gen = generate(tiny, drafter, prompt, 16, shape=Shape("chain", k=8))
    seq = torch.cat([prompt, torch.tensor(gen.tokens)]).view(1, -1)
    hidden = make_batch(tiny, seq, m.feature_ids())["hidden"][tiny.num_layers][0]
    # round r drafts from the target state that produced the pending token: replay the emitted tokens
    pos = prompt.numel() - 1
    for tree, accepted in zip(rounds, gen.stats.accepted_lengths):
        want = [int(lg.argmax()) for lg in m.head_logits(hidden[pos])]
        assert tree.tokens.tolist() == want[: tree.size]  # 3 heads; shorter near max_new_tokens
        assert tree.size <= 3
        pos += accepted + 1
    assert max(t.size for t in rounds) == 3


@pytest.mark.parametrize("head", ["shared", "copied"])
def test_a_round_scores_only_the_heads_its_shape_reaches(tiny, head):
    """draft_logits (a decoding round: W @ z^T for a shared head, one read of it) equals each head on its own;
    a round runs only the heads its shape reaches."""
    torch.manual_seed(0)
    m = Medusa(tiny, MedusaConfig(num_heads=4, head=head))
    for p in m.parameters():
        p.data.normal_(0, 0.1)
    h = torch.randn(5, tiny.hidden_size)
    heads = m.head_modules()
    want = torch.stack([m.one_head(block, heads[k], h) for k, block in enumerate(m.blocks)])  # [K, 5, V]
    assert torch.equal(m.head_logits(h, 2), want[:2])
    torch.testing.assert_close(m.draft_logits(h[0], 3), want[:3, 0], rtol=1e-5, atol=1e-5)
    ran: list[int] = []
    hooks = [block.register_forward_hook(lambda mod, args, out, k=k: ran.append(k)) for k, block in enumerate(m.blocks)]
    drafter = m.drafter()
    drafter.h = h[0]  # the state accept() keeps: propose reads only this
    tree = drafter.propose(Budget(Shape("chain", k=2)))
    for hook in hooks:
        hook.remove()
    assert ran == [0, 1] and tree.size == 2  # 2 of the 4 heads
    assert tree.tokens.tolist() == want[:2, 0].argmax(-1).tolist()


@pytest.mark.parametrize("loss", ["ce", "kl"])
@pytest.mark.parametrize("head", ["shared", "copied"])
def test_loss_on_loss_rows_only_equals_the_all_rows_loss(tiny, loss, head):
    """Medusa.loss runs the heads only on rows that carry a loss: its value, accuracies and gradients equal
    the loss with every head over every row (head k at row t against x_{t+k+2} / P_{t+k+1}, masked by
    ahead(valid, k+1)). The batch has a prompt (loss_mask 0) and right padding."""
    from drafters.trainable.losses import (
        ahead,
        distill_rows,
        hard_ce,
        masked_mean,
        next_valid,
        step_weights,
        teacher_argmax,
    )

    torch.manual_seed(0)
    m = Medusa(tiny, MedusaConfig(num_heads=3, loss=loss, head=head))
    for p in m.blocks.parameters():  # away from Medusa's zero init, so the heads differ
        p.data.normal_(0, 0.1)
    batch = chat_like_batch(tiny, m.feature_ids())
    L, valid = tiny.num_layers, next_valid(batch)
    argmax = teacher_argmax(batch, tiny.lm_head, L)
    logits = m.head_logits(batch["hidden"][L])
    if loss == "ce":
        rows = [hard_ce(lg, ahead(batch["input_ids"], k + 2)) for k, lg in enumerate(logits)]
    else:
        rows = distill_rows(logits, [k + 1 for k in range(3)], batch, tiny.lm_head, L, "kl")
    masks = [ahead(valid, k + 1, False) for k in range(3)]
    ref = sum(w * masked_mean(r, v) for w, r, v in zip(step_weights(3, m.config.step_decay), rows, masks))
    ref_accs = [
        masked_mean((lg.argmax(-1) == ahead(argmax, k + 1, -1)).float(), v)
        for k, (lg, v) in enumerate(zip(logits, masks))
    ]
    params = [p for p in m.parameters() if p.requires_grad]
    ref_grads = torch.autograd.grad(ref, params)
    got, metrics = m.loss(batch)
    grads = torch.autograd.grad(got, params)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    assert [metrics[f"acc_{k + 1}"] for k in range(3)] == pytest.approx([float(a) for a in ref_accs], abs=1e-6)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)
    assert all(g.abs().sum() > 0 for g in grads)
