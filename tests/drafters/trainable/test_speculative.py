"""Every trained drafter kind x chain / static / dynamic tree: greedy speculative output equals AR token for token."""

from __future__ import annotations

import pytest
import torch

from decode.generate import generate
from decode.sampling import SamplingConfig
from decode.tree import Shape
from drafters.sources.ar import ARDrafter
from tests.conftest import tiny_target
from tests.drafters.batches import KINDS, build

SHAPES = {
    "chain": Shape("chain", k=4),
    "static": Shape("static", choices=((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))),
    "dynamic": Shape("dynamic", topk=3, depth=3, nodes=8),
}
PROMPT = torch.tensor([1, 5, 9, 33, 17, 4, 60])


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_equals_ar(tiny, kind):
    ref = generate(tiny, ARDrafter(), PROMPT, 14).tokens
    m = build(kind, tiny)
    for name, shape in SHAPES.items():
        d = m.drafter()
        gen = generate(tiny, d, PROMPT, 14, shape=shape)
        assert gen.tokens == ref, (kind, name)
        assert gen.stats.rounds > 0 and d.forward_passes > 0
        assert gen.stats.draft_nodes > 0


@pytest.mark.parametrize("kind", KINDS)
def test_sampling_runs_chain_with_q_and_tree_without(kind):
    tiny = tiny_target("qwen3")
    m = build(kind, tiny)
    sampling = SamplingConfig(temperature=0.8)
    trees = []
    for shape in (SHAPES["chain"], SHAPES["dynamic"]):
        d = m.drafter()
        inner = d.propose
        d.propose = lambda budget, inner=inner: trees.append(inner(budget)) or trees[-1]
        gen = generate(tiny, d, PROMPT, 12, sampling=sampling, shape=shape, seed=3)
        assert len(gen.tokens) == 12
    is_chain = [bool((t.parents == torch.arange(t.size) - 1).all()) for t in trees]
    chains = [t for t, c in zip(trees, is_chain) if c and t.size]
    branched = [t for t, c in zip(trees, is_chain) if not c]
    assert chains and all(
        t.q is not None and torch.allclose(t.q.sum(-1), torch.ones(t.size, dtype=t.q.dtype)) for t in chains
    )
    assert branched and all(t.q is None for t in branched)
