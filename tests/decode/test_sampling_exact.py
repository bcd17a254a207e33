"""Sampling verification is lossless: exact enumeration of one round's output distribution.

A toy target and drafter over a 5-token vocabulary give distributions as functions of the
context. One speculative round (draft drawn from q, then `verify_sampling`) is enumerated over
every random decision it makes, with the decisions' exact probabilities. Completing the emitted
tokens with the target's own AR distribution must give exactly the target's distribution over
the first j tokens (j = 1..3), to 1e-6.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from decode.sampling import SamplingConfig, draw_without_replacement, probs_from_logits
from decode.tree import DraftTree, path_to
from decode.verify import verify_sampling

V = 5


def dist(ctx: tuple[int, ...], salt: int, cfg: SamplingConfig) -> torch.Tensor:
    """A fixed pseudo-random distribution over V tokens for each context."""
    g = torch.Generator().manual_seed(hash((ctx, salt)) % (2**31))
    return probs_from_logits(torch.randn(V, generator=g, dtype=torch.float64) * 1.5, cfg)


class Branch(Exception):
    def __init__(self, options):
        self.options = options  # [(choice, probability)]


class ScriptRng:
    """Replays scripted decisions; at the first unscripted decision raises Branch with its options."""

    def __init__(self, script):
        self.script, self.i = script, 0

    def _next(self, options):
        if self.i < len(self.script):
            self.i += 1
            return self.script[self.i - 1]
        raise Branch([(c, p) for c, p in options if p > 0])

    def accept(self, prob: float) -> bool:
        prob = min(max(prob, 0.0), 1.0)
        return self._next([(True, prob), (False, 1.0 - prob)])

    def categorical(self, probs: torch.Tensor) -> int:
        return self._next([(t, float(p)) for t, p in enumerate(probs)])


def enumerate_outcomes(run) -> dict[tuple[int, ...], float]:
    """Exact distribution of run(rng)'s result over all decision paths."""
    out: dict[tuple[int, ...], float] = {}
    stack = [((), 1.0)]
    while stack:
        script, w = stack.pop()
        try:
            res = run(ScriptRng(list(script)))
        except Branch as b:
            stack.extend((script + (c,), w * p) for c, p in b.options)
            continue
        out[res] = out.get(res, 0.0) + w
    return out


def one_round(rng, shape: str, stochastic: bool, iid: bool, p_cfg, q_cfg) -> tuple[int, ...]:
    """Draft a tree from the toy drafter, verify it against the toy target; return emitted tokens."""
    ctx = (0,)
    q = lambda c: dist(c, 1, q_cfg)  # noqa: E731 - drafter
    tokens, parents, qs = [], [], []
    if shape == "chain2":  # two tokens, each drawn from q (or argmax of q)
        c = ctx
        for i in range(2):
            qd = q(c)
            tok = rng.categorical(qd) if stochastic else int(qd.argmax())
            tokens.append(tok), parents.append(i - 1), qs.append(qd)
            c = c + (tok,)
    else:  # width 2 at the root, each child with one child of its own
        qd = q(ctx)
        if stochastic and iid:
            kids = [rng.categorical(qd), rng.categorical(qd)]
        elif stochastic:
            kids = draw_without_replacement(qd, 2, rng)
        else:
            kids = torch.topk(qd, 2).indices.tolist()
        for k in kids:
            tokens.append(k), parents.append(-1), qs.append(qd)
        for j, k in enumerate(kids):
            qk = q(ctx + (k,))
            tok = rng.categorical(qk) if stochastic else int(qk.argmax())
            tokens.append(tok), parents.append(j), qs.append(qk)
    tree = DraftTree(tokens, parents, torch.stack(qs) if stochastic else None, iid=iid)
    rows = [ctx] + [ctx + tuple(tree.tokens[path_to(tree.parents, n)].tolist()) for n in range(tree.size)]
    p = torch.stack([dist(c, 0, p_cfg) for c in rows])
    v = verify_sampling(tree, p, rng)
    return tuple(tree.tokens[v.path].tolist()) + (v.bonus,)


def ar_prob(seq: tuple[int, ...], cfg) -> float:
    ctx, prob = (0,), 1.0
    for t in seq:
        prob *= float(dist(ctx, 0, cfg)[t])
        ctx = ctx + (t,)
    return prob


CFGS = {
    "t1": SamplingConfig(temperature=1.0),
    "t0.7-topk3": SamplingConfig(temperature=0.7, top_k=3),
    "topp0.8": SamplingConfig(temperature=1.0, top_p=0.8),
}


@pytest.mark.parametrize("cfg", list(CFGS))
@pytest.mark.parametrize(
    "shape,stochastic,iid",
    [
        ("chain2", True, False),
        ("chain2", False, False),
        ("width2", True, False),
        ("width2", True, True),
        ("width2", False, False),
    ],
)
def test_one_round_distribution_is_exact(shape, stochastic, iid, cfg):
    p_cfg = CFGS[cfg]
    q_cfg = SamplingConfig(temperature=1.3)  # the drafter's own (different) distribution
    outcomes = enumerate_outcomes(lambda rng: one_round(rng, shape, stochastic, iid, p_cfg, q_cfg))
    assert abs(sum(outcomes.values()) - 1.0) < 1e-9
    assert max(len(s) for s in outcomes) > 1  # some drafts do get accepted
    for j in (1, 2, 3):
        got: dict[tuple[int, ...], float] = {}
        for seq, w in outcomes.items():
            if len(seq) >= j:
                got[seq[:j]] = got.get(seq[:j], 0.0) + w
            else:  # complete the emitted prefix with the target's AR distribution
                for tail in itertools.product(range(V), repeat=j - len(seq)):
                    pr = w * ar_prob(seq + tail, p_cfg) / ar_prob(seq, p_cfg)
                    got[seq + tail] = got.get(seq + tail, 0.0) + pr
        for seq in itertools.product(range(V), repeat=j):
            assert abs(got.get(seq, 0.0) - ar_prob(seq, p_cfg)) < 1e-6, (j, seq)


def test_a_wrong_verifier_would_be_caught():
    """The enumeration is sensitive: accepting every draft (no rejection) breaks the distribution."""
    p_cfg, q_cfg = CFGS["t1"], SamplingConfig(temperature=1.3)

    def greedy_accept(rng):
        qd = dist((0,), 1, q_cfg)
        tok = rng.categorical(qd)
        bonus = rng.categorical(dist((0, tok), 0, p_cfg))
        return (tok, bonus)

    outcomes = enumerate_outcomes(greedy_accept)
    first = {t: sum(w for s, w in outcomes.items() if s[0] == t) for t in range(V)}
    assert max(abs(first[t] - ar_prob((t,), p_cfg)) for t in range(V)) > 1e-3
