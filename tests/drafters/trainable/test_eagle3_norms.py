"""EAGLE-3.1's two norms (`drafter.eagle3.fc_norm`, `drafter.eagle3.norm_output`), as vLLM 0.32's llama_eagle3.py
computes them: an RMSNorm on each captured state before fc, and the post-norm state fed to the next draft step.
Trained, and decoded exactly as the training-time unroll computes. Greedy = AR for every draft shape, the native
round trip and bf16 decoding run as the `eagle3-norms` kind of tests/drafters/batches.py; the engine layouts:
tests/drafters/serving/test_export_eagle3_norms.py."""

from __future__ import annotations

import pytest
import torch

from decode.generate import generate
from decode.tree import Shape
from drafters.trainable.eagle3 import Eagle3, Eagle3Config
from tests.drafters.batches import fit, make_batch, random_sequences, record_rounds, sharp_target

OPTIONS = {
    "fc_norm": {"fc_norm": True},
    "norm_output": {"norm_output": True},
    "both": {"fc_norm": True, "norm_output": True},
}


def eagle3(target, seed: int = 0, capture_ids: tuple[int, ...] = (), **options) -> Eagle3:
    """A random EAGLE-3 drafter with the given switches; fc_norm's weights moved off their ones so that each
    capture id's own weight shows."""
    torch.manual_seed(seed)
    counts = torch.randint(0, 100, (target.vocab_size,))
    cfg = Eagle3Config(capture_ids=capture_ids, draft_vocab_size=96, ttt_steps=3, **options)
    m = Eagle3(target, cfg, token_counts=counts)
    with torch.no_grad():
        for norm in m.fc_norm or ():
            norm.weight.uniform_(0.5, 1.5)
    return m


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def test_off_by_default_adds_no_weights(tiny):
    m = eagle3(tiny)
    assert m.fc_norm is None and not any(k.startswith("fc_norm") for k in m.state_dict())
    assert (Eagle3Config().fc_norm, Eagle3Config().norm_output) == (False, False)


def test_fc_norm_norms_each_captured_state_before_fc(tiny):
    """project = fc(cat(RMSNorm_i(h_i))): one norm per capture id (keys fc_norm.{i}.weight), the target's eps."""
    m = eagle3(tiny, fc_norm=True)
    assert sorted(k for k in m.state_dict() if k.startswith("fc_norm")) == [f"fc_norm.{i}.weight" for i in range(3)]
    eps = float(tiny.config.rms_norm_eps)
    assert all(n.eps == eps for n in m.fc_norm)
    batch = make_batch(tiny, random_sequences(tiny, 2, 8), m.feature_ids())
    h = batch["hidden"]
    want = torch.cat([rms(h[i], n.weight, eps) for i, n in zip(m.config.capture_ids, m.fc_norm)], -1) @ m.fc.weight.T
    torch.testing.assert_close(m.project(h), want)


def test_norm_output_feeds_the_post_norm_state(tiny):
    """The same weights with and without norm_output: step 1 predicts alike (its logits are the head over the
    normed output either way), the state it hands on is the normed one, so the steps after it differ."""
    plain, normed = eagle3(tiny), eagle3(tiny, norm_output=True)
    assert all(torch.equal(v, normed.state_dict()[k]) for k, v in plain.state_dict().items())
    batch = make_batch(tiny, random_sequences(tiny, 2, 10), plain.feature_ids())
    (a0, s0), (a1, _), _ = plain.unroll(batch, 3)
    (b0, t0), (b1, _), _ = normed.unroll(batch, 3)
    torch.testing.assert_close(b0, a0)
    torch.testing.assert_close(t0, plain.norm(s0))
    assert not torch.allclose(b1, a1, atol=1e-4)


@pytest.mark.parametrize("option", OPTIONS)
def test_chain_decoding_equals_training_unroll(tiny, option):
    """Each round's greedy chain = the argmax chain of the training-time unroll at its root row: the decoder
    projects and feeds back the states the unroll trains on."""
    m = eagle3(tiny, seed=1, **OPTIONS[option])
    drafter = m.drafter()
    rounds = record_rounds(drafter)
    prompt = [1, 5, 9, 33, 17, 4]
    emitted: list[list[int]] = []
    contexts = []
    inner = drafter.propose

    def propose(budget):  # the context a round drafts from: prompt + everything emitted so far
        contexts.append(prompt + [t for chunk in emitted for t in chunk])
        return inner(budget)

    drafter.propose = propose
    generate(tiny, drafter, torch.tensor(prompt), 20, shape=Shape("chain", k=3), on_tokens=emitted.append)
    assert len(rounds) >= 3
    for context, tree in zip(contexts, rounds):
        if tree.size:
            steps = m.unroll(
                make_batch(tiny, torch.tensor([context + tree.tokens.tolist()]), m.feature_ids()), tree.size
            )
            root = len(context) - 2  # row (feature of the last committed position, pending token)
            assert [int(m.to_target(lg[0, root].argmax())) for lg, _ in steps] == tree.tokens.tolist()


@pytest.mark.parametrize("option", OPTIONS)
def test_trains_with_each_option(option):
    """The loss falls, and fc_norm's weights are trained parameters."""
    t = sharp_target("qwen3")
    m = eagle3(t, **OPTIONS[option])
    before = {k: v.clone() for k, v in m.state_dict().items() if k.startswith("fc_norm")}
    losses = fit(m, make_batch(t, random_sequences(t, 2, 16), m.feature_ids()))
    assert losses[-1] < 0.9 * losses[0], losses  # the plain drafter of this setup: 12.11 -> 10.32 in 30 steps
    assert all(not torch.equal(v, m.state_dict()[k]) for k, v in before.items())
    assert bool(before) == OPTIONS[option].get("fc_norm", False)
