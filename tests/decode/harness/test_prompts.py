"""Prompt files: the three formats, their errors (with line numbers), and turn rendering."""

from __future__ import annotations

import json

import pytest

from decode.harness.prompts import DEFAULT_CATEGORY, PromptFileError, answer_text, load_prompts, render_turn
from tests.conftest import DEV_PROMPTS, STORIES


def write(tmp_path, name: str, lines: list[str]):
    p = tmp_path / name
    p.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return p


def test_plain_text_one_prompt_a_line_blank_lines_skipped(tmp_path):
    p = write(tmp_path, "p.txt", ["Once upon a time", "", "  The sun was out.  "])
    convs = load_prompts(p)
    assert [c.turns for c in convs] == [("Once upon a time",), ("The sun was out.",)]
    assert [c.id for c in convs] == ["1", "3"]  # ids are the line numbers
    assert {c.category for c in convs} == {DEFAULT_CATEGORY}


def test_bundled_dev_prompts_and_limit():
    assert len(load_prompts(DEV_PROMPTS)) == 20
    assert len(load_prompts(DEV_PROMPTS, limit=3)) == 3


def test_spec_bench_jsonl(tmp_path):
    rows = [
        {"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Now shorter."]},
        {"question_id": 7, "category": "qa", "turns": ["Why?"], "reference": ["x"]},
    ]
    convs = load_prompts(write(tmp_path, "q.jsonl", [json.dumps(r) for r in rows]))
    assert [(c.id, c.category, c.turns) for c in convs] == [
        ("81", "writing", ("Write a poem.", "Now shorter.")),
        ("7", "qa", ("Why?",)),
    ]


def test_prompt_jsonl(tmp_path):
    convs = load_prompts(write(tmp_path, "p.jsonl", ['{"prompt": "Hello"}', '{"prompt": "Bye", "category": "c"}']))
    assert [(c.id, c.category, c.turns) for c in convs] == [("1", DEFAULT_CATEGORY, ("Hello",)), ("2", "c", ("Bye",))]


@pytest.mark.parametrize(
    "lines, lineno, words",
    [
        (['{"prompt": "a"}', "", '{"prompt": "b"'], 3, "not valid JSON"),
        (['{"prompt": "a"}', '{"text": "b"}'], 2, "needs 'turns'"),
        (['{"turns": []}'], 1, "non-empty list"),
        (['{"turns": ["a", 3]}'], 1, "non-empty list"),
        (['{"prompt": ""}'], 1, "non-empty string"),
        (['{"prompt": "a"}', "[1, 2]"], 2, "expected a JSON object"),  # a jsonl file stays jsonl
        (['{"prompt": "a", "category": 5}'], 1, "'category'"),
    ],
)
def test_malformed_jsonl_names_the_line(tmp_path, lines, lineno, words):
    p = write(tmp_path, "bad.jsonl", lines)
    with pytest.raises(PromptFileError) as e:
        load_prompts(p)
    assert f"{p}:{lineno}:" in str(e.value) and words in str(e.value)


def test_empty_or_missing_file(tmp_path):
    for lines in ([], ["", "   "]):
        with pytest.raises(PromptFileError, match="no prompts"):
            load_prompts(write(tmp_path, "empty.txt", lines))
    with pytest.raises(PromptFileError, match="not found"):
        load_prompts(tmp_path / "nope.txt")


@pytest.fixture(scope="module")
def tokenizer():
    from decode.loading import load_tokenizer

    return load_tokenizer(STORIES)


def test_raw_text_without_chat_template(tokenizer):
    assert not tokenizer.chat_template  # the bundled story target has none
    assert render_turn(tokenizer, ("Tell a story.",), []) == ("Tell a story.", True)
    text, special = render_turn(tokenizer, ("Q1", "Q2"), ["A1"])
    assert (text, special) == ("Q1\nA1\nQ2", True)


def test_chat_template_turn_by_turn_with_own_answers(tokenizer):
    tok = type(tokenizer).from_pretrained(STORIES)
    tok.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    first, special = render_turn(tok, ("Q1", "Q2"), [])
    assert (first, special) == ("<user>Q1</user><assistant>", False)  # the template holds the special tokens
    second, _ = render_turn(tok, ("Q1", "Q2"), ["my answer"])
    assert second == "<user>Q1</user><assistant>my answer</assistant><user>Q2</user><assistant>"
    with pytest.raises(ValueError, match="turn 2"):
        render_turn(tok, ("Q1", "Q2"), ["a", "b"])


def test_answer_text_drops_special_tokens(tokenizer):
    ids = tokenizer("Lily went home.").input_ids + [tokenizer.eos_token_id]
    assert answer_text(tokenizer, ids) == "Lily went home."
