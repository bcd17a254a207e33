"""The bad-input sweep of `draftsmith train` for the block drafters (DFlash, DSpark): settings out of range, a
key of the other kind, a mask token the target does not have — each refused with one error line, nothing written."""

from __future__ import annotations

import pytest

from tests.bad_input import Case, base_fixture, check_case, registrar  # noqa: F401 - `base` fixture found by name
from tests.train.test_bad_input_train import train

CASES: dict[str, Case] = {}
case = registrar(CASES)


def setting_case(name: str, overrides: dict[str, str], want: str) -> None:
    def build(tmp, base):
        return train(tmp, base, **overrides), rf"override '[^']*': {want}" if not want.startswith("'") else want

    build.__name__ = name
    case(build)


for _name, _over, _want in [
    (
        "dflash_block_size_1",
        {"drafter.kind": "dflash", "drafter.dflash.block_size": "1"},
        r"drafter\.dflash\.block_size=1: must be an integer >= 2 \(the anchor \+ at least 1 masked position\)",
    ),
    (
        "dspark_block_size_1",
        {"drafter.kind": "dspark", "drafter.dspark.block_size": "1"},
        r"drafter\.dspark\.block_size=1: must be an integer >= 2",
    ),
    (
        "dflash_mask_token_negative",
        {"drafter.kind": "dflash", "drafter.dflash.mask_token_id": "-5"},
        r"drafter\.dflash\.mask_token_id=-5: must be an integer >= -1 \(-1 = a learned mask embedding",
    ),
    (
        "dspark_markov_rank_0",
        {"drafter.kind": "dspark", "drafter.dspark.markov_rank": "0"},
        r"drafter\.dspark\.markov_rank=0: must be an integer >= 1",
    ),
    (
        "dflash_gamma_0",
        {"drafter.kind": "dflash", "drafter.dflash.gamma": "0"},
        r"drafter\.dflash\.gamma=0\.0: must be a number > 0\.0",
    ),
    (
        "dspark_draft_vocab_negative",
        {"drafter.kind": "dspark", "drafter.dspark.draft_vocab_size": "-1"},
        r"drafter\.dspark\.draft_vocab_size=-1: must be an integer >= 0 \(0 = the target's whole vocabulary\)",
    ),
    ("dflash_markov_rank_unknown", {"drafter.dflash.markov_rank": "8"}, r"unknown key 'drafter\.dflash\.markov_rank'"),
]:
    setting_case(_name, _over, _want)


@case
def dflash_mask_token_outside_the_vocabulary(tmp, base):
    """A mask token id the target's vocabulary does not have: refused when the drafter is built, naming it."""
    over = {"drafter.kind": "dflash", "drafter.dflash.mask_token_id": "100000"}
    return train(tmp, base, **over), r"mask_token_id 100000 is outside the target's vocabulary 0\.\.\d+; use -1"


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input(name, tmp_path, base, capsys):
    check_case(CASES[name], tmp_path, base, capsys)
