"""Lookahead decoding: the window's mask, side rows in one pass (tree untouched, each column a true trajectory),
greedy equality with AR on tiny random targets and the bundled target."""

from __future__ import annotations

import pytest
import torch

from decode.generate import encode_prompt, generate
from decode.masks import SideRows
from decode.passes import forward_tree
from decode.tree import DraftTree, Shape
from drafters.registry import make_drafter
from drafters.sources.ar import ARDrafter
from drafters.sources.lookahead import window_layout
from tests.conftest import DEV_PROMPTS


@pytest.mark.parametrize("window,ngram", [(2, 3), (5, 4), (4, 6)])
def test_each_cell_sees_one_consecutive_trajectory(window, ngram):
    cells, offsets, see = window_layout(window, ngram)
    assert len(cells) == (window - 1) + (ngram - 2) * window
    pos = torch.cat([torch.tensor([0]), offsets])  # position offsets of [root] + cells
    for i in range(len(cells)):
        seen = pos[see[i]].sort().values
        assert seen.tolist() == list(range(int(offsets[i]) + 1)), cells[i]  # root .. itself, no gap, no repeat
        assert see[i, 1 + i]  # itself


def test_side_rows_ride_along_without_touching_the_tree(stories):
    """Tree logits are the same with or without side rows; a side row's logits are those of its own sequence."""
    ids = encode_prompt(stories, DEV_PROMPTS.read_text().splitlines()[0])
    cells, offsets, see = window_layout(4, 4)
    torch.manual_seed(0)
    side = SideRows(torch.randint(3, 500, (len(cells),)), offsets, see)
    tree = DraftTree(torch.tensor([10, 11, 12, 13]), torch.tensor([-1, 0, -1, 2]))
    outs = []
    for s in (None, side):
        cache = stories.new_cache()
        stories.prefill(ids[:-1], cache)
        outs.append(forward_tree(stories, int(ids[-1]), tree, cache, side=s).logits)
        assert cache.lens[0] == ids.numel() - 1 + 1 + tree.size + (len(cells) if s else 0)
    plain, both = outs
    torch.testing.assert_close(both[: 1 + tree.size], plain, rtol=1e-4, atol=1e-4)
    # the top-row cell of the last column reads root, row 0 up to its column, then its column upwards
    r, j = cells[-1]
    seq = [int(ids[-1])] + [int(side.tokens[cells.index((0, c))]) for c in range(1, j + 1)]
    seq += [int(side.tokens[cells.index((s, j))]) for s in range(1, r + 1)]
    ref = stories.forward(torch.cat([ids[:-1], torch.tensor(seq)]), stories.new_cache()).logits[-1]
    torch.testing.assert_close(both[-1], ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("spec", ["lookahead:window=4,ngram=3,guesses=4", "lookahead:window=5,ngram=4,guesses=6"])
def test_greedy_equals_ar_tiny(tiny, spec):
    torch.manual_seed(2)
    prompt = torch.randint(3, 128, (8,))
    ref = generate(tiny, ARDrafter(), prompt, 48)
    gen = generate(tiny, make_drafter(spec, tiny), prompt, 48)
    assert gen.tokens == ref.tokens


@pytest.mark.parametrize("shape", [Shape("chain", k=8), Shape("chain", k=2)])
def test_greedy_equals_ar_bundled(stories, shape):
    prompts = DEV_PROMPTS.read_text().splitlines()
    accepted = 0
    for text in prompts[:2]:
        ids = encode_prompt(stories, text)
        ref = generate(stories, ARDrafter(), ids, 64)
        gen = generate(stories, make_drafter("lookahead:window=6,ngram=4,guesses=6", stories), ids, 64, shape=shape)
        assert gen.tokens == ref.tokens
        assert len(gen.stats.proposed_by_depth) <= min(shape.k, 3)  # guesses are ngram - 1 long, capped by k
        accepted += sum(gen.stats.accepted_lengths)
    assert accepted > 0  # the pool's n-grams did get accepted


def test_window_left_out_near_max_positions(tiny):
    from decode.protocol import Budget, TargetStep

    drafter = make_drafter("lookahead:window=8,ngram=4", tiny)  # the window reaches 9 positions past the root
    for committed, fits in [(tiny.max_positions - 10, True), (tiny.max_positions - 9, False)]:
        prompt = torch.arange(3, 3 + committed) % 100 + 3
        drafter.begin(prompt, TargetStep(torch.cat([prompt[1:], torch.tensor([5])]), {}, [], committed))
        drafter.propose(Budget(Shape()))
        assert (drafter.side_rows() is not None) == fits


@pytest.mark.parametrize("spec", ["lookahead:ngram=2", "lookahead:window=1", "lookahead:guesses=0", "lookahead:n=3"])
def test_bad_specs(tiny, spec):
    with pytest.raises(ValueError, match="lookahead"):
        make_drafter(spec, tiny)


def test_sampling_path_runs_and_is_seeded(tiny):
    """Sampling verifies the tree rows only (side rows sliced off): runs to length or EOS, same seed -> same tokens."""
    from decode.sampling import SamplingConfig

    prompt = torch.randint(3, 128, (8,), generator=torch.Generator().manual_seed(4))
    cfg = SamplingConfig(temperature=0.8)
    runs = [
        generate(tiny, make_drafter(spec, tiny), prompt, 24, sampling=cfg, seed=7).tokens
        for spec in ["lookahead:window=4,ngram=3", "lookahead:window=4,ngram=3"]
    ]
    assert runs[0] == runs[1]
    assert len(runs[0]) == 24 or (runs[0][-1] in tiny.eos_ids and len(runs[0]) < 24)  # to length or to an EOS
