"""Every stage of the training pipeline against this machine's arithmetic peak, measured in one run.

    python scripts/bench_pipeline.py [--target DIR] [--threads 1] [--out runs/bench_pipeline.json]
    python scripts/bench_pipeline.py --target recipes/targets/stories260K --seqs 2 --seq-len 16 ...  # smoke size

1. peak: a square GEMM (`--gemm-sizes`, best of them) in fp32 and bf16 — the machine's GFLOP/s per dtype;
2. regeneration (the recipes' sampling: temperature 0.7, top-p 0.95): `--regen-prompts` contexts (MT-bench
   questions through the chat template; a target without one: stories from its start token) answered with
   <= `--max-new-tokens` each by hf in fp32 and in bf16 (train/data/regen_engines.py's length-bucketed batches), and by
   vLLM (drafters/serving/vllm_env.py) when this environment or the side venv has it and it takes the target;
   vLLM's tok/s is timed inside the worker (its `generate`), its start-up reported apart;
3. features: the frozen target over `--seqs` x `--seq-len` token rows (train/features.py
   `compute_features`, the hidden ids the four drafters need, no top-k), fp32 and bf16 target;
4. training: one optimizer step (forward, backward, AdamW) of each drafter kind on those features, with
   the drafter settings of `--recipes DIR` (default: the target's recipe folder), fp32 and bf16
   autocast (fp32 master weights, as train/loop.py runs it); median of `--steps` timed steps.

Tokens/s counts processed tokens: regeneration the new tokens, features and training every row token.
FLOPs — stated, not guessed: regeneration 2 x P x (prompt + new tokens), P = the target's parameters
without the input embedding (one multiply-add per weight per token; attention's own FLOPs left out, so
the fraction is a lower bound); features and training are counted by torch's FlopCounterMode over one
untimed run of exactly the timed work (matmuls, attention, forward and backward: for a trainable
weight ~6 FLOPs per weight per token, for a frozen layer the gradient flows through ~4, for a frozen
forward-only one 2). Fraction of peak = achieved FLOP/s / the peak of the stage's compute dtype.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from decode.harness.prompts import load_prompts  # noqa: E402
from decode.precision import has_bf16  # noqa: E402
from decode.target import Target  # noqa: E402
from drafters.serving.checkpoint import drafter_kinds  # noqa: E402
from drafters.serving.vllm_env import cpu_head_dim_ok, find_engine_python, run_worker, vllm_in_this_env  # noqa: E402
from train.config import load_recipe  # noqa: E402
from train.data.regen import start_prefix  # noqa: E402
from train.data.regen_engines import VLLM_WORKER, hf_rounds, vllm_job, vllm_replies, worker_env  # noqa: E402
from train.data.sources import RegenConfig  # noqa: E402
from train.data.tokens import has_template, render  # noqa: E402
from train.features import compute_features  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
KINDS = ["eagle1", "eagle3", "medusa", "layerskip"]
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
DTYPES_T = {"fp32": torch.float32, "bf16": torch.bfloat16}


# --- 1. peak --------------------------------------------------------------------------------------------


def gemm_peak(sizes: list[int], dtype: torch.dtype, seconds: float = 0.5) -> float:
    """Best GFLOP/s of an n x n x n GEMM over `sizes` (2 n^3 FLOPs a product), each timed for ~`seconds`."""
    best = 0.0
    for n in sizes:
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        a @ b  # warm-up (and the backend's first-call set-up)
        reps, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds or reps < 3:
            a @ b
            reps += 1
        best = max(best, 2 * n**3 * reps / (time.perf_counter() - t0) / 1e9)
    return best


# --- 2. regeneration ------------------------------------------------------------------------------------


def contexts_for(target: Target, n: int) -> list[list[int]]:
    """What regeneration feeds the target: MT-bench first turns through the chat template, or the start token."""
    tok = target.tokenizer
    if not has_template(tok):
        return [start_prefix(tok) for _ in range(n)]
    convs = load_prompts(str(REPO / "recipes/data/mt_bench_question.jsonl"), None)
    turns = [c.turns[0] for c in convs][:n]
    return [
        list(tok(render(tok, [{"role": "user", "content": t}], True, {}), add_special_tokens=False)["input_ids"])
        for t in turns
    ]


def non_embedding_params(target: Target) -> int:
    return (
        sum(p.numel() for p in target.model.parameters())
        - target.embed_tokens.weight.numel()
        + (target.lm_head.weight.numel() if target.lm_head.weight is target.embed_tokens.weight else 0)
    )


def bench_regen_hf(target: Target, contexts: list[list[int]], cfg: RegenConfig, stop: list[int]) -> dict:
    torch.manual_seed(0)
    run = hf_rounds(target, cfg, stop, lambda n, t: None)
    t0 = time.perf_counter()
    gens = run(contexts, 0)
    dt = time.perf_counter() - t0
    new = sum(map(len, gens))
    flops = 2 * non_embedding_params(target) * (sum(map(len, contexts)) + new)
    return {"tokens": new, "seconds": dt, "flops": flops}


def bench_regen_vllm(
    target: Target, contexts: list[list[int]], cfg: RegenConfig, stop: list[int], work: Path
) -> dict | str:
    """vLLM's figures, or why it was not run."""
    py, where = find_engine_python()
    if py is None:
        return where
    if not (vllm_in_this_env() or cpu_head_dim_ok(target.config)):
        return "vLLM's CPU build refuses head_dim < 32"
    t0 = time.perf_counter()
    res = run_worker(py, VLLM_WORKER, vllm_job(target, contexts, cfg, stop, seed=0), work, env=worker_env())
    wall = time.perf_counter() - t0
    new = sum(map(len, vllm_replies(res, stop)))
    flops = 2 * non_embedding_params(target) * (sum(map(len, contexts)) + new)
    return {
        "tokens": new,
        "seconds": res["seconds"],
        "flops": flops,
        "startup_s": wall - res["seconds"],
        "engine": where,
        "vllm_version": res["vllm_version"],
    }


# --- 3. features and 4. training ------------------------------------------------------------------------


def counted(fn) -> tuple[float, object]:
    """(FLOPs torch counts for one call of fn, its result)."""
    with FlopCounterMode(display=False) as fc:
        out = fn()
    return float(fc.get_total_flops()), out


def timed(fn, steps: int) -> float:
    """Median seconds of `steps` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def feature_batch(target: Target, seqs: int, seq_len: int, hidden_ids: list[int]) -> dict:
    """A training batch of the batch contract: random token rows (speed does not depend on the text)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, target.vocab_size, (seqs, seq_len), generator=g)
    am = torch.ones_like(ids)
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[:, 0] = False
    return {
        "input_ids": ids,
        "attention_mask": am,
        "position_ids": torch.arange(seq_len).expand(seqs, -1),
        "loss_mask": mask,
        **compute_features(target, ids, am, hidden_ids),
    }


def bench_features(target: Target, batch: dict, hidden_ids: list[int], steps: int) -> dict:
    def run():
        return compute_features(target, batch["input_ids"], batch["attention_mask"], hidden_ids)

    flops, _ = counted(run)
    return {"tokens": batch["input_ids"].numel(), "seconds": timed(run, steps), "flops": flops}


def bench_train_step(target: Target, kind: str, recipes: Path, batch: dict, bf16: bool, steps: int) -> dict:
    cls, _ = drafter_kinds()[kind]
    cfg = getattr(load_recipe(recipes / f"{kind}.yaml").drafter, kind)
    torch.manual_seed(0)
    drafter = cls(target, cfg).train()
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-4)

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss, _ = drafter(batch, 0)
        loss.backward()
        opt.step()
        opt.zero_grad()

    flops, _ = counted(step)
    return {"tokens": batch["input_ids"].numel(), "seconds": timed(step, steps), "flops": flops}


# --- the run --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(REPO / "recipes/targets/smollm2-135m-instruct"))
    ap.add_argument("--recipes", default=None, help="drafter settings from DIR/<kind>.yaml (default: by target)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (give only the free cores)")
    ap.add_argument("--gemm-sizes", type=int, nargs="+", default=[576, 1024, 2048])
    ap.add_argument("--regen-prompts", type=int, default=16, help="contexts answered per regeneration engine")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--regen-batch", type=int, default=16, help="hf batch size (the chat recipes': 16)")
    ap.add_argument("--seqs", type=int, default=4, help="rows per feature / training batch (the recipes': 4)")
    ap.add_argument("--seq-len", type=int, default=512, help="tokens per row")
    ap.add_argument("--steps", type=int, default=3, help="timed repetitions per feature / training figure")
    ap.add_argument("--kinds", nargs="+", default=KINDS, choices=KINDS)
    ap.add_argument("--skip", nargs="*", default=[], choices=["regen", "vllm", "features", "train"])
    ap.add_argument("--out", default=str(REPO / "runs/bench_pipeline.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    target_dir = Path(args.target)
    if not (target_dir / "config.json").is_file():
        print(
            f"error: no model at {target_dir}; fetch it (python -m decode.cli fetch smollm2-135m-instruct) "
            "or pass --target",
            file=sys.stderr,
        )
        return 2
    recipes = (
        Path(args.recipes)
        if args.recipes
        else REPO / "recipes" / ("stories260K" if target_dir.name == "stories260K" else "smollm2-135m")
    )
    print(
        f"bf16 in hardware: {'yes' if has_bf16('cpu') else 'no'}; {args.threads} thread(s); target {target_dir}",
        flush=True,
    )

    # 1. peak
    peak = {d: gemm_peak(args.gemm_sizes, DTYPES_T[d]) for d in DTYPES}
    print("peak GEMM GFLOP/s: " + ", ".join(f"{d} {v:.1f}" for d, v in peak.items()), flush=True)
    targets = {d: Target.load(target_dir, dtype=name) for d, name in DTYPES.items()}
    rows: list[dict] = []

    def add(stage: str, dtype: str, r: dict | str) -> None:
        if isinstance(r, str):
            rows.append({"stage": stage, "dtype": dtype, "skipped": r})
            print(f"{stage:<22} {dtype:<5} skipped: {r}", flush=True)
            return
        r = {
            "stage": stage,
            "dtype": dtype,
            **r,
            "tokens_per_s": r["tokens"] / r["seconds"],
            "gflop_per_s": r["flops"] / r["seconds"] / 1e9,
        }
        r["fraction_of_peak"] = r["gflop_per_s"] / peak[dtype]
        rows.append(r)
        print(
            f"{stage:<22} {dtype:<5} {r['tokens_per_s']:>9.1f} tok/s {r['gflop_per_s']:>8.1f} GFLOP/s "
            f"{100 * r['fraction_of_peak']:>5.1f}% of peak",
            flush=True,
        )

    # 2. regeneration
    t32 = targets["fp32"]
    extra_stops = load_recipe(
        recipes / f"{args.kinds[0]}.yaml"
    ).data.regenerate.stop_ids  # stories260K: BOS ends a story
    stop = sorted((t32.eos_ids | {t32.tokenizer.eos_token_id} | set(extra_stops)) - {None})
    cfg = RegenConfig(
        enabled=True, max_new_tokens=args.max_new_tokens, temperature=0.7, top_p=0.95, batch_size=args.regen_batch
    )
    if "regen" not in args.skip:
        contexts = contexts_for(t32, args.regen_prompts)
        for d, target in targets.items():
            add("regeneration hf", d, bench_regen_hf(target, contexts, cfg, stop))
        if "vllm" not in args.skip:
            work = Path(args.out).with_suffix("") / "vllm"
            add(
                "regeneration vllm",
                "bf16" if has_bf16("cpu") else "fp32",
                bench_regen_vllm(targets["bf16" if has_bf16("cpu") else "fp32"], contexts, cfg, stop, work),
            )
    # 3. features, 4. training (the batch from the fp32 target, as an offline cache would give it)
    hidden_ids = sorted(
        {
            i
            for k in args.kinds
            for i in getattr(load_recipe(recipes / f"{k}.yaml").drafter, k).feature_ids(t32.num_layers)
        }
        | {t32.num_layers}
    )
    batch = feature_batch(t32, args.seqs, args.seq_len, hidden_ids)
    if "features" not in args.skip:
        for d, target in targets.items():
            add("features", d, bench_features(target, batch, hidden_ids, args.steps))
    if "train" not in args.skip:
        for kind in args.kinds:
            for d in DTYPES:
                add(f"train step {kind}", d, bench_train_step(t32, kind, recipes, batch, d == "bf16", args.steps))

    # the table and the JSON
    print(f"\n{'stage':<22} {'dtype':<5} {'tok/s':>9} {'GFLOP/s':>8} {'% peak':>6}")
    for r in rows:
        if "skipped" in r:
            print(f"{r['stage']:<22} {r['dtype']:<5} {'-':>9} {'-':>8} {'-':>6}  ({r['skipped']})")
        else:
            print(
                f"{r['stage']:<22} {r['dtype']:<5} {r['tokens_per_s']:>9.1f} {r['gflop_per_s']:>8.1f} "
                f"{100 * r['fraction_of_peak']:>6.1f}"
                + (f"  (+{r['startup_s']:.0f} s engine start-up, not in tok/s)" if "startup_s" in r else "")
            )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "target": str(target_dir),
                "threads": args.threads,
                "peak_gflop_per_s": peak,
                "bf16_in_hardware": has_bf16("cpu"),
                "settings": vars(args),
                "rows": rows,
            },
            indent=1,
        )
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
