"""scripts/answer_repetition.py's measure: the share of an answer's n-grams that repeat an earlier one."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def load():
    spec = importlib.util.spec_from_file_location("answer_repetition", REPO / "scripts/answer_repetition.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_repeated_share_counts_ngrams_seen_earlier_in_the_same_answer():
    ar = load()
    assert ar.repeated_share([1, 2, 3, 4], 2) == 0.0  # (1,2) (2,3) (3,4): all new
    assert ar.repeated_share([1, 2, 1, 2, 1, 2], 2) == 3 / 5  # (1,2) (2,1) new, then three repeats
    assert ar.repeated_share([7, 7, 7, 7], 1) == 3 / 4
    assert ar.repeated_share([1, 2], 4) == 0.0  # too short for one 4-gram
