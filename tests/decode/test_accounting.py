"""Scripted stub drafters (always / never / sometimes right) pin down τ and acceptance-by-depth accounting."""

from __future__ import annotations

import pytest
import torch

from decode.generate import generate
from decode.metrics import GenStats
from decode.protocol import Budget, TargetStep
from decode.tree import DraftTree, Shape
from decode.verify import verify_greedy
from drafters.sources.ar import ARDrafter


class Scripted:
    """Proposes the AR continuation for its first `right` tokens of each chain, then a wrong token."""

    hidden_ids: tuple[int, ...] = ()
    forward_passes = 0

    def __init__(self, reference: list[int], right: int, vocab: int) -> None:
        self.ref, self.right, self.vocab = reference, right, vocab
        self.name = f"scripted:{right}"

    def begin(self, prompt_ids, step: TargetStep) -> None:
        self.done = 1  # tokens emitted so far (the prefill's)

    def propose(self, budget: Budget) -> DraftTree:
        k = budget.shape.k
        want = self.ref[self.done : self.done + k]
        toks = [t if i < self.right else (t + 1) % self.vocab for i, t in enumerate(want)]
        return DraftTree.chain(toks)

    def accept(self, step: TargetStep) -> None:
        self.done += step.tokens.numel()


@pytest.fixture(scope="module")
def setup():
    from tests.conftest import tiny_target

    target = tiny_target("llama", "eager", seed=2)
    prompt = torch.tensor([1, 9, 17, 33])
    return target, prompt, generate(target, ARDrafter(), prompt, 60).tokens


def test_always_right(setup):
    target, prompt, ref = setup
    n = 1 + 3 * 9  # prefill token + three rounds of 8 accepted + bonus
    g = generate(target, Scripted(ref, 99, target.vocab_size), prompt, n, shape=Shape("chain", k=8))
    assert g.tokens == ref[:n]
    assert g.stats.target_passes == 4 and g.stats.tau == n / 4 == 7.0
    assert g.stats.acceptance_by_depth == [1.0] * 8 and g.stats.accepted_lengths == [8, 8, 8]


def test_never_right(setup):
    target, prompt, ref = setup
    g = generate(target, Scripted(ref, 0, target.vocab_size), prompt, 20, shape=Shape("chain", k=4))
    assert g.tokens == ref[:20]
    assert g.stats.tau == 1.0 and g.stats.target_passes == 20
    assert g.stats.acceptance_by_depth[:3] == [0.0, 0.0, 0.0]


def test_sometimes_right(setup):
    target, prompt, ref = setup
    n = 1 + 5 * 3  # every round accepts 2 of 4 and adds the bonus
    g = generate(target, Scripted(ref, 2, target.vocab_size), prompt, n, shape=Shape("chain", k=4))
    assert g.tokens == ref[:n]
    assert g.stats.target_passes == 6 and g.stats.tau == pytest.approx(n / 6)
    assert g.stats.acceptance_by_depth == [1.0, 1.0, 0.0, 0.0]
    assert g.stats.accepted_lengths == [2] * 5


def test_stats_merge_keeps_tau_as_tokens_over_passes():
    a, b = GenStats(new_tokens=10, target_passes=5), GenStats(new_tokens=3, target_passes=3)
    a.record_round(3, 2, 3)
    b.record_round(1, 0, 1)
    m = a.merge(b)
    assert m.tau == 13 / 8 and m.proposed_by_depth == [2, 1, 1] and m.accepted_by_depth == [1, 1, 0]
    assert m.acceptance_by_depth == [0.5, 1.0, 0.0]


def test_verify_greedy_takes_the_matching_branch():
    tree = DraftTree([4, 5, 6, 7], [-1, -1, 1, 1])  # root -> {4, 5}; 5 -> {6, 7}
    argmax = torch.tensor([5, 0, 7, 0, 0])  # root wants 5, node 1 (token 5) wants 7
    v = verify_greedy(tree, argmax)
    assert v.path == [1, 3] and v.bonus == 0
