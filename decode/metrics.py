"""Per-generation statistics: τ, acceptance by depth, passes, and the time split per round."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class GenStats:
    """Counts for one or more generations; `merge` sums them so τ stays tokens / passes overall."""

    new_tokens: int = 0
    target_passes: int = 0  # prefill included: AR has exactly one pass per token
    drafter_passes: int = 0
    rounds: int = 0  # speculative rounds (target passes after prefill)
    proposed_by_depth: list[int] = field(default_factory=list)  # rounds whose draft reached depth d+1
    accepted_by_depth: list[int] = field(default_factory=list)  # rounds that accepted >= d+1 tokens
    accepted_lengths: list[int] = field(default_factory=list)  # accepted draft tokens per round
    draft_nodes: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    commit_s: float = 0.0
    prefill_s: float = 0.0
    wall_s: float = 0.0

    def record_round(self, depth: int, accepted: int, nodes: int) -> None:
        for lst in (self.proposed_by_depth, self.accepted_by_depth):
            lst.extend([0] * (depth - len(lst)))
        for d in range(depth):
            self.proposed_by_depth[d] += 1
        for d in range(accepted):
            self.accepted_by_depth[d] += 1
        self.accepted_lengths.append(accepted)
        self.draft_nodes += nodes
        self.rounds += 1

    @property
    def tau(self) -> float:
        """Mean tokens emitted per target pass, bonus included (AR = 1.0)."""
        return self.new_tokens / self.target_passes if self.target_passes else 0.0

    @property
    def acceptance_by_depth(self) -> list[float]:
        """P(accepted length >= d) among rounds whose draft reached depth d, d = 1, 2, ..."""
        return [a / p if p else 0.0 for a, p in zip(self.accepted_by_depth, self.proposed_by_depth)]

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def merge(self, other: GenStats) -> GenStats:
        out = GenStats()
        for k, v in asdict(self).items():
            w = getattr(other, k)
            if isinstance(v, list):
                n = max(len(v), len(w))
                if k == "accepted_lengths":
                    setattr(out, k, v + w)
                else:
                    setattr(out, k, [(v[i] if i < len(v) else 0) + (w[i] if i < len(w) else 0) for i in range(n)])
            else:
                setattr(out, k, v + w)
        return out

    def summary(self) -> dict:
        return {
            "mean_accepted_tokens": self.tau,
            "acceptance_by_depth": self.acceptance_by_depth,
            "target_forward_passes": self.target_passes,
            "drafter_forward_passes": self.drafter_passes,
            "new_tokens": self.new_tokens,
            "rounds": self.rounds,
            "mean_draft_nodes": self.draft_nodes / self.rounds if self.rounds else 0.0,
            "wall_time_s": self.wall_s,
            "tokens_per_s": self.tokens_per_s,
            "time_split_s": {
                "prefill": self.prefill_s,
                "draft": self.draft_s,
                "verify": self.verify_s,
                "commit": self.commit_s,
            },
        }
