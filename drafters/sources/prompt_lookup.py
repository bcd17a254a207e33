"""`prompt-lookup[:ngram=3,min=1,k=10,branches=4]`: draft what followed earlier occurrences of the last n tokens.

Training-free and model-free (Saxena's prompt lookup decoding; HF's `prompt_lookup_num_tokens`):
text that is being repeated from the input (quotes, code edits, summaries, loops) is drafted by
copying. Matches are searched in the prompt *and* the generated text.

1. Index: every n-gram (n = min..ngram) of the context maps to the positions right after its
   occurrences; accepted tokens extend the index, so a round costs a few dict lookups.
2. Propose: for n from ngram down to min, the matches of the context's last n tokens, most recent
   first, each give a continuation of up to k tokens (capped by the round's depth). A continuation
   that runs into the end of the context keeps copying its own draft, so a repeating loop drafts
   whole periods. Distinct continuations are merged into a token trie until `branches` of them
   add nodes: branches=1 is a chain (HF's behaviour), more offer the other matches as a tree.
3. The draft is deterministic (q = None), verified as point masses: lossless for sampling too.
"""

from __future__ import annotations

from torch import Tensor

from decode.protocol import Budget, TargetStep
from decode.tree import DraftTree

MAX_SCAN = 64  # matches examined per n-gram length, so a common token in a long context stays cheap


class PromptLookupDrafter:
    hidden_ids: tuple[int, ...] = ()
    forward_passes = 0  # no model runs
    token_probs = False  # copies carry no probabilities: confidence-based length policies refuse

    def __init__(self, ngram: int = 3, min_ngram: int = 1, k: int = 10, branches: int = 4) -> None:
        if not 1 <= min_ngram <= ngram or k < 1 or branches < 1:
            raise ValueError(
                f"prompt-lookup: need 1 <= min <= ngram, k >= 1, branches >= 1 "
                f"(got ngram={ngram}, min={min_ngram}, k={k}, branches={branches})"
            )
        self.ngram, self.min_ngram, self.k, self.branches = ngram, min_ngram, k, branches
        self.name = f"prompt-lookup:ngram={ngram},min={min_ngram},k={k},branches={branches}"
        self.context: list[int] = []
        self.index: dict[tuple[int, ...], list[int]] = {}  # n-gram -> positions right after each occurrence

    def begin(self, prompt_ids: Tensor, step: TargetStep) -> None:
        self.context, self.index = [], {}
        self._extend(prompt_ids.tolist()[:1] + step.tokens.tolist())

    def accept(self, step: TargetStep) -> None:
        self._extend(step.tokens.tolist())

    def _extend(self, tokens: list[int]) -> None:
        for tok in tokens:
            self.context.append(tok)
            end = len(self.context)
            for n in range(self.min_ngram, min(self.ngram, end) + 1):
                self.index.setdefault(tuple(self.context[end - n : end]), []).append(end)

    def continuations(self, depth: int) -> list[list[int]]:
        """Up to `branches` continuations of the context's suffix that add distinct drafts, best first."""
        ctx, found, seen = self.context, [], set()
        for n in range(min(self.ngram, len(ctx)), self.min_ngram - 1, -1):
            ends = self.index.get(tuple(ctx[-n:]), [])
            for end in reversed(ends[-MAX_SCAN - 1 :]):  # most recent first
                if end == len(ctx):  # the suffix itself
                    continue
                cont: list[int] = []
                for i in range(depth):  # past the context's end, keep copying the draft itself
                    j = end + i
                    cont.append(ctx[j] if j < len(ctx) else cont[j - len(ctx)])
                if tuple(cont) in seen:  # every node it would add is already in the trie
                    continue
                seen.update(tuple(cont[:m]) for m in range(1, depth + 1))
                found.append(cont)
                if len(found) == self.branches:
                    return found
        return found

    def propose(self, budget: Budget) -> DraftTree:
        depth = min(self.k, budget.shape.max_depth)
        if depth <= 0:
            return DraftTree.empty()
        return trie(self.continuations(depth))


def trie(branches: list[list[int]]) -> DraftTree:
    """Token sequences merged into a tree (shared prefixes share nodes); parents precede children."""
    node: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    tokens, parents = [], []
    for seq in branches:
        parent = -1
        for tok in seq:
            if (parent, tok) not in node:
                node[(parent, tok)] = len(tokens)
                tokens.append(tok)
                parents.append(parent)
            parent = node[(parent, tok)]
    return DraftTree(tokens, parents) if tokens else DraftTree.empty()
