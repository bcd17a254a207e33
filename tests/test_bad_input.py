"""The bad-input sweep as a whole (the checks and shared inputs: tests/bad_input.py). Its cases live beside the
tests of what they exercise:

    tests/decode/test_bad_input_decode.py             draftsmith generate: target files, options, tree files
    tests/decode/harness/test_bad_input_evaluate.py   draftsmith evaluate: prompt files, --out
    tests/drafters/test_bad_input_drafters.py         drafter directories; draftsmith export and doctor
    tests/train/test_bad_input_train.py               draftsmith train and features: recipes, data, caches,
                                                      checkpoints, every setting out of its range

Here: the sweep stays wide, counted over all four.
"""

from __future__ import annotations

# Another import of those test modules (pytest imports each under its own file name): only to count their cases.
from tests.decode.harness.test_bad_input_evaluate import CASES as EVALUATE
from tests.decode.harness.test_bad_input_evaluate import FULL_DISK as EVALUATE_FULL_DISK
from tests.decode.test_bad_input_decode import CASES as DECODE
from tests.drafters.test_bad_input_drafters import CASES as DRAFTERS
from tests.drafters.test_bad_input_drafters import FULL_DISK as DRAFTERS_FULL_DISK
from tests.train.test_bad_input_train import CASES as TRAIN

CASES = {**DECODE, **EVALUATE, **DRAFTERS, **TRAIN}
FULL_DISK = {**EVALUATE_FULL_DISK, **DRAFTERS_FULL_DISK}


def test_the_sweep_is_wide():
    assert len(CASES) + len(FULL_DISK) >= 100
