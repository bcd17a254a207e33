"""The prompt file the evaluate tests decode: three conversations of two categories, one with two turns."""

from __future__ import annotations

import json
from pathlib import Path


def prompt_file(tmp_path: Path) -> Path:
    rows = [
        {"question_id": 1, "category": "park", "turns": ["One day, a boy named Tim went to the park."]},
        {"question_id": 2, "category": "home", "turns": ["Sam had a red ball.", "Then his dog came."]},
        {"question_id": 3, "category": "park", "turns": ["The sun was shining and the birds were singing."]},
    ]
    p = tmp_path / "prompts.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p
