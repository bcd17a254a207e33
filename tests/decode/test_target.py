"""Target runtime: tree forward, compaction, layer ranges and hidden ids against the HF forward."""

from __future__ import annotations

import pytest
import torch

from decode.loading import LayoutError, load_model
from decode.passes import forward_tree
from decode.target import Target
from decode.tree import DraftTree, path_to

PARENTS = [-1, -1, 0, 0, 1, 2, 4]  # a small branching tree


def test_prefill_matches_hf_logits_and_hidden(tiny):
    ids = torch.randint(3, 128, (9,))
    ref = tiny.model(ids[None], output_hidden_states=True)
    ids_all = tuple(range(tiny.num_layers + 1))
    out = tiny.prefill(ids, tiny.new_cache(), hidden_ids=ids_all)
    torch.testing.assert_close(out.logits, ref.logits[0], atol=1e-5, rtol=1e-5)
    for i in ids_all:
        torch.testing.assert_close(out.hidden[i], ref.hidden_states[i][0], atol=1e-5, rtol=1e-5)


def test_tree_forward_equals_per_path_recompute(tiny):
    prompt = torch.randint(3, 128, (6,))
    root = 7
    tree = DraftTree(torch.randint(3, 128, (len(PARENTS),)), torch.tensor(PARENTS))
    cache = tiny.new_cache()
    tiny.prefill(prompt, cache)
    out = forward_tree(tiny, root, tree, cache, hidden_ids=(1, tiny.num_layers))
    for node in range(-1, tree.size):
        path = [root] + tree.tokens[path_to(tree.parents, node)].tolist()
        ref = tiny.model(torch.cat([prompt, torch.tensor(path)])[None], output_hidden_states=True)
        torch.testing.assert_close(out.logits[node + 1], ref.logits[0, -1], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(out.hidden[1][node + 1], ref.hidden_states[1][0, -1], atol=1e-5, rtol=1e-4)


def test_decode_after_compaction_equals_full_recompute(tiny):
    prompt = torch.randint(3, 128, (5,))
    tree = DraftTree(torch.randint(3, 128, (len(PARENTS),)), torch.tensor(PARENTS))
    cache = tiny.new_cache()
    tiny.prefill(prompt, cache)
    forward_tree(tiny, 9, tree, cache)
    path = path_to(tree.parents, 6)  # nodes 1 -> 4 -> 6
    cache.compact(prompt.numel(), torch.tensor([0] + [i + 1 for i in path]))
    assert cache.lens == [prompt.numel() + 1 + len(path)] * tiny.num_layers
    nxt = torch.tensor([11, 12, 13])
    out = tiny.forward(nxt, cache)
    seq = torch.cat([prompt, torch.tensor([9]), tree.tokens[path], nxt])
    ref = tiny.model(seq[None]).logits[0, -3:]
    torch.testing.assert_close(out.logits, ref, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_first_k_layers_norm_head_equal_hf_path(tiny, k):
    ids = torch.randint(3, 128, (8,))
    ref = tiny.model(ids[None], output_hidden_states=True)
    h, cap = tiny.run_layers(
        tiny.embed(ids), 0, k, tiny.new_cache(), torch.arange(8), mask=_causal(tiny, 8), capture=(k,)
    )
    torch.testing.assert_close(cap[k], ref.hidden_states[k][0], atol=1e-5, rtol=1e-5)
    expect = tiny.model.lm_head(tiny.model.model.norm(ref.hidden_states[k]))[0]
    torch.testing.assert_close(tiny.head(h)[0], expect, atol=1e-5, rtol=1e-5)


def test_layer_range_with_own_cache_decodes_like_full_prefix(tiny):
    """Running [0, k) token by token on its own cache equals running it over the whole prefix."""
    ids = torch.randint(3, 128, (6,))
    cache = tiny.new_cache()
    outs = [tiny.run_layers(tiny.embed(ids[i : i + 1]), 0, 2, cache, torch.tensor([i]))[0] for i in range(6)]
    full, _ = tiny.run_layers(tiny.embed(ids), 0, 2, None, torch.arange(6), _causal(tiny, 6))
    torch.testing.assert_close(torch.cat(outs, dim=1), full, atol=1e-5, rtol=1e-5)
    assert cache.lens[:2] == [6, 6] and cache.lens[2:] == [0] * (tiny.num_layers - 2)


def test_cache_crop_and_growth(tiny):
    cache = tiny.new_cache()
    tiny.prefill(torch.randint(3, 128, (100,)), cache)  # past the initial 64-slot buffer
    cache.crop(40)
    out = tiny.forward(torch.tensor([5]), cache)
    assert cache.lens[0] == 41 and out.logits.shape == (1, tiny.vocab_size)


def test_bundled_target_greedy_story(stories):
    from decode.generate import encode_prompt, generate
    from drafters.sources.ar import ARDrafter

    story = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park."
    ids = encode_prompt(stories, "Once upon a time")
    expect = encode_prompt(stories, story).tolist()[ids.numel() :]
    gen = generate(stories, ARDrafter(), ids, len(expect))
    assert gen.tokens == expect  # token for token
    assert stories.tokenizer.decode(ids.tolist() + gen.tokens, skip_special_tokens=True) == story
    assert gen.stats.tau == 1.0 and gen.stats.target_passes == len(expect)


def test_nonstandard_layout_is_refused():
    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = None

    with pytest.raises(LayoutError, match="Odd"):
        Target(Odd())


def test_missing_model_dir_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="no_such_model"):
        load_model(tmp_path / "no_such_model")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)


def _causal(t: Target, n: int) -> torch.Tensor:
    from decode.masks import causal_mask

    return causal_mask(0, n, t.dtype, t.device)
