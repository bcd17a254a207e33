"""Decoding-faithful simulated τ: the training eval runs the real decoder on held-out prompts.

The teacher-forced estimate (train/evaluation.py `simulated_tau`: 1 + sum_k prod_j acc_j over per-position
accuracies on the training data) scores the drafter on temperature-1 sequences, while decoding
emits the target's greedy continuation of a prompt, so it overestimated the decoded τ (issue 14).
This eval measures what `decode.evaluate` measures, with the same code:

1. prompts (`prompt_set`): a prompt file (`train.sim_prompts`, any format decode.harness.evaluate reads; the
   first turn of each conversation, rendered exactly as decode.harness.evaluate renders it), or prefixes of
   held-out sequences: everything before the first trained token (a chat's prompt), or the first
   `train.sim_prompt_len` tokens when only the start token precedes it (stories, plain text);
2. the eval set (`load_or_build`): each prompt with the target's greedy continuation (AR decoding,
   `sim_max_new_tokens`), built once per run and cached in RUN_DIR/sim_eval.json under a hash of the
   prompts, the target and the length, so resumed runs and periodic evals reuse it;
3. `decoding_tau`: `decode.generate.generate` with the in-training drafter's decode-time object
   (`module.drafter()`: EAGLE drafts from its own states after the first step, Medusa from its heads,
   LayerSkip from its exit) as a chain of `sim_chain` and as the tree `sim_tree`, greedy. τ is
   tokens / target passes over all prompts (prefill included), exactly decode.harness.evaluate's
   `mean_accepted_tokens`; `matches_ar` is the fraction of decodes equal to the cached greedy
   continuation (lossless decoding: 1.0 up to float ties).

Running the decoder costs one target pass per round, which for the periodic eval is kept small
(`sim_periodic_prompts`); the final eval decodes `sim_eval_prompts`. Every rank decodes the same
prompts (no collective inside a decode; ranks stay in lockstep under sharded drafters).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from decode.generate import encode_prompt, generate
from decode.metrics import GenStats
from decode.sampling import SamplingConfig
from decode.target import Target
from decode.tree import parse_shape

CACHE_NAME = "sim_eval.json"


# --- 1. prompts --------------------------------------------------------------------------------


def prefix_prompt(ids: torch.Tensor, loss_mask: torch.Tensor, prompt_len: int) -> list[int] | None:
    """The prompt part of one held-out sequence [T]: the tokens before its first trained one, or its first
    `prompt_len` tokens when only the start token precedes it. None when nothing would be left to continue."""
    trained = torch.nonzero(loss_mask.bool()).view(-1)
    cut = int(trained[0]) if trained.numel() else ids.numel()
    if cut <= 1:
        cut = prompt_len
    return ids[:cut].tolist() if 1 <= cut < ids.numel() else None


def held_out_prompts(ds: Sequence[dict[str, Any]], n: int, prompt_len: int, room: int) -> list[list[int]]:
    """The first n usable prompts of the held-out split (packed rows: their first sequence); a prompt
    longer than `room` tokens is skipped (prompt + continuation must fit the target's positions)."""
    out: list[list[int]] = []
    for i in range(len(ds)):
        if len(out) >= n:
            break
        item = ds[i]
        ids, mask = item["input_ids"], item["loss_mask"]
        if "segments" in item:
            first = item["segments"] == 1
            ids, mask = ids[first], mask[first]
        p = prefix_prompt(ids, mask, prompt_len)
        if p is not None and len(p) <= room:
            out.append(p)
    return out


def file_prompts(target: Target, path: str, n: int) -> list[list[int]]:
    """The first turn of the first n conversations of a prompt file, tokenized as decode.harness.evaluate does."""
    from decode.harness.prompts import load_prompts, render_turn

    out = []
    for conv in load_prompts(path, n):
        text, special = render_turn(target.tokenizer, conv.turns, [])
        out.append(encode_prompt(target, text, special).tolist())
    return out


def prompt_set(cfg, target: Target, eval_ds) -> list[list[int]]:
    """The run's sim-eval prompts (token ids) from `train.sim_prompts` or the held-out split; [] = off."""
    if cfg.sim_eval_prompts <= 0:
        return []
    room = target.max_positions - cfg.sim_max_new_tokens
    if room < 1:
        raise ValueError(
            f"train.sim_max_new_tokens={cfg.sim_max_new_tokens} leaves no room for a prompt in "
            f"the target's {target.max_positions} positions; lower it"
        )
    if cfg.sim_prompts:
        prompts = file_prompts(target, cfg.sim_prompts, cfg.sim_eval_prompts)
        long = [len(p) for p in prompts if len(p) > room]
        if long:
            raise ValueError(
                f"train.sim_prompts: a prompt of {max(long)} tokens + sim_max_new_tokens exceeds the "
                f"target's {target.max_positions} positions; shorten it or lower sim_max_new_tokens"
            )
        return prompts
    return held_out_prompts(eval_ds, cfg.sim_eval_prompts, cfg.sim_prompt_len, room)


# --- 2. the eval set: prompts + the target's greedy continuations, cached ---------------------


def set_key(prompts: list[list[int]], target: Target, max_new_tokens: int) -> str:
    """What the cached continuations depend on: the prompts, the target and the length."""
    blob = json.dumps(
        {
            "prompts": prompts,
            "target": str(target.name_or_path),
            "vocab": target.vocab_size,
            "layers": target.num_layers,
            "max_new_tokens": max_new_tokens,
        }
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def greedy_continuations(target: Target, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """The target's own greedy continuation of each prompt (AR decoding: the decoder's reference)."""
    from drafters.sources.ar import ARDrafter

    return [generate(target, ARDrafter(), torch.tensor(p), max_new_tokens).tokens for p in prompts]


def load_or_build(
    path: Path, target: Target, prompts: list[list[int]], max_new_tokens: int, write: bool = True
) -> list[dict[str, list[int]]]:
    """[{prompt, greedy}] from `path` when its key matches, else built (and written atomically if `write`)."""
    key = set_key(prompts, target, max_new_tokens)
    if path.is_file():
        try:
            cached = json.loads(path.read_text())
        except json.JSONDecodeError:
            cached = {}
        if cached.get("key") == key:
            return cached["items"]
    items = [{"prompt": p, "greedy": g} for p, g in zip(prompts, greedy_continuations(target, prompts, max_new_tokens))]
    if write:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps({"key": key, "max_new_tokens": max_new_tokens, "items": items}))
        os.replace(tmp, path)
    return items


# --- 3. decoding with the in-training drafter ----------------------------------------------------


def decoding_tau(
    module: nn.Module, target: Target, items: list[dict[str, list[int]]], tree: str, draft_len: int, max_new_tokens: int
) -> tuple[GenStats, float]:
    """(merged GenStats, fraction equal to the greedy reference) of greedy decoding every item's prompt
    with the module's decode-time drafter shaped `tree` (chain | static:FILE | dynamic:...)."""
    shape = parse_shape(tree, draft_len)
    total, same = GenStats(), 0
    for it in items:
        gen = generate(target, module.drafter(), torch.tensor(it["prompt"]), max_new_tokens, SamplingConfig(), shape)
        total = total.merge(gen.stats)
        same += gen.tokens == it["greedy"]
    return total, same / max(1, len(items))


@torch.no_grad()
def sim_eval(module: nn.Module, target: Target, items: list[dict[str, list[int]]], cfg) -> dict[str, Any]:
    """Decoding-faithful τ of a chain (sim_chain) and a tree (sim_tree) over `items` -> eval/ metrics."""
    if not items:
        return {}
    was = module.training
    t0 = time.perf_counter()
    chain, chain_same = decoding_tau(module, target, items, "chain", cfg.sim_chain, cfg.sim_max_new_tokens)
    tree, tree_same = decoding_tau(module, target, items, cfg.sim_tree, cfg.sim_chain, cfg.sim_max_new_tokens)
    module.train(was)  # module.drafter() switches the module to eval mode
    return {
        "eval/sim_tau_chain": chain.tau,
        "eval/sim_tau_tree": tree.tau,
        "eval/sim_prompts": len(items),
        "eval/sim_accept_by_depth_chain": chain.acceptance_by_depth,
        "eval/sim_matches_ar": (chain_same + tree_same) / 2,
        "eval/sim_s": time.perf_counter() - t0,
    }
