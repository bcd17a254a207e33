"""Growing drafts from log-probs over a sub-vocabulary's columns (an EAGLE-3 draft vocabulary) is the
same as growing them from the target-wide rows with -inf outside it: same trees, same q."""

from __future__ import annotations

import pytest
import torch

from decode.protocol import Budget
from decode.sampling import SamplingConfig, TorchRng, probs_from_logits
from decode.tree import Shape, grow
from drafters.common import sampler

V = 40
VOCAB = torch.tensor([1, 3, 4, 8, 9, 15, 16, 22, 23, 30, 31, 39])  # ascending target ids, as d2t keeps them


def column_step(seed: int):
    """A fake drafter step: log-probs over VOCAB's columns, a fixed function of (node id, token, parent)."""

    def step(ids: list[int], tokens: list[int], parents: list[int]) -> torch.Tensor:
        rows = []
        for i, t, p in zip(ids, tokens, parents):
            g = torch.Generator().manual_seed(hash((seed, i, t, p)) % (2**31))
            rows.append(torch.log_softmax(torch.randn(VOCAB.numel(), generator=g) * 2, -1))
        return torch.stack(rows)  # [n, N]

    return step


def spread(step):
    """The same step's rows over the whole vocabulary [n, V], -inf outside VOCAB (how drafters used to return them)."""

    def full(ids, tokens, parents):
        cols = step(ids, tokens, parents)
        out = torch.full((cols.shape[0], V), float("-inf"))
        out[:, VOCAB] = cols
        return out

    return full


SHAPES = [
    Shape("chain", k=5),
    Shape("static", choices=((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 2))),
    Shape("dynamic", topk=3, depth=4, nodes=9),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.kind)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_column_vocab_grows_the_same_greedy_tree(shape, seed):
    budget = Budget(shape, SamplingConfig(), None)
    step = column_step(seed)
    cols = grow(step, 7, shape, sampler(budget, VOCAB, V), VOCAB)
    full = grow(spread(step), 7, shape, sampler(budget))
    assert cols.tokens.tolist() == full.tokens.tolist()
    assert cols.parents.tolist() == full.parents.tolist()
    assert set(cols.tokens.tolist()) <= set(VOCAB.tolist())
    if cols.conf is not None:
        assert torch.allclose(cols.conf, full.conf)


@pytest.mark.parametrize(
    "cfg",
    [
        SamplingConfig(temperature=1.0),
        SamplingConfig(temperature=0.7, top_p=0.8),
        SamplingConfig(temperature=1.3, top_k=4),
    ],
)
def test_sampled_chain_q_is_the_target_wide_distribution(cfg):
    """Each sampled token is in the vocabulary, and the q it is verified against is exactly the distribution
    the target-wide rows give (zero outside the vocabulary), so rejection sampling stays exact."""
    step = column_step(5)
    tree = grow(step, 7, Shape("chain", k=4), sampler(Budget(Shape("chain", k=4), cfg, TorchRng(3)), VOCAB, V), VOCAB)
    assert tree.q is not None and tree.q.shape == (tree.size, V)
    prev, parent = 7, -2
    for i, (tok, q) in enumerate(zip(tree.tokens.tolist(), tree.q)):
        lp_full = spread(step)([i - 1], [prev], [parent])[0]
        assert torch.allclose(q.double(), probs_from_logits(lp_full, cfg).double(), atol=1e-6)
        assert tok in VOCAB.tolist() and q[tok] > 0
        assert float(q[~torch.isin(torch.arange(V), VOCAB)].sum()) == 0.0
        prev, parent = tok, i - 1
