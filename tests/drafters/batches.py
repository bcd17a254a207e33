"""Helpers for drafter tests: training batches in the data pipeline's contract, computed from a tiny target."""

from __future__ import annotations

import torch

from decode.target import Target


def make_batch(
    target: Target,
    input_ids: torch.Tensor,
    feature_ids: tuple[int, ...],
    attention_mask: torch.Tensor | None = None,
    loss_mask: torch.Tensor | None = None,
) -> dict:
    """The batch contract: input_ids/attention_mask/loss_mask [B, T] and hidden {id: [B, T, D] float32}."""
    am = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    lm = am.bool() if loss_mask is None else loss_mask
    with torch.no_grad():
        out = target.model(input_ids=input_ids, attention_mask=am, output_hidden_states=True)
    hidden = {i: out.hidden_states[i].float() for i in feature_ids}
    return {"input_ids": input_ids, "attention_mask": am, "loss_mask": lm, "hidden": hidden}


def greedy_sequences(target: Target, batch: int, length: int, seed: int = 0, prompt: int = 4) -> torch.Tensor:
    """[B, length] sequences: random prompts continued greedily by the target (self-distilled data)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, target.vocab_size, (batch, prompt), generator=g)
    with torch.no_grad():
        out = target.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=length - prompt,
            min_new_tokens=length - prompt,
            do_sample=False,
            pad_token_id=0,
        )
    return out[:, :length]


def random_sequences(target: Target, batch: int, length: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, target.vocab_size, (batch, length), generator=g)


def sharp_target(family: str = "qwen3", attn: str = "eager", scale: float = 8.0, **kw) -> Target:
    """A tiny random target with a scaled-up LM head: peaked next-token distributions, like a trained model's."""
    from tests.conftest import tiny_target

    t = tiny_target(family, attn, **kw)
    with torch.no_grad():
        t.lm_head.weight.mul_(scale)
    return t


def record_rounds(drafter) -> list:
    """Wrap drafter.propose to record each round's tree (tests compare it with a recomputation)."""
    rounds = []
    inner = drafter.propose

    def propose(budget):
        tree = inner(budget)
        rounds.append(tree)
        return tree

    drafter.propose = propose
    return rounds


KINDS = ["eagle1", "eagle3", "eagle3-norms", "eagle3-target", "medusa", "layerskip", "layerskip-lora", "layerskip-full"]


def build(kind: str, target: Target, seed: int = 0):
    """A random-init drafter module of each kind with test-sized settings (LoRA weights made non-zero, the
    copied layers moved off the target's)."""
    from drafters.trainable.eagle import Eagle1
    from drafters.trainable.eagle3 import Eagle3, Eagle3Config
    from drafters.trainable.layerskip import LayerSkip, LayerSkipConfig
    from drafters.trainable.medusa import Medusa, MedusaConfig

    torch.manual_seed(seed)
    if kind == "eagle1":
        return Eagle1(target)
    if kind == "eagle3":
        counts = torch.randint(0, 100, (target.vocab_size,))
        return Eagle3(target, Eagle3Config(draft_vocab_size=target.vocab_size // 2, ttt_steps=3), token_counts=counts)
    if kind == "eagle3-norms":  # EAGLE-3.1's fc_norm and norm_output, the norms' weights moved off their ones
        counts = torch.randint(0, 100, (target.vocab_size,))
        cfg = Eagle3Config(draft_vocab_size=target.vocab_size // 2, ttt_steps=3, fc_norm=True, norm_output=True)
        m = Eagle3(target, cfg, token_counts=counts)
        with torch.no_grad():
            for norm in m.fc_norm:
                norm.weight.uniform_(0.5, 1.5)
        return m
    if kind == "eagle3-target":  # the target's own layer type: a Qwen3 target's QK-norm, its weights off their ones
        counts = torch.randint(0, 100, (target.vocab_size,))
        cfg = Eagle3Config(draft_vocab_size=target.vocab_size // 2, ttt_steps=3, draft_layer="target")
        m = Eagle3(target, cfg, token_counts=counts)
        with torch.no_grad():
            for name, p in m.midlayer.self_attn.named_parameters():
                if name.endswith("_norm.weight"):
                    p.uniform_(0.5, 1.5)
        return m
    if kind == "medusa":
        return Medusa(target, MedusaConfig(num_heads=3, num_layers=2))
    if kind == "layerskip":
        return LayerSkip(target, LayerSkipConfig(draft_exit=2, adapter_rank=4))
    if kind == "layerskip-lora":
        m = LayerSkip(
            target,
            LayerSkipConfig(mode="lora", draft_exit=2, lora_rank=4, lora_targets=("q_proj", "v_proj", "down_proj")),
        )
        with torch.no_grad():
            for name, p in m.lora.named_parameters():
                if ".B." in f".{name}.":
                    p.normal_(0, 0.3)
        return m
    if kind == "layerskip-full":
        m = LayerSkip(target, LayerSkipConfig(mode="full", draft_exit=2))
        with torch.no_grad():
            for p in m.early.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        return m
    raise ValueError(kind)


def fit(module: torch.nn.Module, batch: dict, steps: int = 30, lr: float = 1e-2) -> list[float]:
    """AdamW on the module's trainable parameters for `steps` steps on one batch; the loss metric per step."""
    params = [p for p in module.parameters() if p.requires_grad]
    assert params, "no trainable parameters"
    opt = torch.optim.AdamW(params, lr=lr)
    losses = []
    for step in range(steps):
        loss, metrics = module(batch, step)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(metrics["loss"])
    return losses


def chat_like_batch(target: Target, feature_ids: tuple[int, ...], prompt: int = 5, seed: int = 0) -> dict:
    """3 random sequences of 14 tokens as a chat batch has them: the first `prompt` tokens carry no loss, and
    rows 1 and 2 are right-padded (10 and 9 real tokens) — rows the losses must skip."""
    ids = random_sequences(target, 3, 14, seed)
    am = torch.ones_like(ids)
    am[1, 10:] = 0
    am[2, 9:] = 0
    lm = am.clone()
    lm[:, :prompt] = 0
    return make_batch(target, ids, feature_ids, attention_mask=am, loss_mask=lm)
