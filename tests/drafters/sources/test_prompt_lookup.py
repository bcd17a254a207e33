"""Prompt lookup: match search and trie building, greedy equality with AR (chain and multi-branch), τ on a repeat."""

from __future__ import annotations

import pytest
import torch

from decode.generate import encode_prompt, generate
from decode.protocol import Budget, TargetStep
from decode.tree import Shape
from drafters.registry import make_drafter
from drafters.sources.ar import ARDrafter
from drafters.sources.prompt_lookup import PromptLookupDrafter, trie
from tests.conftest import DEV_PROMPTS


def started(drafter: PromptLookupDrafter, context: list[int]) -> PromptLookupDrafter:
    """The drafter after `begin` on a context whose last token is the pending one."""
    ids = torch.tensor(context)
    drafter.begin(ids[:1], TargetStep(ids[1:], {}, [], 1))
    return drafter


class Recorder:
    """Wraps a drafter and keeps every tree it proposed (to prove a test exercised branching)."""

    def __init__(self, inner) -> None:
        self.inner, self.trees = inner, []
        self.name, self.hidden_ids, self.forward_passes = inner.name, inner.hidden_ids, 0

    def begin(self, prompt_ids, step) -> None:
        self.inner.begin(prompt_ids, step)

    def propose(self, budget):
        self.trees.append(self.inner.propose(budget))
        return self.trees[-1]

    def accept(self, step) -> None:
        self.inner.accept(step)

    def branching(self) -> int:
        return sum(int((t.parents == -1).sum()) > 1 or t.size > t.depth() for t in self.trees)


def test_matches_most_recent_first_as_branches():
    # "5 6" occurs twice earlier with different continuations; the later one must come first
    d = started(PromptLookupDrafter(ngram=2, min_ngram=1, k=3, branches=4), [5, 6, 7, 8, 9, 5, 6, 1, 2, 3, 4, 5, 6])
    assert d.continuations(3) == [[1, 2, 3], [7, 8, 9]]
    tree = d.propose(Budget(Shape("chain", k=8)))
    assert tree.tokens[:3].tolist() == [1, 2, 3] and tree.parents[:3].tolist() == [-1, 0, 1]
    assert tree.tokens[3:6].tolist() == [7, 8, 9] and tree.parents[3].item() == -1
    assert tree.q is None and tree.conf is None  # deterministic, no probabilities


def test_one_branch_is_a_chain_and_depth_follows_the_budget():
    d = started(PromptLookupDrafter(ngram=2, k=10, branches=1), [5, 6, 7, 8, 9, 5, 6, 1, 2, 3, 4, 5, 6])
    tree = d.propose(Budget(Shape("chain", k=2)))
    assert tree.tokens.tolist() == [1, 2] and tree.parents.tolist() == [-1, 0]
    assert d.propose(Budget(Shape("chain", k=0))).size == 0


def test_loop_keeps_copying_its_own_draft_and_no_match_is_empty():
    d = started(PromptLookupDrafter(ngram=2, k=7, branches=1), [3, 4, 5, 3, 4, 5, 3, 4])
    assert d.propose(Budget(Shape("chain", k=7))).tokens.tolist() == [5, 3, 4, 5, 3, 4, 5]
    assert started(PromptLookupDrafter(), [1, 2, 3, 4]).propose(Budget(Shape())).size == 0


def test_trie_shares_prefixes():
    tree = trie([[1, 2, 3], [1, 2, 4], [5]])
    assert tree.tokens.tolist() == [1, 2, 3, 4, 5] and tree.parents.tolist() == [-1, 0, 1, 1, -1]


@pytest.mark.parametrize("spec", ["prompt-lookup:branches=1", "prompt-lookup:ngram=3,branches=4,k=6"])
def test_greedy_equals_ar_tiny(tiny, spec):
    torch.manual_seed(1)
    base = torch.randint(3, 128, (6,))
    prompt = torch.cat([base, base[:4], torch.randint(3, 128, (3,)), base[:3]])  # repeats give matches
    ref = generate(tiny, ARDrafter(), prompt, 48)
    rec = Recorder(make_drafter(spec, tiny))
    gen = generate(tiny, rec, prompt, 48)
    assert gen.tokens == ref.tokens
    assert gen.stats.draft_nodes > 0  # the lookup did propose drafts
    if "branches=4" in spec:
        assert rec.branching() > 0  # and some were trees, not chains


@pytest.mark.parametrize(
    "spec,shape",
    [
        ("prompt-lookup:branches=1", Shape("chain", k=8)),
        ("prompt-lookup", Shape("chain", k=8)),
        ("prompt-lookup", Shape("dynamic", topk=4, depth=5, nodes=20)),
    ],
)
def test_greedy_equals_ar_bundled(stories, spec, shape):
    prompts = DEV_PROMPTS.read_text().splitlines()
    for text in prompts[:2]:
        ids = encode_prompt(stories, text)
        ref = generate(stories, ARDrafter(), ids, 64)
        gen = generate(stories, make_drafter(spec, stories), ids, 64, shape=shape)
        assert gen.tokens == ref.tokens
        assert gen.stats.target_passes < ref.stats.target_passes


def test_tau_above_3_when_the_answer_repeats_the_prompt(stories):
    # The story this prompt starts falls into a loop (greedy); with 240 of its tokens in the prompt,
    # the next 64 repeat text the prompt already holds.
    ids = encode_prompt(stories, DEV_PROMPTS.read_text().splitlines()[13])
    story = generate(stories, ARDrafter(), ids, 240).tokens
    prompt = torch.cat([ids, torch.tensor(story)])
    ref = generate(stories, ARDrafter(), prompt, 64)
    gen = generate(stories, make_drafter("prompt-lookup", stories), prompt, 64, shape=Shape("chain", k=16))
    assert gen.tokens == ref.tokens
    assert gen.stats.tau > 3.0, gen.stats.tau


@pytest.mark.parametrize(
    "spec",
    [
        "prompt-lookup:ngram=0",
        "prompt-lookup:min=4,ngram=3",
        "prompt-lookup:k=0",
        "prompt-lookup:branches=0",
        "prompt-lookup:width=3",
    ],
)
def test_bad_specs(tiny, spec):
    with pytest.raises(ValueError, match="prompt-lookup"):
        make_drafter(spec, tiny)
