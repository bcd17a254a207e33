"""Loss masks: assistant spans only, from the rendered ChatML template (thinking on/off, multi-turn),
the plain rule without a template, and max-length handling."""

from __future__ import annotations

import datasets
import pytest

from train.data.sources import CANONICAL
from train.data.tokens import end_token_ids, tokenize_chat, tokenize_dataset, tokenize_record

SYSTEM = {"role": "system", "content": "Be brief."}
Q1 = {"role": "user", "content": "Name a prime number."}
Q2 = {"role": "user", "content": "And another one?"}


def spans(tok, ids, mask) -> list[str]:
    """The trained text, one string per contiguous masked run."""
    out, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            out.append(tok.decode(cur))
            cur = []
    if cur:
        out.append(tok.decode(cur))
    return out


def chat(tok, messages, thinking=None):
    ids, mask = tokenize_chat(
        tok, messages, end_token_ids(tok), {} if thinking is None else {"enable_thinking": thinking}
    )
    assert ids == tok.apply_chat_template(
        messages, tokenize=True, return_dict=False, **({} if thinking is None else {"enable_thinking": thinking})
    )
    return ids, mask


def test_single_turn_trains_only_the_answer_and_its_end_token(chatml):
    ids, mask = chat(chatml, [SYSTEM, Q1, {"role": "assistant", "content": "Seven is prime."}], thinking=False)
    # thinking off: the empty think block belongs to the generation prompt, not to the answer
    assert spans(chatml, ids, mask) == ["Seven is prime.<|im_end|>"]
    assert not mask[0]


def test_thinking_on_trains_the_think_block(chatml):
    a = {"role": "assistant", "content": "<think>\nSmall primes: 2, 3.\n</think>\n\nThree."}
    for thinking in (True, None):  # None: the template's default (thinking on for Qwen3)
        ids, mask = chat(chatml, [Q1, a], thinking=thinking)
        assert spans(chatml, ids, mask) == ["<think>\nSmall primes: 2, 3.\n</think>\n\nThree.<|im_end|>"]


def test_multi_turn_history_drops_thinking_and_every_assistant_turn_is_trained(chatml):
    a1 = {"role": "assistant", "content": "<think>\nfirst thoughts\n</think>\n\nTwo."}
    a2 = {"role": "assistant", "content": "<think>\nmore\n</think>\n\nFive."}
    ids, mask = chat(chatml, [SYSTEM, Q1, a1, Q2, a2], thinking=True)
    # Qwen3 renders history turns without their thinking, exactly what the target sees at inference
    assert spans(chatml, ids, mask) == ["Two.<|im_end|>", "<think>\nmore\n</think>\n\nFive.<|im_end|>"]
    ids, mask = chat(
        chatml,
        [SYSTEM, Q1, {"role": "assistant", "content": "Two."}, Q2, {"role": "assistant", "content": "Five."}],
        thinking=False,
    )
    assert spans(chatml, ids, mask) == ["Two.<|im_end|>", "Five.<|im_end|>"]
    text = chatml.decode([i for i, m in zip(ids, mask) if not m])
    assert "Name a prime number." in text and "<|im_start|>assistant\n" in text  # prompts and headers untrained


def test_plain_rule_without_template(stories):
    tok = stories.tokenizer
    rec = {
        "kind": "chat",
        "messages": [
            {"role": "user", "content": "Once upon a time"},
            {"role": "assistant", "content": "there was a cat."},
        ],
        "text": "",
        "input_ids": [],
        "loss_mask": [],
        "origin": "x row 0",
    }
    ids, mask = tokenize_record(rec, tok, {2}, use_template=False, tpl={})
    prompt = tok("Once upon a time")["input_ids"]  # BOS + prompt tokens
    assert ids[: len(prompt)] == prompt and not any(mask[: len(prompt)])
    assert ids[-1] == tok.eos_token_id and all(mask[len(prompt) :])
    assert tok.decode(ids[len(prompt) :], skip_special_tokens=True) == "there was a cat."
    text = dict(rec, kind="text", text="The end.")
    ids, mask = tokenize_record(text, tok, {2}, use_template=False, tpl={})
    assert ids[0] == tok.bos_token_id and mask == [False] + [True] * (len(ids) - 1)


def records(rows: list[dict]) -> datasets.Dataset:
    base = {"kind": "text", "messages": [], "text": "", "input_ids": [], "loss_mask": [], "origin": "t"}
    return datasets.Dataset.from_list([{**base, **r} for r in rows], features=CANONICAL)


def test_max_length_truncate_drop_and_counts(stories):
    tok = stories.tokenizer
    ds = records(
        [
            {"text": "short."},
            {"text": "a much longer text that goes on and on and on and on and on"},
            {"kind": "tokens", "input_ids": [1, 5, 6], "loss_mask": [0, 0, 0]},
        ]
    )
    out, st = tokenize_dataset(ds, tok, 6, "truncate", {2}, True, None)
    assert (st.truncated, st.dropped_long, st.dropped_no_loss, st.sequences) == (1, 0, 1, 2)
    assert max(len(x) for x in out["input_ids"]) == 6
    out, st = tokenize_dataset(ds, tok, 6, "drop", {2}, True, None)
    assert (st.truncated, st.dropped_long, st.sequences) == (0, 1, 1)
    with pytest.raises(ValueError, match=r"no training sequences left: 3 records -> 0 sequences.*dropped 3 too long"):
        tokenize_dataset(ds, tok, 2, "drop", {2}, True, None)


def test_questions_without_answers_need_regeneration(chatml):
    ds = records([{"kind": "chat", "messages": [{"role": "user", "content": "Hi"}], "origin": "q.jsonl row 3"}])
    with pytest.raises(ValueError, match=r"q.jsonl row 3: a conversation with no assistant turn.*regenerate.enabled"):
        tokenize_dataset(ds, chatml, 64, "truncate", {chatml.eos_token_id}, True, None)
