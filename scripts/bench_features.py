"""Benchmark the data pipeline on the bundled target, measured in one run, and project a Qwen3-14B cache.

  python scripts/bench_features.py [--stories 1024] [--max-new-tokens 128] [--out runs/bench_features]

1. regeneration: stories sampled from BOS by the target itself (1 process), stories/s and tokens/s;
2. extraction through the real CLI (`python -m train.features`, and `accelerate launch` with two CPU
   ranks as in DESIGN §7): tokens/s of the extraction phase and wall time of the whole command;
3. bytes/token of the written cache per storage dtype, with and without top-k;
4. projection: an EAGLE-3 feature cache for Qwen3-14B (3 capture layers x hidden + what the loss needs)
   over 68k ShareGPT conversations of ~1k tokens, next to online mode (stores nothing, pays a target
   forward per sequence per epoch). Sizes come from recipes/data/qwen3-14b-config.json and the same
   `bytes_per_token` layout function the writer uses; the FLOP count is 2 x parameters x tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
for k, v in {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "WANDB_MODE": "offline",
}.items():
    os.environ.setdefault(k, v)

import torch  # noqa: E402

from train.cache import STORAGE_DTYPES, bytes_per_token  # noqa: E402
from train.config import load_recipe  # noqa: E402
from train.data.regen import regenerate  # noqa: E402
from train.features import extract, load_target  # noqa: E402

RECIPE = """target: recipes/targets/stories260K
data:
  max_length: 256
  held_out: 0.05
  regenerate: {{enabled: true, num_samples: {n}, max_new_tokens: {m}, batch_size: 64, shard_size: 256, stop_ids: [1]}}
features: {{hidden_ids: [2, 3, 5], dtype: bf16, topk: 0, shard_size: 128, batch_size: 16}}
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cli(recipe: Path, cache: Path, procs: int, threads: int, overrides: list[str]) -> dict:
    """One extraction through the command line; returns its extract_stats.json plus the command's wall time."""
    shutil.rmtree(cache, ignore_errors=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(REPO)}
    args = ["-m", "train.features", str(recipe), *overrides, f"features.cache_dir={cache}"]
    if procs == 1:
        cmd = [sys.executable, *args]
    else:
        env["ACCELERATE_USE_CPU"] = "true"
        cmd = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--multi_gpu",
            "--num_processes",
            str(procs),
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            "--main_process_port",
            str(free_port()),
            *args,
        ]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if res.returncode:
        sys.exit(f"extraction failed ({' '.join(cmd)}):\n{res.stderr[-3000:]}")
    return {**json.loads((cache / "extract_stats.json").read_text()), "wall_s": wall}


def qwen3_projection(conversations: int, tokens_each: int) -> list[tuple[str, str, str]]:
    """Rows (layout, bytes/token, total) for a Qwen3-14B EAGLE-3 cache, plus the online row."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(REPO / "recipes" / "data" / "qwen3-14b-config.json")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    params = sum(p.numel() for p in model.parameters())
    h, L, v = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size
    n = conversations * tokens_each
    caps = f"(2, {L // 2}, {L - 3})"
    rows = []
    for dtype in ("bf16", "fp32"):
        el = torch.finfo(STORAGE_DTYPES[dtype]).bits // 8
        for what, bpt in [
            (
                f"3 capture ids {caps} + final state {L} (target logits via the frozen lm_head)",
                bytes_per_token(h, 4, dtype, 0),
            ),
            (f"3 capture ids {caps} + top-20 target probs", bytes_per_token(h, 3, dtype, 20)),
            (f"3 capture ids {caps} + full target distribution (V={v})", bytes_per_token(h, 3, dtype, 0) + v * el),
        ]:
            rows.append((f"{dtype}: {what}", f"{bpt:,}", f"{bpt * n / 1e12:,.2f} TB"))
    flops = 2 * params * n
    rows.append(
        (
            "online: nothing stored; one extra frozen-target forward per sequence per epoch",
            "0",
            f"{flops:.2e} FLOP/epoch ({params / 1e9:.2f}B params x 2 x {n / 1e6:.0f}M tokens); "
            f"target resident: {params * 2 / 1e9:.1f} GB bf16",
        )
    )
    return rows


def table(title: str, header: tuple[str, ...], rows: list[tuple]) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    print(f"\n## {title}")
    print(" | ".join(str(x).ljust(w) for x, w in zip(header, widths)))
    print("-|-".join("-" * w for w in widths))
    for r in rows:
        print(" | ".join(str(x).ljust(w) for x, w in zip(r, widths)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stories", type=int, default=1024, help="stories to regenerate from BOS")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", default="runs/bench_features")
    ap.add_argument("--threads", type=int, default=1, help="torch threads for the in-process regeneration")
    ap.add_argument(
        "--cli",
        nargs="*",
        default=["1x1", "1x2", "2x1"],
        metavar="PxT",
        help="CLI extractions to time: P processes x T threads each (none: skip section 2)",
    )
    args = ap.parse_args()
    out = REPO / args.out
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    torch.set_num_threads(args.threads)
    print(
        f"machine: {os.cpu_count()} cores, load average at start {os.getloadavg()[0]:.2f} (other jobs share the CPUs)"
    )

    # 1. regeneration, in process
    recipe_path = out / "bench.yaml"
    recipe_path.write_text(RECIPE.format(n=args.stories, m=args.max_new_tokens))
    common = [f"run_dir={out}"]
    recipe = load_recipe(recipe_path, common)
    target = load_target(recipe)
    t0 = time.perf_counter()
    regen_dir = regenerate(target, None, recipe.data.regenerate, recipe.seed, True, None)
    regen_s = time.perf_counter() - t0
    stories = [json.loads(x) for p in sorted(regen_dir.glob("shard_*.jsonl")) for x in p.read_text().splitlines()]
    gen_tokens = sum(sum(r["loss_mask"]) for r in stories)
    ended = sum(r["input_ids"][-1] in (1, 2) for r in stories)
    table(
        "regeneration (stories260K from BOS, temperature 1.0, batch 64, 1 process)",
        (
            "stories",
            "threads",
            "new tokens",
            "mean tokens/story",
            "ended by stop token",
            "seconds",
            "stories/s",
            "tokens/s",
        ),
        [
            (
                len(stories),
                args.threads,
                gen_tokens,
                f"{gen_tokens / len(stories):.1f}",
                ended,
                f"{regen_s:.1f}",
                f"{len(stories) / regen_s:.1f}",
                f"{gen_tokens / regen_s:,.0f}",
            )
        ],
    )

    # 2. extraction through the CLI
    rows = []
    for procs, threads in (map(int, x.split("x")) for x in args.cli):
        st = run_cli(recipe_path, out / f"cache_{procs}p{threads}t", procs, threads, common)
        rows.append(
            (
                procs,
                threads,
                st["tokens"],
                f"{st['extract_s']:.2f}",
                f"{st['tokens_per_s']:,.0f}",
                f"{st['wall_s']:.1f}",
                f"{st['bytes_per_token']:.1f}",
            )
        )
    if rows:
        table(
            "feature extraction (ids [2, 3, 5], bf16, no top-k, batch 16), python -m train.features",
            ("processes", "threads each", "tokens", "extract s", "extract tok/s", "command wall s", "bytes/token"),
            rows,
        )

    # 3. bytes/token per storage dtype (in process, same data)
    rows = []
    for dtype in ("fp32", "bf16", "fp16"):
        for k in (0, 8):
            cache = out / f"dtype_{dtype}_k{k}"
            r = load_recipe(
                recipe_path, common + [f"features.cache_dir={cache}", f"features.dtype={dtype}", f"features.topk={k}"]
            )
            index = extract(r, target=target, log=lambda s: None)
            rows.append(
                (
                    dtype,
                    k,
                    index["tokens"],
                    f"{index['bytes_per_token']:.1f}",
                    bytes_per_token(target.hidden_size, 3, dtype, k),
                )
            )
    table(
        "bytes per token on the bundled target (D=64, ids [2, 3, 5])",
        ("dtype", "topk", "tokens", "measured bytes/token (files)", "layout bytes/token"),
        rows,
    )

    # 4. the Qwen3-14B projection
    table(
        "projected EAGLE-3 feature cache for Qwen3-14B, 68k ShareGPT conversations x ~1k tokens (68M tokens)",
        ("layout", "bytes/token", "total"),
        qwen3_projection(68_000, 1_000),
    )
    print(f"\nload average at end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
