"""The speculative generate loop, and `python -m decode.generate` (streams text as it is accepted).

One round: the drafter proposes a tree -> one target pass over [pending] + tree -> verify ->
compact the target's KV cache to the accepted path -> tell the drafter. With the `ar` drafter
(empty trees) this is plain autoregressive decoding, the reference the others must match.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from decode.metrics import GenStats
from decode.offload import add_offload_args, load_target_from_args
from decode.passes import forward_tree
from decode.policies import FixedPolicy, Policy, Round, capped, constant_cost, make_policy
from decode.precision import bf16_reason
from decode.protocol import Budget, Drafter, TargetStep, layer_reuse, side_rows
from decode.sampling import Rng, SamplingConfig, TorchRng, probs_from_logits
from decode.target import Target
from decode.tree import Shape, parse_shape
from decode.verify import LazyRows, child_rows, verify_greedy, verify_sampling


@dataclass
class Generation:
    """Emitted tokens (prompt excluded) and the run's statistics."""

    tokens: list[int]
    stats: GenStats


def check_length(target: Target, prompt_len: int, max_new_tokens: int) -> None:
    if prompt_len < 1:
        raise ValueError("empty prompt: at least one token (e.g. BOS) is needed")
    if prompt_len + max_new_tokens > target.max_positions:
        raise ValueError(
            f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's "
            f"max positions ({target.max_positions}); shorten the prompt or lower --max-new-tokens"
        )


def pick(logits: Tensor, sampling: SamplingConfig, rng: Rng) -> int:
    """One token from the target's logits [V], the AR way."""
    if sampling.greedy:
        return int(logits.float().argmax())
    return rng.categorical(probs_from_logits(logits, sampling))


@torch.inference_mode()
def generate(
    target: Target,
    drafter: Drafter,
    prompt_ids: Tensor,
    max_new_tokens: int,
    sampling: SamplingConfig = SamplingConfig(),
    shape: Shape = Shape(),
    policy: Policy | None = None,
    seed: int = 0,
    on_tokens: Callable[[list[int]], None] | None = None,
) -> Generation:
    """Generate up to max_new_tokens (stopping after an EOS) with `drafter` proposing and `target` verifying."""
    prompt_ids = torch.as_tensor(prompt_ids, dtype=torch.long).view(-1)
    check_length(target, prompt_ids.numel(), max_new_tokens)
    policy = policy or FixedPolicy()
    if policy.needs_probs and getattr(drafter, "token_probs", True) is False:
        raise ValueError(no_probs(policy, drafter))
    rng = TorchRng(seed)
    stats = GenStats()
    hidden_ids = tuple(drafter.hidden_ids)
    passes0 = drafter.forward_passes
    t_start = time.perf_counter()

    # 1. prefill: the target processes the prompt and emits the first token.
    cache = target.new_cache()
    out = target.forward(prompt_ids, cache, hidden_ids=hidden_ids, logits=False)
    first = pick(target.head(out.last[-1]), sampling, rng)  # the head on the last row only: the chat target's 49k
    # head over a 78-token prompt took 14-18 ms in bf16, half a decoding step
    emitted = [first]
    stats.target_passes = 1
    committed = prompt_ids.numel()
    step = TargetStep(torch.cat([prompt_ids[1:], torch.tensor([first])]), out.hidden, [], committed, cache)
    if on_tokens:
        on_tokens([first])
    drafter.begin(prompt_ids, step)
    stats.prefill_s = time.perf_counter() - t_start

    while len(emitted) < max_new_tokens and emitted[-1] not in target.eos_ids:
        # 2. draft: no deeper than what can still be emitted (the bonus takes one) or positioned.
        t0 = time.perf_counter()
        room = min(max_new_tokens - len(emitted) - 1, target.max_positions - committed - 2)
        round_shape = capped(policy.shape(shape), room)
        tree = drafter.propose(Budget(round_shape, sampling, rng))
        if policy.needs_probs and tree.size and tree.conf is None:
            raise ValueError(no_probs(policy, drafter))
        depth = tree.depth()
        if depth > room:
            tree, depth = tree.truncate_depth(room), room
        reuse, side = layer_reuse(drafter), side_rows(drafter)
        t1 = time.perf_counter()

        # 3. verify: one target pass over [pending] + tree (+ side rows a drafter rides along, never committed).
        #    The LM head runs only on the rows verification visits (the accepted path + its bonus row) and their children.
        out = forward_tree(target, emitted[-1], tree, cache, hidden_ids, reuse, side, logits=False)
        rows = out.last[: 1 + tree.size]  # [1 + N, D] pre-norm
        also = child_rows(tree)  # a visited row's children ride along: the walk's next visit is one of them
        if sampling.greedy:
            # argmax in fp32: the same index (bf16 -> fp32 is exact), and 5x faster than bf16's on a CPU (49k: 0.17 ms)
            verdict = verify_greedy(tree, LazyRows(lambda h: target.head(h).float().argmax(-1), rows, also))
        else:
            verdict = verify_sampling(
                tree, LazyRows(lambda h: probs_from_logits(target.head(h), sampling), rows, also), rng
            )
        t2 = time.perf_counter()

        # 4. commit: keep the root and the accepted path in the cache, emit path tokens + bonus.
        keep = torch.tensor([0] + [i + 1 for i in verdict.path], dtype=torch.long)
        cache.compact(committed, keep)
        committed += keep.numel()
        new = tree.tokens[verdict.path].tolist() + [verdict.bonus]
        stats.target_passes += 1
        stats.record_round(depth, len(verdict.path), tree.size)
        new = truncate(new, max_new_tokens - len(emitted), target.eos_ids)
        emitted.extend(new)
        if on_tokens:
            on_tokens(new)
        hidden = {i: h[keep] for i, h in out.hidden.items()}
        side_logits = target.head(out.last[1 + tree.size :]) if side is not None else None
        drafter.accept(TargetStep(torch.tensor(new), hidden, verdict.path, committed, cache, side_logits))
        t3 = time.perf_counter()
        stats.draft_s += t1 - t0
        stats.verify_s += t2 - t1
        stats.commit_s += t3 - t2
        conf = tree.conf.tolist() if tree.conf is not None else None
        policy.observe(Round(depth, len(verdict.path), t1 - t0, t2 - t1, out.last.shape[0], conf))

    stats.new_tokens = len(emitted)
    stats.drafter_passes = drafter.forward_passes - passes0
    stats.wall_s = time.perf_counter() - t_start
    return Generation(emitted, stats)


def no_probs(policy: Policy, drafter: Drafter) -> str:
    return (
        f"--policy {policy.name} needs the drafter's per-token probabilities, and {drafter.name} proposes "
        "without them (lookup-style drafts); use --policy fixed or learning with it"
    )


def truncate(tokens: list[int], room: int, eos_ids: set[int]) -> list[int]:
    """At most `room` tokens, ending at the first EOS."""
    out = []
    for t in tokens[:room]:
        out.append(t)
        if t in eos_ids:
            break
    return out


def encode_prompt(target: Target, text: str, add_special_tokens: bool = True) -> Tensor:
    """Token ids [T]; add_special_tokens=False for text already rendered by a chat template."""
    if target.tokenizer is None:
        raise ValueError(f"{target.name_or_path} has no tokenizer: cannot encode a text prompt")
    ids = target.tokenizer(text, return_tensors="pt", add_special_tokens=add_special_tokens).input_ids[0]
    if ids.numel() == 0:
        raise ValueError("the prompt encodes to no tokens")
    return ids


def add_decode_args(ap: argparse.ArgumentParser) -> None:
    """Options shared by decode.generate and decode.harness.evaluate."""
    ap.add_argument("--target", required=True, help="model directory or hub id")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument(
        "--tree",
        default="chain",
        help="chain | static:FILE | dynamic:topk=8,depth=6,nodes=60 | auto "
        "(the chain or tree with the most predicted tokens/s: calibrated acceptance + measured pass cost)",
    )
    ap.add_argument("--draft-len", type=int, default=8, help="chain length k")
    ap.add_argument(
        "--policy",
        default="fixed",
        help="draft-length policy: fixed | learning[:max=..,decay=..] | threshold[:p=0.4,max=..] | "
        "stopping[:max=..,decay=..] (max: the longest chain; default --draft-len, twice that for learning)",
    )
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--dtype",
        default="auto",
        help="auto (bfloat16 where the hardware has it, else float32) | "
        "float32 (bit-exact with AR) | bfloat16 | float16",
    )
    ap.add_argument("--attn", default="sdpa", help="attention implementation: sdpa | eager")
    ap.add_argument(
        "--runtime",
        default="fast",
        choices=["fast", "hf"],
        help="fast: the target's layers as fused ops over packed weights (decode.runtime); hf: HF's own modules",
    )
    add_offload_args(
        ap
    )  # --offload/--max-memory/--offload-dir/--device: load with decode.offload.load_target_from_args


def check_decode_args(args: argparse.Namespace) -> None:
    """The add_decode_args options no dataclass checks."""
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens {args.max_new_tokens}: must be >= 1")


def dtype_line(requested: str, target: Target) -> str:
    """What the run computes in, said at start (bf16 greedy output can leave fp32's at near-ties)."""
    got = str(target.dtype).removeprefix("torch.")
    why = f" (auto: {bf16_reason(target.device, target.config.to_dict())})" if requested == "auto" else ""
    return f"dtype: {got}{why}"


def policy_for(spec: str, target_pass_s: float | None = None) -> Policy:
    """A fresh policy (they keep per-run state); target_pass_s: the pass cost the cost-aware ones decide
    with (None = measure it as the run goes)."""
    return make_policy(spec, constant_cost(target_pass_s) if target_pass_s is not None else None)


def main(argv: list[str] | None = None) -> int:
    # the front end's imports: the harness's chat rendering and --tree auto, and the SPEC registry
    from decode.harness.prompts import chat_calibration_turns, render_turn
    from drafters.registry import make_drafter, resident_layers

    ap = argparse.ArgumentParser(prog="python -m decode.generate", description=__doc__.splitlines()[0])
    add_decode_args(ap)
    ap.add_argument("--drafter", default="ar", help="drafter SPEC (see drafters.registry)")
    ap.add_argument(
        "--prompt",
        required=True,
        help="the user's message (rendered with the target's chat template when it has one, as decode.evaluate does)",
    )
    ap.add_argument("--raw", action="store_true", help="encode --prompt as is: no chat template")
    ap.add_argument(
        "--target-pass-s",
        type=float,
        default=None,
        help="seconds one target pass costs, for the cost-aware policies (e.g. 20 for a streamed 14B "
        "target); default: measured as the run goes",
    )
    args = ap.parse_args(argv)
    # options first: a bad value fails in a second, not after loading the target
    check_decode_args(args)
    sampling = SamplingConfig(args.temperature, args.top_k, args.top_p)
    auto = args.tree == "auto" and args.drafter != "ar"  # plain decoding drafts nothing: no shape to size
    shape = None if auto else parse_shape("chain" if args.tree == "auto" else args.tree, args.draft_len)
    policy_for(args.policy, args.target_pass_s)
    torch.manual_seed(args.seed)
    target = load_target_from_args(args, resident_layers([args.drafter]))
    print(dtype_line(args.dtype, target), file=sys.stderr)
    if target.placement is not None:
        print(target.placement.describe(), file=sys.stderr)
    drafter = make_drafter(args.drafter, target)
    tok = target.tokenizer
    text, special = (args.prompt, True) if args.raw else render_turn(tok, (args.prompt,), [])
    ids = encode_prompt(target, text, special)
    if shape is None:  # --tree auto: calibrate (or read DRAFTER_DIR/calibration.json)
        from decode.harness.autoshape import pass_cost_curve, resolve

        def decode(d: Drafter, p: Tensor, n: int, s: Shape) -> GenStats:
            return generate(target, d, p, n, SamplingConfig(), s).stats

        # a chat turn: on the bundled MT-bench first turns, one per category, as the benchmarks do (one short answer
        # gives a handful of rounds: "What is the capital of France?" calibrated to 4 trials and chose chain k=1)
        cal_prompts = (
            [ids] if special else [encode_prompt(target, *render_turn(tok, t, [])) for t in chat_calibration_turns()]
        )
        choice = resolve(
            decode,
            target,
            drafter,
            args.drafter,
            cal_prompts,
            pass_cost_curve(target),
            max_new_tokens=min(64, args.max_new_tokens),
            fallback=parse_shape("chain", args.draft_len),
        )
        print(f"auto: {choice.describe()}", file=sys.stderr)
        shape = choice.shape
    if special:  # raw text: the continuation is printed after the prompt's own tokens
        shown = ids.tolist()
    else:  # a chat turn: show the user's message, then the answer alone
        print(args.prompt)
        shown = []
    printed = 0

    def stream(new: list[int]) -> None:  # decode the whole text so far: sentencepiece spaces need context
        nonlocal printed
        shown.extend(new)
        text = tok.decode(shown, skip_special_tokens=True)
        sys.stdout.write(text[printed:])
        sys.stdout.flush()
        printed = len(text)

    stream([])

    gen = generate(
        target,
        drafter,
        ids,
        args.max_new_tokens,
        sampling,
        shape,
        policy_for(args.policy, args.target_pass_s),
        args.seed,
        on_tokens=stream,
    )
    s = gen.stats
    print(
        f"\n[{drafter.name}] {s.new_tokens} tokens, {s.target_passes} target passes, tau {s.tau:.2f}, "
        f"{s.tokens_per_s:.1f} tok/s",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    from decode.errors import run_cli

    sys.exit(run_cli(main))
