"""DSpark: DFlash + a low-rank Markov head on the previous token + a confidence head per block position.

DFlash drafts every block position from the same pass, blind to the token drafted just before it; DSpark adds
that token back cheaply. Position i's head state is z_i = norm(h_i) + W E[x_{i-1}] (E: a [V, r] table, W: an
[r, D] map, zero-initialised so training starts from DFlash), so its logits gain lm_head(W E[x_{i-1}]): a
rank-r bias from the previous token. This form costs r*D per position instead of an [r, V] map's r*V, and a
chain still runs one head row per position. A tree conditions each branch on its own previous token.
The confidence head (D -> 1, sigmoid) on z_i predicts P(position i is accepted | positions < i accepted),
trained by BCE against [the drafter's argmax at i = the target's] with earlier positions teacher-forced;
decoding exposes it as DraftTree.conf, which the threshold and stopping length policies read.
Default loss: 0.1 x KL + 0.9 x (1 - α) (the L1 distance of the probabilities, halved), positions weighted by
exp(-(i-1)/4), + 0.1 x the confidence BCE. Keys: DFlash's + `markov.embed.weight`, `markov.proj.weight`,
`conf_head.weight`, `conf_head.bias`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn

from decode.target import Target
from drafters.trainable.dflash import DFlash, DFlashConfig


@dataclass
class DSparkConfig(DFlashConfig):
    """DSpark: DFlash's settings (other loss defaults) + the Markov head's rank and the confidence loss weight."""

    ce_weight: float = 0.1  # weight of the kl/ce term of each block position
    l1_weight: float = 0.9  # weight of 1 - α (the L1 distance of the probabilities, halved)
    position_decay: bool = True  # weight block position i by exp(-(i-1)/gamma)
    gamma: float = 4.0  # the decay's scale
    markov_rank: int = 256  # rank r of the previous-token bias, capped at the target's hidden size
    conf_weight: float = 0.1  # weight of the confidence head's BCE

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.markov_rank < 1 or not self.conf_weight >= 0:
            raise ValueError(
                f"markov_rank must be >= 1 and conf_weight >= 0, got {self.markov_rank}, {self.conf_weight}"
            )


class MarkovHead(nn.Module):
    """The previous token's low-rank term in head-state space: W E[x]. [..] -> [.., D]"""

    def __init__(self, vocab: int, rank: int, hidden: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, rank)
        nn.init.normal_(self.embed.weight, std=rank**-0.5)
        self.proj = nn.Linear(rank, hidden, bias=False)
        nn.init.zeros_(self.proj.weight)  # a no-op at first: training starts from DFlash's drafts

    def forward(self, prev: Tensor) -> Tensor:
        return self.proj(self.embed(prev))


class DSpark(DFlash):
    """DFlash with the Markov and confidence heads."""

    kind = "dspark"
    conditions_on_prev = True

    def __init__(
        self,
        target: Target,
        config: DSparkConfig | None = None,
        seed: int = 0,
        rank: int = 0,
        token_counts: Tensor | None = None,
    ) -> None:
        super().__init__(target, config, seed, rank, token_counts)
        H = target.hidden_size
        self.config = replace(self.config, markov_rank=min(self.config.markov_rank, H))
        with torch.device(target.device):
            self.markov = MarkovHead(target.vocab_size, self.config.markov_rank, H)
            self.conf_head = nn.Linear(H, 1)

    @staticmethod
    def default_config() -> DSparkConfig:
        return DSparkConfig()

    def head_states(self, h: Tensor, prev: Tensor) -> Tensor:
        """norm(h) + W E[prev]: the previous token's rank-r bias. h [.., D], prev [..] -> [.., D]"""
        return self.norm(h) + self.markov(prev.to(self.markov.embed.weight.device)).to(h.dtype)

    @torch.no_grad()
    def markov_logit_table(self) -> Tensor:
        """(W_head P)^T: the logits of each rank direction of the Markov term ([r, D] x [D, V]), so token x's bias on
        the logits is E[x] @ table (the LM head is linear). Row-major [r, V]: a one-row product reads it in order
        (as [V, r].T it ran 1.4x slower). For decoding; product in the head's dtype. -> [r, V] fp32 ([r, N] over
        a draft vocabulary's columns)"""
        w, _ = self.head_rows()  # a bias is added once, with the base logits, never per rank direction
        return (self.markov.proj.weight.T.to(w) @ w.T).float().contiguous()

    def markov_terms(self, prev: Tensor, table: Tensor) -> tuple[Tensor, Tensor]:
        """The previous tokens' Markov term twice: on the logits through `table` (markov_logit_table) and on the head
        states (what the confidence head reads). prev [n] -> ([n, V] fp32, [n, D])"""
        e = self.markov.embed(prev.to(self.markov.embed.weight.device))  # [n, r]
        return e.to(table) @ table, self.markov.proj(e)

    def confidence(self, z: Tensor) -> Tensor:
        """P(accepted) of each position. [.., D] -> [..]"""
        return torch.sigmoid(self.conf_head(z.to(self.dtype)).squeeze(-1).float())
