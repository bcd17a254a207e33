"""Sources and record formats through `datasets`, and the bad-input errors."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest
import torch

from train.data.sources import DataConfig, RecordError, load_records

REPO = Path(__file__).resolve().parents[3]
MT_BENCH = REPO / "recipes" / "data" / "mt_bench_question.jsonl"
SPEC_BENCH = REPO / "recipes" / "data" / "spec_bench_question.jsonl"


def jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


CHAT = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}]
SHAREGPT = [{"id": "x", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}]
PAIRS = [{"prompt": "hi", "response": "hello"}]


def test_formats_normalise_to_the_same_conversation(tmp_path):
    want = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    for name, rows in [("chat", CHAT), ("sharegpt", SHAREGPT), ("pairs", PAIRS)]:
        ds = load_records(DataConfig(source=jsonl(tmp_path / f"{name}.jsonl", rows)))
        assert ds[0]["kind"] == "chat" and ds[0]["messages"] == want, name
    # the same pairs as parquet, csv, a save_to_disk directory, and a directory of jsonl shards
    datasets.Dataset.from_list(PAIRS).to_parquet(str(tmp_path / "p.parquet"))
    datasets.Dataset.from_list(PAIRS).to_csv(str(tmp_path / "p.csv"), index=False)
    datasets.Dataset.from_list(PAIRS).save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "shards").mkdir()
    jsonl(tmp_path / "shards" / "a.jsonl", PAIRS)
    jsonl(tmp_path / "shards" / "b.jsonl", PAIRS)
    (tmp_path / "shards" / "_manifest.json").write_text("{}")  # "_" files are not data
    for src in ["p.parquet", "p.csv", "saved", "shards"]:
        ds = load_records(DataConfig(source=str(tmp_path / src)))
        assert [r["messages"] for r in ds] == [want] * (2 if src == "shards" else 1), src


def test_text_questions_tokens_and_several_sources(tmp_path):
    (tmp_path / "stories.txt").write_text("Once upon a time\nThe cat sat\n")
    toks = jsonl(tmp_path / "t.jsonl", [{"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}, {"input_ids": [4, 5]}])
    ds = load_records(DataConfig(source=[str(tmp_path / "stories.txt"), str(MT_BENCH), toks]))
    assert len(ds) == 2 + 80 + 2
    assert ds[0]["kind"] == "text" and ds[1]["text"] == "The cat sat"
    q = ds[2]
    assert q["kind"] == "chat" and [m["role"] for m in q["messages"]] == ["user", "user"]  # MT-bench: 2 turns
    assert ds[82]["input_ids"] == [1, 2, 3] and ds[83]["loss_mask"] == [1, 1]
    assert len(load_records(DataConfig(source=str(SPEC_BENCH), max_records=10))) == 10


def test_missing_field_names_file_row_and_field(tmp_path):
    bad = jsonl(
        tmp_path / "bad.jsonl", CHAT + [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant"}]}]
    )
    with pytest.raises(RecordError, match=r"bad.jsonl row 1, messages\[1\]: missing field 'content'"):
        load_records(DataConfig(source=bad))
    bad = jsonl(tmp_path / "bad2.jsonl", [{"prompt": "a", "response": "b"}, {"prompt": None, "response": "c"}])
    with pytest.raises(RecordError, match="bad2.jsonl row 1: missing field 'prompt'"):
        load_records(DataConfig(source=bad))
    bad = jsonl(tmp_path / "bad3.jsonl", [{"conversations": [{"from": "alien", "value": "x"}]}])
    with pytest.raises(RecordError, match=r"bad3.jsonl row 0, conversations\[0\]: unknown speaker 'alien'"):
        load_records(DataConfig(source=bad))


def test_unusable_sources_fail_clearly(tmp_path):
    with pytest.raises(ValueError, match="cannot tell the record format from columns"):
        load_records(DataConfig(source=jsonl(tmp_path / "odd.jsonl", [{"question": "x"}])))
    with pytest.raises(FileNotFoundError, match="data source not found"):
        load_records(DataConfig(source=str(tmp_path / "missing.jsonl")))
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="empty file"):
        load_records(DataConfig(source=str(tmp_path / "empty.jsonl")))
    with pytest.raises(FileNotFoundError, match=r"cannot load hub dataset 'someone/chats'.*offline.*local file"):
        load_records(DataConfig(source="someone/chats"))


def test_a_cache_with_the_argmax_in_some_shards_only_collates_and_packs_without_it():
    """Shards extracted before the argmax was stored lack it: a batch or a packed row mixing both leaves it out
    (the losses then score it from hidden[L]); a batch of items that all have it keeps it, padded with 0."""
    from train.batch import collate
    from train.dataset import Packed

    def item(n: int, argmax: bool) -> dict:
        it = {
            "input_ids": torch.arange(n),
            "loss_mask": torch.ones(n, dtype=torch.bool),
            "hidden": {2: torch.randn(n, 4)},
        }
        return {**it, "argmax": torch.arange(n) + 7} if argmax else it

    assert "argmax" not in collate([item(3, True), item(2, False)])
    both = collate([item(3, True), item(2, True)])
    assert both["argmax"].tolist() == [[7, 8, 9], [7, 8, 0]]

    class Base:
        def __init__(self, items):
            self.items = items

        def __getitem__(self, i):
            return self.items[i]

        def lengths(self):
            return [it["input_ids"].numel() for it in self.items]

    row = Packed(Base([item(3, True), item(2, False)]), pack_length=8, seed=0)[0]
    assert "argmax" not in row and row["input_ids"].numel() == 5
