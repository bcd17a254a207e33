"""Frozen-target features: what the drafter losses read, computed once to disk (offline) or in the step (online).

`python -m train.features RECIPE.yaml [key=value ...]` builds the cache a recipe asks for, and nothing else
(`python -m train RECIPE.yaml` runs the same `build_cache` itself before training). Also under
`accelerate launch`: each process takes every world_size-th shard; rank 0 merges the index. The cache
lives in features.cache_dir, default DATA_HOME/features/<target>-<fingerprint digest> (train/data/identity.py):
  1. load the target; 2. prepare the data (train/data/pipeline.py: sources -> regeneration -> tokens +
     loss masks -> split);
  3. fingerprint (target config + weights + tokenizer, hidden ids, dtype, top-k, max length, the token
     data itself); an existing cache must match it — a mismatch is an error, never a silent reuse;
  4. run the target over this rank's missing shards (finished shards are skipped) and write them;
  5. rank 0 merges index.json and reports tokens/s and bytes per token.

Batch contract — what the training loop and drafter losses consume, identical in both modes. A
collated batch (train/dataset.py) is a dict:
  input_ids      [B, T] long
  attention_mask [B, T] long   0 = padding, k >= 1 = k-th sequence of the row (1 everywhere without
                               packing): `attention_mask > 0` marks real tokens; a token may attend to
                               earlier tokens with the same value
  position_ids   [B, T] long   position within its own sequence
  loss_mask      [B, T] bool   True where token t ITSELF is a trained (assistant / text) token; a loss
                               predicting token t+1 from position t uses loss_mask[:, 1:]; column 0 of
                               every sequence is False
  hidden         {id: [B, T, D] float32}  target hidden state at position t for each requested id
                               (DESIGN §3: 0 = embeddings, i = output of layer i, L = post-final-norm)
  topk_ids       [B, T, k] long, topk_probs [B, T, k] float32 (only when features.topk > 0): the
                               target's next-token distribution at position t (softmax of its logits
                               at t, i.e. over token t+1), its k most likely tokens
  argmax         [B, T] long   the target's most likely next token at position t over its whole vocabulary
                               (from its own full-precision logits; caches built before it lack it, and
                               the losses then score it from hidden[L] themselves)
  logz           [B, T] float32  logsumexp of the target's logits from hidden[L] as stored (rounded to the cache's
                               dtype): a loss that needs the target's own probabilities of a draft vocabulary's
                               tokens reads only their rows of the head (lk.overlap_rows; without it, one pass of
                               the whole head; caches built before 2026-12-07 lack it)
Padded positions hold zeros. `compute_features` produces hidden/topk for both the offline extractor
and online mode (`OnlineFeatures`), so the two cannot drift.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import datasets
import torch
from torch import Tensor
from tqdm import tqdm

from decode.loading import local_config
from decode.passes import forward_batch
from decode.precision import bf16_reason, resolve_dtype
from decode.target import Target
from train.batch import collate
from train.cache import STORAGE_DTYPES, CacheError, FeatureCache, check_existing, shard_name, write_index, write_shard
from train.cache_key import feature_cache_dir, fingerprint
from train.config import FeaturesConfig, Recipe, dump_config, load_recipe, with_feature_ids
from train.data.fetch import prepare
from train.data.home import use
from train.data.identity import digest
from train.data.pipeline import Dist, PreparedData, prepare_data
from train.data.regen import drop_strays, write_text_atomically

# --- the one feature function -------------------------------------------------------------------


@torch.no_grad()
def compute_features(
    target: Target,
    input_ids: Tensor,
    attention_mask: Tensor,
    hidden_ids: list[int] | tuple[int, ...],
    topk: int = 0,
    position_ids: Tensor | None = None,
    chunk: int = 2048,
    stored: torch.dtype | None = None,
) -> dict[str, Any]:
    """Target features for a batch: {"hidden": {id: [B, T, D] f32}, "argmax": [B, T] long, "logz": [B, T] f32}
    (+ "topk_ids"/"topk_probs" [B, T, k]).

    input_ids/attention_mask [B, T] as in the batch contract; padded positions come back as zeros.
    The LM head runs over `chunk` positions at a time so a 152k vocabulary never needs [B, T, V] at once.
    The argmax is stored because every drafter loss needs it on every step: scoring it from the cached
    post-norm state costs a full-vocabulary LM head per row per epoch (0.9 of the 6.8 s of a chat EAGLE-3
    forward + backward in fp32, scripts/bench_train_step.py). `stored`: the dtype the cache keeps hidden[L] in;
    a lower precision than the target's costs one more head pass here, for a logz that matches the stored state.
    """
    ids = tuple(sorted(set(hidden_ids)))
    last, hidden = forward_batch(target, input_ids, attention_mask, ids, position_ids)  # [B, T, D]
    real = (attention_mask.to(last.device) > 0)[..., None]  # [B, T, 1]
    out: dict[str, Any] = {"hidden": {i: torch.where(real, h.float(), 0.0) for i, h in hidden.items()}}
    b, t = input_ids.shape
    flat = last.reshape(-1, last.shape[-1])
    argmax, logz, tops = [], [], []
    post = hidden.get(target.num_layers)  # the post-norm state the cache stores, which losses score
    rounded = post is not None and stored is not None and torch.finfo(stored).bits < torch.finfo(post.dtype).bits
    post = post.reshape(-1, post.shape[-1]) if rounded else None
    for a in range(0, flat.shape[0], chunk):
        logits = target.head(flat[a : a + chunk]).float()
        argmax.append(logits.argmax(-1))
        # logz normalises the logits a loss computes from the stored (rounded) state: from those, not the
        # full-precision ones (their logsumexp differs by ~1e-2 in bf16, which would scale every P by as much)
        z = target.lm_head(post[a : a + chunk].to(stored).to(post.dtype)).float() if rounded else logits
        logz.append(z.logsumexp(-1))
        if topk:
            tops.append(torch.softmax(logits, -1).topk(topk, -1))
    out["argmax"] = torch.where(real[..., 0], torch.cat(argmax).view(b, t), 0)
    out["logz"] = torch.where(real[..., 0], torch.cat(logz).view(b, t), 0.0)
    if topk:
        out["topk_probs"] = torch.where(real, torch.cat([x.values for x in tops]).view(b, t, topk), 0.0)
        out["topk_ids"] = torch.where(real, torch.cat([x.indices for x in tops]).view(b, t, topk), 0)
    return out


class OnlineFeatures:
    """Online mode: called on each token batch inside the training step; returns the full batch contract."""

    def __init__(self, target: Target, hidden_ids: list[int], topk: int = 0) -> None:
        target.check_hidden_ids(hidden_ids)
        self.target, self.hidden_ids, self.topk = target, list(hidden_ids), topk

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        feats = compute_features(
            self.target,
            batch["input_ids"],
            batch["attention_mask"],
            self.hidden_ids,
            self.topk,
            batch.get("position_ids"),
        )
        return {**batch, **feats}


# --- precision and fingerprint -----------------------------------------------------------------


def load_target(recipe: Recipe, device: str | torch.device = "cpu") -> Target:
    """The frozen target in features.target_dtype (`auto`: decode.precision.resolve_dtype)."""
    fc = recipe.features
    return Target.load(recipe.target, dtype=fc.target_dtype, attn=fc.attn, device=str(device))


def resolve_precision(recipe: Recipe, device: str | torch.device = "cpu") -> tuple[Recipe, str]:
    """The recipe with its `auto` precisions made concrete for `device` and the target (the frozen target's
    dtype, the drafter's autocast: both bf16 where decode.precision.resolve_dtype picks it), and the one line
    that says what was chosen and why."""
    config = local_config(recipe.target)
    why = bf16_reason(device, config)
    auto_bf16 = resolve_dtype("auto", device, config) == "bfloat16"
    dtype, mp = recipe.features.target_dtype, recipe.train.mixed_precision
    why_t, why_m = why if dtype == "auto" else "requested", why if mp == "auto" else "requested"
    dtype = resolve_dtype(dtype, device, config)
    mp = ("bf16" if auto_bf16 else "no") if mp == "auto" else mp
    short_t = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(dtype, dtype)
    short_m = "bf16" if mp == "bf16" else "fp32"
    if (short_t, why_t) == (short_m, why_m):
        line = f"precision: {short_t} ({why_t})"
    else:
        line = f"precision: target {short_t} ({why_t}), drafter {short_m} ({why_m})"
    recipe = dataclasses.replace(
        recipe,
        features=dataclasses.replace(recipe.features, target_dtype=dtype),
        train=dataclasses.replace(recipe.train, mixed_precision=mp),
    )
    return recipe, line


# --- offline extraction -------------------------------------------------------------------------


def extract_shard(target: Target, rows: datasets.Dataset, fc: FeaturesConfig) -> list[dict[str, Tensor]]:
    """Features for the sequences of one shard (batched by length to limit padding), on the CPU."""
    items = [
        {
            "input_ids": torch.tensor(r["input_ids"], dtype=torch.long),
            "loss_mask": torch.tensor(r["loss_mask"], dtype=torch.bool),
        }
        for r in rows
    ]
    order = sorted(range(len(items)), key=lambda j: items[j]["input_ids"].numel())
    out: list[dict[str, Tensor]] = [{} for _ in items]
    for a in range(0, len(order), fc.batch_size):
        idx = order[a : a + fc.batch_size]
        batch = collate([items[j] for j in idx])
        feats = compute_features(
            target, batch["input_ids"], batch["attention_mask"], fc.hidden_ids, fc.topk, stored=STORAGE_DTYPES[fc.dtype]
        )
        for r, j in enumerate(idx):
            n = items[j]["input_ids"].numel()
            seq = dict(items[j])
            for h, x in feats["hidden"].items():
                seq[f"hidden.{h}"] = x[r, :n].cpu()
            seq["argmax"], seq["logz"] = feats["argmax"][r, :n].cpu(), feats["logz"][r, :n].cpu()
            if fc.topk:
                seq["topk_ids"], seq["topk_probs"] = feats["topk_ids"][r, :n].cpu(), feats["topk_probs"][r, :n].cpu()
            out[j] = seq
    return out


def extract(
    recipe: Recipe,
    target: Target | None = None,
    dist: Dist | None = None,
    device: str | torch.device = "cpu",
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Build (or finish, or confirm) the feature cache of `recipe`; returns its index."""
    dist = dist or Dist()
    target = target or load_target(recipe, device)
    recipe = with_feature_ids(recipe, target.num_layers)  # empty hidden_ids: what the recipe's drafter needs
    target.check_hidden_ids(recipe.features.hidden_ids)
    return build_cache(recipe, target, prepare_data(recipe, target, dist, log), dist, log).index


def build_cache(
    recipe: Recipe, target: Target, data: PreparedData, dist: Dist | None = None, log: Callable[[str], None] = print
) -> FeatureCache:
    """The feature cache of `recipe` over `data` (hidden_ids already filled): reused when complete, finished
    when a killed run left some shards, an error when the directory holds features of something else."""
    dist = dist or Dist()
    fc = recipe.features
    seqs = datasets.concatenate_datasets([data.train, data.eval])
    fp = fingerprint(recipe, target, data)
    cache_dir = feature_cache_dir(recipe, target, fp)
    # 1. refuse a cache built from something else (rank 0 first, then everyone reads the verdict).
    finished_before: set[str] = set()
    if dist.rank == 0:
        cache_dir.mkdir(parents=True, exist_ok=True)
        drop_strays(cache_dir, "features")  # half-written by a killed run: never readable
        check_existing(cache_dir, fp)
        use(cache_dir, recipe.target)  # `draftsmith data ls` shows the last use; `data rm` spares it meanwhile
        finished_before = {p.name for p in cache_dir.glob("shard_*.safetensors")}
        if not check_existing(cache_dir, fp):  # a complete cache is reused untouched
            dump_config(recipe, cache_dir / "recipe.yaml")  # the resolved recipe, for humans
    dist.barrier()
    if check_existing(cache_dir, fp):
        if dist.rank == 0:
            log(f"[features] {cache_dir} is up to date ({len(seqs)} sequences): reusing it; nothing to extract")
        return FeatureCache.open(cache_dir, fp)
    # 2. this rank's missing shards.
    n_shards = math.ceil(len(seqs) / fc.shard_size)
    if dist.rank == 0 and finished_before:
        log(f"[features] {cache_dir}: {len(finished_before)}/{n_shards} shards done, extracting the rest")
    mine = [s for s in range(n_shards) if s % dist.world == dist.rank and not (cache_dir / shard_name(s)).exists()]
    t0 = time.perf_counter()
    total = sum(min(len(seqs), (s + 1) * fc.shard_size) - s * fc.shard_size for s in mine)
    with tqdm(total=total, desc=f"features [rank {dist.rank}/{dist.world}]", unit="seq", disable=dist.rank != 0) as bar:
        for s in mine:
            a, b = s * fc.shard_size, min(len(seqs), (s + 1) * fc.shard_size)
            rows = extract_shard(target, seqs.select(range(a, b)), fc)
            meta = {"fingerprint": digest(fp), "shard": s, "seq_start": a, "seq_end": b}
            write_shard(cache_dir / shard_name(s), rows, meta, fc.dtype)
            bar.update(b - a)
    dist.barrier()
    elapsed = time.perf_counter() - t0
    # 3. rank 0 merges the index once every rank is done.
    if dist.rank == 0:
        extra = {
            "num_sequences": len(seqs),
            "n_train": len(data.train),
            "n_eval": len(data.eval),
            "hidden_ids": fp["hidden_ids"],
            "hidden_size": target.hidden_size,
            "dtype": fc.dtype,
            "topk": fc.topk,
            "shard_size": fc.shard_size,
            "token_stats": dataclasses.asdict(data.stats),
        }
        index = write_index(cache_dir, fp, n_shards, extra)
        new_tokens = sum(sh["tokens"] for sh in index["shards"] if sh["file"] not in finished_before)
        stats = {
            "processes": dist.world,
            "extract_s": elapsed,
            "tokens_extracted": new_tokens,
            "tokens_per_s": new_tokens / max(elapsed, 1e-9),
            "bytes_per_token": index["bytes_per_token"],
            "tokens": index["tokens"],
            "bytes": index["bytes"],
        }
        write_text_atomically(cache_dir / "extract_stats.json", json.dumps(stats, indent=1))
        log(
            f"[features] {len(seqs)} sequences ({len(data.train)} train / {len(data.eval)} eval), {index['tokens']} "
            f"tokens in {n_shards} shards at {cache_dir}"
        )
        log(
            f"[features] extracted {new_tokens} tokens in {elapsed:.2f} s = {stats['tokens_per_s']:.0f} tok/s on "
            f"{dist.world} process(es); {index['bytes_per_token']:.1f} bytes/token ({fc.dtype}, ids {fp['hidden_ids']}, "
            f"topk {fc.topk}), {index['bytes'] / 1e6:.2f} MB"
        )
    dist.barrier()
    return FeatureCache.open(cache_dir, fp)


# --- command line -------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m train.features", description=__doc__.splitlines()[0])
    ap.add_argument("recipe", help="recipe YAML")
    ap.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. features.dtype=fp32")
    args = ap.parse_args(argv)
    try:
        return run(load_recipe(args.recipe, args.overrides))
    except (ValueError, FileNotFoundError, CacheError) as e:  # bad input: the message says what to do
        print(f"error: {e}", file=sys.stderr)
        return 2


def run(recipe: Recipe) -> int:
    from accelerate import PartialState

    # PartialState only forms CPU ranks when told to run on the CPU (as Accelerator does from this variable).
    cpu = os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes") or not torch.cuda.is_available()
    state = PartialState(cpu=cpu)
    dist = Dist(state.process_index, state.num_processes, state.wait_for_everyone)
    with state.main_process_first():  # a fetchable target or `fetch:` data source is fetched once, on first use
        recipe = prepare(recipe)
    torch.manual_seed(recipe.seed)
    if recipe.train.threads:  # the recipe's CPU thread count applies to extraction too
        torch.set_num_threads(recipe.train.threads)
    recipe, line = resolve_precision(recipe, state.device)
    if state.is_main_process:
        print(line, flush=True)
    if recipe.features.mode == "online":
        print(
            "[features] features.mode=online: the target runs inside each training step; nothing to extract "
            "(data preparation still checked)",
            file=sys.stderr,
        )
        prepare_data(recipe, load_target(recipe, state.device), dist)
        return 0
    extract(recipe, dist=dist, device=state.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
