"""Slow: a short EAGLE-3 training run on the bundled target drafts better than the untrained early exit."""

from __future__ import annotations

import pytest
import torch

from decode.generate import generate
from decode.tree import Shape
from drafters.sources.early_exit import early_exit
from drafters.trainable.eagle3 import Eagle3, Eagle3Config
from tests.conftest import DEV_PROMPTS
from tests.drafters.batches import make_batch


def chain_tau(target, drafter_fn, prompts, shape) -> float:
    tokens = passes = 0
    for p in prompts:
        gen = generate(target, drafter_fn(), target.tokenizer(p, return_tensors="pt").input_ids[0], 48, shape=shape)
        tokens, passes = tokens + gen.stats.new_tokens, passes + gen.stats.target_passes
    return tokens / passes


@pytest.mark.slow
def test_short_eagle3_run_beats_early_exit_2(stories):
    torch.manual_seed(0)
    # 1. self-distilled data: stories sampled from the target itself, starting at BOS
    with torch.no_grad():
        ids = stories.model.generate(
            torch.ones(48, 1, dtype=torch.long),
            attention_mask=torch.ones(48, 1, dtype=torch.long),
            do_sample=True,
            top_k=0,
            max_new_tokens=95,
            min_new_tokens=95,
            pad_token_id=0,
        )
    counts = torch.bincount(ids.view(-1), minlength=stories.vocab_size)
    m = Eagle3(stories, Eagle3Config(draft_vocab_size=384, ttt_steps=3), token_counts=counts)
    batches = [make_batch(stories, ids[i : i + 8], m.feature_ids()) for i in range(0, ids.shape[0], 8)]
    # 2. train
    steps = 120
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps, pct_start=0.1)
    for step in range(steps):
        loss, _ = m(batches[step % len(batches)], step)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
        opt.step()
        sched.step()
    # 3. decode held-out prompts: greedy chains of 4
    prompts = [line.strip() for line in DEV_PROMPTS.read_text().splitlines() if line.strip()][:3]
    shape = Shape("chain", k=4)
    eagle = chain_tau(stories, m.drafter, prompts, shape)
    early = chain_tau(stories, lambda: early_exit(stories, 2), prompts, shape)
    print(f"chain-4 tau: eagle3 {eagle:.2f}, early-exit:2 {early:.2f}")
    assert eagle > early + 0.2, (eagle, early)
