"""EAGLE-1 and EAGLE-3 as trainable modules on a frozen target (DESIGN §4).

Both drafters run over *rows*: row t holds a feature for position t and the token x_{t+1}; the row's
output predicts x_{t+2}, and its output state is the feature its child row reads (the next draft
token's row, in a chain or a tree). The first rows of a round carry the target's own features.
- EAGLE-1: z = fc([Emb(x_{t+1}); f_t]) (2H -> H) -> one decoder layer -> f̂, the estimate of the
  target's post-norm feature f_{t+1}; logits = the target's frozen LM head on f̂.
- EAGLE-3: g_t = the target's states at the capture ids (3H) -> fc (3H -> H) -> a decoder layer whose
  q/k/v read [RMSNorm(e); RMSNorm(h)] (2H) -> RMSNorm -> its own LM head over a reduced draft
  vocabulary (`d2t`: target id = draft id + d2t[id]; `t2d`: target-vocabulary membership mask).
  The state fed back is the layer's pre-norm output, which skips fc (SGLang's convention).
The target's embedding, LM head and rotary embedding are used by reference: never parameters of the
drafter, never in its state dict. Parameter and key names follow SGLang's EAGLE-3 layout (`fc`,
`midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`) and EAGLE-1's (`fc`, `layers.0.*`).

Training calls `module(batch, step)` (= `loss`), which returns (loss, metrics); `position_accuracy`
is the eval; `drafter()` gives the decode-time object (drafters/trainable/eagle_drafter.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import torch
from torch import Tensor, nn

from decode.target import Target
from drafters.trainable.draft_layer import (
    DraftLayer,
    LayerSizes,
    RMSNorm,
    UnrollContext,
    causal_padding_mask,
    positions_of,
)
from drafters.trainable.losses import (
    ahead,
    conditional_accuracy,
    distill_rows,
    gather_rows,
    loss_metrics,
    masked_mean,
    next_valid,
    smooth_l1,
    step_weights,
    teacher_argmax,
)
from drafters.trainable.noise import add_noise, check_noise, noise_seed


def default_capture_ids(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low/mid/high capture ids: (2, L//2, L-3) (vLLM/speculators), spread for shallow targets.

    Below 7 layers that formula repeats or reorders ids, so use three ids spread over 1..L-1.
    """
    L = num_layers
    if L >= 7:
        return (2, L // 2, L - 3)
    return tuple(sorted({max(1, round(1 + i * (L - 2) / 2)) for i in range(3)})) if L > 1 else (0,)


def build_draft_vocab(token_counts: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """The n most frequent target tokens (ties: lower id first), in id order.

    token_counts [V] -> d2t [n] long (target id = draft id + d2t[draft id]), t2d [V] bool (in the draft vocab).
    """
    v = token_counts.numel()
    if not 1 <= n <= v:
        raise ValueError(f"draft vocabulary size {n} must be in 1..{v} (the target's vocabulary)")
    order = torch.sort(token_counts.double().view(-1).cpu(), descending=True, stable=True).indices
    ids = order[:n].sort().values
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(n), t2d


@dataclass
class Eagle3Config:
    """EAGLE-3: capture ids, draft vocabulary, draft-layer width and training-time test."""

    capture_ids: tuple[int, ...] = ()  # target hidden ids fused by fc; () = default_capture_ids(L)
    draft_vocab_size: int = 32000  # rows of the drafter's LM head, capped at the target's vocabulary
    intermediate_size: int = 0  # FFN width of the draft layer; 0 = the target's
    ttt_steps: int = 7  # training-time test: steps unrolled on the drafter's own states (K)
    step_decay: float = 0.8  # loss weight decay^k of unrolled step k (1.0: equal weights, speculators)
    noise: Literal["none", "gaussian", "uniform", "relative"] = "none"  # noise on the capture states, training only
    noise_std: float = 0.05  # gaussian: std; uniform: half-width; relative: x*(1+N(0,std²)); speculators: gaussian 0.05
    freeze_head: bool = False  # LM head rows and final norm stay the target's copies, frozen (speculators)

    def __post_init__(self) -> None:
        check_noise(self.noise, self.noise_std)
        if not self.step_decay >= 0:
            raise ValueError(f"step_decay must be >= 0, got {self.step_decay}")

    def resolved(self, num_layers: int, vocab_size: int) -> Eagle3Config:
        """Defaults filled in for a target, checked (capture ids in range)."""
        ids = tuple(int(i) for i in self.capture_ids) or default_capture_ids(num_layers)
        bad = [i for i in ids if not 0 <= i < num_layers]
        if bad:
            raise ValueError(f"EAGLE-3 capture ids {bad} out of range 0..{num_layers - 1} for a "
                             f"{num_layers}-layer target (hidden ids: 0 = embeddings, i = output of layer i)")
        if self.ttt_steps < 1:
            raise ValueError(f"ttt_steps must be >= 1, got {self.ttt_steps}")
        return replace(self, capture_ids=ids, draft_vocab_size=min(self.draft_vocab_size, vocab_size))

    def feature_ids(self, num_layers: int) -> tuple[int, ...]:
        """Hidden ids a training batch needs: the capture ids, and L for the target's distribution."""
        ids = tuple(self.capture_ids) or default_capture_ids(num_layers)
        return tuple(sorted(set(ids) | {num_layers}))


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
            raise ValueError(f"feature_noise {self.feature_noise} and noise {self.noise!r} both set: keep only "
                             f"noise=uniform, noise_std={self.feature_noise / 2:g} (feature_noise a = U(-a/2, a/2))")

    def resolved(self, num_layers: int, vocab_size: int) -> Eagle1Config:
        """feature_noise (the old key) rewritten as noise/noise_std."""
        if self.feature_noise > 0:
            return replace(self, noise="uniform", noise_std=self.feature_noise / 2, feature_noise=0.0)
        return self

    def feature_ids(self, num_layers: int) -> tuple[int, ...]:
        """Hidden ids a training batch needs: only the post-norm last state L."""
        return (num_layers,)


class _Eagle(nn.Module):
    """What EAGLE-1 and EAGLE-3 share: the frozen target's pieces, the unroll, the eval, decoding."""

    kind = "eagle"

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
            hidden = {i: add_noise(hidden[i], self.config.noise, self.config.noise_std, noise)
                      for i in self.decode_hidden_ids}
        x = self.project(hidden)  # [B, T, H]
        pos = positions_of(am)
        ctx = UnrollContext(causal_padding_mask(am, self.dtype))
        out = []
        for k in range(steps):
            tok = torch.zeros_like(ids)
            tok[:, : max(0, ids.shape[1] - 1 - k)] = ids[:, 1 + k:]  # x_{t+1+k}, 0 past the end
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


class Eagle3(_Eagle):
    """EAGLE-3: fuses low/mid/high target features, trained with the training-time test."""

    kind = "eagle3"

    def __init__(self, target: Target, config: Eagle3Config | None = None,
                 token_counts: Tensor | None = None, seed: int = 0, rank: int = 0) -> None:
        """token_counts [V]: target-token frequencies of the training data, for the draft vocabulary
        (None: the first N ids, fine for tests or when the vocabulary is not reduced); seed, rank: of
        the training noise."""
        super().__init__(target, seed, rank)
        self.config = cfg = (config or Eagle3Config()).resolved(target.num_layers, target.vocab_size)
        sizes = LayerSizes.of(target.config, cfg.intermediate_size)
        H, n = sizes.hidden, cfg.draft_vocab_size
        if token_counts is None:
            token_counts = torch.arange(target.vocab_size, 0, -1)
        if token_counts.numel() != target.vocab_size:
            raise ValueError(f"token_counts has {token_counts.numel()} entries, the target's vocabulary {target.vocab_size}")
        d2t, t2d = build_draft_vocab(token_counts, n)
        with torch.device(target.device):
            self.fc = nn.Linear(len(cfg.capture_ids) * H, H, bias=False)
            self.midlayer = DraftLayer(sizes, fused=True)
            self.norm = RMSNorm(H, sizes.eps)
            self.lm_head = nn.Linear(H, n, bias=False)
        self.register_buffer("d2t", d2t.to(target.device))
        self.register_buffer("t2d", t2d.to(target.device))
        with torch.no_grad():  # start from the target's own head, restricted to the draft vocabulary
            self.lm_head.weight.copy_(target.lm_head.weight[self.draft_ids])
            self.norm.weight.copy_(target.norm.weight)
        if cfg.freeze_head:  # not trained: the optimizer only sees parameters that require grad
            self.lm_head.requires_grad_(False)
            self.norm.requires_grad_(False)
        self.default_depth = cfg.ttt_steps

    @property
    def draft_ids(self) -> Tensor:
        """Target id of each draft-vocabulary entry. [N]"""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    @property
    def decode_hidden_ids(self) -> tuple[int, ...]:
        return tuple(self.config.capture_ids)

    def project(self, hidden: dict[int, Tensor]) -> Tensor:
        """fc over the concatenated capture states. {id: [.., H]} -> [.., H]"""
        g = torch.cat([hidden[i].to(self.dtype) for i in self.config.capture_ids], dim=-1)
        return self.fc(g)

    def advance(self, x: Tensor, emb: Tensor, positions: Tensor, ctx) -> Tensor:
        """The draft layer: x, emb [B, T, H] at positions [B, T] -> pre-norm state [B, T, H] (fed back)."""
        cos, sin = self.target.rotary_emb(x, positions)
        return self.midlayer(x, cos, sin, ctx, emb)

    def head(self, h: Tensor) -> Tensor:
        """Draft-vocabulary logits of states. [.., H] -> [.., N]"""
        return self.lm_head(self.norm(h))

    def step_vocab(self) -> Tensor | None:
        """Target id of each logit column [N] for decode.tree.grow; None when the draft vocabulary is the
        target's whole vocabulary (the columns are the ids)."""
        return None if self.d2t.numel() == self.t2d.numel() else self.draft_ids

    def to_target(self, draft: Tensor) -> Tensor:
        return draft + self.d2t[draft]

    def loss(self, batch: dict, step: int = 0) -> tuple[Tensor, dict[str, float]]:
        """Training-time test: sum_k decay^k soft-CE(step k, P restricted to the draft vocabulary).

        Rows whose target argmax lies outside the draft vocabulary are skipped (SpecForge does the same):
        the drafter cannot propose that token, so the row only teaches it a distorted distribution.
        """
        L = self.target.num_layers
        argmax = teacher_argmax(batch, self.target.lm_head, L)
        valid = next_valid(batch) & self.t2d[argmax]  # [B, T]: P_t is a target the draft vocabulary can reach
        states = self.unroll_states(batch, self.config.ttt_steps, self.noise_generator(step))
        # 1. Only rows with a loss go through the draft head (in chat data 54% of a padded batch are prompt
        #    and padding rows, which have none). The teacher rows t' (valid) are every step's targets; step k's
        #    prediction of P_t' sits at row t' - k - 1 (k+1 tokens ahead), absent when that is < 0.
        b, t = valid.nonzero(as_tuple=True)  # [M] each
        logits, present = [], []
        for k, h in enumerate(states):
            src = t - (k + 1)
            present.append((src >= 0)[None])  # [1, M]
            logits.append(self.head(h[b, src.clamp(min=0)])[None])  # [1, M, N]
        # 2. step k against P_t' restricted to the draft vocabulary (softmax over it = renormalised), the
        #    teacher built once per chunk of rows for all steps
        rows = distill_rows(logits, [0] * len(logits), gather_rows(batch, b, t, L), self.target.lm_head, L,
                            "soft_ce", self.draft_ids)
        want = argmax[b, t][None]  # [1, M]
        losses, accs = [], []
        for lg, ce, v in zip(logits, rows, present):
            losses.append(masked_mean(ce, v))
            accs.append(masked_mean((self.to_target(lg.argmax(-1)) == want).float(), v))
        total = sum(w * lo for w, lo in zip(step_weights(len(losses), self.config.step_decay), losses))
        return total, {"loss": float(total.detach()), **loss_metrics("ce", losses), **loss_metrics("acc", accs)}


class Eagle1(_Eagle):
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

    def step_vocab(self) -> None:
        return None  # logits over the target's whole vocabulary

    def to_target(self, ids: Tensor) -> Tensor:
        return ids

    def loss(self, batch: dict, step: int = 0) -> tuple[Tensor, dict[str, float]]:
        """SmoothL1(f̂_t, f_{t+1}) + ce_weight * soft-CE(lm_head(f̂_t), P_{t+1}) over trained rows."""
        L = self.target.num_layers
        argmax = teacher_argmax(batch, self.target.lm_head, L)
        (f_hat,) = self.unroll_states(batch, 1, self.noise_generator(step))
        # rows with a loss only (prompt and padding rows have none): row t predicts f_{t+1} and P_{t+1}
        b, t = ahead(next_valid(batch), 1, False).nonzero(as_tuple=True)  # [M] each
        every = torch.ones_like(b, dtype=torch.bool)[None]  # [1, M]
        f_rows = f_hat[b, t][None]  # [1, M, H]
        reg = masked_mean(smooth_l1(f_rows, batch["hidden"][L][b, t + 1][None].to(f_hat.dtype)), every)
        logits = self.head(f_rows)  # [1, M, V]
        (ce_rows,) = distill_rows([logits], [0], gather_rows(batch, b, t + 1, L), self.target.lm_head, L, "soft_ce")
        ce = masked_mean(ce_rows, every)
        acc = masked_mean((logits.argmax(-1) == argmax[b, t + 1][None]).float(), every)
        total = reg + self.config.ce_weight * ce
        return total, {"loss": float(total.detach()), "regression": float(reg.detach()), "ce_1": float(ce.detach()),
                       "acc_1": float(acc.detach())}
