"""The LK losses of drafters/trainable/lk.py (train.loss=lk): acceptance against a brute-force sum, the optimum
at q = p, a gradient step that raises acceptance, the chunked teacher against the whole one, and every drafter's
loss under lk."""

from __future__ import annotations

import pytest
import torch

from drafters.trainable.lk import KL, Objective, lk_loss, lk_losses, overlap_rows, use_objective
from drafters.trainable.losses import kl_to
from tests.drafters.batches import KINDS, build, chat_like_batch, fit, make_batch, random_sequences, sharp_target

LAMBDA, ALPHA = Objective("lk", "lambda"), Objective("lk", "alpha")


def head_batch(source: str, B: int = 2, T: int = 10, H: int = 8, V: int = 12, seed: int = 0):
    """A random frozen head and the batch its teacher reads: hidden states (+ their logits' logsumexp), or their
    top-4 (renormalised).
    -> (head, batch, P [B, T, V] as the teacher sees it)"""
    torch.manual_seed(seed)
    head = torch.nn.Linear(H, V, bias=True)
    h = torch.randn(B, T, H)
    full = torch.softmax(head(h), -1).detach()
    batch = {"hidden": {3: h}}
    if source == "logz":  # the stored log-normaliser (feature caches): P's own probabilities from V' rows only
        batch["logz"] = head(h).logsumexp(-1).detach()
    if source == "topk":
        tk = full.topk(4, -1)
        batch.update(topk_ids=tk.indices, topk_probs=tk.values)
        full = torch.zeros(B, T, V).scatter_(-1, tk.indices, tk.values)
        full = full / full.sum(-1, keepdim=True)
    return head, batch, full


def test_alpha_is_the_sum_of_minima_brute_force():
    """α_t = Σ_x min(p(x), q(x)), summed word by word; over a draft vocabulary p is the target's own probability
    of each word (not renormalised), so the acceptance the missing words take is lost."""
    head, batch, full = head_batch("hidden")
    logits = torch.randn(2, 10, 12)
    (alpha,), _ = overlap_rows([logits], batch, head, 3)
    q = torch.softmax(logits, -1)
    for b in range(2):
        for t in range(10):
            want = sum(min(float(full[b, t, x]), float(q[b, t, x])) for x in range(12))
            assert float(alpha[b, t]) == pytest.approx(want, abs=1e-6)
    ids = torch.tensor([0, 2, 3, 5, 7, 11])
    sub = torch.randn(2, 10, 6)
    (alpha,), _ = overlap_rows([sub], batch, head, 3, ids)
    q = torch.softmax(sub, -1)
    want = [
        [sum(min(float(full[b, t, x]), float(q[b, t, i])) for i, x in enumerate(ids)) for t in range(10)]
        for b in (0, 1)
    ]
    torch.testing.assert_close(alpha, torch.tensor(want))


@pytest.mark.parametrize("objective", [LAMBDA, ALPHA], ids=["lambda", "alpha"])
def test_lk_is_least_at_q_equal_p_where_alpha_is_one(objective):
    head, batch, full = head_batch("hidden")
    valid = torch.ones(2, 10, dtype=torch.bool)
    at_p = full.log().requires_grad_(True)
    (loss,), (alpha,) = lk_losses([at_p], [valid], batch, head, 3, objective)
    assert float(alpha) == pytest.approx(1.0, abs=1e-6)
    assert float(loss.detach()) == pytest.approx(0.0, abs=1e-5)
    # 1 - α has a kink at q = p (no gradient to check there): the minimum shows as every move away costing
    for seed, size in enumerate([1.0, 1.0, 0.1, 0.1, 0.01]):
        g = torch.Generator().manual_seed(seed)
        off = full.log() + size * torch.randn(full.shape, generator=g)
        (other,), (a,) = lk_losses([off], [valid], batch, head, 3, objective)
        assert float(other) > float(loss.detach()) + size / 100 and float(a) < 1.0


@pytest.mark.parametrize("objective", [LAMBDA, ALPHA], ids=["lambda", "alpha"])
def test_a_gradient_step_on_the_logits_raises_alpha(objective):
    head, batch, _ = head_batch("hidden", seed=1)
    valid = torch.ones(2, 10, dtype=torch.bool)
    logits = (3 * torch.randn(2, 10, 12)).requires_grad_(True)  # a confident drafter, far from the target
    seen = []
    for _ in range(5):
        (loss,), (alpha,) = lk_losses([logits], [valid], batch, head, 3, objective)
        seen.append(float(alpha))
        (grad,) = torch.autograd.grad(loss, logits)
        with torch.no_grad():
            logits -= 2.0 * grad
    assert all(b > a for a, b in zip(seen, seen[1:])), seen


@pytest.mark.parametrize("source", ["hidden", "logz", "topk"])
@pytest.mark.parametrize("vocab", ["full", "draft"])
def test_chunked_overlap_equals_the_whole_teacher(source, vocab):
    """overlap_rows over chunks of 3 rows (three outputs) = α and KL against the whole [B, T, V'] teacher built
    at once, in value and in gradient, and so does each LK loss built on them."""
    head, batch, full = head_batch(source)
    ids = torch.tensor([0, 2, 3, 5, 7, 11]) if vocab == "draft" else None
    own = full if ids is None else full[..., ids]  # α's p: the target's own probabilities
    renorm = own / own.sum(-1, keepdim=True).clamp(min=1e-12)  # KL's p, as distill_rows reads it
    logits = [torch.randn(2, 10, own.shape[-1], requires_grad=True) for _ in range(3)]
    alphas, kls = overlap_rows(logits, batch, head, 3, ids, with_kl=True, chunk=3)
    ref_a = [torch.minimum(own, torch.softmax(x, -1)).sum(-1) for x in logits]
    ref_k = [kl_to(x, renorm) for x in logits]
    for got, ref in zip(alphas + kls, ref_a + ref_k):
        torch.testing.assert_close(got, ref)
    w = [torch.randn(2, 10) for _ in range(6)]
    grads = torch.autograd.grad(sum((r * x).sum() for r, x in zip(alphas + kls, w)), logits)
    ref_grads = torch.autograd.grad(sum((r * x).sum() for r, x in zip(ref_a + ref_k, w)), logits)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)
    valid = torch.rand(2, 10) > 0.3
    for objective in (LAMBDA, ALPHA, Objective("lk", "lambda", eta=0.5, kl_scale=0.7)):
        alphas, kls = overlap_rows(logits, batch, head, 3, ids, with_kl=True, chunk=3)
        got = [lk_loss(a, k, valid, objective) for a, k in zip(alphas, kls)]
        q = [torch.softmax(x, -1) for x in logits]
        want = [lk_loss(torch.minimum(own, x).sum(-1), kl_to(y, renorm), valid, objective) for x, y in zip(q, logits)]
        torch.testing.assert_close(torch.stack(got), torch.stack(want))
        g = torch.autograd.grad(sum(got), logits)
        r = torch.autograd.grad(sum(want), logits)
        for x, y in zip(g, r):
            torch.testing.assert_close(x, y)


def test_a_stored_log_normaliser_reads_only_the_draft_rows_of_the_head():
    """With `logz` in the batch, α and KL over a draft vocabulary never read the head's other rows: changing them
    changes nothing (without it, one pass of the whole head normalises P, and they move α)."""
    head, batch, _ = head_batch("logz")
    ids = torch.tensor([0, 2, 3, 5, 7, 11])
    logits = [torch.randn(2, 10, 6)]
    before = overlap_rows(logits, batch, head, 3, ids, with_kl=True)
    with torch.no_grad():
        head.weight[1] += 5.0  # a row outside the draft vocabulary
    after = overlap_rows(logits, batch, head, 3, ids, with_kl=True)
    assert all(torch.equal(a, b) for a, b in zip(before[0] + before[1], after[0] + after[1]))
    moved = overlap_rows(logits, {"hidden": batch["hidden"]}, head, 3, ids, with_kl=True)
    assert not torch.allclose(moved[0][0], after[0][0])


def test_lambda_blends_kl_into_one_minus_alpha():
    """λ = kl_scale · exp(-η · ᾱ) (no gradient through λ): η = 0, kl_scale = 1 is KL itself; kl_scale = 0 is 1 - ᾱ."""
    alpha, kl = torch.tensor([[0.2, 0.6, 0.9]]), torch.tensor([[1.5, 0.5, 0.1]])
    valid = torch.tensor([[True, True, False]])
    assert float(lk_loss(alpha, kl, valid, Objective("lk", eta=0.0))) == pytest.approx(1.0)
    assert float(lk_loss(alpha, kl, valid, Objective("lk", kl_scale=0.0))) == pytest.approx(0.6)
    lam = torch.exp(torch.tensor(-3 * 0.4))
    assert float(lk_loss(alpha, kl, valid, LAMBDA)) == pytest.approx(float(lam * 1.0 + (1 - lam) * 0.6))
    assert float(lk_loss(alpha, kl, valid, ALPHA)) == pytest.approx(-(torch.log(alpha[0, :2]).mean()).item())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("objective", [LAMBDA, ALPHA], ids=["lambda", "alpha"])
def test_every_drafter_trains_with_lk(tiny, kind, objective):
    m = build(kind, tiny)
    if kind == "medusa":
        m.config.loss = "kl"  # lk needs the target's distributions (the default ce mode trains on labels)
    use_objective(m, objective)
    batch = chat_like_batch(tiny, m.feature_ids())
    loss, metrics = m(batch, 0)
    assert torch.isfinite(loss) and loss.requires_grad
    loss.backward()
    alphas = {k: v for k, v in metrics.items() if k.startswith("alpha_")}
    assert alphas and all(0.0 < v <= 1.0 for v in alphas.values()), metrics
    assert any(k.startswith("lk_") for k in metrics) and not any(k.startswith(("ce_", "kl_")) for k in metrics)


def test_lk_raises_the_acceptance_of_a_trained_eagle3():
    torch.manual_seed(0)
    t = sharp_target("qwen3")
    m = build("eagle3", t)
    use_objective(m, ALPHA)
    batch = make_batch(t, random_sequences(t, 2, 16), m.feature_ids())
    before = m(batch, 0)[1]["alpha_1"]
    fit(m, batch, steps=20)
    assert m(batch, 0)[1]["alpha_1"] > before + 0.05


def test_the_kl_default_and_lk_with_token_labels(tiny):
    m = build("medusa", tiny)  # loss=ce: token labels
    assert m.objective is KL
    use_objective(m, KL)
    with pytest.raises(
        ValueError, match=r"drafter\.medusa\.loss=ce trains on token labels.*set drafter\.medusa\.loss=kl"
    ):
        use_objective(m, LAMBDA)
    with pytest.raises(ValueError, match="kl_scale in"):
        Objective("lk", kl_scale=1.5)
    with pytest.raises(ValueError, match="LK variant"):
        Objective("lk", "tv")
