"""Single-stream decoding against the engines a user would pick instead: ours, vLLM CPU, HF transformers.

    python scripts/bench_peers.py [DRAFTER] [--target DIR] [--limit 6] [--max-new-tokens 64] [--threads 1]
        [--draft-len 4] [--dtype float32] [--no-vllm] [--out DIR]

Same prompts (MT-bench first turns, the chat template applied), greedy, one request at a time, in one run:
1. the machine: the target's weight bytes and the read bandwidth of --threads threads (a 256 MB sum), so a pass's
   floor is bytes / bandwidth; our one-token pass on each runtime beside it;
2. ours (decode.harness.evaluate, interleaved by conversation): AR on the fast runtime (decode.runtime) and on HF's
   modules, the drafter as a chain of --draft-len and with `--tree auto`, HF `generate` and HF assisted generation
   (prompt lookup, and early-exit:4 as the assistant);
3. vLLM CPU (the side venv, drafters/serving/vllm_worker.py, --threads OMP threads): plain, the drafter's vLLM
   export as a chain of --draft-len, and suffix decoding (training-free); single stream, and batched (every prompt
   in one call) labelled so;
4. a table (tokens/s, vs our AR, τ, output = our AR) and a bar plot, OUT/peers.{json,md,png}.
DRAFTER defaults to the shipped chat EAGLE-3 (recipes/smollm2-135m/drafters/eagle3); any SPEC works with --no-vllm.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import textwrap
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from decode.errors import missing_target  # noqa: E402
from decode.generate import encode_prompt, generate  # noqa: E402
from decode.harness.evaluate import DecoderRun, evaluate, prepare  # noqa: E402
from decode.harness.prompts import Conversation, load_prompts, render_turn  # noqa: E402
from decode.harness.runs import EvalConfig  # noqa: E402
from decode.target import Target  # noqa: E402
from drafters.registry import make_drafter  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CHAT_TARGET = REPO / "recipes/targets/smollm2-135m-instruct"
SHIPPED = REPO / "recipes/smollm2-135m/drafters/eagle3"
HF_RUNTIME_AR = "ar [hf runtime]"


def read_bandwidth(threads: int, mb: int = 256) -> float:
    """GB/s of a sum over a tensor far larger than the caches, median of 6 (the floor a weight stream can reach)."""
    torch.set_num_threads(threads)
    x = torch.ones(mb * 2**20 // 4)
    times = []
    for _ in range(8):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    return x.numel() * 4 / statistics.median(times[2:]) / 1e9


@torch.inference_mode()
def pass_ms(target: Target, prefix: int = 256, repeats: int = 12) -> float:
    """Median ms of one one-token pass (LM head included) after `prefix` cached tokens."""
    cache = target.new_cache()
    target.prefill(torch.randint(target.vocab_size, (prefix,), generator=torch.Generator().manual_seed(0)), cache)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        target.forward(torch.tensor([5]), cache)
        times.append(time.perf_counter() - t0)
        cache.crop(prefix)
    return 1000 * statistics.median(times[2:])


def weight_bytes(target: Target) -> int:
    """Bytes one pass reads: every layer's weights and the LM head (an embedding row is noise)."""
    layers = sum(p.numel() * p.element_size() for p in target.layers.parameters())
    head = target.lm_head.weight
    return layers + head.numel() * head.element_size() + target.norm.weight.numel() * target.norm.weight.element_size()


def our_rows(target: Target, hf: Target, drafter: str, convs: list[Conversation], cfg: EvalConfig) -> list[dict]:
    """Step 2: every row of ours and HF's, interleaved by conversation -> [{name, engine, tokens_per_s, tau}]."""
    assisted = f"hf-assisted:early-exit:{min(4, target.num_layers - 1)}"  # the first 4 layers as HF's assistant
    specs = [drafter, f"{drafter}@auto", "hf-generate", "hf-prompt-lookup", assisted]
    runners = prepare(target, specs, cfg) + [(HF_RUNTIME_AR, DecoderRun("ar", hf, cfg))]
    report = evaluate(target, runners, convs, cfg, meta={"bench": "peers"}, progress=True)
    rows = []
    for d in report["drafters"]:
        spec = d["spec"]
        engine = "transformers" if spec.startswith("hf-") else "draftsmith"
        name = {"ar": "AR (fast runtime)", HF_RUNTIME_AR: "AR (HF modules)"}.get(spec, spec.replace(drafter, "drafter"))
        if spec.endswith("@auto"):
            name += f" -> {d['shape']}"
        rows.append(
            {"engine": engine, "name": name, "tokens_per_s": d["tokens_per_s"], "tau": d["mean_accepted_tokens"]}
        )
        rows[-1]["same_as_ar"] = d.get("matches_ar")
    return rows


def vllm_rows(drafter: str, target: Target, prompts: list[list[int]], args, ar_outputs: list[list[int]]) -> list[dict]:
    """Step 3: vLLM plain, with the drafter's export, and with suffix decoding; single stream and batched."""
    from drafters.serving.engine_check import export_layouts
    from drafters.serving.vllm_env import ensure_side_venv, run_worker

    out = Path(args.out)
    _, layouts = export_layouts(Path(drafter), args.target, out)
    layout, export_dir = next(iter(layouts.items()))
    method = {"speculators": "eagle3", "eagle3": "eagle3", "medusa-vllm": "medusa"}[layout]
    k = args.draft_len
    runs = [
        {"name": "plain", "speculative_config": None},
        {
            "name": f"{method} export",
            "speculative_config": {"method": method, "model": str(export_dir.resolve()), "num_speculative_tokens": k},
        },
        {"name": "suffix", "speculative_config": {"method": "suffix", "num_speculative_tokens": k}},
    ]
    job = {
        "target": str(Path(args.target).resolve()),
        "prompts": prompts,
        "max_new_tokens": args.max_new_tokens,
        "stop_token_ids": sorted(target.eos_ids),
        "max_model_len": min(target.max_positions, max(map(len, prompts)) + args.max_new_tokens + k + 8),
        "dtype": str(target.dtype).removeprefix("torch."),
        "threads": args.threads,
        "runs": runs,
    }
    result = run_worker(ensure_side_venv(), REPO / "drafters/serving/vllm_worker.py", job, out / "vllm", 3000)
    rows = []
    for r in result["runs"]:
        if "error" in r:
            rows.append({"engine": "vLLM", "name": r["name"], "tokens_per_s": None, "tau": None, "error": r["error"]})
            continue
        tau = 1 + r["accepted_tokens"] / r["drafts"] if r.get("drafts") else 1.0
        same = r["outputs"] == ar_outputs
        for key, label in (("seconds", ""), ("batched_seconds", " [batched]")):
            rows.append(
                {
                    "engine": "vLLM",
                    "name": r["name"] + label,
                    "tokens_per_s": r["new_tokens"] / r[key],
                    "tau": tau,
                    "same_as_ar": same,
                }
            )
    return rows


def table(rows: list[dict], ar: float) -> str:
    lines = ["| engine | row | tok/s | vs our AR | τ | = our AR |", "|---|---|---|---|---|---|"]
    for r in rows:
        tps = r.get("tokens_per_s")
        same = {True: "yes", False: "NO", None: "-"}[r.get("same_as_ar")]
        cells = [f"{tps:.1f}", f"{tps / ar:.2f}"] if tps else ["failed: " + r.get("error", "")[:90], "-"]
        tau = f"{r['tau']:.2f}" if r.get("tau") else "-"
        lines.append(f"| {r['engine']} | {r['name']} | {cells[0]} | {cells[1]} | {tau} | {same} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in rows if r.get("tokens_per_s")]
    colors = {"draftsmith": "tab:blue", "vLLM": "tab:orange", "transformers": "tab:gray"}
    fig, ax = plt.subplots(figsize=(10, 0.4 * len(shown) + 1.6))
    bars = ax.barh(
        [f"{r['engine']}: {r['name']}" for r in shown],
        [r["tokens_per_s"] for r in shown],
        color=[colors[r["engine"]] for r in shown],
    )
    for bar, r in zip(bars, shown):
        if "[batched]" in r["name"]:  # not single stream: drawn apart
            bar.set_alpha(0.45)
            bar.set_hatch("//")
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {r['tokens_per_s']:.1f}", va="center")
    ax.invert_yaxis()
    ax.set_xlabel("tokens/s, one request at a time ([batched], hatched: every prompt in one call)")
    fig.suptitle(textwrap.fill(title, 110), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("drafter", nargs="?", default=str(SHIPPED), help="a trained drafter directory")
    ap.add_argument("--target", default=str(CHAT_TARGET))
    ap.add_argument("--prompts", default=str(REPO / "recipes/data/mt_bench_question.jsonl"))
    ap.add_argument("--limit", type=int, default=6, help="conversations (first turns)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--draft-len", type=int, default=4)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--no-vllm", action="store_true", help="leave vLLM out (no side venv)")
    ap.add_argument("--out", default="runs/peers")
    args = ap.parse_args(argv)
    if args.threads < 1 or args.limit < 1:
        ap.error("--threads and --limit must be >= 1")
    if missing_target(args.target):
        return 2
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # HF assisted generation warns on every drafting call
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    # 1. the machine: bytes a pass reads, the bandwidth they can be read at, and a pass on each runtime.
    gbs = read_bandwidth(args.threads)
    target = Target.load(args.target, "fast", dtype=args.dtype)
    hf = Target(target.model, target.tokenizer, "hf")
    nbytes = weight_bytes(target)
    floor = nbytes / gbs / 1e6
    passes = {"fast": pass_ms(target), "hf": pass_ms(hf)}
    machine = (
        f"{nbytes / 1e6:.0f} MB of weights a pass, read at {gbs:.1f} GB/s ({args.threads} thread(s)): floor "
        f"{floor:.1f} ms; one-token pass {passes['fast']:.1f} ms fast runtime ({passes['fast'] / floor:.2f}x the "
        f"floor), {passes['hf']:.1f} ms HF modules ({passes['hf'] / floor:.2f}x)"
    )
    print(machine, file=sys.stderr)

    # 2. ours and HF's.
    convs = [Conversation(c.id, c.category, c.turns[:1]) for c in load_prompts(args.prompts, args.limit)]
    cfg = EvalConfig(max_new_tokens=args.max_new_tokens, draft_len=args.draft_len)
    rows = our_rows(target, hf, args.drafter, convs, cfg)
    ar = next(r["tokens_per_s"] for r in rows if r["name"] == "AR (fast runtime)")

    # 3. vLLM on the same token ids (our AR's outputs are what "= our AR" compares against).
    if not args.no_vllm:
        prompts = [encode_prompt(target, *render_turn(target.tokenizer, c.turns, [])) for c in convs]
        ar_drafter = make_drafter("ar", target)
        outs = [generate(target, ar_drafter, p, args.max_new_tokens).tokens for p in prompts]
        rows += vllm_rows(args.drafter, target, [p.tolist() for p in prompts], args, outs)

    # 4. the table and the plot.
    title = (
        f"{Path(args.target).name}, {args.dtype}, {len(convs)} MT-bench first turns x {args.max_new_tokens} tokens, "
        f"greedy, {args.threads} thread(s), draft length {args.draft_len}"
    )
    md = f"{title}\n\n{machine}\n\n{table(rows, ar)}\n"
    print(md)
    (out / "peers.md").write_text(md)
    (out / "peers.json").write_text(json.dumps({"title": title, "machine": machine, "rows": rows}, indent=2) + "\n")
    plot(rows, out / "peers.png", title)
    print(f"wrote {out / 'peers.md'}, peers.json, peers.png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
