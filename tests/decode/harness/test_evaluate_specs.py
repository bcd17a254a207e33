"""`python -m decode.evaluate`'s drafter SPECs: the forms make_run accepts (and the ones it lists when it
refuses one), the CLI refusing a bad SPEC before it decodes anything, and the HF and draft-model peers decoding
losslessly."""

from __future__ import annotations

import pytest

from decode.harness.evaluate import main, make_run
from decode.harness.runs import EvalConfig
from decode.sampling import SamplingConfig
from tests.conftest import STORIES
from tests.decode.harness.eval_prompts import prompt_file


def test_unknown_spec_lists_valid_forms(stories):
    cfg = EvalConfig()
    with pytest.raises(ValueError) as e:
        make_run("medusa-ish:3", stories, cfg)
    for form in ("early-exit:K", "skip:i,j,...", "draft-model:DIR", "hf-assisted:early-exit:K", "hf-prompt-lookup"):
        assert form in str(e.value)
    with pytest.raises(ValueError, match="hf-assisted:draft-model:DIR"):
        make_run("hf-assisted:lookahead", stories, cfg)
    with pytest.raises(ValueError, match=r"1\.\.4"):
        make_run("hf-assisted:early-exit:5", stories, cfg)


def test_cli_bad_spec_fails_before_running(tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(
        [
            "--target",
            str(STORIES),
            "--prompts",
            str(prompt_file(tmp_path)),
            "--drafter",
            "early-exit:2",
            "--drafter",
            "bogus",
            "--out",
            str(out),
        ]
    )
    assert rc == 2 and not out.exists()
    assert "unknown drafter SPEC 'bogus'" in capsys.readouterr().err


def test_hf_prompt_lookup_peer_is_lossless(stories):
    ids = stories.tokenizer("Sam had a red ball. Sam had a red ball. Sam", return_tensors="pt").input_ids[0]
    peer = make_run("hf-prompt-lookup:ngram=2,k=4", stories, EvalConfig())
    ar = make_run("ar", stories, EvalConfig())
    got = peer.run(ids, 16, SamplingConfig(), 0)
    ref = ar.run(ids, 16, SamplingConfig(), 0)
    assert got.tokens == ref.tokens
    assert got.stats.target_passes < ref.stats.target_passes and got.stats.drafter_passes == 0


def test_draft_model_peers_match_early_exit(stories, tmp_path):
    """A separate draft model = the target's first 2 layers (saved truncated) drafts what early-exit:2 drafts."""
    from decode.loading import load_model

    model = load_model(STORIES)
    model.model.layers = model.model.layers[:2]
    model.config.num_hidden_layers = 2
    model.save_pretrained(tmp_path)
    stories.tokenizer.save_pretrained(tmp_path)
    ids = stories.tokenizer("Sam had a red ball.", return_tensors="pt").input_ids[0]
    cfg, greedy = EvalConfig(draft_len=3), SamplingConfig()
    ref = make_run("early-exit:2", stories, cfg).run(ids, 16, greedy, 0)
    assert ref.tokens == make_run("ar", stories, cfg).run(ids, 16, greedy, 0).tokens
    for spec, saved in ((f"draft-model:{tmp_path}", 0), (f"hf-assisted:draft-model:{tmp_path}", 1)):
        got = make_run(spec, stories, cfg).run(ids, 16, greedy, 0)
        assert got.tokens == ref.tokens, spec
        # HF may save one pass: it drafts before its prefill
        assert ref.stats.target_passes - saved <= got.stats.target_passes <= ref.stats.target_passes, spec
        assert got.stats.drafter_passes > 0, spec
