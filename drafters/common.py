"""Shared machinery for drafters that run a token-level LM with a KV cache (composition, not a base class).

`Scratch` tracks the draft-tree nodes a drafter has run past its committed prefix (their cache
slots, positions and ancestor sets, for the tree attention mask). `CachedLM` drives a run
function over a context + scratch: catching up on committed tokens, then growing a draft tree.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from decode.kvcache import KVCache
from decode.masks import causal_mask
from decode.passes import LayerReuse
from decode.protocol import Budget, TargetStep
from decode.sampling import probs_from_logits
from decode.tree import DraftTree, SampleFn, grow

# run(ids [T], positions [T], mask [1, 1, T, S] or None, cache) -> (logits [T, V], state [T, D])
RunFn = Callable[[Tensor, Tensor, Tensor | None, KVCache], tuple[Tensor, Tensor]]


class Scratch:
    """Tree nodes run past a prefix of `prefix` cached tokens: node id -> slot, depths, ancestor rows."""

    def __init__(self, prefix: int, dtype: torch.dtype, device: torch.device) -> None:
        self.prefix, self.dtype, self.device = prefix, dtype, device
        self.slot: dict[int, int] = {}  # tree node id (root = -1) -> slot
        self.depth: list[int] = []  # position offset of each slot (root = 0)
        self.anc = torch.zeros(0, 0, dtype=torch.bool)  # [slots, slots] ancestor-or-self

    def add(self, ids: list[int], parents: list[int]) -> tuple[Tensor, Tensor | None]:
        """Register new nodes; returns their positions [n] and additive mask [1, 1, n, prefix + slots]."""
        n0, n = len(self.depth), len(ids)
        anc = torch.zeros(n0 + n, n0 + n, dtype=torch.bool)
        anc[:n0, :n0] = self.anc
        for j, (i, p) in enumerate(zip(ids, parents)):
            s = n0 + j
            self.slot[i] = s
            if p == -2:  # the root: a child of the prefix
                self.depth.append(0)
            else:
                ps = self.slot[p]
                anc[s] = anc[ps]
                self.depth.append(self.depth[ps] + 1)
            anc[s, s] = True
        self.anc = anc
        positions = torch.tensor(self.depth[n0:], device=self.device) + self.prefix
        if n0 == 0 and n == 1:
            return positions, None  # the root alone sees everything cached
        mask = torch.zeros(n, self.prefix + n0 + n, dtype=self.dtype)
        mask[:, self.prefix :].masked_fill_(~anc[n0:], torch.finfo(self.dtype).min)
        return positions, mask.to(self.device).view(1, 1, n, -1)


def sampler(budget: Budget, vocab: Tensor | None = None, size: int = 0) -> SampleFn:
    """How a chain draws its next column from the drafter's log-probs: argmax when greedy, else from q.

    With `vocab` the log-probs cover only those target tokens (decode.tree.grow's columns); the q a
    sampled draft is verified against is then spread over the target's `size` tokens (zero elsewhere):
    the same distribution as softmax over the whole vocabulary with -inf outside it.
    """

    def sample(logprobs: Tensor) -> tuple[int, Tensor | None]:
        if budget.sampling.greedy or budget.rng is None:
            return int(logprobs.argmax()), None
        q = probs_from_logits(logprobs, budget.sampling)
        col = budget.rng.categorical(q)
        if vocab is not None:
            q = q.new_zeros(size).index_copy_(0, vocab.to(q.device), q)
        return col, q

    return sample


class CachedLM:
    """Drive `run` over a growing context with a KV cache: catch up, then grow a draft tree in scratch.

    The cache holds context[:cached] (committed tokens); a round runs context[cached:] as its root
    step (ending with the pending token), then the tree nodes in scratch slots after it.
    With `shared=True` the cache is the target's (early exit, layer skipping): committed tokens are
    already there, computed by the target itself.
    """

    def __init__(self, run: RunFn, dtype: torch.dtype, device: torch.device, num_layers: int) -> None:
        self.run, self.dtype, self.device, self.num_layers = run, dtype, device, num_layers
        self.cache: KVCache | None = None
        self.shared = False
        self.context: list[int] = []
        self.cached = 0
        self.passes = 0
        self.scratch: Scratch | None = None
        self.states: list[Tensor] = []  # run's state output per scratch slot group, for reuse

    def begin(self, prompt_ids: Tensor, step: TargetStep, shared: bool) -> None:
        self.shared = shared
        self.context = prompt_ids.tolist()[:1] + step.tokens.tolist()
        if shared:
            self.cache, self.cached = step.cache, step.committed
        else:
            self.cache, self.cached = KVCache(self.num_layers), 0

    def accept(self, step: TargetStep) -> None:
        self.context.extend(step.tokens.tolist())
        if self.shared:
            self.cached = step.committed  # the target compacted its cache (and our reused scratch)

    def propose(self, budget: Budget) -> DraftTree:
        new_context = self.context[self.cached :]  # committed tokens not yet cached, then the pending one
        self.scratch = Scratch(self.cached + len(new_context) - 1, self.dtype, self.device)
        self.states = []

        def step(ids: list[int], tokens: list[int], parents: list[int]) -> Tensor:
            if parents == [-2]:  # root step: catch up on the context, its last row is the root
                self.scratch.add([-1], [-2])
                ctx = torch.tensor(new_context, device=self.device)
                start = self.cached
                positions = torch.arange(start, start + ctx.numel(), device=self.device)
                mask = None if ctx.numel() == 1 else causal_mask(start, ctx.numel(), self.dtype, self.device)
                logits, state = self.run(ctx, positions, mask, self.cache)
                logits, state = logits[-1:], state[-1:]
            else:
                positions, mask = self.scratch.add(ids, parents)
                logits, state = self.run(torch.tensor(tokens, device=self.device), positions, mask, self.cache)
            self.passes += 1
            self.states.append(state)
            return torch.log_softmax(logits, dim=-1, dtype=torch.float32)  # fp32 result, no fp32 copy of bf16 logits

        tree = grow(step, self.context[-1], budget.shape, sampler(budget))
        # Everything before the pending token is committed now; the root's own row stays cached
        # in scratch slot 0 only until the target verifies it, so the cached count excludes it.
        self.cached = self.scratch.prefix
        return tree

    def drop_scratch(self) -> None:
        """Forget scratch entries (the root and tree nodes) in the layers this drafter ran."""
        if self.cache is not None:
            layers = range(self.num_layers)
            self.cache.crop(self.cached, layers)

    def scratch_states(self) -> Tensor:
        return torch.cat(self.states, dim=0) if self.states else torch.zeros(0)


class LMDrafter:
    """The drafter protocol around a CachedLM: all a token-level LM drafter needs besides its `run`.

    Early exit, layer skipping, a separate draft model and LayerSkip-LoRA differ only in `run`,
    in whether they draft on the target's own KV cache (`shared`), and in whether a chain's
    verification may reuse their first `reuse_layers` layers (early exit: the scratch KV and the
    layer-K states are exactly what the target would compute). Everything else is this class.
    """

    hidden_ids: tuple[int, ...] = ()

    def __init__(
        self,
        name: str,
        run: RunFn,
        dtype: torch.dtype,
        device: torch.device,
        num_layers: int,
        shared: bool,
        reuse_layers: int = 0,
    ) -> None:
        self.name, self.shared, self.reuse_layers = name, shared, reuse_layers
        self.lm = CachedLM(run, dtype, device, num_layers)
        self._reuse: LayerReuse | None = None

    @property
    def forward_passes(self) -> int:
        return self.lm.passes

    def begin(self, prompt_ids: Tensor, step: TargetStep) -> None:
        self.lm.begin(prompt_ids, step, shared=self.shared)

    def propose(self, budget: Budget) -> DraftTree:
        tree = self.lm.propose(budget)
        self._reuse = None
        if self.reuse_layers and budget.shape.kind == "chain" and tree.size:
            # chain: scratch slots (root, d1..d_{k-1}) are verification rows 0..k-1, in order
            self._reuse = LayerReuse(self.reuse_layers, self.lm.scratch_states())
        else:
            self.lm.drop_scratch()  # trees are grown in another order than their verification rows
        return tree

    def reuse(self) -> LayerReuse | None:
        return self._reuse

    def accept(self, step: TargetStep) -> None:
        self.lm.accept(step)
