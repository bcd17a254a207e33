"""A run on `fetch:` data records the source as written, not the path it resolved to on this machine: a shipped
drafter's config.json and a run's config.yaml name `fetch:sharegpt`, so they rerun on any machine."""

from __future__ import annotations

import json

import yaml

from train.__main__ import main
from train.data.wheels import STAMP

SHAREGPT_SHA = "99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772"  # the pinned wheel's member


def fake_fetched_sharegpt(home):
    """A finished `draftsmith fetch sharegpt` under DRAFTSMITH_DATA=home, with six short conversations."""
    out = home / "sharegpt"
    out.mkdir(parents=True)
    stamp = {"source_sha256": SHAREGPT_SHA, "records_decoded": 6, "conversations": 6, "dropped": {}}
    (out / STAMP).write_text(json.dumps({**stamp, "first_turns": 6, "first_turns_dropped": {}}))
    rows = [
        {"id": str(i), "conversations": [{"from": "human", "value": f"hi {i}"}, {"from": "gpt", "value": "a b c d"}]}
        for i in range(6)
    ]
    (out / "sharegpt.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out / "first_turns.jsonl").write_text(
        "".join(json.dumps(r | {"conversations": r["conversations"][:1]}) + "\n" for r in rows)
    )


def test_run_records_the_fetch_name_not_the_resolved_path(chat_target_dir, tmp_path, monkeypatch):
    fake_fetched_sharegpt(tmp_path / "data")
    monkeypatch.setenv("DRAFTSMITH_DATA", str(tmp_path / "data"))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"target: {chat_target_dir}\n")
    run_dir = tmp_path / "run"
    overrides = [
        "data.source=fetch:sharegpt",
        "data.held_out=0.2",
        "features.mode=online",
        "drafter.kind=medusa",
        f"run_dir={run_dir}",
        "train.steps=1",
        "train.batch_size=2",
        "train.eval_every=0",
        "train.save_every=0",
        "train.report_to=none",
        "train.threads=1",
        "train.sim_eval_prompts=0",
    ]
    assert main([str(recipe), *overrides]) == 0
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["data"]["source"] == "fetch:sharegpt"
    meta = json.loads((run_dir / "export" / "config.json").read_text())
    assert meta["recipe"]["data"]["source"] == "fetch:sharegpt"
