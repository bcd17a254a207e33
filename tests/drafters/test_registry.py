"""SPEC strings: valid forms build drafters, bad ones fail with errors that say what to do."""

from __future__ import annotations

import shutil

import pytest

from drafters.registry import make_drafter
from tests.conftest import STORIES, tiny_model


def test_valid_specs(stories):
    assert make_drafter("ar", stories).name == "ar"
    assert make_drafter("early-exit:2", stories).name == "early-exit:2"
    assert make_drafter("skip:3,1", stories).name == "skip:1,3"


def test_unknown_spec_lists_valid_forms(stories):
    with pytest.raises(ValueError, match="valid forms") as e:
        make_drafter("medusa-magic", stories)
    assert "early-exit:K" in str(e.value) and "prompt-lookup" in str(e.value)


@pytest.mark.parametrize(
    "spec,msg",
    [
        ("early-exit:5", "1..4"),
        ("early-exit:0", "1..4"),
        ("early-exit:x", "integers"),
        ("skip:7", "0..4"),
        ("skip:0,1,2,3,4", "every layer"),
        ("skip:", "0..4"),
    ],
)
def test_out_of_range_layers(stories, spec, msg):
    with pytest.raises(ValueError, match=msg):
        make_drafter(spec, stories)


def test_draft_model_with_other_tokenizer_is_refused(stories, tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    d = tmp_path / "draft"
    tiny_model("llama", vocab=512, layers=1).save_pretrained(d)
    vocab = {f"w{i}": i for i in range(512)}
    PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="w0")), bos_token="w1", eos_token="w2"
    ).save_pretrained(d)
    with pytest.raises(ValueError, match="tokenizer differs"):
        make_drafter(f"draft-model:{d}", stories)


def test_draft_model_with_other_vocab_size_is_refused(stories, tmp_path):
    d = tmp_path / "draft"
    tiny_model("llama", vocab=128, layers=1).save_pretrained(d)
    with pytest.raises(ValueError, match="vocab size 128"):
        make_drafter(f"draft-model:{d}", stories)


def test_draft_model_missing_dir(stories, tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        make_drafter(f"draft-model:{tmp_path / 'nope'}", stories)


def test_draft_model_same_tokenizer_is_accepted(stories, tmp_path):
    d = tmp_path / "copy"
    shutil.copytree(STORIES, d)
    assert make_drafter(f"draft-model:{d}", stories).name.startswith("draft-model:")
