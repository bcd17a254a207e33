"""`python -m decode.evaluate`: several drafters on the same prompts, against the AR reference.

    python -m decode.evaluate --target MODEL_DIR --drafter SPEC [--drafter SPEC ...] --prompts FILE \
        [--max-new-tokens N] [--temperature T] [--top-p P] [--top-k K] [--seed S] [--tree ...] \
        [--draft-len K] [--policy ...] [--target-pass-s S ...] [--limit N] --out DIR

1. load the target and the prompt file (decode.harness.prompts);
2. decode every prompt with `ar` (the reference for `matches_ar` and `speedup_vs_ar`) and with each
   drafter SPEC: our drafters through `decode.generate.generate`, HF peers (`hf-...`,
   decode.harness.hf_peers) through HF `generate()`; multi-turn prompts turn by turn, each run feeding its
   own answers forward (decode.harness.runs: the rows and how one decodes). Timing is interleaved
   (`interleaved`): conversation by conversation every row decodes it back to back, so a change in a
   shared machine's load cannot pass for a speedup;
3. write report.json, report.md and PNG plots to --out (decode.harness.report).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, replace
from itertools import accumulate
from typing import TextIO

import torch
from torch import Tensor
from tqdm import tqdm

from decode.generate import Generation, add_decode_args, encode_prompt, generate
from decode.harness.autoshape import AUTO, CURVE_TOKENS, AutoChoice, pass_cost_curve, resolve
from decode.harness.divergence import divergences, print_divergences, print_table
from decode.harness.hf_peers import HF_FORMS, is_hf_spec, make_hf_peer
from decode.harness.labels import checkpoint_kind
from decode.harness.prompts import Conversation, load_prompts, render_turn
from decode.harness.report import SpecRun, TurnResult, build_report, total_stats, write_report
from decode.harness.runs import EvalConfig, Runner, decode_conversation, shape_text, warm_up
from decode.harness.workers import decode_in_workers
from decode.metrics import GenStats
from decode.policies import make_policy
from decode.protocol import Drafter
from decode.sampling import SamplingConfig
from decode.target import Target
from decode.tree import Shape, parse_shape

DEFAULT_PASS_COSTS = [20.0, 0.025]  # a 14B target streamed from disk; the same on a GPU


class DecoderRun:
    """Our decoder with one drafter (SPEC resolved by drafters.registry); `SPEC@TREE` overrides --tree for it.

    TREE `auto` leaves the shape open until `choose_shape` (decode.harness.autoshape) has calibrated the drafter.
    """

    kind = "draftsmith"

    def __init__(self, spec: str, target: Target, cfg: EvalConfig) -> None:
        from drafters.registry import make_drafter

        self.target, self.cfg = target, cfg
        spec, at, tree = spec.rpartition("@") if "@" in spec else (spec, "", "")
        self.base_spec = spec
        self.drafter = make_drafter(spec, target)
        self.name = self.drafter.name + (f"@{tree}" if at else "")
        tree = tree or cfg.tree
        auto = tree == AUTO and spec != "ar"  # plain decoding drafts nothing: no shape to size
        self.shape: Shape | None = None if auto else parse_shape("chain" if tree == AUTO else tree, cfg.draft_len)
        self.auto: AutoChoice | None = None
        self.policy = make_policy(cfg.policy)

    def choose_shape(self, prompts: list[Tensor], curve: dict[int, float], run_dir: str | None) -> AutoChoice:
        """--tree auto: calibrate (or read the cached calibration) and fix the shape with the best predicted tok/s."""

        def decode(drafter: Drafter, ids: Tensor, n: int, shape: Shape) -> GenStats:
            return generate(self.target, drafter, ids, n, SamplingConfig(), shape).stats

        self.auto = resolve(
            decode,
            self.target,
            self.drafter,
            self.base_spec,
            prompts,
            curve,
            run_dir,
            min(64, self.cfg.max_new_tokens),
            fallback=parse_shape("chain", self.cfg.draft_len),
        )
        self.shape = self.auto.shape
        return self.auto

    def run(self, prompt_ids: Tensor, max_new_tokens: int, sampling: SamplingConfig, seed: int) -> Generation:
        if self.shape is None:
            raise RuntimeError(f"{self.name}: --tree auto needs choose_shape() before decoding")
        return generate(self.target, self.drafter, prompt_ids, max_new_tokens, sampling, self.shape, self.policy, seed)


def make_run(spec: str, target: Target, cfg: EvalConfig) -> Runner:
    """A DecoderRun or an HFPeer for this SPEC (an unknown SPEC lists both sets of valid forms)."""
    if is_hf_spec(spec):
        return make_hf_peer(spec, target, cfg.draft_len)
    try:
        return DecoderRun(spec, target, cfg)
    except ValueError as e:
        if "unknown drafter SPEC" in str(e):
            raise ValueError(f"{e}\n  " + "\n  ".join(HF_FORMS) + "  (HF peers, evaluate only)") from None
        raise


def prepare(target: Target, specs: list[str], cfg: EvalConfig) -> list[tuple[str, Runner]]:
    """(spec, runner) for `ar` then each SPEC (duplicates and an explicit `ar` dropped).

    Every SPEC is resolved before anything runs, so a bad one fails in seconds, not after the others.
    """
    ordered = list(dict.fromkeys(["ar", *specs]))
    return [(spec, make_run(spec, target, cfg)) for spec in ordered]


def interleaved(
    target: Target,
    runners: list[tuple[str, Runner]],
    convs: list[Conversation],
    cfg: EvalConfig,
    progress: bool = True,
    workers: int = 1,
) -> tuple[list[SpecRun], dict[str, list[float]]]:
    """Every runner on every conversation, conversation by conversation (rotated order); runners[0] is AR.

    1. one untimed warm-up per runner (`warm_up`) unless cfg.warmup is off;
    2. conversation by conversation, every runner decodes that conversation (all its turns) back to
       back (`decode_conversation`);
    3. per conversation, each runner's tokens/s is divided by AR's on that same conversation.
    workers > 1: the conversations are dealt to that many processes of one torch thread each
    (decode.harness.workers), the same rows, order and seeds in each; the turns come back in conversation order.
    Returns the runs (turns in conversation order, as `build_report` expects) and those ratios.
    """
    # the global turn index of each conversation's first turn: the seeds
    firsts = list(accumulate((len(c.turns) for c in convs), initial=0))
    if workers > 1:
        done_all = decode_in_workers(
            target, runners, convs, firsts, cfg, workers, progress, (make_run, warm_up, decode_conversation)
        )
    else:
        if cfg.warmup and convs:
            warm_up([r for _, r in runners], target, convs[0], cfg)
        cold = replace(cfg, warmup=False)
        done_all = [
            decode_conversation(target, runners, conv, cold, c, firsts[c])
            for c, conv in enumerate(
                tqdm(
                    convs, desc="conversations", unit="conv", disable=not progress, file=sys.stderr, dynamic_ncols=True
                )
            )
        ]
    turns: dict[str, list[TurnResult]] = {spec: [] for spec, _ in runners}
    ratios: dict[str, list[float]] = {spec: [] for spec, _ in runners}
    ar_spec = runners[0][0]
    for done in done_all:
        ar_rate = total_stats(done[ar_spec]).tokens_per_s
        for spec, _ in runners:
            turns[spec] += done[spec]
            ratios[spec].append(total_stats(done[spec]).tokens_per_s / ar_rate if ar_rate else 0.0)
    runs = [SpecRun(r.name, spec, r.kind, turns[spec]) for spec, r in runners]
    return runs, ratios


def choose_auto_shapes(
    target: Target,
    runners: list[tuple[str, Runner]],
    convs: list[Conversation],
    run_dir: str | None,
    calibration_prompts: int = 8,
    file: TextIO = sys.stderr,
    pass_s: float | None = None,
) -> None:
    """--tree auto rows: calibrate on the first turns of a few conversations spread evenly over the list (one
    per category where the list runs category by category, as MT-bench and Spec-Bench do: the first few alone
    would all be writing prompts), measure the pass-cost curve once, fix each row's shape, and print the
    choice with its predicted speedup. pass_s: size them for a target pass of that many seconds at any row count
    (a streamed target) instead of the curve measured here."""
    pending = [r for _, r in runners if isinstance(r, DecoderRun) and r.shape is None]
    if not pending:
        return
    n = min(calibration_prompts, len(convs))
    spread = [convs[i * len(convs) // n] for i in range(n)]
    prompts = [encode_prompt(target, *render_turn(target.tokenizer, c.turns[:1], [])) for c in spread]
    curve = pass_cost_curve(target) if pass_s is None else dict.fromkeys(CURVE_TOKENS, pass_s)
    for r in pending:
        print(f"auto: {r.name} -> {r.choose_shape(prompts, curve, run_dir).describe()}", file=file)


def evaluate(
    target: Target,
    runners: list[tuple[str, Runner]],
    convs: list[Conversation],
    cfg: EvalConfig,
    pass_costs: list[float] = DEFAULT_PASS_COSTS,
    meta: dict | None = None,
    progress: bool = True,
    run_dir: str | None = None,
    workers: int = 1,
) -> dict:
    """Run every (spec, runner) from `prepare` on the same prompts, interleaved -> the report.json dict.

    runners[0] is AR. Each drafter entry gets `speedup_vs_ar_per_conversation` (the spread), its `shape`,
    `auto` (the --tree auto choice, predicted vs measured) for auto rows, and, greedy, `divergences`
    (where it left AR's tokens and AR's top-2 logit margin there). run_dir: where calibrations of SPEC
    drafters without a directory are cached. workers: processes the conversations are dealt to (`interleaved`).
    """
    choose_auto_shapes(target, runners, convs, run_dir, pass_s=cfg.auto_pass_s)
    runs, ratios = interleaved(target, runners, convs, cfg, progress, workers)
    settings = {
        **(meta or {}),
        "workers": workers,
        "turns": sum(len(c.turns) for c in convs),
        "conversations": len(convs),
        "max_new_tokens": cfg.max_new_tokens,
        **asdict(cfg.sampling),
        "tree": cfg.tree,
        "draft_len": cfg.draft_len,
        "policy": cfg.policy,
        "auto_pass_s": cfg.auto_pass_s,
        "seed": cfg.seed,
        "torch_threads": 1 if workers > 1 else torch.get_num_threads(),
        "timing": "interleaved by conversation",
    }
    report = build_report(runs, settings, list(pass_costs))
    div = divergences(target, runs, convs) if cfg.sampling.greedy else {}
    by_spec = dict(runners)
    for d in report["drafters"]:
        d["speedup_vs_ar_per_conversation"] = ratios[d["spec"]]
        d["shape"] = shape_text(by_spec[d["spec"]])
        d["drafter_kind"] = checkpoint_kind(d["spec"])
        auto = getattr(by_spec[d["spec"]], "auto", None)
        if auto is not None:
            d["auto"] = {
                **auto.summary(),
                "measured_tau": d["mean_accepted_tokens"],
                "measured_speedup_vs_ar": d["speedup_vs_ar"],
            }
        if d["spec"] in div:
            d["divergences"] = div[d["spec"]]  # greedy: first mismatch per conversation + AR's top-2 margin
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m decode.evaluate", description=__doc__.splitlines()[0])
    add_decode_args(ap)
    ap.add_argument(
        "--drafter",
        action="append",
        required=True,
        metavar="SPEC",
        help="drafter SPEC (repeatable), SPEC@TREE to give it its own --tree; also HF peers: " + ", ".join(HF_FORMS),
    )
    ap.add_argument("--prompts", required=True, help="Spec-Bench/MT-bench jsonl, {'prompt': ...} jsonl, or text")
    ap.add_argument("--limit", type=int, default=None, help="only the first N prompts (conversations)")
    ap.add_argument(
        "--target-pass-s",
        type=float,
        nargs="+",
        default=DEFAULT_PASS_COSTS,
        metavar="S",
        help="target-pass costs (seconds) for the cost model",
    )
    ap.add_argument(
        "--auto-pass-s",
        type=float,
        default=None,
        metavar="S",
        help="size --tree auto rows for a target pass of S seconds (a streamed target) instead of the measured one",
    )
    ap.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up generation per drafter")
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: torch's choice; 1 is fastest for tiny targets on a busy machine)",
    )
    ap.add_argument(
        "--workers",
        type=int,
        default=1,
        help="deal the prompts to N processes of 1 torch thread each (decode.harness.workers; N <= cores)",
    )
    ap.add_argument("--out", required=True, help="directory for report.json, report.md and plots")
    args = ap.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        ap.error("--limit must be >= 1")
    if args.workers < 1:
        ap.error("--workers must be >= 1")
    if args.threads is not None and args.threads < 1:
        ap.error(f"--threads {args.threads}: must be >= 1 (leave it out for torch's default)")

    from transformers.utils import logging as hf_logging

    from decode.errors import USER_ERRORS, check_out_dir, writing
    from decode.generate import check_decode_args, dtype_line

    hf_logging.set_verbosity_error()  # HF assisted generation warns on every drafting call
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    try:
        check_decode_args(args)
        check_out_dir(args.out)  # an unwritable --out fails now, not after the whole evaluation
        cfg = EvalConfig(
            args.max_new_tokens,
            SamplingConfig(args.temperature, args.top_k, args.top_p),
            args.tree,
            args.draft_len,
            args.policy,
            args.seed,
            not args.no_warmup,
            args.auto_pass_s,
        )
        if cfg.auto_pass_s is not None and not cfg.auto_pass_s > 0:
            raise ValueError(f"--auto-pass-s must be > 0 seconds, got {cfg.auto_pass_s}")
        if cfg.tree != AUTO:
            parse_shape(cfg.tree, cfg.draft_len)  # fail on a bad --tree before loading anything
        make_policy(cfg.policy)
        convs = load_prompts(args.prompts, args.limit)
        from decode.offload import load_target_from_args
        from drafters.registry import resident_layers

        # one load for every drafter: the deepest early layers any of them runs stay resident
        base_specs = [d.rpartition("@")[0] if "@" in d else d for d in args.drafter]
        target = load_target_from_args(args, resident_layers([d for d in base_specs if not is_hf_spec(d)]))
        print(dtype_line(args.dtype, target), file=sys.stderr)
        runners = prepare(target, args.drafter, cfg)
        meta = {
            "target": args.target,
            "prompts": args.prompts,
            "dtype": str(target.dtype).removeprefix("torch."),
            "attn": args.attn,
            "runtime": args.runtime,
        }
        report = evaluate(target, runners, convs, cfg, args.target_pass_s, meta, run_dir=args.out, workers=args.workers)
        with writing(args.out):
            paths = write_report(report, args.out)
    except USER_ERRORS as e:  # bad input: say what to fix, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    print_table(report)
    print_divergences(report)
    print(f"wrote {', '.join(str(p) for p in paths)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
