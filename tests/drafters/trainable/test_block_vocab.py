"""A draft vocabulary for the block drafters (`draft_vocab_size` N): the frozen head scores only the rows of the N
most frequent training tokens; drafts stay inside it, decoding stays lossless, training skips the rows it cannot
reach, and a checkpoint carries the vocabulary it was trained on."""

from __future__ import annotations

import pytest
import torch

from decode.generate import generate
from decode.tree import Shape
from drafters.registry import make_drafter
from drafters.serving.checkpoint import save_drafter
from drafters.sources.ar import ARDrafter
from drafters.trainable.block_drafter import block_rows_fn
from drafters.trainable.dflash import DFlash, DFlashConfig
from drafters.trainable.dspark import DSpark, DSparkConfig
from tests.conftest import tiny_target
from tests.drafters.batches import chat_like_batch, fit, make_batch, random_sequences, record_rounds, sharp_target
from tests.drafters.trainable.test_block import KINDS, build
from tests.drafters.trainable.test_block_decode import PROMPT, SHAPES

N = 48  # of the tiny targets' 128 tokens


def counts(v: int, seed: int = 0) -> torch.Tensor:
    """Token frequencies whose top N are scattered over the vocabulary (not simply the first ids)."""
    return torch.randperm(v, generator=torch.Generator().manual_seed(seed))


def vocab_drafter(kind: str, target, **cfg):
    cls, config = KINDS[kind]
    torch.manual_seed(0)
    m = cls(target, config(block_size=4, anchors=6, draft_vocab_size=N, **cfg), token_counts=counts(target.vocab_size))
    if kind == "dspark":
        with torch.no_grad():
            m.markov.proj.weight.normal_(0, 0.5)
    return m


def test_the_vocabulary_is_the_most_frequent_tokens_and_config_checks(tiny):
    m = vocab_drafter("dflash", tiny)
    want = torch.topk(counts(tiny.vocab_size).double(), N).indices.sort().values
    assert torch.equal(m.draft_ids, want) and int(m.t2d.sum()) == N
    assert {"d2t", "t2d"} <= set(m.state_dict())
    cols = m.columns(torch.arange(tiny.vocab_size))
    assert torch.equal(cols[want], torch.arange(N)) and bool((cols[~m.t2d] == -1).all())
    z = torch.randn(3, tiny.hidden_size)
    torch.testing.assert_close(m.logits(z), tiny.lm_head(z)[:, want])  # the target's own rows, nothing learned
    torch.testing.assert_close(m.decode_head()(z), m.logits(z), rtol=1e-5, atol=1e-5)
    assert DFlash(tiny, DFlashConfig(draft_vocab_size=tiny.vocab_size)).config.draft_vocab_size == 0  # = all of it
    assert DFlash(tiny).draft_ids is None and "d2t" not in DFlash(tiny).state_dict()
    with pytest.raises(ValueError, match="draft_vocab_size -1: 0 = the target's vocabulary"):
        DSparkConfig(draft_vocab_size=-1)


def test_a_biased_head_keeps_its_bias_on_the_vocabulary_rows():
    """A target whose LM head has a bias: training and decoding logits are the head's own rows, bias included."""
    t = tiny_target("qwen3", seed=2)
    t.lm_head.bias = torch.nn.Parameter(torch.randn(t.vocab_size), requires_grad=False)
    m = vocab_drafter("dspark", t)
    z = torch.randn(3, t.hidden_size)
    torch.testing.assert_close(m.logits(z), t.lm_head(z)[:, m.draft_ids])
    torch.testing.assert_close(m.decode_head()(z), m.logits(z), rtol=1e-5, atol=1e-5)


def test_dspark_rows_over_the_vocabulary_equal_the_head_on_its_states(tiny):
    m = vocab_drafter("dspark", tiny).eval()
    h = torch.randn(3, tiny.hidden_size)
    with torch.no_grad():
        lp, conf = block_rows_fn(m, h, head=m.decode_head())([2, 0, 1], [4, 5, 9])
        z = m.head_states(h[[2, 0, 1]], torch.tensor([4, 5, 9]))
    assert lp.shape == (3, N)
    torch.testing.assert_close(lp, torch.log_softmax(m.logits(z).float(), -1), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(conf, m.confidence(z))


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_equals_ar_and_drafts_stay_in_the_vocabulary(tiny, kind):
    ref = generate(tiny, ARDrafter(), PROMPT, 20).tokens
    m = vocab_drafter(kind, tiny)
    inside = set(m.draft_ids.tolist())
    for name, shape in SHAPES.items():
        d = m.drafter()
        rounds = record_rounds(d)
        assert generate(tiny, d, PROMPT, 20, shape=shape).tokens == ref, (kind, name)
        assert all(set(r.tokens.tolist()) <= inside for r in rounds), name


@pytest.mark.parametrize("kind", KINDS)
def test_trains_on_the_reachable_rows(kind):
    t = sharp_target("qwen3")
    m = vocab_drafter(kind, t).train()
    batch = make_batch(t, random_sequences(t, 2, 16), m.feature_ids())
    before = m.position_accuracy(batch)[0]
    losses = fit(m, batch, steps=30)
    assert losses[-1] < 0.8 * losses[0], losses
    assert m.position_accuracy(batch)[0] > before
    for loss in ("kl", "ce"):
        full = build(kind, t, loss=loss).train()
        cut = vocab_drafter(kind, t, loss=loss).train()
        cut.load_state_dict({**full.state_dict(), "d2t": cut.d2t, "t2d": cut.t2d})
        a, b = full(chat_like_batch(t, full.feature_ids()), 0), cut(chat_like_batch(t, cut.feature_ids()), 0)
        assert torch.isfinite(b[0]) and not torch.equal(a[0], b[0]), loss  # fewer rows, renormalised teacher


def test_the_checkpoint_carries_its_vocabulary(tmp_path):
    target = tiny_target("qwen3", seed=3)
    m = vocab_drafter("dspark", target)
    out = save_drafter(m, tmp_path / "export", target_id="tiny")
    loaded = make_drafter(str(out), target)
    assert torch.equal(loaded.vocab, m.draft_ids)
    ref = generate(target, ARDrafter(), PROMPT, 12).tokens
    own, theirs = m.drafter(), loaded
    a, b = record_rounds(own), record_rounds(theirs)
    for d in (own, theirs):
        assert generate(target, d, PROMPT, 12, shape=Shape("chain", k=3)).tokens == ref
    assert [r.tokens.tolist() for r in a] == [r.tokens.tolist() for r in b]
    assert isinstance(DSpark(target, DSparkConfig(draft_vocab_size=N)).d2t, torch.Tensor)
