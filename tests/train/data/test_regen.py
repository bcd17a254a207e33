"""Regeneration: batched sampling from the target itself, resumable and reproducible shards, chat turns."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

import train.data.regen as regen
from decode.target import Target
from train.data.regen import regenerate
from train.data.regen_engines import sample
from train.data.sources import DataConfig, RegenConfig, load_records
from train.data.tokens import end_token_ids, tokenize_dataset

REPO = Path(__file__).resolve().parents[3]
STORY_PROMPTS = REPO / "recipes" / "prompts" / "stories_dev.txt"
MT_BENCH = REPO / "recipes" / "data" / "mt_bench_question.jsonl"
CFG = RegenConfig(enabled=True, num_samples=12, max_new_tokens=24, batch_size=5, shard_size=4, stop_ids=[1])


def test_left_padded_batch_equals_one_at_a_time(stories):
    tok = stories.tokenizer
    prompts = [tok(p)["input_ids"] for p in ["Once upon a time", "The dog", "Lily and her mom went to the park"]]
    greedy = dataclasses.replace(CFG, temperature=0.0)
    batched = sample(stories, prompts, greedy, [1, 2], pad_id=0)
    single = [sample(stories, [p], greedy, [1, 2], pad_id=0)[0] for p in prompts]
    assert batched == single and all(len(x) >= 1 for x in batched)


def test_stories_from_bos_resume_to_identical_shards(stories, tmp_path, monkeypatch):
    full = regenerate(stories, None, dataclasses.replace(CFG, out_dir=str(tmp_path / "a")), 0, True, None)
    real, calls = regen.write_jsonl, []

    def crash_on_second(path, rows):
        calls.append(path)
        if len(calls) == 2:
            path.with_name(f".{path.name}.999.tmp").write_text('{"half": ')
            raise KeyboardInterrupt("killed")
        real(path, rows)

    cfg_b = dataclasses.replace(CFG, out_dir=str(tmp_path / "b"))
    monkeypatch.setattr(regen, "write_jsonl", crash_on_second)
    with pytest.raises(KeyboardInterrupt):
        regenerate(stories, None, cfg_b, 0, True, None)
    monkeypatch.setattr(regen, "write_jsonl", real)
    resumed = regenerate(stories, None, cfg_b, 0, True, None)
    names = sorted(p.name for p in full.glob("shard_*.jsonl"))
    assert names == sorted(p.name for p in resumed.glob("shard_*.jsonl")) and len(names) == 3
    for n in names:
        assert (full / n).read_text() == (resumed / n).read_text()
    rows = [json.loads(x) for n in names for x in (full / n).read_text().splitlines()]
    assert len(rows) == 12 and len({tuple(r["input_ids"]) for r in rows}) > 1  # sampled, not all equal
    for r in rows:
        assert r["input_ids"][0] == 1 and r["loss_mask"][0] == 0 and all(r["loss_mask"][1:])
        gen = r["input_ids"][1:]
        assert len(gen) <= 24 and all(t not in (1, 2) for t in gen[:-1])  # stops at (and keeps) its stop token
    # the same directory with other settings is refused, not silently mixed
    with pytest.raises(ValueError, match="different settings"):
        regenerate(stories, None, dataclasses.replace(cfg_b, temperature=0.5), 0, True, None)
    with pytest.raises(ValueError, match="different seed"):
        regenerate(stories, None, cfg_b, 1, True, None)


def test_default_directory_is_keyed_by_target_and_settings(stories, tmp_path, monkeypatch, capsys):
    """No out_dir: DATA_HOME/regen/<target>-<digest>, the same from any working directory, reused there;
    other settings or another target's weights get their own directory (never a collision)."""
    home = tmp_path / "home"
    monkeypatch.setenv("DRAFTSMITH_DATA", str(home))
    cfg = dataclasses.replace(CFG, num_samples=4, max_new_tokens=8)
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
    monkeypatch.chdir(tmp_path / "a")
    first = regenerate(stories, None, cfg, 0, True, None)
    assert first.parent == home / "regen" and first.name.startswith("stories260K-")
    assert "0/1 shards done, sampling the rest" in capsys.readouterr().out
    monkeypatch.chdir(tmp_path / "b")
    assert regenerate(stories, None, cfg, 0, True, None) == first
    assert "reusing all 1 shards (4 sequences)" in capsys.readouterr().out
    other = regenerate(stories, None, dataclasses.replace(cfg, max_new_tokens=6), 0, True, None)
    twin = Target.load(REPO / "recipes/targets/stories260K")
    twin.lm_head.weight.data.add_(0.01)  # another target with the same name
    other_target = regenerate(twin, None, cfg, 0, True, None)
    assert len({first, other, other_target}) == 3 and other_target.name.startswith("stories260K-")
    assert not list(tmp_path.glob("[ab]/*"))  # nothing written to the working directories


def test_prompt_file_with_several_samples(stories, tmp_path):
    recs = load_records(DataConfig(source=str(STORY_PROMPTS), max_records=3))
    cfg = dataclasses.replace(CFG, samples_per_prompt=2, num_samples=0, out_dir=str(tmp_path / "p"))
    out = regenerate(stories, recs, cfg, 0, True, None)
    rows = load_records(DataConfig(source=str(out)))
    assert len(rows) == 6 and rows[0]["kind"] == "tokens"
    tok = stories.tokenizer
    for k, r in enumerate(rows):
        prompt = tok(recs[k // 2]["text"])["input_ids"]
        assert r["input_ids"][: len(prompt)] == prompt and not any(r["loss_mask"][: len(prompt)])
        assert all(r["loss_mask"][len(prompt) :])


def test_chat_questions_get_an_answer_per_turn(chat_target_dir, tmp_path):
    target = Target.load(chat_target_dir)
    recs = load_records(DataConfig(source=str(MT_BENCH), max_records=3))
    cfg = dataclasses.replace(CFG, num_samples=0, max_new_tokens=6, stop_ids=[], out_dir=str(tmp_path / "c"))
    with torch.no_grad():
        out = regenerate(target, recs, cfg, 0, True, False)
    rows = load_records(DataConfig(source=str(out)))
    assert len(rows) == 3 and rows[0]["kind"] == "chat"
    for r, q in zip(rows, recs):
        assert [m["role"] for m in r["messages"]] == ["user", "assistant", "user", "assistant"]
        assert [m["content"] for m in r["messages"][::2]] == [m["content"] for m in q["messages"]]
    tok = target.tokenizer
    seqs, stats = tokenize_dataset(rows, tok, 4096, "truncate", end_token_ids(tok), True, False)
    assert stats.sequences == 3 and stats.loss_tokens > 0
    for ids, mask in zip(seqs["input_ids"], seqs["loss_mask"]):
        ends = [j for j, (t, m) in enumerate(zip(ids, mask)) if m and t == tok.eos_token_id]
        assert len(ends) == 2  # one trained <|im_end|> per assistant turn
