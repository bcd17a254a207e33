"""The rows of an evaluation and how each decodes: the shared settings, the Runner protocol, a row's turns, its shape.

A row is a Runner: our decoder with a drafter (decode.harness.evaluate.DecoderRun) or an HF peer
(decode.harness.hf_peers.HFPeer). `run_spec` decodes conversations turn by turn with one row, each turn's
prompt carrying the row's own earlier answers; `decode_conversation` is the step of interleaved timing (one
conversation, every row back to back), run the same way in the parent and in decode.harness.workers.
Nothing here resolves a SPEC (that is decode.harness.evaluate's, through drafters.registry).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Protocol

from torch import Tensor
from tqdm import tqdm

from decode.generate import Generation, encode_prompt
from decode.harness.autoshape import shape_spec
from decode.harness.prompts import Conversation, answer_text, render_turn
from decode.harness.report import SpecRun, TurnResult
from decode.sampling import SamplingConfig
from decode.target import Target


@dataclass(frozen=True)
class EvalConfig:
    """Settings every run in one evaluation shares."""

    max_new_tokens: int = 128
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    tree: str = "chain"  # chain | static:FILE | dynamic:topk=..,depth=..,nodes=.. | auto
    draft_len: int = 8
    policy: str = "fixed"
    seed: int = 0  # turn i is decoded with seed + i in every run
    warmup: bool = True  # one short untimed generation per run first (lazy init, allocator warm-up)
    auto_pass_s: float | None = None  # size `auto` rows for a target pass of this many seconds; None: measured


class Runner(Protocol):
    """Decodes one prompt: our decoder with a drafter (DecoderRun) or an HF peer (decode.harness.hf_peers.HFPeer)."""

    name: str
    kind: str

    def run(self, prompt_ids: Tensor, max_new_tokens: int, sampling: SamplingConfig, seed: int) -> Generation: ...


def warm_up(runners: list[Runner], target: Target, conv: Conversation, cfg: EvalConfig) -> None:
    """One short untimed generation per runner on the conversation's first turn (lazy init, allocator)."""
    text, special = render_turn(target.tokenizer, conv.turns, [])
    ids = encode_prompt(target, text, special)
    for r in runners:
        r.run(ids, min(8, cfg.max_new_tokens), cfg.sampling, cfg.seed)


def run_spec(
    runner: Runner,
    target: Target,
    convs: list[Conversation],
    cfg: EvalConfig,
    spec: str = "",
    progress: bool = True,
    first_turn: int = 0,
) -> SpecRun:
    """Decode every turn of every conversation with one runner (a DecoderRun or an HFPeer).

    Turn i overall (counting from `first_turn`) is decoded with seed cfg.seed + i.
    """
    tok = target.tokenizer
    if cfg.warmup and convs:
        warm_up([runner], target, convs[0], cfg)
    turns: list[TurnResult] = []
    bar = tqdm(
        total=sum(len(c.turns) for c in convs),
        desc=runner.name,
        unit="turn",
        disable=not progress,
        file=sys.stderr,
        dynamic_ncols=True,
    )
    for conv in convs:
        answers: list[str] = []
        for k in range(len(conv.turns)):
            text, special = render_turn(tok, conv.turns, answers)
            ids = encode_prompt(target, text, special)
            gen = runner.run(ids, cfg.max_new_tokens, cfg.sampling, cfg.seed + first_turn + len(turns))
            turns.append(TurnResult(conv.id, conv.category, k, ids.numel(), gen.tokens, gen.stats))
            answers.append(answer_text(tok, gen.tokens))
            bar.update(1)
    bar.close()
    return SpecRun(runner.name, spec or runner.name, runner.kind, turns)


def decode_conversation(
    target: Target, runners: list[tuple[str, Runner]], conv: Conversation, cfg: EvalConfig, c: int, first: int
) -> dict[str, list[TurnResult]]:
    """Conversation number c (its first turn is turn `first` overall: the seeds) decoded by every runner back
    to back, the order rotated by c so no runner always runs first or last."""
    k = c % len(runners)
    return {spec: run_spec(r, target, [conv], cfg, spec, False, first).turns for spec, r in runners[k:] + runners[:k]}


def shape_text(runner: Runner) -> str | None:
    """The shape a row drafted with, as text (None: an HF peer, or plain decoding)."""
    shape = getattr(runner, "shape", None)
    if shape is None or getattr(runner, "base_spec", "") == "ar":
        return None
    return shape_spec(shape) if shape.kind != "static" else f"static nodes={len(shape.choices)}"
