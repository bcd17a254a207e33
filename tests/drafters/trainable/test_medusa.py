"""Medusa heads: keys (vLLM layout), shapes, training, and decoding from each head's argmax."""

from __future__ import annotations

import pytest
import torch

from decode.generate import generate
from decode.tree import Shape
from drafters.trainable.medusa import Medusa, MedusaConfig, capped_shape
from tests.drafters.batches import fit, make_batch, random_sequences, record_rounds, sharp_target


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


@pytest.mark.parametrize("cfg", [MedusaConfig(loss="ce"), MedusaConfig(loss="kl", per_head_vocab=True, num_heads=2)],
                         ids=["ce-shared-head", "kl-own-heads"])
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
