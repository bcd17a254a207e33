"""A recipe's token data, ready for features and training: sources -> (regeneration) -> tokens + loss
masks -> a seeded train/eval split, the same on every rank.

Both modes start here (`python -m train`, `python -m train.features`): offline, train/features.py then
runs the target over these sequences into the feature cache; online, the loaders read them directly.
Under `accelerate launch`, rank 0 builds each `datasets` cache first and the others read it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import datasets

from decode.target import Target
from train.config import Recipe
from train.data.regen import regenerate
from train.data.sources import load_records
from train.data.tokens import TokenStats, end_token_ids, split_held_out, tokenize_dataset


@dataclass
class Dist:
    """This process's place in a (possibly single-process) run."""

    rank: int = 0
    world: int = 1
    barrier: Callable[[], None] = lambda: None


@dataclass
class PreparedData:
    """Token sequences ({input_ids, loss_mask} rows) split into train and eval, with the counts."""

    train: datasets.Dataset
    eval: datasets.Dataset
    stats: TokenStats


def prepare_data(
    recipe: Recipe, target: Target, dist: Dist | None = None, log: Callable[[str], None] = print
) -> PreparedData:
    """Sources -> (regeneration) -> tokens + loss masks -> seeded train/eval split (same on every rank)."""
    dist = dist or Dist()
    cfg = recipe.data
    tok = target.tokenizer
    if tok is None:
        raise ValueError(f"{recipe.target}: no tokenizer found next to the model; the data pipeline needs one")
    if not cfg.sources and not cfg.regenerate.enabled:
        raise ValueError(
            "data.source is empty: give a data file/directory/hub name, or set "
            "data.regenerate.enabled=true with data.regenerate.num_samples to sample from the start token"
        )
    records = _rank0_first(dist, lambda: load_records(cfg))
    if cfg.regenerate.enabled:
        out = regenerate(
            target,
            records if cfg.sources else None,
            cfg.regenerate,
            recipe.seed,
            cfg.chat_template,
            cfg.enable_thinking,
            dist.rank,
            dist.world,
            dist.barrier,
        )
        regen_cfg = dataclasses.replace(cfg, source=str(out), format="auto", max_records=0, split="train")
        records = _rank0_first(dist, lambda: load_records(regen_cfg))
    end_ids = end_token_ids(tok, set(target.eos_ids) | set(cfg.regenerate.stop_ids))
    seqs, stats = tokenize_dataset(
        records, tok, cfg.max_length, cfg.overflow, end_ids, cfg.chat_template, cfg.enable_thinking
    )
    train, held = split_held_out(seqs, cfg.held_out, recipe.seed)
    if dist.rank == 0:
        for note in stats.notes:
            log(f"[data] note: {note}")
        log(f"[data] {stats.summary()}; split {len(train)} train / {len(held)} eval")
    return PreparedData(train, held, stats)


def _rank0_first(dist: Dist, fn: Callable[[], Any]) -> Any:
    """Rank 0 builds the `datasets` cache files first, the others then read them (no concurrent writes)."""
    if dist.rank == 0:
        out = fn()
        dist.barrier()
        return out
    dist.barrier()
    return fn()
