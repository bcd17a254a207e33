"""Regeneration's two engines: the contexts of one reply round in, the target's replies out (token ids,
each cut after its stop token). train/data/regen.py picks the engine and drives the rounds.

Both sample under the same settings and stop ids, our tokenizer rendering every context:
  - hf: HF `generate` on the target as loaded (bf16 where the hardware has it: features.target_dtype),
    batches of similar context length (`length_batches`); shard s runs under torch seed (seed, s), so a
    shard is bit-reproducible on the same machine, torch and thread count;
  - vllm: vLLM in its own python (drafters/serving/vllm_env.py: this environment's vLLM, or the CPU side venv),
    every context of a shard's reply round in one job, token ids in and out, `LLM(seed=...)` per shard
    and round (`round_seed`; vLLM's CPU build refuses per-request seeds). Same seed, same job, same
    vLLM build and threads: the same samples in our runs, but vLLM does not promise it (its scheduler
    batches requests dynamically), and its samples never equal the hf engine's.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from decode.errors import UserError
from decode.target import Target
from drafters.serving.vllm_env import run_worker
from train.data.sources import RegenConfig

VLLM_WORKER = Path(__file__).with_name("vllm_regen_worker.py")  # run by vLLM's python, never imported

# contexts of one reply round, the round's number -> one reply per context
SampleRound = Callable[[list[list[int]], int], list[list[int]]]


def cut_at_stop(row: list[int], stop: list[int] | set[int]) -> list[int]:
    """`row` up to and including its first stop token (all of it when none)."""
    end = next((j + 1 for j, t in enumerate(row) if t in stop), len(row))
    return row[:end]


# --- hf: HF generate on the target in this process ---------------------------------------------


@torch.no_grad()
def sample(
    target: Target, contexts: list[list[int]], cfg: RegenConfig, stop: list[int], pad_id: int
) -> list[list[int]]:
    """Left-padded batched sampling with HF generate; each result is cut after its first stop token."""
    width = max(map(len, contexts))
    ids = torch.full((len(contexts), width), pad_id, dtype=torch.long)
    att = torch.zeros_like(ids)
    for b, c in enumerate(contexts):
        ids[b, width - len(c) :] = torch.tensor(c)
        att[b, width - len(c) :] = 1
    room = target.max_positions - width
    if room < 1:
        raise ValueError(
            f"a regeneration context of {width} tokens leaves no room under the target's "
            f"{target.max_positions} positions; lower data.max_length or shorten the prompts"
        )
    greedy = cfg.temperature == 0
    knobs = {} if greedy else {"temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": cfg.top_k}
    out = target.model.generate(
        ids.to(target.device),
        attention_mask=att.to(target.device),
        do_sample=not greedy,
        max_new_tokens=min(cfg.max_new_tokens, room),
        eos_token_id=stop,
        pad_token_id=pad_id,
        max_length=None,
        **knobs,
    )
    return [cut_at_stop(row, stop) for row in out[:, width:].tolist()]


def length_batches(lengths: list[int], batch_size: int, max_ratio: float = 2.0, slack: int = 32) -> list[list[int]]:
    """Indices of `lengths` in batches of similar length: sorted, at most `batch_size` each, and a new batch
    once a context is longer than max_ratio x the batch's shortest + slack tokens — left padding a
    2,000-character prompt beside a 20-character one would make the short one pay for the long one."""
    batches: list[list[int]] = []
    for j in sorted(range(len(lengths)), key=lambda j: lengths[j]):
        cur = batches[-1] if batches else None
        if cur is None or len(cur) == batch_size or lengths[j] > max_ratio * lengths[cur[0]] + slack:
            batches.append([j])
        else:
            cur.append(j)
    return batches


def hf_rounds(target: Target, cfg: RegenConfig, stop: list[int], on_batch: Callable[[int, int], None]) -> SampleRound:
    """HF `generate` on length-bucketed batches (the caller seeds torch's RNG per shard)."""
    tok = target.tokenizer
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else stop[0]

    def run(contexts: list[list[int]], _round: int) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in contexts]
        for batch in length_batches(list(map(len, contexts)), cfg.batch_size):
            gens = sample(target, [contexts[j] for j in batch], cfg, stop, pad_id)
            on_batch(len(batch), sum(map(len, gens)))
            for j, gen in zip(batch, gens):
                out[j] = gen
        return out

    return run


# --- vllm: vLLM in its own python, one job file per round ---------------------------------------


def round_seed(seed: int, shard: int, round_: int) -> int:
    """The vLLM seed of one shard's reply round: fixed by (seed, shard, round), so a resumed run redoes a
    shard with the seeds it had."""
    return ((seed * 1_000_003 + shard) * 1_009 + round_) % (1 << 31)


def vllm_job(target: Target, contexts: list[list[int]], cfg: RegenConfig, stop: list[int], seed: int) -> dict:
    """The job file of train/data/vllm_regen_worker.py: these contexts under the hf path's settings, one seed."""
    room = [min(cfg.max_new_tokens, target.max_positions - len(c)) for c in contexts]
    if min(room) < 1:
        raise ValueError(
            f"a regeneration context of {max(map(len, contexts))} tokens leaves no room under the "
            f"target's {target.max_positions} positions; lower data.max_length or shorten the prompts"
        )
    model = Path(target.name_or_path)
    return {
        "target": str(model.resolve()) if model.exists() else str(model),
        "dtype": {torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(target.dtype, "float32"),
        "seed": seed,
        "prompts": contexts,
        "max_tokens": room,
        "max_model_len": min(target.max_positions, max(len(c) + n for c, n in zip(contexts, room))),
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "top_k": cfg.top_k,
        "stop_token_ids": stop,
    }


def vllm_replies(result: dict, stop: list[int]) -> list[list[int]]:
    """The worker's outputs as replies: each ends with the stop token that ended it (as on the hf path),
    whether vLLM kept that token in its output or not."""
    return [
        cut_at_stop(ids + ([why] if why in stop and (not ids or ids[-1] != why) else []), stop)
        for ids, why in zip(result["outputs"], result["stop_reasons"])
    ]


def worker_env() -> dict[str, str]:
    """The vLLM worker's threads = this process's torch threads (train.threads); 2 GiB of KV cache, the
    size the regeneration measurement used (issue 18: 64 prompts at once)."""
    return {"OMP_NUM_THREADS": str(torch.get_num_threads()), "VLLM_CPU_KVCACHE_SPACE": "2"}


def vllm_rounds(
    target: Target,
    py: Path,
    cfg: RegenConfig,
    stop: list[int],
    seed: int,
    shard: int,
    work: Path,
    on_batch: Callable[[int, int], None],
) -> SampleRound:
    """vLLM in its own python (drafters/serving/vllm_env.py): a round's contexts all go in one job, ids in and out."""

    def run(contexts: list[list[int]], round_: int) -> list[list[int]]:
        job = vllm_job(target, contexts, cfg, stop, round_seed(seed, shard, round_))
        try:
            result = run_worker(py, VLLM_WORKER, job, work, env=worker_env())
        except RuntimeError as e:  # the worker died: its last log line and the log's path say why
            raise UserError(f"{e}; data.regenerate.engine=hf regenerates without vLLM") from None
        gens = vllm_replies(result, stop)
        on_batch(len(contexts), sum(map(len, gens)))
        return gens

    return run
