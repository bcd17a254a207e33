"""decode.passes.forward_batch (padded / packed batches) against HF's own output_hidden_states."""

from __future__ import annotations

import pytest
import torch

from decode.passes import forward_batch
from train.dataset import collate


def hf_hidden(target, ids: torch.Tensor) -> tuple:
    """HF's hidden states for one unpadded sequence: a tuple of [T, D]."""
    out = target.model(ids[None], output_hidden_states=True)
    return tuple(h[0] for h in out.hidden_states)


@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_batch_matches_output_hidden_states(tiny, side):
    torch.manual_seed(0)
    lens = [7, 3, 5]
    seqs = [torch.randint(3, 120, (n,)) for n in lens]
    t = max(lens)
    ids = torch.zeros(len(seqs), t, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, s in enumerate(seqs):
        sl = slice(0, len(s)) if side == "right" else slice(t - len(s), t)
        ids[b, sl], mask[b, sl] = s, 1
    all_ids = tuple(range(tiny.num_layers + 1))
    last, hidden = forward_batch(tiny, ids, mask, all_ids)
    for b, s in enumerate(seqs):
        sl = slice(0, len(s)) if side == "right" else slice(t - len(s), t)
        ref = hf_hidden(tiny, s)
        for i in all_ids:
            torch.testing.assert_close(hidden[i][b, sl], ref[i], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(tiny.head(last[b, sl]), tiny.model(s[None]).logits[0], atol=1e-5, rtol=1e-5)


def test_packed_rows_attend_within_their_own_sequence(stories):
    torch.manual_seed(1)
    seqs = [torch.randint(3, 500, (n,)) for n in (6, 4, 9)]
    row = {
        "input_ids": torch.cat(seqs[:2]),
        "loss_mask": torch.ones(10, dtype=torch.bool),
        "segments": torch.tensor([1] * 6 + [2] * 4),
    }
    single = {"input_ids": seqs[2], "loss_mask": torch.ones(9, dtype=torch.bool)}
    batch = collate([row, single])
    assert batch["position_ids"][0].tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3]
    assert batch["attention_mask"][1].tolist() == [1] * 9 + [0]
    _, hidden = forward_batch(stories, batch["input_ids"], batch["attention_mask"], (2, 5), batch["position_ids"])
    for (b, a, n), s in zip([(0, 0, 6), (0, 6, 4), (1, 0, 9)], seqs):
        ref = hf_hidden(stories, s)
        for i in (2, 5):
            torch.testing.assert_close(hidden[i][b, a : a + n], ref[i], atol=1e-5, rtol=1e-5)


def test_hidden_id_out_of_range(tiny):
    with pytest.raises(ValueError, match=r"out of range 0\.\.4"):
        forward_batch(tiny, torch.ones(1, 3, dtype=torch.long), torch.ones(1, 3, dtype=torch.long), (5,))
