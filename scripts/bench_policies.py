"""Adaptive draft length and training-free drafters on the bundled target, measured in one run.

Part 1 - policies: for each --drafter (default early-exit:2; add trained drafters' SPECs as they
exist), fixed k = --draft-len vs learning, threshold and stopping. The cost-aware policies run twice:
deciding with the measured target-pass cost and with --pass-s (a streamed 14B target's ~20 s).
Columns: τ, target passes per token, drafted tokens per round, and the projected time per token
    (target passes x C + drafting + commit seconds) / tokens
at C = --pass-s and at C = the run's own measured pass cost (≈ its wall time per token).

Part 2 - prompt lookup vs HF's `generate(prompt_lookup_num_tokens=...)` (and lookahead, the other
training-free source) on two workloads:
- `dev`: the dev story openings;
- `restart` (input-grounded, built here): each dev opening's greedy story (--story-tokens), a
  newline, then the opening again (an instruction-free restart), so the answer can copy the story
  above it;
- `continue` (input-grounded, built here): each dev opening + its greedy story of --long-tokens
  tokens as the prompt; the answer continues the model's own text, which at that length keeps
  repeating phrases (and often loops) the prompt already holds.
The `copy` column is the share of the AR answer's tokens whose preceding 3 tokens + itself already
occur earlier in prompt + answer: how much of the answer a lookup could copy.
HF's τ is counted with a forward hook (target calls, prefill included), as ours counts passes.

    python scripts/bench_policies.py [--drafter SPEC ...] [--max-new-tokens 128] [--pass-s 20]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from decode.generate import encode_prompt, generate  # noqa: E402
from decode.metrics import GenStats  # noqa: E402
from decode.policies import constant_cost, make_policy  # noqa: E402
from decode.target import Target  # noqa: E402
from decode.tree import Shape  # noqa: E402
from drafters.registry import make_drafter  # noqa: E402
from drafters.sources.ar import ARDrafter  # noqa: E402


@dataclass
class Run:
    """One drafter/policy over a workload: merged statistics and whether every output matched AR."""

    stats: GenStats
    matches: bool


def run(
    target: Target,
    spec: str,
    prompts: list[torch.Tensor],
    refs: list[list[int]],
    max_new: int,
    shape: Shape,
    policy: str = "fixed",
    pass_s: float | None = None,
) -> Run:
    total, ok = GenStats(), True
    for ids, ref in zip(prompts, refs):
        cost = constant_cost(pass_s) if pass_s else None
        gen = generate(target, make_drafter(spec, target), ids, max_new, shape=shape, policy=make_policy(policy, cost))
        total, ok = total.merge(gen.stats), ok and gen.tokens == ref
    return Run(total, ok)


def projected(s: GenStats, pass_s: float) -> float:
    """Seconds per token if every target pass cost pass_s (drafting and commit as measured)."""
    return (s.target_passes * pass_s + s.draft_s + s.commit_s) / s.new_tokens


def measured_pass_s(s: GenStats) -> float:
    """This run's own target-pass cost: prefill and verification passes (verification included)."""
    return (s.prefill_s + s.verify_s) / s.target_passes


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


# --- part 1: policies -----------------------------------------------------------------------


def bench_policies(target: Target, drafters: list[str], prompts, refs, args) -> str:
    shape = Shape("chain", k=args.draft_len)
    runs = [
        ("fixed", None),
        ("learning", None),
        ("learning", args.pass_s),
        ("threshold", None),
        ("stopping", None),
        ("stopping", args.pass_s),
    ]
    rows, refusals = [], set()
    ar = run(target, "ar", prompts, refs, args.max_new_tokens, shape)
    rows.append(policy_row("ar", "-", "-", ar, args.pass_s))
    for spec in drafters:
        for policy, pass_s in runs:
            decides = "-" if policy in ("fixed", "threshold") else f"{pass_s:g} s" if pass_s else "measured"
            try:
                r = run(target, spec, prompts, refs, args.max_new_tokens, shape, policy, pass_s)
            except ValueError as e:  # a drafter without per-token probabilities: the policy refuses it
                rows.append([spec, policy, decides, "refused*"] + [""] * 8)
                refusals.add(f"* {e}")
                continue
            rows.append(policy_row(spec, policy, decides, r, args.pass_s))
    header = [
        "drafter",
        "policy",
        "policy's pass cost",
        "τ",
        "passes/token",
        "drafted/round",
        "draft ms/token",
        "pass ms (measured)",
        f"s/token @ {args.pass_s:g} s",
        "ms/token @ measured",
        "tok/s (wall)",
        "= AR",
    ]
    return "\n".join([table(header, rows), *sorted(refusals)])


def policy_row(spec: str, policy: str, decides: str, r: Run, pass_s: float) -> list[str]:
    s = r.stats
    c = measured_pass_s(s)
    drafted = sum(s.proposed_by_depth) / s.rounds if s.rounds else 0.0
    return [
        spec,
        policy,
        decides,
        f"{s.tau:.3f}",
        f"{s.target_passes / s.new_tokens:.3f}",
        f"{drafted:.2f}",
        f"{1000 * s.draft_s / s.new_tokens:.2f}",
        f"{1000 * c:.2f}",
        f"{projected(s, pass_s):.2f}",
        f"{1000 * projected(s, c):.2f}",
        f"{s.tokens_per_s:.0f}",
        "yes" if r.matches else "NO",
    ]


# --- part 2: prompt lookup vs HF ------------------------------------------------------------


def restart_prompts(target: Target, openings: list[torch.Tensor], story_tokens: int) -> list[torch.Tensor]:
    """Story (opening + its greedy continuation), newline, the opening again: the answer may copy the story."""
    newline = target.tokenizer("\n", add_special_tokens=False).input_ids[-1:]
    out = []
    for ids in openings:
        story = generate(target, ARDrafter(), ids, story_tokens).tokens
        out.append(torch.cat([ids, torch.tensor(story + newline), ids[1:]]))
    return out


def continue_prompts(target: Target, openings: list[torch.Tensor], story_tokens: int) -> list[torch.Tensor]:
    """Opening + its greedy story as the prompt: the answer continues text that repeats itself."""
    return [torch.cat([ids, torch.tensor(generate(target, ARDrafter(), ids, story_tokens).tokens)]) for ids in openings]


def copy_rate(prompt: list[int], answer: list[int], n: int = 3) -> float:
    """Share of answer tokens whose (n preceding tokens, token) occurs earlier in prompt + answer."""
    seq, seen, hits = prompt + answer, set(), 0
    for i in range(n, len(seq)):
        gram = tuple(seq[i - n : i + 1])
        if i >= len(prompt) and gram in seen:
            hits += 1
        seen.add(gram)
    return hits / max(1, len(answer))


def hf_run(model, prompts: list[torch.Tensor], max_new: int, **kw) -> tuple[list[list[int]], int, int, float]:
    """HF generate on each prompt: outputs, target forward calls (hooked), new tokens, seconds."""
    calls = [0]
    hook = model.register_forward_pre_hook(lambda mod, a: calls.__setitem__(0, calls[0] + 1))
    outs, tokens, t0 = [], 0, time.perf_counter()
    try:
        for ids in prompts:
            x = ids.view(1, -1)
            y = model.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, do_sample=False, pad_token_id=0, **kw
            )[0, x.shape[1] :].tolist()
            outs.append(y)
            tokens += len(y)
    finally:
        hook.remove()
    return outs, calls[0], tokens, time.perf_counter() - t0


def bench_lookup(target: Target, workloads: dict[str, list[torch.Tensor]], args) -> str:
    shape = Shape("chain", k=args.lookup_tokens)
    ours = [
        ("ar", "fixed"),
        (f"prompt-lookup:ngram=3,k={args.lookup_tokens},branches=1", "fixed"),
        (f"prompt-lookup:ngram=3,k={args.lookup_tokens},branches=4", "fixed"),
        (f"prompt-lookup:ngram=3,k={args.lookup_tokens},branches=4", "learning"),
        ("lookahead:window=8,ngram=4,guesses=8", "fixed"),
    ]
    rows = []
    for name, prompts in workloads.items():
        refs = [generate(target, ARDrafter(), ids, args.max_new_tokens).tokens for ids in prompts]
        copy = sum(copy_rate(p.tolist(), r) for p, r in zip(prompts, refs)) / len(prompts)
        for spec, policy in ours:
            r = run(target, spec, prompts, refs, args.max_new_tokens, shape, policy)
            s = r.stats
            rows.append(
                [
                    name,
                    f"{copy:.2f}",
                    f"ours {spec}" + (f" +{policy}" if policy != "fixed" else ""),
                    f"{s.tau:.3f}",
                    str(s.target_passes),
                    str(s.new_tokens),
                    f"{s.tokens_per_s:.0f}",
                    "yes" if r.matches else "NO",
                ]
            )
        hf_greedy: list[list[int]] = []
        for label, kw in [
            ("HF generate (greedy)", {}),
            (
                f"HF prompt_lookup_num_tokens={args.lookup_tokens}, max_matching_ngram_size=3",
                dict(prompt_lookup_num_tokens=args.lookup_tokens, max_matching_ngram_size=3),
            ),
        ]:
            outs, calls, tokens, secs = hf_run(target.model, prompts, args.max_new_tokens, **kw)
            hf_greedy = hf_greedy or outs
            same = "yes" if outs == refs else "no (= HF greedy)" if outs == hf_greedy else "NO"
            rows.append(
                [
                    name,
                    f"{copy:.2f}",
                    label,
                    f"{tokens / calls:.3f}",
                    str(calls),
                    str(tokens),
                    f"{tokens / secs:.0f}",
                    same,
                ]
            )
    header = ["workload", "copy", "method", "τ", "target passes", "tokens", "tok/s", "= AR"]
    return table(header, rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(REPO / "recipes/targets/stories260K"))
    ap.add_argument("--prompts", default=str(REPO / "recipes/prompts/stories_dev.txt"))
    ap.add_argument("--drafter", action="append", help="drafter SPEC for part 1 (repeatable; default early-exit:2)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--draft-len", type=int, default=8, help="fixed k, and the stop rules' longest chain")
    ap.add_argument("--pass-s", type=float, default=20.0, help="modelled target-pass cost (streamed 14B: ~20 s)")
    ap.add_argument("--lookup-tokens", type=int, default=10, help="prompt lookup's k and HF's prompt_lookup_num_tokens")
    ap.add_argument("--story-tokens", type=int, default=100, help="story length in the restart prompts")
    ap.add_argument("--long-tokens", type=int, default=200, help="story length in the continue prompts")
    ap.add_argument("--limit", type=int, default=0, help="use only the first N prompts (0 = all)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: tiny models only lose from more)")
    ap.add_argument("--skip-lookup", action="store_true", help="part 1 only")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    hf_logging.set_verbosity_error()  # HF warns that generation_config's max_length is overridden, per call
    target = Target.load(args.target)
    texts = [t for t in Path(args.prompts).read_text().splitlines() if t.strip()]
    texts = texts[: args.limit] if args.limit else texts
    openings = [encode_prompt(target, t) for t in texts]
    print(
        f"target {args.target} ({target.num_layers} layers), {len(texts)} prompts, max_new_tokens "
        f"{args.max_new_tokens}, torch threads {args.threads}, load average {os.getloadavg()[0]:.1f} "
        f"on {os.cpu_count()} cores\n"
    )

    t0 = time.perf_counter()
    refs = [generate(target, ARDrafter(), ids, args.max_new_tokens).tokens for ids in openings]
    print(f"## Draft-length policies (chain, k = {args.draft_len}; stop rules up to k, learning up to 2k)\n")
    print(bench_policies(target, args.drafter or ["early-exit:2"], openings, refs, args), "\n", flush=True)
    if not args.skip_lookup:
        workloads = {
            "dev": openings,
            "restart": restart_prompts(target, openings, args.story_tokens),
            "continue": continue_prompts(target, openings, args.long_tokens),
        }
        print(f"## Prompt lookup vs HF (k = {args.lookup_tokens}), lookahead\n")
        print(bench_lookup(target, workloads, args), "\n")
    print(f"total {time.perf_counter() - t0:.0f} s, load average {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
