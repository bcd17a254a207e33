"""Draft-length policies: how long a draft to ask for each round (they never change the output).

- `fixed`: always the base shape (chain of k = --draft-len).
- `learning`: after each round, re-estimates the per-token acceptance rate a (decayed counts of
  accepted tokens and of rejections) and picks the k in 1..2 x --draft-len that maximises expected
  tokens per second, (1 - a^(k+1)) / (1 - a) / (k * draft_s_per_token + target_pass_s(k + 1)).
  It needs no probabilities, so it works with lookup drafters too.
- `threshold`: drafts a chain (up to --draft-len) until the drafter's probability of the token it
  just drafted falls below p (that token stays: it is already paid for, as in HF's confidence
  criterion).
- `stopping`: drafts a chain (up to --draft-len) while one more token pays for itself. With P_n the
  probability that the whole chain so far is accepted (product of the drafter's probabilities,
  calibrated by a running factor: accepted tokens / summed probabilities of the tokens verification
  reached, since an untrained drafter is often confidently wrong), E_n the
  expected tokens this round (1 + sum P_i) and T_n its cost (n drafter steps + one target pass),
  one more token adds P_n to the tokens and dT (a drafter step + the pass's extra row) to the time;
  it is worth it while P_n / dT > E_n / T_n, the rate the round already has.

Costs are measured as the run goes (drafting seconds per drafted token, target seconds per pass)
unless a target-pass cost curve is given (`--target-pass-s`: a constant, e.g. 20 s for a streamed
14B target); the curve is a function of the rows a pass verifies so a measured one can replace it.
`threshold` and `stopping` need the drafter's per-token probabilities (DraftTree.conf) on a chain.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

from decode.options import parse_kv
from decode.tree import Shape

# Seconds one target pass takes when it verifies `rows` rows (root + draft nodes).
PassCost = Callable[[int], float]


@dataclass
class Round:
    """What one speculative round proposed, accepted and cost (the generate loop reports it)."""

    proposed_depth: int
    accepted: int  # accepted draft tokens (bonus excluded)
    draft_s: float
    verify_s: float
    rows: int  # rows in the target pass
    conf: list[float] | None = None  # drafter probability of each chain token (None = not exposed)


class Policy(Protocol):
    """Picks this round's shape from the base shape, then hears how the round went."""

    name: str
    needs_probs: bool  # True: only for drafters whose trees carry per-token probabilities

    def shape(self, base: Shape) -> Shape: ...

    def observe(self, r: Round) -> None: ...


def constant_cost(seconds: float) -> PassCost:
    """A target pass that costs the same whatever it verifies (a streamed target is I/O bound)."""
    if seconds <= 0:
        raise ValueError(f"--target-pass-s must be > 0, got {seconds}")
    return lambda rows: seconds


class Costs:
    """Drafting seconds per drafted token (measured) and target seconds per pass (given or measured)."""

    def __init__(self, pass_cost: PassCost | None = None) -> None:
        self.pass_cost = pass_cost
        self.draft_s = self.drafted = 0.0
        self.verify_s = self.passes = 0.0

    def observe(self, r: Round) -> None:
        if r.proposed_depth:  # rounds with no draft (no lookup match) say nothing about drafting cost
            self.draft_s += r.draft_s
            self.drafted += r.proposed_depth
        self.verify_s += r.verify_s
        self.passes += 1

    @property
    def known(self) -> bool:
        return self.drafted > 0 and (self.pass_cost is not None or self.passes > 0)

    def draft_token_s(self) -> float:
        return self.draft_s / self.drafted

    def target_s(self, rows: int) -> float:
        return self.pass_cost(rows) if self.pass_cost is not None else self.verify_s / self.passes


def with_depth(shape: Shape, k: int) -> Shape:
    """The shape grown to depth k (chain length, dynamic depth, static paths no longer than k)."""
    if shape.kind == "chain":
        return replace(shape, k=k)
    if shape.kind == "dynamic":
        return replace(shape, depth=k)
    return replace(shape, choices=tuple(c for c in shape.choices if len(c) <= k))


def need_chain(shape: Shape, name: str) -> None:
    if shape.kind != "chain":
        raise ValueError(
            f"--policy {name} stops a chain token by token; it does not apply to --tree {shape.kind} "
            "(use --tree chain, or --policy fixed|learning)"
        )


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a round emits (bonus included) when each of k chain tokens is accepted with prob alpha."""
    return float(k + 1) if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def best_length(alpha: float, costs: Costs, k_max: int) -> int:
    """The k in 1..k_max with the most expected tokens per second (ties -> the shorter)."""
    c_d = costs.draft_token_s()
    rate = [expected_tokens(alpha, k) / (k * c_d + costs.target_s(k + 1)) for k in range(1, k_max + 1)]
    return 1 + max(range(k_max), key=lambda i: (rate[i], -i))


def stop_rule(c_d: float, target_s: PassCost, calib: float) -> Callable[[list[float]], bool]:
    """The `stopping` rule for one round: True once one more token no longer pays its cost."""

    def stop(conf: list[float]) -> bool:
        n, p_all, expected = len(conf), 1.0, 1.0
        for c in conf:  # 1. P_i = prob. the first i tokens are all accepted; E_n = 1 + sum P_i
            p_all *= min(1.0, calib * c)
            expected += p_all
        spent = n * c_d + target_s(n + 1)  # 2. this round's cost so far (n drafter steps + the pass)
        extra = c_d + target_s(n + 2) - target_s(n + 1)  # 3. what one more token adds
        return p_all * spent < extra * expected  # 4. its gain P_n is below the round's current rate

    return stop


class FixedPolicy:
    """Always the base shape (chain of k = --draft-len)."""

    name, needs_probs = "fixed", False

    def shape(self, base: Shape) -> Shape:
        return base

    def observe(self, r: Round) -> None:
        pass


class LearningPolicy:
    """k re-chosen after each round from the decayed acceptance rate and the costs (any drafter)."""

    name, needs_probs = "learning", False

    def __init__(self, costs: Costs, max_len: int = 0, decay: float = 0.9) -> None:
        self.costs, self.max_len, self.decay = costs, max_len, decay
        self.accepted = self.rejected = 0.0
        self.k: int | None = None  # None until the first round has been measured
        self.k_max = 0

    def shape(self, base: Shape) -> Shape:
        self.k_max = self.max_len or 2 * max(1, base.max_depth)
        return with_depth(base, self.k if self.k is not None else min(base.max_depth, self.k_max))

    def observe(self, r: Round) -> None:
        self.costs.observe(r)
        if not r.proposed_depth:
            return
        # 1. geometric model: each round gives `accepted` successes and one failure unless fully accepted
        self.accepted = self.decay * self.accepted + r.accepted
        self.rejected = self.decay * self.rejected + (r.accepted < r.proposed_depth)
        alpha = self.accepted / (self.accepted + self.rejected) if self.accepted + self.rejected else 0.0
        # 2. the length with the best expected tokens per second under the measured costs
        if self.costs.known and self.k_max:
            self.k = best_length(alpha, self.costs, self.k_max)


class ThresholdPolicy:
    """Chain until the drafter's probability of its last token is below p (at most max_len tokens)."""

    name, needs_probs = "threshold", True

    def __init__(self, p: float = 0.4, max_len: int = 0) -> None:
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"--policy threshold:p={p}: p must be in [0, 1]")
        self.p, self.max_len = p, max_len

    def shape(self, base: Shape) -> Shape:
        need_chain(base, self.name)
        p = self.p
        return replace(base, k=self.max_len or base.k, stop=lambda conf: conf[-1] < p)

    def observe(self, r: Round) -> None:
        pass


class StoppingPolicy:
    """Chain while one more token's expected gain pays its cost (measured draft/target cost ratio)."""

    name, needs_probs = "stopping", True

    def __init__(self, costs: Costs, max_len: int = 0, decay: float = 0.9) -> None:
        self.costs, self.max_len, self.decay = costs, max_len, decay
        self.accepted = self.conf_sum = 1.0  # calibration prior: the drafter's probabilities are right

    def shape(self, base: Shape) -> Shape:
        need_chain(base, self.name)
        k = self.max_len or base.k
        if not self.costs.known:  # first round: nothing measured yet, draft the longest chain
            return replace(base, k=k)
        calib = self.accepted / self.conf_sum
        return replace(base, k=k, stop=stop_rule(self.costs.draft_token_s(), self.costs.target_s, calib))

    def observe(self, r: Round) -> None:
        self.costs.observe(r)
        if not r.conf:
            return
        # calibration: accepted tokens vs the probabilities of the tokens verification reached
        reached = r.conf[: min(r.accepted + 1, len(r.conf))]
        self.accepted = self.decay * self.accepted + r.accepted
        self.conf_sum = self.decay * self.conf_sum + sum(reached)


# name -> (constructor, options with their defaults: the defaults also give the option types)
POLICIES: dict[str, tuple[Callable[..., Policy], dict[str, float | int]]] = {
    "fixed": (lambda costs: FixedPolicy(), {}),
    "learning": (lambda costs, max, decay: LearningPolicy(costs, max, decay), {"max": 0, "decay": 0.9}),
    "threshold": (lambda costs, p, max: ThresholdPolicy(p, max), {"p": 0.4, "max": 0}),
    "stopping": (lambda costs, max, decay: StoppingPolicy(costs, max, decay), {"max": 0, "decay": 0.9}),
}


def make_policy(spec: str, pass_cost: PassCost | None = None) -> Policy:
    """`fixed`, `learning[:max=0,decay=0.9]`, `threshold[:p=0.4,max=0]`, `stopping[:max=0,decay=0.9]`.

    max = the longest chain; 0 = --draft-len for the stop rules (threshold, stopping only cut a chain
    short) and twice --draft-len for learning (it moves k both ways). pass_cost = the target-pass
    cost curve (None = measure it).
    """
    name, _, arg = spec.partition(":")
    if name not in POLICIES:
        raise ValueError(f"--policy {spec!r}: available policies are {sorted(POLICIES)}")
    build, defaults = POLICIES[name]
    kw = parse_kv(arg, defaults, f"--policy {spec!r}")
    if kw.get("max", 0) < 0 or not 0.0 <= kw.get("decay", 0.0) <= 1.0:
        raise ValueError(f"--policy {spec!r}: max must be >= 0 and decay in [0, 1]")
    return build(Costs(pass_cost), **kw)


def capped(shape: Shape, max_depth: int) -> Shape:
    """The shape with its depth limited (near max_new_tokens or the model's max positions)."""
    if shape.kind == "chain":
        return replace(shape, k=max(0, min(shape.k, max_depth)))
    if shape.kind == "dynamic":
        return replace(shape, depth=max(0, min(shape.depth, max_depth)))
    return shape  # static trees are truncated after growing
