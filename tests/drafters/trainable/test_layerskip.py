"""LayerSkip: exit heads start as the untrained early exit, train with the exit loss; LoRA and the copied layers
never touch verification."""

from __future__ import annotations

import pytest
import torch

from decode.generate import generate
from decode.tree import Shape
from drafters.sources.early_exit import early_exit
from drafters.trainable.layerskip import LayerSkip, LayerSkipConfig
from tests.drafters.batches import (
    build,
    chat_like_batch,
    fit,
    make_batch,
    random_sequences,
    record_rounds,
    sharp_target,
)

PROMPT = torch.tensor([1, 5, 9, 33, 17, 4, 60])


def test_exit_head_keys_and_features(tiny):
    m = LayerSkip(tiny, LayerSkipConfig(adapter_rank=4, draft_exit=2))
    L = tiny.num_layers
    assert m.config.exits == tuple(range(1, L))
    assert set(m.state_dict()) == {f"exits.{e}.{k}.weight" for e in range(1, L) for k in ("norm", "down", "up")}
    assert m.feature_ids() == (*range(1, L), L)
    lora = LayerSkip(tiny, LayerSkipConfig(mode="lora", draft_exit=2))
    assert lora.feature_ids() == (L,) and lora.config.exits == (2,)
    assert not any(k.startswith(("embed", "lm_head", "model.")) for k in lora.state_dict())
    full = LayerSkip(tiny, LayerSkipConfig(mode="full", draft_exit=2))
    assert full.feature_ids() == (L,) and full.config.exits == (2,)
    plain = {k.replace(".base_layer", "") for k in tiny.layers[:2].state_dict() if ".lora_" not in k}
    assert set(full.state_dict()) == {"exits.2.norm.weight"} | {f"early.{k}" for k in plain}  # the LoRA above stays out


def test_bad_configs(tiny):
    L = tiny.num_layers
    with pytest.raises(ValueError, match="out of range"):
        LayerSkip(tiny, LayerSkipConfig(exits=(1, L)))
    with pytest.raises(ValueError, match="not among"):
        LayerSkip(tiny, LayerSkipConfig(exits=(1, 2), draft_exit=3))
    for mode in ("lora", "full"):
        with pytest.raises(ValueError, match=f"{mode} mode trains one exit"):
            LayerSkip(tiny, LayerSkipConfig(mode=mode, exits=(1, 2), draft_exit=2))
    with pytest.raises(ValueError, match="curriculum"):
        m = LayerSkip(tiny, LayerSkipConfig(curriculum="sideways"))
        m(make_batch(tiny, random_sequences(tiny, 1, 6), m.feature_ids()))


@pytest.mark.parametrize(
    "cfg",
    [LayerSkipConfig(draft_exit=2, adapter_rank=4), LayerSkipConfig(mode="full", draft_exit=2)],
    ids=["exit-head", "full"],
)
def test_untrained_drafts_exactly_like_early_exit(tiny, cfg):
    m = LayerSkip(tiny, cfg)
    trees = []
    for d in (m.drafter(), early_exit(tiny, 2)):
        rounds = record_rounds(d)
        generate(tiny, d, PROMPT, 14, shape=Shape("chain", k=3))
        trees.append([t.tokens.tolist() for t in rounds])
    assert trees[0] == trees[1]


def test_exit_head_chain_reuses_the_targets_kv(tiny):
    d = LayerSkip(tiny, LayerSkipConfig(draft_exit=2)).drafter()
    reuses = []
    inner = d.propose
    d.propose = lambda budget: (tree := inner(budget), reuses.append((tree.size, d.reuse())))[0]
    generate(tiny, d, PROMPT, 10, shape=Shape("chain", k=3))
    drafted = [r for size, r in reuses if size]
    assert drafted and all(r is not None and r.layers == 2 and r.hidden.shape[0] == 3 for r in drafted)


@pytest.mark.parametrize(
    "cfg",
    [
        LayerSkipConfig(adapter_rank=4, curriculum="rotational", scale="sum"),
        LayerSkipConfig(
            exits=(1, 2, 3), adapter_rank=8, curriculum="gradual", curriculum_steps=20, loss="ce", scale="linear"
        ),
        LayerSkipConfig(mode="lora", draft_exit=2, lora_rank=4, layer_dropout=0.2),
        LayerSkipConfig(mode="full", draft_exit=2, layer_dropout=0.2),
    ],
    ids=["exit-head-rotational", "exit-head-gradual-ce", "lora-layer-dropout", "full-layer-dropout"],
)
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_loss_decreases(family, cfg):
    torch.manual_seed(0)
    t = sharp_target(family)
    m = LayerSkip(t, cfg)
    batch = make_batch(t, random_sequences(t, 2, 16), m.feature_ids())
    first = m.eval()(batch, 10**6)[1]["loss"]  # eval mode (no layer dropout), every exit on
    fit(m.train(), batch)
    last = m.eval()(batch, 10**6)[1]["loss"]
    assert last < 0.8 * first, (first, last)


def test_lora_verification_equals_the_plain_target(tiny):
    ids = torch.tensor([1, 5, 9, 33, 17, 4, 60, 2, 8])
    plain = tiny.forward(ids, None).logits
    plain_exit = tiny.head(tiny.run_layers(tiny.embed(ids), 0, 2, None, torch.arange(ids.numel()))[0])
    m = build("layerskip-lora", tiny)  # LoRA injected into the target's layers 0..1, weights non-zero
    assert torch.equal(tiny.forward(ids, None).logits, plain)
    with m.adapters_on():  # drafting sees the adapters
        h, _ = tiny.run_layers(tiny.embed(ids), 0, 2, None, torch.arange(ids.numel()))
        assert not torch.allclose(tiny.head(h), plain_exit, atol=1e-3)
    # a whole speculative run leaves them off again: verification logits stay the plain target's
    generate(tiny, m.drafter(), PROMPT, 10, shape=Shape("dynamic", topk=2, depth=2, nodes=4))
    assert torch.equal(tiny.forward(ids, None).logits, plain)
    assert all(p.requires_grad for p in m.lora.parameters())


def test_full_mode_trains_its_copy_and_leaves_the_target_alone(tiny):
    ids = torch.tensor([1, 5, 9, 33, 17, 4, 60, 2, 8])
    plain = tiny.forward(ids, None).logits
    before = {k: v.clone() for k, v in tiny.layers[:2].state_dict().items()}
    m = LayerSkip(tiny, LayerSkipConfig(mode="full", draft_exit=2))
    fit(m.train(), make_batch(tiny, random_sequences(tiny, 2, 12), m.feature_ids()), steps=5)
    moved = [k for k, v in m.early.state_dict().items() if not torch.equal(v, before[k])]
    assert moved and all(torch.equal(v, before[k]) for k, v in tiny.layers[:2].state_dict().items())
    assert not any(p.requires_grad for p in tiny.layers.parameters())
    generate(tiny, m.drafter(), PROMPT, 10, shape=Shape("dynamic", topk=2, depth=2, nodes=4))
    assert torch.equal(tiny.forward(ids, None).logits, plain)  # verification is the plain target


def test_full_mode_after_a_lora_drafter_on_the_same_target_copies_plain_layers(tiny):
    # a benchmark loads a LoRA drafter, then a full one, on one target: the copy must not carry the LoRA wrappers
    fresh = LayerSkip(tiny, LayerSkipConfig(mode="full", draft_exit=2)).state_dict()
    LayerSkip(tiny, LayerSkipConfig(mode="lora", draft_exit=2, lora_rank=4))
    after = LayerSkip(tiny, LayerSkipConfig(mode="full", draft_exit=2)).state_dict()
    assert set(after) == set(fresh) and all(torch.equal(after[k], fresh[k]) for k in fresh)


def test_one_lora_drafter_per_target(tiny):
    LayerSkip(tiny, LayerSkipConfig(mode="lora", draft_exit=2))
    with pytest.raises(ValueError, match="already carries peft adapters"):
        LayerSkip(tiny, LayerSkipConfig(mode="lora", draft_exit=2))


def test_lora_needs_right_padding(tiny):
    m = LayerSkip(tiny, LayerSkipConfig(mode="lora", draft_exit=2))
    ids = random_sequences(tiny, 1, 6)
    batch = make_batch(tiny, ids, m.feature_ids(), attention_mask=torch.tensor([[0, 1, 1, 1, 1, 1]]))
    with pytest.raises(ValueError, match="right-padded"):
        m(batch)


@pytest.mark.parametrize(
    "cfg",
    [
        LayerSkipConfig(adapter_rank=4, loss="kl"),
        LayerSkipConfig(adapter_rank=4, loss="ce"),
        LayerSkipConfig(mode="lora", draft_exit=2, lora_rank=4),
        LayerSkipConfig(mode="full", draft_exit=2),
    ],
    ids=["kl", "ce", "lora", "full"],
)
def test_loss_on_loss_rows_only_equals_the_all_rows_loss(tiny, cfg):
    """The exit loss runs the exit heads only on rows that carry a loss: its value, accuracies and gradients
    equal the loss with every exit's head over every row, masked. The batch has a prompt and right padding."""
    from drafters.trainable.layerskip.objective import exit_curriculum, exit_loss_scales
    from drafters.trainable.losses import ahead, distill_rows, hard_ce, masked_mean, next_valid, teacher_argmax

    torch.manual_seed(0)
    m = LayerSkip(tiny, cfg)
    for p in m.parameters():  # away from the init, so the exits' heads differ
        if p.requires_grad:
            p.data.add_(torch.randn_like(p) * 0.05)
    batch = chat_like_batch(tiny, m.feature_ids())
    L, valid, c = tiny.num_layers, next_valid(batch), m.config
    argmax = teacher_argmax(batch, tiny.lm_head, L)
    scales = exit_loss_scales(c.exits, c.scale, exit_curriculum(c.curriculum, 0, len(c.exits)))
    ref, ref_metrics = 0.0, {}
    for e, s in zip(c.exits, scales):
        logits = m.exit_logits(e, m.exit_states(batch, e))
        rows = (
            distill_rows([logits], [0], batch, tiny.lm_head, L, "kl")[0]
            if c.loss == "kl"
            else hard_ce(logits, ahead(batch["input_ids"], 1))
        )
        ref = ref + s * masked_mean(rows, valid)
        ref_metrics[f"acc_exit{e}"] = float(masked_mean((logits.argmax(-1) == argmax).float(), valid))
    params = [p for p in m.parameters() if p.requires_grad]
    ref_grads = torch.autograd.grad(ref, params)
    got, metrics = m.loss(batch, 0)
    grads = torch.autograd.grad(got, params)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    assert {k: metrics[k] for k in ref_metrics} == pytest.approx(ref_metrics, abs=1e-6)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)
    assert any(g.abs().sum() > 0 for g in grads)
