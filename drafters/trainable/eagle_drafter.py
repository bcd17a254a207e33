"""Decoding with an EAGLE module (EAGLE-1 or EAGLE-3): the drafter protocol over its own one-layer KV cache.

The drafter's cache holds one row per committed position p: (the target's feature at p, token x_{p+1}).
Rows arrive with each TargetStep (the target's states at the accepted positions and the tokens they
produced); the last one pairs the newest feature with the pending token and is the draft root.
A round:
  1. root step: run the rows not yet cached (causally); the last row's logits give depth 1;
  2. grow the draft (chain / static / dynamic tree via decode.tree.grow): a node's row reads its
     parent's output state and its own token at position parent + 1, seeing the committed rows and
     its ancestors (the Scratch mask);
  3. drop the tree rows from the cache: only rows built from the target's own features stay.
"""

from __future__ import annotations

import torch
from torch import Tensor

from decode.kvcache import KVCache
from decode.masks import causal_mask
from decode.protocol import Budget, TargetStep
from decode.runtime import packed_copy
from decode.tree import DraftTree, grow
from drafters.common import Scratch, sampler
from drafters.trainable.draft_layer import CacheContext


class EagleDrafter:
    """Drafter protocol for the EAGLE-1/3 modules (drafters/trainable/eagle.py, eagle3.py). Chains sample from q when sampling; trees are top-k."""

    def __init__(self, module, name: str) -> None:
        self.m, self.name = packed_copy(module), name  # its linears packed for few-row products; module untouched
        self.hidden_ids: tuple[int, ...] = tuple(module.decode_hidden_ids)
        self.forward_passes = 0
        self.cache = KVCache(1)
        self.cached = 0  # rows in the cache (= positions 0..cached-1)
        self.rows_x: list[Tensor] = []  # pending rows' features [n, H], not yet cached
        self.rows_tok: list[Tensor] = []  # and their tokens [n]
        self.vocab = module.step_vocab()  # target id of each logit column [N] (None: the whole vocabulary)
        self.vocab_size = module.target.vocab_size
        self.head = module.decode_head()  # module.head, with its LM head packed for one-row products

    def begin(self, prompt_ids: Tensor, step: TargetStep) -> None:
        self.cache, self.cached = KVCache(1), 0
        self.rows_x, self.rows_tok = [], []
        self.accept(step)

    def accept(self, step: TargetStep) -> None:
        # hidden[i][j] is the target's state at the position that produced tokens[j]: one row each.
        with torch.no_grad():
            self.rows_x.append(self.m.project({i: step.hidden[i] for i in self.hidden_ids}))
        self.rows_tok.append(step.tokens.to(self.m.target.device))

    def _run(
        self, x: Tensor, tokens: Tensor, positions: Tensor, mask: Tensor | None, last_only: bool = False
    ) -> tuple[Tensor, Tensor]:
        """Rows x [n, H] + tokens [n] at positions [n] -> log-probs over the logit columns [n, N] (the draft
        vocabulary: decode.tree.grow maps columns to target ids through self.vocab), states [n, H].
        last_only: log-probs of the last row only [1, N] (the root step: the head over a whole prompt is waste)."""
        emb = self.m.embed(tokens.view(1, -1))
        out = self.m.advance(x.unsqueeze(0), emb, positions.view(1, -1), CacheContext(self.cache, mask))[0]
        logits = self.head(out[-1:] if last_only else out)
        self.forward_passes += 1
        return torch.log_softmax(logits, dim=-1, dtype=torch.float32), out

    @torch.no_grad()
    def propose(self, budget: Budget) -> DraftTree:
        x, tok = torch.cat(self.rows_x), torch.cat(self.rows_tok)
        n, dev, dtype = tok.numel(), tok.device, self.m.dtype
        scratch = Scratch(self.cached + n - 1, dtype, dev)  # the root row sits at position cached + n - 1
        states: dict[int, Tensor] = {}  # tree node id (root = -1) -> its output state [H]

        def step(ids: list[int], tokens: list[int], parents: list[int]) -> Tensor:
            if parents == [-2]:  # 1. root step: the pending rows, causally after the cached ones
                scratch.add([-1], [-2])
                positions = torch.arange(self.cached, self.cached + n, device=dev)
                mask = causal_mask(self.cached, n, dtype, dev) if n > 1 else None
                logp, out = self._run(x, tok, positions, mask, last_only=True)
                states[-1] = out[-1]
                return logp
            # 2. tree rows: the parent's state, the node's token, the Scratch mask
            positions, mask = scratch.add(ids, parents)
            feats = torch.stack([states[p] for p in parents])
            logp, out = self._run(feats, torch.tensor(tokens, device=dev), positions, mask)
            states.update(zip(ids, out))
            return logp

        tree = grow(step, int(tok[-1]), budget.shape, sampler(budget, self.vocab, self.vocab_size), self.vocab)
        if -1 in states:  # the pending rows are cached now (a zero-length draft runs nothing)
            self.cached += n
            self.rows_x, self.rows_tok = [], []
        self.cache.crop(self.cached)  # 3. drop the tree rows
        return tree
