"""Decoding with a block drafter (DFlash, DSpark): the whole draft from one drafter pass per round.

The drafter keeps, per draft layer, the keys/values of the fused target context at every verified position
(`ContextKV`). Each TargetStep brings the target's states at the positions it just verified — only verified
positions, so nothing in this cache is ever rejected: the block's own keys are recomputed every round and never
stored, which is what a crop on rejection would otherwise undo. A round:
  1. project the new context rows through each layer's k/v (once per position, never again);
  2. run the block [anchor, MASK x (K-1)] at positions p..p+K-1 over the cached context: states [K-1, D];
  3. grow the draft from those states: a chain takes position d's argmax (or draws from its distribution when
     sampling: q recorded per node, so verification stays exact), a static or dynamic tree ranks each
     position's top-k (Medusa-style, decode.tree.grow); DSpark's rows condition on the branch's previous token
     (its Markov head), and its chain's DraftTree.conf is the confidence head's P(accepted).
The shape is capped at K-1 positions (a chain of at most K-1 tokens, trees at most K-1 deep).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from decode.protocol import Budget, TargetStep
from decode.runtime import packed_copy
from decode.tree import DraftTree, SampleFn, StepFn, StopRule, grow
from drafters.common import sampler
from drafters.trainable.block_ops import KVPair
from drafters.trainable.medusa import capped_shape

# block positions (0 = the anchor's first masked position) + the token before each -> (log-probs [n, V], P(accepted) [n] or None)
RowsFn = Callable[[list[int], list[int]], tuple[Tensor, Tensor | None]]


class ContextKV:
    """Per draft layer, keys/values [1, kv, S, d] of the S context positions, grown in place (capacity doubles)."""

    def __init__(self) -> None:
        self.kv: list[KVPair] = []
        self.n = 0  # context positions held (= the next anchor's position)

    def append(self, new: list[KVPair]) -> None:
        """Add rows [1, kv, s, d] per layer after the ones held."""
        s = new[0][0].shape[2]
        if not self.kv or self.n + s > self.kv[0][0].shape[2]:
            cap = max(2 * (self.n + s), 64)
            grown = []
            for k, v in new if not self.kv else self.kv:
                shape = (*k.shape[:2], cap, k.shape[-1])
                grown.append((k.new_empty(shape), v.new_empty(shape)))
            for (gk, gv), (k, v) in zip(grown, self.kv):
                gk[:, :, : self.n], gv[:, :, : self.n] = k[:, :, : self.n], v[:, :, : self.n]
            self.kv = grown
        for (k, v), (nk, nv) in zip(self.kv, new):
            k[:, :, self.n : self.n + s], v[:, :, self.n : self.n + s] = nk, nv
        self.n += s

    def views(self) -> list[KVPair]:
        return [(k[:, :, : self.n], v[:, :, : self.n]) for k, v in self.kv]


def block_rows_fn(
    module: nn.Module, h: Tensor, table: Tensor | None = None, head: Callable[[Tensor], Tensor] | None = None
) -> RowsFn:
    """Log-probs (fp32) and confidences of block states h [K-1, D] given each row's previous token. All K-1 rows
    go through the LM head at once, one batched read of the head. DSpark's Markov term is added in logit space:
    the head is linear, so head(norm(h) + P E[x]) = head(norm(h)) + E[x] (W P)^T, where table = (W P)^T [r, V]
    (DSpark.markov_logit_table, built once per drafter): a step then costs an [n, r] x [r, V] product, not a
    second read of the [V, D] head per drafted position. head: module.decode_head() (default module.logits); with
    a draft vocabulary the rows are over its N columns (the protocol's `vocab` maps them to target ids)."""
    head = module.logits if head is None else head
    z = module.norm(h)  # [K-1, D]: the head states before any Markov term
    if not module.conditions_on_prev:  # DFlash: the rows ignore the previous token
        lp, conf = torch.log_softmax(head(z), -1, dtype=torch.float32), module.confidence(z)
        return lambda depths, prevs: (lp[depths], None if conf is None else conf[depths])
    base = head(z).float()  # [K-1, V or N]
    table = module.markov_logit_table() if table is None else table

    def rows(depths: list[int], prevs: list[int]) -> tuple[Tensor, Tensor | None]:
        logit_bias, state_bias = module.markov_terms(torch.tensor(prevs), table)  # [n, V], [n, D]
        return torch.log_softmax(base[depths] + logit_bias, -1), module.confidence(z[depths] + state_bias.to(z.dtype))

    return rows


def draft_chain(
    rows: RowsFn, anchor: int, k: int, sample: SampleFn, stop: StopRule | None = None, vocab: Tensor | None = None
) -> DraftTree:
    """Up to k tokens, position d drawn by `sample` from its row given the token before it; `stop(confidences
    so far)` may end the chain early. conf = the confidence head's P(accepted), else the drafted token's prob.
    vocab [N]: the target id of each row column (a draft vocabulary; None: the columns are the ids)."""
    tokens, qs, conf = [], [], []
    prev = anchor
    for d in range(k):
        lp, c = rows([d], [prev])
        col, q = sample(lp[0])
        prev = col if vocab is None else int(vocab[col])
        tokens.append(prev)
        qs.append(q)
        conf.append(float(c[0]) if c is not None else float(lp[0, col].exp()))
        if stop is not None and stop(conf):
            break
    q = torch.stack(qs) if qs[0] is not None else None
    return DraftTree.chain(tokens, q, torch.tensor(conf))


def tree_step(rows: RowsFn) -> StepFn:
    """decode.tree.grow's step: a node's children come from the block position one deeper, given its token."""
    depth: dict[int, int] = {}  # tree node id (root = -1) -> its block position (root: 0)

    def step(ids: list[int], tokens: list[int], parents: list[int]) -> Tensor:
        for i, p in zip(ids, parents):
            depth[i] = 0 if p == -2 else depth[p] + 1
        return rows([depth[i] for i in ids], tokens)[0]

    return step


class BlockDrafter:
    """Drafter protocol for a DFlash / DSpark module: one block pass per round over the cached context."""

    def __init__(self, module: nn.Module, name: str) -> None:  # a DFlash / DSpark (drafters/trainable/dflash.py)
        self.m, self.name = packed_copy(module), name  # its linears packed for few-row products; module untouched
        self.hidden_ids: tuple[int, ...] = tuple(module.decode_hidden_ids)
        self.forward_passes = 0
        self.ctx = ContextKV()
        self.pending: list[Tensor] = []  # fused context rows [n, D] not yet projected
        self.anchor = 0  # the pending token: verified, not yet seen by the target
        self.table = module.markov_logit_table() if module.conditions_on_prev else None  # DSpark: [r, V], once
        self.head = module.decode_head()  # the target's packed head, or the draft vocabulary's rows packed once
        self.vocab = module.draft_ids  # target id of each logit column [N] (None: the whole vocabulary)
        self.vocab_size = module.target.vocab_size

    def begin(self, prompt_ids: Tensor, step: TargetStep) -> None:
        self.ctx, self.pending = ContextKV(), []
        self.accept(step)

    def accept(self, step: TargetStep) -> None:
        # hidden[i][j] is the target's state at the position that produced tokens[j]: one context row each
        with torch.no_grad():
            self.pending.append(self.m.fuse({i: step.hidden[i] for i in self.hidden_ids}))
        self.anchor = int(step.tokens[-1])

    @torch.no_grad()
    def states(self) -> Tensor:
        """1.-2. of a round: the block's pre-norm states at positions 1..K-1. -> [K-1, D]"""
        if self.pending:
            x = torch.cat(self.pending)[None]  # [1, n, D]
            pos = torch.arange(self.ctx.n, self.ctx.n + x.shape[1], device=x.device)[None]
            self.ctx.append(self.m.context_kvs(x, pos))
            self.pending = []
        k, dev = self.m.block_size, self.m.fc.weight.device
        x = self.m.block_inputs(torch.tensor([[self.anchor]], device=dev)).flatten(1, 2)  # [1, K, D]
        pos = torch.arange(self.ctx.n, self.ctx.n + k, device=dev)[None]
        self.forward_passes += 1
        return self.m.run_block(x, pos, self.ctx.views(), None)[0, 1:]

    @torch.no_grad()
    def propose(self, budget: Budget) -> DraftTree:
        shape = capped_shape(budget.shape, self.m.block_size - 1)
        if shape.max_depth == 0:
            return DraftTree.empty()
        rows = block_rows_fn(self.m, self.states(), self.table, self.head)
        sample = sampler(budget, self.vocab, self.vocab_size)
        if shape.kind == "chain":
            return draft_chain(rows, self.anchor, shape.k, sample, shape.stop, self.vocab)
        return grow(tree_step(rows), self.anchor, shape, sample, self.vocab)
