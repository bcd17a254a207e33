"""Prompt files for evaluation: Spec-Bench/MT-bench jsonl, `{"prompt": ...}` jsonl, or plain text.

A file becomes a list of `Conversation`s. Multi-turn conversations are decoded turn by turn as
Spec-Bench does: turn k's prompt is the chat template applied to the earlier turns *with the
model's own answers to them* plus turn k, so each decoding run feeds its own answers forward.
Tokenizers without a chat template (the bundled story target) get the raw text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

DEFAULT_CATEGORY = "default"
MT_BENCH = Path(__file__).resolve().parents[2] / "recipes/data/mt_bench_question.jsonl"  # bundled, 80 questions
JSONL_SUFFIXES = (".jsonl", ".json")  # always parsed as jsonl: a bad line is an error, never a text prompt


class PromptFileError(ValueError):
    """A prompt file that is empty or has a malformed line (the message names the line)."""


@dataclass(frozen=True)
class Conversation:
    """One evaluation item: an id, a category (per-category rows), and one or more user turns."""

    id: str
    category: str
    turns: tuple[str, ...]


def load_prompts(path: str | Path, limit: int | None = None) -> list[Conversation]:
    """Read a prompt file; jsonl when named .jsonl or when the first non-blank line starts with '{', else
    one prompt a line."""
    path = Path(path)
    if not path.is_file():
        raise PromptFileError(f"prompt file not found: {path}")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise PromptFileError(
            f"{path}: not a UTF-8 text file (byte {e.start}); give one prompt a line or jsonl rows"
        ) from None
    numbered = [(n, line) for n, line in enumerate(lines, start=1) if line.strip()]
    if not numbered:
        raise PromptFileError(f"{path}: no prompts (the file is empty); give one prompt a line or jsonl rows")
    is_jsonl = path.suffix in JSONL_SUFFIXES or numbered[0][1].lstrip().startswith("{")
    convs = [parse_json_line(path, n, line) if is_jsonl else text_line(n, line) for n, line in numbered]
    return convs[:limit] if limit is not None else convs


def first_per_category(convs: list[Conversation], n: int) -> list[Conversation]:
    """The first n conversations of each category, in file order (a cheaper run that still covers them all)."""
    counts: dict[str, int] = {}
    out = []
    for c in convs:
        counts[c.category] = counts.get(c.category, 0) + 1
        if counts[c.category] <= n:
            out.append(c)
    return out


def chat_calibration_turns(n: int = 1) -> list[tuple[str]]:
    """The first user turn of the first n MT-bench questions of each category (the bundled file): the prompts
    `--tree auto` calibrates a chat drafter on when a run has no prompt list of its own (decode.generate)."""
    return [c.turns[:1] for c in first_per_category(load_prompts(MT_BENCH), n)]


def text_line(lineno: int, line: str) -> Conversation:
    return Conversation(str(lineno), DEFAULT_CATEGORY, (line.strip(),))


def parse_json_line(path: Path, lineno: int, line: str) -> Conversation:
    """One jsonl row: `{"question_id", "category", "turns": [...]}` or `{"prompt": "..."}`."""
    where = f"{path}:{lineno}"
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise PromptFileError(
            f"{where}: not valid JSON ({e.msg}, column {e.colno}); a jsonl prompt file needs one JSON object per line"
        ) from None
    if not isinstance(row, dict):
        raise PromptFileError(f"{where}: expected a JSON object, got {type(row).__name__}")
    if "turns" in row:
        turns = row["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
            raise PromptFileError(f"{where}: 'turns' must be a non-empty list of non-empty strings")
        qid = row.get("question_id", lineno)
    elif "prompt" in row:
        if not isinstance(row["prompt"], str) or not row["prompt"].strip():
            raise PromptFileError(f"{where}: 'prompt' must be a non-empty string")
        turns, qid = [row["prompt"]], row.get("id", lineno)
    else:
        raise PromptFileError(
            f"{where}: a row needs 'turns' (Spec-Bench/MT-bench) or 'prompt'; keys were {sorted(row)}"
        )
    category = row.get("category", DEFAULT_CATEGORY)
    if not isinstance(category, str) or not category:
        raise PromptFileError(f"{where}: 'category' must be a non-empty string")
    return Conversation(str(qid), category, tuple(turns))


def has_chat_template(tokenizer) -> bool:
    return tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))


def render_turn(tokenizer, turns: tuple[str, ...], answers: list[str]) -> tuple[str, bool]:
    """The text of turn len(answers)'s prompt, and whether the tokenizer should add special tokens.

    With a chat template: user/assistant messages for the earlier turns and their answers, then
    this turn, with the generation prompt (the template already holds BOS and the like). Without
    one: the earlier turns and answers concatenated as raw text, one newline between them.
    """
    k = len(answers)
    if k >= len(turns):
        raise ValueError(f"turn {k} requested of a {len(turns)}-turn conversation")
    if has_chat_template(tokenizer):
        messages = []
        for user, answer in zip(turns[:k], answers):
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        messages.append({"role": "user", "content": turns[k]})
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), False
    parts = [p for pair in zip(turns[:k], answers) for p in pair] + [turns[k]]
    return "\n".join(parts), True


def answer_text(tokenizer, tokens: list[int]) -> str:
    """The model's answer as text for the next turn's prompt (special tokens dropped, as Spec-Bench does)."""
    return tokenizer.decode(tokens, skip_special_tokens=True).strip()
