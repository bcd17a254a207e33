"""Greedy speculative output equals AR token for token, for every untrained drafter and draft shape."""

from __future__ import annotations

import json

import pytest
import torch

from decode.generate import encode_prompt, generate
from decode.passes import forward_tree
from decode.sampling import SamplingConfig
from decode.target import Target
from decode.tree import Shape, parse_shape
from drafters.registry import make_drafter
from drafters.sources.ar import ARDrafter

STATIC = ((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 0, 0, 0))
SHAPES = {
    "chain": Shape("chain", k=4),
    "static": Shape("static", choices=STATIC),
    "dynamic": Shape("dynamic", topk=3, depth=4, nodes=12),
}


TEACHER_TAU = 4.0  # stories260K drafting 8 for the Qwen3 distilled from it: 6.7 measured (a random one: ~1)


def _save_tiny(tmp_path_factory, model, name):
    d = tmp_path_factory.mktemp(name)
    model.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """A tiny Qwen3 target and a second tiny model (other weights, same vocab) saved as a draft model dir."""
    from tests.conftest import tiny_model

    target = Target(tiny_model("qwen3", "eager", seed=0))
    draft_dir = _save_tiny(tmp_path_factory, tiny_model("qwen3", "eager", layers=2, seed=1), "draft")
    return target, draft_dir


def _specs(n_layers: int, draft_dir) -> list[str]:
    return [
        "early-exit:1",
        f"early-exit:{n_layers - 1}",
        "skip:1",
        f"skip:0,{n_layers - 1}",
        f"draft-model:{draft_dir}",
    ]


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("family", ["qwen3-eager", "llama-sdpa"])
def test_greedy_equals_ar_tiny(tiny_pair, tmp_path, shape, family):
    from tests.conftest import tiny_model

    name, attn = family.split("-")
    target = tiny_pair[0] if name == "qwen3" else Target(tiny_model(name, attn, seed=3, vocab=128))
    torch.manual_seed(5)
    for trial in range(2):
        prompt = torch.randint(3, 128, (4 + 3 * trial,))
        ref = generate(target, ARDrafter(), prompt, 40)
        for spec in _specs(target.num_layers, tiny_pair[1]):
            gen = generate(target, make_drafter(spec, target), prompt, 40, shape=SHAPES[shape])
            assert gen.tokens == ref.tokens, f"{spec} {shape}"
            assert gen.stats.new_tokens == 40


@pytest.mark.parametrize("shape", list(SHAPES))
def test_greedy_equals_ar_bundled(stories, shape):
    ids = encode_prompt(stories, "One day, a boy named Tim went to the park with his mom.")
    ref = generate(stories, ARDrafter(), ids, 60)
    for spec in [
        "early-exit:1",
        "early-exit:2",
        "early-exit:4",
        "skip:2",
        "skip:1,3",
        "draft-model:recipes/targets/stories260K",
    ]:
        gen = generate(stories, make_drafter(spec, stories), ids, 60, shape=SHAPES[shape])
        assert gen.tokens == ref.tokens, spec
    same = generate(
        stories, make_drafter("draft-model:recipes/targets/stories260K", stories), ids, 60, shape=Shape("chain", k=8)
    )
    assert same.stats.tau > 6  # a drafter identical to the target is always accepted


@pytest.mark.parametrize("shape", list(SHAPES))
def test_greedy_equals_ar_bundled_qwen3(stories_qwen3, shape):
    """The same on the bundled Qwen3 (QK-norm in every layer, untied head); its teacher stories260K, a Llama of
    another width, drafts for it as a separate draft model and is mostly accepted: the distillation took."""
    ids = encode_prompt(stories_qwen3, "One day, a boy named Tim went to the park with his mom.")
    ref = generate(stories_qwen3, ARDrafter(), ids, 60)
    for spec in ["early-exit:2", "early-exit:4", "skip:1,3", "draft-model:recipes/targets/stories260K"]:
        gen = generate(stories_qwen3, make_drafter(spec, stories_qwen3), ids, 60, shape=SHAPES[shape])
        assert gen.tokens == ref.tokens, spec
    teacher = generate(
        stories_qwen3,
        make_drafter("draft-model:recipes/targets/stories260K", stories_qwen3),
        ids,
        60,
        shape=Shape("chain", k=8),
    )
    assert teacher.stats.tau > TEACHER_TAU


def test_static_tree_file_and_dynamic_spec(tmp_path, stories):
    f = tmp_path / "tree.json"
    f.write_text(json.dumps([list(c) for c in STATIC]))
    assert parse_shape(f"static:{f}").choices == tuple(sorted(STATIC, key=lambda c: (len(c), c)))
    assert parse_shape("dynamic:topk=4,depth=3,nodes=9") == Shape("dynamic", topk=4, depth=3, nodes=9)
    with pytest.raises(ValueError, match="not one of"):
        parse_shape("dynamic:width=3")
    bad = tmp_path / "bad.json"
    bad.write_text("[[0, 1]]")
    with pytest.raises(ValueError, match="no parent path"):
        parse_shape(f"static:{bad}")


def test_early_exit_reuse_is_exact(stories):
    """Verification that reuses the drafter's layer-K states and KV equals a full recompute."""
    from decode.protocol import Budget, TargetStep, layer_reuse
    from drafters.sources.early_exit import early_exit

    ids = encode_prompt(stories, "Sam had a red ball that he loved very much.")
    outs, caches = [], []
    for reuse in (True, False):
        d = early_exit(stories, 3, reuse=reuse)
        cache = stories.new_cache()
        pre = stories.prefill(ids, cache)
        first = int(pre.logits[-1].argmax())
        d.begin(ids, TargetStep(torch.cat([ids[1:], torch.tensor([first])]), {}, [], ids.numel(), cache))
        tree = d.propose(Budget(Shape("chain", k=5)))
        r = layer_reuse(d)
        assert (r is not None) == reuse
        outs.append(forward_tree(stories, first, tree, cache, reuse=r).logits)
        caches.append(cache)
    assert outs[0].shape == (6, stories.vocab_size)
    torch.testing.assert_close(outs[0], outs[1], atol=2e-5, rtol=1e-5)
    assert caches[0].lens == caches[1].lens
    for i in range(stories.num_layers):
        n = caches[0].lens[i]
        torch.testing.assert_close(caches[0].keys[i][:, :, :n], caches[1].keys[i][:, :, :n], atol=2e-5, rtol=1e-5)


def test_sampling_run_is_seeded_and_stays_in_vocab(stories):
    ids = encode_prompt(stories, "Once upon a time")
    cfg = SamplingConfig(temperature=0.8, top_p=0.95)
    a = generate(stories, make_drafter("early-exit:3", stories), ids, 30, sampling=cfg, seed=7)
    b = generate(stories, make_drafter("early-exit:3", stories), ids, 30, sampling=cfg, seed=7)
    assert a.tokens == b.tokens and len(a.tokens) == 30


def test_eos_and_max_new_tokens_are_exact(tiny_pair):
    target = tiny_pair[0]
    prompt = torch.tensor([5, 6, 7, 8])
    ref = generate(target, ARDrafter(), prompt, 30)
    eos = ref.tokens[12]
    target.eos_ids = {eos}
    try:
        ar = generate(target, ARDrafter(), prompt, 30)
        sp = generate(
            target, make_drafter("draft-model:" + str(tiny_pair[1]), target), prompt, 30, shape=Shape("chain", k=8)
        )
        sp2 = generate(target, make_drafter("skip:1", target), prompt, 30, shape=Shape("chain", k=8))
    finally:
        target.eos_ids = set()
    stop = ref.tokens.index(eos) + 1
    assert ar.tokens == ref.tokens[:stop] == sp.tokens == sp2.tokens
    for n in (1, 2, 7, 9):
        assert len(generate(target, make_drafter("skip:1", target), prompt, n).tokens) == n


def test_too_long_prompt_is_refused(stories):
    with pytest.raises(ValueError, match="max positions"):
        generate(stories, ARDrafter(), torch.ones(500, dtype=torch.long), 20)


def test_lazy_lm_head_visits_only_the_accepted_path_and_agrees_with_full_logits(stories):
    """Verification through LazyRows gives the verdict of the full [1 + N, V] logits, computing ≤ depth + 1 rows."""
    from decode.sampling import TorchRng, probs_from_logits
    from decode.tree import DraftTree
    from decode.verify import LazyRows, child_rows, verify_greedy, verify_sampling

    ids = encode_prompt(stories, "Once upon a time, there was a little girl")
    cache = stories.new_cache()
    first = int(stories.prefill(ids, cache).logits[-1].argmax())
    # a tree whose first-level children hold the target's own next tokens (greedy AR), so paths get accepted
    ar = generate(stories, ARDrafter(), ids, 4).tokens
    tree = DraftTree(tokens=torch.tensor([ar[1], 7, ar[2], 9, ar[3], 11]), parents=torch.tensor([-1, -1, 0, 0, 2, 1]))
    full = forward_tree(stories, first, tree, cache)
    cache.crop(ids.numel())
    lean = forward_tree(stories, first, tree, cache, logits=False)
    assert lean.logits is None and torch.equal(lean.last, full.last)
    rows = LazyRows(lambda h: stories.head(h).argmax(-1), lean.last)
    want = verify_greedy(tree, full.logits.argmax(-1))
    assert verify_greedy(tree, rows) == want and want.path == [0, 2, 4]
    assert sorted(rows.memo) == [0, 1, 3, 5]  # the root, the three accepted nodes: never the rejected siblings
    calls = []
    grouped = LazyRows(lambda h: calls.append(h.shape[0]) or stories.head(h).argmax(-1), lean.last, child_rows(tree))
    assert verify_greedy(tree, grouped) == want
    # a miss computes the row with its children: two calls (root + its 2 children; row 3 + its child) instead of
    # four, and the subtrees the walk never entered (row 4's node, row 6 under a rejected sibling) stay unread
    assert calls == [3, 2] and sorted(grouped.memo) == [0, 1, 2, 3, 5]
    cfg = SamplingConfig(temperature=0.9)
    for seed in range(5):
        a = verify_sampling(tree, probs_from_logits(full.logits, cfg), TorchRng(seed))
        b = verify_sampling(
            tree, LazyRows(lambda h: probs_from_logits(stories.head(h), cfg), lean.last), TorchRng(seed)
        )
        c = verify_sampling(
            tree,
            LazyRows(lambda h: probs_from_logits(stories.head(h), cfg), lean.last, child_rows(tree)),
            TorchRng(seed),
        )
        assert a == b == c
