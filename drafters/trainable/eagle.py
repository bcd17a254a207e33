"""EAGLE-1 and EAGLE-3 as trainable modules on a frozen target (DESIGN §4).

Both drafters run over *rows*: row t holds a feature for position t and the token x_{t+1}; the row's
output predicts x_{t+2}, and its output state is the feature its child row reads (the next draft
token's row, in a chain or a tree). The first rows of a round carry the target's own features.
- EAGLE-1: z = fc([Emb(x_{t+1}); f_t]) (2H -> H) -> one decoder layer -> f̂, the estimate of the
  target's post-norm feature f_{t+1}; logits = the target's frozen LM head on f̂.
- EAGLE-3: g_t = the target's states at the capture ids (3H) -> fc (3H -> H) -> a decoder layer whose
  q/k/v read [RMSNorm(e); RMSNorm(h)] (2H) -> RMSNorm -> its own LM head over a reduced draft
  vocabulary (`d2t`: target id = draft id + d2t[id]; `t2d`: target-vocabulary membership mask).
  The state fed back is the layer's pre-norm output, which skips fc (SGLang's convention); with EAGLE-3.1's
  `norm_output` the post-norm one (vLLM's `aux_output`).
The target's embedding, LM head and rotary embedding are used by reference: never parameters of the
drafter, never in its state dict. Parameter and key names follow SGLang's EAGLE-3 layout (`fc`,
`midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`) and EAGLE-1's (`fc`, `layers.0.*`).

EAGLE-3's own parts (capture ids, draft vocabulary, the fused layer) are in drafters/trainable/eagle3.py.
Training calls `module(batch, step)` (= `loss`), which returns (loss, metrics); `position_accuracy`
is the eval; `drafter()` gives the decode-time object (drafters/trainable/eagle_drafter.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

import torch
from torch import Tensor, nn

from decode.target import Target
from drafters.trainable.draft_layer import DraftLayer, LayerSizes, UnrollContext, causal_padding_mask, positions_of
from drafters.trainable.lk import KL, lk_losses
from drafters.trainable.losses import (
    ahead,
    conditional_accuracy,
    distill_rows,
    gather_rows,
    masked_mean,
    next_valid,
    smooth_l1,
    teacher_argmax,
)
from drafters.trainable.noise import add_noise, check_noise, noise_seed


@dataclass
class Eagle1Config:
    """EAGLE-1: feature regression + soft CE through the frozen LM head."""

    intermediate_size: int = 0  # FFN width of the draft layer; 0 = the target's
    ce_weight: float = 0.1  # weight of the soft CE against the regression (EAGLE-1: 0.1)
    noise: Literal["none", "gaussian", "uniform", "relative"] = "none"  # noise on the input feature, training only
    noise_std: float = 0.05  # gaussian: std; uniform: half-width (U(-std, std)); relative: x*(1+N(0,std²))
    feature_noise: float = 0.0  # old spelling of noise=uniform, noise_std=a/2 (U(-a/2, a/2)); kept so old configs load
    eval_depth: int = 7  # draft positions `position_accuracy` reports by default

    def __post_init__(self) -> None:
        check_noise(self.noise, self.noise_std)
        if not self.feature_noise >= 0:
            raise ValueError(f"feature_noise must be >= 0, got {self.feature_noise}")
        if self.feature_noise > 0 and self.noise != "none":
            raise ValueError(
                f"feature_noise {self.feature_noise} and noise {self.noise!r} both set: keep only "
                f"noise=uniform, noise_std={self.feature_noise / 2:g} (feature_noise a = U(-a/2, a/2))"
            )

    def resolved(self, num_layers: int, vocab_size: int) -> Eagle1Config:
        """feature_noise (the old key) rewritten as noise/noise_std."""
        if self.feature_noise > 0:
            return replace(self, noise="uniform", noise_std=self.feature_noise / 2, feature_noise=0.0)
        return self

    def feature_ids(self, num_layers: int) -> tuple[int, ...]:
        """Hidden ids a training batch needs: only the post-norm last state L."""
        return (num_layers,)


class EagleBase(nn.Module):
    """What EAGLE-1 and EAGLE-3 share: the frozen target's pieces, the unroll, the eval, decoding."""

    kind = "eagle"
    objective = KL  # the distillation term's objective (train.loss; lk.use_objective sets it)

    def __init__(self, target: Target, seed: int = 0, rank: int = 0) -> None:
        super().__init__()
        self.target = target  # a plain attribute: the frozen target is not part of this module
        for piece in (target.embed_tokens, target.lm_head, target.norm):
            piece.requires_grad_(False)
        self.noise_key = (seed, rank)  # training noise is drawn from (run seed, rank, step, call within step)
        self._noise_calls = (-1, 0)  # (step, training calls seen at that step): micro-batches of one step differ

    # Subclasses define: project(hidden) -> x [.., H]; advance(x, emb, positions, ctx) -> out [.., H];
    # head(out) -> logits [.., V'];
    # step_vocab() -> the target id of each logit column, or None; to_target(ids) -> target ids;
    # decode_hidden_ids; loss().

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def embed(self, ids: Tensor) -> Tensor:
        """The target's frozen embedding, in the drafter's dtype. [B, T] -> [B, T, H]"""
        with torch.no_grad():
            return self.target.embed_tokens(ids.to(self.target.device)).to(self.dtype)

    def feature_ids(self, num_layers: int | None = None) -> tuple[int, ...]:
        return self.config.feature_ids(num_layers or self.target.num_layers)

    def forward(self, batch: dict, step: int = 0) -> tuple[Tensor, dict[str, float]]:
        """= loss(batch, step); call the module itself so DDP/accelerate wrappers see the forward."""
        return self.loss(batch, step)

    def noise_generator(self, step: int) -> torch.Generator | None:
        """The generator of this training call's hidden-state noise; None in eval mode or with noise=none.

        Seeded from (seed, rank, step, call within the step), not drawn from a running RNG: a run resumed
        at a step boundary draws exactly what an uninterrupted run does, and no global RNG is touched.
        """
        if not self.training or self.config.noise == "none":
            return None
        last, calls = self._noise_calls
        self._noise_calls = (step, calls + 1 if step == last else 0)
        g = torch.Generator(device=self.fc.weight.device)
        return g.manual_seed(noise_seed(*self.noise_key, step, self._noise_calls[1]))

    def unroll_states(self, batch: dict, steps: int, noise: torch.Generator | None = None) -> list[Tensor]:
        """Run `steps` draft steps over every row of a batch, each fed the previous step's own states.

        Step k at row t reads token x_{t+1+k} at position t+k and predicts x_{t+2+k}; it attends to
        step 0's rows <= t and its own rows of steps 1..k (what its draft chain would see when decoding).
        `noise`: a generator to perturb the target states the drafter reads (config.noise), training only;
        the loss's targets stay clean. Returns each step's output state [B, T, H] (its logits: `head`).
        """
        ids, am = batch["input_ids"], batch["attention_mask"]
        hidden = batch["hidden"]
        if noise is not None:
            hidden = {
                i: add_noise(hidden[i], self.config.noise, self.config.noise_std, noise) for i in self.decode_hidden_ids
            }
        x = self.project(hidden)  # [B, T, H]
        pos = positions_of(am)
        ctx = UnrollContext(causal_padding_mask(am, self.dtype))
        out = []
        for k in range(steps):
            tok = torch.zeros_like(ids)
            tok[:, : max(0, ids.shape[1] - 1 - k)] = ids[:, 1 + k :]  # x_{t+1+k}, 0 past the end
            x = self.advance(x, self.embed(tok), pos + k, ctx)
            out.append(x)
        return out

    def unroll(self, batch: dict, steps: int, noise: torch.Generator | None = None) -> list[tuple[Tensor, Tensor]]:
        """unroll_states with every row's logits: [(logits [B, T, V'], state [B, T, H])] per step."""
        return [(self.head(x), x) for x in self.unroll_states(batch, steps, noise)]

    @torch.no_grad()
    def position_accuracy(self, batch: dict, depth: int | None = None, topk: int = 1) -> list[float]:
        """Top-k agreement with the target's argmax per draft position 1..depth (conditional, see losses)."""
        depth = depth or self.default_depth
        argmax = teacher_argmax(batch, self.target.lm_head, self.target.num_layers)
        valid = next_valid(batch)
        correct, valids = [], []
        for k, (logits, _) in enumerate(self.unroll(batch, depth)):
            top = self.to_target(logits.topk(min(topk, logits.shape[-1]), dim=-1).indices)  # [B, T, k]
            correct.append((top == ahead(argmax, k + 1, -1)[..., None]).any(-1))
            valids.append(ahead(valid, k + 1, False))
        return conditional_accuracy(correct, valids)

    def drafter(self, name: str | None = None):
        """The decode-time drafter (drafter protocol) running this module."""
        from drafters.trainable.eagle_drafter import EagleDrafter

        return EagleDrafter(self.eval(), name or self.kind)


class Eagle1(EagleBase):
    """EAGLE-1: regresses the target's next feature, one decoder layer over fc([Emb(x_{t+1}); f_t])."""

    kind = "eagle1"

    def __init__(self, target: Target, config: Eagle1Config | None = None, seed: int = 0, rank: int = 0) -> None:
        super().__init__(target, seed, rank)
        self.config = config = (config or Eagle1Config()).resolved(target.num_layers, target.vocab_size)
        sizes = LayerSizes.of(target.config, config.intermediate_size)
        H = sizes.hidden
        with torch.device(target.device):
            self.fc = nn.Linear(2 * H, H, bias=True)
            self.layers = nn.ModuleList([DraftLayer(sizes, fused=False)])
        self.default_depth = config.eval_depth

    @property
    def decode_hidden_ids(self) -> tuple[int, ...]:
        return (self.target.num_layers,)

    def project(self, hidden: dict[int, Tensor]) -> Tensor:
        """The target's post-norm last state is the feature itself. {id: [.., H]} -> [.., H]"""
        return hidden[self.target.num_layers].to(self.dtype)

    def advance(self, x: Tensor, emb: Tensor, positions: Tensor, ctx) -> Tensor:
        """x (feature), emb [B, T, H] at positions [B, T] -> f̂ [B, T, H], the next feature's estimate."""
        z = self.fc(torch.cat([emb, x], dim=-1))
        cos, sin = self.target.rotary_emb(z, positions)
        return self.layers[0](z, cos, sin, ctx)

    def head(self, f_hat: Tensor) -> Tensor:
        """The target's frozen LM head on f̂. [.., H] -> [.., V]"""
        return self.target.lm_head(f_hat.to(self.target.lm_head.weight.dtype))

    def decode_head(self) -> Callable[[Tensor], Tensor]:
        """head() for decoding: the target's LM head through its packed runtime when that may run."""

        def head(f_hat: Tensor) -> Tensor:
            fast = self.target.fast()
            return fast.head(f_hat.to(self.target.dtype)) if fast is not None else self.head(f_hat)

        return head

    def step_vocab(self) -> None:
        return None  # logits over the target's whole vocabulary

    def to_target(self, ids: Tensor) -> Tensor:
        return ids

    def loss(self, batch: dict, step: int = 0) -> tuple[Tensor, dict[str, float]]:
        """SmoothL1(f̂_t, f_{t+1}) + ce_weight * soft-CE(lm_head(f̂_t), P_{t+1}) over trained rows (with
        train.loss=lk the LK loss in place of the soft CE; the regression stays)."""
        L = self.target.num_layers
        argmax = teacher_argmax(batch, self.target.lm_head, L)
        (f_hat,) = self.unroll_states(batch, 1, self.noise_generator(step))
        # rows with a loss only (prompt and padding rows have none): row t predicts f_{t+1} and P_{t+1}
        b, t = ahead(next_valid(batch), 1, False).nonzero(as_tuple=True)  # [M] each
        every = torch.ones_like(b, dtype=torch.bool)[None]  # [1, M]
        f_rows = f_hat[b, t][None]  # [1, M, H]
        reg = masked_mean(smooth_l1(f_rows, batch["hidden"][L][b, t + 1][None].to(f_hat.dtype)), every)
        logits = self.head(f_rows)  # [1, M, V]
        taught = gather_rows(batch, b, t + 1, L)
        if self.objective.lk:  # the acceptance rate of lm_head(f̂_t) against P_{t+1} (drafters/trainable/lk.py)
            (ce,), (alpha,) = lk_losses([logits], [every], taught, self.target.lm_head, L, self.objective)
            extra = {"lk_1": float(ce.detach()), "alpha_1": float(alpha)}
        else:
            (ce_rows,) = distill_rows([logits], [0], taught, self.target.lm_head, L, "soft_ce")
            ce = masked_mean(ce_rows, every)
            extra = {"ce_1": float(ce.detach())}
        acc = masked_mean((logits.argmax(-1) == argmax[b, t + 1][None]).float(), every)
        total = reg + self.config.ce_weight * ce
        return total, {
            "loss": float(total.detach()),
            "regression": float(reg.detach()),
            **extra,
            "acc_1": float(acc.detach()),
        }
