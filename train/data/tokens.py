"""Tokenization with loss masks, max-length handling and the held-out split.

Loss-mask convention (used everywhere in train/): `loss_mask[t]` is True when token t itself is a
trained token (an assistant token, or a plain-text token). A loss that predicts token t+1 from
position t therefore uses `loss_mask[:, 1:]`. Token 0 is never trained (nothing predicts it), which
also keeps packed sequences from predicting across their boundary.

Chat records with a chat template: the assistant spans are found from the rendered template itself,
not from hard-coded header strings:
  1. R = template(all messages); tokenize R with character offsets;
  2. for each assistant message i: P = template(messages[:i], add_generation_prompt=True). The span
     starts where P and R stop agreeing (all of P when P is a prefix of R; when the template renders
     history differently from a fresh generation prompt — e.g. Qwen3 with thinking off, whose
     generation prompt carries an empty <think></think> that history turns do not — the span starts
     at the first differing character, i.e. where the assistant's own text begins);
  3. the span ends with the first end-of-turn token (the tokenizer's EOS and the target's EOS ids)
     at or after its start, included — that is where the target stops generating; if none occurs
     before the next message's content, the span ends there (trailing whitespace excluded);
  4. a token is in the span when it starts at or after the span's first character.
Qwen3's template drops the thinking block of assistant turns before the last user turn, exactly as
the target sees its history at inference; the last turn keeps it (enable_thinking on) or gets the
empty <think></think> as part of the prompt (enable_thinking off).

Without a chat template (or data.chat_template false) the plain rule applies: the tokenizer's
special-token prefix (e.g. BOS), then each message's content tokenized on its own (so turn
boundaries are token boundaries); assistant contents are followed by the EOS token and trained
together with it. Plain text records: prefix + text, every text token trained.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import datasets

SEQ_FEATURES = datasets.Features(
    {"input_ids": datasets.Sequence(datasets.Value("int32")), "loss_mask": datasets.Sequence(datasets.Value("bool"))}
)


@dataclass
class TokenStats:
    """What tokenization kept and dropped (reported by train.features)."""

    records: int = 0
    truncated: int = 0
    dropped_long: int = 0
    dropped_no_loss: int = 0
    sequences: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return (
            f"{self.records} records -> {self.sequences} sequences, {self.tokens} tokens "
            f"({self.loss_tokens} trained); truncated {self.truncated}, dropped {self.dropped_long} too long "
            f"and {self.dropped_no_loss} with no trained token"
        )


def has_template(tok) -> bool:
    return bool(getattr(tok, "chat_template", None))


def end_token_ids(tok, extra: set[int] | frozenset[int] = frozenset()) -> set[int]:
    """Token ids that end an assistant turn: the tokenizer's EOS plus `extra` (the target's EOS ids)."""
    ids = set(extra)
    if tok.eos_token_id is not None:
        ids.add(tok.eos_token_id)
    if not ids:
        raise ValueError("the tokenizer has no EOS token and the target declares none: cannot end assistant turns")
    return ids


def template_kwargs(enable_thinking: bool | None) -> dict:
    return {} if enable_thinking is None else {"enable_thinking": enable_thinking}


def render(tok, messages: list[dict], generation_prompt: bool, tpl: dict) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt, **tpl)


def common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def tokenize_chat(tok, messages: list[dict], end_ids: set[int], tpl: dict) -> tuple[list[int], list[bool]]:
    """Chat template rendering -> ids and assistant-only loss mask (steps 1-4 of the module docstring)."""
    if not tok.is_fast:
        raise ValueError("chat loss masks need a fast tokenizer (character offsets); load it with use_fast=True")
    full = render(tok, messages, False, tpl)
    enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
    starts = [a for a, _ in offsets]
    mask = [False] * len(ids)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = common_prefix(render(tok, messages[:i], True, tpl), full)
        nxt = full.find(messages[i + 1]["content"], start) if i + 1 < len(messages) else -1
        bound = nxt if nxt > start else len(full)
        first = next((j for j, a in enumerate(starts) if a >= start), len(ids))
        end = next((j for j in range(first, len(ids)) if starts[j] < bound and ids[j] in end_ids), None)
        if end is None:  # no end-of-turn token before the next message: stop at its content
            stop = len(full[:bound].rstrip())
            end = max((j for j in range(first, len(ids)) if offsets[j][1] <= stop), default=first - 1)
        for j in range(first, end + 1):
            mask[j] = True
    return ids, mask


def tokenize_plain(tok, messages: list[dict], eos_id: int) -> tuple[list[int], list[bool]]:
    """The no-template rule: special prefix, then each message's content; assistant content + EOS trained."""
    ids = list(tok("", add_special_tokens=True)["input_ids"])
    mask = [False] * len(ids)
    for m in messages:
        t = list(tok(m["content"], add_special_tokens=False)["input_ids"])
        if m["role"] == "assistant":
            t.append(eos_id)
        ids += t
        mask += [m["role"] == "assistant"] * len(t)
    return ids, mask


def tokenize_record(rec: dict, tok, end_ids: set[int], use_template: bool, tpl: dict) -> tuple[list[int], list[bool]]:
    if rec["kind"] == "tokens":
        ids, mask = list(rec["input_ids"]), [bool(x) for x in rec["loss_mask"]]
    elif rec["kind"] == "text":
        prefix = list(tok("", add_special_tokens=True)["input_ids"])
        body = list(tok(rec["text"], add_special_tokens=False)["input_ids"])
        ids, mask = prefix + body, [False] * len(prefix) + [True] * len(body)
    elif not any(m["role"] == "assistant" for m in rec["messages"]):
        raise ValueError(
            f"{rec['origin']}: a conversation with no assistant turn (questions or bare prompts); "
            "set data.regenerate.enabled=true to have the target answer them"
        )
    elif use_template:
        ids, mask = tokenize_chat(tok, rec["messages"], end_ids, tpl)
    else:
        ids, mask = tokenize_plain(tok, rec["messages"], min(end_ids) if tok.eos_token_id is None else tok.eos_token_id)
    if mask:
        mask[0] = False  # nothing predicts the first token
    return ids, mask


def tokenize_dataset(
    records: datasets.Dataset,
    tok,
    max_length: int,
    overflow: str,
    end_ids: set[int],
    use_template: bool,
    enable_thinking: bool | None,
) -> tuple[datasets.Dataset, TokenStats]:
    """Canonical records -> {"input_ids", "loss_mask"} rows, with truncation/dropping counted."""
    stats = TokenStats(records=len(records))
    tpl = template_kwargs(enable_thinking)
    if use_template and not has_template(tok):
        use_template = False
        if "chat" in records["kind"]:
            stats.notes.append("the tokenizer has no chat template: conversations use the plain rule (tokens.py)")

    def one(rec: dict) -> dict:
        ids, mask = tokenize_record(rec, tok, end_ids, use_template, tpl)
        status = "ok"
        if len(ids) > max_length:
            status = "long" if overflow == "drop" else "truncated"
            ids, mask = ids[:max_length], mask[:max_length]
        if status != "long" and not any(mask):
            status = "no_loss"
        return {"input_ids": ids, "loss_mask": mask, "status": status}

    feats = datasets.Features({**SEQ_FEATURES, "status": datasets.Value("string")})
    out = records.map(one, remove_columns=records.column_names, features=feats, keep_in_memory=True, desc="tokenizing")
    status = out["status"]
    stats.truncated = status.count("truncated")
    stats.dropped_long = status.count("long")
    stats.dropped_no_loss = status.count("no_loss")
    keep = [i for i, s in enumerate(status) if s in ("ok", "truncated")]
    out = out.select(keep, keep_in_memory=True).remove_columns("status")
    if len(out) == 0:
        raise ValueError(
            f"no training sequences left: {stats.summary()}; raise data.max_length, use "
            "data.overflow=truncate, or check that the records have assistant/text content"
        )
    stats.sequences = len(out)
    stats.tokens = sum(len(x) for x in out["input_ids"])
    stats.loss_tokens = sum(sum(x) for x in out["loss_mask"])
    return out, stats


def split_held_out(ds: datasets.Dataset, fraction: float, seed: int) -> tuple[datasets.Dataset, datasets.Dataset]:
    """A seeded shuffle; the last `fraction` (at least one sequence when fraction > 0 and N > 1) is eval."""
    order = list(range(len(ds)))
    random.Random(seed).shuffle(order)
    n_eval = min(len(ds) - 1, max(1, round(fraction * len(ds)))) if fraction > 0 and len(ds) > 1 else 0
    cut = len(ds) - n_eval
    return ds.select(order[:cut], keep_in_memory=True), ds.select(order[cut:], keep_in_memory=True)
