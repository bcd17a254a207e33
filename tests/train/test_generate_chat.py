"""`python -m decode.generate --prompt` renders the user's message with the target's chat template (as
decode.harness.evaluate does for every turn); `--raw` encodes the text as it is."""

from __future__ import annotations

import decode.generate as g


def test_prompt_is_a_chat_turn_unless_raw(chat_target_dir, chatml, monkeypatch, capsys):
    seen = []
    real = g.generate

    def spy(target, drafter, ids, *a, **kw):
        seen.append(ids.tolist())
        return real(target, drafter, ids, *a, **kw)

    monkeypatch.setattr(g, "generate", spy)
    base = ["--target", str(chat_target_dir), "--prompt", "What is a dog?", "--max-new-tokens", "4"]
    assert g.main(base) == 0
    templated = chatml.apply_chat_template(
        [{"role": "user", "content": "What is a dog?"}], tokenize=False, add_generation_prompt=True
    )
    assert seen[0] == chatml(templated, add_special_tokens=False).input_ids
    assert "<|im_start|>" in templated and capsys.readouterr().out.startswith("What is a dog?\n")
    assert g.main([*base, "--raw"]) == 0
    assert seen[1] == chatml("What is a dog?").input_ids
