"""Where a greedy row leaves AR's tokens, and the evaluation's two console tables.

A speculative row must reproduce AR token for token in fp32 (the lossless suite proves it). In bf16, or with a
kernel whose result depends on the batch shape, a row can leave AR at a near-tie: the margin top1 - top2 of
AR's own logits at the first differing position tells numerics (near 0) from a bug (a clear margin).
"""

from __future__ import annotations

import statistics
import sys

import torch

from decode.generate import encode_prompt
from decode.harness.prompts import Conversation, answer_text, render_turn
from decode.harness.report import SpecRun
from decode.target import Target


@torch.inference_mode()
def divergences(target: Target, runs: list[SpecRun], convs: list[Conversation]) -> dict[str, list[dict]]:
    """Per greedy run, where it first leaves AR's tokens in each conversation, and AR's top-2 margin there.

    runs[0] is AR. At a divergence the margin top1 - top2 of AR's own logits at that position tells
    numerics from a bug: a near-tie (a bf16 target, a batch-shape-dependent kernel) is numerics; a
    clear margin is a bug. Later turns of that conversation are skipped (their prompts differ).
    """
    ar, tok = runs[0], target.tokenizer
    ar_turns = {(t.id, t.turn): t for t in ar.turns}
    turns_of = {c.id: c.turns for c in convs}
    out: dict[str, list[dict]] = {}
    for run in runs[1:]:
        found, done = [], set()
        for t in run.turns:
            ref = ar_turns.get((t.id, t.turn))
            if ref is None or t.id in done or t.tokens == ref.tokens:
                continue
            done.add(t.id)
            i = next((j for j, (a, b) in enumerate(zip(ref.tokens, t.tokens)) if a != b), None)
            if i is None:  # one is a prefix of the other (an EOS or a length cut differs)
                found.append(
                    {
                        "conversation": t.id,
                        "turn": t.turn,
                        "position": min(len(ref.tokens), len(t.tokens)),
                        "ar_token": None,
                        "got_token": None,
                        "ar_top2_margin": None,
                    }
                )
                continue
            answers = [answer_text(tok, ar_turns[(t.id, k)].tokens) for k in range(t.turn)]
            text, special = render_turn(tok, turns_of[t.id], answers)
            ids = torch.cat([encode_prompt(target, text, special), torch.tensor(ref.tokens[:i], dtype=torch.long)])
            top = target.forward(ids, None).logits[-1].float().topk(2).values
            found.append(
                {
                    "conversation": t.id,
                    "turn": t.turn,
                    "position": i,
                    "ar_token": ref.tokens[i],
                    "got_token": t.tokens[i],
                    "ar_top2_margin": float(top[0] - top[1]),
                }
            )
        out[run.spec] = found
    return out


def print_table(report: dict, file=sys.stdout) -> None:
    cols = f"{'drafter':<28} {'tau':>6} {'tok/s':>8} {'vs AR':>6} {'per prompt: median [min, max]':>30} {'matches':>7}"
    costs = report["cost_model"]["target_pass_s"]
    cols += "".join(f" {'@' + format(c, 'g') + 's':>8}" for c in costs)
    print(cols, file=file)
    for d in report["drafters"]:
        m = {True: "yes", False: "NO", None: "-"}[d["matches_ar"]]
        proj = (
            "".join(f" {r['speedup_vs_ar']:>8.2f}" for r in d["cost_model"])
            if d["cost_model"]
            else "".join(f" {'-':>8}" for _ in costs)
        )
        r = d.get("speedup_vs_ar_per_conversation") or []
        spread = f"{statistics.median(r):.2f} [{min(r):.2f}, {max(r):.2f}]" if r else "-"
        print(
            f"{d['name']:<28} {d['mean_accepted_tokens']:>6.3f} {d['tokens_per_s']:>8.1f} "
            f"{d['speedup_vs_ar']:>6.2f} {spread:>30} {m:>7}{proj}",
            file=file,
        )


def print_divergences(report: dict, file=sys.stdout) -> None:
    """Greedy rows that left AR's tokens: where, and AR's top-2 logit margin there (near 0 = numerics)."""
    for d in report["drafters"]:
        for v in d.get("divergences", []):
            m = "-" if v["ar_top2_margin"] is None else f"{v['ar_top2_margin']:.4f}"
            print(
                f"diverged: {d['name']} conversation {v['conversation']} turn {v['turn']} at token {v['position']}"
                f" (AR {v['ar_token']}, got {v['got_token']}); AR top-2 logit margin {m}",
                file=file,
            )
