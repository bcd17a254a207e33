"""The pure loss, schedule and metric functions of drafters/trainable/losses.py."""

from __future__ import annotations

import math

import pytest
import torch

from drafters.trainable.layerskip.schedules import (
    exit_curriculum,
    exit_loss_scales,
    gradual_curriculum,
    layer_dropout_rates,
    rotational_curriculum,
)
from drafters.trainable.losses import (
    ahead,
    conditional_accuracy,
    distill_rows,
    kl_to,
    masked_mean,
    next_valid,
    simulated_chain_tau,
    soft_ce,
    step_weights,
    teacher_argmax,
    teacher_probs,
)


def test_ahead_shifts_and_fills():
    x = torch.arange(6).view(1, 6)
    assert ahead(x, 2, -1).tolist() == [[2, 3, 4, 5, -1, -1]]
    assert ahead(x, 0).tolist() == x.tolist()
    assert ahead(x, 9, 7).tolist() == [[7] * 6]


def test_next_valid_reads_loss_mask_one_ahead():
    batch = {
        "loss_mask": torch.tensor([[0, 0, 1, 1, 1, 0]]).bool(),
        "attention_mask": torch.tensor([[1, 1, 1, 1, 0, 0]]),
    }
    assert next_valid(batch).tolist() == [[False, True, True, False, False, False]]


def test_soft_ce_and_kl():
    logits = torch.tensor([[2.0, 0.0, -1.0]])
    p = torch.softmax(logits, -1)
    assert kl_to(logits, p).abs().max() < 1e-6
    entropy = -(p * p.log()).sum(-1)
    assert torch.allclose(soft_ce(logits, p), entropy, atol=1e-6)
    q = torch.tensor([[0.0, 1.0, 0.0]])
    assert torch.allclose(soft_ce(logits, q), -torch.log_softmax(logits, -1)[:, 1])


def test_masked_mean_ignores_invalid_rows_and_survives_none():
    x = torch.tensor([[1.0, 100.0, 3.0]], requires_grad=True)
    assert float(masked_mean(x, torch.tensor([[True, False, True]])).detach()) == 2.0
    zero = masked_mean(x, torch.zeros(1, 3, dtype=torch.bool))
    zero.backward()
    assert float(zero.detach()) == 0.0


def test_step_weights():
    assert step_weights(3) == pytest.approx([1.0, 0.8, 0.64])


def test_exit_loss_scales_match_layerskip():
    exits = [1, 2, 4]
    assert exit_loss_scales(exits, "uniform") == pytest.approx([1 / 3] * 3)
    assert exit_loss_scales(exits, "linear") == pytest.approx([1 / 7, 2 / 7, 4 / 7])
    assert exit_loss_scales(exits, "sum") == pytest.approx([1 / 11, 3 / 11, 7 / 11])  # cumsum 1, 3, 7
    inv = [1, 1 / 2, 1 / 4]
    assert exit_loss_scales(exits, "inv") == pytest.approx([v / sum(inv) for v in inv])
    assert exit_loss_scales(exits, "sqrt", active=[False, True, True]) == pytest.approx(
        [0.0, math.sqrt(2) / (math.sqrt(2) + 2), 2 / (math.sqrt(2) + 2)]
    )
    with pytest.raises(ValueError, match="not one of"):
        exit_loss_scales(exits, "cubic")


def test_rotational_curriculum_rolls_one_exit_per_step():
    assert rotational_curriculum(0, 5, every=2) == [True, False, True, False, True]
    assert rotational_curriculum(1, 5, every=2) == [True, True, False, True, True]  # rolled; deepest stays on
    assert rotational_curriculum(1, 4, every=2) == [False, True, False, True]


def test_gradual_curriculum_adds_shallow_exits_last():
    assert gradual_curriculum(0, 4, max_steps=100) == [False, False, False, True]
    assert gradual_curriculum(25, 4, max_steps=100) == [False, False, True, True]  # 0.25 >= 0.5 * 2/4
    assert gradual_curriculum(50, 4, max_steps=100) == [True] * 4
    assert exit_curriculum("none", 3, 4) == [True] * 4
    with pytest.raises(ValueError, match="curriculum"):
        exit_curriculum("random", 0, 4)


def test_layer_dropout_rates_grow_exponentially_to_max():
    r = layer_dropout_rates(5, 0.2)
    assert r[0] == 0.0 and r[-1] == pytest.approx(0.2) and r == sorted(r)


def test_conditional_accuracy_and_simulated_tau():
    # rows: position-1 right on 3 of 4; position 2 right on 1 of those 3 (and on the row that failed first)
    c1 = torch.tensor([[True, True, True, False]])
    c2 = torch.tensor([[True, False, False, True]])
    valid = torch.ones(1, 4, dtype=torch.bool)
    acc = conditional_accuracy([c1, c2], [valid, valid])
    assert acc == pytest.approx([3 / 4, 1 / 3])
    assert simulated_chain_tau(acc) == pytest.approx(1 + 3 / 4 + 1 / 4)
    # an invalid row at position 2 leaves the denominator
    v2 = torch.tensor([[True, False, True, True]])
    assert conditional_accuracy([c1, c2], [valid, v2]) == pytest.approx([3 / 4, 1 / 2])


def test_teacher_probs_from_hidden_and_from_topk():
    head = torch.nn.Linear(4, 6, bias=False)
    h = torch.randn(1, 3, 4)
    batch = {"hidden": {2: h}}
    p = teacher_probs(batch, head, 2, 0, 3)
    assert torch.allclose(p, torch.softmax(head(h), -1), atol=1e-6)
    assert teacher_argmax(batch, head, 2).tolist() == head(h).argmax(-1).tolist()
    sub = teacher_probs(batch, head, 2, 0, 3, vocab_ids=torch.tensor([0, 3]))
    assert torch.allclose(sub, torch.softmax(head(h)[..., [0, 3]], -1), atol=1e-6)
    # rows past the end have no next token: all-zero, as `ahead` fills
    assert teacher_probs(batch, head, 2, 2, 5)[0, 1:].abs().sum() == 0
    topk = {
        "topk_ids": torch.tensor([[[5, 1], [2, 0], [3, 4]]]),
        "topk_probs": torch.tensor([[[0.6, 0.2], [0.5, 0.5], [0.1, 0.3]]]),
    }
    assert teacher_argmax(topk, head, 2).tolist() == [[5, 2, 4]]
    assert teacher_probs(topk, head, 2, 0, 3)[0, 0].tolist() == pytest.approx([0, 0.25, 0, 0, 0, 0.75])


def test_blocked_teacher_argmax_equals_the_full_argmax_ties_included(monkeypatch):
    """Scored a vocabulary block and a row chunk at a time (blocks of 7 words, chunks of 5 rows), the argmax is
    the full one, and on exact ties (duplicated head rows, integer-valued so every sum is exact) the first
    index wins as torch.argmax's does, also across blocks."""
    import drafters.trainable.losses as losses

    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(6, 40, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randint(-3, 4, (40, 6), generator=g).float())
        head.weight[25] = head.weight[3]  # a tie across blocks (3 in block 0, 25 in block 3)
        head.weight[5] = head.weight[3]  # and within block 0
    h = torch.randint(-2, 3, (3, 4, 6), generator=g).float()
    h[0, 0] = torch.tensor([1.0, 0, 0, 0, 0, 0])
    batch = {"hidden": {2: h}}
    monkeypatch.setattr(losses, "ARGMAX_ROWS", 5)
    want = head(h).argmax(-1)
    assert teacher_argmax(batch, head, 2, budget=35).tolist() == want.tolist()
    assert teacher_argmax(batch, head, 2).tolist() == want.tolist()
    ties = (head(h) == head(h).max(-1, keepdim=True).values).sum(-1)
    assert (ties > 1).any()  # the data really has ties


def test_teacher_argmax_reads_the_batch_argmax_when_the_cache_stored_it():
    head = torch.nn.Linear(4, 6, bias=False)
    # zero states score argmax 0 at every row: only the batch's own argmax gives [5, 0, 2]
    batch = {"hidden": {2: torch.zeros(1, 3, 4)}, "argmax": torch.tensor([[5, 0, 2]])}
    assert teacher_argmax(batch, head, 2).tolist() == [[5, 0, 2]]


@pytest.mark.parametrize("kind", ["soft_ce", "kl"])
@pytest.mark.parametrize("source", ["hidden", "topk"])
def test_chunked_distillation_equals_the_full_teacher(kind, source):
    """distill_rows over chunks of 3 rows (several outputs, several shifts) = the loss against the whole
    [B, T, V'] teacher built at once, in value and in gradient."""
    torch.manual_seed(0)
    B, T, H, V = 2, 10, 8, 12
    head = torch.nn.Linear(H, V, bias=True)
    h = torch.randn(B, T, H)
    full = torch.softmax(head(h), -1).detach()  # [B, T, V] at once
    batch = {"hidden": {3: h}}
    if source == "topk":
        tk = full.topk(4, -1)
        batch.update(topk_ids=tk.indices, topk_probs=tk.values)
        full = torch.zeros(B, T, V).scatter_(-1, tk.indices, tk.values)
        full = full / full.sum(-1, keepdim=True)
    vocab_ids = torch.tensor([0, 2, 3, 5, 7, 11])
    sub = full[..., vocab_ids] / full[..., vocab_ids].sum(-1, keepdim=True).clamp(min=1e-12)
    ref_loss = {"soft_ce": soft_ce, "kl": kl_to}[kind]
    shifts = [0, 1, 4]
    logits = [torch.randn(B, T, len(vocab_ids), requires_grad=True) for _ in shifts]
    rows = distill_rows(logits, shifts, batch, head, 3, kind, vocab_ids, chunk=3)
    want = [ref_loss(x, ahead(sub, k)) for x, k in zip(logits, shifts)]
    for got, ref in zip(rows, want):
        torch.testing.assert_close(got, ref)
    grads = torch.autograd.grad(sum(r.sum() for r in rows), logits)
    ref_grads = torch.autograd.grad(sum(r.sum() for r in want), logits)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)
    # past the end (shift 4: the last 4 rows) the teacher is empty and so is the loss
    assert rows[2][:, -4:].abs().max() == 0 and rows[2][:, :-4].abs().min() > 0
